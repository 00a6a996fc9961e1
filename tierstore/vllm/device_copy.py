"""Moving a job's bytes between the KV cache and host memory: one copy plan, two executors.

Each job's copies are described once (:mod:`tierstore.data.copy_plan`) from its
``JobPlan`` and block ids. On the CPU platform the KV cache is host memory and the
plan runs as vectorized numpy copies (:mod:`tierstore.data.host_copy`). On CUDA the
same plan, as flat pointer runs, goes to one batched copy per job on a side stream
(vLLM's ``swap_blocks_batch``, else the driver's through cuda-bindings, else a copy per
run: :mod:`tierstore.vllm.batch_copy`), no GPU staging. Its host side is the node's arena once the
worker has mapped and registered it (``attach_arena``): stores gather straight into
their granted extents and same-node loads scatter straight out of pinned extents
(:mod:`tierstore.data.extent_dma` maps the runs onto the extents); otherwise pinned
job buffers (the object-store path).

CUDA ordering (vLLM 0.33's ``cpu/gpu_worker.py`` does the same):
- ``gather`` and ``prepare_scatter`` run on the model-runner thread. They record an
  event on that thread's current stream (vLLM's compute stream) and the side stream
  waits on it, so a store reads KV only once the forward that wrote it is done, and a
  load lands only after every write already queued to its blocks (their zeroing).
- block ids become pointers on the host: nothing is copied to the GPU at submit, so
  submit never waits for the forward.
- the arena is registered once per worker (``cudaHostRegister``,
  :mod:`tierstore.vllm.host_register`), or used as pageable memory where it cannot be;
  the object-store path's host buffers come from a pinned bounce pool reserved at
  start (``HostBuffers``), a larger job in pieces: no per-job ``cudaHostAlloc``, no
  per-job GPU allocation.
- stores, loads and expedited loads each have their own stream.
- events are blocking: a thread waiting on one sleeps instead of spinning.
- the copy is timed by its own start/end events (``Gathered.copy_seconds``).

This module holds the interface and the host executor; the CUDA executor is
:mod:`tierstore.vllm.cuda_copy`, imported only where the KV cache is on a GPU. No module
here imports Ray or vLLM (the GPU check runs on a machine without them).
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from tierstore.data import fused_copy
from tierstore.data.checksum import digest
from tierstore.data.copy_plan import CopyPlan, CopyPlanner, window
from tierstore.data.extent_copy import Run, gather_into, runs_of, scatter_from
from tierstore.data.host_buffers import HostBuffers
from tierstore.data.host_copy import HostExecutor
from tierstore.data.layout import ChunkLayout, ChunkPlacement, JobPlan

FromExtents = Callable[[np.ndarray, Sequence[Run]], None]
# (arena, the job's chunks, per chunk its extent's (arena offset, digest)) -> verified
FromVerifiedExtents = Callable[
    [np.ndarray, Sequence[ChunkPlacement], Sequence[tuple[int, int]]], bool
]
# (per chunk in job order: its bytes, their digest) -> verified
FromVerifiedPieces = Callable[[Sequence[tuple[np.ndarray, int]]], bool]


class Scatter:
    """A load's copies, prepared at submit; called with the job's bytes on a transfer
    thread, it returns once they are in the destination blocks."""

    def __init__(
        self,
        run: Callable[[np.ndarray], None],
        from_extents: FromExtents | None = None,
        from_pieces: Callable[[Sequence[tuple[int, np.ndarray]]], None] | None = None,
        on_caller: bool = False,
        verified: tuple[FromVerifiedExtents, FromVerifiedPieces] | None = None,
    ) -> None:
        self._run = run
        self._from_extents = from_extents
        # One pass that verifies as it copies, from extents or from separate buffers.
        self._verified = verified
        self._from_pieces = from_pieces
        # The copies run on the calling thread, as plain memory work (the host
        # executor), not as a device copy the caller waits for: a small one may run at
        # submit, cheaper than a hand-off to a transfer thread.
        self.on_caller = on_caller

    def __call__(self, data: np.ndarray) -> None:
        self._run(data)

    @property
    def in_place(self) -> bool:
        """Whether :meth:`from_extents` works: the host executor always; CUDA once the
        arena was registered when the load was submitted."""
        return self._from_extents is not None

    def from_extents(self, arena: np.ndarray, runs: Sequence[Run]) -> None:
        """Scatter straight from the job's extents in the node's arena; returns once the
        bytes are in the destination blocks (the extents may be unpinned then)."""
        if self._from_extents is None:
            raise NotImplementedError("this copier scatters from one buffer only")
        self._from_extents(arena, runs)

    def from_verified_extents(
        self,
        arena: np.ndarray,
        chunks: Sequence[ChunkPlacement],
        extents: Sequence[tuple[int, int]],
    ) -> bool:
        """Check each chunk's extent ``(arena offset, digest)`` (xxh3 of its
        ``chunk.nbytes``) and scatter the job straight from them. False if a digest
        differs: some blocks may then hold bytes of this try (the host copier hashes each
        piece right after copying it, :mod:`tierstore.data.fused_copy`), so the caller
        fails the load or tries again, and never reports it done."""
        if self._verified is not None:
            return self._verified[0](arena, chunks, extents)
        for chunk, (at, want) in zip(chunks, extents, strict=True):
            if digest(arena[at : at + chunk.nbytes]) != want:
                return False
        self.from_extents(arena, runs_of(chunks, [at for at, _ in extents]))
        return True

    @property
    def pieces_in_place(self) -> bool:
        """Whether :meth:`from_verified_pieces` works (the host executor; CUDA, which
        copies each piece into pinned memory as it hashes it)."""
        return self._from_pieces is not None or self._verified is not None

    def from_pieces(self, pieces: Sequence[tuple[int, np.ndarray]]) -> None:
        """Scatter from separate buffers, each the job's bytes from a chunk boundary
        ``(job offset, bytes)`` on (the shards of a fetched object, read in place). The
        caller checks that they cover the job once."""
        if self._from_pieces is None:
            raise NotImplementedError("this copier scatters from one buffer only")
        self._from_pieces(pieces)

    def from_verified_pieces(
        self, chunks: Sequence[ChunkPlacement], pieces: Sequence[tuple[np.ndarray, int]]
    ) -> bool:
        """Check each chunk's buffer ``(bytes, digest)`` (the shards of a fetched object,
        in job order, read in place) and scatter the job from them, as
        :meth:`from_verified_extents`: False if a digest differs (some blocks may then
        hold bytes of this try). Needs :attr:`pieces_in_place`."""
        if self._verified is not None:
            return self._verified[1](pieces)
        if any(digest(piece) != want for piece, want in pieces):
            return False
        self.from_pieces([(c.offset, p) for c, (p, _) in zip(chunks, pieces, strict=True)])
        return True


EMPTY_BUFFER = np.empty(0, dtype=np.uint8)


class DeviceCopy(Protocol):
    """A device copy in flight (CUDA events)."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def seconds(self) -> float: ...


