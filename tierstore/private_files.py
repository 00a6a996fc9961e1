"""Private files on a shared host: directories only this user can enter, and locks that
never follow a planted link nor wait forever.

Every file tierstore creates outside a directory the user named (arena files in
``/dev/shm``, the Ray start lock in the temporary folder) lives in a directory made here:
mode 0700, owned by this user, not a symlink. A path another user planted fails with
:class:`UnsafePathError` naming it, never a hang and never a write through it.

Any thread may call these; only :func:`locked_file` blocks, and only up to its deadline.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from tierstore.errors import TierStoreError

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_LOCK_POLL_S = 0.05  # how often a held lock is tried again until its deadline


class UnsafePathError(TierStoreError, PermissionError):
    """A path tierstore would create or use is a symlink, another user's, or open to
    others: it is left alone, and the message names it."""


class LockTimeoutError(TierStoreError, TimeoutError):
    """A lock file stayed held by another process past the caller's deadline."""


def check_private(path: Path, st: os.stat_result, kind: int) -> None:
    """Raise :class:`UnsafePathError` unless ``st`` (an ``lstat``/``fstat`` of ``path``)
    is of ``kind`` (``stat.S_IFDIR`` or ``stat.S_IFREG``), owned by this user, and
    neither readable nor writable by group or others."""
    if stat.S_IFMT(st.st_mode) != kind:
        what = "a directory" if kind == stat.S_IFDIR else "a regular file"
        raise UnsafePathError(
            f"{path} is not {what} (a symlink or other file planted there?); tierstore "
            "leaves it alone: remove it, or point tierstore elsewhere"
        )
    if st.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
            "tierstore will not use another user's files: remove it, or point tierstore "
            "elsewhere"
        )
    if st.st_mode & 0o077:
        wanted = PRIVATE_DIR_MODE if kind == stat.S_IFDIR else PRIVATE_FILE_MODE
        raise UnsafePathError(
            f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); tierstore "
            f"keeps its files private: chmod {wanted:o} it, or remove it"
        )


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can enter: made 0700 if missing (its
    parent must exist), checked if present. Never chmods or follows what is there."""
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    check_private(path, os.lstat(path), stat.S_IFDIR)
    return path


def user_dir(base: Path, name: str = "tierstore") -> Path:
    """This user's private directory ``<base>/<name>-<uid>`` (e.g. in ``/dev/shm`` or
    the temporary folder), made on first use."""
    return private_dir(base / f"{name}-{os.geteuid()}")


def open_nofollow(path: Path, flags: int) -> int:
    """``os.open`` of ``path`` never through a symlink (``O_NOFOLLOW``, close-on-exec;
    created 0600 when ``flags`` has ``O_CREAT``). Raises :class:`UnsafePathError` naming
    ``path`` if it is a symlink; other errors (missing, no permission) as ``os.open``."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(
                f"{path} is a symlink; tierstore never reads or writes through one: remove it"
            ) from exc
        raise


def open_private(path: Path, flags: int) -> int:
    """:func:`open_nofollow` of a file that must be this user's and private (checked on
    the open descriptor). Raises :class:`UnsafePathError` for a planted file."""
    fd = open_nofollow(path, flags)
    try:
        check_private(path, os.fstat(fd), stat.S_IFREG)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def locked_file(path: Path, timeout_s: float) -> Iterator[int]:
    """Hold an exclusive ``flock`` on ``path`` (created 0600, never through a symlink)
    for the ``with`` block. Blocks the calling thread up to ``timeout_s``, then raises
    :class:`LockTimeoutError` naming the file."""
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"{path} is still locked by another process after {timeout_s:g} s; "
                        "if no tierstore process should hold it, remove the file"
                    ) from None
                time.sleep(_LOCK_POLL_S)
        yield fd
    finally:
        os.close(fd)  # releases the lock
