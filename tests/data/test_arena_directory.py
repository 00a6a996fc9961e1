"""The arena's shard directory, on real shared mappings: what the NodeStore holds, a
worker's own mapping finds (offset, metadata, generation), from adoptions, promotions
and pins; an entry another shard took, or one half written, is never trusted."""

from __future__ import annotations

import numpy as np

from tierstore.data.arena.directory import (
    MAX_DIRECTORY_BYTES,
    Located,
    ShardDirectory,
    arena_tables,
    directory_bytes,
)
from tierstore.data.arena.generations import Generations
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.region import ArenaMapping
from tierstore.data.checksum import digest
from tierstore.data.tiers.arena import ArenaTier
from tierstore.data.tiers.base import ShardMeta
from tierstore.keys import ChunkKey, Namespace, ShardId

NS = Namespace("d1d1d1d1")
KiB = 1 << 10


def _shard(i: int, rank: int = 0) -> ShardId:
    return ShardId(NS, ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\0"), rank)


def _worker_view(tier: ArenaTier) -> tuple[ShardDirectory, Generations]:
    """The tables as a worker's own mapping of the arena sees them."""
    generations, directory = arena_tables(ArenaMapping(tier.region.info).array)
    return directory, generations


def test_the_directory_sits_between_the_extents_and_the_generations() -> None:
    assert directory_bytes(1 << 30) == MAX_DIRECTORY_BYTES
    assert directory_bytes(256 * KiB) == 4 * KiB  # 64 entries
    assert directory_bytes(100) == 64  # one entry: shards take it in turn
    region = np.zeros(256 * KiB, dtype=np.uint8)
    generations, directory = arena_tables(region)
    assert directory.extents_bytes + directory.nbytes + generations.nbytes == len(region)
    directory.record(_shard(1), 0, ShardMeta(64, 7, 1), 0)
    assert region[: directory.extents_bytes].sum() == 0  # no extent byte touched


def test_a_worker_finds_what_the_tier_adopted_or_filled(arena_tier: ArenaTier) -> None:
    tier = arena_tier
    holder = HolderLock(tier.region.info.path)
    directory, generations = _worker_view(tier)
    (offset,) = tier.grant(holder.holder, [3000])
    assert offset is not None
    data = np.full(3000, 5, dtype=np.uint8)
    tier.region.view(offset, 3000)[:] = data
    meta = ShardMeta(3000, digest(data), 0b11)
    assert tier.adopt(holder.holder, _shard(1), meta, offset)
    (found,) = directory.find([_shard(1)]) or [None]
    assert found == Located(
        offset, ShardMeta(3000, digest(data), 0b11), *generations.read([offset])
    )
    # Another rank's shard of the same chunk is another shard: not found.
    assert directory.find([_shard(1, rank=1)]) is None
    # A promotion (filled in place) is found too.
    filled = ShardMeta(2048, digest(np.zeros(2048, np.uint8)), 1)
    tier.fill(_shard(2), filled, lambda out: out.fill(0))
    ((at, meta2, _),) = directory.find([_shard(2)]) or [(None, None, None)]
    assert meta2 == filled and tier.region.view(at, 2048).sum() == 0
    holder.close()


def test_a_shard_whose_entry_another_took_is_found_again_once_pinned(arena_tier: ArenaTier) -> None:
    tier = arena_tier
    """Direct-mapped: with more shards than entries some are not found (their loads pin);
    the pin writes the entry back, so the next load finds it."""
    holder = HolderLock(tier.region.info.path)
    directory, _ = _worker_view(tier)
    shards = [_shard(i) for i in range(200)]  # 64 entries
    for shard_id in shards:
        tier.fill(shard_id, ShardMeta(256, digest(np.ones(256, np.uint8)), 1), lambda o: o.fill(1))
    lost = [s for s in shards if directory.find([s]) is None]
    assert lost, "200 shards in 64 entries: some must have lost theirs"
    assert directory.find(shards) is None  # one lost: the job is not served from it
    tier.pin(holder.holder, lost[:1])
    assert directory.find(lost[:1]) is not None
    holder.close()


def test_an_entry_being_written_is_not_trusted(arena_tier: ArenaTier) -> None:
    tier = arena_tier
    """Its sequence word is odd (the NodeStore is writing it, or died doing so)."""
    directory, _ = _worker_view(tier)
    tier.fill(_shard(3), ShardMeta(128, digest(np.zeros(128, np.uint8)), 1), lambda o: o.fill(0))
    assert directory.find([_shard(3)]) is not None
    entries = tier.directory._entries
    (slot,) = [i for i in range(len(entries)) if entries[i, 0] != 0]
    entries[slot, 0] += np.uint64(1)  # as a writer does first
    assert directory.find([_shard(3)]) is None
    entries[slot, 0] += np.uint64(1)  # and last
    assert directory.find([_shard(3)]) is not None


def test_chunks_of_more_than_63_slots_are_found_when_whole(arena_tier: ArenaTier) -> None:
    """A chunk of 256 blocks (a 16 MiB chunk of 64 KiB pages): its slot mask does not fit
    a word, so it is kept as "all 256 slots"; a partial one is not kept (its loads pin)."""
    tier = arena_tier
    directory, _ = _worker_view(tier)
    whole = ShardMeta(512, digest(np.zeros(512, np.uint8)), (1 << 256) - 1)
    tier.fill(_shard(7), whole, lambda o: o.fill(0))
    ((_, meta, _),) = directory.find([_shard(7)]) or [(None, None, None)]
    assert meta == whole
    partial = ShardMeta(512, digest(np.zeros(512, np.uint8)), ((1 << 256) - 1) & ~1)
    tier.fill(_shard(8), partial, lambda o: o.fill(0))
    assert directory.find([_shard(8)]) is None
    tier.fill(_shard(9), ShardMeta(512, whole.digest, 0b1011), lambda o: o.fill(0))
    ((_, narrow, _),) = directory.find([_shard(9)]) or [(None, None, None)]
    assert narrow.slot_mask == 0b1011
