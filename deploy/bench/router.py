"""``router``: tierstore's request router against Ray Serve's on a multi-turn chat (issue 31).

One ``ray.cluster_utils`` cluster on loopback (a 1-CPU head for Serve's proxy and
ingress, two 2-CPU raylets: one replica each), token auth as the tests run it. For each
router in turn, the same Ray Serve LLM app (``tierstore.deploy.serve_llm``: the tiny
random Llama, two replicas, tierstore as the KV connector, a tierstore namespace of its
own so no run finds another's chunks) is deployed, sent the same seeded workload, and
deleted:

- ``default``: Ray Serve's default, ``PowerOfTwoChoicesRequestRouter`` (queue length);
- ``prefix_cache_affinity``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` (a prefix
  tree of the prompts it routed). It reads text only; the tiny models have no tokenizer,
  so prompts are token ids, which it would read as empty text. It is given one character
  per token id (:class:`TokenPrefixCacheAffinityRouter`): the same prefix information a
  text prompt gives it, its policy unchanged;
- ``tier_aware``: :class:`tierstore.deploy.router.TierAwareRouter` (device prefix it
  routed, then tierstore's prefix on the replica's node, then load). It needs the
  engines' chunk namespace, which the first run's NodeStores show (the same engine
  settings give the same namespace; only tierstore's Ray namespace differs per run).

Workload: workloads.MultiRound's multi-turn chat (LMCache's multi-round QA shape):
``users`` conversations share one system prompt, each adds context of its own, then
``rounds`` turns, each turn's prompt the previous prompt + its answer + a new question.
Closed loop: ``clients`` requests in flight at most, turns handed out in their schedule's
order (conversations interleaved), a conversation's next turn only after its answer.
Each replica's device KV cache (``num_gpu_blocks_override``) holds about two
conversations, fewer than each replica is sent, so repeats come from tierstore or are
recomputed.

Per request: TTFT (the first streamed token, through the OpenAI API over HTTP), prompt
and cached tokens (``usage.prompt_tokens_details``: the device prefix cache's and
tierstore's hits together), the output tokens (greedy: every router must give the same).
Per run, from tierstore's Evictor (its counters summed over shards, deltas over the
workload): lookup HITs whose every rank's bytes were on the asking engine's node
(``hits_same_node``) or not (``hits_other_node``: loaded from another node, or pulled
here at lookup time), and chunks loaded. The replicas' placement (which node) is
recorded; which replica served each request is not (the OpenAI response does not say).

The replicas are placed on the two raylets; their vLLM engines run in processes vLLM
starts outside Ray (the CPU build's multiprocessing executor), which join the cluster as
drivers, and Ray attaches a driver to the head's raylet when several share a host
(``get_node_to_connect_for_driver``). tierstore works for the node of the raylet that
started the replica (``tierstore.actors.bootstrap.this_node_id``), so each engine stores
to and loads from its replica's node, as on machines with one raylet each.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ray.serve.llm.request_router import PrefixCacheAffinityRouter
from tierstore.deploy.bench.common import percentile, stream_completion
from tierstore.deploy.bench.e2e import BIND_ENV, omp_binding
from tierstore.deploy.bench.workloads import MultiRound
from tierstore.deploy.models import make_tiny_model
from tierstore.deploy.ray_auth import token_auth

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
MODEL_ID = "tiny"
BLOCK = 32  # tokens per block; one chunk = one block (the tiny Llama has one KV group)
ROUTERS = ("default", "prefix_cache_affinity", "tier_aware")
_ROUTER_CLASSES = {
    "default": "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter",
    "prefix_cache_affinity": "tierstore.deploy.bench.router:TokenPrefixCacheAffinityRouter",
    "tier_aware": "tierstore.deploy.router:TierAwareRouter",
}
_REQUEST_TIMEOUT_S = 300.0
_SETTLE_S = 3.0  # the engines report loads to the Evictor one-way, after they complete
_PRIVATE_USE = 0xE000  # token id -> one character, for the text-only prefix router

# quick -> sizes. Full: final prompts ~590 tokens (19 blocks); all conversations together
# ~3,700 tokens (116 blocks) against 2 x 40 device blocks.
_SETUPS: dict[bool, dict[str, Any]] = {
    False: {
        "workload": {
            "users": 8,
            "rounds": 5,
            "system_len": 128,
            "user_info_len": 256,
            "question_len": 32,
            "qps": 1.0,  # orders the turns only (closed loop)
        },
        "clients": 3,
        "max_tokens": 16,
        "device_blocks": 40,  # vLLM keeps one back: 1,248 tokens, about two conversations
        "max_model_len": 1024,
        "cpu_bytes_per_node": 64 << 20,
    },
    True: {
        "workload": {
            "users": 3,
            "rounds": 2,
            "system_len": 64,
            "user_info_len": 128,
            "question_len": 16,
            "qps": 1.0,
        },
        "clients": 2,
        "max_tokens": 4,
        "device_blocks": 17,  # vLLM keeps one back: 512 tokens, a prompt's or two
        "max_model_len": 512,
        "cpu_bytes_per_node": 16 << 20,
    },
}


class TokenPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter`` for token-id prompts: each token id
    is one character of the text it matches prefixes on (it reads a list of ints as empty
    text otherwise). Its policy is unchanged."""

    def _extract_text_from_request(self, pending_request: Any) -> str:
        for arg in pending_request.args[:1]:
            prompt = getattr(arg, "prompt", None)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return "".join(chr(_PRIVATE_USE + t) for t in prompt)
        text: str = super()._extract_text_from_request(pending_request)
        return text


