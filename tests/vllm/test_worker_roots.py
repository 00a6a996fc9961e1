"""A store job's root (``StoreSpec.root``, the request's prefix tree, which names the
Evictor shard that indexes it) reaches the NodeStore with every shard, on both the
object-store path and the arena path: the NodeStore keeps it in each shard's meta.
Real Ray, real NodeStore, real KV tensors."""

from __future__ import annotations

import dataclasses

import ray
from tierstore.actors.bootstrap import evictor_clients, find_node_store
from tierstore.actors.clients import NodeStoreClient
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
)

from tests.support import wait_for
from tests.vllm.test_worker_arena import _pool_ready
from tests.vllm.test_worker_roundtrip import NS, _drain, _keys, _kv, _worker
from tierstore.config import TierStoreConfig
from tierstore.keys import NodeId, root_of, shard_of
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.manager import TierStoreManager
from tierstore.vllm.transfer_specs import StoreSpec

SRC = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[4, 1], block_indices=[0, 0])
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def test_every_stored_shard_keeps_its_requests_root(cfg: TierStoreConfig) -> None:
    kv = _kv()
    worker = _worker(cfg, kv)
    node = NodeId(ray.get_runtime_context().get_node_id())
    store = NodeStoreClient(find_node_store(cfg.namespace, node), node)
    jobs = []
    for job, start in ((1, 0), (2, 10)):  # the first finds no extents granted yet
        keys = _keys(2, 0, start) + _keys(1, 1, start)
        root = root_of(NS, keys[0])
        assert worker.submit_store(job, SRC, StoreSpec(NS, tuple(keys), root=root))
        assert _drain(worker, 1) == [job]
        jobs.append((keys, root))
        if job == 1:
            _pool_ready(worker)
    # One store took each path: the object store (no extents yet), then the arena.
    assert worker.arena.arena_stores == 1
    for keys, root in jobs:
        _, metas = store.load(NS, 0, keys).result()
        assert [m.root for m in metas] == [root] * len(keys)
    worker.shutdown()


def test_two_evictor_shards_a_stored_prefix_is_a_hit_through_its_roots_shard(
    cfg: TierStoreConfig,
) -> None:
    """The whole path with two real Evictor shards: a worker stores two prompts whose
    roots map to different shards, the NodeStore offers each to its root's shard, and a
    scheduler (one client per shard) finds both HIT, each asked of its own shard."""
    cfg = dataclasses.replace(cfg, evictor_shards=2, presence_max_age_ms=0)
    worker = _worker(cfg, _kv())
    prompts = []
    for start in range(0, 1000, 10):
        keys = _keys(2, 0, start) + _keys(1, 1, start)
        root = root_of(NS, keys[0])
        if shard_of(root, 2) not in {shard_of(r, 2) for _, r in prompts}:
            prompts.append((keys, root))
        if len(prompts) == 2:
            break
    for job, (keys, root) in enumerate(prompts, start=1):
        assert worker.submit_store(job, SRC, StoreSpec(NS, tuple(keys), root=root))
        assert _drain(worker, 1) == [job]
    clients = evictor_clients(cfg)
    held = [c.status().result()["chunks"] for c in clients]
    assert held == [3, 3]  # each prompt's three chunks on its root's shard only
    manager = TierStoreManager(cfg, NS, EvictorChannel(list(clients)), {0: 32, 1: 32})
    for i, (keys, _) in enumerate(prompts):
        ctx = ReqContext(req_id=f"r{i}")
        for k, end in zip(keys, (32, 64, 64), strict=True):
            ctx.set_offload_key_position(k, end)  # type: ignore[arg-type]
        manager.on_new_request(ctx)
        for k in keys:
            manager.lookup(k, ctx)  # type: ignore[arg-type]
        manager.on_schedule_end(END)

        def answered(ctx: ReqContext = ctx, keys: list = keys) -> list[LookupResult] | None:
            results = [manager.lookup(k, ctx) for k in keys]
            manager.on_schedule_end(END)
            return None if LookupResult.RETRY in results else results

        assert wait_for(answered, "the lookups answered", 30) == [LookupResult.HIT] * 3
    manager.shutdown()
    worker.shutdown()
