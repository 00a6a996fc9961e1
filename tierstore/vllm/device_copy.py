"""Moving a job's bytes between the KV cache and host memory: one copy plan, two executors.

Each job's copies are described once (:mod:`tierstore.data.copy_plan`) from its
``JobPlan`` and block ids. On the CPU platform the KV cache is host memory and the
plan runs as vectorized numpy copies (:mod:`tierstore.data.host_copy`). On CUDA the
same plan, as flat pointer runs, goes to vLLM's ``swap_blocks_batch``: one driver call
per job on a side stream, device <-> pinned host buffers, no GPU staging.

CUDA ordering (vLLM 0.33's ``cpu/gpu_worker.py`` does the same):
- ``gather`` and ``prepare_scatter`` run on the model-runner thread. They record an
  event on that thread's current stream (vLLM's compute stream) and the side stream
  waits on it, so a store reads KV only once the forward that wrote it is done, and a
  load lands only after every write already queued to its blocks (their zeroing).
- block ids become pointers on the host: nothing is copied to the GPU at submit, so
  submit never waits for the forward.
- descriptor tables and host buffers are pinned once and reused (``HostBuffers``):
  no per-job ``cudaHostAlloc``, no per-job GPU allocation.
- stores, loads and expedited loads each have their own stream.
- events are blocking: a thread waiting on one sleeps instead of spinning.
- the copy is timed by its own start/end events (``Gathered.copy_seconds``).
"""

from __future__ import annotations

import functools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tierstore.data.copy_plan import CopyPlan, CopyPlanner, DmaRuns, fill_descriptors, window
from tierstore.data.extent_copy import Run, gather_into, scatter_from
from tierstore.data.host_buffers import HostBuffers
from tierstore.data.host_copy import HostExecutor
from tierstore.data.layout import ChunkLayout, JobPlan


class Scatter:
    """A load's copies, prepared at submit; called with the job's bytes on a transfer
    thread, it returns once they are in the destination blocks."""

    def __init__(
        self,
        run: Callable[[np.ndarray], None],
        plan: CopyPlan | None = None,
        executor: HostExecutor | None = None,
    ) -> None:
        self._run = run
        self._plan = plan
        self._executor = executor

    def __call__(self, data: np.ndarray) -> None:
        self._run(data)

    @property
    def in_place(self) -> bool:
        """Whether :meth:`from_extents` works (the host executor; CUDA: not yet)."""
        return self._executor is not None

    def from_extents(self, arena: np.ndarray, runs: Sequence[Run]) -> None:
        """Scatter straight from the job's extents in the node's arena."""
        if self._executor is None or self._plan is None:
            raise NotImplementedError("this copier scatters from one buffer only")
        scatter_from(self._executor, self._plan, arena, runs)

    def from_pieces(self, pieces: Sequence[tuple[int, np.ndarray]]) -> None:
        """Scatter from separate buffers, each the job's bytes from a chunk boundary
        ``(job offset, bytes)`` on (the shards of a fetched object, read in place). The
        caller checks that they cover the job once."""
        if self._executor is None or self._plan is None:
            raise NotImplementedError("this copier scatters from one buffer only")
        for lo, piece in pieces:
            self._executor.scatter(window(self._plan, lo, lo + piece.nbytes), piece)


_EMPTY = np.empty(0, dtype=np.uint8)


class Gathered:
    """A store's bytes on their way out; calling it waits for them (transfer thread)."""

    def __init__(self, buffer: np.ndarray, copy: _Copy | None, seconds: float = 0.0) -> None:
        self._buffer = buffer
        self._copy = copy
        self._seconds = seconds

    def __call__(self) -> np.ndarray:
        """The job's bytes once copied; from then on the source blocks may be overwritten."""
        self.wait_copied()
        return self._buffer

    def copied(self) -> bool:
        return self._copy is None or self._copy.done()

    def wait_copied(self) -> None:
        """Block (sleeping, not spinning) until the device copy is done."""
        if self._copy is not None:
            self._copy.wait()

    @property
    def copy_seconds(self) -> float:
        """The copy's own duration (device events on CUDA); valid once copied."""
        return self._copy.seconds() if self._copy is not None else self._seconds


