"""One engine's share of the end-to-end benchmark, in a process of its own.

``python -m tierstore.deploy.bench.e2e_engine PLAN_JSON OUT_JSON``: builds the engine, warms it up,
then runs each workload of the plan in order, one request at a time (the multi-round
chat: paced, several at once, ``run_paced``). Before each
workload the device prefix cache is emptied, so workloads do not feed each other. With
tierstore on, the cluster's counters (``tierstore status``) are read before and after
each workload; their difference says how many chunks came from the CPU and disk tiers.
Each engine gets its own process: vLLM engines do not shut down cleanly enough to share one.

The ``hit_pass`` workload (``count`` unique prompts of ``length`` tokens) stores every
prompt first (the store pass, drained), empties the device prefix cache, then times the
same prompts again: every request of the hit pass loads all its full chunks. Every
workload also records what vLLM's and tierstore's metrics (the Prometheus registry) added up
over it (``metrics``: per name, a counter's value or a histogram's ``sum`` and ``count``),
the sources of the hit breakdown (``e2e.breakdown``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierstore.deploy.bench.workloads import ChatSession, MultiRound, PrefixHit, Unique, build
from tierstore.deploy.passes import (
    EngineSpec,
    RequestResult,
    build_llm,
    drain,
    request_result,
    run_request,
    sampling_params,
    shutdown_engine,
    warm_up,
)

_PACED_TIMEOUT_S = 1800.0


def _tierstore_totals(namespace: str | None) -> dict[str, int]:
    if namespace is None:
        return {}
    from tierstore.deploy.cli import collect_status

    return collect_status(namespace)["totals"]


# The metrics the hit breakdown reads (``e2e.breakdown``): vLLM's offloading connector
# (lookup delay, load time per job) and the scheduler's own (tierstore:*).
_METRIC_PREFIXES = ("vllm:kv_offload", "tierstore:")


def metric_totals() -> dict[str, Any]:
    """Counters' values and histograms' sums and counts, added over their label sets,
    from this process's Prometheus registry (the engine's stat loggers run here; vLLM's
    ``LLM.get_metrics`` would skip tierstore's names and round counters to integers).
    A counter with a ``tier`` label also has each tier's total, as ``NAME{tier="disk"}``."""
    from prometheus_client import REGISTRY

    out: dict[str, Any] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith(_METRIC_PREFIXES) or family.type == "gauge":
            continue
        for sample in family.samples:
            if family.type == "counter" and sample.name.endswith("_total"):
                out[family.name] = out.get(family.name, 0.0) + sample.value
                if "tier" in sample.labels:
                    name = f'{family.name}{{tier="{sample.labels["tier"]}"}}'
                    out[name] = out.get(name, 0.0) + sample.value
            elif family.type == "histogram" and sample.name.endswith(("_sum", "_count")):
                total = out.setdefault(family.name, {"sum": 0.0, "count": 0})
                field = "sum" if sample.name.endswith("_sum") else "count"
                total[field] += sample.value
    return out


def metric_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, dict):
            old = old or {"sum": 0.0, "count": 0}
            out[name] = {"sum": value["sum"] - old["sum"], "count": value["count"] - old["count"]}
        else:
            out[name] = value - (old or 0)
    return out


