"""The CUDA executor of a job's copy plan: one batched copy per job on a side stream,
between the KV cache and the node's arena extents (or bounce buffers on the
object-store path). The copy itself goes through the executor chosen at start
(:mod:`tierstore.vllm.batch_copy`: vLLM's ``swap_blocks_batch``, else the driver's
``cuMemcpyBatchAsync`` through cuda-bindings, else a Triton copy kernel, else one async
copy per run). The ordering rules are :mod:`tierstore.vllm.device_copy`'s (the
interface's module).

Host memory, all of it fixed at start (no pinned allocation per job, none on the
model-runner thread):
- the node's arena, registered for DMA (``cudaHostRegister``) by the arena set-up
  thread; where registration fails (RLIMIT_MEMLOCK, a file-backed arena the kernel
  will not pin) it is used as pageable memory, as vLLM does, and counted
  (:attr:`CudaCopier.pageable_arenas`). A copy into pageable memory can block the
  thread that issues it, so such gathers are launched from the copier's launch
  thread, never from the model-runner thread;
- the bounce pool, ``bounce_bytes`` of pinned memory reserved at construction: most of
  it holds whole jobs' buffers (the object-store path); the rest is two staging slots
  through which a job larger than what is free goes in pieces
  (:func:`tierstore.data.extent_dma.window_runs`): a store's pieces from the launch
  thread, a load's from its transfer thread. A slot is held only for its piece's
  copy, so waiting for one never waits on a NodeStore.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from tierstore.config import DEFAULT_PINNED_BOUNCE_BYTES
from tierstore.data.checksum import digest
from tierstore.data.copy_plan import DmaRuns, fill_descriptors
from tierstore.data.extent_copy import Run, runs_of
from tierstore.data.extent_dma import arena_ranges, arena_runs, window_runs, windows
from tierstore.data.host_buffers import HostBuffers
from tierstore.data.layout import ChunkLayout, ChunkPlacement, JobPlan
from tierstore.vllm.batch_copy import BatchCopy, select_executor
from tierstore.vllm.device_copy import EMPTY_BUFFER, DeviceCopier, Gathered, Scatter
from tierstore.vllm.host_register import HostRegistry

logger = logging.getLogger(__name__)

# Pinned bytes a CUDA worker reserves at start unless its config says otherwise
# (``pinned_bounce_bytes``): jobs up to 3/4 of it go whole, larger ones in pieces.
DEFAULT_BOUNCE_BYTES = DEFAULT_PINNED_BOUNCE_BYTES
_SLOTS = 2  # staging slots: a store's piece and a load's piece in flight at once
_MIN_SLOT_BYTES = 4096  # a page
_PAGE = 4096
_TABLE_RUNS = 1 << 14  # descriptor-table entries made at start (more only for huge jobs)


def slot_bytes_for(bounce_bytes: int) -> int:
    """Each staging slot's size for a bounce pool of ``bounce_bytes``: an eighth of it,
    page-aligned, at least a page."""
    return max(_MIN_SLOT_BYTES, (bounce_bytes // 8) // _PAGE * _PAGE)


class CudaCopier(DeviceCopier):
    """KV cache on a GPU.

    Host side: the node's arena extents once :meth:`attach_arena` has taken the mapping
    (registered, else pageable); before that, buffers from the bounce pool, for the
    object-store path. A job racing the arena's detach (a NodeStore restart) copies to
    or from it unregistered, as pageable memory: slower, still correct, and the mapping
    is kept until it is done.
    """

    in_place = True

    def __init__(
        self,
        layout: ChunkLayout,
        executor: BatchCopy | None = None,
        bounce_bytes: int = DEFAULT_BOUNCE_BYTES,
    ) -> None:
        """Start-up: allocates the bounce pool; ``executor`` defaults to
        :func:`~tierstore.vllm.batch_copy.select_executor`'s choice (probed)."""
        super().__init__(layout)
        self._executor = executor or select_executor(layout.tensors)
        self._device = layout.device
        self._store_stream = torch.cuda.Stream(device=self._device)
        self._load_stream = torch.cuda.Stream(device=self._device)
        self._expedited_stream = torch.cuda.Stream(device=self._device)
        slot = slot_bytes_for(bounce_bytes)
        self._buffers = HostBuffers(_pinned)
        self._buffers.reserve(max(bounce_bytes - _SLOTS * slot, _MIN_SLOT_BYTES))
        staging = _pinned(_SLOTS * slot)
        self._slots: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for i in range(_SLOTS):
            self._slots.put(staging[i * slot : (i + 1) * slot])
        self.slot_bytes = slot
        self._tables = _DescriptorTables(self._executor.pinned_tables)
        self._tables.give(self._tables.take(_TABLE_RUNS), _always)
        self._arena = HostRegistry(self._synchronize, self._device)
        self._pageable: dict[int, np.ndarray] = {}  # arenas used unregistered, by base
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="tierstore-copy-launch")
        self.pageable_arenas = 0  # arenas cudaHostRegister refused: used as pageable
        self.split_jobs = 0  # jobs larger than the free bounce pool: copied in pieces
        self.bounced_jobs = 0  # jobs staged whole in a bounce buffer (not the arena)

    @property
    def executor(self) -> str:
        """Which executor issues the copies (``vllm``, ``driver``, ``kernel`` or ``runs``)."""
        return self._executor.name

    @property
    def host_bytes(self) -> int:
        """Pinned bytes of the bounce pool's job buffers (fixed at start)."""
        return self._buffers.capacity

    # ---- the arena ------------------------------------------------------------------------
    def attach_arena(self, array: np.ndarray) -> bool:
        """Arena set-up thread: register the mapping; if that fails, use it as pageable
        memory (counted, logged with what to do). Always True: in place from now on."""
        if self._arena.register(array):
            return True
        logger.warning(
            "the node's arena (%d MiB) could not be pinned for DMA; this worker copies "
            "to and from it as pageable memory (slower). Raise the engine's RLIMIT_MEMLOCK "
            "(ulimit -l); in Docker, give /dev/shm room for the arena (--shm-size), as a "
            "file-backed arena may not be pinnable",
            array.nbytes >> 20,
        )
        self.pageable_arenas += 1
        self._pageable[int(array.ctypes.data)] = array
        return True

    def detach_arena(self, array: np.ndarray) -> None:
        if self._pageable.pop(int(array.ctypes.data), None) is not None:
            self._launcher.submit(_always).result()  # the launches queued before
            self._synchronize()
            return
        self._arena.unregister(array)

    def _attached(self) -> bool:
        return bool(self._pageable) or self._arena.active()

    # ---- stores ---------------------------------------------------------------------------
    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Gathered:
        """Model-runner thread: one copy into a bounce buffer; a job larger than the free
        pool goes in pieces, launched from the launch thread, into a pageable buffer."""
        copy_plan = self.planner.build(plan, block_ids)
        runs = self.planner.dma_runs(copy_plan)
        after = self._mark()
        copy = _Copy()
        out = self._buffers.try_take(copy_plan.nbytes, ready=copy.done)
        split = out is None
        self.bounced_jobs += not split
        if out is None:
            self.split_jobs += 1
            out = np.empty(copy_plan.nbytes, dtype=np.uint8)
        if split:
            pieces = self._launcher.submit(self._pieces_out, runs, out, after, copy_plan.zeros)
            return Gathered(out, _Deferred(pieces))
        for offset, nbytes in copy_plan.zeros:
            out[offset : offset + nbytes] = 0
        self._launch(self._store_stream, runs, out, after, copy)
        return Gathered(out, copy)

    def _pieces_out(
        self, runs: DmaRuns, out: np.ndarray, after: Any, zeros: Sequence[tuple[int, int]]
    ) -> float:
        """Launch thread: device -> ``out`` through the staging slots, then the slots no
        page fills cleared; returns the copies' time."""
        seconds = 0.0
        for lo, hi in windows(out.nbytes, self.slot_bytes):
            with self._slot() as slot:
                copy = _Copy()
                self._launch(self._store_stream, window_runs(runs, lo, hi), slot, after, copy)
                copy.wait()
                out[lo:hi] = slot[: hi - lo]
                seconds += copy.seconds()
        for offset, nbytes in zeros:
            out[offset : offset + nbytes] = 0
        return seconds

    def gather_into(
        self, plan: JobPlan, block_ids: np.ndarray, arena: np.ndarray, offsets: Sequence[int]
    ) -> Gathered:
        """Model-runner thread: one copy, device -> the job's granted extents; the slots
        it does not fill are cleared on the host first (nothing else writes them). Into a
        pageable arena the copy is launched from the launch thread."""
        runs = runs_of(plan.chunks, offsets)
        copy_plan = self.planner.build(plan, block_ids)
        nbytes = copy_plan.nbytes
        for at, n in arena_ranges(copy_plan.zeros, runs, nbytes, arena.nbytes):
            arena[at : at + n] = 0
        dma = arena_runs(
            self.planner.dma_runs(copy_plan), runs, nbytes, arena.nbytes, self._arena.range_bytes
        )
        copy = _Copy()
        after = self._mark()
        if self._arena.registered(arena):
            self._launch(self._store_stream, dma, arena, after, copy, keep=True)
            return Gathered(EMPTY_BUFFER, copy)
        return Gathered(
            EMPTY_BUFFER,
            _Deferred(
                self._launcher.submit(
                    self._launch_and_wait, self._store_stream, dma, arena, after, copy
                )
            ),
        )

    def _launch_and_wait(
        self, stream: Any, runs: DmaRuns, host: np.ndarray, after: Any, copy: _Copy
    ) -> float:
        self._launch(stream, runs, host, after, copy, keep=True)
        copy.wait()
        return copy.seconds()

    # ---- loads ----------------------------------------------------------------------------
    def prepare_scatter(
        self, plan: JobPlan, block_ids: np.ndarray, expedited: bool = False
    ) -> Scatter:
        copy_plan = self.planner.build(plan, block_ids)
        stream = self._expedited_stream if expedited else self._load_stream
        load = _Load(copy_plan.nbytes, self.planner.dma_runs(copy_plan), self._mark(), stream)
        attached = self._attached()
        return Scatter(
            functools.partial(self._scatter, load),
            functools.partial(self._scatter_extents, load) if attached else None,
            verified=(
                functools.partial(self._scatter_verified_extents, load),
                functools.partial(self._scatter_verified_pieces, load, plan.chunks),
            ),
        )

    def _scatter(self, load: _Load, data: np.ndarray) -> None:
        """Transfer thread: stage the bytes in a bounce buffer, copy, wait (sleeping);
        through the staging slots, piece by piece, if the pool has no room for them."""
        if data.nbytes != load.nbytes:
            raise ValueError(f"load buffer has {data.nbytes} bytes, the job needs {load.nbytes}")
        self._stage_in(load, [(0, data.reshape(-1).view(np.uint8))], check=None)

    def _scatter_verified_pieces(
        self,
        load: _Load,
        chunks: Sequence[ChunkPlacement],
        pieces: Sequence[tuple[np.ndarray, int]],
    ) -> bool:
        """Transfer thread: each fetched shard ``(bytes, digest)`` copied straight into
        its slice of the staging buffer and hashed in the same pass (while its bytes are
        in cache); False (the load fails) if a digest differs: some pieces of the job
        may have reached their blocks then."""
        placed = [(c.offset, p) for c, (p, _) in zip(chunks, pieces, strict=True)]
        hashers = [xxhash.xxh3_64() for _ in pieces]
        self._stage_in(load, placed, check=hashers)
        return all(h.intdigest() == want for h, (_, want) in zip(hashers, pieces, strict=True))

    def _stage_in(
        self,
        load: _Load,
        pieces: Sequence[tuple[int, np.ndarray]],
        check: list[Any] | None,
    ) -> None:
        """Copy the job's bytes (``pieces``: job offset, bytes) into pinned memory,
        hashing each piece into ``check[i]`` as it is copied, and DMA them to the
        blocks: whole through a bounce buffer, else window by window through a slot."""
        copy = _Copy()
        whole = self._buffers.try_take(load.nbytes, ready=copy.done)
        if whole is not None:
            self.bounced_jobs += 1
            _fill(whole, 0, pieces, check)
            self._launch(load.stream, load.runs, whole, load.after, copy)
            copy.wait()
            return
        self.split_jobs += 1
        for lo, hi in windows(load.nbytes, self.slot_bytes):
            with self._slot() as slot:
                part = _Copy()
                _fill(slot[: hi - lo], lo, pieces, check)
                runs = window_runs(load.runs, lo, hi)
                self._launch(load.stream, runs, slot, load.after, part)
                part.wait()

    def _scatter_extents(self, load: _Load, arena: np.ndarray, extents: Sequence[Run]) -> None:
        """Transfer thread: one copy, the job's extents -> device; waits (sleeping)."""
        dma = arena_runs(load.runs, extents, load.nbytes, arena.nbytes, self._arena.range_bytes)
        copy = _Copy()
        self._launch(load.stream, dma, arena, load.after, copy, keep=True)
        copy.wait()

    def _scatter_verified_extents(
        self,
        load: _Load,
        arena: np.ndarray,
        chunks: Sequence[ChunkPlacement],
        extents: Sequence[tuple[int, int]],
    ) -> bool:
        """Transfer thread: start the DMA from the job's extents ``(arena offset,
        digest)``, hash them while it runs, then wait for it; False (never reported
        loaded) if a digest differs."""
        if not self._attached():
            raise NotImplementedError("no arena attached: this copier scatters from one buffer")
        placed = runs_of(chunks, [at for at, _ in extents])
        dma = arena_runs(load.runs, placed, load.nbytes, arena.nbytes, self._arena.range_bytes)
        copy = _Copy()
        self._launch(load.stream, dma, arena, load.after, copy, keep=True)
        ok = all(
            digest(arena[at : at + c.nbytes]) == want
            for c, (at, want) in zip(chunks, extents, strict=True)
        )
        copy.wait()
        return ok

    # ---- launching ------------------------------------------------------------------------
    @contextmanager
    def _slot(self) -> Iterator[np.ndarray]:
        """A staging slot, held for one piece's copy (blocks while both are in use)."""
        slot = self._slots.get()
        try:
            yield slot
        finally:
            self._slots.put(slot)

    def _mark(self) -> Any:
        """Model-runner thread: an event at the current end of its (compute) stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _launch(
        self,
        stream: Any,
        runs: DmaRuns,
        host: np.ndarray,
        after: Any,
        copy: _Copy,
        keep: bool = False,
    ) -> None:
        """One batched copy on ``stream``, after the event ``after``. ``host`` is a job
        buffer (offsets into it) or the arena (arena offsets); the store stream copies
        device -> host, the load streams host -> device. Launched under the registry's
        lock, so the arena is never unregistered under a queued copy; with ``keep`` (the
        arena) ``host`` is referenced until the copy is done, so its mapping is not
        unmapped under one either (a job buffer goes back by its own ``ready`` check)."""
        to_host = stream is self._store_stream
        table = self._tables.take(len(runs))
        src, dst, sizes = (row.numpy() for row in table)
        n = fill_descriptors(runs, host.ctypes.data, to_host, src, dst, sizes)
        with self._arena.lock, torch.cuda.device(self._device):
            stream.wait_event(after)
            with torch.cuda.stream(stream):
                copy.start.record(stream)
                if n:
                    # Host -> device reads memory no GPU stream writes (a load's pinned
                    # extents, a staged buffer): the DMA engine may read ahead. Device ->
                    # host keeps stream order (the KV is live).
                    self._executor.launch(table, n, stream, not to_host, host)
                copy.end.record(stream)
        self._tables.give(table, copy.done, host if keep else None)

    def _synchronize(self) -> None:
        """Block until every copy queued so far on this copier's streams is done."""
        for stream in (self._store_stream, self._load_stream, self._expedited_stream):
            stream.synchronize()


