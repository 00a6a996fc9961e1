"""A job staged through a buffer smaller than itself: its DMA runs cut into windows.

Every byte must come from the same KV address whether the job is copied whole or
window by window (``window_runs`` rebases each window to its own buffer), and no
window may reach past its size.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.data.copy_plan import DmaRuns
from tierstore.data.extent_dma import window_runs, windows


def _byte_map(runs: DmaRuns, nbytes: int) -> np.ndarray:
    """For each job-buffer byte, the KV address it is copied from (-1: none)."""
    out = np.full(nbytes, -1, dtype=np.int64)
    for addr, off, n in zip(
        runs.kv_addr.tolist(), runs.offset.tolist(), runs.nbytes.tolist(), strict=True
    ):
        out[off : off + n] = np.arange(addr, addr + n)
    return out


@st.composite
def _runs(draw) -> tuple[DmaRuns, int]:
    sizes = draw(st.lists(st.integers(1, 700), min_size=0, max_size=20))
    gaps = draw(st.lists(st.integers(0, 50), min_size=len(sizes), max_size=len(sizes)))
    offsets, at = [], 0
    for size, gap in zip(sizes, gaps, strict=True):
        at += gap
        offsets.append(at)
        at += size
    nbytes = at + draw(st.integers(0, 50))
    addrs = [1 << 20 + i for i in range(len(sizes))]  # far apart: each run its own source
    as64 = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
    return DmaRuns(as64(addrs), as64(offsets), as64(sizes)), nbytes


@settings(max_examples=200, deadline=None)
@given(_runs(), st.integers(1, 900))
def test_windows_copy_every_byte_from_where_the_whole_job_would(case, piece: int) -> None:
    runs, nbytes = case
    whole = _byte_map(runs, nbytes)
    pieced = np.full(nbytes, -1, dtype=np.int64)
    for lo, hi in windows(nbytes, piece):
        assert 0 < hi - lo <= piece
        part = window_runs(runs, lo, hi)
        assert np.all(part.nbytes > 0)
        assert np.all(part.offset >= 0) and np.all(part.offset + part.nbytes <= hi - lo)
        pieced[lo:hi] = _byte_map(part, hi - lo)
    assert np.array_equal(pieced, whole)


def test_windows_tile_the_job() -> None:
    assert windows(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert windows(0, 4) == []
