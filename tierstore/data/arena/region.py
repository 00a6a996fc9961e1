"""A node's arena: one shared, page-aligned mapping of ``cpu_bytes_per_node`` (plus room for
the extents workers hold), owned by the NodeStore and mapped by the workers of the node.

Where it lives: in this user's private directory in ``/dev/shm``
(``/dev/shm/tierstore-<uid>/``, mode 0700, made by :func:`tierstore.private_files.user_dir`),
a file named by namespace and node, ``tierstore-<namespace>+<node>``, mode 0600; the
workers' holder files sit next to it. Both names must match ``[A-Za-z0-9_.-]{1,64}`` in
full (ASCII): two namespaces never share a file. What another local user planted where
tierstore's files go (the directory, or a file in it) fails with
:class:`~tierstore.private_files.UnsafePathError` naming it, never a hang, and nothing is
followed through a symlink. Containers often mount a small ``/dev/shm`` (64 MiB under
Docker's default), so the room is checked first; if it is short, the arena is a
file-backed shared mapping in the same kind of private directory under a fallback
directory, as Ray's own object store does (the page cache holds it; the kernel writes
dirty pages back lazily). Neither with room: :class:`ArenaError`, naming
``cpu_bytes_per_node`` and the mounts.

The file is allocated whole (``posix_fallocate``: a full tmpfs fails here, never as a
SIGBUS on a later write) and mapped pre-faulted (``MAP_POPULATE``). A file left by a dead
NodeStore of the same name is replaced, never reused: a restarted NodeStore has an
empty arena, so what it held are misses, never stale bytes. A file whose lock is still
held (a live NodeStore's: a killed predecessor not yet exited is waited for, bounded) is
never unlinked: :class:`ArenaError` names it and its holder. Each creation has a fresh
``epoch``; workers check it, and map only the very file the NodeStore created (its
device and inode, in :class:`RegionInfo`), so a worker still mapping a replaced file
notices, and one never maps a file put in its place.

``close`` unlinks the file; workers' mappings of it stay valid until they unmap.
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
import uuid
from pathlib import Path

import numpy as np

from tierstore.data.arena.locks import describe_holders, unlink_if_free
from tierstore.data.arena.orphans import sweep_orphans
from tierstore.errors import TierStoreError
from tierstore.private_files import UnsafePathError, check_private, user_dir
from tierstore.wire import RegionInfo

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PAGE = mmap.PAGESIZE
# A name in an arena's file name: matched in full, ASCII only (a trailing newline, a
# Unicode digit or a separator never passes), so two namespaces never share a file.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}", re.ASCII)
_FILE_MODE = 0o600
# A restarted NodeStore's killed predecessor may hold its arena's lock this long before
# its process exits (``ray.kill`` returns first); a lock held longer is a live arena.
HELD_WAIT_S = 30.0
_HELD_POLL_S = 0.1


class ArenaError(TierStoreError):
    """The arena cannot be created or mapped."""


def check_name(what: str, value: object) -> str:
    """``value`` if it may name an arena file (``[A-Za-z0-9_.-]{1,64}``, in full)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ArenaError(
            f"{what} {value!r} cannot name an arena: it must be 1-64 ASCII letters, "
            "digits, '_', '.' or '-', nothing else"
        )
    return value


def arena_file_name(namespace: str, node_id: str) -> str:
    """``tierstore-<namespace>+<node>``: one file per (namespace, node), and no two
    pairs share one (``+`` is in neither name)."""
    return f"tierstore-{check_name('namespace', namespace)}+{check_name('node id', node_id)}"


def arena_dir(base: Path) -> Path:
    """This user's private directory for arenas under ``base`` (``/dev/shm``, or a
    fallback directory), made 0700 on first use; raises
    :class:`~tierstore.private_files.UnsafePathError` naming a planted one."""
    return user_dir(base)


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still allocate under ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class _Mapping:
    """An ``mmap`` of a region file and a uint8 array over it."""

    def __init__(self, fd: int, nbytes: int, populate: bool) -> None:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._mmap = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.nbytes = nbytes

    @property
    def address(self) -> int:
        """Base address in this process (page-aligned: mmap's)."""
        return int(self.array.ctypes.data)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)``, shared with every process that maps them."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"[{offset}, {offset + nbytes}) lies outside the {self.nbytes}-byte arena"
            )
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:  # a view is still alive: the mapping goes with the last one
            logger.debug("arena views still alive; unmapped when they are gone")


def _clear_stale(path: Path, held_wait_s: float) -> None:
    """Make room for a new arena at ``path``: a file a dead NodeStore left there (this
    user's, its lock free) is unlinked; a live one's is waited for up to ``held_wait_s``,
    then refused by name, never unlinked. Anything else there (a symlink, a FIFO, a
    directory, another user's file) raises UnsafePathError naming it."""
    deadline = time.monotonic() + held_wait_s
    while True:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        check_private(path, st, stat.S_IFREG)
        if unlink_if_free(path, st):
            logger.warning("replaced arena file %s left by a NodeStore that stopped", path)
            return
        if time.monotonic() >= deadline:
            raise ArenaError(
                f"{path} is a live arena: its lock is held by {describe_holders(path)} "
                f"(still held after {held_wait_s:g} s). tierstore never removes a live "
                "arena; is another NodeStore of this namespace running on this machine? "
                "Stop it, or use another namespace"
            )
        time.sleep(_HELD_POLL_S)


