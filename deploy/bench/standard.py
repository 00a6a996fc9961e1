"""The field's standard workloads, each against the same engine without tierstore.

- ``longdoc``: vLLM's long-document QA (``benchmarks/benchmark_long_document_qa_throughput.py``):
  N documents of L tokens, each queried R times, a short question after the document,
  in that script's ``random`` and ``interleave`` repeat modes (each mode its own
  documents, so neither warms the other). Requests go one at a time (vLLM's script
  hands them all to ``generate`` at once; one at a time, each TTFT is the request's own,
  not its place in a queue).
- ``multiround``: LMCache's multi-round QA (``benchmarks/multi-round-qa``): U users
  share one system prompt, each follows it with context of its own and asks R
  questions, each answer appended to its history; requests arrive at a fixed rate
  (``qps``, all users together), several in the engine at once.

Two engines with the same settings run the same workloads: ``no_connector`` (the
device prefix cache only) and ``tierstore`` (the e2e benchmark's tiers for the model:
a CPU tier smaller than the working set, a disk tier behind it). The device KV cache
holds about two prompts (``num_gpu_blocks_override``, as the e2e benchmark's), and
each workload's working set is larger than it, so repeats come from tierstore or are
recomputed. The engines run through the e2e benchmark's machinery (``e2e.EngineRuns``:
a process each, OpenMP threads pinned alike and recorded; ``--passes 2`` runs them
forward then back, each engine's runs pooled). Reported per workload and engine: TTFT
p50/p99, requests/s and tokens/s, and where prompt tokens came from (device prefix
cache, tierstore's CPU tier, its disk tier, computed: the hit rate by tier, from
vLLM's ``num_cached_tokens`` and the Evictor's counters).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from tierstore.deploy.bench import plots
from tierstore.deploy.bench.common import percentile
from tierstore.deploy.bench.e2e import (
    BLOCK_SIZE,
    NAMESPACE,
    EngineRuns,
    compare,
    pooled,
    run_order,
    summarize,
)
from tierstore.deploy.bench.e2e_setups import MODELS, setup_for

logger = logging.getLogger(__name__)

MODES = ("no_connector", "tierstore")
NAMES = ("longdoc", "multiround")

# (benchmark, model, quick) -> workloads and output length; the engine and its tiers are
# the e2e benchmark's for the model (``e2e_setups``). Tiny full: the device cache holds
# 2,304 tokens, the CPU tier 4,096 (1 KiB per token), the disk 256 MiB.
_LONGDOC: dict[tuple[str, bool], dict[str, Any]] = {
    # 8 documents of 1,024 tokens (8 MiB of KV), 3 questions each: 24 requests per mode.
    ("tiny", False): {"num_prefixes": 8, "prefix_len": 1024, "suffix_len": 32, "repeats": 3},
    ("tiny", True): {"num_prefixes": 4, "prefix_len": 384, "suffix_len": 16, "repeats": 2},
    ("0.1b", False): {"num_prefixes": 4, "prefix_len": 1024, "suffix_len": 32, "repeats": 2},
    ("0.1b", True): {"num_prefixes": 3, "prefix_len": 384, "suffix_len": 16, "repeats": 2},
}
_LONGDOC_ORDERS = {"random": 11, "interleave": 12}  # order -> the seed of its documents
_LONGDOC_MAX_TOKENS = 8  # vLLM's script: 10; the answer is not what is measured
_MULTIROUND: dict[tuple[str, bool], dict[str, Any]] = {
    # Final prompts ~820 tokens; all histories together ~5,000 (more than device or CPU).
    ("tiny", False): {
        "users": 8,
        "rounds": 4,
        "system_len": 256,
        "user_info_len": 384,
        "question_len": 32,
        "qps": 4.0,
    },
    ("tiny", True): {
        "users": 4,
        "rounds": 2,
        "system_len": 128,
        "user_info_len": 192,
        "question_len": 16,
        "qps": 4.0,
    },
    ("0.1b", False): {
        "users": 4,
        "rounds": 3,
        "system_len": 256,
        "user_info_len": 384,
        "question_len": 32,
        "qps": 0.25,
    },
    ("0.1b", True): {
        "users": 3,
        "rounds": 2,
        "system_len": 128,
        "user_info_len": 192,
        "question_len": 16,
        "qps": 0.25,
    },
}
_MULTIROUND_MAX_TOKENS = {False: 16, True: 4}  # each answer (LMCache: --answer-len)


def _param(item: str) -> tuple[str, Any]:
    """``--param KEY=VALUE``: the value as JSON (``16``, ``0.5``), else as text."""
    key, _, text = item.partition("=")
    try:
        return key, json.loads(text)
    except ValueError:
        return key, text


def setup(name: str, model: str, quick: bool, params: list[str] | None = None) -> dict[str, Any]:
    """The engines' sizes (the e2e benchmark's for ``model``) and ``name``'s workloads,
    ``params`` (``KEY=VALUE``) overriding the workload's parameters."""
    if name not in NAMES:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(NAMES)}")
    base = setup_for(model, quick)
    overrides = dict(_param(item) for item in params or [])
    if name == "longdoc":
        shape = _LONGDOC[(model, quick)] | overrides
        workloads = {
            order: {"kind": "prefix_repetition", "params": shape | {"order": order, "seed": seed}}
            for order, seed in _LONGDOC_ORDERS.items()
        }
        max_tokens = _LONGDOC_MAX_TOKENS
        longest = shape["prefix_len"] + shape["suffix_len"] + max_tokens
    else:
        shape = _MULTIROUND[(model, quick)] | overrides
        workloads = {"multi_round": {"kind": "multi_round", "params": shape}}
        max_tokens = _MULTIROUND_MAX_TOKENS[quick]
        answered = shape["rounds"] * (shape["question_len"] + max_tokens)
        longest = shape["system_len"] + shape["user_info_len"] + answered
    if longest > base["max_model_len"]:
        raise ValueError(f"{name}: prompts reach {longest} tokens, over {base['max_model_len']}")
    return {**base, "max_tokens": max_tokens, "workloads": workloads}


