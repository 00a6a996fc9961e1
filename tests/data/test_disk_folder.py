"""The disk tier writes only inside the folder it makes and marks in ``disk_path``: what
the user keeps there, and symlinks planted there or inside tierstore's folder, are
never changed nor followed, through start, stores, restart and drops; a folder of
tierstore's name that it did not make is refused by name; the room is checked at start.

Real files in temporary directories; the room tests mount a small tmpfs (root only).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierstore.data.checksum import digest
from tierstore.data.tiers.base import ShardMeta, StoredShard
from tierstore.data.tiers.disk import DiskTier, chunk_records
from tierstore.data.tiers.disk_folder import (
    FOLDER_NAME,
    LAYOUT_VERSION,
    MARKER_NAME,
    ForeignFolderError,
    mount_of,
    size_of,
)
from tierstore.errors import ConfigError, TierFullError
from tierstore.keys import ChunkKey, Namespace, ShardId
from tierstore.private_files import UnsafePathError

NS = Namespace("0123abcd")
OTHER_NS = Namespace("fedc9876")
USER_NS = Namespace("cafe")  # a user's folder in disk_path happens to have a hex name
KIB, MIB = 1 << 10, 1 << 20
_FOLDER_LOG = "tierstore.data.tiers.disk_folder"


def _shard(n: int, seed: int) -> StoredShard:
    data = np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)
    return StoredShard(ShardMeta(n, digest(data), 1, 1), data)


def _id(i: int, namespace: str = NS) -> ShardId:
    return ShardId(Namespace(namespace), ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\1"), 0)


def _snapshot(top: Path, skip: str | None = None) -> dict[str, tuple[int, bytes | str]]:
    """Every entry under ``top`` (never following a symlink): relative path -> (mode,
    content or link target); ``skip`` leaves out one entry of ``top`` and what is in it."""
    seen: dict[str, tuple[int, bytes | str]] = {".": (os.lstat(top).st_mode, "")}
    for folder, dirs, files in os.walk(top):
        if skip is not None and Path(folder) == top:
            dirs[:] = [d for d in dirs if d != skip]
            files = [f for f in files if f != skip]
        for name in dirs + files:
            path = Path(folder) / name
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                seen[str(path.relative_to(top))] = (st.st_mode, os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                seen[str(path.relative_to(top))] = (st.st_mode, path.read_bytes())
            else:
                seen[str(path.relative_to(top))] = (st.st_mode, "")
    return seen


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """What planted symlinks point at: a file and a folder outside ``disk_path`` that
    tierstore must never write, truncate, chmod nor delete (one looks like a slab)."""
    folder = tmp_path / "victim"
    folder.mkdir(mode=0o755)
    (folder / "precious").write_bytes(b"not tierstore's" * 1000)
    (folder / "precious").chmod(0o644)
    (folder / "64.slab").write_bytes(b"a user's file with a slab's name" * 300)
    (folder / "64.slab").chmod(0o644)
    return folder


def _lifecycle(disk_path: Path) -> None:
    """Start, stores (several namespaces and sizes), a restart, drops, a stop."""
    tier = DiskTier(disk_path, 1 * MIB)
    for i, (namespace, size) in enumerate(
        [(NS, 64), (NS, 64), (NS, 128), (OTHER_NS, 64), (USER_NS, 12), (NS, 8000)]
    ):
        try:
            tier.put(_id(i, namespace), _shard(size, i))
        except TierFullError:
            pass  # a planted file refused: the test checks what it names
    tier.close()
    tier = DiskTier(disk_path, 1 * MIB)
    for shard_id, _ in list(tier.items()):
        assert tier.delete(shard_id) > 0
    tier.put(_id(9), _shard(64, 9))
    list(chunk_records(disk_path))
    tier.close()


def test_symlinks_planted_in_disk_path_are_never_followed(tmp_path: Path, victim: Path) -> None:
    """Where the layout before tierstore's folder kept its files (slabs, chunk files, the
    free list, the lock), a planted symlink is left alone and its target unchanged."""
    disk_path = tmp_path / "kv"
    (disk_path / NS / "ab").mkdir(parents=True)
    (disk_path / NS / "64.slab").symlink_to(victim / "precious")
    (disk_path / NS / "128.slab").symlink_to(victim / "64.slab")
    (disk_path / NS / "ab" / ("ab" + "0" * 62 + ".chunk")).symlink_to(victim / "precious")
    (disk_path / OTHER_NS).symlink_to(victim)
    (disk_path / ".free").symlink_to(victim)
    (disk_path / ".lock").symlink_to(victim / "precious")
    before, planted = _snapshot(victim), _snapshot(disk_path)
    _lifecycle(disk_path)
    assert _snapshot(victim) == before
    assert _snapshot(disk_path, skip=FOLDER_NAME) == planted


def test_symlinks_planted_in_tierstores_folder_are_skipped_and_named(
    tmp_path: Path, victim: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A slab file, a namespace folder, a chunk file of the old layout or a free list
    that is a symlink inside the tier's own folder: skipped at start with a warning
    naming it, a store into it refused naming it, its target never touched."""
    tier = DiskTier(tmp_path, 1 * MIB)
    tier.put(_id(1), _shard(64, 1))
    root = tier.root
    tier.close()
    (root / NS / "128.slab").symlink_to(victim / "precious")
    (root / OTHER_NS).symlink_to(victim)
    (root / NS / "ab").mkdir()
    (root / NS / "ab" / ("ab" + "0" * 62 + ".chunk")).symlink_to(victim / "precious")
    (root / ".free").symlink_to(victim)
    before = _snapshot(victim)

    with caplog.at_level(logging.WARNING):
        tier = DiskTier(tmp_path, 1 * MIB)
    warned = caplog.text
    assert f"{root / NS / '128.slab'}: a symlink" in warned
    assert f"{root / OTHER_NS}: a symlink" in warned
    assert list(dict(tier.items())) == [_id(1)]  # its own file still recovered
    with pytest.raises(TierFullError, match=str(root / NS / "128.slab")):
        tier.put(_id(2), _shard(128, 2))
    with pytest.raises(TierFullError, match=str(root / OTHER_NS)):
        tier.put(_id(3, OTHER_NS), _shard(64, 3))
    assert [r.location.path for r in chunk_records(tmp_path)] == [root / NS / "64.slab"]
    tier.close()
    _lifecycle(tmp_path)
    assert _snapshot(victim) == before
    for link in (root / NS / "128.slab", root / OTHER_NS, root / ".free"):
        assert link.is_symlink()  # skipped, never removed


