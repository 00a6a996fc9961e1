"""The CUDA copier on the node's arena: GPU -> arena extents -> GPU, one copy each way.

Skipped unless CUDA is present (see conftest.py). The arena is a
real :class:`ArenaRegion` in /dev/shm (where the NodeStore puts it; a file-backed
fallback is used only if /dev/shm is short, and newer kernels may refuse to pin such
pages) mapped by a real :class:`ArenaMapping`, registered by the copier
(``cudaHostRegister``); extents come from the real allocator, shuffled so a job's
chunks are not back to back. The test thread plays the model-runner thread; loads
run on a second thread as the worker's transfer pool runs them. No assertion is on
time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.data.test_extent_copy import _extents
from tests.gpu.conftest import ExecutorFor
from tests.gpu.kv import (
    GROUPS,
    assert_loaded,
    kv_pair,
    random_job,
    reference_gather,
    sleeping_forward,
)
from tierstore.data.arena.region import ArenaMapping, ArenaRegion
from tierstore.data.extent_copy import runs_of
from tierstore.data.layout import ChunkLayout, as_index
from tierstore.vllm.batch_copy import BatchCopy
from tierstore.vllm.cuda_copy import CudaCopier

pytestmark = pytest.mark.gpu

ARENA_BYTES = 8 << 20


class Arena:
    """A node arena mapped here, and the copiers attached to it (detached at teardown,
    also after a failure: a later test's mapping may reuse the address range)."""

    def __init__(self, mapping: ArenaMapping) -> None:
        self.mapping = mapping
        self.array = mapping.array
        self.copiers: list[CudaCopier] = []

    def attach(self, layout: ChunkLayout, executor: BatchCopy | None = None) -> CudaCopier:
        copier = CudaCopier(layout, executor)
        assert copier.attach_arena(self.array)
        self.copiers.append(copier)
        assert copier.pageable_arenas == 0, "cudaHostRegister of the arena failed"
        return copier


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    region = ArenaRegion.create(f"gputest{os.getpid()}", "node", ARENA_BYTES, tmp_path)
    mapping = ArenaMapping(region.info)
    mapping.array[:] = 0xCD
    held = Arena(mapping)
    yield held
    for copier in held.copiers:
        copier.detach_arena(mapping.array)
    mapping.close()
    region.close()


def _place(plan, seed: int):
    offsets = _extents(plan.chunks, np.random.default_rng(seed), ARENA_BYTES)
    return offsets, runs_of(plan.chunks, offsets)


@pytest.mark.parametrize("name", sorted(GROUPS))
@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize("expedited", [False, True])
def test_round_trip_gpu_arena_gpu_is_bit_exact(
    arena: Arena, executor_for: ExecutorFor, name: str, bpc: int, expedited: bool
) -> None:
    gpu, host = kv_pair(name, seed=bpc)
    layout = ChunkLayout(gpu, GROUPS[name][1], bpc)
    ref_layout = ChunkLayout(host, GROUPS[name][1], bpc)
    executor = executor_for(gpu)
    copier = arena.attach(layout, executor)
    plan, src, dst = random_job(layout, np.random.default_rng(bpc), 64)
    offsets, runs = _place(plan, bpc)

    gathered = copier.gather_into(plan, src, arena.array, offsets)
    gathered.wait_copied()
    expected = reference_gather(ref_layout, plan, src)
    outside = np.ones(ARENA_BYTES, dtype=bool)
    for chunk, at in zip(plan.chunks, offsets, strict=True):
        got = arena.array[at : at + chunk.nbytes]
        assert np.array_equal(got, expected[chunk.offset : chunk.offset + chunk.nbytes])
        outside[at : at + chunk.nbytes] = False
    assert np.all(arena.array[outside] == 0xCD)  # nothing written between the extents
    assert gathered.copy_seconds > 0

    scatter = copier.prepare_scatter(plan, dst, expedited)
    assert scatter.in_place
    with ThreadPoolExecutor(1) as pool:
        pool.submit(scatter.from_extents, arena.array, runs).result(timeout=60)
    ref_layout.scatter(plan, as_index(dst, "cpu"), torch.from_numpy(expected.copy()))
    for mine, theirs in zip(gpu, host, strict=True):
        assert torch.equal(mine.cpu(), theirs)  # padding and other blocks untouched
    # The copy kernel ran the registered arena's copies itself (no DMA fallback).
    assert getattr(executor, "fallbacks", 0) == 0
    copier.detach_arena(arena.array)


def test_a_load_from_extents_lands_after_the_compute_stream_zeroes_its_blocks(
    arena: Arena, executor_for: ExecutorFor
) -> None:
    gpu, host = kv_pair("hybrid")
    layout = ChunkLayout(gpu, GROUPS["hybrid"][1], 2)
    copier = arena.attach(layout, executor_for(gpu))
    plan, _, dst = random_job(layout, np.random.default_rng(7), 64)
    offsets, runs = _place(plan, 7)
    data = np.random.default_rng(8).integers(1, 256, plan.nbytes, dtype=np.uint8)
    for chunk, at in zip(plan.chunks, offsets, strict=True):  # what a store left there
        arena.array[at : at + chunk.nbytes] = data[chunk.offset : chunk.offset + chunk.nbytes]
    with sleeping_forward(gpu, dst, 0):  # zeroes the blocks the load writes
        scatter = copier.prepare_scatter(plan, dst)
    assert scatter.in_place
    with ThreadPoolExecutor(1) as pool:  # the worker's transfer thread
        pool.submit(scatter.from_extents, arena.array, runs).result(timeout=120)
    assert_loaded(gpu, host, ChunkLayout(host, GROUPS["hybrid"][1], 2), plan, dst, data, 0)
    copier.detach_arena(arena.array)


def test_a_store_into_extents_returns_while_the_forward_still_runs(arena: Arena) -> None:
    gpu, host = kv_pair("hybrid")
    layout = ChunkLayout(gpu, GROUPS["hybrid"][1], 2)
    copier = arena.attach(layout)
    plan, src, _ = random_job(layout, np.random.default_rng(2), 64)
    offsets, _ = _place(plan, 2)
    copier.gather_into(plan, src, arena.array, offsets).wait_copied()  # warm the tables
    with sleeping_forward(gpu, src, 5) as forward_done:  # writes the KV this store reads
        gathered = copier.gather_into(plan, src, arena.array, offsets)  # submit_store
        assert not forward_done.query(), "the store's submit waited for the forward"
        assert not gathered.copied(), "the store's copy did not wait for the forward"
    gathered.wait_copied()
    for t in host:
        t[torch.as_tensor(src)] = 5
    expected = reference_gather(ChunkLayout(host, GROUPS["hybrid"][1], 2), plan, src)
    for chunk, at in zip(plan.chunks, offsets, strict=True):
        got = arena.array[at : at + chunk.nbytes]
        assert np.array_equal(got, expected[chunk.offset : chunk.offset + chunk.nbytes])
    copier.detach_arena(arena.array)


def _pinned_requests() -> int | None:
    """Pinned blocks handed out by torch's host allocator so far (None: no such stat)."""
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    return stats.get("active_requests.allocated", stats.get("num_host_alloc"))


def test_jobs_through_the_arena_allocate_no_pinned_or_gpu_memory(
    arena: Arena, executor_for: ExecutorFor
) -> None:
    gpu, _ = kv_pair("odd")
    layout = ChunkLayout(gpu, GROUPS["odd"][1], 2)
    copier = arena.attach(layout, executor_for(gpu))

    def job(seed: int) -> None:
        plan, src, dst = random_job(layout, np.random.default_rng(seed), 64)
        offsets, runs = _place(plan, seed)
        copier.gather_into(plan, src, arena.array, offsets).wait_copied()
        scatter = copier.prepare_scatter(plan, dst)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(scatter.from_extents, arena.array, runs).result(timeout=60)

    job(0)  # the first job pins its descriptor tables, once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    pinned, gpu_bytes = _pinned_requests(), torch.cuda.memory_allocated()
    for seed in range(1, 9):
        job(seed)
    torch.cuda.synchronize()
    assert copier.bounced_jobs == 0, "an arena job took a bounce buffer"
    assert _pinned_requests() == pinned, "an arena job allocated pinned memory"
    assert torch.cuda.max_memory_allocated() == gpu_bytes, "an arena job allocated GPU memory"
    copier.detach_arena(arena.array)
    plan, _, dst = random_job(layout, np.random.default_rng(9), 64)
    assert not copier.prepare_scatter(plan, dst).in_place  # detached: the object store
