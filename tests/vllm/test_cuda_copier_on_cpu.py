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
import enum
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.data.test_copy_plan import GEOMETRIES, _case, _job, _reference_gather
from tests.data.test_extent_copy import _extents
from tierstore.data.checksum import digest
from tierstore.data.extent_copy import runs_of
from tierstore.data.layout import ChunkLayout, as_index
from tierstore.vllm import cuda_copy, host_register
from tierstore.vllm.batch_copy import BatchCopy, DriverBatchCopy, RunCopy, VllmBatchCopy
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
    cuda_stream = 0  # the handle cuda-bindings is given

    def __init__(self, device: object = None) -> None:
        pass

    def wait_event(self, event: _Event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Recording(BatchCopy):
    """An executor that records (triples, src_any) per call, then runs ``inner``."""

    def __init__(self, inner: BatchCopy) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[list[tuple[int, int, int]], bool]] = []

    def launch(self, table, n, stream, src_any, host) -> None:
        self.calls.append((list(zip(*table[:, :n].tolist(), strict=True)), src_any))
        self.inner.launch(table, n, stream, src_any, host)


def _memmove_swap(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, any_: bool):
    """vLLM's ``swap_blocks_batch`` contract, on host memory."""
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


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
    helpers = (
        lambda ptr, n: registered.append(("register", ptr, n)) or True,
        lambda ptr: registered.append(("unregister", ptr, 0)),
    )
    monkeypatch.setattr(host_register, "default_helpers", lambda: helpers)
    monkeypatch.setattr(host_register, "MAX_REGISTER_BYTES", CUT)
    yield registered


class _FakeDriver:
    """``cuda.bindings.driver`` as far as :class:`DriverBatchCopy` uses it, with the
    documented argument order (dsts before srcs) and a memmove per copy."""

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0

    class CUmemcpySrcAccessOrder(enum.Enum):
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
        CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3

    class CUmemcpyAttributes:
        srcAccessOrder = None

    class CUdeviceptr(int):
        pass

    class CUstream(int):
        pass

    def cuMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attr_idxs, n_attrs, stream):
        assert count == len(dsts) == len(srcs) == len(sizes) and attr_idxs == [0] == [0] * n_attrs
        assert all(isinstance(p, self.CUdeviceptr) for p in dsts + srcs)
        assert isinstance(stream, self.CUstream)
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(int(d), int(s), n)
        return (self.CUresult.CUDA_SUCCESS,)


def _copier(
    layout: ChunkLayout, executor: str = "vllm", bounce_bytes: int = 64 << 20
) -> tuple[CudaCopier, _Recording]:
    inner = {
        "vllm": lambda: VllmBatchCopy(_memmove_swap),
        "driver": lambda: DriverBatchCopy(_FakeDriver()),
        "runs": lambda: RunCopy(layout.tensors),
    }[executor]()
    swaps = _Recording(inner)
    return CudaCopier(layout, executor=swaps, bounce_bytes=bounce_bytes), swaps


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("executor", ["vllm", "driver", "runs"])
def test_gather_into_and_from_extents_are_byte_exact(
    fake_cuda: list, name: str, bpc: int, seed: int, executor: str
) -> None:
    kv, layout = _case(name, bpc, seed=seed)
    copier, swaps = _copier(layout, executor)
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
    assert copier.bounced_jobs == 0  # no job buffer: straight into the extents
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
    assert copier.bounced_jobs == 0 and copier.split_jobs == 0

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


BIG_BLOCKS = 48


def _big_job(layout: ChunkLayout, rng: np.random.Generator):
    """A job of three 4 KiB pieces or more through a one-page staging slot."""
    plan = layout.plan([20, 20], [1, 0])
    ids = rng.choice(BIG_BLOCKS, 40, replace=False)
    return plan, ids


