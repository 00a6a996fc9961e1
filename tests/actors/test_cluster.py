"""Several simulated nodes (ray.cluster_utils): placement follows nodes joining and leaving."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from tierstore.actors.bootstrap import ensure_actors, get_or_create_evictor, shutdown_actors
from tierstore.actors.placement import node_store_name

from tests.support import LOOPBACK, simulated_cluster, wait_for
from tierstore.config import TierStoreConfig
from tierstore.keys import ChunkKey, Namespace
from tierstore.wire import LookupState, ShardOffer

NAMESPACE = "tierstore-cluster-tests"
NS = Namespace("c1c1")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster, _ = simulated_cluster(1, NAMESPACE, head_cpus=1)
    yield cluster
    shutdown_actors(NAMESPACE)
    ray.shutdown()
    cluster.shutdown()


_WAIT_S = 30.0


def _has_store(node_id: str) -> bool:
    try:
        ray.get_actor(node_store_name(node_id), namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def test_every_node_gets_a_node_store_and_a_lost_node_takes_its_chunks(cluster: Cluster) -> None:
    cfg = TierStoreConfig(cpu_bytes_per_node=1 << 20, namespace=NAMESPACE)
    ensure_actors(cfg)
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2 and all(_has_store(n) for n in nodes)

    # A node that joins later gets its NodeStore without anyone running `tierstore up`.
    joined = cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
    assert wait_for(lambda: _has_store(joined.node_id), "a NodeStore on the new node", _WAIT_S)
    evictor = get_or_create_evictor(cfg)
    assert wait_for(
        lambda: joined.node_id in ray.get(evictor.status.remote())["nodes"],
        "the new node in the Evictor's status",
        _WAIT_S,
    )

    # A chunk whose rank 1 lives on the new node: a HIT while the node is up...
    key = ChunkKey(b"\x01" * 8 + b"\0\0\0\0")
    head = ray.get_runtime_context().get_node_id()
    ray.get(evictor.admit.remote(head, [ShardOffer(NS, key, 0, 2, 100)]))
    ray.get(evictor.admit.remote(joined.node_id, [ShardOffer(NS, key, 1, 2, 100)]))
    (answer,) = ray.get(evictor.lookup.remote(NS, [key], "t", 1.0))
    assert LookupState(answer[0]) is LookupState.HIT

    # ...and forgotten everywhere once the node is gone: a miss, not a hang.
    cluster.remove_node(joined, allow_graceful=False)

    def forgotten() -> bool:
        status = ray.get(evictor.status.remote())
        return joined.node_id not in status["nodes"]

    assert wait_for(forgotten, "the lost node forgotten", _WAIT_S)
    (answer,) = ray.get(evictor.lookup.remote(NS, [key], "t", 1.0), timeout=10)
    assert LookupState(answer[0]) is LookupState.MISS
    head_status = ray.get(evictor.status.remote())["nodes"][head]
    assert head_status["cpu"]["used_bytes"] == 0  # rank 0's shard was dropped too
