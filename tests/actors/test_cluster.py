"""Several simulated nodes (ray.cluster_utils): placement follows nodes joining and leaving;
the node a process works for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tierstore.actors.bootstrap import (
    ensure_actors,
    get_or_create_evictor,
    shutdown_actors,
    this_node_id,
)
from tierstore.actors.clients import EvictorClient
from tierstore.actors.placement import alive_node_ids, node_store_name

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
    client = EvictorClient(evictor)
    client.admit(head, [ShardOffer(NS, key, 0, 2, 100)]).result()
    client.admit(joined.node_id, [ShardOffer(NS, key, 1, 2, 100)]).result()
    (answer,) = client.lookup(NS, [key], "t", 1.0).result()
    assert answer.state is LookupState.HIT

    # ...and forgotten everywhere once the node is gone: a miss, not a hang.
    cluster.remove_node(joined, allow_graceful=False)

    def forgotten() -> bool:
        status = ray.get(evictor.status.remote())
        return joined.node_id not in status["nodes"]

    assert wait_for(forgotten, "the lost node forgotten", _WAIT_S)
    (answer,) = client.lookup(NS, [key], "t", 1.0).result(timeout_s=10)
    assert answer.state is LookupState.MISS
    head_status = ray.get(evictor.status.remote())["nodes"][head]
    assert head_status["cpu"]["used_bytes"] == 0  # rank 0's shard was dropped too


# What vLLM's engine processes do under Ray Serve LLM: a process started by a Ray worker
# outside Ray joins the cluster as a driver, and says which node it attached to and
# which it works for.
_CHILD = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
from tierstore.actors.bootstrap import this_node_id
attached = ray.get_runtime_context().get_node_id()
print(json.dumps({"attached": attached, "works_for": this_node_id()}))
"""
_CHILD_TIMEOUT_S = 120.0


@ray.remote(num_cpus=0)
def _start_child(address: str) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, address],
        capture_output=True,
        text=True,
        timeout=_CHILD_TIMEOUT_S,
        check=True,
    )
    return dict(json.loads(done.stdout.splitlines()[-1]))


def test_a_process_a_ray_worker_starts_works_for_that_workers_node(cluster: Cluster) -> None:
    head = ray.get_runtime_context().get_node_id()
    address = ray.get_runtime_context().gcs_address
    for node in sorted(alive_node_ids()):
        child = ray.get(
            _start_child.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(address),
            timeout=_CHILD_TIMEOUT_S + 30,
        )
        # Ray attaches the child's connection to the host's head raylet, whichever raylet
        # started its parent; the child works for its parent's node.
        assert child == {"attached": head, "works_for": node}


def test_a_raylet_pid_that_names_no_raylet_falls_back_to_the_attached_node(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = ray.get_runtime_context().get_node_id()
    assert this_node_id() == head  # this driver: no RAY_RAYLET_PID
    for stale in (str(os.getpid()), "999999999", "not a pid"):
        monkeypatch.setenv("RAY_RAYLET_PID", stale)
        assert this_node_id() == head
