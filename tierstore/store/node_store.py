"""NodeStore: one per node; owns that node's CPU and disk tiers and the bytes in them.

:class:`NodeStoreCore` holds all of the logic and no Ray; the actor
(``tierstore.actors.node_store_actor``) is a thin shell around it. Shards arrive as one
buffer per job (an ObjectRef the worker put); the core copies each admitted shard out of
it into memory this process owns, so the producing worker may exit without taking a
byte with it (ray-notes: a held ObjectRef dies with its owner). What to keep, demote,
promote or drop is the Evictor's decision; the core carries it out and reports what
failed. Replica pushes and receipts are a part it owns
(:class:`~tierstore.store.replicas.ReplicaTransfers`).

Threads (the actor's concurrency groups): ``load`` runs on several data threads at once;
``store``, ``apply``, ``accept_replicas`` and ``register_inventory`` on one control
thread; ``inventory``/``status`` on a third; a store's write-through on a thread of its
own (``defer``), so the next store never waits behind the last one's disk writes. The
tiers lock their own indexes (never across a payload read or write), the counters
(:class:`~tierstore.store.stats.StoreCounters`) lock themselves, and no lock is ever
held across an Evictor or peer call, so a load never waits on either. Every change of
a shard's disk copy (write-through, demotion, a store demoted on admission, drop) holds
the core's disk lock, so a write-through and the Evictor's decisions never interleave
on one shard: a shard dropped while its write-through waited is not written after. A
load copies out of a shard array that is never written after it is stored: a concurrent
drop only removes the tier's reference, and a dropped disk file fails the read cleanly.

A failed disk write (a full or failing filesystem) costs only the disk copy: the shard
stays in memory, the Evictor learns it has no disk copy, and the disk tier is degraded
(no write tried) until a retry (:mod:`tierstore.store.disk_health`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

import numpy as np

from tierstore.data.checksum import digest
from tierstore.data.tiers.base import StoredShard, Tier
from tierstore.data.tiers.disk import DiskTier
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierFullError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName, shard_of
from tierstore.store.disk_health import DiskHealth, os_error_of
from tierstore.store.evictor_shards import ShardedEvictorPort
from tierstore.store.ports import EvictorPort, PeerPort
from tierstore.store.replicas import Landed, ReplicaTransfers
from tierstore.store.stats import NodeStoreStats, StoreCounters, tier_status
from tierstore.wire import (
    MalformedField,
    NodeActions,
    RefusedCommit,
    ShardEntry,
    ShardMeta,
    ShardOffer,
    buffer_room,
    check_job,
    check_origin,
    per_shard,
    units_of,
)

__all__ = ["EvictorPort", "NodeStoreCore", "NodeStoreStats", "PeerPort", "StoreCounters"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Deadlines of the Evictor's answers a NodeStore waits on. The Evictor answers in
# milliseconds; these bound a store while it is stuck or restarting (the worker's own
# transfer deadline is what fails the job). A restore offers a node's whole inventory.
ADMIT_TIMEOUT_S = 30.0
RESTORE_TIMEOUT_S = 120.0
# Roots of shards this node let go of lately (dropped, lost, found corrupt), so that a
# report about one, sent right after, still reaches the Evictor shard that indexes it
# (root_of) rather than every shard. Each report follows its loss within one call.
RECENT_ROOTS = 4096


class Promotion(Enum):
    """What became of a promotion, as reported to the Evictor (in this order)."""

    DONE = "done"
    FAILED = "failed"  # missing or corrupt: the unit is dropped
    REFUSED = "refused"  # no extent free: the disk copy stays, read from there


@dataclass
class NodeStoreCore:
    node_id: NodeId
    cpu: Tier  # the node's shared arena in the actor (ArenaTier)
    disk: DiskTier | None
    evictor: EvictorPort
    # Writes shards through to disk later (the actor: on its write-through thread, after
    # the store is acknowledged, so it never delays a store); default: right away.
    defer: Callable[[list[ShardId]], None] | None = None
    peers: PeerPort | None = None  # None: replicas cannot be pushed (reported failed)
    # Shared with the parts that count (replica transfers, the actor's ArenaStore).
    counters: StoreCounters = field(default_factory=StoreCounters)
    # Held by every change of a shard's disk copy, one shard at a time; never across an
    # Evictor or peer call.
    _disk_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    # The disk tier's state after a failed write (tierstore.store.disk_health), on this
    # clock (tests move it); what the Evictor last heard of it (see _report_disk).
    clock: Callable[[], float] = time.monotonic
    _disk_health: DiskHealth | None = field(default=None, init=False, repr=False)
    _reported_failures: int = field(default=0, init=False, repr=False)
    _reported_writable: bool = field(default=True, init=False, repr=False)
    _report_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _replicas: ReplicaTransfers = field(init=False, repr=False)
    _gone_roots: OrderedDict[ShardId, int] = field(default_factory=OrderedDict, repr=False)
    _gone_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.defer is None:
            self.defer = self.write_through
        if self.disk is not None:  # corrupt files found (and removed) while re-indexing
            self.counters.add(corrupt_before_hit=self.disk.corrupt_chunks_removed)
            self._disk_health = DiskHealth(self.disk.root, self.clock)
        self._replicas = ReplicaTransfers(
            node_id=self.node_id,
            cpu=self.cpu,
            disk=self.disk,
            evictor=self.evictor,
            peers=self.peers,
            counters=self.counters,
            drop=self.drop,
        )

    # ---- start-up ----------------------------------------------------------------------
    def register_inventory(
        self, after_evictor_restart: bool = False, shard: int | None = None
    ) -> int:
        """Offer what this node holds to the Evictor; drop what it refuses. Returns the
        copies it accepted.

        ``after_evictor_restart``: HITs granted by the lost index may still be loading,
        so the Evictor keeps these chunks leased for a while. ``shard``: offer only the
        copies whose root maps to that Evictor shard (one that restarted: the others
        hear nothing); None: every copy, each to its own shard. Offering a shard a copy
        it already indexes for this node changes nothing there (accepted again).
        """
        held = [
            (_offer(shard_id, meta), TierName.DISK)
            for shard_id, meta in (self.disk.items() if self.disk else [])
        ] + [(_offer(shard_id, meta), TierName.CPU) for shard_id, meta in self.cpu.items()]
        if shard is not None:
            shards = self.evictor.shards if isinstance(self.evictor, ShardedEvictorPort) else 1
            held = [h for h in held if shard_of(h[0].root, shards) == shard]
        with self._report_lock:
            self._reported_writable = True  # what registering told the Evictor
        if not held:
            self._report_disk([])
            return 0
        reply = self.evictor.restore(self.node_id, held, after_evictor_restart)
        accepted, actions = reply.result(RESTORE_TIMEOUT_S)
        self.apply(actions)  # reports a degraded disk tier too
        return sum(accepted)

    # ---- stores ------------------------------------------------------------------------
    def store(
        self,
        namespace: Namespace,
        rank: int,
        world_size: int,
        entries: list[ShardEntry],
        buffer: np.ndarray,
    ) -> int:
        """Keep what the Evictor admits; returns the number of shards now held.

        Control thread. Blocks on the Evictor's ``admit`` (its deadline) with no lock
        held, so loads go on meanwhile. A malformed entry (see
        :func:`tierstore.wire.check_job`) refuses the job: RefusedCommit, nothing changed."""
        try:
            namespace, rank, world_size = check_origin(namespace, rank, world_size)
            entries = check_job(entries, buffer_room(buffer))
        except MalformedField as exc:
            raise self.refused(exc) from None
        accepted, to_disk, persist = self.admit(namespace, rank, world_size, entries)
        kept = 0
        lost: list[ShardId] = []
        for entry, ok in zip(entries, accepted, strict=True):
            if not ok:
                self.counters.add(skipped_shards=1)
                continue
            shard_id = ShardId(namespace, entry.key, rank)
            data = buffer[entry.offset : entry.offset + entry.nbytes]
            if not self.cpu.copies_on_put:  # it would keep a view of the worker's buffer
                data = np.array(data, copy=True)
            if digest(data) != entry.digest:
                self.counters.add(corrupt_on_store=1)
                logger.error("shard %s arrived corrupt; not stored", entry.key.hex())
                self.note_root(shard_id, entry.root)
                lost.append(shard_id)
                continue
            meta = ShardMeta(
                entry.nbytes, entry.digest, entry.slot_mask, world_size, entry.parent, entry.root
            )
            if not self.hold(shard_id, StoredShard(meta, data), shard_id in to_disk):
                self.note_root(shard_id, entry.root)
                lost.append(shard_id)
                continue
            kept += 1
            self.counters.add(stored_shards=1, stored_bytes=entry.nbytes)
        self.settle_store(lost, persist)
        return kept

    def refused(self, error: MalformedField, what: str = "store job") -> RefusedCommit:
        """Count and log a store job refused for ``error``; the error its worker gets."""
        self.counters.add(refused_commits=1)
        logger.warning("refused a %s: %s", what, error)
        return RefusedCommit(f"{what} refused by node {self.node_id}: {error}")

    def admit(
        self, namespace: Namespace, rank: int, world_size: int, entries: list[ShardEntry]
    ) -> tuple[list[bool], set[ShardId], list[ShardId]]:
        """The Evictor's admission of one rank's batch (:meth:`admit_offers`)."""
        return self.admit_offers(
            [
                ShardOffer(namespace, e.key, rank, world_size, e.nbytes, e.parent, e.root)
                for e in entries
            ]
        )

    def admit_offers(
        self, offers: list[ShardOffer]
    ) -> tuple[list[bool], set[ShardId], list[ShardId]]:
        """The Evictor's admission of a batch (of any ranks), its room made now: one offer
        per token boundary (every rank's and KV cache group's shard there), one decision
        each. Returns which shards are accepted, those of them to write straight to disk
        (demoted on admission: a prompt larger than the CPU tier), and the write-through
        to queue once they are held."""
        self._report_disk([])  # a degraded disk tier's retry falls due: writes planned again
        units = units_of(offers)
        answers, own = self.evictor.admit_units(self.node_id, units).result(ADMIT_TIMEOUT_S)
        accepted = per_shard(offers, units, answers)
        batch = {
            ShardId(o.namespace, o.key, o.rank)
            for o, ok in zip(offers, accepted, strict=True)
            if ok
        }
        to_disk = {s for s in own.demote if s in batch}
        # Room first; the write-through copies only once the shards are in memory.
        demote = [s for s in own.demote if s not in to_disk]
        self.apply(NodeActions(drop=own.drop, demote=demote, promote=own.promote))
        return accepted, to_disk, list(own.persist)

    def root_of(self, shard_id: ShardId) -> int | None:
        """The prefix tree root of this node's copy of ``shard_id`` (memory first, then
        disk), None if it holds none: which Evictor shard indexes it
        (:class:`~tierstore.store.evictor_shards.ShardedEvictorPort` routes reports by
        it). Any thread."""
        shard = self.cpu.find(shard_id)
        if shard is not None:
            return shard.meta.root
        if self.disk is not None and shard_id in self.disk:
            try:
                return self.disk.meta(shard_id).root
            except ChunkNotFoundError:
                pass  # dropped meanwhile
        with self._gone_lock:
            return self._gone_roots.get(shard_id)

    def note_root(self, shard_id: ShardId, root: int | None) -> None:
        """``shard_id`` is let go of (or was never kept), and its root was ``root``: for
        :meth:`root_of` a while after (the last :data:`RECENT_ROOTS`). Any thread."""
        if root is None:
            return
        with self._gone_lock:
            self._gone_roots[shard_id] = root
            self._gone_roots.move_to_end(shard_id)
            while len(self._gone_roots) > RECENT_ROOTS:
                self._gone_roots.popitem(last=False)

    def holds(self, shard_id: ShardId) -> bool:
        """Whether this node holds a copy of ``shard_id`` (memory or disk); any thread."""
        return shard_id in self.cpu or (self.disk is not None and shard_id in self.disk)

    def settle_store(self, lost: list[ShardId], persist: list[ShardId]) -> None:
        """After a store: forget what was admitted but not kept; queue the write-through."""
        if lost:
            self.evictor.forget_shards(self.node_id, lost)
        self._report_disk([])
        if persist:
            assert self.defer is not None
            self.defer(persist)

    def hold(self, shard_id: ShardId, shard: StoredShard, to_disk: bool) -> bool:
        """Hold an admitted shard in memory, or ``to_disk`` (demoted on admission): written
        in the store call, since the CPU tier has no room to hold it until later (not
        kept if that write fails or the disk tier is degraded)."""
        try:
            if to_disk and self.disk is not None:
                with self._disk_lock:
                    written = self._disk_put(shard_id, lambda: shard)
                if not written:
                    self.counters.add(skipped_shards=1)
                    return False
                self.counters.add(demoted_shards=1)
            else:
                self.cpu.put(shard_id, shard)
        except (TierFullError, ValueError):
            tier = "disk" if to_disk else "CPU"
            logger.warning("%s tier refused admitted %s", tier, shard_id.key.hex(), exc_info=True)
            self.counters.add(skipped_shards=1)
            return False
        return True

    # ---- the Evictor's decisions ---------------------------------------------------------
    def apply(self, actions: NodeActions) -> None:
        """Drop, demote, promote, persist, push: each step makes the room the next one needs.

        Control thread; disk writes and reads happen here, outside every lock."""
        self.drop(actions.drop)
        lost = [s for s in actions.demote if not self._demote(s)]
        outcomes: dict[Promotion, list[ShardId]] = {p: [] for p in Promotion}
        for shard_id in actions.promote:
            outcomes[self._promote(shard_id)].append(shard_id)
        gone, unwritten = self._persist(actions.persist)
        lost += gone
        if lost:
            self.evictor.forget_shards(self.node_id, lost)
        if any(outcomes.values()):
            done, failed, refused = (outcomes[p] for p in Promotion)
            self.evictor.promoted(self.node_id, done, failed, refused)
        self._report_disk(unwritten)
        self._replicas.push(actions.push)

    def accept_replicas(
        self, shards: list[tuple[ShardId, ShardMeta]], views: list[np.ndarray]
    ) -> None:
        """Keep replica shards another node pushed, verified; the Evictor hears which
        (one-way). The control thread."""
        self.report_replicas(self.keep_replicas(shards, views))

    def keep_replicas(
        self, shards: list[tuple[ShardId, ShardMeta]], views: list[np.ndarray]
    ) -> Landed:
        """Keep replica shards another node sent, verified (:meth:`ReplicaTransfers.accept`);
        the caller tells the Evictor which (:meth:`report_replicas`). The control thread
        (:meth:`accept_replicas`) or a pull thread (:mod:`tierstore.store.pulls`): the
        tiers and counters it uses are thread-safe, but it is not ordered with ``apply``
        or a re-registration."""
        return self._replicas.accept(shards, views)

    def report_replicas(self, landed: Landed) -> None:
        """Tell the Evictor which replica shards this node kept, which not (one-way)."""
        self._replicas.report(landed)

    def write_through(self, shard_ids: list[ShardId]) -> None:
        """Copy stored shards to disk; their memory copies stay. The actor's
        write-through thread (``defer``). A shard no longer in memory (dropped or demoted
        meanwhile) is not written again, and the Evictor forgets one it still counts on.
        One whose write fails or is skipped (the disk tier degraded) costs only its disk
        copy: it stays in memory, and the Evictor learns it has none on disk."""
        gone, unwritten = self._persist(shard_ids)
        if gone:
            self.evictor.forget_shards(self.node_id, gone)
        self._report_disk(unwritten)

    def drop(self, shard_ids: list[ShardId]) -> int:
        freed = 0
        for shard_id in shard_ids:
            with self._disk_lock:
                self.note_root(shard_id, self.root_of(shard_id))
                freed += self.cpu.delete(shard_id)
                if self.disk is not None:
                    freed += self.disk.delete(shard_id)
            self.counters.add(dropped_shards=1)
        return freed

    def _disk_put(self, shard_id: ShardId, shard: Callable[[], StoredShard]) -> bool:
        """Write ``shard()`` to the disk tier (disk lock held). False if it is not
        written: skipped while the tier is degraded, or failed (counted; an OS error, such
        as ENOSPC, EDQUOT or EIO, degrades the tier until its retry)."""
        assert self.disk is not None and self._disk_health is not None
        if not self._disk_health.writable():
            self.counters.add(disk_writes_skipped=1)
            return False
        try:
            self.disk.put(shard_id, shard())
        except (TierFullError, ValueError, OSError) as exc:
            self.counters.add(disk_write_failures=1)
            error = os_error_of(exc)
            if error is None:  # the tier refused it (no room it knows of, a bad name)
                logger.warning("writing %s to disk failed", shard_id.key.hex(), exc_info=True)
            else:
                self._disk_health.failed(error)  # logged once per degraded period
            return False
        self._disk_health.succeeded()
        return True

    def _write_to_disk(self, shard_id: ShardId) -> bool:
        """Copy a memory shard to disk (once; disk lock held); False if it is not on disk
        after: not in memory, or not written (see _disk_put)."""
        if self.disk is None:
            return False
        if shard_id in self.disk:
            return True
        try:
            with self.cpu.reading():  # its extent is not reused while it is written
                return self._disk_put(shard_id, lambda: self.cpu.get(shard_id))
        except ChunkNotFoundError:
            return False  # not in memory (a load may have just dropped it as corrupt)

    def _demote(self, shard_id: ShardId) -> bool:
        """Free the memory copy; written first if it is not on disk yet. If that write
        fails or is refused (the disk tier degraded), the shard is dropped instead: the
        policy chose to evict it, and the caller tells the Evictor (forget_shards), which
        drops its unit knowingly rather than count on a disk copy that is not there."""
        with self._disk_lock:
            root = self.root_of(shard_id)
            written = self._write_to_disk(shard_id)
            held = self.cpu.delete(shard_id) > 0
        if not written:
            self.note_root(shard_id, root)
        if written:
            self.counters.add(demoted_shards=1)
        elif held:
            self.counters.add(failed_demotions=1)
        return written

    def _persist(self, shard_ids: Iterable[ShardId]) -> tuple[list[ShardId], list[ShardId]]:
        """Write-through: copy memory shards to disk, the memory copies stay. Returns the
        shards no longer in memory (dropped meanwhile) and those kept in memory only
        (written nowhere else: their write failed or was skipped)."""
        gone: list[ShardId] = []
        unwritten: list[ShardId] = []
        for shard_id in shard_ids:
            with self._disk_lock:
                if self._write_to_disk(shard_id):
                    continue
                in_memory = shard_id in self.cpu
            (unwritten if in_memory else gone).append(shard_id)
        return gone, unwritten

    def _report_disk(self, unwritten: list[ShardId]) -> None:
        """Tell the Evictor (one-way) what went wrong with disk writes since the last
        report: shards kept in memory only, writes failed, and whether the disk tier takes
        writes (False while degraded; True again once its retry is due, so the Evictor
        plans writes and the first one is the retry). Sends nothing when all is well."""
        if self._disk_health is None:
            return
        # Held across the one-way send (never waited on; loads never take it), so two
        # threads' reports of the tier's state reach the Evictor in the order read.
        with self._report_lock:
            writable = self._disk_health.writable()
            total = self.counters.value("disk_write_failures")
            failures = total - self._reported_failures
            self._reported_failures = total
            if unwritten or failures or writable != self._reported_writable:
                self._reported_writable = writable
                self.evictor.report_disk_writes(self.node_id, unwritten, failures, writable)

    def _promote(self, shard_id: ShardId) -> Promotion:
        """Disk -> CPU, verified: a corrupt or truncated file becomes a miss, never a HIT;
        one the CPU tier has no extent for stays on disk, and is read from there."""
        if shard_id in self.cpu:
            return Promotion.DONE
        if self.disk is None:
            return Promotion.FAILED
        disk = self.disk

        def read(out: np.ndarray) -> None:
            disk.read_into(shard_id, out)

        try:
            meta = disk.meta(shard_id)
        except ChunkNotFoundError:
            return Promotion.FAILED
        try:  # read straight into the CPU tier's extent, verified there; the disk copy
            # stays, so a later demotion is free
            self.cpu.fill(shard_id, meta, read)
        except ChunkNotFoundError:
            self.note_root(shard_id, meta.root)
            return Promotion.FAILED
        except ChunkCorruptError:
            self.note_root(shard_id, meta.root)
            logger.warning(
                "corrupt chunk file for %s removed; it will be recomputed",
                shard_id.key.hex(),
                exc_info=True,
            )
            self.counters.add(corrupt_before_hit=1)
            return Promotion.FAILED
        except TierFullError as exc:
            logger.info("%s stays on disk: %s", shard_id.key.hex(), exc)
            self.counters.add(refused_promotions=1)
            return Promotion.REFUSED
        self.counters.add(promoted_shards=1)
        return Promotion.DONE

    # ---- loads -------------------------------------------------------------------------
    def load(
        self, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> tuple[np.ndarray, list[ShardMeta]]:
        """The shards of ``keys``, back to back in one new buffer, each verified first."""
        return self.load_views(namespace, rank, keys, _concatenate)

    def load_views(
        self,
        namespace: Namespace,
        rank: int,
        keys: list[ChunkKey],
        put: Callable[[list[np.ndarray]], T],
    ) -> tuple[T, list[ShardMeta]]:
        """``put`` of the shards of ``keys`` (views of their extents, in key order), each
        verified first, and their metas. ``put`` runs while no extent it sees can be
        reused, and must copy out what it keeps (the actor: one ``ray.put``).

        Data threads, several at once. Waits on no other call and holds no lock while
        ``put`` copies; a shard dropped meanwhile raises ChunkNotFoundError or, if its disk
        file vanished under the read, ChunkCorruptError: never other bytes."""
        return self.load_shard_views([ShardId(namespace, key, rank) for key in keys], put)

    def load_shard_views(
        self, shard_ids: list[ShardId], put: Callable[[list[np.ndarray]], T]
    ) -> tuple[T, list[ShardMeta]]:
        """As :meth:`load_views`, for shards of any namespaces and ranks (another node
        pulling its copies of a request's chunks held here: one call for them all)."""
        with self.cpu.reading():  # no extent read here is reused until put returns
            shards = [self.verified(shard_id) for shard_id in shard_ids]
            out = put([s.data for s in shards])
        nbytes = sum(s.meta.nbytes for s in shards)
        self.counters.add(loaded_shards=len(shards), loaded_bytes=nbytes)
        return out, [s.meta for s in shards]

    def verified(self, shard_id: ShardId) -> StoredShard:
        """The held shard (its memory copy, else its disk copy read), verified: one that
        fails its checksum is dropped, reported to the Evictor and raised as
        ChunkCorruptError; ChunkNotFoundError if neither tier holds it. A memory copy is a
        view of its extent: read it inside ``cpu.reading()`` or under a pin."""
        shard = self.cpu.find(shard_id)
        if shard is not None:
            if digest(shard.data) != shard.meta.digest:
                # The bytes changed in memory after the HIT was promised: fail the load.
                self.counters.add(corrupt_after_hit=1)
                self.note_root(shard_id, shard.meta.root)
                self.cpu.delete(shard_id)
                self.evictor.report_corrupt_after_hit(self.node_id, [shard_id])
                raise ChunkCorruptError(
                    f"node {self.node_id}: chunk {shard_id.key.hex()} rank {shard_id.rank} "
                    "failed its checksum in memory"
                )
            return shard
        # A HIT from disk (no CPU room to promote it), or a promotion not done yet: the
        # lease keeps the file, and the read verifies it.
        if self.disk is not None and shard_id in self.disk:
            root = self.disk.meta(shard_id).root  # ChunkNotFoundError if dropped meanwhile
            try:
                return self.disk.get(shard_id)
            except ChunkCorruptError:
                self.counters.add(corrupt_after_hit=1)
                self.note_root(shard_id, root)
                self.evictor.report_corrupt_after_hit(self.node_id, [shard_id])
                raise
        raise ChunkNotFoundError(
            f"node {self.node_id}: chunk {shard_id.key.hex()} rank {shard_id.rank} is not held"
        )

    # ---- introspection -------------------------------------------------------------------
    def inventory(self) -> set[tuple[ShardId, TierName]]:
        """Every copy this node holds."""
        held = {(s, TierName.CPU) for s, _ in self.cpu.items()}
        if self.disk is not None:
            held |= {(s, TierName.DISK) for s, _ in self.disk.items()}
        return held

    def status(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "cpu": tier_status(self.cpu),
            "disk": {**tier_status(self.disk), **self._disk_state()},
            "stats": self.counters.snapshot(),
        }

    def _disk_state(self) -> dict[str, object]:
        """Whether the disk tier is degraded (and why, since when, the retry)."""
        return self._disk_health.status() if self._disk_health else {"degraded": False}


def _offer(shard_id: ShardId, meta: ShardMeta) -> ShardOffer:
    parent = None if meta.parent is None else ChunkKey(meta.parent)
    return ShardOffer(
        shard_id.namespace,
        shard_id.key,
        shard_id.rank,
        meta.world_size,
        meta.nbytes,
        parent,
        meta.root,
    )


def _concatenate(views: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(views) if views else np.empty(0, dtype=np.uint8)
