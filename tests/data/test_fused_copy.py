"""The one-pass C walk against the numpy path: the same arena and KV bytes for every
geometry, both ways, the digests a store commits, the same verdict on every load's
digest, and bad block ids, extents or tables refused with nothing written; other
Python threads run while it copies; setup.sh rebuilds it when its source changes."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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


# Columns of a ref row (fused_copy.PlanTables.refs, fused_copy.c REF_*).
REF_STRIDE, REF_OFFSET = 1, 4


def _narrow_stride(tables: fused_copy.PlanTables) -> None:
    tables.refs[0, REF_STRIDE] = 16  # its rows are 32 bytes: 16-byte rows fit in them


def _drop_last_ref(tables: fused_copy.PlanTables) -> None:
    tables.refs = tables.refs[:1]  # the same rows (same address), one fewer given


def _shift_past_slot(tables: fused_copy.PlanTables) -> None:
    tables.refs[1, REF_OFFSET] += 8  # its page now ends 8 bytes past the slot


@needs_c
@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (_narrow_stride, "wider than its tensor's row stride"),
        (_drop_last_ref, "outside the ref table"),
        (_shift_past_slot, "outside its slot"),
    ],
)
def test_a_table_the_c_walk_cannot_trust_is_refused_with_nothing_written(
    tamper: Callable[[fused_copy.PlanTables], None], message: str
) -> None:
    """Rows of the plan's tables that would send a page past its row, its slot or the
    table itself: ValueError, and neither the KV cache (load) nor the arena (store) is
    touched, even by the pages before the bad one."""
    rng = np.random.default_rng(5)
    kv = [torch.from_numpy(rng.integers(-128, 128, (6, n), dtype=np.int8)) for n in (32, 64)]
    layout = ChunkLayout(kv, [[(0, 32), (1, 64)]], blocks_per_chunk=2)
    tables = fused_copy.PlanTables(layout)
    plan = layout.plan([4], [0])  # two chunks of two 96-byte slots
    tables.spans(plan)  # the span rows the walks below read
    tamper(tables)
    arena = rng.integers(0, 256, 1024, dtype=np.uint8)
    offsets = [512, 0]
    extents = [
        (at, xxhash.xxh3_64_intdigest(arena[at : at + c.nbytes]))
        for c, at in zip(plan.chunks, offsets, strict=True)
    ]
    kv_before, arena_before = [t.clone() for t in kv], arena.copy()
    with pytest.raises(ValueError, match=message):
        fused_copy.scatter_verified(arena, tables, plan, [1, 2, 3, 4], extents)
    assert all(torch.equal(a, b) for a, b in zip(kv, kv_before, strict=True))
    with pytest.raises(ValueError, match=message):
        fused_copy.gather(arena, tables, plan, [1, 2, 3, 4], offsets)
    assert np.array_equal(arena, arena_before)


_ODD_VALUES = [-(2**63), -1, 0, 1, 31, 32, 33, 95, 96, 97, 1000, 2**62, 2**63 - 1]


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    in_spans=st.booleans(),
    row=st.integers(0, 1),
    column=st.integers(0, 5),
    value=st.sampled_from(_ODD_VALUES) | st.integers(-3, 3),
    replace=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_no_corrupt_index_in_the_tables_makes_a_walk_write_out_of_bounds(
    in_spans: bool, row: int, column: int, value: int, replace: bool, seed: int
) -> None:
    """One span field, or one ref's page bytes or slot offset, set to an odd value (or
    moved by a few): the walk either refuses (ValueError, nothing written) or writes only
    inside the KV tensors' rows and the chunks' extents (guard rows and bytes around
    them unchanged). Addresses, strides and rows are the caller's to get right."""
    rng = np.random.default_rng(seed)
    kv_with_guards = [
        torch.from_numpy(rng.integers(-128, 128, (8, n), dtype=np.int8)) for n in (32, 64)
    ]
    kv = [t[1:7] for t in kv_with_guards]  # a guard row on each side
    layout = ChunkLayout(kv, [[(0, 32)], [(1, 64)]], blocks_per_chunk=2)
    tables, plan = fused_copy.PlanTables(layout), layout.plan([3, 2], [0, 1])
    spans, _ = tables.spans(plan)
    table, column = (spans, column) if in_spans else (tables.refs, 3 + column % 2)
    table[row, column] = value if replace else table[row, column] + value
    arena = rng.integers(0, 256, 4096, dtype=np.uint8)
    offsets = [3000, 2000, 1000, 0]
    extents = [
        (at, xxhash.xxh3_64_intdigest(arena[at : at + c.nbytes]))
        for c, at in zip(plan.chunks, offsets, strict=True)
    ]
    kv_before, arena_before = [t.clone() for t in kv_with_guards], arena.copy()
    ids = [5, 0, 3, 2, 4]
    try:
        fused_copy.scatter_verified(arena, tables, plan, ids, extents)
    except ValueError:
        assert all(torch.equal(a, b) for a, b in zip(kv_with_guards, kv_before, strict=True))
    for t, before in zip(kv_with_guards, kv_before, strict=True):
        assert torch.equal(t[0], before[0]) and torch.equal(t[7], before[7])
    try:
        fused_copy.gather(arena, tables, plan, ids, offsets)
    except ValueError:
        assert np.array_equal(arena, arena_before)
    outside = np.ones(arena.nbytes, dtype=bool)
    for chunk, at in zip(plan.chunks, offsets, strict=True):
        outside[at : at + chunk.nbytes] = False
    assert np.array_equal(arena[outside], arena_before[outside])


