"""Two NodeStores never share one disk directory at once. A restarted NodeStore keeps its
node's directory, even while the killed one's process (which holds the directory's
lock) has not exited yet; another node's NodeStore on the same machine takes a
directory of its own at once, and keeps it when restarted after the first holder left.
Every lock is in tierstore's folder (never in ``disk_path`` itself), opened without
following a symlink, and waited on up to a deadline, then refused naming its holders."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from tierstore.data.tiers.disk import DiskTier
from tierstore.data.tiers.disk_folder import (
    FOLDER_NAME,
    LOCK_NAME,
    DiskFolderBusyError,
    claim,
    open_folder,
)
from tierstore.private_files import UnsafePathError

CAPACITY = 1 << 20


def _hold(path: Path, node_id: str) -> int:
    """Another process's lock on ``path`` (a descriptor of its own: flock tells them
    apart), with its node id written in it."""
    path.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, node_id.encode())
    return fd


def test_a_restarted_node_store_waits_for_its_predecessor_and_keeps_the_directory(
    tmp_path: Path,
) -> None:
    first = DiskTier(tmp_path, CAPACITY, node_id="node-a")
    assert first.root == tmp_path / FOLDER_NAME
    # The predecessor's process exits (its lock goes) only after the successor started.
    threading.Timer(0.5, first.close).start()
    second = DiskTier(tmp_path, CAPACITY, node_id="node-a")
    assert second.root == tmp_path / FOLDER_NAME
    second.close()
    assert sorted(os.listdir(tmp_path)) == [FOLDER_NAME]  # nothing of tierstore's outside


def test_another_nodes_node_store_takes_a_directory_of_its_own(tmp_path: Path) -> None:
    folder = open_folder(tmp_path)
    held = _hold(folder, "node-a")
    tier = DiskTier(tmp_path, CAPACITY, node_id="node-b")
    assert tier.root == folder / "node-node-b"
    assert (folder / LOCK_NAME).read_text() == "node-a"  # the holder's id is left alone
    tier.close()
    os.close(held)


def test_a_node_with_a_directory_of_its_own_keeps_it_after_roots_holder_left(
    tmp_path: Path,
) -> None:
    folder = open_folder(tmp_path)
    held = _hold(folder, "node-a")
    path, lock = claim(folder, "node-b")
    assert path == folder / "node-node-b"
    (path / "chunk").write_bytes(b"kept")
    os.close(lock)
    os.close(held)  # node-a is removed: the folder itself is free now
    path, lock = claim(folder, "node-b")  # node-b's NodeStore restarts
    assert path == folder / "node-node-b"
    assert (path / "chunk").read_bytes() == b"kept"
    os.close(lock)


def test_held_directories_are_refused_by_name_at_the_deadline(tmp_path: Path) -> None:
    """A predecessor that never exits: after the deadline, and not before, the claim
    fails naming what holds each directory (never a hang, never a shared directory)."""
    folder = open_folder(tmp_path)
    held = [_hold(folder, "node-a"), _hold(folder / "node-node-a", "node-a")]
    started = time.monotonic()
    with pytest.raises(DiskFolderBusyError, match=f"{folder} by node node-a") as refused:
        DiskTier(tmp_path, CAPACITY, node_id="node-a", claim_timeout_s=0.5)
    assert 0.5 <= time.monotonic() - started < 5
    assert f"{folder / 'node-node-a'} by node node-a" in str(refused.value)
    for fd in held:
        os.close(fd)


def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    folder = open_folder(tmp_path)
    target = tmp_path / "target"
    target.write_bytes(b"someone's file")
    (folder / LOCK_NAME).symlink_to(target)
    with pytest.raises(UnsafePathError, match=f"{folder / LOCK_NAME} is a symlink"):
        DiskTier(tmp_path, CAPACITY, node_id="node-a")
    assert target.read_bytes() == b"someone's file"


def test_a_node_id_never_names_a_path_outside_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="node id"):
        DiskTier(tmp_path, CAPACITY, node_id="../../etc")
    assert not list(tmp_path.iterdir())  # refused before anything was made
