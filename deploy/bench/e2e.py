"""End to end: a random Llama on the CPU build of vLLM, three engines in one run.

Three engines with the same settings run the same workloads (``workloads.py``: unique
prompts, prefix hits, prefix repetition, multi-turn chat), one request at a time:

- ``no_connector``: the device prefix cache only;
- ``reference``: the in-process reference restore (``tierstore.vllm.reference_spec``),
  the cheapest correct offload, through the same connector;
- ``tierstore``: a CPU tier smaller than the workloads' prefixes and a disk tier behind
  it, so hits come from both tiers.

Every engine's OpenMP threads are pinned alike (``VLLM_CPU_OMP_THREADS_BIND``; by default
every allowed core but the first, which is left to the engine's front end and tierstore's
actors), and the binding is recorded. The device KV cache is made small
(``num_gpu_blocks_override``: about two prompts), so the device prefix cache forgets as
a busy server's does. Reported per workload: TTFT p50/p90 (engine timestamps: queued to
first token, lookups and loads included), throughput, and where each prompt token came
from. The engines run twice, in the order no connector, reference, tierstore, then
back (``--quick``: once): a machine that drifts over the run's minutes weighs on every
engine alike, and each engine's figures pool its two runs (tierstore's second run has a
namespace and disk directory of its own, so it starts empty as the first did). The
headline ratios (``targets``): throughput and time at 0 % hits (the unique prompts)
against no connector, and the prefix-hit TTFT against the reference's and
against recompute (the no-connector engine's same request).

``--model``: ``tiny`` (2 layers, 1 KiB of KV per token: copies weigh most) or ``0.1b``
(real-model proportions of KV bytes to compute, 4 KiB per token); see ``e2e_setups``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore.actors.bootstrap import shutdown_actors
from tierstore.deploy.bench import plots
from tierstore.deploy.bench.common import percentile, ray_session
from tierstore.deploy.bench.e2e_setups import MODELS, setup_for
from tierstore.deploy.models import make_tiny_model
from tierstore.deploy.passes import REFERENCE_SPEC, TIERSTORE_SPEC

logger = logging.getLogger(__name__)

NAMESPACE = "tierstore-bench-e2e"
BLOCK_SIZE = 32  # tokens per block; one chunk = one block of the model's one KV group
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_ENGINE_TIMEOUT_S = 1800
_REPO = Path(__file__).resolve().parents[2]
MODES = ("no_connector", "reference", "tierstore")
# tierstore.vllm.metrics.LOADED_CHUNKS, by tier (e2e_engine.metric_totals); named here as
# breakdown() names the others, so the driver does not import vLLM.
_LOADED = "tierstore:loaded_chunks"


def omp_binding() -> str:
    """The OpenMP binding every engine gets: ``VLLM_CPU_OMP_THREADS_BIND`` if set, else
    every core this process may use but the first (vLLM's list syntax, e.g. ``1`` or
    ``1-7``); ``nobind`` on a single core."""
    if os.environ.get(BIND_ENV):
        return os.environ[BIND_ENV]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return "nobind"
    return ",".join(str(c) for c in cores[1:])


def _plan(
    setup: dict[str, Any],
    model: Path,
    mode: str,
    disk_path: Path,
    namespace: str = NAMESPACE,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``overrides``: tierstore config keys for the tierstore engine (``--set``)."""
    engine: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "max_model_len": setup["max_model_len"],
        "num_gpu_blocks_override": setup["device_blocks"],
    }
    if mode == "reference":
        engine["kv_extra_config"] = dict(REFERENCE_SPEC)
    if mode == "tierstore":
        engine["kv_extra_config"] = {
            **TIERSTORE_SPEC,
            "cpu_bytes_per_node": setup["cpu_bytes"],
            "disk_path": str(disk_path),
            "disk_bytes_per_node": setup["disk_bytes"],
            "namespace": namespace,
            **(overrides or {}),
        }
    return {
        "engine": engine,
        "max_tokens": setup["max_tokens"],
        "workloads": setup["workloads"],
        "tierstore_namespace": namespace if mode == "tierstore" else None,
    }