@needs_c
def test_other_python_threads_run_while_a_walk_copies() -> None:
    """A long copy (a 64 MiB store, hashed) must not stop the process's other Python
    threads, the model runner's among them. With a switch interval longer than the
    test, this thread keeps the GIL unless a call lets it go: the other thread, woken
    before the walks start, runs only if a walk releases it."""
    kv = [torch.zeros((64, 1 << 20), dtype=torch.uint8)]
    layout = ChunkLayout(kv, [[(0, 1 << 20)]], blocks_per_chunk=16)
    tables, plan = fused_copy.PlanTables(layout), layout.plan([64], [0])
    arena = np.empty(plan.nbytes, dtype=np.uint8)
    offsets, ids = [c.offset for c in plan.chunks], list(range(64))
    go, ran = threading.Event(), threading.Event()

    def run_when_woken() -> None:
        if go.wait(60):
            ran.set()

    other = threading.Thread(target=run_when_woken, daemon=True)
    other.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(600.0)
    try:
        go.set()
        deadline = time.monotonic() + 30
        while not ran.is_set() and time.monotonic() < deadline:
            assert fused_copy.gather(arena, tables, plan, ids, offsets) is not None
        ran_during_walks = ran.is_set()
    finally:
        sys.setswitchinterval(interval)
        other.join(60)
    assert ran_during_walks, "no other Python thread ran during 30 s of walks"


REPO = Path(__file__).resolve().parents[2]


def test_setup_installs_again_when_the_c_source_changes(tmp_path: Path) -> None:
    """deploy/setup.sh skips the install while its stamp matches; the editable install
    is what rebuilds the C module, so an edited fused_copy.c must change the stamp (or
    the old module stays loaded)."""
    script = (REPO / "deploy" / "setup.sh").read_text()
    (want,) = re.findall(r"^want=.*$", script, flags=re.MULTILINE)
    for part in ("pyproject.toml", "deploy", "tierstore"):
        copy = shutil.copytree if (REPO / part).is_dir() else shutil.copy
        copy(REPO / part, tmp_path / part)

    def stamp() -> str:
        run = ["bash", "-c", f'set -euo pipefail; {want}; echo "$want"']
        return subprocess.run(run, cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    before = stamp()
    with open(tmp_path / "tierstore" / "data" / "fused_copy.c", "a") as source:
        source.write("/* edited */\n")
    assert stamp() != before
