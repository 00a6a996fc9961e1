"""Cross-node hits end to end: a hit whose prefix another node holds, against a hit on
the engine's own node, in one engine and one run.

``tierstore bench crossnode_hits --model tiny|0.1b --out results/``, on two nodes
(:func:`common.two_nodes`: simulated raylets on this machine, or two real nodes under
``ray job submit``), each engine a Ray actor pinned to its node
(:mod:`tierstore.deploy.engine_host`), both pinned alike (``VLLM_CPU_OMP_THREADS_BIND``,
recorded):

1. An engine on node A stores ``count`` prompts (*far*) and is stopped: their chunks
   stay in node A's NodeStore.
2. An engine on node B stores ``count`` other prompts (*near*) and empties its device
   prefix cache.
3. Node B's engine serves near and far prompts alternately, one at a time. Each loads
   all its full chunks from tierstore: a near one from node B's CPU tier, a far one
   from node A's, pulled into node B's when its lookup answers (``pulls_per_node``)
   and read there by the load, which joins the pull still in flight.

Reported: hit TTFT p50 and mean of each kind and far over near (issue 30's target:
p50 ≤ 1.3x), the tokens each hit found cached, node B's pull counters (pulls, shards,
loads that joined one) and the Evictor's HITs by place.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, cast

import ray
from tierstore.actors.bootstrap import ensure_actors, find_node_store, shutdown_actors
from tierstore.deploy.bench.common import machine_info, two_nodes
from tierstore.deploy.bench.e2e import BIND_ENV, EngineRuns, breakdown, metrics_added
from tierstore.deploy.bench.e2e_engine import metric_delta, metric_totals
from tierstore.deploy.cli import collect_status
from tierstore.deploy.engine_host import start_engine_on
from tierstore.deploy.passes import TIERSTORE_SPEC, EngineSpec, random_prompt

from tierstore.config import TierStoreConfig

NAMESPACE = "tierstore-bench-crossnode-hits"
# Prompts per kind (1,088 tokens: 34 chunks of 32 tokens each; tiny 32 KiB a chunk,
# 0.1 B 128 KiB), and tokens generated per request (TTFT is what is timed).
COUNTS = {"tiny": 16, "0.1b": 6}
PROMPT_TOKENS = 1088
MAX_TOKENS = 4
_FAR_SEED, _NEAR_SEED = 30_000, 40_000


def _engine(node: str, spec: EngineSpec, binding: str) -> ray.actor.ActorHandle:
    """An engine on ``node`` as ``vllm serve`` runs one: its engine core in a process of
    its own (which steps with a 1 ms sleep while nothing is runnable, so the scheduler's
    and the worker's threads get the GIL at once), started by the actor there: it
    inherits the actor's raylet (``RAY_RAYLET_PID``: tierstore works for that node) and
    joins this cluster (``RAY_ADDRESS``)."""
    env = {
        BIND_ENV: binding,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
    }
    return start_engine_on(node, spec, env)


def _prompts(seed: int, count: int) -> list[list[int]]:
    return [random_prompt(PROMPT_TOKENS, seed=seed + i) for i in range(count)]


def _metrics(engine: ray.actor.ActorHandle) -> dict[str, Any]:
    """The engine's vLLM and tierstore metrics now (summed over labels), read in its
    actor's process, where its stat loggers run."""
    return cast(dict[str, Any], ray.get(engine.__ray_call__.remote(lambda _h: metric_totals())))


def _summary(requests: list[dict[str, Any]], metrics: dict[str, Any]) -> dict[str, Any]:
    """A kind's hits: TTFT, the tokens each found cached, and where their time went
    (:func:`e2e.breakdown`, ms per request: the lease's wait, the load job, its copy)."""
    ttft_ms = [1e3 * r["ttft_s"] for r in requests]
    return {
        "requests": len(requests),
        "ttft_ms_p50": statistics.median(ttft_ms),
        "ttft_ms_mean": statistics.fmean(ttft_ms),
        "cached_tokens": [r["num_cached_tokens"] for r in requests],
        "breakdown_ms": breakdown(requests, metrics),
    }


def _node_stats(node: str) -> dict[str, float]:
    """A node's NodeStore: the shards it has served to loads and pulls, and its pulls."""
    status = cast(dict[str, Any], ray.get(find_node_store(NAMESPACE, node).status.remote()))
    return {**status["pulls"], "served_shards": status["stats"].get("loaded_shards", 0)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    choice = getattr(args, "model", None) or "tiny"
    count = 2 if getattr(args, "quick", False) else getattr(args, "count", None) or COUNTS[choice]
    engines = EngineRuns.prepare(args, choice, "crossnode-hits")  # model, binding, --set
    extra = {"cpu_bytes_per_node": 256 << 20, "namespace": NAMESPACE, **engines.overrides}
    cfg = TierStoreConfig.from_extra_config(extra)  # what the engines will build
    spec = EngineSpec(
        model=str(engines.model), max_model_len=2048, kv_extra_config={**TIERSTORE_SPEC, **extra}
    )
    binding = engines.binding
    far, near = _prompts(_FAR_SEED, count), _prompts(_NEAR_SEED, count)
    with two_nodes(NAMESPACE, "crossnode_hits") as (node_a, node_b, how):
        ensure_actors(cfg)
        try:
            engine_a = _engine(node_a, spec, binding)
            ray.get(engine_a.run_pass.remote(far, MAX_TOKENS))  # stored on node A
            ray.kill(engine_a)  # its chunks are node A's NodeStore's
            engine_b = _engine(node_b, spec, binding)
            ray.get(engine_b.run_pass.remote(near, MAX_TOKENS))  # stored on node B
            ray.get(engine_b.reset_prefix_cache.remote())
            before = collect_status(NAMESPACE)["totals"]
            a_before, b_before = _node_stats(node_a), _node_stats(node_b)
            hits: dict[str, list[dict[str, Any]]] = {"near": [], "far": []}
            deltas: dict[str, list[dict[str, Any]]] = {"near": [], "far": []}
            for near_prompt, far_prompt in zip(near, far, strict=True):
                for kind, prompt in (("near", near_prompt), ("far", far_prompt)):
                    started = _metrics(engine_b)
                    result = ray.get(engine_b.run_pass.remote([prompt], MAX_TOKENS))
                    hits[kind].append(result["requests"][0])
                    deltas[kind].append(metric_delta(_metrics(engine_b), started))
            after = collect_status(NAMESPACE)["totals"]
            a_after, b_after = _node_stats(node_a), _node_stats(node_b)
            ray.kill(engine_b)
        finally:
            shutdown_actors(NAMESPACE)
    near_s, far_s = (_summary(hits[k], metrics_added(deltas[k])) for k in ("near", "far"))
    return {
        "model": choice,
        "nodes": how,
        "omp_threads_bind": binding,
        "tierstore_overrides": engines.overrides,
        "prompts_per_kind": count,
        "prompt_tokens": PROMPT_TOKENS,
        "machine": machine_info(),
        "near": near_s,
        "far": far_s,
        "far_vs_near_ttft_p50": far_s["ttft_ms_p50"] / near_s["ttft_ms_p50"],
        "far_vs_near_ttft_mean": far_s["ttft_ms_mean"] / near_s["ttft_ms_mean"],
        # Shards node A's NodeStore served (to node B's pulls, and to loads that read
        # from node A themselves), and node B's pulls.
        "node_a_served_shards": a_after["served_shards"] - a_before["served_shards"],
        "node_b_pulls": {k: b_after[k] - b_before[k] for k in b_after if k != "served_shards"},
        "evictor_hits": {
            k: after.get(k, 0) - before.get(k, 0) for k in ("hits_same_node", "hits_other_node")
        },
    }
