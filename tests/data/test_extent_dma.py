"""The CUDA copier's arena descriptors, executed on the host, are byte-exact.

``swap_blocks_batch`` copies ``size`` bytes from ``src`` to ``dst`` for each triple;
``ctypes.memmove`` does the same on host memory, so the triples built here for host
KV tensors and a host arena are checked against the host executor's
``gather_into``/``scatter_from`` and against the layout's one-buffer gather/scatter,
over every byte of the arena and of the KV tensors (padding, untouched blocks, bytes
between extents).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.data.test_copy_plan import GEOMETRIES, _case, _job, _reference_gather
from tests.data.test_extent_copy import _extents
from tierstore.data.copy_plan import CopyPlanner, fill_descriptors
from tierstore.data.extent_copy import Run, runs_of
from tierstore.data.extent_dma import arena_ranges, arena_runs, split_runs
from tierstore.data.layout import ChunkLayout, as_index
from tierstore.vllm.device_copy import HostCopier


def _execute(runs, arena: np.ndarray, to_arena: bool) -> int:
    """Run the pointer triples as swap_blocks_batch would; returns how many."""
    n = len(runs)
    src, dst, size = (np.empty(n, dtype=np.int64) for _ in range(3))
    assert fill_descriptors(runs, arena.ctypes.data, to_arena, src, dst, size) == n
    for s, d, b in zip(src.tolist(), dst.tolist(), size.tolist(), strict=True):
        ctypes.memmove(d, s, b)
    return n


def _dma_gather(layout, plan, ids, arena, runs, cut_every: int) -> None:
    """What CudaCopier.gather_into does, with memmove for the DMA engine."""
    planner = CopyPlanner(layout)
    copy_plan = planner.build(plan, ids)
    for at, n in arena_ranges(copy_plan.zeros, runs, plan.nbytes, arena.nbytes):
        arena[at : at + n] = 0
    dma = arena_runs(planner.dma_runs(copy_plan), runs, plan.nbytes, arena.nbytes, cut_every)
    _execute(dma, arena, to_arena=True)


def _dma_scatter(layout, plan, ids, arena, runs, cut_every: int) -> None:
    planner = CopyPlanner(layout)
    dma = arena_runs(
        planner.dma_runs(planner.build(plan, ids)), runs, plan.nbytes, arena.nbytes, cut_every
    )
    _execute(dma, arena, to_arena=False)


def job_in_extents(name: str, bpc: int, seed: int):  # type: ignore[no-untyped-def]
    """A random job of geometry ``name`` and its chunks' extents, apart and out of
    order, in an arena of ``4 * plan.nbytes + 40_000`` bytes."""
    kv, layout = _case(name, bpc, seed=seed)
    rng = np.random.default_rng(seed)
    sizes, indices, ids = _job(len(layout.groups), rng, 24)
    plan = layout.plan(sizes, indices)
    offsets = _extents(plan.chunks, rng, 4 * plan.nbytes + 40_000)
    return kv, layout, plan, ids, offsets, rng


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(sorted(GEOMETRIES)),
    bpc=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    cut_every=st.sampled_from([0, 0, 64, 4096, 77]),
)
def test_descriptors_into_extents_match_the_host_copies_byte_for_byte(
    name: str, bpc: int, seed: int, cut_every: int
) -> None:
    kv, layout, plan, ids, offsets, rng = job_in_extents(name, bpc, seed)
    arena_bytes = 4 * plan.nbytes + 40_000
    runs = runs_of(plan.chunks, offsets)

    # Gather: every arena byte as the host executor leaves it (0xCD between extents).
    mine = np.full(arena_bytes, 0xCD, dtype=np.uint8)
    host = mine.copy()
    _dma_gather(layout, plan, ids, mine, runs, cut_every)
    HostCopier(layout).gather_into(plan, ids, host, offsets)()
    assert np.array_equal(mine, host)
    one_buffer = HostCopier(layout).gather(plan, ids)()  # today's one-buffer gather
    assert np.array_equal(one_buffer, _reference_gather(layout, plan, ids))
    for chunk, at in zip(plan.chunks, offsets, strict=True):
        assert np.array_equal(
            mine[at : at + chunk.nbytes], one_buffer[chunk.offset : chunk.offset + chunk.nbytes]
        )

    # Scatter other bytes from the same extents into other blocks: every KV byte alike.
    mine[:] = np.random.default_rng(seed + 1).integers(0, 256, arena_bytes, dtype=np.uint8)
    dst = rng.permutation(24)[: len(ids)]
    theirs = [t.clone() for t in kv]
    other = ChunkLayout(theirs, GEOMETRIES[name][1], bpc)
    HostCopier(other).prepare_scatter(plan, dst).from_extents(mine, runs)
    _dma_scatter(layout, plan, dst, mine, runs, cut_every)
    for a, b in zip(kv, theirs, strict=True):
        assert torch.equal(a, b)
    pairs = zip(plan.chunks, offsets, strict=True)
    job = np.concatenate([mine[at : at + c.nbytes] for c, at in pairs])
    reference = [t.clone() for t in kv]
    for t in reference:
        t.zero_()
    for t in theirs:
        t.zero_()
    ChunkLayout(reference, GEOMETRIES[name][1], bpc).scatter(
        plan, as_index(dst, layout.device), torch.from_numpy(job.copy())
    )
    HostCopier(other).scatter(plan, dst, job)  # today's one-buffer scatter
    for a, b in zip(reference, theirs, strict=True):
        assert torch.equal(a, b)


def _dense_run_over_chunks():
    """One DMA run of 6 consecutive 64-byte blocks, a chunk per block."""
    kv, layout = _case("dense", bpc=1)
    planner = CopyPlanner(layout)
    plan = layout.plan([6, 0], [0, 0])
    ids = [4, 5, 6, 7, 8, 9]
    runs = planner.dma_runs(planner.build(plan, ids))
    assert runs.nbytes.tolist() == [6 * 64]
    return kv, layout, plan, ids, runs


def test_a_dma_run_crossing_extents_is_cut_exactly_at_their_bounds() -> None:
    kv, _, plan, ids, runs = _dense_run_over_chunks()
    # chunks 0-1 back to back, 2 elsewhere, 3-5 back to back again but before chunk 0
    offsets = [1000, 1064, 5000, 200, 264, 328]
    extents = runs_of(plan.chunks, offsets)
    assert len(extents) == 3
    dma = arena_runs(runs, extents, plan.nbytes, 8192)
    assert dma.offset.tolist() == [1000, 5000, 200]
    assert dma.nbytes.tolist() == [128, 64, 192]
    base = kv[0].data_ptr()
    assert (dma.kv_addr - base).tolist() == [4 * 64, 6 * 64, 7 * 64]
    arena = np.zeros(8192, dtype=np.uint8)
    _execute(dma, arena, to_arena=True)
    rows = kv[0].numpy().view(np.uint8)
    for block, at in zip(ids, offsets, strict=True):
        assert np.array_equal(arena[at : at + 64], rows[block])


def test_back_to_back_extents_keep_the_dma_run_whole() -> None:
    _, _, plan, _, runs = _dense_run_over_chunks()
    extents = runs_of(plan.chunks, [640 + 64 * i for i in range(6)])
    dma = arena_runs(runs, extents, plan.nbytes, 4096)
    assert dma.offset.tolist() == [640] and dma.nbytes.tolist() == [384]


def test_no_copy_straddles_a_registration_bound() -> None:
    _, _, plan, _, runs = _dense_run_over_chunks()
    extents = runs_of(plan.chunks, [100 + 64 * i for i in range(6)])  # one extent run
    dma = arena_runs(runs, extents, plan.nbytes, 4096, cut_every=256)
    assert dma.offset.tolist() == [100, 256]
    assert dma.nbytes.tolist() == [156, 228]
    assert split_runs([Run(0, 10, 5)], 0) == [Run(0, 10, 5)]
    assert split_runs([Run(0, 10, 5)], 4) == [Run(0, 3, 5), Run(3, 7, 8), Run(7, 10, 12)]


def test_zeros_land_in_their_extents() -> None:
    _, layout = _case("hybrid", bpc=4)
    planner = CopyPlanner(layout)
    plan = layout.plan([1, 0, 0], [2, 0, 0])  # one 160-byte slot filled of four
    zeros = planner.build(plan, [7]).zeros
    assert zeros == ((0, 320), (480, 160))
    assert arena_ranges(zeros, [Run(0, 640, 3000)], 640, 4096) == [(3000, 320), (3480, 160)]


@pytest.mark.parametrize(
    ("extents", "arena_bytes", "match"),
    [
        ([Run(0, 100, 0), Run(120, 384, 500)], 4096, "tile"),  # a hole in the job
        ([Run(0, 384, 0), Run(384, 400, 500)], 4096, "tile"),  # past the job's end
        ([Run(64, 384, 0)], 4096, "tile"),  # not from the job's start
        ([Run(0, 384, 3800)], 4096, "outside"),  # past the arena's end
        ([Run(0, 384, -8)], 4096, "outside"),
    ],
)
def test_extents_that_do_not_tile_the_job_or_fit_the_arena_are_refused(
    extents, arena_bytes: int, match: str
) -> None:
    _, _, plan, _, runs = _dense_run_over_chunks()
    with pytest.raises(ValueError, match=match):
        arena_runs(runs, extents, plan.nbytes, arena_bytes)