def test_a_hard_link_planted_as_a_slab_file_is_skipped_and_its_file_untouched(
    tmp_path: Path, victim: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(tmp_path, 1 * MIB)
    tier.put(_id(1), _shard(64, 1))
    tier.close()
    os.chmod(victim / "64.slab", 0o600)  # private and this user's: only the link count tells
    planted = tier.root / OTHER_NS / "64.slab"
    planted.parent.mkdir(mode=0o700)
    os.link(victim / "64.slab", planted)
    before = _snapshot(victim)
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(tmp_path, 1 * MIB)
    assert f"skipping {planted}: {planted} has 2 hard links" in caplog.text
    with pytest.raises(TierFullError, match="hard links"):
        tier.put(_id(2, OTHER_NS), _shard(64, 2))
    assert list(dict(tier.items())) == [_id(1)]
    tier.close()
    assert _snapshot(victim) == before


def test_what_the_user_keeps_in_disk_path_is_untouched(tmp_path: Path) -> None:
    """A user's file and folders next to tierstore's folder (one with a hex name holding
    a file named like a slab, one shaped like the old layout's chunk files, a free list)
    keep their mode and bytes through start, stores, restart and drops; so does
    ``disk_path``'s own mode."""
    disk_path = tmp_path / "kv"
    disk_path.mkdir(mode=0o755)
    disk_path.chmod(0o755)
    (disk_path / "notes.txt").write_bytes(b"the user's notes")
    (disk_path / "notes.txt").chmod(0o644)
    (disk_path / USER_NS).mkdir(mode=0o755)
    (disk_path / USER_NS / "12.slab").write_bytes(b"the user's own data, not a slab")
    (disk_path / "data" / "ab").mkdir(parents=True)
    (disk_path / "data" / "ab" / "old.chunk").write_bytes(b"kept")
    (disk_path / "data" / "ab" / "draft.tmp").write_bytes(b"kept too")
    (disk_path / ".free").mkdir()
    (disk_path / ".free" / "x").write_bytes(b"the user's")
    before = _snapshot(disk_path)
    _lifecycle(disk_path)
    assert _snapshot(disk_path, skip=FOLDER_NAME) == before
    assert stat.S_IMODE(disk_path.stat().st_mode) == 0o755


def test_disk_path_is_made_if_missing_and_only_read_otherwise(tmp_path: Path) -> None:
    disk_path = tmp_path / "a" / "kv"
    tier = DiskTier(disk_path, 1 * MIB)
    assert stat.S_IMODE(disk_path.stat().st_mode) == 0o700
    assert sorted(os.listdir(disk_path)) == [FOLDER_NAME]
    tier.close()
    os.chmod(disk_path, 0o711)
    DiskTier(disk_path, 1 * MIB).close()
    assert stat.S_IMODE(disk_path.stat().st_mode) == 0o711
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        DiskTier(tmp_path / "file", 1 * MIB)


def test_the_marker_says_whose_folder_it_is_and_its_layout(tmp_path: Path) -> None:
    DiskTier(tmp_path, 1 * MIB).close()
    marker_path = tmp_path / FOLDER_NAME / MARKER_NAME
    marker = json.loads(marker_path.read_bytes())
    assert marker["layout"] == LAYOUT_VERSION and FOLDER_NAME.endswith(f"v{LAYOUT_VERSION}")
    assert marker["created_by"]["uid"] == os.geteuid()
    assert marker["created_by"]["host"] == socket.gethostname()
    assert stat.S_IMODE(marker_path.stat().st_mode) == 0o600


@pytest.mark.parametrize("content", ["a user's file", None])
def test_an_unmarked_folder_of_tierstores_name_is_refused_by_name(
    tmp_path: Path, content: str | None
) -> None:
    """Never adopted nor wiped (an empty one too, after a short wait for a marker that
    a NodeStore starting alongside might be writing)."""
    folder = tmp_path / FOLDER_NAME
    folder.mkdir(mode=0o700)
    if content is not None:
        (folder / "mine.txt").write_text(content)
        (folder / NS).mkdir()
    before = _snapshot(folder)
    with pytest.raises(ForeignFolderError, match=f"{folder} exists but is not tierstore's"):
        DiskTier(tmp_path, 1 * MIB)
    assert _snapshot(folder) == before


@pytest.mark.parametrize("marker", [b"{}", b"not json", json.dumps({"layout": 0}).encode()])
def test_a_folder_whose_marker_is_not_this_layouts_is_refused(
    tmp_path: Path, marker: bytes
) -> None:
    DiskTier(tmp_path, 1 * MIB).close()
    marker_path = tmp_path / FOLDER_NAME / MARKER_NAME
    marker_path.write_bytes(marker)
    with pytest.raises(ForeignFolderError, match=str(marker_path)):
        DiskTier(tmp_path, 1 * MIB)
    assert marker_path.read_bytes() == marker


def test_a_symlink_in_place_of_tierstores_folder_or_marker_is_refused(
    tmp_path: Path, victim: Path
) -> None:
    disk_path = tmp_path / "kv"
    disk_path.mkdir()
    (disk_path / FOLDER_NAME).symlink_to(victim)
    before = _snapshot(victim)
    with pytest.raises(UnsafePathError, match=str(disk_path / FOLDER_NAME)):
        DiskTier(disk_path, 1 * MIB)
    (disk_path / FOLDER_NAME).unlink()
    DiskTier(disk_path, 1 * MIB).close()
    marker = disk_path / FOLDER_NAME / MARKER_NAME
    marker.unlink()
    marker.symlink_to(victim / "precious")
    with pytest.raises(UnsafePathError, match=str(marker)):
        DiskTier(disk_path, 1 * MIB)
    assert _snapshot(victim) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_files_of_another_user_in_tierstores_folder_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(tmp_path, 1 * MIB)
    tier.put(_id(1), _shard(64, 1))
    tier.put(_id(2), _shard(128, 2))
    slab = tier.location_of(_id(2)).path
    tier.close()
    os.chown(slab, 65534, 65534)
    size = slab.stat().st_size
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(tmp_path, 1 * MIB)
    assert f"skipping {slab}: {slab} belongs to uid 65534" in caplog.text
    assert list(dict(tier.items())) == [_id(1)]
    with pytest.raises(TierFullError, match="belongs to uid 65534"):
        tier.put(_id(3), _shard(128, 3))
    tier.close()
    assert slab.stat().st_size == size
    os.chown(tmp_path / FOLDER_NAME, 65534, 65534)
    with pytest.raises(UnsafePathError, match="belongs to uid 65534"):
        DiskTier(tmp_path, 1 * MIB)


def test_two_tiers_starting_at_once_on_a_new_disk_path_share_one_marked_folder(
    tmp_path: Path,
) -> None:
    tiers: dict[str, DiskTier] = {}
    errors: list[BaseException] = []

    def start(node: str) -> None:
        try:
            tiers[node] = DiskTier(tmp_path / "kv", 1 * MIB, node_id=node)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    folder = tmp_path / "kv" / FOLDER_NAME
    roots = {node: tier.root for node, tier in tiers.items()}
    assert roots in ({"a": folder, "b": folder / "node-b"}, {"a": folder / "node-a", "b": folder})
    assert json.loads((folder / MARKER_NAME).read_bytes())["layout"] == LAYOUT_VERSION
    for tier in tiers.values():
        tier.close()


def test_an_older_layout_in_disk_path_is_named_and_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / NS).mkdir()
    (tmp_path / NS / "64.slab").write_bytes(bytes(8192))
    (tmp_path / ".lock").write_text("node-a")
    before = _snapshot(tmp_path)
    with caplog.at_level(logging.WARNING, logger=_FOLDER_LOG):
        DiskTier(tmp_path, 1 * MIB).close()
    assert f"disk_path {tmp_path} holds what looks like an older tierstore layout" in caplog.text
    assert f".lock, {NS}" in caplog.text
    assert _snapshot(tmp_path, skip=FOLDER_NAME) == before


