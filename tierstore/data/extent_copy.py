"""A job's copies into or out of per-chunk arena extents, on the host executor.

Each shard of a job lives in its own extent of the node's arena, so a job's buffer is
not one range: its chunks are spread over the arena. Chunks whose extents happen to lie
back to back in job order (a fresh arena hands them out so, and the allocator prefers
low addresses) form one *run*, copied as one buffer; a run is the copy plan's
:func:`~tierstore.data.copy_plan.window` over those chunks. Bytes are copied once,
straight between the KV cache and the arena.

Thread: any (the caller's; no state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierstore.data.copy_plan import CopyPlan, window
from tierstore.data.host_copy import HostExecutor
from tierstore.data.layout import ChunkPlacement


@dataclass(frozen=True)
class Run:
    """Job bytes ``[job_lo, job_hi)`` live at arena offset ``arena_lo`` onwards."""

    job_lo: int
    job_hi: int
    arena_lo: int


def runs_of(chunks: Sequence[ChunkPlacement], arena_offsets: Sequence[int]) -> list[Run]:
    """Chunks (in job order) and their extents' offsets, merged where back to back."""
    if len(chunks) != len(arena_offsets):
        raise ValueError(f"{len(arena_offsets)} extents for {len(chunks)} chunks")
    runs: list[Run] = []
    lo = hi = arena_lo = -1
    for chunk, at in zip(chunks, arena_offsets, strict=True):
        if hi == chunk.offset and arena_lo + (hi - lo) == at:
            hi = chunk.offset + chunk.nbytes  # back to back on both sides: one run
            continue
        if lo >= 0:
            runs.append(Run(lo, hi, arena_lo))
        lo, hi, arena_lo = chunk.offset, chunk.offset + chunk.nbytes, at
    if lo >= 0:
        runs.append(Run(lo, hi, arena_lo))
    return runs


def _views(plan: CopyPlan, arena: np.ndarray, runs: Sequence[Run]):
    if sum(r.job_hi - r.job_lo for r in runs) != plan.nbytes:
        raise ValueError(
            f"extents cover {sum(r.job_hi - r.job_lo for r in runs)} of {plan.nbytes} bytes"
        )
    for r in runs:
        end = r.arena_lo + r.job_hi - r.job_lo
        yield window(plan, r.job_lo, r.job_hi), arena[r.arena_lo : end]


def gather_into(
    executor: HostExecutor, plan: CopyPlan, arena: np.ndarray, runs: Sequence[Run]
) -> None:
    """Copy the job's pages from the KV cache straight into its extents."""
    for part, view in _views(plan, arena, runs):
        executor.gather(part, view)


def scatter_from(
    executor: HostExecutor, plan: CopyPlan, arena: np.ndarray, runs: Sequence[Run]
) -> None:
    """Copy the job's pages from its extents straight into the KV cache."""
    for part, view in _views(plan, arena, runs):
        executor.scatter(part, view)
