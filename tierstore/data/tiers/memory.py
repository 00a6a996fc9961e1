"""CPU tier: shard bytes held as numpy arrays in the NodeStore's own heap.

The Ray object store is only transport (it spills silently at 80 % full), so the bound
is enforced here, on bytes this process owns: a vLLM worker that exits takes nothing
with it.
"""

from __future__ import annotations

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

    @override
    def put(self, shard_id: ShardId, shard: StoredShard) -> None:
        if shard.data.nbytes != shard.meta.nbytes:
            raise ValueError(
                f"shard data has {shard.data.nbytes} bytes, its metadata says {shard.meta.nbytes}"
            )
        if shard_id in self._shards:
            return
        self._check_room(shard.meta.nbytes)
        self._shards[shard_id] = shard
        self._used_bytes += shard.meta.nbytes

    @override
    def get(self, shard_id: ShardId) -> StoredShard:
        try:
            return self._shards[shard_id]
        except KeyError:
            raise ChunkNotFoundError(f"shard not in CPU tier: {shard_id!r}") from None

    @override
    def delete(self, shard_id: ShardId) -> int:
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
        for shard_id, shard in self._shards.items():
            yield shard_id, shard.meta

    @override
    def __len__(self) -> int:
        return len(self._shards)
