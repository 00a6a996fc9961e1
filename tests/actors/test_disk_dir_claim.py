"""A restarted NodeStore keeps its node's disk directory, even while the killed one's
process (which holds the directory's lock) has not exited yet; another node's NodeStore
on the same machine takes a directory of its own at once, and keeps it when restarted
after root's holder left."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

from tierstore.actors.node_store_actor import _claim_disk_dir


def _hold(path: Path, node_id: str):
    lock = open(path / ".lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.truncate(0)
    lock.write(node_id)
    lock.flush()
    return lock


def test_a_restarted_node_store_waits_for_its_predecessor_and_keeps_the_directory(
    tmp_path: Path,
) -> None:
    path, first = _claim_disk_dir(tmp_path, "node-a")
    assert path == tmp_path
    # The predecessor's process exits (its lock goes) only after the successor started.
    threading.Timer(0.5, first.close).start()
    path, second = _claim_disk_dir(tmp_path, "node-a")
    assert path == tmp_path
    second.close()


def test_another_nodes_node_store_takes_a_directory_of_its_own(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    held = _hold(tmp_path, "node-a")
    path, lock = _claim_disk_dir(tmp_path, "node-b")
    assert path == tmp_path / "node-node-b"
    assert (tmp_path / ".lock").read_text() == "node-a"  # the holder's id is left alone
    lock.close()
    held.close()


def test_a_node_with_a_directory_of_its_own_keeps_it_after_roots_holder_left(
    tmp_path: Path,
) -> None:
    held = _hold(tmp_path, "node-a")
    path, lock = _claim_disk_dir(tmp_path, "node-b")
    assert path == tmp_path / "node-node-b"
    (path / "chunk").write_bytes(b"kept")
    lock.close()
    held.close()  # node-a is removed: root is free now
    path, lock = _claim_disk_dir(tmp_path, "node-b")  # node-b's NodeStore restarts
    assert path == tmp_path / "node-node-b"
    assert (path / "chunk").read_bytes() == b"kept"
    lock.close()
