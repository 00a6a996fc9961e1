"""Shards moved from one node's arena into another's in place (``pull_transport``
"nixl", issue 30): the holder lends the extents of the shards a pull asks for, pinned
and verified, and the pulling node reads them straight into extents of its own arena
granted for them, then verifies and keeps them as the Evictor's replicas. Neither side
copies: the transport reads one arena into the other.

:class:`ArenaLoans` keeps both sides' books for one node; it has no Ray and moves no
bytes (:mod:`tierstore.store.nixl_pulls` does). Its holder is the
NodeStore's own lock on the arena (:class:`~tierstore.data.arena.holders.HolderLock`):
pins and grants under it are the NodeStore's, and end with it.

- Lent extents stay pinned until the transport says the pulling node let go of them
  (:meth:`end_loan`): one deleted meanwhile leaves the tier at once, and its bytes are
  reused after.
- A read that failed or outlived its deadline may still be landing: its extents are
  held back (:meth:`quarantine`) and go back to the arena only after
  ``quarantine_s`` (:meth:`release_due`), never to another shard before.

Threads: any (the arena tier locks its books); :meth:`keep` reads the bytes outside
every lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from tierstore.data.checksum import digest
from tierstore.data.tiers.arena import ArenaTier
from tierstore.errors import TierFullError
from tierstore.keys import ShardId
from tierstore.store.node_store import NodeStoreCore
from tierstore.store.replicas import Landed
from tierstore.wire import ShardMeta

__all__ = ["ArenaLoans"]

logger = logging.getLogger(__name__)


class ArenaLoans:
    """One node's lent extents and extents granted to its own pulls."""

    def __init__(self, core: NodeStoreCore, tier: ArenaTier, holder: str, quarantine_s: float):
        self._core = core
        self._tier = tier
        self._holder = holder
        self._quarantine_s = quarantine_s
        self._lock = threading.Lock()
        self._quarantined: list[tuple[float, list[int]]] = []  # (release time, offsets)

    # ---- the holder's side ------------------------------------------------------------------
    def lend(self, shard_ids: Sequence[ShardId]) -> list[tuple[int, ShardMeta]]:
        """Each shard's extent (offset, meta), pinned and verified, for another node to
        read in place until :meth:`end_loan`. Raises ChunkNotFoundError (nothing pinned)
        if one is not in memory, ChunkCorruptError (nothing left pinned; the bad copy
        dropped and reported) if one fails its checksum."""
        lent = self._tier.pin(self._holder, list(shard_ids))
        try:
            for shard_id in shard_ids:
                self._core.verified(shard_id)
        except BaseException:
            self.end_loan([offset for offset, _ in lent])
            raise
        nbytes = sum(meta.nbytes for _, meta in lent)
        self._core.counters.add(loaded_shards=len(lent), loaded_bytes=nbytes)
        return lent

    def end_loan(self, offsets: Sequence[int]) -> None:
        """The pulling node is done with these extents (or its time is up)."""
        self._tier.unpin(self._holder, list(offsets))

    # ---- the pulling node's side --------------------------------------------------------------
    def reserve(self, metas: Sequence[ShardMeta]) -> list[int]:
        """An extent of this node's arena for each shard, to read it into. Raises
        TierFullError (nothing kept) if one does not fit; they are its replicas' room,
        which the Evictor reserved, so this is rare (a fragmented arena)."""
        offsets = self._tier.grant(self._holder, [meta.nbytes for meta in metas], alive=True)
        granted = [offset for offset in offsets if offset is not None]
        if len(granted) < len(offsets):
            self._tier.give_back(self._holder, granted)
            raise TierFullError(
                f"no arena room to pull {len(offsets)} shards into "
                f"({len(offsets) - len(granted)} did not fit)"
            )
        return granted

    def keep(self, shards: Sequence[tuple[ShardId, ShardMeta]], offsets: Sequence[int]) -> Landed:
        """Keep each shard read into its reserved extent if it verifies and fits the
        tier; give back the rest. Returns which were kept, for the Evictor to hear
        (:meth:`NodeStoreCore.report_replicas`)."""
        done: list[ShardId] = []
        failed: list[ShardId] = []
        for (shard_id, meta), offset in zip(shards, offsets, strict=True):
            if digest(self._tier.region.view(offset, meta.nbytes)) != meta.digest:
                self._core.counters.add(corrupt_on_store=1)
                self._tier.give_back(self._holder, [offset])
                failed.append(shard_id)
            elif self._tier.adopt(self._holder, shard_id, meta, offset):
                self._core.counters.add(replicas_received=1)
                done.append(shard_id)
            else:
                logger.warning("no CPU room for replica %s", shard_id.key.hex())
                failed.append(shard_id)
        return Landed(done, failed)

    def quarantine(self, offsets: Sequence[int]) -> None:
        """Extents a read that failed or timed out may still write: given back to the
        arena only after ``quarantine_s``."""
        with self._lock:
            self._quarantined.append((time.monotonic() + self._quarantine_s, list(offsets)))

    def release_due(self) -> int:
        """Give back the quarantined extents whose time has come; returns how many."""
        now = time.monotonic()
        with self._lock:
            due = [offsets for until, offsets in self._quarantined if until <= now]
            self._quarantined = [(u, o) for u, o in self._quarantined if u > now]
        for offsets in due:
            self._tier.give_back(self._holder, offsets)
        return sum(len(offsets) for offsets in due)

    def status(self) -> dict[str, int]:
        with self._lock:
            return {"quarantined_extents": sum(len(o) for _, o in self._quarantined)}
