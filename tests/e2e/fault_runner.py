"""One engine meets a failed load, then keeps serving; writes what happened as JSON.

Run by ``test_failed_load.py`` as ``python -m tests.e2e.fault_runner ARGS_JSON OUT_JSON``
(each engine in its own process, as ``run_engine``). ``RAY_ADDRESS`` names the cluster.

1. ``PROMPT`` is computed (nothing stored yet) and stored; the device cache is reset.
2. The fault: ``corrupt`` flips a byte of every shard this namespace holds in memory (a
   lookup still answers HIT, the NodeStore's checksum then fails the load); ``kill``
   loses the only copy: it kills the NodeStore that holds it and zeroes the arena file
   it leaves (the Evictor still indexes its chunks until a new NodeStore registers:
   placing one takes over a second, the next request's lookup a few milliseconds).
   Killing the process alone is no fault for a same-node load: the arena outlives it,
   and the worker reads it unpinned, verified, as long as the file is its own.
3. ``PROMPT`` again: its load fails and it is recomputed.
4. The engine keeps serving: ``OTHER`` is computed, stored and (device cache reset) loaded
   back from tierstore.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import ray
from tierstore.actors.bootstrap import find_node_store
from tierstore.actors.clients import NodeStoreClient
from tierstore.deploy.passes import (
    EngineSpec,
    build_llm,
    drain,
    random_prompt,
    run_request,
    sampling_params,
)

from tests.actors.hooks import corrupt_in_memory
from tierstore.errors import ClusterUnavailableError

PROMPT = random_prompt(1000, seed=61)
OTHER = random_prompt(1000, seed=62)
_NODE_STORE_WAIT_S = 120.0


def _corrupt_all(namespace: str, node: str) -> int:
    """Flip a byte of every shard held in ``node``'s arena, writing into the arena file."""
    store = NodeStoreClient(find_node_store(namespace, node), node)
    shards = [s for s, tier in store.inventory().result() if tier == "cpu"]
    return corrupt_in_memory(store, shards) if shards else 0


def _kill(store: ray.actor.ActorHandle) -> None:
    """Kill the NodeStore and wipe its arena; return once it is dead (``ray.kill`` does
    not wait). A new NodeStore takes the Evictor's reconcile (every 2 s) plus an actor
    start (over a second)."""
    region, _ = ray.get(store.arena_info.remote())
    arena_file = os.stat(region.path).st_ino  # not a successor's, if one came already
    ray.kill(store, no_restart=True)
    deadline = time.monotonic() + _NODE_STORE_WAIT_S
    while time.monotonic() < deadline:
        try:
            ray.get(store.status.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            _wipe(region.path, arena_file)
            return
        time.sleep(0.01)
    raise TimeoutError("the killed NodeStore still answers")


def _wipe(path: str, inode: int) -> None:
    """Zero the arena file, tables and extents, as if its memory were lost (not a
    successor's file; never truncated: the worker's mapping would fault past the end)."""
    with contextlib.suppress(FileNotFoundError), open(path, "r+b") as arena:
        if os.fstat(arena.fileno()).st_ino != inode:
            return
        size, zeros = os.fstat(arena.fileno()).st_size, bytes(1 << 20)
        for at in range(0, size, len(zeros)):
            arena.write(zeros[: size - at])


def _wait_for_node_store(namespace: str, node: str) -> None:
    """Until the Evictor's reconcile has placed a new NodeStore and it answers."""
    deadline = time.monotonic() + _NODE_STORE_WAIT_S
    while time.monotonic() < deadline:
        try:
            ray.get(find_node_store(namespace, node).status.remote(), timeout=10)
            return
        except (ClusterUnavailableError, ray.exceptions.RayError):
            time.sleep(0.5)
    raise TimeoutError(f"no new NodeStore on node {node} after {_NODE_STORE_WAIT_S} s")


def _counters() -> dict[str, float]:
    """tierstore's counters in this process's Prometheus registry, where the offline
    engine's stat logger records them (``LLM.get_metrics`` shows only ``vllm:*``)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if metric.type == "counter" and metric.name.startswith("tierstore:"):
            total = [s.value for s in metric.samples if s.name.endswith("_total")]
            out[metric.name] = sum(total)
    return out


def main(args: dict[str, Any], out_path: str) -> None:
    spec = EngineSpec(**args["engine"])
    namespace = spec.kv_extra_config["namespace"]  # type: ignore[index]
    llm = build_llm(spec)
    params = sampling_params(8)
    facts: dict[str, Any] = {"first": asdict(run_request(llm, PROMPT, params))}
    drain(llm)
    llm.reset_prefix_cache()

    ray.init(namespace=namespace, log_to_driver=False)  # RAY_ADDRESS: the test's cluster
    node = ray.get_runtime_context().get_node_id()
    if args["fault"] == "corrupt":
        facts["corrupted_shards"] = _corrupt_all(namespace, node)
    else:
        _kill(find_node_store(namespace, node))
    facts["after_fault"] = asdict(run_request(llm, PROMPT, params))
    drain(llm)
    llm.reset_prefix_cache()
    facts["counters"] = _counters()

    if args["fault"] == "kill":
        _wait_for_node_store(namespace, node)
    facts["other_first"] = asdict(run_request(llm, OTHER, params))
    drain(llm)
    llm.reset_prefix_cache()
    facts["other_again"] = asdict(run_request(llm, OTHER, params))
    facts["counters_at_end"] = _counters()
    facts["node_store"] = ray.get(find_node_store(namespace, node).status.remote())
    with open(out_path, "w") as out:
        json.dump(facts, out)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