def _override(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--set``: the value as JSON (``false``, ``0``), else as text
    (``4GiB``); the tierstore engine's config validates it."""
    key, _, text = item.partition("=")
    try:
        return key, json.loads(text)
    except ValueError:
        return key, text


def run_order(passes: int, modes: tuple[str, ...] = MODES) -> list[tuple[str, int]]:
    """(mode, pass) in the order the engines run: forward, then back, and so on."""
    order: list[tuple[str, int]] = []
    for n in range(passes):
        order += [(mode, n) for mode in (modes if n % 2 == 0 else modes[::-1])]
    return order


@dataclass(frozen=True)
class EngineRuns:
    """What every engine of one benchmark run shares: the model built for ``choice``, the
    OpenMP binding, the ``--set`` overrides, the folder for the engines' files."""

    choice: str
    model: Path
    binding: str
    overrides: dict[str, Any]
    work: Path

    @classmethod
    def prepare(cls, args: argparse.Namespace, choice: str, name: str) -> EngineRuns:
        """Builds the model (cached) and ``args.out/<name>-<choice>-work``."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        model = make_tiny_model(MODELS[choice], Path(tempfile.gettempdir()) / "tierstore-models")
        overrides = dict(_override(item) for item in getattr(args, "set", None) or [])
        work = args.out / f"{name}-{choice}-work"
        work.mkdir(parents=True, exist_ok=True)
        return cls(choice, model, omp_binding(), overrides, work)

    def run(
        self,
        setup: dict[str, Any],
        order: list[tuple[str, int]],
        disk_root: Path | None,
        namespace: str,
    ) -> tuple[str, dict[str, list[dict[str, Any]]]]:
        """Each (mode, pass) of ``order`` as an engine of its own, in one Ray session; pass
        n's tierstore actors live in namespace ``<namespace>-<n>`` (stopped at the end).
        Returns the cluster's address and each mode's runs in order."""
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode, _ in order}
        passes = sorted({n for _, n in order})
        with (
            tempfile.TemporaryDirectory(prefix="tierstore-bench-disk-", dir=disk_root) as disk,
            ray_session(NAMESPACE) as address,
        ):
            try:
                for mode, n in order:
                    space = Path(disk) / f"run{n}"
                    plan = _plan(setup, self.model, mode, space, f"{namespace}-{n}", self.overrides)
                    runs[mode].append(
                        _run_engine(plan, address, self.work, f"{mode}-{n}", self.binding)
                    )
            finally:  # each tierstore run's actors (ray_session stops NAMESPACE's only)
                for n in passes:
                    shutdown_actors(f"{namespace}-{n}")
        return address, runs


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's runs as one: per workload, the requests in run order, the wall
    times and tierstore's counters added up (a prefix-hit run keeps its miss/hit
    alternation, as each holds whole pairs)."""
    out: dict[str, Any] = {}
    for name in runs[0]:
        parts = [run[name] for run in runs]
        counters: dict[str, int] = {}
        for part in parts:
            for key, value in part["tierstore"].items():
                counters[key] = counters.get(key, 0) + value
        out[name] = {
            **parts[0],
            "requests": [r for part in parts for r in part["requests"]],
            "wall_s": sum(part["wall_s"] for part in parts),
            "tierstore": counters,
            "metrics": metrics_added([part.get("metrics", {}) for part in parts]),
        }
    return out


def metrics_added(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Metric totals of several runs added up (a histogram's sum and count each)."""
    out: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            if isinstance(value, dict):
                total = out.setdefault(name, {"sum": 0.0, "count": 0})
                total["sum"] += value["sum"]
                total["count"] += value["count"]
            else:
                out[name] = out.get(name, 0) + value
    return out


def _metric_sum(metrics: dict[str, Any], name: str) -> float:
    value = metrics.get(name, metrics.get(name + "_total", 0.0))
    return float(value["sum"] if isinstance(value, dict) else value)


def _metric_count(metrics: dict[str, Any], name: str) -> int:
    value = metrics.get(name)
    return int(value["count"]) if isinstance(value, dict) else 0


def breakdown(requests: list[dict[str, Any]], metrics: dict[str, Any]) -> dict[str, float]:
    """Where the hit requests' time went, in ms per request (means; ``*_p50`` medians).

    From the engine's timestamps: ``queued_to_scheduled`` (lookups and the load: the
    request is scheduled for compute once its load is done) and
    ``scheduled_to_first_token`` (the forward of what is not loaded). From vLLM's
    offloading connector: ``lookup_calls`` (time inside ``lookup``: the scheduler's own
    cost), ``lookup_deferred`` (first RETRY to the lookup that resolved: the lease's round
    trip when a key is asked, not answered from the cluster view), ``load_copy`` (a load
    job's submit to its bytes in place, as the worker reports it: submit, directory find,
    copy). From tierstore's scheduler metrics: ``load_job`` (``prepare_load`` to
    ``complete_load``), hence ``load_completion`` = ``load_job`` - ``load_copy`` (the
    job's report reaching the scheduler: the next step's ``get_finished``), and
    ``scheduler_wait`` = ``queued_to_scheduled`` - ``lookup_deferred`` - ``load_job``
    (steps spent on neither). A figure with no source (the reference has no tierstore
    metrics) is left out."""
    n = len(requests)
    if not n:
        return {}
    waits = [1e3 * r.get("wait_s", 0.0) for r in requests]
    runs = [1e3 * (r["ttft_s"] - r.get("wait_s", 0.0)) for r in requests]
    out = {
        "requests": float(n),
        "ttft": 1e3 * sum(r["ttft_s"] for r in requests) / n,
        "ttft_p50": 1e3 * percentile([r["ttft_s"] for r in requests], 50),
        "queued_to_scheduled": sum(waits) / n,
        "queued_to_scheduled_p50": percentile(waits, 50),
        "scheduled_to_first_token": sum(runs) / n,
        "scheduled_to_first_token_p50": percentile(runs, 50),
    }
    if not metrics:
        return out
    out["lookup_calls"] = (
        1e3 * _metric_sum(metrics, "vllm:kv_offload_lookup_sync_delay_seconds") / n
    )
    out["lookup_deferred"] = (
        1e3 * _metric_sum(metrics, "vllm:kv_offload_lookup_async_delay_seconds") / n
    )
    jobs = _metric_count(metrics, "vllm:kv_offload_load_size")
    out["load_jobs"] = float(jobs)
    out["load_copy"] = 1e3 * _metric_sum(metrics, "vllm:kv_offload_load_time") / n
    if "tierstore:load_latency_seconds" in metrics:
        out["load_job"] = 1e3 * _metric_sum(metrics, "tierstore:load_latency_seconds") / n
        out["load_completion"] = out["load_job"] - out["load_copy"]
        out["lease_wait"] = 1e3 * _metric_sum(metrics, "tierstore:lookup_wait_seconds") / n
        out["scheduler_wait"] = (
            out["queued_to_scheduled"] - out["lookup_deferred"] - out["load_job"]
        )
        for name in ("picture_hits", "picture_hits_unleased", "failed_loads", "lookup_timeouts"):
            out[name] = _metric_sum(metrics, "tierstore:" + name)
    return out


def breakdown_vs(mine: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
    """Per figure both have: how many ms more per request than the reference's."""
    return {k: mine[k] - reference[k] for k in mine if k in reference and k != "requests"}


def _run_engine(
    plan: dict[str, Any], ray_address: str, work: Path, mode: str, binding: str
) -> dict[str, Any]:
    """Runs ``tierstore.deploy.bench.e2e_engine`` in a fresh process; its log goes to ``work``."""
    plan_path, out_path, log_path = (work / f"{mode}{s}" for s in (".plan.json", ".json", ".log"))
    plan_path.write_text(json.dumps(plan))
    env = dict(os.environ)
    env.update(
        RAY_ADDRESS=ray_address,
        PYTHONPATH=f"{_REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    )
    env[BIND_ENV] = binding
    logger.info("e2e: running the %s engine (log: %s)", mode, log_path)
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tierstore.deploy.bench.e2e_engine",
                str(plan_path),
                str(out_path),
            ],
            cwd=_REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=_ENGINE_TIMEOUT_S,
        )
    if proc.returncode != 0:
        tail = log_path.read_text()[-6000:]
        raise RuntimeError(f"the {mode} engine failed ({proc.returncode}):\n{tail}")
    return json.loads(out_path.read_text())


def _ttft_ms(requests: list[dict[str, Any]]) -> dict[str, float]:
    ttfts = [r["ttft_s"] for r in requests]
    # The TTFT's share before the request was first scheduled (lookups and loads).
    waits = [r.get("wait_s", 0.0) for r in requests]
    return {
        "p50": 1e3 * percentile(ttfts, 50),
        "p90": 1e3 * percentile(ttfts, 90),
        "p99": 1e3 * percentile(ttfts, 99),
        "mean": 1e3 * sum(ttfts) / len(ttfts),
        "wait_p50": 1e3 * percentile(waits, 50),
    }


def summarize(raw: dict[str, Any], tokens_per_chunk: int = BLOCK_SIZE) -> dict[str, Any]:
    """One workload of one engine: latency, throughput, and where prompt tokens came from."""
    requests = raw["requests"]
    latencies = [r.get("latency_s", 0.0) for r in requests]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)
    ts = raw["tierstore"]
    metrics = raw.get("metrics", {})
    by_tier = {t: metrics.get(f'{_LOADED}{{tier="{t}"}}') for t in ("cpu", "disk")}
    if any(n is not None for n in by_tier.values()):
        # The scheduler's count of the chunks it loaded, by the tier each HIT came from
        # (DISK: read from disk, or promoted first).
        cpu_chunks, disk_chunks = (int(by_tier[t] or 0) for t in ("cpu", "disk"))
        loaded = cpu_chunks + disk_chunks
    else:  # no such metric (runs recorded before it): the Evictor's counters
        loaded = ts.get("loaded_chunks", 0)
        # One shard per chunk here (one rank): a chunk HIT from disk is counted by
        # disk_hits and promoted_shards both; their larger one is the floor.
        disk_chunks = max(ts.get("promoted_shards", 0), ts.get("disk_hits", 0))
    from_tierstore = min(cached, loaded * tokens_per_chunk)
    from_disk = min(from_tierstore, disk_chunks * tokens_per_chunk)
    tokens = {
        "device": cached - from_tierstore,
        "tierstore_cpu": from_tierstore - from_disk,
        "tierstore_disk": from_disk,
        "computed": prompt - cached,
    }
    summary = {
        "requests": len(requests),
        "prompt_tokens": prompt,
        "ttft_ms": _ttft_ms(requests),
        "latency_ms": {
            "p50": 1e3 * percentile(latencies, 50),
            "p90": 1e3 * percentile(latencies, 90),
        },
        "wall_s": raw["wall_s"],
        "requests_per_s": len(requests) / raw["wall_s"],
        "prompt_tokens_per_s": prompt / raw["wall_s"],
        "output_tokens_per_s": sum(r["output_tokens"] for r in requests) / raw["wall_s"],
        "tokens": tokens,
        # Shares of prompt tokens: hits per tier, and the miss (computed).
        "hit_rate": {k: v / prompt for k, v in tokens.items() if k != "computed"}
        | {"miss": tokens["computed"] / prompt},
        "tierstore_counters": ts,
    }
    if raw.get("kind") == "hit_pass":  # every request a hit
        summary["hit_ttft_ms"] = _ttft_ms(requests)
        summary["breakdown_ms"] = breakdown(requests, raw.get("metrics", {}))
        summary["store_pass"] = raw.get("store_pass", {})
    if raw.get("kind") == "prefix_hit":  # misses at even positions, their hits at odd
        hits = requests[1::2]
        summary["miss_ttft_ms"] = _ttft_ms(requests[0::2])
        summary["hit_ttft_ms"] = _ttft_ms(hits)
        summary["hit_cached_fraction"] = sum(r["cached_tokens"] for r in hits) / sum(
            r["prompt_tokens"] for r in hits
        )
    return summary


def compare(summary: dict[str, dict[str, Any]], mode: str) -> dict[str, dict[str, float]]:
    """Per workload: ``mode`` over no connector (TTFT < 1 and throughput > 1 are wins)."""
    on, off = summary[mode], summary["no_connector"]
    return {
        name: {
            "ttft_p50_ratio": on[name]["ttft_ms"]["p50"] / off[name]["ttft_ms"]["p50"],
            "ttft_p90_ratio": on[name]["ttft_ms"]["p90"] / off[name]["ttft_ms"]["p90"],
            "throughput_ratio": on[name]["prompt_tokens_per_s"] / off[name]["prompt_tokens_per_s"],
            "time_ratio": on[name]["wall_s"] / off[name]["wall_s"],
        }
        for name in on
    }


def targets(summary: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The issue's headline ratios: 0 % hits against no connector, and the prefix hit's
    TTFT (p50 over the pairs) against the reference's and against recompute."""
    ts, ref, off = (summary[m] for m in ("tierstore", "reference", "no_connector"))
    out = {
        "zero_hit_throughput_vs_no_connector": ts["unique"]["prompt_tokens_per_s"]
        / off["unique"]["prompt_tokens_per_s"],
        "zero_hit_time_vs_no_connector": ts["unique"]["wall_s"] / off["unique"]["wall_s"],
        "reference_zero_hit_time_vs_no_connector": ref["unique"]["wall_s"]
        / off["unique"]["wall_s"],
    }
    if "prefix_hit" in ts:
        hit = {m: summary[m]["prefix_hit"]["hit_ttft_ms"] for m in MODES}
        for q in ("p50", "mean"):
            out[f"hit_ttft_{q}_vs_reference"] = hit["tierstore"][q] / hit["reference"][q]
            out[f"hit_ttft_{q}_vs_recompute"] = hit["tierstore"][q] / hit["no_connector"][q]
            out[f"reference_hit_ttft_{q}_vs_recompute"] = (
                hit["reference"][q] / hit["no_connector"][q]
            )
        out["hit_pass_time_vs_reference"] = ts["prefix_hit"]["wall_s"] / ref["prefix_hit"]["wall_s"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    choice = getattr(args, "model", None) or "tiny"
    setup = setup_for(choice, args.quick)
    engines = EngineRuns.prepare(args, choice, "e2e")
    binding, overrides = engines.binding, engines.overrides
    passes = 1 if args.quick else 2
    address, runs = engines.run(setup, run_order(passes), args.disk_root, NAMESPACE)
    raw = {mode: pooled(runs[mode]) for mode in MODES}
    summary = {mode: {name: summarize(w) for name, w in raw[mode].items()} for mode in MODES}
    return {
        "ray_cluster": address,
        "model": choice,
        "omp_threads_bind": binding,
        "tierstore_overrides": overrides,
        "engine_runs": [f"{mode}-{n}" for mode, n in run_order(passes)],
        "setup": dict(setup) | {"model": MODELS[choice], "block_size": BLOCK_SIZE},
        "summary": summary,
        "targets": targets(summary),
        "tierstore_vs_no_connector": compare(summary, "tierstore"),
        "reference_vs_no_connector": compare(summary, "reference"),
        "raw": raw,
        "raw_runs": runs,
    }


_LABEL = {"no_connector": "no connector", "reference": "reference", "tierstore": "tierstore"}


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    summary = results["summary"]
    names = list(summary["tierstore"])
    tag = f"e2e_{results.get('model', 'tiny')}"
    ttft = plots.bars(
        out / f"{tag}_ttft.png",
        f"Time to first token ({results['setup']['model']}, CPU)",
        "ms",
        names,
        {
            f"{_LABEL[m]} {q}": [summary[m][n]["ttft_ms"][q] for n in names]
            for q in ("p50", "p90")
            for m in MODES
        },
    )
    throughput = plots.bars(
        out / f"{tag}_throughput.png",
        "Prompt tokens per second (one request at a time)",
        "tokens / s",
        names,
        {_LABEL[m]: [summary[m][n]["prompt_tokens_per_s"] for n in names] for m in MODES},
    )
    sources = ["device", "tierstore_cpu", "tierstore_disk", "computed"]
    hits = plots.stacked(
        out / f"{tag}_sources.png",
        "Where prompt tokens came from",
        "share of prompt tokens",
        ["\n".join([*n.split("_"), _LABEL[m]]) for n in names for m in MODES],
        {
            s: [
                summary[m][n]["tokens"][s] / summary[m][n]["prompt_tokens"]
                for n in names
                for m in MODES
            ]
            for s in sources
        },
    )
    return [ttft, throughput, hits]