class DeviceCopier(ABC):
    def __init__(self, layout: ChunkLayout) -> None:
        self.layout = layout
        self.planner = CopyPlanner(layout)

    @abstractmethod
    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Gathered:
        """Model-runner thread: start copying the job's pages out."""

    @abstractmethod
    def prepare_scatter(
        self, plan: JobPlan, block_ids: np.ndarray, expedited: bool = False
    ) -> Scatter:
        """Model-runner thread, at submit: the load's copies, ordered after the work
        queued so far. Call the result with the job's bytes (on a transfer thread); it
        returns when they are in the destination blocks."""

    def scatter(self, plan: JobPlan, block_ids: np.ndarray, data: np.ndarray) -> None:
        """Prepare and run a scatter at once (the CPU platform, benchmarks, tests)."""
        self.prepare_scatter(plan, block_ids)(data)

    in_place = False  # whether gather_into works

    def gather_into(
        self, plan: JobPlan, block_ids: np.ndarray, arena: np.ndarray, runs: Sequence[Run]
    ) -> Gathered:
        """Model-runner thread: copy the job's pages straight into its arena extents."""
        raise NotImplementedError(f"{type(self).__name__} gathers into its own buffers only")


class HostCopier(DeviceCopier):
    """KV cache in host memory (vLLM's CPU platform)."""

    def __init__(self, layout: ChunkLayout) -> None:
        super().__init__(layout)
        self._executor = HostExecutor(layout)
        self._buffers = HostBuffers(lambda n: np.empty(n, dtype=np.uint8))

    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Gathered:
        started = time.perf_counter()
        copy_plan = self.planner.build(plan, block_ids)
        out = self._buffers.take(copy_plan.nbytes)
        self._executor.gather(copy_plan, out)
        return Gathered(out, None, time.perf_counter() - started)

    in_place = True

    def gather_into(
        self, plan: JobPlan, block_ids: np.ndarray, arena: np.ndarray, runs: Sequence[Run]
    ) -> Gathered:
        started = time.perf_counter()
        gather_into(self._executor, self.planner.build(plan, block_ids), arena, runs)
        return Gathered(_EMPTY, None, time.perf_counter() - started)

    def prepare_scatter(
        self, plan: JobPlan, block_ids: np.ndarray, expedited: bool = False
    ) -> Scatter:
        copy_plan = self.planner.build(plan, block_ids)
        return Scatter(
            functools.partial(self._executor.scatter, copy_plan), copy_plan, self._executor
        )


