"""CPU tier in the node's shared arena: each shard is an extent, its data a view of it.

Shards enter three ways, none with a copy the caller did not ask for:
- :meth:`adopt`: a worker of the node gathered the shard straight into an extent it was
  granted (:meth:`grant`) and hashed it as it copied; the tier keeps it with that
  digest without reading the bytes again (one hash per store): every reader verifies
  (a same-node load, the NodeStore's load, a disk write's later read).
- :meth:`fill`: the tier allocates an extent and the caller writes it (a disk promotion
  ``readinto``, a replica received).
- :meth:`put`: a :class:`StoredShard` from elsewhere, copied in (the cross-node path).

Loads of the same node :meth:`pin` extents: an extent deleted while pinned leaves the
tier at once (the Evictor's accounting) but its bytes are reused only once the last pin
is gone (:meth:`unpin`) or its holder is dead (:meth:`reclaim_dead`). Extents granted to
a worker that died are reclaimed the same way.

Thread-safe: one lock guards the shard map, the allocator's use and the books; digests
and copies run outside it. ``capacity_bytes`` bounds shard bytes (the Evictor's model);
the arena itself is larger by the room granted extents and pins need.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from typing_extensions import override

from tierstore.data.arena.allocator import DEFAULT_ALIGN, ExtentAllocator
from tierstore.data.arena.directory import arena_tables
from tierstore.data.arena.holders import Holdings
from tierstore.data.arena.region import ArenaRegion, RegionInfo
from tierstore.data.tiers.base import ShardMeta, StoredShard, Tier
from tierstore.errors import ChunkNotFoundError, TierFullError
from tierstore.keys import ShardId

logger = logging.getLogger(__name__)


class ArenaTier(Tier):
    name = "CPU"
    copies_on_put = True

    def __init__(
        self, region: ArenaRegion, capacity_bytes: int, align: int = DEFAULT_ALIGN
    ) -> None:
        super().__init__(capacity_bytes)
        self.region = region
        # Bumped as each extent is freed, and where each shard is: same-node loads, of
        # any worker on the node, read committed extents unpinned.
        self.generations, self.directory = arena_tables(region.array, align)
        self.extents_bytes = self.directory.extents_bytes  # the arena before its tables
        self.allocator = ExtentAllocator(self.extents_bytes, align, on_free=self.generations.bump)
        self.holdings = Holdings(region.info.path)
        # -> (offset, meta, extent bytes): an adopted extent may be bigger than its shard
        self._shards: dict[ShardId, tuple[int, ShardMeta, int]] = {}
        self._doomed: dict[int, int] = {}  # deleted while pinned: offset -> bytes
        self._readers = 0  # NodeStore threads inside reading()
        self._deferred: list[tuple[int, int]] = []  # deleted while read: freed after
        self._lock = threading.RLock()
        self.refused_grants = 0  # extents asked for that the arena had no room for

    @property
    def info(self) -> RegionInfo:
        return self.region.info

    # ---- Tier ------------------------------------------------------------------------------
    @override
    def put(self, shard_id: ShardId, shard: StoredShard) -> None:
        if shard.data.nbytes != shard.meta.nbytes:
            raise ValueError(
                f"shard data has {shard.data.nbytes} bytes, its metadata says {shard.meta.nbytes}"
            )
        self.fill(shard_id, shard.meta, lambda out: np.copyto(out, shard.data.reshape(-1)))

    @override
    def get(self, shard_id: ShardId) -> StoredShard:
        shard = self.find(shard_id)
        if shard is None:
            raise ChunkNotFoundError(f"shard not in CPU tier: {shard_id!r}")
        return shard

    @override
    def find(self, shard_id: ShardId) -> StoredShard | None:
        """A view of the shard's extent: use it inside :meth:`reading` (or on the thread
        that deletes shards), since a deleted shard's extent is reused."""
        with self._lock:
            entry = self._shards.get(shard_id)
        if entry is None:
            return None
        offset, meta, _ = entry
        return StoredShard(meta, self.region.view(offset, meta.nbytes))

    @override
    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._lock:
            self._readers += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers -= 1
                if not self._readers:
                    for offset, nbytes in self._deferred:
                        self.allocator.free(offset, nbytes)
                    self._deferred.clear()

    @override
    def delete(self, shard_id: ShardId) -> int:
        with self._lock:
            entry = self._shards.pop(shard_id, None)
            if entry is None:
                return 0
            offset, meta, extent = entry
            self._used_bytes -= meta.nbytes
            if offset in self.holdings.pin_count:
                self._doomed[offset] = extent  # freed by the last unpin
            else:
                self._release(offset, extent)
            return meta.nbytes

    @override
    def __contains__(self, shard_id: object) -> bool:
        with self._lock:
            return shard_id in self._shards

    @override
    def items(self) -> Iterator[tuple[ShardId, ShardMeta]]:
        with self._lock:
            held = [(shard_id, meta) for shard_id, (_, meta, _) in self._shards.items()]
        yield from held

    @override
    def __len__(self) -> int:
        with self._lock:
            return len(self._shards)

    # ---- shards written in place ------------------------------------------------------------
    def fill(self, shard_id: ShardId, meta: ShardMeta, write: Callable[[np.ndarray], None]) -> None:
        """Hold a shard whose bytes ``write`` puts into its extent (called outside the
        lock; if it raises, the extent is freed and the error propagates)."""
        with self._lock:
            if shard_id in self._shards:
                return
            self._check_room(meta.nbytes)
            offset = self._allocate(meta.nbytes)
            self._used_bytes += meta.nbytes  # reserved while being written
        try:
            write(self.region.view(offset, meta.nbytes))
        except BaseException:
            with self._lock:
                self._used_bytes -= meta.nbytes
                self.allocator.free(offset, meta.nbytes)
            raise
        with self._lock:
            if shard_id in self._shards:  # a concurrent fill of the same shard won
                self._used_bytes -= meta.nbytes
                self.allocator.free(offset, meta.nbytes)
                return
            self._hold(shard_id, offset, meta, meta.nbytes)

    def _hold(self, shard_id: ShardId, offset: int, meta: ShardMeta, extent: int) -> None:
        """Lock held: the shard is in the extent at ``offset`` (``extent`` bytes), and the
        directory says so to the node's workers."""
        self._shards[shard_id] = (offset, meta, extent)
        self._record(shard_id, offset, meta)

    def _record(self, shard_id: ShardId, offset: int, meta: ShardMeta) -> None:
        """Lock held: the directory entry, with the extent's generation while held."""
        self.directory.record(shard_id, offset, meta, *self.generations.read([offset]))

    def _allocate(self, nbytes: int) -> int:
        offset = self.allocator.allocate(nbytes)
        if offset is None:
            raise TierFullError(
                f"CPU arena: no free extent of {nbytes} bytes ({self.allocator.free_bytes} "
                f"free, largest hole {self.allocator.largest_hole})"
            )
        return offset

    # ---- grants: extents workers fill ------------------------------------------------------
    def grant(self, holder: str, sizes: list[int], alive: bool = False) -> list[int | None]:
        """Extents for ``holder`` to gather shards into, one per size (None: no room).
        Raises PermissionError if ``holder`` holds no live lock: its grants could leak.
        ``alive``: the holder just handed extents over, so its lock is not probed again
        (three syscalls per call; a holder that died since is swept as any other)."""
        if not alive:
            self.holdings.check_alive(holder)
        out: list[int | None] = []
        with self._lock:
            for nbytes in sizes:
                offset = self.allocator.allocate(nbytes)
                if offset is None:
                    self.refused_grants += 1
                else:
                    self.holdings.grant(holder, offset, nbytes)
                out.append(offset)
        return out

    def grant_room(self, holder: str) -> Callable[[int], int | None]:
        """What a commit of ``holder``'s may claim, as ``room_at(offset)``: the bytes of
        its grant at ``offset`` (within the arena's extents), None if it holds none
        there. A snapshot: checked again as each extent is adopted."""
        with self._lock:
            grants = dict(self.holdings.granted.get(holder, {}))
        end = self.allocator.capacity

        def room_at(offset: int) -> int | None:
            granted = grants.get(offset)
            return None if granted is None else min(granted, end - offset)

        return room_at

    def adopt(self, holder: str, shard_id: ShardId, meta: ShardMeta, offset: int) -> bool:
        """Keep the shard ``holder`` wrote into its granted extent at ``offset``, with the
        digest it computed, if there is room; the extent is no longer granted either way
        (it is the shard's, or free). Returns whether the tier now holds the shard."""
        with self._lock:
            granted = self.holdings.take_grant(holder, offset)
        if granted is None:
            raise ValueError(f"extent {offset} is not granted to {holder} (shard {shard_id!r})")
        if meta.nbytes > granted:
            self._free(offset, granted)
            raise ValueError(f"shard {shard_id!r}: {meta.nbytes} bytes in a {granted}-byte extent")
        with self._lock:
            if shard_id in self._shards or meta.nbytes > self.free_bytes:
                held = shard_id in self._shards
                self.allocator.free(offset, granted)
                return held
            self._hold(shard_id, offset, meta, granted)
            self._used_bytes += meta.nbytes
            return True

    def give_back(self, holder: str, offsets: list[int]) -> None:
        """Granted extents ``holder`` will not fill."""
        for offset in offsets:
            with self._lock:
                nbytes = self.holdings.take_grant(holder, offset)
            if nbytes is not None:
                self._free(offset, nbytes)

    def _free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self.allocator.free(offset, nbytes)

    # ---- pins: same-node loads read extents in place ---------------------------------------
    def pin(self, holder: str, shard_ids: list[ShardId]) -> list[tuple[int, ShardMeta]]:
        """Each shard's (offset, meta), pinned until ``holder`` unpins it or dies.
        Raises ChunkNotFoundError (nothing pinned) if one is not held."""
        self.holdings.check_alive(holder)
        with self._lock:
            missing = [s for s in shard_ids if s not in self._shards]
            if missing:
                raise ChunkNotFoundError(f"shard not in CPU tier: {missing[0]!r}")
            found = [self._shards[s][:2] for s in shard_ids]
            for shard_id, (offset, meta) in zip(shard_ids, found, strict=True):
                self.holdings.pin(holder, offset)
                # Again: another shard may have taken its directory slot since.
                self._record(shard_id, offset, meta)
        return found

    def unpin(self, holder: str, offsets: list[int]) -> None:
        with self._lock:
            for offset in offsets:
                if self.holdings.unpin(holder, offset):
                    self._free_if_doomed(offset)

    def _free_if_doomed(self, offset: int) -> None:
        nbytes = self._doomed.pop(offset, None)
        if nbytes is not None:
            self._release(offset, nbytes)

    def _release(self, offset: int, nbytes: int) -> None:
        """Lock held: a deleted shard's extent, free once no NodeStore read may use it."""
        if self._readers:
            self._deferred.append((offset, nbytes))
        else:
            self.allocator.free(offset, nbytes)

    def reclaim_dead(self) -> int:
        """Grants and pins of holders whose process died; returns the extents freed."""
        freed = 0
        for holder in self.holdings.dead_holders():
            with self._lock:
                grants, unpinned = self.holdings.drop_holder(holder)
                for offset, nbytes in grants.items():
                    self.allocator.free(offset, nbytes)
                for offset in unpinned:
                    freed += offset in self._doomed
                    self._free_if_doomed(offset)
            freed += len(grants)
            if grants or unpinned:
                logger.warning(
                    "holder %s died: %d granted extents and %d pins reclaimed",
                    holder,
                    len(grants),
                    len(unpinned),
                )
        return freed

    def status(self) -> dict[str, int]:
        with self._lock:
            return {
                "arena_bytes": self.region.nbytes,
                "arena_free_bytes": self.allocator.free_bytes,
                "arena_largest_hole": self.allocator.largest_hole,
                "granted_bytes": self.holdings.granted_bytes(),
                "pinned_extents": len(self.holdings.pin_count),
                "refused_grants": self.refused_grants,
            }

    def close(self) -> None:
        self.region.close()
