"""A NodeStore's arena file goes with the NodeStore, however it dies (``ray down``
kills NodeStores with their raylets; each node's arena stayed in /dev/shm): its reaper
unlinks it once the process is gone, and never a file made in its place nor one whose
lock a live process holds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support import nodestore_process
from tierstore.data.arena.reaper import reap

MiB = 1 << 20


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _wait_gone(path: str, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while os.path.lexists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.lexists(path)


def test_a_killed_nodestores_arena_is_removed_by_its_reaper(tmp_path: Path) -> None:
    proc, info = nodestore_process("ns-reap", "n1", MiB, shm_dir=tmp_path, reaper=True)
    time.sleep(0.5)
    assert os.lstat(info.path).st_ino == info.inode  # kept while its NodeStore lives
    proc.kill()  # no shutdown hook runs
    proc.wait()
    assert _wait_gone(info.path)


def test_the_reaper_leaves_a_file_made_in_its_place_and_a_held_one(tmp_path: Path) -> None:
    first, old = nodestore_process("ns-reap", "n1", MiB, shm_dir=tmp_path)
    kept = os.open(old.path, os.O_RDONLY)  # the reaper's descriptor: the inode stays
    first.kill()
    first.wait()
    second, new = nodestore_process("ns-reap", "n1", MiB, shm_dir=tmp_path)
    try:
        assert not reap(_dead_pid(), kept, Path(old.path))  # another file took the name
        assert not reap(_dead_pid(), os.open(new.path, os.O_RDONLY), Path(new.path))  # held
        assert os.lstat(new.path).st_ino == new.inode
    finally:
        second.kill()
        second.wait()
    assert reap(_dead_pid(), os.open(new.path, os.O_RDONLY), Path(new.path))  # free: removed
    assert not os.path.lexists(new.path)
