"""``python -m tierstore.deploy.bench NAME --out DIR``: run a benchmark, write JSON and PNG plots.

Runs by hand (a private local Ray cluster) or as a Ray job against a running cluster:
``ray job submit -- python -m tierstore.deploy.bench e2e --out /abs/results``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from tierstore.deploy.bench.common import machine_info, private_clusters_on_loopback
from tierstore.deploy.quiet import add_log_arguments, logs_to_file

# name -> module under tierstore.deploy.bench; each has ``run(args) -> dict`` (JSON-able results)
# and may have ``plot(results, out_dir) -> list[Path]`` (PNG files it wrote).
BENCHMARKS: dict[str, str] = {
    "disk": "tierstore.deploy.bench.disk",
    "dataplane": "tierstore.deploy.bench.dataplane",
    "controlplane": "tierstore.deploy.bench.controlplane",
    "e2e": "tierstore.deploy.bench.e2e",
    "e2e_hits": "tierstore.deploy.bench.e2e_hits",
    "evictor": "tierstore.deploy.bench.evictor",
    "crossnode": "tierstore.deploy.bench.crossnode",
    "crossnode_hits": "tierstore.deploy.bench.crossnode_hits",
    "soak": "tierstore.deploy.bench.soak",
    "lookup": "tierstore.deploy.bench.lookup",
    "transport": "tierstore.deploy.bench.transport",
    "longdoc": "tierstore.deploy.bench.standard",
    "multiround": "tierstore.deploy.bench.standard",
    "router": "tierstore.deploy.bench.router",
}
# Benchmarks that run vLLM engines: their files are named NAME-MODEL.
_PER_MODEL = ("e2e", "e2e_hits", "crossnode_hits", "longdoc", "multiround")


def _run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    module = importlib.import_module(BENCHMARKS[name])
    if name == "disk":
        return module.run(args.out, args.disk_root, args.quick)
    if name == "dataplane":
        return module.run(args.quick)
    if name == "controlplane" and args.shards:
        return importlib.import_module("tierstore.deploy.bench.controlplane_scale").run(args)
    return module.run(args)


def _key_value(text: str) -> str:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def _numbers(text: str, least: int, what: str) -> list[int]:
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < least:
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
    return numbers


def _counts(text: str) -> list[int]:
    return _numbers(text, 1, "counts like 1,2")


def _cores(text: str) -> list[int]:
    return _numbers(text, 0, "core numbers like 0,1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark options, shared with ``tierstore bench``."""
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results"),
        help="output folder (use an absolute path under `ray job submit`: the job's "
        "working directory is a temporary copy)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--disk-root", type=Path, default=None, help="where to write (disk)")
    _add_engine_arguments(parser)
    _add_control_plane_arguments(parser)
    add_log_arguments(parser)  # default log file: OUT/NAME.log


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the benchmarks that run vLLM engines."""
    parser.add_argument(
        "--model",
        choices=["tiny", "0.1b"],
        default="tiny",
        help="e2e, e2e_hits, crossnode_hits, longdoc, multiround: the tiny 2-layer Llama or "
        "the 0.1 B one "
        "(real-model KV proportions)",
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        type=_key_value,
        help="e2e, e2e_hits, longdoc, multiround: a tierstore config key for the tierstore "
        "engine (repeatable), e.g. --set hits_from_picture=false; recorded in the JSON",
    )
    parser.add_argument(
        "--param",
        action="append",
        metavar="KEY=VALUE",
        type=_key_value,
        help="longdoc, multiround: a workload parameter (repeatable), e.g. --param qps=2; "
        "longdoc: num_prefixes (documents), prefix_len (their tokens), suffix_len (the "
        "question's), repeats; multiround: users, rounds, system_len, user_info_len, "
        "question_len, qps; recorded in the JSON's setup",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=None,
        help="e2e_hits, longdoc, multiround: engine runs per engine kind (2: forward then "
        "back, each kind's runs pooled; default 1)",
    )


def _add_control_plane_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the evictor and controlplane benchmarks."""
    parser.add_argument(
        "--index",
        choices=["both", "chunk", "compact"],
        default="both",
        help="evictor: which chunk index to measure (ChunkIndex, the compact one, or both)",
    )
    parser.add_argument(
        "--shards",
        type=_counts,
        default=None,
        metavar="S[,S...]",
        help="controlplane: Evictor shards to compare at cluster scale, e.g. 1,2 (without "
        "it, the scheduler-side control plane of one engine is measured)",
    )
    parser.add_argument(
        "--engines", type=int, default=32, help="controlplane --shards: simulated engines"
    )
    parser.add_argument(
        "--nodes", type=int, default=4, help="controlplane --shards: simulated nodes (raylets)"
    )
    parser.add_argument("--groups", type=int, default=3, help="controlplane --shards: KV groups")
    parser.add_argument("--tp", type=int, default=2, help="controlplane --shards: TP ranks")
    parser.add_argument(
        "--shard-cores",
        type=_cores,
        default=None,
        metavar="C[,C...]",
        help="controlplane --shards: bind shard i's process to core C[i] (a core of its own; "
        "run the benchmark itself on the other cores, e.g. under taskset)",
    )


def run_benchmark(args: argparse.Namespace) -> int:
    """Runs one benchmark with Ray's and vLLM's logs in a file (unless ``--verbose``);
    the results and the files written go to the terminal."""
    private_clusters_on_loopback()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.name}-{args.model}" if args.name in _PER_MODEL else args.name
    if args.name == "controlplane" and args.shards:
        stem = "controlplane-shards"
    log_path = None if args.verbose else args.log_file or args.out / f"{stem}.log"
    if log_path is not None:
        print(f"logs: {log_path.resolve()}", file=sys.stderr)
    with logs_to_file(log_path):
        before = machine_info()
        results = _run(args.name, args)
        results["machine"] = before | {"load_avg_1m_after": machine_info()["load_avg_1m"]}
        path = args.out / f"{stem}.json"
        path.write_text(json.dumps(results, indent=2))
        written = [path]
        module = BENCHMARKS[args.name]
        if args.name == "controlplane" and args.shards:
            module = "tierstore.deploy.bench.controlplane_scale"
        plot = getattr(importlib.import_module(module), "plot", None)
        if plot is not None:
            written += plot(results, args.out)
    print(json.dumps(results, indent=2))
    for file in written:
        print(f"wrote {file.resolve()}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierstore.deploy.bench")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
