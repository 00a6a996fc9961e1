"""Two engines on two simulated nodes, then the storing node is lost; writes JSON facts.

Run by ``test_multinode.py`` as ``python -m tests.e2e.multinode_scenario MODEL OUT_JSON``
in its own process: it is the driver of its own ``ray.cluster_utils.Cluster`` (the test
session is already a driver of another cluster, and a process joins only one).

1. Engine A (an actor pinned to node A) computes PROMPT and HOT and stores them on node A.
2. Engine A is killed; engine B, on node B, runs PROMPT: its prefix must come from node
   A's NodeStore, through the object store. It runs HOT twice: HOT is hot now, and node
   B gets its own copy, which serves B's third run of HOT.
3. Node A is removed while engine B runs (with the Evictor, if Ray placed it there: it
   then restarts elsewhere); once every Evictor shard has forgotten node A (each on its
   own reconcile: one that still knows A answers a HIT whose load fails and recomputes),
   engine B runs PROMPT again (a miss, recomputed), then once more (a hit, now from node
   B). HOT hits at once: its copy on B outlived A.
4. Every Evictor shard is killed (Ray restarts them) and engine B serves PROMPT at once,
   while the index is rebuilt; once it is, PROMPT hits again.

The Evictor runs as two shards (``evictor_shards``): PROMPT's and HOT's prefix trees live
on one shard each, wherever their roots map, and every step above holds across both.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import ray
from tierstore.actors.bootstrap import ensure_actors, find_node_store, get_or_create_evictors
from tierstore.deploy.cli import collect_status
from tierstore.deploy.engine_host import start_engine_on
from tierstore.deploy.passes import TIERSTORE_SPEC, EngineSpec, random_prompt

from tests.support import E2E_LOOKUP_TIMEOUT_MS, simulated_cluster, wait_for
from tierstore.config import TierStoreConfig
from tierstore.errors import ActorUnavailableError, ClusterUnavailableError, RemoteCallTimeout

NAMESPACE = "tierstore-multinode"
PROMPT = random_prompt(1000, seed=11)
HOT = random_prompt(1000, seed=12)
_WAIT_TIMEOUT_S = 60.0
# The actors' config: the engines' and every lookup of the Evictor use the same one (an
# Evictor looked up with another config is refused: ConfigMismatchError).
# Copies made after counted loads (replicate_after_loads), not pulled at lookup: the
# scenario checks that node B holds nothing of what it loaded once.
CFG = TierStoreConfig(
    cpu_bytes_per_node=1 << 30, namespace=NAMESPACE, evictor_shards=2, pulls_per_node=0
)


def _node_store_stats(node_id: str) -> dict[str, Any]:
    return ray.get(find_node_store(NAMESPACE, node_id).status.remote())


def _status() -> dict[str, Any]:
    """The Evictor shards' statuses as one: counters and chunks summed, the nodes every
    shard knows (``nodes``) and those some shard knows (``known_anywhere``)."""
    statuses = [ray.get(h.status.remote(), timeout=10) for h in get_or_create_evictors(CFG)]
    totals: dict[str, int] = {}
    for status in statuses:
        for counter, value in status["totals"].items():
            totals[counter] = totals.get(counter, 0) + value
    return {
        "totals": totals,
        "chunks": sum(status["chunks"] for status in statuses),
        "nodes": set.intersection(*(set(status["nodes"]) for status in statuses)),
        "known_anywhere": set.union(*(set(status["nodes"]) for status in statuses)),
    }


def _wait_for(check: Callable[[dict[str, Any]], bool], what: str) -> float:
    """Seconds until the Evictor shards' status (:func:`_status`) satisfies ``check``."""
    started = time.monotonic()

    def satisfied() -> bool:
        try:
            return check(_status())
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.GetTimeoutError,
            ClusterUnavailableError,  # the config check's call, mapped by the client
            ActorUnavailableError,
            RemoteCallTimeout,
        ):
            return False  # restarting

    wait_for(satisfied, what, _WAIT_TIMEOUT_S, poll_s=0.2)
    return time.monotonic() - started


