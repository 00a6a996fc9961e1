"""A load never queues behind stores whose device copies are still running; a store
whose copy cannot even start is a counted failure, and the worker goes on.

Real Ray, real NodeStore and arena; the only stand-in is the copier's device: a host
copier whose store copies into the arena report "still running" until the test lets
them end (a CUDA copy held up behind a long forward), and whose loads are not run at
submit (as on CUDA, they go to a transfer thread). Before loads had their own
threads, two such stores held both transfer threads and the load waited for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import ray
import torch
from tierstore.actors.bootstrap import get_or_create_evictor, get_or_create_node_store
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from tierstore.actors.worker_ports import RayWorkerPorts
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.support import poll
from tests.vllm.test_worker_roundtrip import NS, PAGE_BYTES, _keys, _kv, _load_spec
from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout, JobPlan
from tierstore.keys import NodeId
from tierstore.vllm.device_copy import Gathered, HostCopier, Scatter
from tierstore.vllm.transfer_specs import StoreSpec
from tierstore.vllm.worker import TierStoreWorker


class _HeldCopy:
    """A device copy that is done only once ``release`` is set."""

    def __init__(self, release: threading.Event) -> None:
        self._release = release

    def done(self) -> bool:
        return self._release.is_set()

    def wait(self) -> None:
        self._release.wait()

    def seconds(self) -> float:
        return 0.001


class _SlowStoreCopier(HostCopier):
    """Arena stores look like device copies still in flight until ``release``; loads
    run on a transfer thread, never at submit."""

    def __init__(self, layout: ChunkLayout) -> None:
        super().__init__(layout)
        self.release = threading.Event()
        self.release.set()
        self.refuse = False  # the next copies raise at launch (a driver error, say)

    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Gathered:
        if self.refuse:
            raise RuntimeError("copy launch refused")
        return super().gather(plan, block_ids)

    def gather_into(
        self, plan: JobPlan, block_ids: np.ndarray, arena: np.ndarray, offsets: Sequence[int]
    ) -> Gathered:
        if self.refuse:
            raise RuntimeError("copy launch refused")
        copied = super().gather_into(plan, block_ids, arena, offsets)
        return Gathered(copied(), _HeldCopy(self.release), digests=copied.digests)

    def prepare_scatter(
        self, plan: JobPlan, block_ids: np.ndarray, expedited: bool = False
    ) -> Scatter:
        scatter = super().prepare_scatter(plan, block_ids, expedited)
        scatter.on_caller = False
        return scatter


def _worker(
    cfg: TierStoreConfig, kv: list[torch.Tensor]
) -> tuple[TierStoreWorker, _SlowStoreCopier]:
    layout = ChunkLayout(kv, [[(0, PAGE_BYTES[0])], [(1, PAGE_BYTES[1])]], blocks_per_chunk=2)
    copier = _SlowStoreCopier(layout)
    node = NodeId(ray.get_runtime_context().get_node_id())
    evictor = EvictorClient(get_or_create_evictor(cfg), cfg.transfer_timeout_s)
    NodeStoreClient(get_or_create_node_store(cfg, node), node).status().result(30)
    ports = RayWorkerPorts(cfg.namespace, node, [evictor], cfg.transfer_timeout_s)
    worker = TierStoreWorker(layout, 0, 1, ports, cfg.transfer_timeout_s, copier=copier)
    return worker, copier


def _store(worker: TierStoreWorker, job_id: int, start: int) -> None:
    src = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[4, 1], block_indices=[0, 0])
    keys = _keys(2, 0, start) + _keys(1, 1, start)
    assert worker.submit_store(job_id, src, StoreSpec(NS, tuple(keys)))


def test_a_load_completes_while_store_copies_are_still_running(cfg: TierStoreConfig) -> None:
    kv = _kv()
    original = [t.clone() for t in kv]
    worker, copier = _worker(cfg, kv)
    finished: dict[int, bool] = {}

    def collect() -> None:
        finished.update((r.job_id, r.success) for r in worker.get_finished())

    # Stores until one went into the arena (it is mapped at start, its pool fills).
    for job in range(1, 50):
        _store(worker, job, start=0)
        poll(lambda j=job: collect() or j in finished, 30, poll_s=0.01)
        if worker.arena.arena_stores:
            break
    assert worker.arena.arena_stores, "no store went into the arena"
    assert worker.wait_committed(30)
    spec = _load_spec(cfg, _keys(2, 0) + _keys(1, 1))

    copier.release.clear()  # from here, arena store copies stay "running"
    try:
        held = _hold_three_stores(worker, collect, finished)
        dst = GPULoadStoreSpec([20, 21, 22, 23, 24], group_sizes=[4, 1], block_indices=[0, 0])
        assert worker.submit_load(200, spec, dst)
        poll(lambda: collect() or 200 in finished, 30, poll_s=0.01)
        assert finished.get(200) is True, "the load waited behind the stores' copies"
        assert not held & set(finished), "a store finished before its copy ended"
        for s, d in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True):
            assert torch.equal(kv[0][d, :96], original[0][s, :96])
        assert torch.equal(kv[1][24, :200], original[1][5, :200])
    finally:
        copier.release.set()
    poll(lambda: collect() or held <= set(finished), 30, poll_s=0.01)
    assert held <= set(finished)
    assert worker.wait_committed(30)
    worker.shutdown()


def _hold_three_stores(
    worker: TierStoreWorker, collect: Callable[[], None], finished: dict[int, bool]
) -> set[int]:
    """Store jobs until three went into the arena (their copies held); a store that
    found the extent pool empty meanwhile went through the object store and ends."""
    held: set[int] = set()
    for job in range(100, 150):
        before = worker.arena.arena_stores
        _store(worker, job, start=job)
        if worker.arena.arena_stores > before:
            held.add(job)
            if len(held) == 3:
                return held
        else:  # the pool's refill is on its way: let it land
            poll(lambda j=job: collect() or j in finished, 30, poll_s=0.01)
            time.sleep(0.05)
    raise AssertionError(f"only {len(held)} stores went into the arena")


def test_a_store_whose_copy_raises_at_submit_is_counted_and_the_worker_goes_on(
    cfg: TierStoreConfig,
) -> None:
    worker, copier = _worker(cfg, _kv())
    finished: dict[int, bool] = {}

    def collect() -> None:
        finished.update((r.job_id, r.success) for r in worker.get_finished())

    copier.refuse = True
    _store(worker, 1, start=0)  # raises inside, on the model-runner thread: not here
    poll(lambda: collect() or 1 in finished, 30, poll_s=0.01)
    assert finished == {1: True}  # vLLM has no failed store: done, its blocks free
    assert worker.failed_store_launches == 1 and worker.failed_stores == 1
    copier.refuse = False
    _store(worker, 2, start=0)
    poll(lambda: collect() or 2 in finished, 30, poll_s=0.01)
    assert finished[2] is True and worker.failed_stores == 1
    assert worker.wait_committed(30)
    _load_spec(cfg, _keys(2, 0) + _keys(1, 1))  # stored after all: every key a HIT
    worker.shutdown()