def run_paced(
    llm: Any,
    session: ChatSession,
    sampling: Any,
    record: Callable[[list[int], RequestResult, dict[str, Any]], None],
    timeout_s: float = _PACED_TIMEOUT_S,
) -> None:
    """Sends each request of ``session`` when it is due, several in the engine at once,
    and steps the engine until every one is answered; ``record(prompt, result, extra)``
    per finished request (``extra``: its user, round, due and send times, in seconds from
    the start). A request goes within one engine step of its time (``step`` returns
    after each: the engine reports its stats every step). Blocks; raises
    ``TimeoutError`` past ``timeout_s``."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    started = time.perf_counter()
    in_flight: dict[str, tuple[Any, float]] = {}
    while not session.done:
        now = time.perf_counter() - started
        if now > timeout_s:
            raise TimeoutError(f"paced workload unfinished after {timeout_s} s")
        for request in session.due(now):
            request_id = f"paced-{request.index}"  # outputs carry it (the engine adds a suffix)
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=request.prompt), sampling)
            in_flight[request_id] = (request, now)
        if not in_flight:
            next_s = session.next_s()
            if next_s is not None:
                time.sleep(min(max(0.0, next_s - now), 0.05))
            continue
        if not engine.has_unfinished_requests():  # step() would wait for nothing
            raise RuntimeError(f"the engine lost requests {sorted(in_flight)}")
        for out in engine.step():
            if not out.finished or out.request_id not in in_flight:
                continue
            request, sent_s = in_flight.pop(out.request_id)
            finished_s = time.perf_counter() - started
            result = request_result(out, finished_s - sent_s)
            session.answered(request, result.tokens)
            extra = {
                "user": request.user,
                "round": request.round,
                "scheduled_s": request.scheduled_s,
                "sent_s": sent_s,
            }
            record(request.prompt, result, extra)


def _store_pass(llm: Any, params: dict[str, Any], sampling: Any) -> dict[str, Any]:
    """The hit pass's set-up: every prompt stored first (only the hit pass is measured)."""
    started = time.perf_counter()
    for prompt in Unique(**params).prompts():
        run_request(llm, prompt, sampling)
    drain(llm)
    llm.reset_prefix_cache()
    return {"wall_s": time.perf_counter() - started}


def run_workload(
    llm: Any, kind: str, params: dict[str, Any], max_tokens: int, namespace: str | None
) -> dict[str, Any]:
    drain(llm)
    llm.reset_prefix_cache()
    sampling = sampling_params(max_tokens)
    requests: list[dict[str, Any]] = []
    store_pass = _store_pass(llm, params, sampling) if kind == "hit_pass" else {}
    before = _tierstore_totals(namespace)
    metrics_before = metric_totals()

    def record(prompt: list[int], result: RequestResult, extra: dict[str, Any]) -> None:
        requests.append(
            {
                "prompt_tokens": len(prompt),
                "cached_tokens": result.num_cached_tokens,
                "output_tokens": len(result.tokens),
                "ttft_s": result.ttft_s,
                "wait_s": result.wait_s,
                "latency_s": result.latency_s,
                **extra,
            }
        )

    def generate(prompt: list[int]) -> list[int]:
        result = run_request(llm, prompt, sampling)
        record(prompt, result, {})
        return result.tokens

    def forget() -> None:  # stores done, then the device prefix cache emptied
        drain(llm)
        llm.reset_prefix_cache()

    workload = build("unique" if kind == "hit_pass" else kind, params)
    started = time.perf_counter()
    if isinstance(workload, PrefixHit):
        workload.run(generate, forget)
    elif isinstance(workload, MultiRound):
        run_paced(llm, workload.session(), sampling, record)
    else:
        workload.run(generate)
    wall_s = time.perf_counter() - started
    drain(llm)
    after = _tierstore_totals(namespace)
    return {
        "kind": kind,
        "params": params,
        "wall_s": wall_s,
        "requests": requests,
        "tierstore": {k: after[k] - before.get(k, 0) for k in after},
        "metrics": metric_delta(metric_totals(), metrics_before),
        **({"store_pass": store_pass} if store_pass else {}),
    }


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    llm = build_llm(EngineSpec(**plan["engine"]))
    namespace = plan.get("tierstore_namespace")
    if namespace is not None:
        import ray

        # Only to read the counters; the engine's own processes joined on their own.
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=namespace, log_to_driver=False)
    try:
        warm_up(llm)
        results = {
            name: run_workload(llm, w["kind"], w["params"], plan["max_tokens"], namespace)
            for name, w in plan["workloads"].items()
        }
    finally:
        shutdown_engine(llm)  # now, in order: not at interpreter exit
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
