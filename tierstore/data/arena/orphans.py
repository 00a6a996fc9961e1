"""Removing arenas and holder files that no live process holds.

A NodeStore holds an ``flock`` on its arena file for its life, a worker one on its holder
file (:mod:`tierstore.data.arena.locks`). A killed NodeStore runs no shutdown hook, so its
arena (``cpu_bytes_per_node`` of memory in ``/dev/shm``) stays until someone removes it.
:func:`sweep_orphans` is that someone: every NodeStore at start (any namespace: a
namespace whose NodeStores never come back would otherwise keep its arenas until
reboot), and the tests after each module.

Only files that look like ours are touched: a name ``tierstore-<ns>-<node>`` (or its
``.holder-<hex>.lock``), a regular file of this user with no group or other bits, and an
arena's size a whole number of pages. The fallback directory may be ``/tmp``, where other
``tierstore-*`` files (the tests' ``tierstore-heavy.lock``) live.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

# A file is created a moment before its creator locks it; younger than this, it is left.
ORPHAN_AGE_S = 60.0
_ARENA = re.compile(r"^tierstore-[A-Za-z0-9_.-]+-[A-Za-z0-9_.-]+$")
_HOLDER = re.compile(r"^tierstore-[A-Za-z0-9_.-]+-[A-Za-z0-9_.-]+\.holder-[0-9a-f]{8,64}\.lock$")


@dataclass
class Swept:
    """What one sweep removed."""

    paths: list[Path] = field(default_factory=list)
    nbytes: int = 0


def _looks_like_ours(path: Path, st: os.stat_result) -> bool:
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return False
    if _HOLDER.match(path.name):
        return True
    return bool(_ARENA.match(path.name)) and st.st_size > 0 and st.st_size % mmap.PAGESIZE == 0


def _unlink_if_unlocked(path: Path, st: os.stat_result) -> bool:
    """Unlink ``path`` while holding its lock, so its owner cannot take it in between;
    only if it is still the file that was looked at."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != st.st_ino:
            return False
        path.unlink()
        return True
    except OSError:  # held (BlockingIOError), or gone meanwhile
        return False
    finally:
        os.close(fd)


def sweep_orphans(directory: Path, min_age_s: float = ORPHAN_AGE_S) -> Swept:
    """Remove every tierstore arena and holder file in ``directory`` whose lock nobody
    holds, of any namespace, last modified at least ``min_age_s`` ago. Logs what it
    removed. Safe against live NodeStores and workers on this machine: a held lock, or a
    file too young to be locked yet, is left alone."""
    swept = Swept()
    settled = time.time() - min_age_s
    try:
        candidates = sorted(directory.glob("tierstore-*"))
    except OSError:
        return swept
    for path in candidates:
        try:
            st = path.lstat()
        except OSError:
            continue
        if st.st_mtime > settled or not _looks_like_ours(path, st):
            continue
        if _unlink_if_unlocked(path, st):
            swept.paths.append(path)
            swept.nbytes += st.st_size
    if swept.paths:
        logger.info(
            "removed %d orphaned tierstore arena/holder files from %s (%d bytes): %s",
            len(swept.paths),
            directory,
            swept.nbytes,
            ", ".join(p.name for p in swept.paths),
        )
    return swept