def _pacing(requests: list[dict[str, Any]]) -> dict[str, float]:
    """How late requests went against their schedule (a user's answer still out, or the
    engine's step in the way), in ms."""
    late = [1e3 * (r["sent_s"] - r["scheduled_s"]) for r in requests]
    return {"late_ms_p50": percentile(late, 50), "late_ms_max": max(late)}


def table(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload and engine: the figures the docs' tables show."""
    rows = []
    for workload in summary[MODES[0]]:
        for mode in MODES:
            s = summary[mode][workload]
            rows.append(
                {
                    "workload": workload,
                    "engine": mode,
                    "requests": s["requests"],
                    "ttft_ms_p50": s["ttft_ms"]["p50"],
                    "ttft_ms_p99": s["ttft_ms"]["p99"],
                    "requests_per_s": s["requests_per_s"],
                    "prompt_tokens_per_s": s["prompt_tokens_per_s"],
                    "output_tokens_per_s": s["output_tokens_per_s"],
                    "hit_rate": s["hit_rate"],
                }
            )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    name = args.name
    choice = getattr(args, "model", None) or "tiny"
    plan_setup = setup(name, choice, args.quick, getattr(args, "param", None))
    passes = getattr(args, "passes", None) or 1
    engines = EngineRuns.prepare(args, choice, name)
    order = run_order(passes, MODES)
    namespace = f"{NAMESPACE}-{name}"
    address, runs = engines.run(plan_setup, order, getattr(args, "disk_root", None), namespace)
    raw = {mode: pooled(runs[mode]) for mode in MODES}
    summary = {mode: {w: summarize(raw[mode][w]) for w in raw[mode]} for mode in MODES}
    if name == "multiround":
        for mode in MODES:
            for w, s in summary[mode].items():
                s["pacing"] = _pacing(raw[mode][w]["requests"])
    return {
        "ray_cluster": address,
        "benchmark": name,
        "model": choice,
        "omp_threads_bind": engines.binding,
        "tierstore_overrides": engines.overrides,
        "engine_runs": [f"{mode}-{n}" for mode, n in order],
        "setup": dict(plan_setup) | {"model": MODELS[choice], "block_size": BLOCK_SIZE},
        "table": table(summary),
        "tierstore_vs_no_connector": compare(summary, "tierstore"),
        "summary": summary,
        "raw_runs": runs,
    }


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    summary = results["summary"]
    names = list(summary["tierstore"])
    tag = f"{results['benchmark']}_{results.get('model', 'tiny')}"
    ttft = plots.bars(
        out / f"{tag}_ttft.png",
        f"{results['benchmark']}: time to first token ({results['setup']['model']}, CPU)",
        "ms",
        names,
        {
            f"{m.replace('_', ' ')} {q}": [summary[m][n]["ttft_ms"][q] for n in names]
            for q in ("p50", "p99")
            for m in MODES
        },
    )
    sources = ["device", "tierstore_cpu", "tierstore_disk", "computed"]
    hits = plots.stacked(
        out / f"{tag}_sources.png",
        f"{results['benchmark']}: where prompt tokens came from",
        "share of prompt tokens",
        [f"{n}\n{m.replace('_', ' ')}" for n in names for m in MODES],
        {
            s: [
                summary[m][n]["tokens"][s] / summary[m][n]["prompt_tokens"]
                for n in names
                for m in MODES
            ]
            for s in sources
        },
    )
    return [ttft, hits]
