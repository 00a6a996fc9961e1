"""Private directories and lock files: what another local user planted is refused by
name, and a held lock gives up at its deadline."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

import pytest

from tierstore.private_files import (
    LockTimeoutError,
    UnsafePathError,
    locked_file,
    open_private,
    private_dir,
    user_dir,
)

OTHER_UID = 65534  # nobody


def test_a_private_dir_is_made_0700_and_reused(tmp_path: Path) -> None:
    made = user_dir(tmp_path)
    assert made == tmp_path / f"tierstore-{os.geteuid()}"
    assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700
    assert user_dir(tmp_path) == made


def test_a_symlink_planted_for_the_dir_is_refused_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / f"tierstore-{os.geteuid()}").symlink_to(target)
    with pytest.raises(UnsafePathError, match="not a directory"):
        user_dir(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_dir_another_user_planted_is_refused_by_name(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePathError, match=f"{planted}.*uid {OTHER_UID}"):
        private_dir(planted)


def test_a_dir_open_to_others_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafePathError, match="open to other users"):
        private_dir(shared)
    assert stat.S_IMODE(os.lstat(shared).st_mode) == 0o777  # never chmodded


def test_a_symlinked_file_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "lock"
    link.symlink_to(victim)
    with pytest.raises(UnsafePathError, match="symlink"):
        open_private(link, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    assert victim.read_bytes() == b"precious"


def test_a_held_lock_times_out_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "start.lock"
    with locked_file(path, timeout_s=1.0):
        holder = os.open(path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another process's hold, as far as flock knows
    try:
        started = time.monotonic()
        with pytest.raises(LockTimeoutError, match=str(path)), locked_file(path, 0.3):
            pass
        assert 0.3 <= time.monotonic() - started < 5
    finally:
        os.close(holder)
    with locked_file(path, timeout_s=1.0):  # free again once released
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