def setup(quick: bool) -> dict[str, Any]:
    """The run's sizes (``--quick``: a smoke run)."""
    return dict(_SETUPS[quick])


def _engine_kwargs(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "dtype": "float32",
        "block_size": BLOCK,
        "max_model_len": s["max_model_len"],
        "max_num_batched_tokens": s["max_model_len"],
        "num_gpu_blocks_override": s["device_blocks"],
        "enforce_eager": True,
        "skip_tokenizer_init": True,  # the tiny models have no tokenizer: token ids
        "enable_prompt_tokens_details": True,  # usage.prompt_tokens_details.cached_tokens
    }


def _router_config(name: str, chunk_namespace: str | None, ray_ns: str, s: dict[str, Any]) -> Any:
    from ray.serve.config import RequestRouterConfig

    kwargs: dict[str, Any] = {}
    if name == "tier_aware":
        if chunk_namespace is None:
            raise RuntimeError(
                "tier_aware needs the engines' chunk namespace: the earlier runs stored nothing"
            )
        kwargs = {
            "namespace": chunk_namespace,
            "block_size": BLOCK,
            "ray_namespace": ray_ns,
            "device_blocks": s["device_blocks"],
            "index_timeout_s": s.get("index_timeout_s", 0.1),
        }
    fields: dict[str, Any] = {
        "request_router_class": _ROUTER_CLASSES[name],
        "request_router_kwargs": kwargs,
    }
    return RequestRouterConfig(**fields)


