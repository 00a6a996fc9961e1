"""A slab file: equal slots for the chunks of one size, written in place.

Why slots in a few big files rather than a file per chunk: creating a file allocates
an inode, and on ext4 that is the dearest step of a chunk write. Measured on this
project's machine: 0.11 ms (idle) to 1.3 ms (loaded) of kernel CPU per chunk for
create + write + rename, against 0.01-0.025 ms for one ``pwritev`` of 32 KiB into a
slot (0.003 ms to clear a header). A namespace stores chunks of only a few sizes, so
one file per (namespace, size) never fragments: a freed slot fits the next chunk of
that size exactly, and slots of a size no longer written are punched out (their disk
blocks given back) when the room is needed.

Slot ``i`` starts at ``i * slot_bytes``: one header page (:mod:`chunk_header`, zero
padded), then the payload, padded to whole pages so that writes into the page cache
never read a partial page first. A free slot's header starts with zeros, so start-up
never indexes it.

Thread: every method does positional I/O only (``pread``/``pwrite``), so any thread may
use any slot; which slots are free (``held``, ``holes``, ``n_slots``) is bookkeeping the
disk tier changes under its lock.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import logging
import os
from pathlib import Path

import numpy as np

from tierstore.private_files import UnsafePathError, open_private

logger = logging.getLogger(__name__)

PAGE = 4096
HEADER_ROOM = PAGE  # a chunk's header, zero padded
SUFFIX = ".slab"
_CLEARED = bytes(8)  # over a header's magic and length: the slot reads as free
_ZEROS = memoryview(bytes(PAGE))  # a payload's padding to whole pages
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _load_fallocate() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    return fallocate


_fallocate = _load_fallocate()


def slot_bytes_for(nbytes: int) -> int:
    return HEADER_ROOM + -(-nbytes // PAGE) * PAGE


def slab_name(nbytes: int) -> str:
    return f"{nbytes}{SUFFIX}"


def payload_size_of(path: Path) -> int | None:
    """The chunk size a slab file's name says, or None if it is not a slab file's name."""
    stem = path.name.removesuffix(SUFFIX)
    if path.name == stem or not stem.isdigit() or len(stem) > 18 or stem != str(int(stem)):
        return None
    return int(stem)


class SlabFile:
    """The open slab file of one namespace's chunks of ``nbytes`` bytes: made 0600 if
    missing, never opened through a symlink, and refused (:class:`UnsafePathError`, an
    OSError naming it) unless it is this user's, private and its only link."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.slot_bytes = slot_bytes_for(nbytes)
        self.fd = -1  # for close() should the open fail
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        links = os.fstat(fd).st_nlink
        if links != 1:  # a hard link planted to another file: never written through
            os.close(fd)
            raise UnsafePathError(f"{path} has {links} hard links; tierstore leaves it alone")
        self.fd = fd
        self.n_slots = os.fstat(self.fd).st_size // self.slot_bytes
        self.held: list[int] = []  # heap: free slots whose disk blocks may be allocated
        self.holes: list[int] = []  # heap: free slots punched out (no blocks)

    # ---- bookkeeping (the disk tier's lock held) -------------------------------------------
    def take(self) -> tuple[int, bool]:
        """A slot to write, and whether it was held (its blocks are reused): held slots
        first, then holes, then a new slot at the end of the file."""
        if self.held:
            return heapq.heappop(self.held), True
        if self.holes:
            return heapq.heappop(self.holes), False
        self.n_slots += 1
        return self.n_slots - 1, False

    def hold(self, slot: int) -> None:
        heapq.heappush(self.held, slot)

    def add_hole(self, slot: int) -> None:
        heapq.heappush(self.holes, slot)

    # ---- I/O -------------------------------------------------------------------------------
    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def write(self, slot: int, header: bytes, payload: np.ndarray, fsync: bool) -> None:
        """Header page and payload in one ``pwritev``. Raises OSError (a full disk, a
        file-size limit); the slot then holds a partial write, which reads back as a
        checksum failure, never as the chunk."""
        views = [memoryview(header.ljust(HEADER_ROOM, b"\0")), memoryview(payload).cast("B")]
        if self.slot_bytes > HEADER_ROOM + self.nbytes:  # whole slots: a short file is torn
            views.append(_ZEROS[: self.slot_bytes - HEADER_ROOM - self.nbytes])
        _pwritev_all(self.fd, views, self.offset(slot))
        if fsync:
            os.fdatasync(self.fd)

    def read_payload(self, slot: int, out: np.ndarray) -> int:
        """Read the slot's payload into ``out``; returns the bytes read (short at EOF)."""
        view = memoryview(out).cast("B")
        offset, done = self.offset(slot) + HEADER_ROOM, 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                break
            done += got
        return done

    def read_header(self, slot: int) -> bytes:
        return os.pread(self.fd, HEADER_ROOM, self.offset(slot))

    def clear(self, slot: int) -> None:
        """Zero the slot's header so that start-up never indexes what it held. Only
        logged on failure: the chunk is forgotten either way, and one that comes back
        after a restart is still verified when read."""
        try:
            os.pwrite(self.fd, _CLEARED, self.offset(slot))
        except OSError:
            logger.warning("could not clear slot %d of %s", slot, self.path, exc_info=True)

    def punch(self, slot: int) -> None:
        """Give the slot's disk blocks back (it then reads as zeros: free). Where the
        file system cannot punch holes, the slot is only cleared and keeps its blocks."""
        if _fallocate is not None:
            flags = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
            if _fallocate(self.fd, flags, self.offset(slot), self.slot_bytes) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
                logger.warning("punching slot %d of %s: %s", slot, self.path, os.strerror(err))
        self.clear(slot)

    def truncate_to(self, n_slots: int) -> None:
        """Drop the slots from ``n_slots`` on (start-up: a torn or free tail)."""
        os.ftruncate(self.fd, n_slots * self.slot_bytes)
        self.n_slots = n_slots

    def close(self) -> None:
        """Idempotent; also run when the object is collected (tests open many tiers)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    __del__ = close


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """``pwritev`` until every byte is written (a file-size limit writes part, then fails)."""
    while views:
        done = os.pwritev(fd, views, offset)
        if done == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += done
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]
