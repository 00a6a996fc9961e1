"""Liveness by ``flock``: a process holds an exclusive lock on its file for its life, so
another process that can take that lock knows the first one is gone (the kernel drops a
dead process's locks). Used for an arena's NodeStore and for each worker holding extents."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def lock_is_free(path: Path) -> bool | None:
    """Whether nobody holds ``path``'s lock (probed, then released); None if the file
    cannot be opened (gone, or not ours to open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases the lock if it was taken
    return True