def main(model: str, out_path: str) -> None:
    cluster, (node_a, node_b) = simulated_cluster(2, NAMESPACE)
    facts: dict[str, Any] = {"node_a": node_a.node_id, "node_b": node_b.node_id}
    try:
        ensure_actors(CFG)
        extra = {
            **TIERSTORE_SPEC,
            "cpu_bytes_per_node": CFG.cpu_bytes_per_node,
            "namespace": NAMESPACE,
            "evictor_shards": CFG.evictor_shards,
            "pulls_per_node": CFG.pulls_per_node,
            "lookup_timeout_ms": E2E_LOOKUP_TIMEOUT_MS,
        }
        spec = EngineSpec(model=model, kv_extra_config=extra)

        engine_a = start_engine_on(node_a.node_id, spec)
        facts["engine_a_node"] = ray.get(engine_a.node_id.remote())
        facts["a"], facts["a_hot"] = ray.get(engine_a.run_pass.remote([PROMPT, HOT]))["requests"]
        ray.kill(engine_a)  # the chunks belong to node A's NodeStore, not to the engine
        facts["node_a_before"] = _node_store_stats(node_a.node_id)

        engine_b = start_engine_on(node_b.node_id, spec)
        facts["engine_b_node"] = ray.get(engine_b.node_id.remote())
        facts["b_from_a"] = ray.get(engine_b.run_pass.remote([PROMPT]))["requests"][0]
        facts["node_a_after"] = _node_store_stats(node_a.node_id)
        facts["node_b_after"] = _node_store_stats(node_b.node_id)

        hot_runs = []
        for _ in range(CFG.replicate_after_loads):
            ray.get(engine_b.reset_prefix_cache.remote())
            hot_runs.append(ray.get(engine_b.run_pass.remote([HOT]))["requests"][0])
        facts["b_hot_remote"] = hot_runs
        hot_chunks = hot_runs[-1]["num_cached_tokens"] // spec.block_size
        facts["replicate_s"] = _wait_for(
            lambda s: s["totals"]["replicated_chunks"] >= hot_chunks, "HOT's copy on node B"
        )
        facts["node_b_before_hot"] = _node_store_stats(node_b.node_id)
        ray.get(engine_b.reset_prefix_cache.remote())
        facts["b_hot_local"] = ray.get(engine_b.run_pass.remote([HOT]))["requests"][0]
        facts["node_b_after_hot"] = _node_store_stats(node_b.node_id)

        cluster.remove_node(node_a, allow_graceful=False)
        # The Evictor may have lived on node A: then it restarts elsewhere, and its index
        # is whole again once node B has re-registered with it.
        facts["forget_s"] = _wait_for(
            lambda s: node_a.node_id not in s["known_anywhere"] and node_b.node_id in s["nodes"],
            "every Evictor shard forgets node A and knows node B",
        )
        facts["status_nodes"] = [n["node_id"] for n in collect_status(NAMESPACE)["nodes"]]
        ray.get(engine_b.reset_prefix_cache.remote())
        facts["b_after_loss"] = ray.get(engine_b.run_pass.remote([PROMPT]))["requests"][0]
        ray.get(engine_b.reset_prefix_cache.remote())
        facts["b_hot_after_loss"] = ray.get(engine_b.run_pass.remote([HOT]))["requests"][0]
        ray.get(engine_b.reset_prefix_cache.remote())
        facts["b_again"] = ray.get(engine_b.run_pass.remote([PROMPT]))["requests"][0]
        facts["node_b_end"] = _node_store_stats(node_b.node_id)

        for shard in get_or_create_evictors(CFG):
            ray.kill(shard, no_restart=False)
        ray.get(engine_b.reset_prefix_cache.remote())
        facts["b_evictor_down"] = ray.get(engine_b.run_pass.remote([PROMPT]))["requests"][0]
        held = facts["node_b_end"]["cpu"]["chunks"]
        facts["rebuild_s"] = _wait_for(lambda s: s["chunks"] >= held, "the index is rebuilt")
        time.sleep(1.5)  # engine B's manager trusts a MISS for 1 s
        ray.get(engine_b.reset_prefix_cache.remote())
        facts["b_rebuilt"] = ray.get(engine_b.run_pass.remote([PROMPT]))["requests"][0]
    finally:
        with open(out_path, "w") as out:
            json.dump(facts, out)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
