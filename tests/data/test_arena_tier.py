"""The CPU tier in the arena, on real shared mappings and real worker processes: adopted
extents, pins, grants of a killed worker reclaimed, a full arena refusing, disk readinto."""

from __future__ import annotations

import fcntl
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import flip_bit, holder_process
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.region import ArenaMapping, ArenaRegion
from tierstore.data.checksum import digest
from tierstore.data.tiers.arena import ArenaTier
from tierstore.data.tiers.base import ShardMeta, StoredShard
from tierstore.data.tiers.disk import DiskTier
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierFullError
from tierstore.keys import ChunkKey, Namespace, ShardId

NS = Namespace("0123abcd")
KiB = 1 << 10
REGION = 64 * KiB + 4 * KiB  # room for four 16 KiB extents, and a page for the generations


def _id(i: int) -> ShardId:
    return ShardId(NS, ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\1"), 0)


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


def _meta(data: np.ndarray) -> ShardMeta:
    return ShardMeta(data.nbytes, digest(data), 1)


@pytest.fixture
def tier() -> Iterator[ArenaTier]:
    region = ArenaRegion.create("ns-test", uuid.uuid4().hex, REGION)
    tier = ArenaTier(region, capacity_bytes=48 * KiB)
    yield tier
    tier.close()


@pytest.fixture
def holder(tier: ArenaTier) -> Iterator[HolderLock]:
    lock = HolderLock(tier.info.path)
    yield lock
    lock.close()


def test_worker_fills_granted_extents_and_the_tier_adopts_them(
    tier: ArenaTier, holder: HolderLock
) -> None:
    worker = ArenaMapping(tier.info)
    offsets = tier.grant(holder.holder, [4 * KiB, 4 * KiB])
    assert None not in offsets
    data = [_bytes(4 * KiB, i) for i in range(2)]
    for offset, d in zip(offsets, data, strict=True):
        worker.view(offset, d.nbytes)[:] = d  # the gather, straight into the arena
    assert tier.adopt(holder.holder, _id(0), _meta(data[0]), offsets[0])
    # The worker's digest is taken as given (it hashed the extent as it filled it; one
    # hash per store): the tier does not read the bytes. Every reader checks them.
    wrong = ShardMeta(4 * KiB, digest(data[0]), 1)  # not the bytes written there
    assert tier.adopt(holder.holder, _id(1), wrong, offsets[1])
    assert digest(tier.get(_id(1)).data) != tier.get(_id(1)).meta.digest
    assert np.array_equal(tier.get(_id(0)).data, data[0])
    assert tier.used_bytes == 8 * KiB and tier.status()["granted_bytes"] == 0
    with pytest.raises(ValueError, match="not granted"):
        tier.adopt(holder.holder, _id(2), _meta(data[0]), offsets[0])
    worker.close()


def test_grants_need_a_live_holder(tier: ArenaTier) -> None:
    with pytest.raises(PermissionError):
        tier.grant("ab" * 8, [KiB])


def test_full_arena_refuses_grants_and_adoptions_without_blocking(
    tier: ArenaTier, holder: HolderLock
) -> None:
    offsets = tier.grant(holder.holder, [16 * KiB] * 5)
    assert offsets.count(None) == 1 and tier.refused_grants == 1
    data = _bytes(16 * KiB, 1)
    for i, offset in enumerate(offsets[:4]):
        assert offset is not None
        tier.region.view(offset, data.nbytes)[:] = data
        # the tier's capacity (48 KiB of shards) refuses the fourth: its extent is freed
        assert tier.adopt(holder.holder, _id(i), _meta(data), offset) == (i < 3)
    assert tier.used_bytes == 48 * KiB
    assert tier.allocator.free_bytes == tier.allocator.capacity - 48 * KiB
    with pytest.raises(TierFullError):
        tier.put(_id(9), StoredShard(_meta(data), data))


def test_a_killed_worker_leaks_no_granted_or_pinned_extent(tier: ArenaTier) -> None:
    data = _bytes(8 * KiB, 3)
    tier.put(_id(0), StoredShard(_meta(data), data))
    free_before = tier.allocator.free_bytes
    proc, holder = holder_process(tier.info.path)
    try:
        assert tier.grant(holder, [4 * KiB, 8 * KiB]).count(None) == 0
        [(offset, _)] = tier.pin(holder, [_id(0)])
        tier.delete(_id(0))  # evicted while the worker loads it: bytes stay until unpinned
        assert tier.allocator.free_bytes == free_before - 12 * KiB
        assert tier.region.view(offset, data.nbytes).tobytes() == data.tobytes()
        assert tier.reclaim_dead() == 0  # alive: nothing taken from it
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert tier.reclaim_dead() == 3  # two grants, one pinned (deleted) shard
    assert tier.allocator.free_bytes == tier.allocator.capacity
    assert tier.allocator.holes() == [(0, tier.allocator.capacity)]
    assert not Path(f"{tier.info.path}.holder-{holder}.lock").exists()


def test_a_pinned_extent_is_not_reused_until_unpinned(tier: ArenaTier, holder: HolderLock) -> None:
    data = _bytes(40 * KiB, 4)
    tier.put(_id(0), StoredShard(_meta(data), data))
    [(offset, meta)] = tier.pin(holder.holder, [_id(0)])
    assert meta.nbytes == data.nbytes
    tier.delete(_id(0))
    with pytest.raises(TierFullError, match="no free extent"):  # its bytes are still pinned
        tier.put(_id(1), StoredShard(_meta(data), data))
    tier.unpin(holder.holder, [offset])
    tier.put(_id(1), StoredShard(_meta(data), data))
    with pytest.raises(ChunkNotFoundError):
        tier.pin(holder.holder, [_id(0)])


def test_promotion_reads_a_disk_shard_straight_into_an_extent(
    tier: ArenaTier, tmp_path: Path
) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    data = _bytes(10 * KiB + 3, 5)
    disk.put(_id(0), StoredShard(_meta(data), data))
    tier.fill(_id(0), disk.meta(_id(0)), lambda out: disk.read_into(_id(0), out))
    assert tier.get(_id(0)).data.tobytes() == data.tobytes()
    # a corrupt chunk: the checksum fails after the read, the extent is freed, no shard
    where = disk.location_of(_id(0))
    flip_bit(where.path, where.payload_offset + where.nbytes - 1, 0xFF)
    tier.delete(_id(0))
    with pytest.raises(ChunkCorruptError):
        tier.fill(_id(0), disk.meta(_id(0)), lambda out: disk.read_into(_id(0), out))
    assert _id(0) not in tier and tier.used_bytes == 0
    assert tier.allocator.free_bytes == tier.allocator.capacity


def test_a_new_arena_after_a_restart_holds_nothing(tier: ArenaTier) -> None:
    data = _bytes(KiB, 6)
    tier.put(_id(0), StoredShard(_meta(data), data))
    # The NodeStore dies without closing: the kernel drops its lock, its file stays. Its
    # successor creates the arena of the same name.
    fd = tier.region._fd
    assert fd is not None
    fcntl.flock(fd, fcntl.LOCK_UN)
    successor = ArenaTier(ArenaRegion(tier.region.path, REGION), 48 * KiB)
    try:
        assert len(successor) == 0 and _id(0) not in successor
        assert not successor.region.array.any()
        tier.close()  # the dead one's close (if it ever ran) leaves the successor's file
        assert successor.region.path.exists()
    finally:
        successor.close()
    assert not successor.region.path.exists()


def test_an_extent_read_by_the_node_store_is_not_reused_until_the_read_ends(
    tier: ArenaTier,
) -> None:
    """A load copies out of a shard on a data thread while the control thread drops it:
    the extent stays until the copy is done, so the copy never sees another shard."""
    data = _bytes(40 * KiB, 7)
    tier.put(_id(0), StoredShard(_meta(data), data))
    with tier.reading():
        shard = tier.find(_id(0))
        assert shard is not None
        tier.delete(_id(0))
        with pytest.raises(TierFullError, match="no free extent"):
            tier.put(_id(1), StoredShard(_meta(data), data))
        assert shard.data.tobytes() == data.tobytes()
    tier.put(_id(1), StoredShard(_meta(data), data))