class Gathered:
    """A store's bytes on their way out; calling it waits for them (transfer thread)."""

    def __init__(
        self,
        buffer: np.ndarray,
        copy: DeviceCopy | None,
        seconds: float = 0.0,
        digests: list[int] | None = None,
    ) -> None:
        self._buffer = buffer
        self._copy = copy
        self._seconds = seconds
        # Each chunk's xxh3-64 where the copy computed them (the host's C walk); else
        # the commit thread hashes the extents.
        self.digests = digests

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

    def attach_arena(self, array: np.ndarray) -> bool:
        """Arena set-up thread, once the node's arena is mapped: make it usable for
        in-place copies; False: it cannot be (the worker keeps the object store)."""
        return self.in_place

    def detach_arena(self, array: np.ndarray) -> None:
        """Before the arena is unmapped (a NodeStore restart, worker shutdown): blocks
        until no copy of this copier touches it any more."""
        return None

    def gather_into(
        self, plan: JobPlan, block_ids: np.ndarray, arena: np.ndarray, offsets: Sequence[int]
    ) -> Gathered:
        """Model-runner thread: copy the job's pages straight into its chunks' arena
        extents (at ``offsets``)."""
        raise NotImplementedError(f"{type(self).__name__} gathers into its own buffers only")


class HostCopier(DeviceCopier):
    """KV cache in host memory (vLLM's CPU platform)."""

    def __init__(self, layout: ChunkLayout) -> None:
        super().__init__(layout)
        self._executor = HostExecutor(layout)
        self._buffers = HostBuffers(lambda n: np.empty(n, dtype=np.uint8))
        self._tables = fused_copy.PlanTables(layout) if fused_copy.available() else None

    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Gathered:
        started = time.perf_counter()
        copy_plan = self.planner.build(plan, block_ids)
        out = self._buffers.take(copy_plan.nbytes)
        self._executor.gather(copy_plan, out)
        return Gathered(out, None, time.perf_counter() - started)

    in_place = True

    def gather_into(
        self, plan: JobPlan, block_ids: np.ndarray, arena: np.ndarray, offsets: Sequence[int]
    ) -> Gathered:
        started = time.perf_counter()
        digests = None
        tables = self._walk_tables(plan)
        if tables is not None:  # the C walk; a large job also hashed as it is copied
            digests = fused_copy.gather(arena, tables, plan, block_ids, offsets)
        else:
            runs = runs_of(plan.chunks, offsets)
            gather_into(self._executor, self.planner.build(plan, block_ids), arena, runs)
        return Gathered(EMPTY_BUFFER, None, time.perf_counter() - started, digests)

    def prepare_scatter(
        self, plan: JobPlan, block_ids: np.ndarray, expedited: bool = False
    ) -> Scatter:
        tables = self._walk_tables(plan)
        copy_plan = _OnDemand(
            functools.partial(self.planner.build, plan, block_ids), tables is None
        )
        executor = self._executor
        return Scatter(
            lambda data: executor.scatter(copy_plan(), data),
            lambda arena, runs: scatter_from(executor, copy_plan(), arena, runs),
            from_pieces=lambda pieces: _scatter_pieces(executor, copy_plan(), pieces),
            on_caller=True,
            verified=(
                functools.partial(self._walk, tables, plan, block_ids),
                functools.partial(self._walk_pieces, tables, plan, block_ids),
            )
            if tables is not None
            else None,
        )

    def _walk_tables(self, plan: JobPlan) -> fused_copy.PlanTables | None:
        """The C walk's tables where it serves this job (built, and the job large
        enough), else None."""
        if self._tables is None or plan.nbytes < fused_copy.MIN_BYTES:
            return None
        return self._tables

    @staticmethod
    def _walk(
        tables: fused_copy.PlanTables,
        plan: JobPlan,
        block_ids: np.ndarray,
        arena: np.ndarray,
        chunks: Sequence[ChunkPlacement],
        extents: Sequence[tuple[int, int]],
    ) -> bool:
        """Verify and scatter in one pass (:mod:`tierstore.data.fused_copy`); ``chunks``
        are the plan's."""
        assert chunks is plan.chunks or tuple(chunks) == plan.chunks
        walked = fused_copy.scatter_verified(arena, tables, plan, block_ids, extents)
        return walked == fused_copy.OK

    @staticmethod
    def _walk_pieces(
        tables: fused_copy.PlanTables,
        plan: JobPlan,
        block_ids: np.ndarray,
        pieces: Sequence[tuple[np.ndarray, int]],
    ) -> bool:
        walked = fused_copy.scatter_verified_pieces(tables, plan, block_ids, pieces)
        return walked == fused_copy.OK


class _OnDemand:
    """A job's copy plan, built the first time a numpy copy needs it: the C walk reads
    the job plan itself, and building one is Python work per job."""

    def __init__(self, build: Callable[[], CopyPlan], now: bool) -> None:
        self._build = build
        self._plan = build() if now else None  # built now: block ids checked at submit

    def __call__(self) -> CopyPlan:
        if self._plan is None:
            self._plan = self._build()
        return self._plan


def _scatter_pieces(
    executor: HostExecutor, plan: CopyPlan, pieces: Sequence[tuple[int, np.ndarray]]
) -> None:
    for lo, piece in pieces:
        executor.scatter(window(plan, lo, lo + piece.nbytes), piece)


def make_copier(layout: ChunkLayout, bounce_bytes: int | None = None) -> DeviceCopier:
    """Start-up: the copier for where the KV tensors live; on CUDA it reserves
    ``bounce_bytes`` of pinned memory (the config's default if None)."""
    if layout.device.type == "cuda":
        from tierstore.vllm.cuda_copy import DEFAULT_BOUNCE_BYTES, CudaCopier

        return CudaCopier(layout, bounce_bytes=bounce_bytes or DEFAULT_BOUNCE_BYTES)
    return HostCopier(layout)
