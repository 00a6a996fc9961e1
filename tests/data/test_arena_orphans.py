"""The orphan sweep on real files in a directory standing for /dev/shm: arenas and holder
files of any namespace whose lock nobody holds go; a live NodeStore's arena, a live
worker's holder file, a young file and files that are not ours stay, and so does anything
of another user's or behind a symlink."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from tests.support import holder_process
from tierstore.data.arena.orphans import sweep_orphans
from tierstore.data.arena.region import ArenaRegion, arena_dir, arena_file_name

KiB = 1 << 10
MiB = 1 << 20
OTHER_UID = 65534  # nobody


def _age(*paths: Path) -> None:
    old = time.time() - 3600
    for path in paths:
        os.utime(path, (old, old))


def _orphan(path: Path, nbytes: int) -> Path:
    path.write_bytes(b"\0" * nbytes)
    path.chmod(0o600)
    return path


def test_orphans_of_every_namespace_go_and_live_files_stay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    private = arena_dir(tmp_path)
    live = ArenaRegion(private / arena_file_name("ns-a", "live"), MiB)
    proc, holder = holder_process(str(live.path))
    try:
        held = Path(f"{live.path}.holder-{holder}.lock")
        assert held.exists()
        dead_a = _orphan(private / arena_file_name("ns-a", "dead"), 64 * KiB)
        dead_b = _orphan(private / arena_file_name("other.ns", "gone"), 128 * KiB)
        dead_holder = _orphan(Path(f"{dead_b}.holder-{'ab' * 16}.lock"), 0)
        not_ours = _orphan(private / "tierstore-heavy.lock", 0)  # the tests' flock file
        odd_size = _orphan(private / arena_file_name("ns-c", "log"), 100)
        young = _orphan(private / arena_file_name("ns-d", "new"), 4 * KiB)
        outside = _orphan(tmp_path / arena_file_name("ns-e", "out"), 64 * KiB)
        _age(live.path, held, dead_a, dead_b, dead_holder, not_ours, odd_size, outside)

        with caplog.at_level(logging.INFO, logger="tierstore.data.arena.orphans"):
            swept = sweep_orphans(tmp_path)

        assert sorted(swept.paths) == sorted([dead_a, dead_b, dead_holder])
        assert swept.nbytes == 192 * KiB
        assert "196608 bytes" in caplog.text
        for path in (live.path, held, not_ours, odd_size, young, outside):
            assert path.exists(), path
        for path in (dead_a, dead_b, dead_holder):
            assert not path.exists(), path
    finally:
        proc.kill()
        proc.wait()
    # The worker died: its holder file is an orphan now, like any other.
    assert sweep_orphans(tmp_path).paths == [held]
    assert live.path.exists()
    live.close()


def test_a_new_nodestore_sweeps_other_namespaces(tmp_path: Path) -> None:
    """ArenaRegion.create (a NodeStore's start) sweeps its directory, any namespace."""
    dead = _orphan(arena_dir(tmp_path) / arena_file_name("ns-gone", "n1"), 64 * KiB)
    _age(dead)
    region = ArenaRegion.create("ns-new", "n2", MiB, shm_dir=tmp_path)
    try:
        assert not dead.exists()
        assert region.path.parent == arena_dir(tmp_path)
    finally:
        region.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_the_sweep_never_removes_a_file_of_another_user(tmp_path: Path) -> None:
    private = arena_dir(tmp_path)
    theirs = _orphan(private / arena_file_name("ns-t", "n1"), 64 * KiB)
    their_holder = _orphan(Path(f"{theirs}.holder-{'cd' * 16}.lock"), 0)
    for path in (theirs, their_holder):
        os.chown(path, OTHER_UID, OTHER_UID)
    _age(theirs, their_holder)
    assert sweep_orphans(tmp_path).paths == []
    assert theirs.exists() and their_holder.exists()


def test_the_sweep_never_goes_through_a_symlink(tmp_path: Path) -> None:
    """Neither a link named like an arena (the link and its target stay) nor a link
    where the private directory goes (nothing behind it is looked at)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    target = _orphan(elsewhere / arena_file_name("ns-t", "n1"), 64 * KiB)
    link = arena_dir(tmp_path) / arena_file_name("ns-t", "n2")
    link.symlink_to(target)
    _age(target)
    os.utime(link, (time.time() - 3600,) * 2, follow_symlinks=False)
    assert sweep_orphans(tmp_path).paths == []
    assert link.is_symlink() and target.exists()

    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    (base / f"tierstore-{os.geteuid()}").symlink_to(elsewhere)
    assert sweep_orphans(base).paths == []
    assert target.exists()
