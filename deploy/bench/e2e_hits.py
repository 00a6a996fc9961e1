"""The hit pass against the reference restore, and where a hit's extra time goes.

``python -m tierstore.deploy.bench.e2e_hits --model tiny --out results/``: two engines of
the e2e benchmark (``e2e.py``: same model, settings and OpenMP binding, recorded), the
in-process reference restore and tierstore, each in a process of its own. Each stores
``count`` unique prompts (the store pass, drained), empties its device prefix cache, then
sends the same prompts again one at a time: the hit pass, every request loading all its
full chunks. tierstore's CPU tier holds every prompt, so every hit is a memory hit (disk
hits are the e2e benchmark's). Reported: the hit pass's time and hit TTFT against the
reference's (``targets``), and per engine the breakdown of a hit's time
(``e2e.breakdown``: queued to scheduled, lookups, the load's copy and its completion,
the scheduler's wait), and tierstore's extra ms per request in each
(``extra_ms_vs_reference``). With ``--passes 2`` the engines run reference, tierstore,
tierstore, reference, each engine's figures pooled.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from tierstore.deploy.bench.common import machine_info
from tierstore.deploy.bench.e2e import (
    NAMESPACE,
    EngineRuns,
    breakdown_vs,
    pooled,
    run_order,
    summarize,
)
from tierstore.deploy.bench.e2e_setups import MODELS, setup_for

logger = logging.getLogger(__name__)

MODES = ("reference", "tierstore")
# Prompts per hit pass (1,088 tokens: 34 chunks each), and a CPU tier that holds them all.
HIT_PASS = {
    "tiny": {"count": 24, "length": 1088, "cpu_bytes": 64 << 20},  # 34 x 32 KiB each
    "0.1b": {"count": 8, "length": 1088, "cpu_bytes": 64 << 20},  # 34 x 128 KiB each
}


def setup(model: str, count: int | None = None) -> dict[str, Any]:
    base = setup_for(model, quick=False)
    hits = HIT_PASS[model]
    params = {"count": count or hits["count"], "length": hits["length"]}
    return {
        **base,
        "cpu_bytes": hits["cpu_bytes"],
        "workloads": {"hit_pass": {"kind": "hit_pass", "params": params}},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    choice = args.model
    passes = getattr(args, "passes", None) or 1
    plan_setup = setup(choice, getattr(args, "count", None))
    engines = EngineRuns.prepare(args, choice, "e2e-hits")
    binding, overrides = engines.binding, engines.overrides
    order = run_order(passes, MODES)
    _, runs = engines.run(plan_setup, order, None, f"{NAMESPACE}-hits")
    summary = {mode: summarize(pooled(runs[mode])["hit_pass"]) for mode in MODES}
    ts, ref = summary["tierstore"], summary["reference"]
    return {
        "model": choice,
        "omp_threads_bind": binding,
        "tierstore_overrides": overrides,
        "engine_runs": [f"{mode}-{n}" for mode, n in order],
        "setup": dict(plan_setup) | {"model": MODELS[choice]},
        "machine": machine_info(),
        "targets": {
            "hit_pass_time_vs_reference": ts["wall_s"] / ref["wall_s"],
            "hit_ttft_p50_vs_reference": ts["hit_ttft_ms"]["p50"] / ref["hit_ttft_ms"]["p50"],
            "hit_ttft_mean_vs_reference": ts["hit_ttft_ms"]["mean"] / ref["hit_ttft_ms"]["mean"],
        },
        "extra_ms_vs_reference": breakdown_vs(ts["breakdown_ms"], ref["breakdown_ms"]),
        "summary": summary,
        "raw_runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--passes", type=int, default=1, help="engine runs per mode")
    parser.add_argument("--count", type=int, default=None, help="prompts in the hit pass")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="tierstore key")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args)
    path = args.out / f"e2e-hits-{args.model}.json"
    path.write_text(json.dumps(results, indent=1))
    brief = {k: results[k] for k in ("omp_threads_bind", "targets", "extra_ms_vs_reference")}
    brief["breakdown_ms"] = {m: results["summary"][m]["breakdown_ms"] for m in MODES}
    print(json.dumps(brief, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