@pytest.mark.parametrize("executor", ["vllm", "runs"])
def test_a_job_larger_than_the_bounce_pool_goes_in_pieces_byte_exact(
    fake_cuda: list, executor: str
) -> None:
    kv, layout = _case("dense", 4, num_blocks=BIG_BLOCKS)
    # 8 KiB: one page of job buffers, two one-page staging slots.
    copier, _ = _copier(layout, executor, bounce_bytes=8 << 10)
    rng = np.random.default_rng(3)
    plan, ids = _big_job(layout, rng)
    assert plan.nbytes > 2 * copier.slot_bytes
    stored = copier.gather(plan, ids)()  # pieces from the launch thread
    assert np.array_equal(stored, _reference_gather(layout, plan, ids))
    assert copier.split_jobs == 1 and copier.bounced_jobs == 0

    dst = rng.permutation(BIG_BLOCKS)[:40]
    reference = [t.clone() for t in kv]
    ChunkLayout(reference, GEOMETRIES["dense"][1], 4).scatter(
        plan, as_index(dst, "cpu"), torch.from_numpy(stored.copy())
    )
    data = stored.copy()
    data.flags.writeable = False
    copier.prepare_scatter(plan, dst)(data)
    for mine, theirs in zip(kv, reference, strict=True):
        assert torch.equal(mine, theirs)
    assert copier.split_jobs == 2
    assert copier.host_bytes == 4096  # nothing allocated past the start


@pytest.mark.parametrize("bounce", [8 << 10, 1 << 20])  # in pieces, whole
def test_fetched_shards_are_hashed_as_they_are_staged_and_a_bad_one_fails(
    fake_cuda: list, bounce: int
) -> None:
    kv, layout = _case("dense", 4, num_blocks=BIG_BLOCKS)
    copier, _ = _copier(layout, bounce_bytes=bounce)
    rng = np.random.default_rng(4)
    plan, _ = _big_job(layout, rng)
    data = rng.integers(0, 256, plan.nbytes, dtype=np.uint8)
    shards = [data[c.offset : c.offset + c.nbytes] for c in plan.chunks]
    good = [(s, digest(s)) for s in shards]
    dst = rng.permutation(BIG_BLOCKS)[:40]
    scatter = copier.prepare_scatter(plan, dst)
    assert scatter.pieces_in_place
    assert scatter.from_verified_pieces(plan.chunks, good)
    reference = [t.clone() for t in kv]
    ChunkLayout(reference, GEOMETRIES["dense"][1], 4).scatter(
        plan, as_index(dst, "cpu"), torch.from_numpy(data.copy())
    )
    for mine, theirs in zip(kv, reference, strict=True):
        assert torch.equal(mine, theirs)
    bad = list(good)
    bad[-1] = (bad[-1][0], bad[-1][1] ^ 1)
    assert not copier.prepare_scatter(plan, dst).from_verified_pieces(plan.chunks, bad)


def test_an_arena_cuda_will_not_register_is_used_pageable_and_counted(
    fake_cuda: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused: list[int] = []
    monkeypatch.setattr(
        host_register,
        "default_helpers",
        lambda: (lambda ptr, n: refused.append(n) and False, lambda ptr: None),
    )
    kv, layout = _case("hybrid", 2)
    copier, _ = _copier(layout)
    arena = np.full(ARENA_BYTES, 0xCD, dtype=np.uint8)
    assert copier.attach_arena(arena)  # usable all the same
    assert refused and copier.pageable_arenas == 1
    rng = np.random.default_rng(6)
    sizes, indices, ids = _job(len(layout.groups), rng, 24)
    plan = layout.plan(sizes, indices)
    offsets = _extents(plan.chunks, rng, ARENA_BYTES)
    gathered = copier.gather_into(plan, ids, arena, offsets)  # from the launch thread
    gathered.wait_copied()
    expected = _reference_gather(layout, plan, ids)
    for chunk, at in zip(plan.chunks, offsets, strict=True):
        assert np.array_equal(
            arena[at : at + chunk.nbytes], expected[chunk.offset : chunk.offset + chunk.nbytes]
        )
    dst = rng.permutation(24)[: len(ids)]
    extents = [
        (at, digest(arena[at : at + c.nbytes])) for c, at in zip(plan.chunks, offsets, strict=True)
    ]
    scatter = copier.prepare_scatter(plan, dst)
    assert scatter.in_place
    reference = [t.clone() for t in kv]
    ChunkLayout(reference, GEOMETRIES["hybrid"][1], 2).scatter(
        plan, as_index(dst, "cpu"), torch.from_numpy(expected.copy())
    )
    assert scatter.from_verified_extents(arena, plan.chunks, extents)
    for mine, theirs in zip(kv, reference, strict=True):
        assert torch.equal(mine, theirs)
    extents[0] = (extents[0][0], extents[0][1] ^ 1)
    assert not copier.prepare_scatter(plan, dst).from_verified_extents(arena, plan.chunks, extents)
    copier.detach_arena(arena)
    assert not copier.prepare_scatter(plan, dst).in_place
