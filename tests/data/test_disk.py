"""The disk tier on real files: slots in slab files, checksummed, owner-only, rebuilt on
start, all in tierstore's own folder of ``disk_path``."""

from __future__ import annotations

import os
import resource
import signal
import stat
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest

from tests.support import flip_bit, overwrite
from tierstore.data.checksum import digest
from tierstore.data.tiers import slab as slab_module
from tierstore.data.tiers.base import ShardMeta, StoredShard
from tierstore.data.tiers.disk import ChunkLocation, DiskTier, chunk_records
from tierstore.data.tiers.disk_folder import FOLDER_NAME, LOCK_NAME, MARKER_NAME
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierFullError
from tierstore.keys import ChunkKey, Namespace, ShardId

NS = Namespace("0123abcd")


def _shard(n: int, seed: int, parent: bytes | None = None) -> StoredShard:
    data = np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)
    return StoredShard(ShardMeta(n, digest(data), 0b11, 2, parent), data)


def _id(i: int, rank: int = 0) -> ShardId:
    return ShardId(NS, ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\1"), rank)


def _reopen(tier: DiskTier) -> DiskTier:
    """The tier as its NodeStore's restart finds it (the first one's claim given up)."""
    tier.close()
    return DiskTier(tier.disk_path, tier.capacity_bytes)


def test_put_get_roundtrip_and_restart_recovers_everything(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    shards = {_id(i, r): _shard(100 + i, i, parent=b"p" * 12) for i in range(5) for r in (0, 1)}
    for shard_id, shard in shards.items():
        tier.put(shard_id, shard)
    used = tier.used_bytes
    assert used == sum(s.meta.nbytes for s in shards.values())

    reopened = _reopen(tier)
    assert dict(reopened.items()) == {i: s.meta for i, s in shards.items()}
    assert reopened.used_bytes == used
    for shard_id, shard in shards.items():
        assert np.array_equal(reopened.get(shard_id).data, shard.data)


def test_a_chunk_of_more_than_64_slots_keeps_its_slot_mask_across_a_restart(
    tmp_path: Path,
) -> None:
    """A chunk of 100 blocks, its last 37 slots written: the mask needs more than the 64
    bits a msgpack int holds, and must come back whole (once, its write raised)."""
    tier = DiskTier(tmp_path, 10_000)
    data = np.random.default_rng(7).integers(0, 255, 300, dtype=np.uint8)
    mask = ((1 << 37) - 1) << 63
    shard = StoredShard(ShardMeta(300, digest(data), mask, 1, None), data)
    tier.put(_id(1), shard)
    reopened = _reopen(tier)
    assert reopened.meta(_id(1)).slot_mask == mask
    assert np.array_equal(reopened.get(_id(1)).data, data)


def _flip(where: ChunkLocation, index: int) -> None:
    """Flip one bit of the payload byte at ``index`` (negative: from its end)."""
    flip_bit(where.path, where.payload_offset + index % where.nbytes)


def _disk_bytes(root: Path) -> int:
    """Bytes the files under ``root`` occupy on disk (holes excluded)."""
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def test_files_are_owner_only_named_by_namespace_and_size_in_tierstores_folder(
    tmp_path: Path,
) -> None:
    os.chmod(tmp_path, 0o755)
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(64, 1))
    tier.put(_id(2), _shard(64, 2))
    tier.put(_id(3), _shard(100, 3))
    folder = tmp_path / FOLDER_NAME
    assert tier.folder == tier.root == folder
    where = tier.location_of(_id(1))
    assert where.path == folder / NS / "64.slab"
    assert tier.location_of(_id(2)).path == where.path  # one file per size
    assert tier.location_of(_id(3)).path == folder / NS / "100.slab"
    for path in (where.path, folder / MARKER_NAME, folder / LOCK_NAME):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / NS).stat().st_mode) == 0o700
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755  # disk_path is the user's
    with pytest.raises(ValueError, match="hex"):
        tier.put(ShardId(Namespace("../etc"), ChunkKey(b"k" * 12), 0), _shard(8, 2))
    with pytest.raises(ValueError, match="hex"):  # "$" would take it
        tier.put(ShardId(Namespace(NS + "\n"), ChunkKey(b"k" * 12), 0), _shard(8, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [FOLDER_NAME]
    assert sorted(p.name for p in folder.rglob("*")) == sorted(
        [LOCK_NAME, NS, "100.slab", "64.slab", MARKER_NAME]
    )


def test_flipped_byte_is_detected_and_the_chunk_freed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(256, 1))
    tier.put(_id(2), _shard(256, 2))
    _flip(tier.location_of(_id(1)), -10)
    with pytest.raises(ChunkCorruptError, match="checksum"):
        tier.get(_id(1))
    assert _id(1) not in tier and tier.used_bytes == 256
    assert tier.corrupt_chunks_removed == 1
    assert np.array_equal(tier.get(_id(2)).data, _shard(256, 2).data)  # its neighbour
    reopened = _reopen(tier)  # the freed slot is not indexed again
    assert list(dict(reopened.items())) == [_id(2)]


def test_a_torn_write_is_never_served_and_a_torn_file_tail_is_cut_at_start(
    tmp_path: Path,
) -> None:
    """A crash can leave a slot whose payload is partly written, or a file cut inside its
    last slot: the first fails its checksum when read, the second is cut off at start."""
    tier = DiskTier(tmp_path, 10_000)
    for i in (1, 2, 3):
        tier.put(_id(i), _shard(256, i))
    torn = tier.location_of(_id(1))
    overwrite(torn.path, torn.payload_offset + 100, bytes(156))
    os.truncate(torn.path, torn.path.stat().st_size - 7)  # slot 3's tail
    reopened = _reopen(tier)
    assert set(dict(reopened.items())) == {_id(1), _id(2)}
    assert torn.path.stat().st_size == 2 * slab_module.slot_bytes_for(256)
    with pytest.raises(ChunkCorruptError, match="checksum"):
        reopened.get(_id(1))
    assert np.array_equal(reopened.get(_id(2)).data, _shard(256, 2).data)
    assert _id(1) not in _reopen(reopened)


def test_junk_headers_are_freed_and_files_that_are_not_slabs_left_alone(
    tmp_path: Path,
) -> None:
    """A slot whose header is junk is counted and freed; anything in the tier's folders
    that is not a slab file (chunk files of the layout before slabs, an operator's
    notes) is left as it is."""
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(32, 1))
    tier.put(_id(2), _shard(32, 2))
    junk = tier.location_of(_id(2))
    overwrite(junk.path, junk.payload_offset - 4096, b"TSC2\0\0\0\5junk!")
    legacy = tier.root / NS / "ab"
    legacy.mkdir()
    (legacy / ("ab" + "0" * 62 + ".chunk")).write_bytes(b"TSC1 an old chunk")
    (legacy / ".half-written.tmp").write_bytes(b"partial")
    (tier.root / ".free").mkdir()
    (tier.root / ".free" / "x.free").write_bytes(b"freed")
    (tier.root / NS / "notes.txt").write_bytes(b"an operator's")
    reopened = _reopen(tier)
    assert list(dict(reopened.items())) == [_id(1)] and reopened.corrupt_chunks_removed == 1
    assert sorted(p.name for p in (tier.root / NS).iterdir()) == ["32.slab", "ab", "notes.txt"]
    assert sorted(p.name for p in legacy.iterdir()) == [
        ".half-written.tmp",
        legacy.name + "0" * 62 + ".chunk",
    ]
    assert (tier.root / ".free" / "x.free").read_bytes() == b"freed"


