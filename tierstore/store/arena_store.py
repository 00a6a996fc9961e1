"""The NodeStore's arena calls: grants to the node's workers, commits, pins for loads.

The arena tier (:class:`~tierstore.data.tiers.arena.ArenaTier`) holds the bytes; this
adds what needs the rest of the NodeStore: the Evictor's admission of committed shards
(a TP group's ranks gathered first, :mod:`tierstore.store.rank_gather`, so each token
boundary is one offer), promotion from disk before a pin, stats. Every call names the
arena ``epoch`` the worker mapped: a worker still mapping a replaced arena (its
NodeStore restarted) is told the current one and granted, adopted or pinned nothing.

Called on the NodeStore's threads; the tier has its own lock.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tierstore.data.tiers.arena import ArenaTier
from tierstore.data.tiers.base import StoredShard
from tierstore.errors import TierStoreError
from tierstore.fields import holder_id
from tierstore.keys import ChunkKey, Namespace, ShardId
from tierstore.store.rank_gather import Committed, RankGather
from tierstore.wire import (
    MalformedField,
    RegionInfo,
    ShardEntry,
    ShardMeta,
    check_job,
    check_origin,
    job_lists,
)

if TYPE_CHECKING:
    from tierstore.store.node_store import NodeStoreCore

logger = logging.getLogger(__name__)

# A commit sweeps dead holders at most this often (a grant call always does): each
# sweep probes every holder's lock, and commits come once per store.
_SWEEP_EVERY_S = 1.0


class StaleArenaError(TierStoreError):
    """The caller mapped an arena this NodeStore no longer has."""


class ArenaStore:
    """The arena calls of one NodeStore, over its core's public calls (``admit``,
    ``hold``, ``settle_store``, ``refused``); counted in the core's
    :class:`~tierstore.store.stats.StoreCounters`, so ``status`` shows one set."""

    def __init__(
        self, core: NodeStoreCore, tier: ArenaTier, gather: RankGather | None = None
    ) -> None:
        self._core = core
        self._counters = core.counters  # the core's: one status for the node
        self.tier = tier
        self._next_sweep = 0.0
        # A TP group's ranks' commits, gathered so each boundary is offered once.
        self._gather = gather if gather is not None else RankGather()

    @property
    def epoch(self) -> str:
        return self.tier.info.epoch

    def info(self) -> tuple[RegionInfo, int]:
        """The arena, and its room beyond the CPU tier's capacity (for workers' pools)."""
        return self.tier.info, self.tier.extents_bytes - self.tier.capacity_bytes

    def grant(self, holder: str, epoch: str, sizes: list[int]) -> tuple[str, list[int | None]]:
        """Extents for ``holder`` (None where the arena is full), and the current epoch."""
        if epoch != self.epoch:
            return self.epoch, [None] * len(sizes)
        self.tier.reclaim_dead()
        return self.epoch, self.tier.grant(holder, sizes)

    def commit(
        self,
        holder: str,
        epoch: str,
        namespace: Namespace,
        rank: int,
        world_size: int,
        jobs: list[list[ShardEntry]],
    ) -> tuple[int, str, list[int | None], list[tuple[int, str]]]:
        """Adopt what the Evictor admits of ``holder``'s filled extents (verified, no
        copy); the rest go back to the arena. ``jobs``: the entries of each of the
        worker's store jobs, in order.

        Every entry is checked first (:func:`tierstore.wire.check_job`): a job with a
        malformed one is refused whole, counted and logged, and nothing is changed for
        it (its extents stay granted: the worker gives them back); the other jobs go on.
        A malformed call (holder, namespace, rank, the list of jobs) raises
        RefusedCommit, nothing changed. Entries of a TP group (``world_size`` > 1) may
        wait for the other ranks' commits (:class:`RankGather`) and are admitted with
        theirs. Returns (shards held now, this call's or gathered ones; current epoch;
        fresh extents granted to ``holder`` in their place: one per entry, in order, None
        where the arena is full or the job was refused, so a worker's pool refills with
        no call of its own; the refused jobs: (index, why))."""
        core = self._core
        try:
            holder = holder_id("holder", holder)
            namespace, rank, world_size = check_origin(namespace, rank, world_size)
            lists = job_lists(jobs)
        except MalformedField as exc:
            raise core.refused(exc, "commit") from None
        sizes = [len(job) for job in lists]
        if epoch != self.epoch:
            return 0, self.epoch, [None] * sum(sizes), []
        checked = self._check_jobs(holder, lists)
        good = [e for job in checked if not isinstance(job, MalformedField) for e in job]
        self._gather.add([Committed(holder, namespace, rank, world_size, e) for e in good])
        ready = self._gather.take(core.holds)
        kept = self._keep(ready, frozenset((holder, e.offset) for e in good)) if ready else 0
        refused = [
            (i, str(core.refused(job, f"commit of job {i} from {holder}")))
            for i, job in enumerate(checked)
            if isinstance(job, MalformedField)
        ]
        fresh = iter(self._regrant(holder, [e.nbytes for e in good]))
        granted = [
            None if isinstance(job, MalformedField) else next(fresh)
            for job, n in zip(checked, sizes, strict=True)
            for _ in range(n)
        ]
        return kept, self.epoch, granted, refused

    def _check_jobs(
        self, holder: str, jobs: list[list[object]]
    ) -> list[list[ShardEntry] | MalformedField]:
        """Each job's entries checked, or why it is refused: each in an extent granted to
        ``holder`` and claimed by no earlier job of the call."""
        granted = self.tier.grant_room(holder)
        claimed: set[int] = set()

        def room_at(offset: int) -> int | None:
            return None if offset in claimed else granted(offset)

        checked: list[list[ShardEntry] | MalformedField] = []
        for i, entries in enumerate(jobs):
            try:
                job = check_job(entries, room_at, f"job[{i}]")
            except MalformedField as exc:
                checked.append(exc)
            else:
                checked.append(job)
                claimed.update(e.offset for e in job)
        return checked

    def _keep(
        self, items: list[Committed], calling: frozenset[tuple[str, int]] = frozenset()
    ) -> int:
        """Checked entries, of any ranks (a TP group's, gathered): adopt (or write to
        disk) what the Evictor admits, give the rest back to their workers; returns the
        shards held. If the admission fails, the error is raised and the entries are
        parked again, but the calling commit's own (``calling``: holder and offset): its
        worker gives those extents back, or the actor retries the commit with them."""
        core = self._core
        try:
            accepted, to_disk, persist = core.admit_offers([item.offer for item in items])
        except BaseException:
            self._gather.put_back([i for i in items if (i.holder, i.entry.offset) not in calling])
            raise
        kept = 0
        lost: list[ShardId] = []
        for item, ok in zip(items, accepted, strict=True):
            entry, shard_id = item.entry, item.shard_id
            meta = ShardMeta(
                entry.nbytes,
                entry.digest,
                entry.slot_mask,
                item.world_size,
                entry.parent,
                entry.root,
            )
            if not ok:
                self._counters.add(skipped_shards=1)
                self.tier.give_back(item.holder, [entry.offset])
                continue
            if shard_id in to_disk:  # demoted on admission: straight from the extent to disk
                held = self._to_disk(item.holder, shard_id, meta, entry.offset)
            else:
                held = self._adopt(item.holder, shard_id, meta, entry.offset)
            if not held:
                core.note_root(shard_id, entry.root)
                lost.append(shard_id)
                continue
            kept += 1
            self._counters.add(stored_shards=1, stored_bytes=entry.nbytes)
        core.settle_store(lost, persist)
        return kept

    def flush_gathered(self) -> int:
        """Offer the gathered units that are complete or waited long enough (see
        :class:`RankGather`), as a commit would: for when no commit comes (the last
        request before a pause, a rank whose shards went through the object store).
        Control thread; returns the shards held now."""
        ready = self._gather.take(self._core.holds)
        return self._keep(ready) if ready else 0

    @property
    def gathered(self) -> int:
        """Shards parked waiting for their TP group's other ranks."""
        return len(self._gather)

    def _regrant(self, holder: str, sizes: list[int]) -> list[int | None]:
        """Fresh extents for a holder that just committed (so it is alive); what dead
        holders left is swept first, at most every :data:`_SWEEP_EVERY_S`: with commits
        bringing extents, a worker that stores steadily makes no grant call that would."""
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_EVERY_S
            self.tier.reclaim_dead()
        return self.tier.grant(holder, sizes, alive=True)

    def _to_disk(self, holder: str, shard_id: ShardId, meta: ShardMeta, offset: int) -> bool:
        """Write a committed extent to the disk tier, then free it (the file keeps the
        worker's digest; reading it back verifies)."""
        view = self.tier.region.view(offset, meta.nbytes)
        try:
            return self._core.hold(shard_id, StoredShard(meta, view), to_disk=True)
        finally:
            self.tier.give_back(holder, [offset])

    def _adopt(self, holder: str, shard_id: ShardId, meta: ShardMeta, offset: int) -> bool:
        try:
            held = self.tier.adopt(holder, shard_id, meta, offset)
        except ValueError:
            logger.warning("bad commit from %s", holder, exc_info=True)
            return False
        if not held:
            self._counters.add(skipped_shards=1)
        return held

    def give_back(self, holder: str, epoch: str, offsets: list[int]) -> None:
        if epoch == self.epoch:
            self.tier.give_back(holder, offsets)

    def pin(
        self, holder: str, epoch: str, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> list[tuple[int, ShardMeta]]:
        """Each shard's extent and metadata, pinned for ``holder``. Raises
        ChunkNotFoundError if one is not in memory (only on disk: the worker loads it
        through the object store, as the Evictor has not promoted it)."""
        if epoch != self.epoch:
            raise StaleArenaError(f"arena {epoch} was replaced by {self.epoch}")
        pins = self.tier.pin(holder, [ShardId(namespace, key, rank) for key in keys])
        self._counters.add(
            loaded_shards=len(pins), loaded_bytes=sum(meta.nbytes for _, meta in pins)
        )
        return pins

    def unpin(self, holder: str, epoch: str, offsets: list[int]) -> None:
        if epoch == self.epoch:
            self.tier.unpin(holder, offsets)

    def loaded(self, epoch: str, shards: int, nbytes: int) -> None:
        """A worker read shards of this arena without pinning them (their extents'
        generations held): counted as the loads they are."""
        if epoch == self.epoch:
            self._counters.add(loaded_shards=shards, loaded_bytes=nbytes)

    def reclaim_dead(self) -> int:
        return self.tier.reclaim_dead()