# ---- room ------------------------------------------------------------------------------------
def test_a_capacity_past_the_filesystems_size_is_refused_before_anything_is_made(
    tmp_path: Path,
) -> None:
    fs = os.statvfs(tmp_path)
    total = fs.f_blocks * fs.f_frsize
    with pytest.raises(ConfigError) as refused:
        DiskTier(tmp_path / "kv", total + 1)
    message = str(refused.value)
    assert message.startswith("disk_bytes_per_node: ")
    assert f"filesystem mounted at {mount_of(tmp_path)} holding disk_path {tmp_path / 'kv'}" in (
        message
    )
    assert not (tmp_path / "kv").exists()


def test_less_free_room_than_the_capacity_is_a_warning_with_the_figures(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = os.statvfs(tmp_path)
    total = fs.f_blocks * fs.f_frsize
    with caplog.at_level(logging.WARNING, logger=_FOLDER_LOG):
        DiskTier(tmp_path, total).close()  # the whole filesystem: never all of it free
    assert f"disk_bytes_per_node: {size_of(total)} ({total} bytes) configured" in caplog.text
    assert f"mounted at {mount_of(tmp_path)} holding disk_path" in caplog.text


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of its own (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_capacity_past_a_small_filesystem_names_the_key_and_the_mount(small_fs: Path) -> None:
    disk_path = small_fs / "kv"
    with pytest.raises(ConfigError) as refused:
        DiskTier(disk_path, 64 << 30)
    assert str(refused.value).startswith(
        f"disk_bytes_per_node: 64 GiB ({64 << 30} bytes) exceeds the 4 MiB ({4 * MIB} bytes) "
        f"filesystem mounted at {small_fs} holding disk_path {disk_path}"
    )
    assert not disk_path.exists()


def test_free_room_on_a_small_filesystem_counts_what_tierstore_holds_there(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning compares the free space with what the tier may still grow by: its own
    files' bytes are not counted twice after a restart."""
    disk_path = small_fs / "kv"
    with caplog.at_level(logging.WARNING, logger=_FOLDER_LOG):
        tier = DiskTier(disk_path, 3 * MIB)
        for i in range(32):
            tier.put(_id(i), _shard(64 * KIB, i))  # 2 MiB (and 128 KiB of header pages)
        tier.close()
        tier = DiskTier(disk_path, 3 * MIB)  # ~1.8 MiB free, 0.9 MiB more to come: fine
        assert len(tier) == 32
        tier.close()
        assert "disk_bytes_per_node" not in caplog.text
        (small_fs / "filler").write_bytes(bytes(3 * MIB // 2))  # someone else's file
        DiskTier(disk_path, 3 * MIB).close()
    assert (
        f"disk_bytes_per_node: 3 MiB ({3 * MIB} bytes) configured, tierstore's files hold "
        f"2.125 MiB ({2176 * KIB} bytes) of it, and the filesystem mounted at {small_fs} "
        f"holding disk_path {disk_path} has only "
    ) in caplog.text
    assert "more it may take: disk writes will fail once it fills" in caplog.text
