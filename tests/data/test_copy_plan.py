"""The copy plan and its CPU executor are byte-exact against the layout's gather/scatter.

The reference is ``ChunkLayout.gather``/``scatter`` (the torch path the worker used
before). The DMA runs are checked by executing them with ``ctypes.memmove``, which
does on host memory what ``swap_blocks_batch`` does with the same pointer triples.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.data.copy_plan import CopyPlanner, fill_descriptors
from tierstore.data.layout import ChunkLayout, as_index
from tierstore.vllm.device_copy import HostCopier, make_copier

# (row bytes per tensor, groups as [(tensor_idx, page_bytes)] per layer)
GEOMETRIES = {
    # attention pages padded (96 of 128), a second layer in another tensor, a Mamba-like
    # state page of 200 of 256 bytes, and a group sharing tensor 0 (the HMA overlay)
    "hybrid": ([128, 256, 64], [[(0, 96), (2, 64)], [(1, 200)], [(0, 128)]]),
    # odd page sizes: the byte path, no 8-byte words anywhere
    "odd": ([128, 64, 40], [[(0, 100), (1, 37)], [(2, 33)]]),
    # one layer per group, unpadded: consecutive blocks merge into long runs
    "dense": ([64, 512], [[(0, 64)], [(1, 512)]]),
}


def _kv(rows: list[int], num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (num_blocks, r), dtype=torch.int8, generator=g) for r in rows]


def _case(name: str, bpc: int, num_blocks: int = 24, seed: int = 0):
    rows, groups = GEOMETRIES[name]
    kv = _kv(rows, num_blocks, seed)
    return kv, ChunkLayout(kv, groups, bpc)


def _reference_gather(layout: ChunkLayout, plan, ids) -> np.ndarray:
    out = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8)
    layout.gather(plan, as_index(ids, layout.device), out)
    return out.numpy()


def _job(n_groups: int, rng: np.random.Generator, num_blocks: int):
    sizes = [int(x) for x in rng.integers(0, 6, n_groups)]
    sizes[0] = max(sizes[0], 1)
    indices = [int(x) for x in rng.integers(0, 9, n_groups)]  # unaligned starts
    ids = rng.choice(num_blocks, sum(sizes), replace=False).astype(np.int32)
    return sizes, indices, ids


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("bpc", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_and_scatter_match_the_layout_byte_for_byte(name: str, bpc: int, seed: int) -> None:
    kv, layout = _case(name, bpc, seed=seed)
    rng = np.random.default_rng(seed)
    sizes, indices, ids = _job(len(layout.groups), rng, 24)
    plan = layout.plan(sizes, indices)
    copier = HostCopier(layout)

    expected = _reference_gather(layout, plan, ids)
    got = copier.gather(plan, ids)()
    assert np.array_equal(got, expected)

    # Scatter the same (read-only, as Ray hands it out) bytes into other blocks, both ways.
    data = np.random.default_rng(seed + 10).integers(0, 256, plan.nbytes, dtype=np.uint8)
    data.flags.writeable = False
    dst = rng.permutation(24)[: len(ids)]
    reference = [t.clone() for t in kv]
    ChunkLayout(reference, GEOMETRIES[name][1], bpc).scatter(
        plan, as_index(dst, layout.device), torch.from_numpy(data.copy())
    )
    copier.scatter(plan, dst, data)
    for mine, theirs in zip(kv, reference, strict=True):
        assert torch.equal(mine, theirs)  # padding and untouched blocks included


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(GEOMETRIES)),
    bpc=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_dma_runs_are_byte_exact_both_ways(name: str, bpc: int, seed: int) -> None:
    kv, layout = _case(name, bpc, seed=seed)
    rng = np.random.default_rng(seed)
    sizes, indices, ids = _job(len(layout.groups), rng, 24)
    plan = layout.plan(sizes, indices)
    planner = CopyPlanner(layout)
    copy_plan = planner.build(plan, ids)
    runs = planner.dma_runs(copy_plan)
    assert int(runs.nbytes.sum()) == sum(b.page_bytes * len(b.ids) for b in copy_plan.batches)

    out = np.zeros(plan.nbytes, dtype=np.uint8)  # the zeros a gather clears first
    _memmove_all(runs, out, to_buffer=True)
    assert np.array_equal(out, _reference_gather(layout, plan, ids))

    before = [t.clone() for t in kv]
    for t in kv:
        t.zero_()
    _memmove_all(runs, out, to_buffer=False)
    for k, i in enumerate(ids):
        g = _group_of(k, sizes)
        for tensor_idx, page in GEOMETRIES[name][1][g]:
            assert torch.equal(kv[tensor_idx][i, :page], before[tensor_idx][i, :page])


def _group_of(k: int, sizes: list[int]) -> int:
    return int(np.searchsorted(np.cumsum(sizes), k, side="right"))


def _memmove_all(runs, buffer: np.ndarray, to_buffer: bool) -> None:
    n = len(runs)
    src, dst, size = (np.empty(n, dtype=np.int64) for _ in range(3))
    fill_descriptors(runs, buffer.ctypes.data, to_buffer, src, dst, size)
    for s, d, b in zip(src.tolist(), dst.tolist(), size.tolist(), strict=True):
        ctypes.memmove(d, s, b)


def test_runs_merge_where_both_sides_are_contiguous() -> None:
    _, layout = _case("dense", bpc=4)
    planner = CopyPlanner(layout)
    plan = layout.plan([6, 0], [0, 0])
    # blocks 3,4,5 are consecutive rows and consecutive slots: one run; 9 then 10 another
    runs = planner.dma_runs(planner.build(plan, [3, 4, 5, 9, 10, 2]))
    assert runs.nbytes.tolist() == [3 * 64, 2 * 64, 64]
    assert runs.offset.tolist() == [0, 3 * 64, 5 * 64]


def test_padded_pages_never_merge_across_the_padding() -> None:
    _, layout = _case("hybrid", bpc=2)
    planner = CopyPlanner(layout)
    plan = layout.plan([0, 3, 0], [0, 0, 0])  # 200-byte pages in 256-byte rows
    runs = planner.dma_runs(planner.build(plan, [4, 5, 6]))
    assert runs.nbytes.tolist() == [200, 200, 200]


def test_block_ids_outside_the_cache_are_refused_before_any_copy() -> None:
    _, layout = _case("hybrid", bpc=1)
    plan = layout.plan([2, 0, 0], [0, 0, 0])
    with pytest.raises(ValueError, match="outside"):
        CopyPlanner(layout).build(plan, [3, 24])
    with pytest.raises(ValueError, match="outside"):
        CopyPlanner(layout).build(plan, [-1, 3])
    with pytest.raises(ValueError, match="block ids"):
        CopyPlanner(layout).build(plan, [3])


def test_unfilled_slots_are_zero_in_a_reused_buffer() -> None:
    _, layout = _case("hybrid", bpc=4)
    copier = HostCopier(layout)
    full = layout.plan([4, 0, 0], [0, 0, 0])
    first = copier.gather(full, [1, 2, 3, 4])()
    assert np.count_nonzero(first)
    del first  # its buffer goes back to the worker's segments and is reused below
    partial = layout.plan([1, 0, 0], [2, 0, 0])
    out = copier.gather(partial, [7])()
    rows = out.reshape(4, 160)
    assert np.count_nonzero(rows[[0, 1, 3]]) == 0
    assert np.array_equal(out, _reference_gather(layout, partial, [7]))


def test_cpu_tensors_get_the_host_copier_without_touching_cuda() -> None:
    _, layout = _case("dense", bpc=1)
    assert isinstance(make_copier(layout), HostCopier)
    assert not torch.cuda.is_initialized()
