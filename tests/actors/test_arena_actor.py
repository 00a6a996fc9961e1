"""The NodeStore's arena behind the real actor: a killed worker's grants come back, and a
restarted NodeStore has a new, empty arena (misses, never stale bytes) that every worker
of the node maps, even one that only loads."""

from __future__ import annotations

import os
import signal
import time

import ray
from tierstore.actors.bootstrap import find_node_store
from tierstore.actors.clients import NodeStoreClient
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.support import holder_process, poll, wait_for
from tests.vllm.test_worker_roundtrip import NS, _drain, _keys, _kv, _load_spec, _lookup, _worker
from tierstore.config import TierStoreConfig
from tierstore.data.arena.holders import HolderLock
from tierstore.errors import ClusterUnavailableError
from tierstore.keys import NodeId
from tierstore.vllm.transfer_specs import StoreSpec
from tierstore.wire import LookupState


def _node_store(cfg: TierStoreConfig) -> NodeStoreClient:
    node = NodeId(ray.get_runtime_context().get_node_id())
    return NodeStoreClient(find_node_store(cfg.namespace, node), node)


def test_extents_granted_to_a_killed_worker_are_reclaimed(cfg: TierStoreConfig) -> None:
    _worker(cfg, _kv())  # starts the NodeStore
    store = _node_store(cfg)
    region, _ = store.arena_info().result()
    free = store.status().result()["arena"]["arena_free_bytes"]
    proc, holder = holder_process(region.path)
    try:
        epoch, offsets = store.arena_grant(holder, region.epoch, [4096] * 4).result()
        assert epoch == region.epoch and None not in offsets
        arena = store.status().result()["arena"]
        assert arena["granted_bytes"] == 4 * 4096
        assert arena["arena_free_bytes"] == free - 4 * 4096
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # between grant and commit
        proc.wait()
    me = HolderLock(region.path)
    store.arena_grant(me.holder, region.epoch, []).result()  # any grant sweeps the dead
    me.close()
    arena = store.status().result()["arena"]
    assert arena["granted_bytes"] == 0 and arena["arena_free_bytes"] == free


def test_a_killed_workers_extents_come_back_while_another_worker_only_commits(
    cfg: TierStoreConfig,
) -> None:
    """A worker storing steadily refills its pool from its commits' answers and makes no
    grant call; its commits still sweep what a killed worker held (at most once a
    second), so nothing leaks while no grant call comes."""
    worker = _worker(cfg, _kv())
    src = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4, 0], block_indices=[0, 0])

    def store(job: int) -> None:
        worker.submit_store(job, src, StoreSpec(NS, tuple(_keys(2, 0, start=10 * job))))
        assert _drain(worker, 1) == [job]
        assert worker.wait_committed(30.0)

    for job in (1, 2, 3):  # the first maps the arena; the pool fills
        store(job)
    assert worker.arena.arena_stores >= 1
    node_store = _node_store(cfg)
    region, _ = node_store.arena_info().result()
    proc, holder = holder_process(region.path)
    try:
        _, offsets = node_store.arena_grant(holder, region.epoch, [4096] * 4).result()
        assert None not in offsets
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(1.1)  # past the commits' sweep interval
    store(4)
    pool = worker.arena._arena.pool
    sizes = [c.nbytes for c in worker._plan(src, 2, 0).chunks]
    assert not pool.short(sizes)  # the commit refilled it: no grant call was due
    assert node_store.status().result()["arena"]["granted_bytes"] == pool.held_bytes


def _replaced(cfg: TierStoreConfig, node: str) -> bool:
    try:
        ray.get(find_node_store(cfg.namespace, node).status.remote(), timeout=5)
        return True
    except (ClusterUnavailableError, ray.exceptions.RayError):
        return False


def test_a_restarted_node_store_has_an_empty_arena_and_workers_remap(
    cfg: TierStoreConfig,
) -> None:
    worker = _worker(cfg, _kv())
    reader = _worker(cfg, _kv())  # another engine of the node, one that only loads
    reader.arena._ready()
    assert poll(lambda: reader.arena._arena, 20) is not None
    src = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4, 0], block_indices=[0, 0])
    for job in (1, 2, 3):  # the first maps the arena; then stores go through it
        keys = _keys(2, 0, start=10 * job)
        worker.submit_store(job, src, StoreSpec(NS, tuple(keys)))
        assert _drain(worker, 1) == [job]
    assert worker.arena.arena_stores >= 1
    old_epoch = _node_store(cfg).arena_info().result()[0].epoch
    node = ray.get_runtime_context().get_node_id()
    ray.kill(find_node_store(cfg.namespace, node))
    wait_for(lambda: _replaced(cfg, node), "a new NodeStore on the node", timeout_s=30)
    assert _lookup(cfg, keys) == [LookupState.MISS] * 2
    region, _ = _node_store(cfg).arena_info().result()
    assert region.epoch != old_epoch
    # The worker notices the new arena, maps it and stores through it again (jobs keep
    # coming, as from a serving engine).
    jobs = iter(range(4, 400))

    def stored_into_the_new_arena() -> bool:
        job = next(jobs)
        worker.submit_store(job, src, StoreSpec(NS, tuple(_keys(2, 0, start=10 * job))))
        assert _drain(worker, 1) == [job]
        return getattr(worker.arena._arena, "epoch", None) == region.epoch

    assert poll(stored_into_the_new_arena, 20, poll_s=0.05)
    stores = worker.arena.arena_stores
    keys = _keys(2, 0, start=500)
    poll(lambda: worker.arena._arena.pool.held_bytes > 0, 10)
    worker.submit_store(99, src, StoreSpec(NS, tuple(keys)))
    assert _drain(worker, 1) == [99]
    assert worker.arena.arena_stores == stores + 1
    spec = _load_spec(cfg, keys)  # HITs in the new arena
    # The reader's loads call nobody (the directory), so it looks at the arena's file:
    # replaced, it maps the new arena and loads from it, unpinned.
    assert poll(lambda: getattr(reader.arena._ready(), "epoch", None) == region.epoch, 10)
    reader.submit_load(100, spec, GPULoadStoreSpec([20, 21, 22, 23], [4, 0], [0, 0]))
    assert _drain(reader, 1) == [100]
    assert reader.arena.unpinned_loads == 1
    reader.shutdown()
    worker.shutdown()