class _Load(NamedTuple):
    """A load prepared at submit: its size, its DMA runs against a job buffer, the event
    on the compute stream it must follow, and its stream."""

    nbytes: int
    runs: DmaRuns
    after: Any
    stream: Any


def _fill(
    out: np.ndarray, lo: int, pieces: Sequence[tuple[int, np.ndarray]], check: list[Any] | None
) -> None:
    """Copy the parts of ``pieces`` (job offset, bytes) that fall in job bytes
    ``[lo, lo + len(out))`` into ``out``, each part hashed into ``check[i]`` right after
    it is copied (from ``out``: bytes just written, in cache). Pieces are in job order
    and each is hashed from its start, window after window."""
    hi = lo + out.nbytes
    for i, (at, piece) in enumerate(pieces):
        a, b = max(at, lo), min(at + piece.nbytes, hi)
        if b <= a:
            continue
        out[a - lo : b - lo] = piece[a - at : b - at]
        if check is not None:
            check[i].update(out[a - lo : b - lo])


class _Copy:
    """A job's start/end events: blocking (waiters sleep) and timed."""

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True, blocking=True)
        self.end = torch.cuda.Event(enable_timing=True, blocking=True)

    def done(self) -> bool:
        return bool(self.end.query())

    def wait(self) -> None:
        self.end.synchronize()

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1e3


