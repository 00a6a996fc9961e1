"""The arena's extent allocator: no overlap, full coalescing, little fragmentation for the
few shard sizes a namespace has."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.data.arena.allocator import ExtentAllocator

ALIGN = 64


def _check(alloc: ExtentAllocator, live: dict[int, int]) -> None:
    """Live extents and holes tile the arena exactly: no overlap, no byte lost."""
    ranges = sorted([(o, alloc.size_of(n)) for o, n in live.items()] + alloc.holes())
    cursor = 0
    for offset, size in ranges:
        assert offset == cursor, f"gap or overlap at {cursor}: next range starts at {offset}"
        cursor = offset + size
    assert cursor == alloc.capacity
    assert alloc.free_bytes == sum(size for _, size in alloc.holes())
    holes = alloc.holes()
    for (a, n), (b, _) in itertools.pairwise(holes):
        assert a + n < b, "adjacent holes were not coalesced"


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9 * ALIGN), min_size=1, max_size=3, unique=True),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 2), st.integers(0, 1000)), max_size=200),
)
def test_no_overlap_and_all_freed_is_one_range(sizes: list[int], ops: list) -> None:
    alloc = ExtentAllocator(64 * ALIGN, ALIGN)
    live: dict[int, int] = {}
    for is_alloc, which, pick in ops:
        if is_alloc or not live:
            nbytes = sizes[which % len(sizes)]
            offset = alloc.allocate(nbytes)
            if offset is None:
                assert alloc.largest_hole < alloc.size_of(nbytes)
            else:
                assert offset % ALIGN == 0 and offset not in live
                live[offset] = nbytes
        else:
            offset = sorted(live)[pick % len(live)]
            alloc.free(offset, live.pop(offset))
        _check(alloc, live)
    for offset, nbytes in list(live.items()):
        alloc.free(offset, nbytes)
    assert alloc.holes() == [(0, alloc.capacity)]


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 8 * ALIGN),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), max_size=300),
)
def test_one_size_is_refused_only_when_full(size: int, ops: list) -> None:
    """Every hole is a multiple of the one size: a refusal means the bytes are not there."""
    alloc = ExtentAllocator(50 * ALIGN + 17, ALIGN)
    live: list[int] = []
    for is_alloc, pick in ops:
        if is_alloc or not live:
            offset = alloc.allocate(size)
            if offset is None:
                assert alloc.free_bytes < alloc.size_of(size) + alloc.capacity % alloc.size_of(size)
            else:
                live.append(offset)
        else:
            alloc.free(live.pop(pick % len(live)), size)


def test_few_sizes_under_random_churn_fill_the_arena() -> None:
    """Three sizes, random frees at high occupancy: refusals only once the arena is ~full."""
    rng = random.Random(7)
    sizes = [256 << 10, 512 << 10, 768 << 10]
    alloc = ExtentAllocator(1 << 30, 4096)
    live: list[tuple[int, int]] = []
    refusals_at: list[float] = []
    for _ in range(20_000):
        nbytes = rng.choice(sizes)
        offset = alloc.allocate(nbytes)
        if offset is None:
            refusals_at.append(1 - alloc.free_bytes / alloc.capacity)
            # the Evictor makes room: drop random shards until this one fits
            while offset is None:
                alloc.free(*live.pop(rng.randrange(len(live))))
                offset = alloc.allocate(nbytes)
        live.append((offset, nbytes))
    assert refusals_at, "the workload never filled the arena"
    assert min(refusals_at) > 0.9, f"refused at {min(refusals_at):.1%} occupancy"


def test_double_free_and_foreign_extents_are_refused() -> None:
    alloc = ExtentAllocator(16 * ALIGN, ALIGN)
    offset = alloc.allocate(ALIGN)
    assert offset is not None
    alloc.free(offset, ALIGN)
    with pytest.raises(ValueError, match="already"):
        alloc.free(offset, ALIGN)
    with pytest.raises(ValueError, match="not in this arena"):
        alloc.free(15 * ALIGN, 2 * ALIGN)
    with pytest.raises(ValueError, match="not in this arena"):
        alloc.free(3, ALIGN)
    assert alloc.holes() == [(0, alloc.capacity)]
