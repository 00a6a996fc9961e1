"""Whether a node's disk tier takes writes: degraded after one fails, retried after a while.

A full or failing filesystem (ENOSPC, EDQUOT, EIO, a file-size limit) fails every write
until an operator frees it. Trying each shard against it costs a failed write per shard
and a warning per shard; so after one write fails the tier is *degraded*: no write is
tried until a backoff passes, write-throughs are skipped (the shards stay in memory) and
demotions that need a write are refused. The first write after the backoff is the retry:
it either clears the state or doubles the wait. Reads are never affected.

The caller (:class:`~tierstore.store.node_store.NodeStoreCore`) holds its disk lock around
every write, so one retry is in flight at a time; :meth:`DiskHealth.status` is read from
other threads, so the state has a lock of its own.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tierstore.data.tiers.disk_folder import mount_of

logger = logging.getLogger(__name__)

# After a disk write fails, the next one is tried this long after (the retry), doubling
# after each failed retry up to the cap. A full disk then costs one failed write every
# few seconds at first and one a minute after that, not one per shard; a disk freed by
# an operator takes writes again within a minute at most.
DISK_RETRY_FIRST_S = 5.0
DISK_RETRY_MAX_S = 60.0


class DiskHealth:
    """The disk tier at ``root``: healthy, or degraded until a retry time."""

    def __init__(self, root: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self._root = Path(root)
        self._clock = clock
        self._lock = threading.Lock()
        self._retry_at: float | None = None  # None: healthy
        self._backoff_s = DISK_RETRY_FIRST_S
        self._since = 0.0  # when the degraded period began
        self._error = ""  # the first error of the degraded period, for status

    @property
    def degraded(self) -> bool:
        return self._retry_at is not None

    def writable(self) -> bool:
        """Whether to try a write now: healthy, or degraded with its retry due."""
        with self._lock:
            return self._retry_at is None or self._clock() >= self._retry_at

    def failed(self, exc: OSError) -> None:
        """A write failed with ``exc``: degraded, next retry after the backoff. Logged at
        WARNING once per degraded period (with the errno and the mount), not per shard."""
        with self._lock:
            now = self._clock()
            first = self._retry_at is None
            if first:
                self._backoff_s = DISK_RETRY_FIRST_S
                self._since = now
                self._error = describe(exc)
            else:
                self._backoff_s = min(2 * self._backoff_s, DISK_RETRY_MAX_S)
            self._retry_at = now + self._backoff_s
            wait_s = self._backoff_s
        if first:
            logger.warning(
                "disk tier %s: write failed (%s) on the filesystem mounted at %s%s; the disk "
                "tier is degraded: shards stay in memory only, no disk write is tried for "
                "%g s",
                self._root,
                describe(exc),
                mount_of(self._root),
                _free_space(self._root),
                wait_s,
            )
        else:
            logger.info("disk tier %s: retry failed (%s); next in %g s", self._root, exc, wait_s)

    def succeeded(self) -> None:
        """A write landed: healthy again (logged if it was degraded)."""
        with self._lock:
            if self._retry_at is None:
                return
            self._retry_at = None
            degraded_s = self._clock() - self._since
        logger.warning(
            "disk tier %s takes writes again after %.0f s degraded", self._root, degraded_s
        )

    def status(self) -> dict[str, object]:
        """For ``tierstore status``: whether degraded, since when, why, and the retry."""
        with self._lock:
            if self._retry_at is None:
                return {"degraded": False}
            now = self._clock()
            return {
                "degraded": True,
                "degraded_s": round(now - self._since, 1),
                "error": self._error,
                "retry_in_s": round(max(0.0, self._retry_at - now), 1),
            }


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind a failed disk write: ``exc`` itself, or its cause (the disk tier
    raises TierFullError from the OSError of a failed write)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__
    return None


def describe(exc: OSError) -> str:
    """``ENOSPC (No space left on device)``: the errno's name and its text."""
    name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else "?"
    return f"{name} ({exc.strerror or exc})"


def _free_space(path: Path) -> str:
    try:
        fs = os.statvfs(path)
    except OSError:
        return ""
    return f" ({fs.f_bavail * fs.f_frsize} of {fs.f_blocks * fs.f_frsize} bytes free)"
