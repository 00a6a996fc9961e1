"""The CUDA copier's host-side logic, run on CPU against a synchronous CUDA stand-in.

No GPU here, so ``tests/gpu`` is skipped. This runs every line of ``CudaCopier`` that
does not need one: plans, descriptor tables, the arena's zero slots, the DMA runs'
mapping onto extents (cut at registration bounds), registration and the ``in_place``
switch. The stand-in runtime: streams and events that are done at once, and
``swap_blocks_batch`` executed with ``memmove`` over the descriptor tables it is given
(exactly the pointer triples a GPU would get: the "device" KV is host tensors here).
Stream order is not simulated: ``tests/gpu`` checks it where there is a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.data.test_copy_plan import GEOMETRIES, _case, _job, _reference_gather
from tests.data.test_extent_copy import _extents
from tierstore.data.extent_copy import runs_of
from tierstore.data.layout import ChunkLayout, as_index
from tierstore.vllm import cuda_copy, host_register
from tierstore.vllm.cuda_copy import CudaCopier

ARENA_BYTES = 1 << 16
CUT = 256  # registration ranges of 256 bytes (pages, on a GPU): many DMA runs cross one


class _Event:
    def __init__(self, **_: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _Event) -> float:
        return 1.0


class _Stream:
    def __init__(self, device: object = None) -> None:
        pass

    def wait_event(self, event: _Event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Swaps:
    """``swap_blocks_batch`` on host memory; records (triples, src_any) per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[tuple[int, int, int]], bool]] = []

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, any_: bool):
        triples = list(zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True))
        for s, d, n in triples:
            ctypes.memmove(d, s, n)
        self.calls.append((triples, any_))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int, int]]]:
    """The stand-in runtime; yields the (un)registrations made."""
    registered: list[tuple[str, int, int]] = []
    for name, value in {
        "Stream": _Stream,
        "Event": _Event,
        "device": lambda device: contextlib.nullcontext(),
        "stream": lambda stream: contextlib.nullcontext(),
        "current_stream": lambda device=None: _Stream(),
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(cuda_copy, "_pinned", lambda n: np.empty(n, dtype=np.uint8))
    monkeypatch.setattr(
        cuda_copy, "_pinned_table", lambda n: torch.empty((3, n), dtype=torch.int64)
    )
    helpers = (
        lambda ptr, n: registered.append(("register", ptr, n)) or True,
        lambda ptr: registered.append(("unregister", ptr, 0)),
    )
    monkeypatch.setattr(host_register, "_vllm_helpers", lambda: helpers)
    monkeypatch.setattr(host_register, "MAX_REGISTER_BYTES", CUT)
    yield registered


def _copier(layout: ChunkLayout) -> tuple[CudaCopier, _Swaps]:
    swaps = _Swaps()
    return CudaCopier(layout, swap=swaps), swaps


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_into_and_from_extents_are_byte_exact(
    fake_cuda: list, name: str, bpc: int, seed: int
) -> None:
    kv, layout = _case(name, bpc, seed=seed)
    copier, swaps = _copier(layout)
    arena = np.full(ARENA_BYTES, 0xCD, dtype=np.uint8)
    assert copier.attach_arena(arena)
    base = arena.ctypes.data
    assert fake_cuda == [("register", base + o, CUT) for o in range(0, ARENA_BYTES, CUT)]
    rng = np.random.default_rng(seed)
    sizes, indices, ids = _job(len(layout.groups), rng, 24)
    plan = layout.plan(sizes, indices)
    offsets = _extents(plan.chunks, rng, ARENA_BYTES)
    runs = runs_of(plan.chunks, offsets)

    gathered = copier.gather_into(plan, ids, arena, offsets)
    assert gathered.copied() and len(gathered()) == 0 and gathered.copy_seconds > 0
    assert copier.host_bytes == 0  # no job buffer: straight into the extents
    expected = _reference_gather(layout, plan, ids)
    outside = np.ones(ARENA_BYTES, dtype=bool)
    for chunk, at in zip(plan.chunks, offsets, strict=True):
        assert np.array_equal(
            arena[at : at + chunk.nbytes], expected[chunk.offset : chunk.offset + chunk.nbytes]
        )
        outside[at : at + chunk.nbytes] = False
    assert np.all(arena[outside] == 0xCD)
    ((triples, src_any),) = swaps.calls  # one driver call for the job
    assert not src_any  # device -> host keeps stream order
    for _, dst, n in triples:  # no copy straddles two registered ranges
        assert (dst - base) // CUT == (dst + n - 1 - base) // CUT

    arena[~outside] = rng.integers(0, 256, int((~outside).sum()), dtype=np.uint8)
    dst_ids = rng.permutation(24)[: len(ids)]
    scatter = copier.prepare_scatter(plan, dst_ids, expedited=bool(seed % 2))
    assert scatter.in_place
    reference = [t.clone() for t in kv]
    pairs = zip(plan.chunks, offsets, strict=True)
    job = np.concatenate([arena[at : at + c.nbytes] for c, at in pairs])
    ChunkLayout(reference, GEOMETRIES[name][1], bpc).scatter(
        plan, as_index(dst_ids, "cpu"), torch.from_numpy(job.copy())
    )
    scatter.from_extents(arena, runs)
    for mine, theirs in zip(kv, reference, strict=True):
        assert torch.equal(mine, theirs)
    assert swaps.calls[-1][1]  # host -> device may read ahead
    assert copier.host_bytes == 0

    copier.detach_arena(arena)
    assert fake_cuda[-1][0] == "unregister"
    assert not copier.prepare_scatter(plan, dst_ids).in_place  # the object store now


def test_the_object_store_path_still_stages_in_reused_pinned_buffers(fake_cuda: list) -> None:
    kv, layout = _case("hybrid", 2)
    copier, _ = _copier(layout)
    rng = np.random.default_rng(5)
    sizes, indices, ids = _job(len(layout.groups), rng, 24)
    plan = layout.plan(sizes, indices)
    stored = copier.gather(plan, ids)()
    assert np.array_equal(stored, _reference_gather(layout, plan, ids))
    data = stored.copy()
    data.flags.writeable = False
    dst = rng.permutation(24)[: len(ids)]
    reference = [t.clone() for t in kv]
    ChunkLayout(reference, GEOMETRIES["hybrid"][1], 2).scatter(
        plan, as_index(dst, "cpu"), torch.from_numpy(data.copy())
    )
    scatter = copier.prepare_scatter(plan, dst)
    assert not scatter.in_place  # no arena attached
    scatter(data)
    for mine, theirs in zip(kv, reference, strict=True):
        assert torch.equal(mine, theirs)
    assert fake_cuda == []