def test_capacity_is_enforced(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 300)
    tier.put(_id(1), _shard(200, 1))
    with pytest.raises(TierFullError, match="disk tier full"):
        tier.put(_id(2), _shard(200, 2))
    assert tier.delete(_id(1)) == 200
    tier.put(_id(2), _shard(200, 2))
    assert tier.used_bytes == 200


def test_a_full_disk_raises_a_clear_error_and_loses_nothing(tmp_path: Path) -> None:
    """The file-size limit makes the kernel refuse the write (EFBIG), as a full disk would."""
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(_id(1), _shard(8192, 1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        with pytest.raises(TierFullError, match="write failed"):
            tier.put(_id(2), _shard(8192, 2))  # its slot would end at 24 KiB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert _id(2) not in tier and tier.used_bytes == 8192
    assert np.array_equal(tier.get(_id(1)).data, _shard(8192, 1).data)
    tier.put(_id(2), _shard(8192, 2))  # room again: the failed slot is written over
    reopened = _reopen(tier)
    assert set(dict(reopened.items())) == {_id(1), _id(2)}
    assert np.array_equal(reopened.get(_id(2)).data, _shard(8192, 2).data)


def test_a_deleted_shards_slot_is_written_over_by_the_next_put(tmp_path: Path) -> None:
    """A full cache writes after every delete: the freed slot is reused (no new disk
    blocks), and what it holds now is the new shard's bytes, verified, also after a
    restart; the deleted shard never comes back."""
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(3000, 1))
    tier.put(_id(2), _shard(3000, 2))
    size = tier.location_of(_id(2)).path.stat().st_size
    assert tier.delete(_id(1)) == 3000
    tier.put(_id(3), _shard(3000, 3))
    assert tier.slots_reused == 1
    assert tier.location_of(_id(3)).path.stat().st_size == size  # no slot added
    assert tier.location_of(_id(3)).payload_offset == 4096  # slot 0, where 1 was
    assert np.array_equal(tier.get(_id(3)).data, _shard(3000, 3).data)
    tier.delete(_id(2))
    reopened = _reopen(tier)
    assert dict(reopened.items()) == {_id(3): _shard(3000, 3).meta}
    assert np.array_equal(reopened.get(_id(3)).data, _shard(3000, 3).data)
    assert reopened.location_of(_id(3)).path.stat().st_size == size // 2  # free tail cut


def test_freed_slots_count_against_the_capacity_and_are_punched_out_for_room(
    tmp_path: Path,
) -> None:
    """Freed slots kept for reuse plus the shards never pass the capacity: a write of
    another size that needs the room gives the kept slots' disk blocks back."""
    tier = DiskTier(tmp_path, 64 * 1024)
    for i in range(4):
        tier.put(_id(i), _shard(16 * 1024, i))
    for i in range(4):
        tier.delete(_id(i))
    held = _disk_bytes(tmp_path)
    assert held >= 4 * 16 * 1024
    tier.put(_id(9), _shard(60 * 1024, 9))  # another size: three kept slots must go
    assert _disk_bytes(tmp_path) <= held + 64 * 1024 - 3 * 16 * 1024
    assert np.array_equal(tier.get(_id(9)).data, _shard(60 * 1024, 9).data)
    tier.delete(_id(9))
    for i in range(4):  # the punched slots are written again
        tier.put(_id(i), _shard(16 * 1024, i))
    reopened = _reopen(tier)
    assert set(dict(reopened.items())) == {_id(i) for i in range(4)}
    assert reopened.used_bytes == 64 * 1024
    assert all(r.payload_ok() for r in chunk_records(tmp_path))


def test_a_read_racing_the_reuse_of_its_slot_never_returns_the_new_shards_bytes(
    tmp_path: Path,
) -> None:
    """A read of a shard that is deleted, and its slot written over by another shard of
    the same size, while the read runs reads the other shard's bytes: the digest check
    turns that into 'not found', and the other shard stays intact."""
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(1000, 1))
    read_payload = slab_module.SlabFile.read_payload

    def read_while_reused(slab: slab_module.SlabFile, slot: int, out: np.ndarray) -> int:
        tier.delete(_id(1))
        tier.put(_id(2), _shard(1000, 2))
        assert tier.slots_reused == 1
        return read_payload(slab, slot, out)

    with (
        patch.object(slab_module.SlabFile, "read_payload", read_while_reused),
        pytest.raises(ChunkNotFoundError, match="dropped"),
    ):
        tier.get(_id(1))
    assert tier.corrupt_chunks_removed == 0
    assert np.array_equal(tier.get(_id(2)).data, _shard(1000, 2).data)


def test_a_nodes_folder_inside_another_tier_is_its_own(tmp_path: Path) -> None:
    """Simulated nodes on one machine nest their tiers (``<folder>/node-<id>``): each
    tier recovers only its own chunks, and the operators' listing finds both."""
    outer = DiskTier(tmp_path, 10_000, node_id="a")
    inner = DiskTier(tmp_path, 10_000, node_id="ab12")
    assert inner.root == outer.root / "node-ab12"
    outer.put(_id(1), _shard(64, 1))
    inner.put(_id(2), _shard(64, 2))
    outer.close()
    inner.close()
    inner = DiskTier(tmp_path, 10_000, node_id="ab12")  # keeps its own, though root is free
    outer = DiskTier(tmp_path, 10_000, node_id="a")
    assert list(dict(outer.items())) == [_id(1)]
    assert list(dict(inner.items())) == [_id(2)]
    keys = sorted(bytes(r.header["key"]) for r in chunk_records(tmp_path))
    assert keys == sorted(bytes(i.key) for i in (_id(1), _id(2)))
    assert all(r.payload_ok() for r in chunk_records(tmp_path))
