"""The arena on a shared host, on real files and processes: a live arena is never unlinked,
names match in full (two namespaces never share a file), what another user planted is
refused by name and never hangs, no symlink is followed, and a worker maps only the file
its NodeStore created."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import nodestore_process
from tierstore.data.arena.holders import HolderLock, holder_lock_path
from tierstore.data.arena.region import (
    SHM_DIR,
    ArenaError,
    ArenaMapping,
    ArenaRegion,
    arena_dir,
    arena_file_name,
)
from tierstore.private_files import UnsafePathError

MiB = 1 << 20
OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def bounded(call: Callable[[], object], timeout_s: float = 20.0) -> BaseException | None:
    """What ``call`` raised (None if nothing), failing the test if it runs past
    ``timeout_s``: a planted file must give an error, never a hang."""
    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            raised[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"hung for {time.monotonic() - started:.0f} s"
    return raised[0]


def _inode(path: str | Path) -> int:
    return os.lstat(path).st_ino


# ---- a live arena is never unlinked ---------------------------------------------------------
def test_a_live_arena_of_another_process_is_never_unlinked(node: str) -> None:
    proc, live = nodestore_process("ns-live", node, MiB)
    try:
        worker = ArenaMapping(live)  # a worker of the live NodeStore
        started = time.monotonic()
        with pytest.raises(ArenaError, match="live arena") as err:
            ArenaRegion.create("ns-live", node, MiB, held_wait_s=0.3)
        assert time.monotonic() - started < 10  # bounded
        message = str(err.value)
        assert live.path in message
        assert f"pid {proc.pid}" in message or "not visible" in message
        assert _inode(live.path) == live.inode  # the same file, still there
        assert not worker.replaced()
        assert worker.view(0, 8).tolist() == [7] * 8
        worker.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Its NodeStore gone, the same file is an orphan of ours: replaced.
    successor = ArenaRegion.create("ns-live", node, MiB, held_wait_s=5)
    try:
        assert successor.info.inode != live.inode and not successor.array.any()
    finally:
        successor.close()


def test_a_live_arena_held_by_an_fd_is_never_unlinked(
    node: str, regions: list[ArenaRegion]
) -> None:
    live = ArenaRegion.create("ns-live", node, MiB)
    regions.append(live)
    live.view(0, 4)[:] = 3
    with pytest.raises(ArenaError, match=re.escape(str(live.path))):
        ArenaRegion(live.path, MiB)
    with pytest.raises(ArenaError, match="live arena"):
        ArenaRegion.create("ns-live", node, MiB, held_wait_s=0)
    assert _inode(live.path) == live.info.inode
    mapping = ArenaMapping(live.info)
    assert mapping.view(0, 4).tolist() == [3] * 4
    mapping.close()


# ---- names match in full --------------------------------------------------------------------
@pytest.mark.parametrize(
    "namespace",
    [
        "ns-nl_\n",
        "ns-nl\n",
        "ns-nl_\r",
        "ns-nl_ ",
        "ns-nl\x00",
        "ns-nl\u0661",
        "ns-nl\u00e9",
        "ns+nl",
        "",
        "x" * 65,
    ],
)
def test_a_namespace_that_does_not_match_in_full_is_refused(
    namespace: str, node: str, regions: list[ArenaRegion]
) -> None:
    """Before, "ns-nl\\n" became "ns-nl_" in the file name: a second NodeStore replaced
    the live arena of "ns-nl_" and its workers mapped the other namespace's bytes."""
    live = ArenaRegion.create("ns-nl_", node, MiB)
    regions.append(live)
    with pytest.raises(ArenaError, match="cannot name an arena"):
        ArenaRegion.create(namespace, node, MiB, held_wait_s=0)
    with pytest.raises(ArenaError, match="node id"):
        ArenaRegion.create("ns-nl_", f"{node}\n", MiB, held_wait_s=0)
    assert _inode(live.path) == live.info.inode
    ours = [p.name for p in live.path.parent.iterdir() if p.name.endswith(node)]
    assert ours == [live.path.name]  # no second arena


def test_file_names_of_distinct_namespace_and_node_pairs_differ() -> None:
    assert arena_file_name("a-b", "c") != arena_file_name("a", "b-c")
    assert arena_file_name("a.b", "c") != arena_file_name("a", "b.c")


