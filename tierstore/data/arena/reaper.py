"""Removes a NodeStore's arena file once the NodeStore is gone, however it went.

A NodeStore unlinks its arena when it stops in order; one killed with its raylet
(``ray down``, ``ray stop``, a lost node, ``kill -9``) runs no hook, and its file would
keep the CPU tier's bytes of ``/dev/shm`` until a NodeStore starts on that machine again
(its sweep of orphans). So each NodeStore starts a reaper (:func:`start_reaper`): a small
process of its own session (a signal to the NodeStore's process group does not reach
it), the NodeStore's grandchild (what kills a Ray worker's children does not kill it).
It holds:

- a descriptor of the very file the NodeStore created (so that inode cannot be reused
  by a file made in its place while the reaper looks), opened anew (not a copy of the
  NodeStore's: the NodeStore's lock is not shared);
- the read end of a pipe whose write end only the NodeStore holds: end of file once the
  NodeStore is gone (the kernel closes a dead process's descriptors) or has let the
  reaper go (:meth:`Reaper.release`, after its orderly stop unlinked the file);
- a pidfd of the NodeStore (readable once it has exited), in case a child the
  NodeStore forked without exec keeps a copy of the pipe's write end.

Once either wakes it, it removes the file only if nobody holds the file's lock (which
may outlive the owner's exit a moment: waited for up to ``LOCK_WAIT_S``), the path
still names that very file, and the file is this user's private one
(:func:`~tierstore.data.arena.locks.unlink_if_free`): never a file a new NodeStore made
under the same name, never one a live process holds, never a file tierstore did not
make. Then it exits: it lives as long as its NodeStore, plus the moment it takes to
look. It writes no file; what it has to say goes to the NodeStore's stderr (a Ray
worker's ``.err`` log).

Where the reaper cannot run (it fails to start, it is killed, or Ray's raylet acts as a
subreaper and kills unknown children), the sweep of orphans at the next NodeStore start
remains the fallback.
"""

from __future__ import annotations

import logging
import os
import select
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tierstore.data.arena.locks import lock_is_free, unlink_if_free

if TYPE_CHECKING:  # not imported at run time: the reaper process starts light
    from tierstore.wire import RegionInfo

MODULE = __name__  # the reaper's command line: python -m MODULE PID RELEASE_FD FD PATH
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# The launcher only forks the reaper and exits (well under a second); reaped by a thread.
_LAUNCH_TIMEOUT_S = 60.0
# The owner's lock may outlive its exit a moment: the lock goes with the last reference to
# the owner's open file, which its mapping also holds, and a process reading the owner's
# /proc entries (psutil, Ray's agent) may drop the owner's memory, and with it the
# mapping, after the owner's exit was signalled. Seen once in the ray up check. A lock
# held past this is a live holder's (a child the owner forked): the file is left.
LOCK_WAIT_S = 30.0
_LOCK_POLL_S = 0.1

logger = logging.getLogger(__name__)


class Reaper:
    """The NodeStore's handle of its arena's reaper. Thread-safe."""

    def __init__(self, path: str, release_fd: int, launcher: subprocess.Popen[bytes]) -> None:
        self.path = path
        self.launcher = launcher
        self._release_fd: int | None = release_fd
        self._lock = threading.Lock()

    def release(self) -> None:
        """Let the reaper go: called after the owner unlinked the arena in order (the
        reaper then finds nothing to remove and exits, and the file's pages, which its
        descriptor kept, are freed). Idempotent; never blocks."""
        with self._lock:
            if self._release_fd is not None:
                os.close(self._release_fd)
                self._release_fd = None