class ArenaRegion(_Mapping):
    """The NodeStore's side: creates the file, owns it, unlinks it at ``close``.

    ``path``'s directory must be this user's private one (:func:`arena_dir`)."""

    def __init__(self, path: Path, nbytes: int, held_wait_s: float = 0.0) -> None:
        self.path = path
        check_private(path.parent, os.lstat(path.parent), stat.S_IFDIR)
        _clear_stale(path, held_wait_s)
        try:
            fd = os.open(
                path,
                os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                _FILE_MODE,
            )
        except FileExistsError as exc:
            raise ArenaError(
                f"{path} was created by another process while this NodeStore started; "
                "is another NodeStore of this namespace running on this machine?"
            ) from exc
        try:
            # Held while this NodeStore lives: a file nobody holds it on is an orphan.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, _FILE_MODE)  # whatever the umask
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve every page now
            except OSError as exc:
                raise ArenaError(f"cannot allocate {nbytes} bytes for {path}: {exc}") from exc
            super().__init__(fd, nbytes, populate=True)
            st = os.fstat(fd)
            self._file = (st.st_dev, st.st_ino)
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        self._fd: int | None = fd
        self.info = RegionInfo(str(path), nbytes, uuid.uuid4().hex, st.st_dev, st.st_ino)

    @classmethod
    def create(  # noqa: PLR0913 - the mounts, their room, and the wait
        cls,
        namespace: str,
        node_id: str,
        nbytes: int,
        fallback_dir: Path | None = None,
        shm_dir: Path = SHM_DIR,
        shm_free_bytes: int | None = None,
        held_wait_s: float = HELD_WAIT_S,
    ) -> ArenaRegion:
        """The node's arena in this user's private directory in ``shm_dir`` if it has
        room, else in one under ``fallback_dir``.

        ``shm_free_bytes`` stands in for the room ``shm_dir`` reports (None: ask it);
        tests use it to play a small container mount. ``held_wait_s``: how long a live
        arena of the same name is waited for (a killed predecessor exiting) before
        :class:`ArenaError`.
        """
        nbytes = max(PAGE, -(-nbytes // PAGE) * PAGE)
        name = arena_file_name(namespace, node_id)  # refused before anything is touched
        shm_private = arena_dir(shm_dir)
        for directory in (shm_dir, fallback_dir):
            if directory is not None:
                sweep_orphans(directory)  # any namespace's, not only ours
        stale = shm_private / name
        # A stale file of our own name is gone first: its pages count as room.
        _clear_stale(stale, held_wait_s)
        room = free_bytes(shm_private) if shm_free_bytes is None else shm_free_bytes
        if room >= nbytes:
            return cls(stale, nbytes)
        tried = [f"{shm_dir} ({room} bytes free)"]
        if fallback_dir is not None:
            fallback_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = arena_dir(fallback_dir) / name
            _clear_stale(path, held_wait_s)
            fallback_room = free_bytes(path.parent)
            if fallback_room >= nbytes:
                logger.warning(
                    "%s has %d bytes free, the arena needs %d: using a file-backed arena at %s",
                    shm_dir,
                    room,
                    nbytes,
                    path,
                )
                return cls(path, nbytes)
            tried.append(f"{fallback_dir} ({fallback_room} bytes free)")
        raise ArenaError(
            f"the CPU tier's arena needs {nbytes} bytes (cpu_bytes_per_node plus the extents "
            f"workers hold) and no mount has room: {', '.join(tried)}. Lower "
            "cpu_bytes_per_node, enlarge /dev/shm (docker run --shm-size), or set disk_path "
            "to a directory with room."
        )

    def close(self) -> None:
        """Unmap and unlink (NodeStore stop). Idempotent; a successor's file under the
        same name is left alone."""
        super().close()
        if self._fd is None:
            return
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._file:
                self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


class ArenaMapping(_Mapping):
    """A worker's side: maps an existing arena by the NodeStore's :class:`RegionInfo`."""

    def __init__(self, info: RegionInfo) -> None:
        self.info = info
        path = Path(info.path)
        try:
            # O_NONBLOCK: a FIFO put in its place does not hang the open.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(
                    f"the arena {path} is a symlink; tierstore will not map through it"
                ) from exc
            raise ArenaError(f"cannot open the arena {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            check_private(path, st, stat.S_IFREG)  # a regular file of this user's, 0600
            self._file = (st.st_dev, st.st_ino)
            if self._file != (info.dev, info.inode):
                raise ArenaError(
                    f"{path} is not the file the NodeStore created (device {st.st_dev} "
                    f"inode {st.st_ino}, expected {info.dev} {info.inode}): replaced, or "
                    "another file put in its place; not mapped"
                )
            size = st.st_size
            if size != info.nbytes:
                raise ArenaError(f"arena {info.path} has {size} bytes, expected {info.nbytes}")
            # Page tables filled now (on the worker's set-up thread), not by faults in
            # the first gathers and scatters.
            super().__init__(fd, info.nbytes, populate=True)
        finally:
            os.close(fd)

    def replaced(self) -> bool:
        """Whether the arena's path names another file now, or none (its NodeStore
        restarted, or stopped): this mapping is of an arena nobody serves any more."""
        try:
            st = os.lstat(self.info.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._file
