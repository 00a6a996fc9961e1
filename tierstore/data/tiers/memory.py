"""CPU tier: shard bytes held as numpy arrays in the NodeStore's own heap.

The Ray object store is only transport (it spills silently at 80 % full), so the bound
is enforced here, on bytes this process owns: a vLLM worker that exits takes nothing
with it.

Thread-safe: one lock guards the dict and the byte count (the NodeStore loads on
several threads while its control thread stores and drops). A shard's array is never
written after ``put``, so a reader copies it without the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from typing_extensions import override

from tierstore.data.tiers.base import ShardMeta, StoredShard, Tier
from tierstore.errors import ChunkNotFoundError
from tierstore.keys import ShardId


class MemoryTier(Tier):
    name = "CPU"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._shards: dict[ShardId, StoredShard] = {}
        self._lock = threading.Lock()

    @override
    def put(self, shard_id: ShardId, shard: StoredShard) -> None:
        if shard.data.nbytes != shard.meta.nbytes:
            raise ValueError(
                f"shard data has {shard.data.nbytes} bytes, its metadata says {shard.meta.nbytes}"
            )
        with self._lock:
            if shard_id in self._shards:
                return
            self._check_room(shard.meta.nbytes)
            self._shards[shard_id] = shard
            self._used_bytes += shard.meta.nbytes

    @override
    def get(self, shard_id: ShardId) -> StoredShard:
        shard = self.find(shard_id)
        if shard is None:
            raise ChunkNotFoundError(f"shard not in CPU tier: {shard_id!r}")
        return shard

    def find(self, shard_id: ShardId) -> StoredShard | None:
        """The shard, or None: one look-up, so no drop can slip in between two."""
        with self._lock:
            return self._shards.get(shard_id)

    @override
    def delete(self, shard_id: ShardId) -> int:
        with self._lock:
            shard = self._shards.pop(shard_id, None)
            if shard is None:
                return 0
            self._used_bytes -= shard.meta.nbytes
        return shard.meta.nbytes

    @override
    def __contains__(self, shard_id: object) -> bool:
        return shard_id in self._shards

    @override
    def items(self) -> Iterator[tuple[ShardId, ShardMeta]]:
        with self._lock:  # a snapshot: the dict may change while the caller iterates
            held = [(shard_id, shard.meta) for shard_id, shard in self._shards.items()]
        yield from held

    @override
    def __len__(self) -> int:
        return len(self._shards)