# ---- what another user planted --------------------------------------------------------------
@as_root
def test_a_dir_another_user_planted_for_ours_is_refused_by_name(node: str, tmp_path: Path) -> None:
    planted = tmp_path / f"tierstore-{os.geteuid()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    exc = bounded(lambda: ArenaRegion.create("ns-p", node, MiB, shm_dir=tmp_path))
    assert isinstance(exc, UnsafePathError), exc
    assert str(planted) in str(exc) and f"uid {OTHER_UID}" in str(exc)
    assert os.lstat(planted).st_uid == OTHER_UID and not any(planted.iterdir())


@as_root
def test_a_file_another_user_planted_for_our_dir_is_refused_by_name(
    node: str, tmp_path: Path
) -> None:
    planted = tmp_path / f"tierstore-{os.geteuid()}"
    planted.write_bytes(b"mine")
    os.chown(planted, OTHER_UID, OTHER_UID)
    exc = bounded(lambda: ArenaRegion.create("ns-p", node, MiB, shm_dir=tmp_path))
    assert isinstance(exc, UnsafePathError) and str(planted) in str(exc), exc
    assert planted.read_bytes() == b"mine"


@as_root
def test_a_file_of_another_user_where_the_arena_goes_is_refused_and_left(node: str) -> None:
    """In /dev/shm itself: the private directory is ours, the file in it is not."""
    planted = arena_dir(SHM_DIR) / arena_file_name("ns-p", node)
    planted.write_bytes(b"\0" * 4096)
    os.chmod(planted, 0o600)
    os.chown(planted, OTHER_UID, OTHER_UID)
    try:
        exc = bounded(lambda: ArenaRegion.create("ns-p", node, MiB, held_wait_s=0))
        assert isinstance(exc, UnsafePathError), exc
        assert str(planted) in str(exc) and f"uid {OTHER_UID}" in str(exc)
        assert os.lstat(planted).st_uid == OTHER_UID  # never unlinked
    finally:
        planted.unlink()


def test_a_fifo_where_the_arena_goes_is_refused_without_a_hang(node: str) -> None:
    planted = arena_dir(SHM_DIR) / arena_file_name("ns-p", node)
    os.mkfifo(planted, 0o600)
    try:
        exc = bounded(lambda: ArenaRegion.create("ns-p", node, MiB, held_wait_s=0))
        assert isinstance(exc, UnsafePathError) and str(planted) in str(exc), exc
        assert os.path.exists(planted)
    finally:
        planted.unlink()


# ---- symlinks are never followed ------------------------------------------------------------
def test_a_symlink_where_the_arena_goes_is_not_followed(node: str, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1024)
    os.chmod(victim, 0o600)
    link = arena_dir(SHM_DIR) / arena_file_name("ns-s", node)
    link.symlink_to(victim)
    try:
        exc = bounded(lambda: ArenaRegion.create("ns-s", node, MiB, held_wait_s=0))
        assert isinstance(exc, UnsafePathError) and str(link) in str(exc), exc
        assert link.is_symlink()
        assert victim.read_bytes() == b"precious" * 1024
    finally:
        link.unlink()


def test_a_symlink_where_a_holder_file_goes_is_not_followed(
    node: str, tmp_path: Path, regions: list[ArenaRegion]
) -> None:
    region = ArenaRegion.create("ns-s", node, MiB)
    regions.append(region)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.chmod(victim, 0o600)
    holder = "ab" * 16
    link = holder_lock_path(region.info.path, holder)
    link.symlink_to(victim)
    try:
        with pytest.raises(UnsafePathError, match=re.escape(str(link))):
            HolderLock(region.info.path, holder)
        assert victim.read_bytes() == b"precious" and link.is_symlink()
    finally:
        link.unlink()


# ---- a worker maps only its NodeStore's file ------------------------------------------------
def test_a_worker_maps_only_the_file_its_node_store_created(
    node: str, tmp_path: Path, regions: list[ArenaRegion]
) -> None:
    region = ArenaRegion.create("ns-w", node, MiB)
    regions.append(region)
    info = region.info
    os.unlink(info.path)  # another file of the same size takes the name
    fd = os.open(info.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, info.nbytes)
        with pytest.raises(ArenaError, match="not the file the NodeStore created"):
            ArenaMapping(info)
    finally:
        os.close(fd)
        os.unlink(info.path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * info.nbytes)
    os.chmod(victim, 0o600)
    os.symlink(victim, info.path)  # a link to a file of ours is not followed either
    try:
        with pytest.raises(UnsafePathError, match="symlink"):
            ArenaMapping(info)
    finally:
        os.unlink(info.path)
