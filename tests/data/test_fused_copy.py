"""The one-pass verified scatter (C) against the numpy path: the same KV bytes for every
geometry, the same verdict on every digest, and bad copy runs refused."""

from __future__ import annotations

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
from tierstore.data.copy_plan import DmaRuns
from tierstore.data.extent_copy import runs_of
from tierstore.data.fused_copy import ShardExtent
from tierstore.data.layout import ChunkLayout
from tierstore.vllm.device_copy import HostCopier

needs_c = pytest.mark.skipif(not fused_copy.available(), reason="the C module is not built")


@pytest.mark.skipif(not can_build_c(), reason="no C compiler or Python headers to build it")
def test_the_install_built_the_c_module_and_it_passed_its_probe() -> None:
    """``pip install`` builds it where a compiler exists (``deploy/setup.sh``); the loads'
    speed depends on it, so a build that silently fell back is a failure here."""
    assert fused_copy.available()


@needs_c
@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(sorted(GEOMETRIES)),
    bpc=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    bad=st.integers(-1, 3),
)
def test_verified_scatter_matches_hash_then_scatter_byte_for_byte(
    name: str, bpc: int, seed: int, bad: int
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
    small, fused_copy.MIN_BYTES = fused_copy.MIN_BYTES, 0  # these jobs are all small
    try:
        scatter = HostCopier(layout).prepare_scatter(plan, dst)
    finally:
        fused_copy.MIN_BYTES = small
    assert scatter._from_verified_extents is not None  # the C path, not the fallback
    assert scatter.from_verified_extents(arena, plan.chunks, extents) is (bad < 0)
    if bad < 0:
        for a, b in zip(kv, theirs, strict=True):
            assert torch.equal(a, b)


@needs_c
def test_a_wrong_digest_is_named_and_bad_runs_or_shards_are_refused() -> None:
    """Two 256-byte shards, their extents in the other order in the arena; one run
    crosses from the first into the second."""
    arena = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    job = np.concatenate([arena[1024:1280], arena[0:256]])
    out = np.zeros(512, dtype=np.uint8)
    base = out.ctypes.data
    shards = [
        ShardExtent(0, 256, 1024, xxhash.xxh3_64_intdigest(job[:256])),
        ShardExtent(256, 256, 0, xxhash.xxh3_64_intdigest(job[256:])),
    ]

    def runs(*triples: tuple[int, int, int]) -> DmaRuns:
        kv, lo, n = (np.array(col, dtype=np.int64) for col in zip(*triples, strict=True))
        return DmaRuns(kv, lo, n)

    crossing = runs((base, 0, 16), (base + 100, 100, 300))
    assert fused_copy.scatter_verified(arena, shards, crossing) == fused_copy.OK
    assert np.array_equal(out[:16], job[:16]) and not out[16:100].any()
    assert np.array_equal(out[100:400], job[100:400]) and not out[400:].any()
    wrong = [shards[0], shards[1]._replace(digest=shards[1].digest ^ 1)]
    assert fused_copy.scatter_verified(arena, wrong, crossing) == 1
    for bad_runs in (
        runs((base, 100, 16), (base, 50, 16)),  # backwards
        runs((base, 0, 32), (base, 16, 32)),  # overlapping
        runs((base, 500, 16)),  # past the job's end
    ):
        with pytest.raises(ValueError, match="copy runs"):
            fused_copy.scatter_verified(arena, shards, bad_runs)
    with pytest.raises(ValueError, match="tile"):
        fused_copy.scatter_verified(arena, [shards[0], shards[1]._replace(job_lo=300)], crossing)
    with pytest.raises(ValueError, match="outside"):
        fused_copy.scatter_verified(arena, [shards[0]._replace(arena_at=3900)], runs((base, 0, 8)))