def _app(model: Path, name: str, chunk_ns: str | None, ray_ns: str, s: dict[str, Any]) -> Any:
    from tierstore.deploy.serve_llm import llm_config, openai_app

    tierstore = {"cpu_bytes_per_node": s["cpu_bytes_per_node"], "namespace": ray_ns}
    env = {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", BIND_ENV)}
    config = llm_config(
        str(model),
        tierstore,
        model_id=MODEL_ID,
        cpu=True,
        engine_kwargs=_engine_kwargs(s),
        runtime_env={"env_vars": env},
        # Stream each token as it comes: Ray Serve LLM batches a stream's chunks every
        # 50 ms by default, which would round every TTFT up to that grid.
        experimental_configs={"stream_batching_interval_ms": 0},
        deployment_config={
            "num_replicas": 2,
            "request_router_config": _router_config(name, chunk_ns, ray_ns, s),
        },
    )
    return openai_app([config])


def _stream(client: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One completion, streamed: TTFT (first chunk with a token), tokens, cached tokens."""
    got = stream_completion(client, MODEL_ID, prompt, max_tokens)
    return {
        "ttft_s": got.ttft_s,
        "latency_s": got.latency_s,
        "prompt_tokens": got.prompt_tokens,
        "cached_tokens": got.cached_tokens,
        "tokens": got.tokens,
    }


def run_workload(client: Any, s: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat, closed loop: at most ``clients`` requests in flight, turns in their
    schedule's order, a conversation's next turn once its answer is in. Blocks until
    every turn is answered; raises the first failed request's error."""
    session = MultiRound(**s["workload"]).session()
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(s["clients"], thread_name_prefix="router-bench-client") as pool:
        running: dict[Future[dict[str, Any]], Any] = {}

        def submit_due() -> None:
            for request in session.due(math.inf):
                running[pool.submit(_stream, client, request.prompt, s["max_tokens"])] = request

        submit_due()
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                request = running.pop(future)
                result = future.result()
                session.answered(request, result["tokens"])
                results.append(
                    {"index": request.index, "user": request.user, "round": request.round} | result
                )
            submit_due()
    return sorted(results, key=lambda r: r["index"])


def _warm_up(client: Any, s: dict[str, Any]) -> None:
    """Two short unrelated prompts at once (most often one per replica): the engines'
    first steps are slower; no chat prefix is shared with them."""
    from tierstore.deploy.passes import random_prompt

    with ThreadPoolExecutor(2) as pool:
        prompts = [random_prompt(2 * BLOCK + 3, seed=900_001 + i) for i in range(2)]
        list(pool.map(lambda p: _stream(client, p, 2), prompts))


def _totals(ray_ns: str) -> dict[str, int]:
    from tierstore.deploy.cli import collect_status

    return dict(collect_status(ray_ns)["totals"])


def _node_loads(ray_ns: str) -> dict[str, int]:
    from tierstore.deploy.cli import collect_status

    return {
        str(node["node_id"]): int(node["stats"]["loaded_shards"])
        for node in collect_status(ray_ns)["nodes"]
    }


def _chunk_namespace(ray_ns: str) -> str | None:
    """The chunk namespace the engines stored under: any chunk the Evictor's index or a
    NodeStore holds (None: nothing is stored)."""
    import ray
    from tierstore.actors.bootstrap import find_node_store
    from tierstore.actors.names import evictor_name

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    evictor = ray.get_actor(evictor_name(0), namespace=ray_ns)
    for node in nodes:
        views: Any = [ray.get(evictor.index_view.remote(node), timeout=30)]
        try:
            views.append(ray.get(find_node_store(ray_ns, node).inventory.remote(), timeout=30))
        except Exception as exc:  # a node without a NodeStore (the head may have none)
            logger.info("no NodeStore inventory from %s: %r", node, exc)
        for held in views:
            for shard_id, _tier in held:
                return str(shard_id.namespace)
    return None


def summarize(
    requests: list[dict[str, Any]], before: dict[str, int], after: dict[str, int]
) -> dict[str, Any]:
    """One router's numbers: TTFT, hit rate, tierstore's hits by place."""
    ttfts = [r["ttft_s"] for r in requests]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] or 0 for r in requests)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    same, other = delta.get("hits_same_node", 0), delta.get("hits_other_node", 0)
    return {
        "requests": len(requests),
        "ttft_ms": {
            "p50": 1e3 * percentile(ttfts, 50),
            "p90": 1e3 * percentile(ttfts, 90),
            "p99": 1e3 * percentile(ttfts, 99),
            "mean": 1e3 * sum(ttfts) / len(ttfts),
        },
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "tierstore_loaded_tokens": BLOCK * delta.get("loaded_chunks", 0),
        "tierstore_hits_same_node": same,
        "tierstore_hits_other_node": other,
        "same_node_share": same / (same + other) if same + other else None,
        "evictor_delta": delta,
    }


