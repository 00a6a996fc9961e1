"""Job buffers carved from a few large host segments a worker allocates once and reuses.

Used where a job does not go through the node's arena (the object-store path, and the
CUDA copier until it maps the arena): on CUDA one pinned segment is reserved at start
(the bounce pool, :meth:`HostBuffers.reserve`) and only :meth:`HostBuffers.try_take`
is used, which never allocates: a job larger than what is free goes in pieces (no
per-job ``cudaHostAlloc``: slow, and torch's pinned cache rounds sizes up and never
frees); on the CPU platform they spare each job fresh pages to fault in.

A buffer is a numpy array over its extent. It returns to its segment when it and every
view of it are gone (a ``weakref.finalize``), and, if a device copy may still be
writing or reading it, only once that copy's ``ready`` check says it is done. Segments grow by
doubling when in-flight jobs need more room, so a worker allocates O(log peak) times,
and are kept while the worker lives (freeing them would make a pinned ``cudaHostAlloc``
of the same size the next time a store and a load overlap): a worker holds at most
twice its peak of in-flight job bytes.

Thread-safe: buffers are taken on any thread (the model-runner thread for stores, a
transfer thread for loads); a buffer dropped on any thread, or by the garbage collector,
is only queued, and reused by a later ``take``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np

logger = logging.getLogger(__name__)

_ALIGN = 4096  # page-aligned extents: DMA-friendly, 8-byte words for every copy


class _Segment:
    def __init__(self, memory: np.ndarray) -> None:
        self.memory = memory
        self.free: list[tuple[int, int]] = [(0, memory.nbytes)]  # sorted (offset, size)
        self.used = 0

    def take(self, size: int) -> int | None:
        for i, (offset, room) in enumerate(self.free):
            if room >= size:
                if room == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, room - size)
                self.used += size
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        free = self.free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, (offset, size))
        if i + 1 < len(free) and offset + size == free[i + 1][0]:  # merge with the next
            free[i] = (offset, size + free.pop(i + 1)[1])
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # and with the previous
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free.pop(i)[1])
        self.used -= size


_Returned = tuple[_Segment, int, int, Callable[[], bool]]


class HostBuffers:
    """Reusable job buffers. ``allocate(nbytes)`` makes one segment (a uint8 array)."""

    def __init__(
        self, allocate: Callable[[int], np.ndarray], min_segment_bytes: int = 64 << 20
    ) -> None:
        self._allocate = allocate
        self._min_segment = min_segment_bytes
        self._segments: list[_Segment] = []
        self._returned: deque[_Returned] = deque()  # appended from any thread
        self._pending: list[_Returned] = []  # returned, device copy maybe unfinished
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        with self._lock:
            return sum(s.memory.nbytes for s in self._segments)

    def reserve(self, nbytes: int) -> None:
        """Allocate one segment of ``nbytes`` now (start-up), so that :meth:`try_take`
        has room without allocating later."""
        with self._lock:
            self._segments.append(_Segment(self._allocate(nbytes)))

    def take(self, nbytes: int, ready: Callable[[], bool] | None = None) -> np.ndarray:
        """A buffer of ``nbytes``. ``ready`` (if given) says whether the device copy that
        uses it has finished; the buffer is reused only once it has and the view is gone.
        Grows the segments when none has room."""
        view = self._take(nbytes, ready, grow=True)
        assert view is not None
        return view

    def try_take(self, nbytes: int, ready: Callable[[], bool] | None = None) -> np.ndarray | None:
        """As :meth:`take`, but never allocates: None when no segment has room now (a
        fixed pool: the caller splits the job or waits)."""
        return self._take(nbytes, ready, grow=False)

    def _take(self, nbytes: int, ready: Callable[[], bool] | None, grow: bool) -> np.ndarray | None:
        if nbytes <= 0:
            return np.empty(0, dtype=np.uint8)
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            self._reclaim()
            for segment in self._segments:
                offset = segment.take(size)
                if offset is not None:
                    break
            else:
                if not grow:
                    return None
                segment = self._grow(size)
                offset = segment.take(size)
                assert offset is not None
        # A view of its own buffer object: numpy's slices of it keep *it* alive (slices of
        # a plain slice would point at the segment), so its finalizer fires only once
        # the last view of the job's bytes is gone.
        view = np.frombuffer(memoryview(segment.memory[offset : offset + nbytes]), np.uint8)
        weakref.finalize(view, self._release, segment, offset, size, ready)
        return view

    def _grow(self, size: int) -> _Segment:
        total = sum(s.memory.nbytes for s in self._segments)
        nbytes = max(size, self._min_segment, total)  # doubles the total
        logger.info("job buffers: new %d MiB segment (had %d MiB)", nbytes >> 20, total >> 20)
        segment = _Segment(self._allocate(nbytes))
        self._segments.append(segment)
        return segment

    def _release(
        self, segment: _Segment, offset: int, size: int, ready: Callable[[], bool] | None
    ) -> None:
        """Runs wherever the last view dies (GC included): only queues, never locks."""
        self._returned.append((segment, offset, size, ready or _always))

    def _reclaim(self) -> None:
        """Give back returned buffers whose device copy has finished (lock held)."""
        while self._returned:
            self._pending.append(self._returned.popleft())
        still = []
        for segment, offset, size, ready in self._pending:
            if ready():
                segment.give(offset, size)
            else:
                still.append((segment, offset, size, ready))
        self._pending = still


def _always() -> bool:
    return True
