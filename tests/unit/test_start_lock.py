"""The lock that keeps one user's engines from starting two local Ray clusters: private to
the user, never followed through a link, and never waited on forever."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
from tierstore.actors import bootstrap

from tierstore.config import TierStoreConfig
from tierstore.private_files import LockTimeoutError, UnsafePathError

_DEADLINE_S = 1.0
# A deadline's overshoot allowed here: one poll of the lock, and a loaded machine.
_SLACK_S = 5.0

_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary folder, for bootstrap, is this test's own (no one else's lock)."""
    assert not ray.is_initialized()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(bootstrap, "_START_LOCK_TIMEOUT_S", _DEADLINE_S)
    return tmp_path


def test_a_held_start_lock_fails_naming_the_file_within_its_deadline(private_tmp: Path) -> None:
    lock = bootstrap.start_lock_path()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(LockTimeoutError) as error:
            bootstrap.connect(TierStoreConfig(cpu_bytes_per_node=1 << 20))
        assert time.monotonic() - started < _DEADLINE_S + _SLACK_S
    finally:
        holder.kill()
        holder.wait()
    assert str(lock) in str(error.value)
    assert "ray_address" in str(error.value)  # what to do instead
    assert not ray.is_initialized()


def test_the_start_lock_lives_in_a_directory_only_this_user_can_enter(private_tmp: Path) -> None:
    lock = bootstrap.start_lock_path()
    assert lock.parent == private_tmp / f"tierstore-{os.geteuid()}"
    assert stat.S_IMODE(lock.parent.stat().st_mode) == 0o700


def test_a_symlink_planted_as_the_start_lock_is_refused_not_followed(private_tmp: Path) -> None:
    target = private_tmp / "victim"
    target.write_text("keep")
    bootstrap.start_lock_path().symlink_to(target)
    with pytest.raises(UnsafePathError, match="symlink"):
        bootstrap.connect(TierStoreConfig(cpu_bytes_per_node=1 << 20))
    assert target.read_text() == "keep"
