"""Liveness by ``flock``: a process holds an exclusive lock on its file for its life, so
another process that can take that lock knows the first one is gone (the kernel drops a
dead process's locks). Used for an arena's NodeStore and for each worker holding extents.

Every open here is ``O_NOFOLLOW | O_NONBLOCK`` (a planted symlink is not followed, a
planted FIFO does not hang the open) and only of a regular file of this user's.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from tierstore.private_files import check_private

_PROBE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_own(path: Path) -> int | None:
    """A read-only fd of ``path`` if it is a regular file of this user's; else None."""
    try:
        fd = os.open(path, _PROBE_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            return None
    except OSError:
        os.close(fd)
        return None
    return fd


def lock_is_free(path: Path) -> bool | None:
    """Whether nobody holds ``path``'s lock (probed, then released); None if the file
    cannot be opened (gone, not a regular file, or not this user's)."""
    fd = _open_own(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases the lock if it was taken
    return True


def unlink_if_free(path: Path, expect: os.stat_result | None = None) -> bool:
    """Unlink ``path`` while holding its lock, so its owner cannot take it in between:
    only a regular file of this user's that nobody holds (and, given ``expect``, still
    the file that was looked at: same device and inode). Returns whether it was removed.
    """
    fd = _open_own(path)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.fstat(fd)
        if expect is not None and (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino):
            return False
        check_private(path, st, stat.S_IFREG)
        now = os.lstat(path)  # the name still names this very file
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(path)
        return True
    except OSError:  # held (BlockingIOError), gone meanwhile, or not private
        return False
    finally:
        os.close(fd)


def lock_holders(path: Path) -> list[int]:
    """Pids holding an ``flock`` on ``path`` as ``/proc/locks`` reports them (best effort:
    empty where it cannot tell, e.g. a holder in another pid namespace)."""
    try:
        st = os.lstat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids = []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[2] == "->":
            continue
        try:
            major, minor, ino = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == want and int(fields[4]) > 0:
                pids.append(int(fields[4]))
        except ValueError:
            continue
    return sorted(set(pids))


def describe_holders(path: Path) -> str:
    """Who holds ``path``'s lock, in words, for an error message."""
    pids = lock_holders(path)
    if not pids:
        return "a live process (its pid is not visible from here)"
    names = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
            names.append(f"pid {pid} ({cmd.decode(errors='replace')[:120]})")
        except OSError:
            names.append(f"pid {pid}")
    return ", ".join(names)
