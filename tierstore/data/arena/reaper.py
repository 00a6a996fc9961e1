"""Removes a NodeStore's arena file once the NodeStore is gone, however it went.

A NodeStore unlinks its arena when it stops in order; one killed with its raylet
(``ray down``, a lost node, ``kill -9``) runs no hook, and its file would keep the CPU
tier's bytes of ``/dev/shm`` until a NodeStore starts on that machine again (its sweep
of orphans). So each NodeStore starts a reaper: a process of its own session that holds
an fd of the very file the NodeStore created (so its inode cannot be reused by a file
made in its place), waits on the NodeStore's pid (a pidfd: no polling, no pid reuse),
then takes the file's lock and, if nobody holds it and the path still names that file,
unlinks it. Never a file a new NodeStore made, nor one a live process holds. Then it
exits.

Run by :func:`start_reaper` as ``python -m tierstore.data.arena.reaper PID FD PATH``,
which forks the reaper and exits.
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import stat
import subprocess
import sys
from pathlib import Path

from tierstore.wire import RegionInfo

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LAUNCH_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)


def start_reaper(info: RegionInfo) -> subprocess.Popen[bytes] | None:
    """Called by the arena's owner (the NodeStore) while it holds the arena's lock:
    starts the reaper of the file ``info`` names and returns at once; None if the path
    no longer names that file (nothing to reap). The reaper gets a descriptor of its own
    (a new open of the file, so the owner's lock is not shared) and a session of its own
    (a signal to the owner's process group does not reach it). Blocks until the reaper
    has started (under a second; at most ``_LAUNCH_TIMEOUT_S``)."""
    try:
        fd = os.open(info.path, _OPEN_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (info.dev, info.inode) or not stat.S_ISREG(st.st_mode):
            return None
        launcher = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), str(fd), info.path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(fd,),
            start_new_session=True,
        )
    finally:
        os.close(fd)
    try:
        launcher.wait(_LAUNCH_TIMEOUT_S)  # it forks the reaper and exits
    except subprocess.TimeoutExpired:
        logger.warning("the arena reaper of %s did not start in time", info.path)
    return launcher


def reap(pid: int, fd: int, path: Path) -> bool:
    """Blocks until process ``pid`` has exited, then unlinks ``path`` if nobody holds
    the lock of the file ``fd`` is open on and ``path`` still names that file. Returns
    whether it was removed; closes ``fd``."""
    try:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            pidfd = None
        if pidfd is not None:
            try:
                select.select([pidfd], [], [])  # readable once the process has exited
            finally:
                os.close(pidfd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while we look and unlink
        except BlockingIOError:
            return False  # a live process holds it
        held = os.fstat(fd)
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            return False  # unlinked in order
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return False  # another file took the name
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if os.fork() > 0:  # the reaper goes on as the owner's grandchild, not its child: what
        os._exit(0)  # kills the owner's children when it exits does not kill the reaper
    reap(int(argv[0]), int(argv[1]), Path(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
