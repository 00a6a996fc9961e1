"""End to end: a tiny Llama on the CPU build of vLLM, with tierstore and without.

Two engines with the same settings run the same workloads (``workloads.py``: prefix
repetition, multi-turn chat, unique prompts), one request at a time:

- ``tierstore``: the device prefix cache plus tierstore, with a CPU tier smaller than
  the workloads' prefixes and a disk tier behind it, so hits come from both tiers;
- ``baseline``: the device prefix cache only.

The device KV cache is made small (``num_gpu_blocks_override``: about two prompts), so
the device prefix cache forgets as a busy server's does, and what it forgets tierstore
can give back. Reported per workload: TTFT p50/p90 (engine timestamps: queued to first
token, lookups and loads included), throughput, and where each prompt token came from
(device prefix cache, tierstore CPU tier, tierstore disk tier, or computed). The unique
prompts have nothing to reuse: their tierstore-vs-baseline ratio is tierstore's 0 %-hit
overhead (lookups that miss, and the stores).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tierstore.deploy.bench import plots
from tierstore.deploy.bench.common import percentile, ray_session
from tierstore.deploy.models import make_tiny_model
from tierstore.deploy.passes import TIERSTORE_SPEC

logger = logging.getLogger(__name__)

NAMESPACE = "tierstore-bench-e2e"
MODEL = "llama"
BLOCK_SIZE = 32  # tokens per block; one chunk = one block of the model's one KV group
_ENGINE_TIMEOUT_S = 1800
_REPO = Path(__file__).resolve().parents[2]

# The tiny Llama's KV cache is 1 KiB per token (2 layers x 2 KV heads x 32 dims x K,V x
# fp32): a 32-token chunk is 32 KiB. The CPU tier (4 MiB = 128 chunks) holds half of the
# full run's shared prefixes; the rest are served from disk.
FULL: dict[str, Any] = {
    "device_blocks": 72,  # 2304 tokens (vLLM keeps one block back): about two prompts
    "max_model_len": 2048,
    "cpu_bytes": 4 << 20,
    "disk_bytes": 256 << 20,
    "max_tokens": 16,
    "workloads": {
        "unique": {"kind": "unique", "params": {"count": 24, "length": 1088}},
        "prefix_repetition": {
            "kind": "prefix_repetition",
            "params": {"num_prefixes": 8, "prefix_len": 1024, "suffix_len": 64, "repeats": 5},
        },
        "multi_turn": {
            "kind": "multi_turn",
            "params": {"conversations": 8, "turns": 4, "system_len": 384, "user_len": 96},
        },
    },
}
QUICK: dict[str, Any] = {
    **FULL,
    "device_blocks": 25,  # 800 tokens (vLLM keeps one block back): one or two prompts
    "max_model_len": 768,
    "cpu_bytes": 1 << 20,  # 32 chunks: more than one request stores, less than all
    "max_tokens": 4,
    "workloads": {
        "unique": {"kind": "unique", "params": {"count": 2, "length": 256}},
        "prefix_repetition": {
            "kind": "prefix_repetition",
            "params": {"num_prefixes": 2, "prefix_len": 512, "suffix_len": 32, "repeats": 2},
        },
        "multi_turn": {
            "kind": "multi_turn",
            "params": {"conversations": 2, "turns": 2, "system_len": 256, "user_len": 64},
        },
    },
}
MODES = ("tierstore", "baseline")


def _plan(setup: dict[str, Any], model: Path, mode: str, disk_path: Path) -> dict[str, Any]:
    engine: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "max_model_len": setup["max_model_len"],
        "num_gpu_blocks_override": setup["device_blocks"],
    }
    if mode == "tierstore":
        engine["kv_extra_config"] = {
            **TIERSTORE_SPEC,
            "cpu_bytes_per_node": setup["cpu_bytes"],
            "disk_path": str(disk_path),
            "disk_bytes_per_node": setup["disk_bytes"],
            "namespace": NAMESPACE,
        }
    return {
        "engine": engine,
        "max_tokens": setup["max_tokens"],
        "workloads": setup["workloads"],
        "tierstore_namespace": NAMESPACE if mode == "tierstore" else None,
    }


def _run_engine(plan: dict[str, Any], ray_address: str, work: Path, mode: str) -> dict[str, Any]:
    """Runs ``tierstore.deploy.bench.e2e_engine`` in a fresh process; its log goes to ``work``."""
    plan_path, out_path, log_path = (work / f"{mode}{s}" for s in (".plan.json", ".json", ".log"))
    plan_path.write_text(json.dumps(plan))
    env = dict(os.environ)
    env.update(
        RAY_ADDRESS=ray_address,
        PYTHONPATH=f"{_REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    )
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


def summarize(raw: dict[str, Any], tokens_per_chunk: int = BLOCK_SIZE) -> dict[str, Any]:
    """One workload of one engine: latency, throughput, and where prompt tokens came from."""
    requests = raw["requests"]
    ttfts = [r["ttft_s"] for r in requests]
    latencies = [r.get("latency_s", 0.0) for r in requests]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)
    ts = raw["tierstore"]
    from_tierstore = min(cached, ts.get("loaded_chunks", 0) * tokens_per_chunk)
    # A chunk found only on disk is promoted to the CPU tier before its HIT, or read
    # straight from disk when the CPU tier has no room for it: one shard per chunk here
    # (one rank), so promotions plus disk HITs count the chunks served from disk.
    disk_chunks = ts.get("promoted_shards", 0) + ts.get("disk_hits", 0)
    from_disk = min(from_tierstore, disk_chunks * tokens_per_chunk)
    tokens = {
        "device": cached - from_tierstore,
        "tierstore_cpu": from_tierstore - from_disk,
        "tierstore_disk": from_disk,
        "computed": prompt - cached,
    }
    return {
        "requests": len(requests),
        "prompt_tokens": prompt,
        "ttft_ms": {
            "p50": 1e3 * percentile(ttfts, 50),
            "p90": 1e3 * percentile(ttfts, 90),
            "mean": 1e3 * sum(ttfts) / len(ttfts),
        },
        "latency_ms": {
            "p50": 1e3 * percentile(latencies, 50),
            "p90": 1e3 * percentile(latencies, 90),
        },
        "wall_s": raw["wall_s"],
        "requests_per_s": len(requests) / raw["wall_s"],
        "prompt_tokens_per_s": prompt / raw["wall_s"],
        "output_tokens_per_s": sum(r["output_tokens"] for r in requests) / raw["wall_s"],
        "tokens": tokens,
        "hit_rate": {k: v / prompt for k, v in tokens.items() if k != "computed"},
        "tierstore_counters": ts,
    }


def compare(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per workload: tierstore over baseline (TTFT < 1 and throughput > 1 are wins)."""
    on, off = summary["tierstore"], summary["baseline"]
    return {
        name: {
            "ttft_p50_ratio": on[name]["ttft_ms"]["p50"] / off[name]["ttft_ms"]["p50"],
            "ttft_p90_ratio": on[name]["ttft_ms"]["p90"] / off[name]["ttft_ms"]["p90"],
            "throughput_ratio": on[name]["prompt_tokens_per_s"] / off[name]["prompt_tokens_per_s"],
        }
        for name in on
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    setup = QUICK if args.quick else FULL
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = make_tiny_model(MODEL, Path(tempfile.gettempdir()) / "tierstore-models")
    work = args.out / "e2e-work"
    work.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="tierstore-bench-disk-", dir=args.disk_root) as disk,
        ray_session(NAMESPACE) as address,
    ):
        raw = {
            mode: _run_engine(_plan(setup, model, mode, Path(disk)), address, work, mode)
            for mode in MODES
        }
    summary = {mode: {name: summarize(w) for name, w in raw[mode].items()} for mode in MODES}
    return {
        "ray_cluster": address,
        "setup": {k: v for k, v in setup.items()} | {"model": MODEL, "block_size": BLOCK_SIZE},
        "summary": summary,
        "tierstore_vs_baseline": compare(summary),
        "zero_hit_overhead": compare(summary)["unique"],
        "raw": raw,
    }


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    summary = results["summary"]
    names = list(summary["tierstore"])
    label = {"tierstore": "tierstore", "baseline": "no tierstore"}
    ttft = plots.bars(
        out / "e2e_ttft.png",
        "Time to first token (tiny Llama, CPU)",
        "ms",
        names,
        {
            f"{label[m]} {q}": [summary[m][n]["ttft_ms"][q] for n in names]
            for q in ("p50", "p90")
            for m in MODES
        },
    )
    throughput = plots.bars(
        out / "e2e_throughput.png",
        "Prompt tokens per second (one request at a time)",
        "tokens / s",
        names,
        {label[m]: [summary[m][n]["prompt_tokens_per_s"] for n in names] for m in MODES},
    )
    sources = ["device", "tierstore_cpu", "tierstore_disk", "computed"]
    hits = plots.stacked(
        out / "e2e_sources.png",
        "Where prompt tokens came from",
        "share of prompt tokens",
        ["\n".join([*n.split("_"), label[m]]) for n in names for m in MODES],
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