def _one_router(
    name: str, model: Path, chunk_ns: str | None, s: dict[str, Any], port: int, run_id: str
) -> tuple[dict[str, Any], str | None]:
    """Deploy, warm up, run the workload, delete. Returns its results and the chunk
    namespace the engines used."""
    from openai import OpenAI
    from ray import serve
    from tierstore.actors.bootstrap import shutdown_actors
    from tierstore.deploy.serve_llm import replica_nodes

    ray_ns = f"tierstore-bench-router-{run_id}-{name}"
    started = time.monotonic()
    serve.run(_app(model, name, chunk_ns, ray_ns, s), name="llm", route_prefix="/")
    ready_s = time.monotonic() - started
    placed = replica_nodes()
    logger.info("router %s: 2 replicas ready in %.0f s on %s", name, ready_s, placed)
    try:
        client = OpenAI(
            base_url=f"http://{LOOPBACK}:{port}/v1",
            api_key="unused",
            timeout=_REQUEST_TIMEOUT_S,
            max_retries=0,
        )
        _warm_up(client, s)
        time.sleep(_SETTLE_S)
        before, loads_before = _totals(ray_ns), _node_loads(ray_ns)
        ran = time.monotonic()
        requests = run_workload(client, s)
        workload_s = time.monotonic() - ran
        time.sleep(_SETTLE_S)
        after, loads_after = _totals(ray_ns), _node_loads(ray_ns)
        found = _chunk_namespace(ray_ns) if chunk_ns is None else chunk_ns
    finally:
        serve.delete("llm")
        shutdown_actors(ray_ns)
    summary = summarize(requests, before, after)
    summary |= {
        "router_class": _ROUTER_CLASSES[name],
        "ready_s": ready_s,
        "workload_s": workload_s,
        "replica_nodes": placed,
        "loaded_shards_by_node": {
            n: loads_after.get(n, 0) - loads_before.get(n, 0) for n in loads_after
        },
    }
    logger.info("router %s: %s", name, {k: summary[k] for k in ("ttft_ms", "hit_rate")})
    return {"summary": summary, "requests": requests}, found


def table(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, run in results.items():
        s = run["summary"]
        share = s["same_node_share"]
        rows.append(
            {
                "router": name,
                "ttft_p50_ms": round(s["ttft_ms"]["p50"], 1),
                "ttft_p99_ms": round(s["ttft_ms"]["p99"], 1),
                "hit_rate": round(s["hit_rate"], 3),
                "tierstore_hits_same_node_pct": None if share is None else round(100 * share, 1),
                "tierstore_hits": s["tierstore_hits_same_node"] + s["tierstore_hits_other_node"],
                "requests": s["requests"],
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| router | TTFT p50 ms | TTFT p99 ms | hit rate | tierstore hits same-node % "
        "(of HITs) | requests |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        pct = (
            "n/a"
            if r["tierstore_hits_same_node_pct"] is None
            else r["tierstore_hits_same_node_pct"]
        )
        lines.append(
            f"| {r['router']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {r['hit_rate']} | "
            f"{pct} ({r['tierstore_hits']}) | {r['requests']} |"
        )
    return "\n".join(lines) + "\n"


def same_outputs(results: dict[str, Any]) -> bool:
    """Whether every router's run gave the same output tokens per request."""
    outputs = [[r["tokens"] for r in run["requests"]] for run in results.values()]
    return all(o == outputs[0] for o in outputs)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark (module docstring); writes ``router.md`` in ``args.out`` too."""
    token_auth()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ[BIND_ENV] = omp_binding()
    s = setup(args.quick)
    model = make_tiny_model("llama", Path(tempfile.gettempdir()) / "tierstore-models")
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        # Ray's default health checks: no node is removed, and shorter ones declare a
        # raylet starved by engines starting beside it dead (tests/support.py).
        head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, node_ip_address=LOOPBACK)
    results: dict[str, Any] = {}
    chunk_ns: str | None = None
    run_id = f"{os.getpid()}"
    try:
        ray.init(address=cluster.address, namespace="tierstore-bench-router", log_to_driver=False)
        port = _free_port()
        serve.start(http_options={"host": LOOPBACK, "port": port})
        for name in ROUTERS:
            results[name], found = _one_router(name, model, chunk_ns, s, port, run_id)
            chunk_ns = chunk_ns or found
            # Kept as they come: a later router's failure leaves the earlier runs.
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "router-partial.json").write_text(json.dumps(results, indent=1))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    rows = table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router.md").write_text(markdown(rows))
    return {
        "setup": s
        | {
            "model": "tiny random Llama (deploy/models.py 'llama'), float32",
            "engine_kwargs": _engine_kwargs(s),
            BIND_ENV: os.environ[BIND_ENV],
            "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
            "cluster": "cluster_utils: head 1 CPU + 2 raylets x 2 CPUs, loopback, one replica each",
            "chunk_namespace": chunk_ns,
            "order": list(ROUTERS),
        },
        "table": rows,
        "same_outputs": same_outputs(results),
        "routers": results,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port
