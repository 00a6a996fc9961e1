"""Several simulated nodes (ray.cluster_utils): placement follows nodes joining and leaving;
the node a process works for; ``evictor_shards: "auto"`` follows the node count when the
first shard starts."""

from __future__ import annotations

import dataclasses
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
    evictor_clients,
    find_node_store,
    get_or_create_evictor,
    running_evictors,
    shutdown_actors,
    this_node_id,
)
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from tierstore.actors.placement import alive_node_ids, node_store_name
from tierstore.deploy.cli import collect_status, format_status

from tests.support import LOOPBACK, simulated_cluster, wait_for
from tierstore.config import ConfigMismatchError, TierStoreConfig, evictor_shards_for
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


# The fewest nodes for which "auto" runs more than one Evictor shard.
_AUTO_NODES = 5


def test_auto_shards_follow_the_nodes_when_shard_0_starts_and_are_adopted_after(
    cluster: Cluster,
) -> None:
    shutdown_actors(NAMESPACE)  # the tests above ran one shard
    listed = {node.node_id for node in cluster.list_all_nodes()}
    wait_for(lambda: alive_node_ids() == listed, "only the cluster's own nodes alive", _WAIT_S)
    added = [
        cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        for _ in range(_AUTO_NODES - len(listed))
    ]
    wait_for(lambda: len(alive_node_ids()) == _AUTO_NODES, f"{_AUTO_NODES} nodes", _WAIT_S)
    shards = evictor_shards_for(_AUTO_NODES)
    assert shards == 2

    cfg = TierStoreConfig(cpu_bytes_per_node=1 << 20, namespace=NAMESPACE)  # "auto"
    ensure_actors(cfg)  # as `tierstore up` does: shard 0 is started with the rule's number
    resolved, handles = running_evictors(cfg)
    assert resolved == dataclasses.replace(cfg, evictor_shards=shards)
    assert [EvictorClient(h).config().result() for h in handles] == [resolved] * shards
    nodes = alive_node_ids()
    for node in nodes:  # every NodeStore runs with that number, registered with each shard
        assert NodeStoreClient(find_node_store(NAMESPACE, node), node).config().result() == resolved
    statuses = [EvictorClient(h).status().result() for h in handles]
    assert all(set(status["nodes"]) == nodes for status in statuses)
    for node in nodes:
        shares = [status["nodes"][node]["cpu"]["capacity_bytes"] for status in statuses]
        assert sum(shares) == cfg.cpu_bytes_per_node and all(shares)
    status = collect_status(NAMESPACE)
    assert status["evictor_shards"] == shards
    assert f"evictor shards: {shards}" in format_status(status)

    # The cluster shrinks to where the rule says 1: a later "auto" caller adopts shard 0's
    # number all the same, and one naming another number is refused.
    shard_1_node = min(nodes - {ray.get_runtime_context().get_node_id()})  # round-robin
    cluster.remove_node(next(n for n in added if n.node_id != shard_1_node))
    wait_for(lambda: len(alive_node_ids()) == _AUTO_NODES - 1, "a node gone", _WAIT_S)
    assert evictor_shards_for(_AUTO_NODES - 1) == 1
    assert len(evictor_clients(cfg)) == shards
    refused = f"evictor_shards: running {shards}, this config 1"
    with pytest.raises(ConfigMismatchError, match=refused):
        ensure_actors(dataclasses.replace(cfg, evictor_shards=1))