class CudaCopier(DeviceCopier):
    """KV cache on a GPU. Constructed only for CUDA KV tensors; imports vLLM's ops then.

    Host side: job buffers from pinned segments this worker allocates once and reuses
    (``HostBuffers``), until the node's shared-memory arena (issue 10, item 1) replaces
    them; a load's bytes are first copied from the Ray object into such a buffer.
    """

    def __init__(self, layout: ChunkLayout, swap: Callable[..., None] | None = None) -> None:
        super().__init__(layout)
        if swap is None:
            from vllm import _custom_ops as ops  # CUDA build only: import lazily

            swap = ops.swap_blocks_batch
        self._swap = swap
        self._device = layout.device
        self._store_stream = torch.cuda.Stream(device=self._device)
        self._load_stream = torch.cuda.Stream(device=self._device)
        self._expedited_stream = torch.cuda.Stream(device=self._device)
        self._buffers = HostBuffers(_pinned)
        self._tables = _DescriptorTables()

    @property
    def host_bytes(self) -> int:
        """Pinned host memory this worker's job buffers hold (peak in-flight, at most 2x)."""
        return self._buffers.capacity

    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Gathered:
        copy_plan = self.planner.build(plan, block_ids)
        runs = self.planner.dma_runs(copy_plan)
        copy = _Copy()
        out = self._buffers.take(copy_plan.nbytes, ready=copy.done)
        for offset, nbytes in copy_plan.zeros:
            out[offset : offset + nbytes] = 0
        self._launch(self._store_stream, runs, out, True, self._mark(), copy)
        return Gathered(out, copy)

    def prepare_scatter(
        self, plan: JobPlan, block_ids: np.ndarray, expedited: bool = False
    ) -> Scatter:
        copy_plan = self.planner.build(plan, block_ids)
        stream = self._expedited_stream if expedited else self._load_stream
        return Scatter(
            functools.partial(
                self._scatter,
                copy_plan.nbytes,
                self.planner.dma_runs(copy_plan),
                self._mark(),
                stream,
            )
        )

    def _scatter(
        self, nbytes: int, runs: DmaRuns, after: Any, stream: Any, data: np.ndarray
    ) -> None:
        """Transfer thread: stage the bytes in a pinned buffer, copy, wait (sleeping)."""
        if data.nbytes != nbytes:
            raise ValueError(f"load buffer has {data.nbytes} bytes, the job needs {nbytes}")
        copy = _Copy()
        host = self._buffers.take(nbytes, ready=copy.done)
        np.copyto(host, data.reshape(-1).view(np.uint8))
        self._launch(stream, runs, host, False, after, copy)
        copy.wait()

    def _mark(self) -> Any:
        """Model-runner thread: an event at the current end of its (compute) stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _launch(
        self, stream: Any, runs: DmaRuns, host: np.ndarray, to_host: bool, after: Any, copy: _Copy
    ) -> None:
        """One ``swap_blocks_batch`` on ``stream``, after the event ``after``."""
        table = self._tables.take(len(runs))
        src, dst, sizes = (row.numpy() for row in table)
        n = fill_descriptors(runs, host.ctypes.data, to_host, src, dst, sizes)
        with torch.cuda.device(self._device):
            stream.wait_event(after)
            with torch.cuda.stream(stream):
                copy.start.record(stream)
                if n:
                    # Host -> device reads memory no GPU stream writes: the DMA engine may
                    # read ahead. Device -> host keeps stream order (the KV is live).
                    src_any = not to_host
                    self._swap(table[0, :n], table[1, :n], table[2, :n], src_any)
                copy.end.record(stream)
        self._tables.give(table, copy.done)


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


class _DescriptorTables:
    """Pinned int64 ``(3, capacity)`` pointer tables, reused once their copy is done.

    ``swap_blocks_batch`` reads them on the host; they are kept until the copy ends all
    the same, as vLLM does, so a kernel-based variant could read them on the device.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._busy: list[tuple[torch.Tensor, Callable[[], bool]]] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> torch.Tensor:
        with self._lock:
            busy, self._busy = self._busy, []
            for table, done in busy:
                if done():
                    self._free.append(table)
                else:
                    self._busy.append((table, done))
            fitting = [t for t in self._free if t.shape[1] >= n]
            if fitting:
                table = min(fitting, key=lambda t: t.shape[1])
                self._free.remove(table)
                return table
        capacity = 1 << max(10, (n - 1).bit_length())  # powers of two: allocated rarely
        return torch.empty((3, capacity), dtype=torch.int64, pin_memory=True)

    def give(self, table: torch.Tensor, done: Callable[[], bool]) -> None:
        with self._lock:
            self._busy.append((table, done))


def _pinned(nbytes: int) -> np.ndarray:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def make_copier(layout: ChunkLayout) -> DeviceCopier:
    """The executor for where the KV tensors live."""
    if layout.device.type == "cuda":
        return CudaCopier(layout)
    return HostCopier(layout)
