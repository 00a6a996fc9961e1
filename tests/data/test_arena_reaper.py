"""A NodeStore's arena file goes with the NodeStore, however it dies (``ray down``
kills NodeStores with their raylets; each node's arena stayed in /dev/shm): its reaper
unlinks it once the process is gone, and never a file made in its place nor one whose
lock a live process holds. The reaper itself lives no longer than its NodeStore (plus a
moment), and at once lets go of a file its NodeStore removed in order (its descriptor
would keep the file's pages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from tests.support import nodestore_process, poll, wait_for
from tierstore.data.arena.reaper import is_reaper, reap
from tierstore.wire import RegionInfo

MiB = 1 << 20
_GONE_S = 10.0  # the reaper wakes at once; a loaded machine may take a while to run it


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _reapers_of(path: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if is_reaper(proc.info["cmdline"] or [], path):
            found.append(proc.pid)
    return found


def test_a_killed_nodestores_arena_is_removed_and_its_reaper_exits(tmp_path: Path) -> None:
    proc, info = nodestore_process("ns-reap", "n1", MiB, shm_dir=tmp_path, reaper=True)
    try:
        wait_for(lambda: _reapers_of(info.path), "the arena's reaper", _GONE_S)
        assert os.lstat(info.path).st_ino == info.inode  # kept while its NodeStore lives
    finally:
        proc.kill()  # no shutdown hook runs
        proc.wait()
    assert not poll(lambda: os.path.lexists(info.path), _GONE_S, done=lambda x: not x)
    assert poll(lambda: _reapers_of(info.path), _GONE_S, done=lambda x: not x) == []


_ORDERLY = """
import dataclasses, json, sys, time
from pathlib import Path
from tierstore.data.arena.region import ArenaRegion
from tierstore.data.arena.reaper import start_reaper
r = ArenaRegion.create("ns-reap", "n2", 1 << 20, shm_dir=Path(sys.argv[1]), held_wait_s=0)
reaper = start_reaper(r.info)
print(json.dumps(dataclasses.asdict(r.info)), flush=True)
sys.stdin.readline()
r.close()  # as NodeStore.__ray_shutdown__
reaper.release()
print("stopped", flush=True)
time.sleep(600)
"""


def test_an_orderly_stop_lets_the_reaper_go_while_the_nodestore_lives(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORDERLY, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        info = RegionInfo(**json.loads(proc.stdout.readline()))
        wait_for(lambda: _reapers_of(info.path), "the arena's reaper", _GONE_S)
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "stopped\n"
        assert not os.path.lexists(info.path)
        # Its reaper exits while the NodeStore still runs: no process keeps the pages.
        assert poll(lambda: _reapers_of(info.path), _GONE_S, done=lambda x: not x) == []
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_the_reaper_leaves_a_file_made_in_its_place_and_a_held_one(tmp_path: Path) -> None:
    first, old = nodestore_process("ns-reap", "n1", MiB, shm_dir=tmp_path)
    kept = os.open(old.path, os.O_RDONLY)  # the reaper's descriptor: the inode stays
    first.kill()
    first.wait()
    second, new = nodestore_process("ns-reap", "n1", MiB, shm_dir=tmp_path)
    try:
        assert not reap(_dead_pid(), None, kept, Path(old.path))  # another file took the name
        held = os.open(new.path, os.O_RDONLY)
        assert not reap(_dead_pid(), None, held, Path(new.path), lock_wait_s=0.5)  # held
        assert os.lstat(new.path).st_ino == new.inode
    finally:
        second.kill()
        second.wait()
    assert reap(_dead_pid(), None, os.open(new.path, os.O_RDONLY), Path(new.path))  # free: removed
    assert not os.path.lexists(new.path)


def test_a_reaper_never_removes_a_file_open_to_others(tmp_path: Path) -> None:
    first, info = nodestore_process("ns-reap", "n3", MiB, shm_dir=tmp_path)
    first.kill()
    first.wait()
    os.chmod(info.path, 0o644)  # not tierstore's private file (any more)
    assert not reap(_dead_pid(), None, os.open(info.path, os.O_RDONLY), Path(info.path))
    assert os.lstat(info.path).st_ino == info.inode
    os.unlink(info.path)


_FORKS = """
import dataclasses, json, os, sys, time
from pathlib import Path
from tierstore.data.arena.region import ArenaRegion
from tierstore.data.arena.reaper import start_reaper
r = ArenaRegion.create("ns-reap", "n5", 1 << 20, shm_dir=Path(sys.argv[1]), held_wait_s=0)
reaper = start_reaper(r.info)
if os.fork() == 0:  # a child with the owner's descriptors, so its lock: exits a bit later
    time.sleep(2)
    os._exit(0)
print(json.dumps(dataclasses.asdict(r.info)), flush=True)
time.sleep(600)
"""


def test_a_lock_that_outlives_its_nodestore_a_moment_is_waited_for(tmp_path: Path) -> None:
    # ray_up_check saw it once: the owner's lock, held through its mapping too, was
    # still taken when its exit woke the reaper, and the arena stayed.
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKS, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    info = RegionInfo(**json.loads(proc.stdout.readline()))
    wait_for(lambda: _reapers_of(info.path), "the arena's reaper", _GONE_S)
    proc.kill()
    proc.wait()
    assert not poll(lambda: os.path.lexists(info.path), _GONE_S, done=lambda x: not x)
