"""The copier's arena hooks in a real worker (real Ray, real NodeStore, real mapping):
the arena is attached once when it is mapped and detached before it is unmapped; a
copier that cannot attach it (CUDA: ``cudaHostRegister`` refused) leaves the worker on
the object-store path, byte-exact all the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import poll
from tests.vllm.test_worker_arena import DST, _pool_ready, _store
from tests.vllm.test_worker_roundtrip import _drain, _kv, _load_spec, _worker
from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout
from tierstore.vllm.device_copy import HostCopier


class _Recording(HostCopier):
    """The host copier, recording each arena it is handed: (base, bytes mapped then)."""

    refuse = False

    def __init__(self, layout: ChunkLayout) -> None:
        super().__init__(layout)
        self.attached: list[tuple[int, int]] = []
        self.detached: list[tuple[int, int]] = []

    def attach_arena(self, array: np.ndarray) -> bool:
        self.attached.append((array.ctypes.data, array.nbytes))
        return not self.refuse

    def detach_arena(self, array: np.ndarray) -> None:
        self.detached.append((array.ctypes.data, array.nbytes))


class _Refusing(_Recording):
    refuse = True


def _with_copier(monkeypatch: pytest.MonkeyPatch, cls: type[_Recording]) -> list[_Recording]:
    made: list[_Recording] = []

    def make(layout: ChunkLayout, bounce_bytes: int | None = None) -> _Recording:
        made.append(cls(layout))
        return made[-1]

    # connect_worker makes the copier (with the config's bounce pool); a worker built
    # without one makes its own
    monkeypatch.setattr("tierstore.spec.make_copier", make)
    monkeypatch.setattr("tierstore.vllm.worker.make_copier", make)
    return made


def test_the_arena_is_attached_once_and_detached_before_it_is_unmapped(
    cfg: TierStoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _with_copier(monkeypatch, _Recording)
    worker = _worker(cfg, _kv())
    _store(worker, 1, 0)
    _pool_ready(worker)
    _store(worker, 2, 10)
    assert worker.arena.arena_stores >= 1
    (copier,) = made
    mapping = worker.arena._arena.mapping
    assert copier.attached == [(mapping.address, mapping.nbytes)]
    assert copier.detached == []
    worker.shutdown()
    assert copier.detached == copier.attached  # still mapped, whole, when detached
    assert mapping.array.nbytes == 0  # and unmapped after


def test_an_arena_the_copier_cannot_attach_leaves_the_object_store_path(
    cfg: TierStoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _with_copier(monkeypatch, _Refusing)
    kv = _kv()
    original = [t.clone() for t in kv]
    worker = _worker(cfg, kv)
    _store(worker, 1, 0)
    (copier,) = made
    assert poll(lambda: worker.arena._no_arena_here, 20), "the worker kept asking for the arena"
    assert len(copier.attached) == 1
    keys = _store(worker, 2, 10)
    worker.submit_load(3, _load_spec(cfg, keys), DST)
    assert _drain(worker, 1) == [3]
    assert worker.arena.arena_stores == 0 and worker.arena.arena_loads == 0
    assert worker.arena._arena is None
    for s, d in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True):
        assert torch.equal(kv[0][d, :96], original[0][s, :96])
    assert torch.equal(kv[1][24, :200], original[1][5, :200])
    worker.shutdown()
    assert copier.detached == []  # never attached: nothing to detach