def start_reaper(info: RegionInfo) -> Reaper | None:
    """Start the reaper of the arena file ``info`` names; called by the arena's owner
    (the NodeStore) while it holds the arena's lock. Returns at once (a fork and exec;
    the launcher that forks the reaper is waited for on a daemon thread). None, logged,
    if the path no longer names that file or the reaper cannot be launched: the sweep of
    orphans is then the only remover of a file the owner leaves."""
    try:
        fd = os.open(info.path, _OPEN_FLAGS)
    except OSError as exc:
        logger.warning("no arena reaper for %s: %s", info.path, exc)
        return None
    read_end, write_end = os.pipe()  # both close-on-exec; read_end goes to the reaper
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (info.dev, info.inode) or not stat.S_ISREG(st.st_mode):
            logger.warning("no arena reaper for %s: it names another file now", info.path)
            os.close(write_end)
            return None
        args = [str(os.getpid()), str(read_end), str(fd), info.path]
        launcher = subprocess.Popen(
            [sys.executable, "-m", MODULE, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(read_end, fd),
            start_new_session=True,
        )
    except OSError as exc:
        logger.warning("no arena reaper for %s: %s", info.path, exc)
        os.close(write_end)
        return None
    finally:
        os.close(fd)
        os.close(read_end)
    threading.Thread(
        target=_reap_launcher,
        args=(launcher, info.path),
        name="tierstore-reaper-launch",
        daemon=True,
    ).start()
    return Reaper(info.path, write_end, launcher)


def _reap_launcher(launcher: subprocess.Popen[bytes], path: str) -> None:
    """Wait for the launcher (it forks the reaper and exits), so it leaves no zombie."""
    try:
        code = launcher.wait(_LAUNCH_TIMEOUT_S)
        if code != 0:
            logger.warning("the arena reaper of %s failed to start (exit %s)", path, code)
    except Exception:  # a thread of the NodeStore: it logs, never raises
        logger.warning("the arena reaper of %s did not start in time", path, exc_info=True)


def wait_for_owner(pid: int, release_fd: int | None) -> None:
    """Block until process ``pid`` has exited or ``release_fd`` (a pipe's read end) is
    at end of file, whichever comes first. A pid that cannot be watched (gone already,
    or no pidfd on this kernel) leaves the pipe alone to wake it, if any."""
    fds = [] if release_fd is None else [release_fd]
    pidfd = None
    try:
        pidfd = os.pidfd_open(pid)
        fds.append(pidfd)
    except ProcessLookupError:
        return  # gone already
    except (OSError, AttributeError) as exc:  # ENOSYS: a kernel older than 5.3
        logger.warning("cannot watch pid %d (%s); waiting on its pipe only", pid, exc)
    try:
        while fds:
            readable, _, _ = select.select(fds, [], [])
            if pidfd is not None and pidfd in readable:
                return
            if release_fd is not None and release_fd in readable:
                if not os.read(release_fd, 1):
                    return  # end of file: the owner is gone or let us go
    finally:
        if pidfd is not None:
            os.close(pidfd)


def reap(
    pid: int, release_fd: int | None, fd: int, path: Path, lock_wait_s: float = LOCK_WAIT_S
) -> bool:
    """Block until the owner ``pid`` is gone or released the reaper
    (:func:`wait_for_owner`), then unlink ``path`` if it still names the file ``fd`` is
    open on, nobody holds that file's lock (a held lock is waited for up to
    ``lock_wait_s``) and it is this user's private file. Returns whether it was removed;
    closes ``fd`` and ``release_fd``."""
    try:
        wait_for_owner(pid, release_fd)
        return _remove_once_free(os.fstat(fd), path, lock_wait_s)
    finally:
        os.close(fd)
        if release_fd is not None:
            os.close(release_fd)


def _remove_once_free(held: os.stat_result, path: Path, wait_s: float) -> bool:
    """:func:`unlink_if_free` of ``path`` (the file ``held``), tried again while the path
    still names that file and its lock stays held, up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while not unlink_if_free(path, held):
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            return False  # unlinked in order, or by a sweep
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return False  # another file took the name
        if lock_is_free(path):  # free, yet refused: not a private file of ours
            return unlink_if_free(path, held)  # (or freed just now)
        if time.monotonic() >= deadline:
            logger.warning("left %s: its lock is still held after %g s", path, wait_s)
            return False
        time.sleep(_LOCK_POLL_S)
    return True


def is_reaper(cmdline: Sequence[str], path: str | None = None) -> bool:
    """Whether a process's command line is an arena reaper's (of the arena at ``path``,
    if given): how a check after ``ray down`` finds reapers that outlived their arena."""
    try:
        at = list(cmdline).index(MODULE)
    except ValueError:
        return False
    args = list(cmdline)[at + 1 :]
    return at >= 1 and cmdline[at - 1] == "-m" and (path is None or args[-1:] == [path])


def main(argv: list[str]) -> int:
    """The launcher: forks the reaper and exits 0. The reaper: :func:`reap`, then exits
    0 whatever happened (a failure is logged to the owner's stderr)."""
    pid, release_fd, fd, path = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    if os.fork() > 0:  # the reaper goes on as the owner's grandchild, not its child
        os._exit(0)
    os.chdir("/")  # it pins no directory (a Ray session's, a test's) while it waits
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s tierstore arena reaper %(levelname)s %(message)s"
    )
    try:
        if reap(pid, release_fd, fd, path):
            logger.info("removed %s: its NodeStore (pid %d) exited without stopping", path, pid)
    except Exception:  # logged, and the reaper exits all the same
        logger.exception("could not reap %s of pid %d", path, pid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
