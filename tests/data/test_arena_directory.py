"""The arena's shard directory, on real shared mappings: what the NodeStore holds, a
worker's own mapping finds (offset, metadata, generation), from adoptions, promotions
and pins; shards that share a bucket keep their entries while there is room (a stale
entry goes first); an entry another shard took, or one half written, is never trusted."""

from __future__ import annotations

import itertools
import uuid

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
from tierstore.data.arena.region import ArenaMapping, ArenaRegion
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
    assert directory_bytes(1 << 40) == MAX_DIRECTORY_BYTES
    assert directory_bytes(1 << 30) == (1 << 30) // 64  # one entry per 4 KiB
    assert directory_bytes(256 * KiB) == 4 * KiB  # 64 entries: 16 buckets of 4
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


def _one_bucket(directory: ShardDirectory, n: int) -> list[ShardId]:
    """``n`` shards whose entries go in the same bucket of ``directory``."""
    by_bucket: dict[int, list[ShardId]] = {}
    for i in itertools.count():
        shards = by_bucket.setdefault(directory.bucket_of(_shard(i)), [])
        shards.append(_shard(i))
        if len(shards) == n:
            return shards
    raise AssertionError("unreachable")


def _fill(tier: ArenaTier, shard_id: ShardId, nbytes: int = 256) -> None:
    data = np.full(nbytes, 1, np.uint8)
    tier.fill(shard_id, ShardMeta(nbytes, digest(data), 1), lambda out: out.fill(1))


def test_shards_that_share_a_bucket_keep_their_entries_and_a_stale_one_goes_first(
    arena_tier: ArenaTier,
) -> None:
    tier = arena_tier
    directory, _ = _worker_view(tier)
    first, second, third, fourth, fifth = _one_bucket(directory, 5)
    for shard_id in (first, second, third, fourth):
        _fill(tier, shard_id)
    assert directory.find([first, second, third, fourth]) is not None
    tier.delete(second)  # its extent freed: its entry is stale
    _fill(tier, fifth)
    assert directory.find([first, third, fourth, fifth]) is not None
    assert directory.find([second]) is None


def test_a_shard_whose_entry_another_took_is_found_again_once_pinned(arena_tier: ArenaTier) -> None:
    """Five live shards in one bucket of four: one of the first four lost its entry (its
    loads pin); the pin writes the entry back, so the next load finds it."""
    tier = arena_tier
    holder = HolderLock(tier.region.info.path)
    directory, _ = _worker_view(tier)
    shards = _one_bucket(directory, 5)
    for shard_id in shards:
        _fill(tier, shard_id)
    lost = [s for s in shards if directory.find([s]) is None]
    assert len(lost) == 1 and lost[0] != shards[-1]
    assert directory.find(shards) is None  # one lost: the job is not served from it
    tier.pin(holder.holder, lost)
    assert directory.find(lost) is not None
    holder.close()


def test_a_full_small_arena_finds_every_shard_of_a_prefix() -> None:
    """The e2e bench's tiny-model arena (a 4 MiB CPU tier of 32 KiB chunks, 8 MiB in
    all) holding 128 chunks: every one is found. Direct-mapped, as the directory was,
    the same 128 shards lost several entries, and a 32-chunk load then pinned."""
    region = ArenaRegion.create("ns-data", uuid.uuid4().hex, 8 << 20)
    try:
        tier = ArenaTier(region, capacity_bytes=4 << 20)
        directory, _ = _worker_view(tier)
        shards = [_shard(i) for i in range(128)]
        for shard_id in shards:
            _fill(tier, shard_id, 32 * KiB)
        assert [s for s in shards if directory.find([s]) is None] == []
    finally:
        region.close()


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
