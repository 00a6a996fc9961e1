"""A job gathered straight into per-chunk extents (and scattered back from them) is
byte-exact against the layout's gather/scatter of one contiguous buffer, wherever the
extents lie: back to back, shuffled, or mixed."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.data.test_copy_plan import GEOMETRIES, _case, _job, _reference_gather
from tierstore.data.arena.allocator import ExtentAllocator
from tierstore.data.copy_plan import CopyPlanner
from tierstore.data.extent_copy import gather_into, runs_of, scatter_from
from tierstore.data.host_copy import HostExecutor
from tierstore.data.layout import ChunkLayout, as_index


def _extents(chunks, rng: np.random.Generator, arena_bytes: int) -> list[int]:
    """Extents from a real allocator, allocated in a shuffled order with some freed
    between, so some chunks are back to back in the arena and others are not."""
    alloc = ExtentAllocator(arena_bytes, 64)
    order = rng.permutation(len(chunks))
    offsets = [0] * len(chunks)
    for i in order:
        if rng.random() < 0.3:
            spare = alloc.allocate(int(rng.integers(1, 300)))
            assert spare is not None
        got = alloc.allocate(chunks[i].nbytes)
        assert got is not None
        offsets[i] = got
    return offsets


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(GEOMETRIES)),
    bpc=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_gather_into_extents_and_scatter_back_are_byte_exact(
    name: str, bpc: int, seed: int
) -> None:
    kv, layout = _case(name, bpc, seed=seed)
    rng = np.random.default_rng(seed)
    sizes, indices, ids = _job(len(layout.groups), rng, 24)
    plan = layout.plan(sizes, indices)
    copy_plan = CopyPlanner(layout).build(plan, ids)
    arena = np.full(4 * plan.nbytes + 40_000, 0xCD, dtype=np.uint8)
    offsets = _extents(plan.chunks, rng, arena.nbytes)
    runs = runs_of(plan.chunks, offsets)
    executor = HostExecutor(layout)

    gather_into(executor, copy_plan, arena, runs)
    expected = _reference_gather(layout, plan, ids)
    for chunk, at in zip(plan.chunks, offsets, strict=True):
        got = arena[at : at + chunk.nbytes]
        assert np.array_equal(got, expected[chunk.offset : chunk.offset + chunk.nbytes])

    dst = rng.permutation(24)[: len(ids)]
    reference = [t.clone() for t in kv]
    ChunkLayout(reference, GEOMETRIES[name][1], bpc).scatter(
        plan, as_index(dst, layout.device), torch.from_numpy(expected.copy())
    )
    scatter_from(executor, CopyPlanner(layout).build(plan, dst), arena, runs)
    for mine, theirs in zip(kv, reference, strict=True):
        assert torch.equal(mine, theirs)


def test_back_to_back_extents_make_one_run() -> None:
    _, layout = _case("dense", bpc=2)
    plan = layout.plan([6, 3], [1, 0])
    chunk_bytes = [c.nbytes for c in plan.chunks]
    offsets = [int(x) for x in np.cumsum([1000, *chunk_bytes[:-1]])]
    assert len(runs_of(plan.chunks, offsets)) == 1
    moved = offsets[:2] + [at + 64 for at in offsets[2:]]  # a gap before the third chunk
    assert len(runs_of(plan.chunks, moved)) == 2
