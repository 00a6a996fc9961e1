"""The CUDA executor of a job's copy plan: one ``swap_blocks_batch`` call per job on a
side stream, between the KV cache and the node's registered arena extents (or pinned
job buffers on the object-store path). The ordering rules are
:mod:`tierstore.vllm.device_copy`'s (the interface's module).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tierstore.data.copy_plan import DmaRuns, fill_descriptors
from tierstore.data.extent_copy import Run, runs_of
from tierstore.data.extent_dma import arena_ranges, arena_runs
from tierstore.data.host_buffers import HostBuffers
from tierstore.data.layout import ChunkLayout, JobPlan
from tierstore.vllm.device_copy import EMPTY_BUFFER, DeviceCopier, Gathered, Scatter
from tierstore.vllm.host_register import HostRegistry


class CudaCopier(DeviceCopier):
    """KV cache on a GPU. Constructed only for CUDA KV tensors; imports vLLM's ops then.

    Host side: the node's arena extents once :meth:`attach_arena` has registered the
    mapping; before that, or if it cannot, job buffers from pinned segments this worker
    allocates once and reuses (``HostBuffers``), for the object-store path, where a
    load's bytes are first copied from the Ray object into such a buffer. A job racing
    the arena's detach (a NodeStore restart) copies to or from it unregistered, as
    pageable memory: slower, still correct, and the mapping is kept until it is done.
    """

    in_place = True

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
        self._arena = HostRegistry(self._synchronize, self._device)

    @property
    def host_bytes(self) -> int:
        """Pinned host memory this worker's job buffers hold (peak in-flight, at most 2x)."""
        return self._buffers.capacity

    def attach_arena(self, array: np.ndarray) -> bool:
        return self._arena.register(array)

    def detach_arena(self, array: np.ndarray) -> None:
        self._arena.unregister(array)

    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Gathered:
        copy_plan = self.planner.build(plan, block_ids)
        runs = self.planner.dma_runs(copy_plan)
        copy = _Copy()
        out = self._buffers.take(copy_plan.nbytes, ready=copy.done)
        for offset, nbytes in copy_plan.zeros:
            out[offset : offset + nbytes] = 0
        self._launch(self._store_stream, runs, out, self._mark(), copy)
        return Gathered(out, copy)

    def gather_into(
        self, plan: JobPlan, block_ids: np.ndarray, arena: np.ndarray, offsets: Sequence[int]
    ) -> Gathered:
        """Model-runner thread: one copy, device -> the job's granted extents; the slots
        it does not fill are cleared on the host first (nothing else writes them)."""
        runs = runs_of(plan.chunks, offsets)
        copy_plan = self.planner.build(plan, block_ids)
        nbytes = copy_plan.nbytes
        for at, n in arena_ranges(copy_plan.zeros, runs, nbytes, arena.nbytes):
            arena[at : at + n] = 0
        dma = arena_runs(
            self.planner.dma_runs(copy_plan), runs, nbytes, arena.nbytes, self._arena.range_bytes
        )
        copy = _Copy()
        self._launch(self._store_stream, dma, arena, self._mark(), copy, keep=True)
        return Gathered(EMPTY_BUFFER, copy)

    def prepare_scatter(
        self, plan: JobPlan, block_ids: np.ndarray, expedited: bool = False
    ) -> Scatter:
        copy_plan = self.planner.build(plan, block_ids)
        stream = self._expedited_stream if expedited else self._load_stream
        args = (copy_plan.nbytes, self.planner.dma_runs(copy_plan), self._mark(), stream)
        from_extents = functools.partial(self._scatter_extents, *args)
        return Scatter(
            functools.partial(self._scatter, *args),
            from_extents if self._arena.active() else None,
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
        self._launch(stream, runs, host, after, copy)
        copy.wait()

    def _scatter_extents(
        self,
        nbytes: int,
        runs: DmaRuns,
        after: Any,
        stream: Any,
        arena: np.ndarray,
        extents: Sequence[Run],
    ) -> None:
        """Transfer thread: one copy, the job's extents -> device; waits (sleeping)."""
        dma = arena_runs(runs, extents, nbytes, arena.nbytes, self._arena.range_bytes)
        copy = _Copy()
        self._launch(stream, dma, arena, after, copy, keep=True)
        copy.wait()

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
        """One ``swap_blocks_batch`` on ``stream``, after the event ``after``. ``host`` is
        a job buffer (offsets into it) or the arena (arena offsets); the store stream
        copies device -> host, the load streams host -> device. Launched under the
        registry's lock, so the arena is never unregistered under a queued copy; with
        ``keep`` (the arena) ``host`` is referenced until the copy is done, so its
        mapping is not unmapped under one either (a job buffer goes back to its segment
        by its own ``ready`` check)."""
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
                    src_any = not to_host
                    self._swap(table[0, :n], table[1, :n], table[2, :n], src_any)
                copy.end.record(stream)
        self._tables.give(table, copy.done, host if keep else None)

    def _synchronize(self) -> None:
        """Block until every copy queued so far on this copier's streams is done."""
        for stream in (self._store_stream, self._load_stream, self._expedited_stream):
            stream.synchronize()


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
        capacity = 1 << max(10, (n - 1).bit_length())  # powers of two: allocated rarely
        return _pinned_table(capacity)

    def give(self, table: torch.Tensor, done: Callable[[], bool], keep: Any = None) -> None:
        """``table`` (and ``keep``, e.g. the host memory the copy uses) are held until
        ``done``."""
        with self._lock:
            self._busy.append((table, done, keep))


def _pinned(nbytes: int) -> np.ndarray:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def _pinned_table(capacity: int) -> torch.Tensor:
    return torch.empty((3, capacity), dtype=torch.int64, pin_memory=True)
