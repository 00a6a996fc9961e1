"""Who holds what in a node's arena: extents granted to workers, extents pinned by loads.

A holder is a worker process of the node, identified by a lock file next to the arena
(``<arena>.holder-<id>.lock``, in the same private directory, created 0600 and never
through a symlink) on which it holds an ``flock`` for its whole life. The
kernel drops the lock when the process dies, however it dies, so the NodeStore can tell
a dead holder from a live one without asking it: if it can take the lock, the holder is
gone, and whatever it held goes back to the arena. Same node only: a worker of another
node maps no arena and holds nothing in it.

:class:`HolderLock` is the worker's side; :class:`Holdings` the NodeStore's books, kept
under the arena tier's lock (not thread-safe on its own).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import uuid
from collections import Counter
from pathlib import Path

from tierstore.data.arena.locks import lock_is_free, unlink_if_free
from tierstore.private_files import open_private

logger = logging.getLogger(__name__)

_ID = re.compile(r"[0-9a-f]{8,64}", re.ASCII)


def holder_lock_path(arena_path: str, holder: str) -> Path:
    if not isinstance(holder, str) or not _ID.fullmatch(holder):
        raise ValueError(f"holder id must be 8-64 lowercase hex digits, got {holder!r}")
    return Path(f"{arena_path}.holder-{holder}.lock")


class HolderLock:
    """A worker's proof of life: created and locked before it asks for anything."""

    def __init__(self, arena_path: str, holder: str | None = None) -> None:
        self.holder = holder or uuid.uuid4().hex
        self.path = holder_lock_path(arena_path, self.holder)
        # Never through a symlink, never a file of another user's (UnsafePathError).
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def close(self) -> None:
        """Release (worker shutdown): the NodeStore reclaims what is left at its next sweep."""
        if self._fd is not None:
            mine = os.fstat(self._fd)
            try:
                now = os.lstat(self.path)
                if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                    os.unlink(self.path)  # only our own file, not one put in its place
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None


def holder_alive(arena_path: str, holder: str) -> bool:
    """Whether ``holder``'s process still holds its lock; a dead one's file is removed."""
    path = holder_lock_path(arena_path, holder)
    free = lock_is_free(path)
    if free is False or (free is None and os.path.lexists(path)):
        return True  # held, or cannot be probed: keep its extents rather than risk them
    unlink_if_free(path)  # never a file someone took meanwhile, nor another user's
    return False


class Holdings:
    """Extents granted (holder -> offset -> bytes) and pins (holder -> offset -> count)."""

    def __init__(self, arena_path: str) -> None:
        self.arena_path = arena_path
        self.granted: dict[str, dict[int, int]] = {}
        self.pins: dict[str, Counter[int]] = {}
        self.pin_count: Counter[int] = Counter()  # offset -> pins over all holders

    def check_alive(self, holder: str) -> None:
        if not holder_alive(self.arena_path, holder):
            raise PermissionError(f"holder {holder} holds no lock on {self.arena_path}")

    def grant(self, holder: str, offset: int, nbytes: int) -> None:
        self.granted.setdefault(holder, {})[offset] = nbytes

    def take_grant(self, holder: str, offset: int) -> int | None:
        """The bytes of ``holder``'s grant at ``offset``, no longer granted; None if none."""
        grants = self.granted.get(holder)
        return None if grants is None else grants.pop(offset, None)

    def granted_bytes(self) -> int:
        return sum(sum(g.values()) for g in self.granted.values())

    def pin(self, holder: str, offset: int) -> None:
        self.pins.setdefault(holder, Counter())[offset] += 1
        self.pin_count[offset] += 1

    def unpin(self, holder: str, offset: int) -> bool:
        """Drop one pin; True if ``offset`` is now pinned by no one."""
        held = self.pins.get(holder)
        if held is None or held[offset] <= 0:
            logger.warning("holder %s unpinned %d, which it did not pin", holder, offset)
            return False
        held[offset] -= 1
        if not held[offset]:
            del held[offset]
        self.pin_count[offset] -= 1
        if self.pin_count[offset]:
            return False
        del self.pin_count[offset]
        return True

    def dead_holders(self) -> list[str]:
        holders = set(self.granted) | set(self.pins)
        return [h for h in sorted(holders) if not holder_alive(self.arena_path, h)]

    def drop_holder(self, holder: str) -> tuple[dict[int, int], list[int]]:
        """Forget ``holder``: its grants, and the offsets its pins were the last on."""
        grants = self.granted.pop(holder, {})
        unpinned = []
        for offset, count in self.pins.pop(holder, Counter()).items():
            self.pin_count[offset] -= count
            if self.pin_count[offset] <= 0:
                del self.pin_count[offset]
                unpinned.append(offset)
        return grants, unpinned
