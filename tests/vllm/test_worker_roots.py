"""A store job's root (``StoreSpec.root``, the request's prefix tree, which names the
Evictor shard that indexes it) reaches the NodeStore with every shard, on both the
object-store path and the arena path: the NodeStore keeps it in each shard's meta.
Real Ray, real NodeStore, real KV tensors."""

from __future__ import annotations

import ray
from tierstore.actors.bootstrap import find_node_store
from tierstore.actors.clients import NodeStoreClient
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.vllm.test_worker_arena import _pool_ready
from tests.vllm.test_worker_roundtrip import NS, _drain, _keys, _kv, _worker
from tierstore.config import TierStoreConfig
from tierstore.keys import NodeId, root_of
from tierstore.vllm.transfer_specs import StoreSpec

SRC = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[4, 1], block_indices=[0, 0])


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
