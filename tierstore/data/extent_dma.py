"""A job's DMA runs with their host side in the node's arena: the CUDA copier's descriptors.

:meth:`~tierstore.data.copy_plan.CopyPlanner.dma_runs` gives a job's copies as flat
runs against one contiguous job buffer. A job in the arena is not one buffer: each of
its chunks has an extent, and chunks whose extents lie back to back form one
:class:`~tierstore.data.extent_copy.Run`. :func:`arena_runs` moves every DMA run's
buffer side to where its bytes live in the arena, cutting a DMA run wherever it
crosses from one extent run to the next (a run of consecutive blocks may span several
chunks; their extents need not be adjacent), and wherever it crosses a multiple of
``cut_every`` in the arena (the bounds of separate ``cudaHostRegister`` ranges: no copy
may straddle two registrations). The result is again a :class:`DmaRuns`, whose
``offset`` is an arena offset (in job order, so not necessarily increasing):
``fill_descriptors(result, arena_base, ...)`` then gives the (src, dst, size) pointer
triples for ``swap_blocks_batch``. :func:`arena_ranges` maps a plan's ``zeros`` the
same way, for the host to clear.

Pure numpy: no CUDA, no Ray. Thread: any (no state).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tierstore.data.copy_plan import DmaRuns
from tierstore.data.extent_copy import Run


def split_runs(runs: Sequence[Run], cut_every: int) -> list[Run]:
    """``runs`` cut at every arena offset that is a multiple of ``cut_every`` (0: none)."""
    if cut_every <= 0:
        return list(runs)
    out: list[Run] = []
    for r in runs:
        job_lo, arena_lo = r.job_lo, r.arena_lo
        while job_lo < r.job_hi:
            bound = (arena_lo // cut_every + 1) * cut_every  # the next cut above arena_lo
            step = min(r.job_hi - job_lo, bound - arena_lo)
            out.append(Run(job_lo, job_lo + step, arena_lo))
            job_lo, arena_lo = job_lo + step, arena_lo + step
    return out


class _Extents:
    """Checked extent runs as arrays: job bytes ``[lo[i], hi[i])`` at arena ``at[i]``."""

    def __init__(self, runs: Sequence[Run], nbytes: int, arena_bytes: int) -> None:
        self.lo = np.array([r.job_lo for r in runs], dtype=np.int64)
        self.hi = np.array([r.job_hi for r in runs], dtype=np.int64)
        self.at = np.array([r.arena_lo for r in runs], dtype=np.int64)
        # Raw pointers follow from these: a wrong extent would be a wild DMA write.
        tiles = (
            len(runs) > 0
            and self.lo[0] == 0
            and self.hi[-1] == nbytes
            and bool(np.all(self.hi > self.lo))
            and bool(np.all(self.lo[1:] == self.hi[:-1]))
        )
        if not tiles and nbytes > 0:
            raise ValueError(
                f"extent runs {[(r.job_lo, r.job_hi) for r in runs]} do not tile the "
                f"{nbytes}-byte job in order"
            )
        if len(runs) and (self.at.min() < 0 or (self.at + self.hi - self.lo).max() > arena_bytes):
            raise ValueError(f"an extent lies outside the {arena_bytes}-byte arena")

    def pieces(self, lo: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, ...]:
        """Job ranges ``[lo, lo + n)`` (n > 0) cut at extent-run bounds: for each piece,
        the range it came from, its offset into that range, its arena offset, its size."""
        first = np.searchsorted(self.lo, lo, side="right") - 1
        last = np.searchsorted(self.lo, lo + n - 1, side="right") - 1
        count = last - first + 1
        source = np.repeat(np.arange(len(lo), dtype=np.int64), count)
        nth = np.arange(len(source), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        ext = first[source] + nth
        piece_lo = np.maximum(lo[source], self.lo[ext])
        piece_hi = np.minimum(lo[source] + n[source], self.hi[ext])
        arena = self.at[ext] + (piece_lo - self.lo[ext])
        return source, piece_lo - lo[source], arena, piece_hi - piece_lo


def _check_ranges(lo: np.ndarray, n: np.ndarray, nbytes: int, what: str) -> None:
    if len(lo) and (lo.min() < 0 or n.min() <= 0 or (lo + n).max() > nbytes):
        raise ValueError(f"{what} reach outside the {nbytes}-byte job")


def arena_runs(
    runs: DmaRuns, extents: Sequence[Run], nbytes: int, arena_bytes: int, cut_every: int = 0
) -> DmaRuns:
    """The DMA runs of an ``nbytes`` job whose bytes lie in ``extents`` of an arena of
    ``arena_bytes``: same KV side, buffer side moved to arena offsets, cut at every
    extent-run bound (and multiple of ``cut_every``) a run crosses."""
    ext = _Extents(split_runs(extents, cut_every), nbytes, arena_bytes)
    _check_ranges(runs.offset, runs.nbytes, nbytes, "DMA runs")
    if len(runs) == 0:
        return runs
    source, into, arena, size = ext.pieces(runs.offset, runs.nbytes)
    return DmaRuns(
        np.ascontiguousarray(runs.kv_addr[source] + into, dtype=np.int64),
        np.ascontiguousarray(arena, dtype=np.int64),
        np.ascontiguousarray(size, dtype=np.int64),
    )


def arena_ranges(
    ranges: Sequence[tuple[int, int]], extents: Sequence[Run], nbytes: int, arena_bytes: int
) -> list[tuple[int, int]]:
    """Job byte ranges ``(offset, nbytes)`` (a plan's ``zeros``) as arena ranges."""
    ranges = [(o, n) for o, n in ranges if n > 0]
    if not ranges:
        return []
    ext = _Extents(extents, nbytes, arena_bytes)
    lo = np.array([o for o, _ in ranges], dtype=np.int64)
    n = np.array([s for _, s in ranges], dtype=np.int64)
    _check_ranges(lo, n, nbytes, "ranges")
    _, _, arena, size = ext.pieces(lo, n)
    return list(zip(arena.tolist(), size.tolist(), strict=True))


def windows(nbytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` pieces of an ``nbytes`` job, each at most ``piece_bytes`` (> 0)."""
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
    return [(lo, min(lo + piece_bytes, nbytes)) for lo in range(0, nbytes, piece_bytes)]


def window_runs(runs: DmaRuns, lo: int, hi: int) -> DmaRuns:
    """The part of job-buffer-ordered ``runs`` whose buffer bytes lie in ``[lo, hi)``,
    offsets rebased to ``lo`` (a run crossing a bound is cut there): the copies of one
    piece of a job staged through a buffer smaller than the job."""
    if lo >= hi or len(runs) == 0:
        empty = np.empty(0, dtype=np.int64)
        return DmaRuns(empty, empty, empty)
    start = np.maximum(runs.offset, lo)
    end = np.minimum(runs.offset + runs.nbytes, hi)
    keep = end > start
    start, end = start[keep], end[keep]
    return DmaRuns(
        np.ascontiguousarray(runs.kv_addr[keep] + (start - runs.offset[keep]), dtype=np.int64),
        np.ascontiguousarray(start - lo, dtype=np.int64),
        np.ascontiguousarray(end - start, dtype=np.int64),
    )