class _Deferred:
    """A copy launched from the launch thread: done once that thread waited it out; its
    result is the copy's seconds; a launch that raised raises from :meth:`wait`."""

    def __init__(self, future: Future[float]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()

    def seconds(self) -> float:
        return self._future.result()


class _DescriptorTables:
    """Int64 ``(3, capacity)`` pointer tables, reused once their copy is done: in plain
    host memory for executors that read them on the host, in pinned memory for one that
    reads them on the device (``pinned``: the copy kernel)."""

    def __init__(self, pinned: bool = False) -> None:
        self._pinned = pinned
        self._free: list[torch.Tensor] = []
        self._busy: list[tuple[torch.Tensor, Callable[[], bool], Any]] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> torch.Tensor:
        with self._lock:
            busy, self._busy = self._busy, []
            for table, done, kept in busy:
                if done():
                    self._free.append(table)  # and ``kept`` is let go
                else:
                    self._busy.append((table, done, kept))
            fitting = [t for t in self._free if t.shape[1] >= n]
            if fitting:
                table = min(fitting, key=lambda t: t.shape[1])
                self._free.remove(table)
                return table
        capacity = 1 << max(10, (n - 1).bit_length())  # powers of two: made rarely
        return torch.empty((3, capacity), dtype=torch.int64, pin_memory=self._pinned)

    def give(self, table: torch.Tensor, done: Callable[[], bool], keep: Any = None) -> None:
        """``table`` (and ``keep``, e.g. the host memory the copy uses) are held until
        ``done``."""
        with self._lock:
            self._busy.append((table, done, keep))


def _always() -> bool:
    return True


def _pinned(nbytes: int) -> np.ndarray:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
