"""Hot-chunk replicas across simulated nodes (ray.cluster_utils), without an engine.

Node A's NodeStore holds a chunk; an engine on node B (played here by the Evictor calls
its manager makes) keeps loading it. B gets its own verified copy, HITs asked from B name
B; when A's NodeStore dies a load planned from A is served from B's copy, and when A is
lost the chunk lives on at B.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from tierstore.actors.bootstrap import (
    ensure_actors,
    find_node_store,
    get_or_create_evictor,
    shutdown_actors,
)
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.support import chain_entries, simulated_cluster, wait_for
from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout
from tierstore.errors import TierStoreError
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.spec import connect_worker
from tierstore.vllm.transfer_specs import LoadSpec
from tierstore.wire import LookupState

NAMESPACE = "tierstore-replica-tests"
NS = Namespace("7e9a")
KEYS = [ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\0") for i in range(3)]
CHUNK_BYTES = 4096
_WAIT_S = 60.0  # a replaced NodeStore is a new process: slow on a loaded machine


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[Cluster, str, str]]:
    cluster, (node_a, node_b) = simulated_cluster(2, NAMESPACE)
    yield cluster, node_a, node_b
    shutdown_actors(NAMESPACE)
    ray.shutdown()
    cluster.shutdown()


def _lookup(evictor: EvictorClient, node: str) -> list[tuple[LookupState, dict]]:
    answers = evictor.lookup(NS, KEYS, f"engine@{node}", 5.0, node).result()
    return [(a.state, a.where) for a in answers]


def test_a_node_that_keeps_loading_a_chunk_gets_a_verified_copy_that_outlives_the_holder(
    nodes: tuple[Cluster, object, object],
) -> None:
    cluster, node_a, node_b = nodes
    a, b = node_a.node_id, node_b.node_id  # type: ignore[attr-defined]
    # Counted copies (replicate_after_loads); copies pulled at lookup: test_lookup_pulls.
    cfg = TierStoreConfig(cpu_bytes_per_node=1 << 20, namespace=NAMESPACE, pulls_per_node=0)
    ensure_actors(cfg)
    evictor = EvictorClient(get_or_create_evictor(cfg))
    wait_for(
        lambda: {a, b} <= set(evictor.status().result()["nodes"]),
        "both nodes registered",
        _WAIT_S,
    )

    # Node A holds three chunks (a chain), stored the way a worker on A stores them.
    payload = np.random.default_rng(0).integers(0, 255, CHUNK_BYTES * len(KEYS), dtype=np.uint8)
    entries = chain_entries(KEYS, payload, CHUNK_BYTES)
    store_a = NodeStoreClient(find_node_store(NAMESPACE, a), a)
    assert store_a.store(NS, 0, 1, entries, payload).result() == len(KEYS)

    # An engine on B loads them twice (replicate_after_loads=2): HITs name A until then.
    for _ in range(cfg.replicate_after_loads):
        assert all(s is LookupState.HIT and w == {0: a} for s, w in _lookup(evictor, b))
        evictor.release(NS, KEYS, f"engine@{b}", loaded=len(KEYS), node_id=b)
    wait_for(
        lambda: all(w == {0: b} for _, w in _lookup(evictor, b)),
        "HITs asked from B naming B's replica",
        _WAIT_S,
    )
    assert all(w == {0: a} for _, w in _lookup(evictor, a))  # A still serves itself
    store_b = NodeStoreClient(find_node_store(NAMESPACE, b), b)
    shards, _ = store_b.load(NS, 0, KEYS).result()
    assert np.array_equal(np.concatenate(shards), payload)  # the same bytes, from B
    status_b = store_b.status().result()
    assert status_b["stats"]["replicas_received"] == len(KEYS)
    assert status_b["cpu"]["chunks"] == len(KEYS)
    totals = evictor.status().result()["totals"]
    assert totals["replicated_chunks"] == len(KEYS)

    # A's NodeStore dies. A load planned from A before anyone knew (a HIT granted
    # earlier) is served from B's copy instead of stopping the engine, byte for byte.
    kv = torch.zeros((len(KEYS) + 1, CHUNK_BYTES), dtype=torch.uint8)
    worker = connect_worker(cfg, ChunkLayout([kv], [[(0, CHUNK_BYTES)]], blocks_per_chunk=1))
    ray.kill(store_a.handle)
    planned = LoadSpec.build(NS, KEYS, [{0: NodeId(a)}] * len(KEYS))
    blocks = list(range(1, len(KEYS) + 1))
    worker.submit_load(7, planned, GPULoadStoreSpec(blocks, [len(KEYS)], [0]))
    worker.wait({7})
    assert [r.job_id for r in worker.get_finished()] == [7]
    assert np.array_equal(kv[1:].numpy().reshape(-1), payload)
    assert worker.relocated_loads == 1
    worker.shutdown()
    # The replaced NodeStore on A holds nothing: the Evictor forgot A's copies, and B's
    # became the chunks' own.
    wait_for(
        lambda: all(s is LookupState.HIT and w == {0: b} for s, w in _lookup(evictor, a)),
        "lookups from A naming B after A's NodeStore restarted",
        _WAIT_S,
    )

    # A is lost: the chunks live on at B, for every node.
    cluster.remove_node(node_a, allow_graceful=False)

    def settled() -> bool:
        try:
            status = evictor.status().result(10)
        except (ray.exceptions.RayError, TierStoreError):
            return False  # the Evictor lived on node A: it is restarting elsewhere
        return a not in status["nodes"] and status["chunks"] == len(KEYS)

    wait_for(settled, "node A forgotten and B's copies indexed", _WAIT_S)
    head = ray.get_runtime_context().get_node_id()
    assert all(s is LookupState.HIT and w == {0: b} for s, w in _lookup(evictor, head))
    shards, _ = store_b.load(NS, 0, KEYS).result()
    assert np.array_equal(np.concatenate(shards), payload)
    assert evictor.status().result()["chunks"] == len(KEYS)
