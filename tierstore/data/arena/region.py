"""A node's arena: one shared, page-aligned mapping of ``cpu_bytes_per_node`` (plus room for
the extents workers hold), owned by the NodeStore and mapped by the workers of the node.

Where it lives: a ``/dev/shm`` file named by namespace and node,
``tierstore-<namespace>-<node>``, mode 0600. Containers often mount a small ``/dev/shm``
(64 MiB under Docker's default), so the room is checked first; if it is short, the
arena is a file-backed shared mapping in a fallback directory, as Ray's own object
store does (the page cache holds it; the kernel writes dirty pages back lazily).
Neither with room: :class:`ArenaError`, naming ``cpu_bytes_per_node`` and the mounts.

The file is allocated whole (``posix_fallocate``: a full tmpfs fails here, never as a
SIGBUS on a later write) and mapped pre-faulted (``MAP_POPULATE``). A file left by a dead
NodeStore of the same name is replaced, never reused: a restarted NodeStore has an
empty arena, so what it held are misses, never stale bytes. Each creation has a fresh
``epoch``; workers check it, so a worker still mapping a replaced file notices.

``close`` unlinks the file; workers' mappings of it stay valid until they unmap.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierstore.data.arena.orphans import sweep_orphans
from tierstore.errors import TierStoreError

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PAGE = mmap.PAGESIZE
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_FILE_MODE = 0o600


class ArenaError(TierStoreError):
    """The arena cannot be created or mapped."""


@dataclass(frozen=True)
class RegionInfo:
    """What a worker needs to map the arena (sent to it by the NodeStore)."""

    path: str
    nbytes: int
    epoch: str  # fresh per creation: a replaced file is never mistaken for this one


def arena_file_name(namespace: str, node_id: str) -> str:
    return f"tierstore-{_SAFE.sub('_', namespace)}-{_SAFE.sub('_', node_id)}"


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


class ArenaRegion(_Mapping):
    """The NodeStore's side: creates the file, owns it, unlinks it at ``close``."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        if path.exists() or path.is_symlink():
            logger.warning("replacing arena file %s left by a NodeStore that stopped", path)
            path.unlink()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, _FILE_MODE)
        try:
            # Held while this NodeStore lives: a file nobody holds it on is an orphan.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, _FILE_MODE)  # whatever the umask
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve every page now
            except OSError as exc:
                raise ArenaError(f"cannot allocate {nbytes} bytes for {path}: {exc}") from exc
            super().__init__(fd, nbytes, populate=True)
            self._inode = os.fstat(fd).st_ino
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        self._fd: int | None = fd
        self.info = RegionInfo(str(path), nbytes, uuid.uuid4().hex)

    @classmethod
    def create(
        cls,
        namespace: str,
        node_id: str,
        nbytes: int,
        fallback_dir: Path | None = None,
        shm_dir: Path = SHM_DIR,
        shm_free_bytes: int | None = None,
    ) -> ArenaRegion:
        """The node's arena in ``shm_dir`` if it has room, else in ``fallback_dir``.

        ``shm_free_bytes`` stands in for the room ``shm_dir`` reports (None: ask it);
        tests use it to play a small container mount.
        """
        nbytes = max(PAGE, -(-nbytes // PAGE) * PAGE)
        name = arena_file_name(namespace, node_id)
        for directory in (shm_dir, fallback_dir):
            if directory is not None and directory.is_dir():
                sweep_orphans(directory)  # any namespace's, not only ours
        stale = shm_dir / name
        # A stale file of our own name does not count against the room: it is replaced.
        reclaimable = stale.stat().st_size if stale.is_file() else 0
        room = free_bytes(shm_dir) if shm_free_bytes is None else shm_free_bytes
        if room + reclaimable >= nbytes:
            return cls(stale, nbytes)
        tried = [f"{shm_dir} ({room} bytes free)"]
        if fallback_dir is not None:
            fallback_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = fallback_dir / name
            reclaimable = path.stat().st_size if path.is_file() else 0
            fallback_room = free_bytes(fallback_dir) + reclaimable
            if fallback_room >= nbytes:
                logger.warning(
                    "%s has %d bytes free, the arena needs %d: using a file-backed arena at %s",
                    shm_dir,
                    room,
                    nbytes,
                    path,
                )
                stale.unlink(missing_ok=True)  # never leave an older arena behind
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
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


class ArenaMapping(_Mapping):
    """A worker's side: maps an existing arena by the NodeStore's :class:`RegionInfo`."""

    def __init__(self, info: RegionInfo) -> None:
        self.info = info
        try:
            fd = os.open(info.path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise ArenaError(f"cannot open the arena {info.path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            self._file = (st.st_dev, st.st_ino)
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
            st = os.stat(self.info.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._file
