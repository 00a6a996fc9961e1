"""Removing arenas and holder files that no live process holds.

A NodeStore holds an ``flock`` on its arena file for its life, a worker one on its holder
file (:mod:`tierstore.data.arena.locks`). A killed NodeStore runs no shutdown hook, so its
arena (``cpu_bytes_per_node`` of memory in ``/dev/shm``) stays until someone removes it.
:func:`sweep_orphans` is that someone: every NodeStore at start (any namespace: a
namespace whose NodeStores never come back would otherwise keep its arenas until
reboot), and the tests after each module.

Only this user's private directory under the base (``/dev/shm/tierstore-<uid>``, made by
:func:`tierstore.private_files.user_dir`) is swept, and only files that look like ours
there: a name ``tierstore-<ns>+<node>`` (or its ``.holder-<hex>.lock``), a regular file
of this user with no group or other bits, and an arena's size a whole number of pages.
The directory is opened once (never through a symlink, and only if it is this user's,
mode 0700) and every look, lock and unlink is relative to it: nothing outside it is
touched, nor any file through a symlink.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from tierstore.private_files import UnsafePathError, check_private

logger = logging.getLogger(__name__)

# A file is created a moment before its creator locks it; younger than this, it is left.
ORPHAN_AGE_S = 60.0
_NAME = r"[A-Za-z0-9_.-]{1,64}"
_ARENA = re.compile(rf"tierstore-{_NAME}\+{_NAME}", re.ASCII)
_HOLDER = re.compile(rf"tierstore-{_NAME}\+{_NAME}\.holder-[0-9a-f]{{8,64}}\.lock", re.ASCII)


@dataclass
class Swept:
    """What one sweep removed."""

    paths: list[Path] = field(default_factory=list)
    nbytes: int = 0


def private_dir_of(base: Path) -> Path:
    """Where this user's arenas and holder files live under ``base``."""
    return base / f"tierstore-{os.geteuid()}"


def looks_like_ours(name: str, st: os.stat_result) -> bool:
    """Whether a file of this ``name`` and ``lstat`` is a tierstore arena or holder file
    of this user's (a symlink, another user's file or one open to others never is)."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return False
    if _HOLDER.fullmatch(name):
        return True
    return bool(_ARENA.fullmatch(name)) and st.st_size > 0 and st.st_size % mmap.PAGESIZE == 0


def _unlink_if_unlocked(dir_fd: int, name: str, st: os.stat_result) -> bool:
    """Unlink ``name`` (in ``dir_fd``) while holding its lock, so its owner cannot take
    it in between; only if it is still the file that was looked at."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not looks_like_ours(name, now):
            return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:  # held (BlockingIOError), or gone meanwhile
        return False
    finally:
        os.close(fd)


def _open_dir(directory: Path) -> int | None:
    """An fd of ``directory`` if it is this user's private directory; None if missing.
    Logs (and skips) one that is not: a symlink, another user's, open to others."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            logger.warning("not sweeping %s: %s", directory, exc)
        elif exc.errno == errno.ENOTDIR:
            logger.warning("not sweeping %s: not a directory (a symlink?)", directory)
        return None
    try:
        check_private(directory, os.fstat(fd), stat.S_IFDIR)
    except UnsafePathError as exc:
        os.close(fd)
        logger.warning("not sweeping: %s", exc)
        return None
    return fd


def sweep_orphans(base: Path, min_age_s: float = ORPHAN_AGE_S) -> Swept:
    """Remove every tierstore arena and holder file in this user's private directory
    under ``base`` (e.g. ``/dev/shm``) whose lock nobody holds, of any namespace, last
    modified at least ``min_age_s`` ago. Logs what it removed. Safe against live
    NodeStores and workers on this machine: a held lock, or a file too young to be
    locked yet, is left alone; so is anything not this user's own file."""
    swept = Swept()
    directory = private_dir_of(base)
    dir_fd = _open_dir(directory)
    if dir_fd is None:
        return swept
    try:
        settled = time.time() - min_age_s
        with os.scandir(dir_fd) as entries:
            names = sorted(e.name for e in entries if e.name.startswith("tierstore-"))
        for name in names:
            try:
                st = os.lstat(name, dir_fd=dir_fd)
            except OSError:
                continue
            if st.st_mtime > settled or not looks_like_ours(name, st):
                continue
            if _unlink_if_unlocked(dir_fd, name, st):
                swept.paths.append(directory / name)
                swept.nbytes += st.st_size
    finally:
        os.close(dir_fd)
    if swept.paths:
        logger.info(
            "removed %d orphaned tierstore arena/holder files from %s (%d bytes): %s",
            len(swept.paths),
            directory,
            swept.nbytes,
            ", ".join(p.name for p in swept.paths),
        )
    return swept
