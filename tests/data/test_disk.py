"""The disk tier on real files: atomic, checksummed, owner-only, rebuilt on start."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import stat
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest

from tierstore.data.checksum import digest
from tierstore.data.tiers import disk as disk_module
from tierstore.data.tiers.base import ShardMeta, StoredShard
from tierstore.data.tiers.disk import DiskTier
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierFullError
from tierstore.keys import ChunkKey, Namespace, ShardId

NS = Namespace("0123abcd")


def _shard(n: int, seed: int, parent: bytes | None = None) -> StoredShard:
    data = np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)
    return StoredShard(ShardMeta(n, digest(data), 0b11, 2, parent), data)


def _id(i: int, rank: int = 0) -> ShardId:
    return ShardId(NS, ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\1"), rank)


def test_put_get_roundtrip_and_restart_recovers_everything(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    shards = {_id(i, r): _shard(100 + i, i, parent=b"p" * 12) for i in range(5) for r in (0, 1)}
    for shard_id, shard in shards.items():
        tier.put(shard_id, shard)
    assert tier.used_bytes == sum(s.meta.nbytes for s in shards.values())

    reopened = DiskTier(tmp_path, 10_000)
    assert dict(reopened.items()) == {i: s.meta for i, s in shards.items()}
    assert reopened.used_bytes == tier.used_bytes
    for shard_id, shard in shards.items():
        assert np.array_equal(reopened.get(shard_id).data, shard.data)


def test_files_are_owner_only_and_named_by_digest(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(64, 1))
    path = tier.path_of(_id(1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    assert path.name.removesuffix(".chunk").isalnum() and len(path.name) == 64 + 6
    with pytest.raises(ValueError, match="hex"):
        tier.put(ShardId(Namespace("../etc"), ChunkKey(b"k" * 12), 0), _shard(8, 2))


def test_flipped_byte_is_detected_and_the_file_removed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(256, 1))
    path = tier.path_of(_id(1))
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ChunkCorruptError, match="checksum"):
        tier.get(_id(1))
    assert not path.exists() and _id(1) not in tier and tier.used_bytes == 0
    assert tier.corrupt_files_removed == 1


def test_truncated_file_is_detected_now_and_at_restart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(256, 1))
    tier.put(_id(2), _shard(256, 2))
    for i in (1, 2):
        path = tier.path_of(_id(i))
        os.truncate(path, path.stat().st_size - 7)
    with pytest.raises(ChunkCorruptError):
        tier.get(_id(1))
    reopened = DiskTier(tmp_path, 10_000)  # the other truncated file is caught on start
    assert _id(2) not in reopened and reopened.corrupt_files_removed == 1


def test_unpublished_temp_files_and_junk_are_cleaned_at_start(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(32, 1))
    folder = tier.path_of(_id(1)).parent
    (folder / ".half-written.tmp").write_bytes(b"partial")
    (folder / ("f" * 64 + ".chunk")).write_bytes(b"not a chunk file")
    reopened = DiskTier(tmp_path, 10_000)
    assert list(dict(reopened.items())) == [_id(1)]
    assert sorted(p.name for p in folder.iterdir()) == [tier.path_of(_id(1)).name]


def test_capacity_is_enforced(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 300)
    tier.put(_id(1), _shard(200, 1))
    with pytest.raises(TierFullError, match="disk tier full"):
        tier.put(_id(2), _shard(200, 2))
    assert tier.delete(_id(1)) == 200
    tier.put(_id(2), _shard(200, 2))
    assert tier.used_bytes == 200


def test_a_full_disk_raises_a_clear_error_and_leaves_no_file(tmp_path: Path) -> None:
    """The file-size limit makes the kernel refuse the write (EFBIG), as a full disk would."""
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(_id(1), _shard(32, 1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
    try:
        with pytest.raises(TierFullError, match="write failed"):
            tier.put(_id(2), _shard(8192, 2))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert _id(2) not in tier and tier.used_bytes == 32
    assert [p.name for p in tier.path_of(_id(1)).parent.parent.rglob("*.tmp")] == []
    assert np.array_equal(tier.get(_id(1)).data, _shard(32, 1).data)


def _inode(path: Path) -> int:
    return path.stat().st_ino


def test_a_deleted_shards_file_is_written_over_by_the_next_put_not_created(
    tmp_path: Path,
) -> None:
    """A full cache writes after every delete: the freed file is reused (same inode, no
    create), and what it holds now is the new shard's bytes, verified, also after a
    restart."""
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(3000, 1))
    tier.put(_id(2), _shard(500, 2))
    freed = {_inode(tier.path_of(_id(1))), _inode(tier.path_of(_id(2)))}
    assert tier.delete(_id(1)) == 3000 and tier.delete(_id(2)) == 500
    assert not any(tmp_path.rglob("*.chunk"))

    tier.put(_id(3), _shard(700, 3))  # shorter than one freed file, longer than the other
    tier.put(_id(4), _shard(2000, 4))
    assert tier.files_reused == 2
    assert {_inode(tier.path_of(_id(3))), _inode(tier.path_of(_id(4)))} == freed
    for i, n in ((3, 700), (4, 2000)):
        assert tier.path_of(_id(i)).stat().st_size < n + 512  # no tail of the old bytes
        assert np.array_equal(tier.get(_id(i)).data, _shard(n, i).data)
    reopened = DiskTier(tmp_path, 10_000)
    assert dict(reopened.items()) == {_id(3): _shard(700, 3).meta, _id(4): _shard(2000, 4).meta}
    assert np.array_equal(reopened.get(_id(4)).data, _shard(2000, 4).data)


def test_freed_files_count_against_the_capacity_and_are_never_indexed(tmp_path: Path) -> None:
    """Bytes kept for reuse plus the shards never pass the capacity (a put that needs the
    room unlinks freed files); files left in ``.free/`` (a crash mid-rewrite) are reused
    at start, never served."""
    tier = DiskTier(tmp_path, 1000)
    for i in range(4):
        tier.put(_id(i), _shard(250, i))
    for i in range(4):
        tier.delete(_id(i))
    on_disk = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(on_disk) == 4 and sum(p.stat().st_size for p in on_disk) < 1000 + 4 * 512
    tier.put(_id(9), _shard(900, 9))  # reuses one file, unlinks what no longer fits
    held = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert held < 1000 + 512, held

    (tmp_path / ".free" / "torn.free").write_bytes(b"TSC1 half of a rewrite")
    reopened = DiskTier(tmp_path, 1000)
    assert list(dict(reopened.items())) == [_id(9)]
    assert reopened.delete(_id(9)) == 900
    reopened.put(_id(10), _shard(64, 10))
    assert np.array_equal(reopened.get(_id(10)).data, _shard(64, 10).data)


def test_a_read_racing_the_reuse_of_its_file_never_returns_the_new_shards_bytes(
    tmp_path: Path,
) -> None:
    """A reader that opened a shard's file just before the shard was deleted and its file
    written over by another shard of the same size reads the other shard's bytes: the
    digest check turns that into 'not found', and the other shard stays intact."""
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(1000, 1))

    def read_while_reused(path: Path, out: np.ndarray) -> dict[str, object]:
        with open(path, "rb") as f:
            tier.delete(_id(1))
            tier.put(_id(2), _shard(1000, 2))
            assert tier.files_reused == 1
            header, _ = disk_module._read_header_from(f)
            f.readinto(memoryview(out).cast("B"))
        return header

    with (
        patch.object(disk_module, "_read_file_into", read_while_reused),
        pytest.raises(ChunkNotFoundError, match="dropped"),
    ):
        tier.get(_id(1))
    assert tier.corrupt_files_removed == 0
    assert np.array_equal(tier.get(_id(2)).data, _shard(1000, 2).data)


def test_a_shard_directory_removed_under_the_tier_is_made_again(tmp_path: Path) -> None:
    """Directories are created once and remembered; one removed from outside costs one
    failed write (a clear error, nothing indexed), not every later one."""
    tier = DiskTier(tmp_path, 10_000)
    tier.put(_id(1), _shard(64, 1))
    folder = tier.path_of(_id(1)).parent
    tier.delete(_id(1))
    shutil.rmtree(folder)
    with pytest.raises(TierFullError, match="write failed"):
        tier.put(_id(1), _shard(64, 1))
    assert _id(1) not in tier and tier.used_bytes == 0
    tier.put(_id(1), _shard(64, 1))
    assert np.array_equal(tier.get(_id(1)).data, _shard(64, 1).data)
