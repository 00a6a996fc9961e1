"""The one-pass C walk against the numpy path: the same arena and KV bytes for every
geometry, both ways, the digests a store commits, the same verdict on every load's
digest, and bad block ids or extents refused."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.data.test_copy_plan import GEOMETRIES
from tests.data.test_extent_dma import job_in_extents
from tests.support import can_build_c
from tierstore.data import fused_copy
from tierstore.data.extent_copy import runs_of
from tierstore.data.layout import ChunkLayout
from tierstore.vllm.device_copy import HostCopier

needs_c = pytest.mark.skipif(not fused_copy.available(), reason="the C module is not built")
NUMPY_ONLY = 1 << 62  # fused_copy.MIN_BYTES that sends every job down the numpy path


@pytest.mark.skipif(not can_build_c(), reason="no C compiler or Python headers to build it")
def test_the_install_built_the_c_module_and_it_passed_its_probe() -> None:
    """``pip install`` builds it where a compiler exists (``deploy/setup.sh``); the jobs'
    speed depends on it, so a build that silently fell back is a failure here."""
    assert fused_copy.available()


@needs_c
@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(sorted(GEOMETRIES)),
    bpc=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    bad=st.integers(-1, 3),
    streaming=st.booleans(),
)
def test_verified_scatter_matches_hash_then_scatter_byte_for_byte(
    name: str, bpc: int, seed: int, bad: int, streaming: bool
) -> None:
    kv, layout, plan, ids, offsets, rng = job_in_extents(name, bpc, seed)
    arena = rng.integers(0, 256, 4 * plan.nbytes + 40_000, dtype=np.uint8)
    digests = [
        xxhash.xxh3_64_intdigest(arena[at : at + c.nbytes])
        for c, at in zip(plan.chunks, offsets, strict=True)
    ]
    bad = bad if bad < len(digests) else -1
    if bad >= 0:
        digests[bad] ^= 1 << 63
    extents = list(zip(offsets, digests, strict=True))
    dst = rng.permutation(24)[: len(ids)]

    theirs = [t.clone() for t in kv]
    numpy_path = HostCopier(ChunkLayout(theirs, GEOMETRIES[name][1], bpc))
    numpy_path.prepare_scatter(plan, dst).from_extents(arena, runs_of(plan.chunks, offsets))
    scatter = HostCopier(layout).prepare_scatter(plan, dst)
    assert scatter._verified is not None  # the C path, not the fallback
    with _knobs(STREAMING_MIN_BYTES=0 if streaming else NUMPY_ONLY):
        assert scatter.from_verified_extents(arena, plan.chunks, extents) is (bad < 0)
    if bad < 0:
        for a, b in zip(kv, theirs, strict=True):
            assert torch.equal(a, b)


@needs_c
@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(sorted(GEOMETRIES)),
    bpc=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    large=st.booleans(),
)
def test_a_gather_leaves_the_numpy_gathers_bytes_and_large_ones_their_digests(
    name: str, bpc: int, seed: int, large: bool
) -> None:
    """Every arena byte as the numpy gather leaves it (0xCD between extents, zeros in
    slots the job does not fill); a large job (streamed) also gives each chunk's digest,
    its extent's xxh3."""
    _, layout, plan, ids, offsets, _ = job_in_extents(name, bpc, seed)
    ours = np.full(4 * plan.nbytes + 40_000, 0xCD, dtype=np.uint8)
    theirs = ours.copy()
    streaming = 0 if large else NUMPY_ONLY
    with _knobs(STREAMING_MIN_BYTES=streaming):
        gathered = HostCopier(layout).gather_into(plan, ids, ours, offsets)
    with _knobs(MIN_BYTES=NUMPY_ONLY):
        numpy_gathered = HostCopier(layout).gather_into(plan, ids, theirs, offsets)
    assert numpy_gathered.digests is None  # the commit thread hashes those
    assert np.array_equal(ours, theirs)
    expected = [
        xxhash.xxh3_64_intdigest(ours[at : at + c.nbytes])
        for c, at in zip(plan.chunks, offsets, strict=True)
    ]
    assert gathered.digests == (expected if large else None)


@contextlib.contextmanager
def _knobs(**values: int) -> Iterator[None]:
    """Set module constants of fused_copy for a block (hypothesis runs many examples
    per test, so no monkeypatch fixture)."""
    saved = {k: getattr(fused_copy, k) for k in values}
    for k, v in values.items():
        setattr(fused_copy, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(fused_copy, k, v)


@needs_c
def test_a_wrong_digest_is_named_and_bad_block_ids_or_extents_are_refused() -> None:
    kv = [torch.zeros((6, 64), dtype=torch.int8) for _ in range(2)]
    layout = ChunkLayout(kv, [[(0, 48), (1, 64)]], blocks_per_chunk=2)
    tables = fused_copy.PlanTables(layout)
    plan = layout.plan([4], [0])  # two chunks of two 112-byte slots
    arena = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    offsets = [1000, 0]  # in the other order
    extents = [
        (at, xxhash.xxh3_64_intdigest(arena[at : at + c.nbytes]))
        for c, at in zip(plan.chunks, offsets, strict=True)
    ]
    assert fused_copy.scatter_verified(arena, tables, plan, [1, 2, 3, 4], extents) == fused_copy.OK
    assert np.array_equal(kv[0][1, :48].numpy().view(np.uint8), arena[1000:1048])
    assert np.array_equal(kv[1][4].numpy().view(np.uint8), arena[48 + 112 : 112 + 112])
    wrong = [extents[0], (0, extents[1][1] ^ 1)]
    assert fused_copy.scatter_verified(arena, tables, plan, [1, 2, 3, 4], wrong) == 1

    before = [t.clone() for t in kv]
    with pytest.raises(ValueError, match="block ids"):
        fused_copy.scatter_verified(arena, tables, plan, [6, 2, 3, 4], extents)
    with pytest.raises(ValueError, match="block ids"):
        fused_copy.gather(arena, tables, plan, [1, 2, -1, 4], offsets)
    assert all(torch.equal(a, b) for a, b in zip(kv, before, strict=True))  # nothing copied
    for outside in ([4000, 0], [-1, 0]):
        with pytest.raises(ValueError, match="outside"):
            fused_copy.gather(arena, tables, plan, [1, 2, 3, 4], outside)
    with pytest.raises(ValueError, match="extents for a job"):
        fused_copy.gather(arena, tables, plan, [1, 2, 3, 4], [0])
