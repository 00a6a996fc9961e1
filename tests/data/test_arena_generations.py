"""The arena's generation table, on real shared mappings: every free of an extent bumps
it as the workers' own mappings see it; nothing else does. What an unpinned same-node
load relies on (tests/vllm/test_worker_arena.py drives the load itself)."""

from __future__ import annotations

import numpy as np

from tierstore.data.arena.generations import MAX_TABLE_BYTES, Generations, table_bytes
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.region import ArenaMapping
from tierstore.data.checksum import digest
from tierstore.data.tiers.arena import ArenaTier
from tierstore.data.tiers.base import ShardMeta
from tierstore.keys import ChunkKey, Namespace, ShardId

NS = Namespace("9e9e9e9e")
KiB = 1 << 10


def _adopted(tier: ArenaTier, holder: HolderLock, i: int, nbytes: int) -> tuple[ShardId, int]:
    """A shard a worker gathered into a granted extent and committed."""
    (offset,) = tier.grant(holder.holder, [nbytes])
    assert offset is not None
    data = np.full(nbytes, i, dtype=np.uint8)
    tier.region.view(offset, nbytes)[:] = data
    shard_id = ShardId(NS, ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\0"), 0)
    assert tier.adopt(holder.holder, shard_id, ShardMeta(nbytes, digest(data), 1), offset)
    return shard_id, offset


def test_the_table_sits_after_the_extents_and_grows_with_the_region() -> None:
    assert table_bytes(1 << 40) == MAX_TABLE_BYTES
    assert table_bytes(1 << 30) == (1 << 30) // 64  # a slot per 512 bytes of region
    assert table_bytes(256 * KiB) == 4 * KiB
    assert table_bytes(100) == 8  # one slot: every free bumps it (loads pin more often)
    region = np.zeros(256 * KiB, dtype=np.uint8)
    generations = Generations(region)
    assert generations.extents_bytes + generations.nbytes == len(region)
    generations.bump(0)
    assert region[: generations.extents_bytes].sum() == 0  # no extent byte touched


def test_freeing_an_extent_bumps_its_generation_where_workers_see_it(arena_tier: ArenaTier) -> None:
    tier = arena_tier
    holder = HolderLock(tier.region.info.path)
    worker_view = Generations(ArenaMapping(tier.region.info).array)
    shards = [_adopted(tier, holder, i, 3000 + 64 * i) for i in range(8)]
    offsets = [at for _, at in shards]
    before = worker_view.read(offsets)
    # Allocating and adopting others changes nothing for extents still held.
    _adopted(tier, holder, 99, 4096)
    assert worker_view.read(offsets) == before
    # A pinned extent deleted is freed (bumped) only at its last unpin.
    tier.pin(holder.holder, [shards[0][0]])
    tier.delete(shards[0][0])
    assert worker_view.read(offsets[:1]) == before[:1]
    tier.unpin(holder.holder, offsets[:1])
    assert worker_view.read(offsets[:1]) != before[:1]
    # A plain delete frees at once.
    tier.delete(shards[1][0])
    assert worker_view.read(offsets[1:2]) != before[1:2]
    # A refused adoption (the same shard again) frees the new extent: bumped too.
    (again,) = tier.grant(holder.holder, [4000])
    gen = worker_view.read([again])
    data = np.full(3064, 2, dtype=np.uint8)
    tier.adopt(holder.holder, shards[2][0], ShardMeta(3064, digest(data), 1), again)
    assert worker_view.read([again]) != gen
    holder.close()
