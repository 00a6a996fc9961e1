"""The ``tierstore`` command: up, down, status, demo, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from deploy.bench.__main__ import add_arguments as add_bench_arguments
from deploy.bench.__main__ import run_benchmark
from tierstore.config import DEFAULT_NAMESPACE, TierStoreConfig, parse_bytes
from tierstore.errors import TierStoreError

logger = logging.getLogger("tierstore.cli")


def _connect(address: str | None, namespace: str) -> None:
    import ray

    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(
            address=target, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING
        )
    except ConnectionError as exc:
        raise SystemExit(
            f"no Ray cluster at {target}: start one with `ray start --head` or pass --address "
            f"({exc})"
        ) from exc


def collect_status(namespace: str) -> dict[str, Any]:
    """Per node and tier: used and capacity bytes and chunks; cluster totals."""
    import ray

    from actors.placement import EVICTOR_NAME, node_store_name

    try:
        evictor = ray.get_actor(EVICTOR_NAME, namespace=namespace)
    except ValueError as exc:
        raise TierStoreError(
            f"no tierstore actors in namespace {namespace!r}: run `tierstore up` first"
        ) from exc
    evictor_status = ray.get(evictor.status.remote())
    nodes = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        try:
            store = ray.get_actor(node_store_name(node["NodeID"]), namespace=namespace)
        except ValueError:
            continue
        nodes.append(ray.get(store.status.remote()))
    stats = evictor_status["totals"]
    # Corruption is detected where the bytes are: sum what each NodeStore found,
    # including files it rejected while re-indexing its disk at start-up.
    for counter in ("corrupt_before_hit", "corrupt_after_hit"):
        stats[counter] = sum(node["stats"][counter] for node in nodes)
    return {
        "nodes": nodes,
        "totals": {
            "stored_chunks": stats["stored_chunks"],
            "loaded_chunks": stats["loaded_chunks"],
            "hits": stats["hits"],
            "misses": stats["misses"],
            "evicted_chunks": stats["evicted_chunks"],
            "demoted_shards": stats["demoted_shards"],
            "promoted_shards": stats["promoted_shards"],
            "skipped_stores": stats["skipped_stores"],
            "corrupt_before_hit": stats["corrupt_before_hit"],
            "corrupt_after_hit": stats["corrupt_after_hit"],
            "indexed_chunks": evictor_status["chunks"],
        },
    }


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_status(status: dict[str, Any]) -> str:
    lines = [f"{'node':<14} {'tier':<5} {'used':>11} {'capacity':>11} {'chunks':>7}"]
    for node in status["nodes"]:
        for tier in ("cpu", "disk"):
            t = node[tier]
            lines.append(
                f"{node['node_id'][:12]:<14} {tier:<5} {_fmt_bytes(t['used_bytes']):>11} "
                f"{_fmt_bytes(t['capacity_bytes']):>11} {t['chunks']:>7}"
            )
    totals = status["totals"]
    lookups = totals["hits"] + totals["misses"]
    hit_rate = f"{100 * totals['hits'] / lookups:.1f} %" if lookups else "n/a"
    lines.append("")
    lines.append(
        f"stored chunks {totals['stored_chunks']}, loaded chunks {totals['loaded_chunks']}, "
        f"hits {totals['hits']}, misses {totals['misses']} (hit rate {hit_rate})"
    )
    lines.append(
        f"evicted {totals['evicted_chunks']}, demoted {totals['demoted_shards']}, promoted "
        f"{totals['promoted_shards']}, skipped stores {totals['skipped_stores']}, corrupt "
        f"{totals['corrupt_before_hit']} before HIT / {totals['corrupt_after_hit']} after"
    )
    return "\n".join(lines)


def cmd_up(args: argparse.Namespace) -> int:
    from actors.bootstrap import ensure_actors

    cfg = TierStoreConfig(
        cpu_bytes_per_node=parse_bytes("--cpu-bytes-per-node", args.cpu_bytes_per_node),
        namespace=args.namespace,
        ray_address=args.address,
        disk_path=args.disk_path,
        disk_bytes_per_node=parse_bytes("--disk-bytes-per-node", args.disk_bytes_per_node),
        disk_fsync=args.disk_fsync,
        eviction_policy=args.eviction_policy,
    )
    _connect(args.address, cfg.namespace)
    ensure_actors(cfg)
    print(format_status(collect_status(cfg.namespace)))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from actors.bootstrap import shutdown_actors

    _connect(args.address, args.namespace)
    print(f"stopped {shutdown_actors(args.namespace)} tierstore actor(s)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _connect(args.address, args.namespace)
    status = collect_status(args.namespace)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from deploy.demo import DEMO_NAMESPACE, format_table, run_demo

    rows = run_demo()
    print()
    print(format_table(rows))
    print()
    print(format_status(collect_status(DEMO_NAMESPACE)))
    return 0 if all(r["same_tokens"] for r in rows) else 1


def cmd_bench(args: argparse.Namespace) -> int:
    return run_benchmark(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def cluster_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--address", default=None, help="Ray cluster (default: RAY_ADDRESS, then auto)"
        )
        p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Ray namespace of the actors")

    up = sub.add_parser("up", help="start or find the actors on a running Ray cluster")
    cluster_args(up)
    up.add_argument(
        "--cpu-bytes-per-node", required=True, help="CPU tier bytes per node, e.g. 8GiB"
    )
    up.add_argument("--disk-path", default=None, help="disk tier directory on every node")
    up.add_argument("--disk-bytes-per-node", default="0", help="disk tier bytes per node; 0 = none")
    up.add_argument("--disk-fsync", action="store_true", help="fsync every chunk file")
    up.add_argument("--eviction-policy", default="lru", choices=["lru", "arc"])
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the actors (the chunks they hold are dropped)")
    cluster_args(down)
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="per node and tier: bytes, chunks, hits")
    cluster_args(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="local Ray + tiny Gemma 3 model, served twice")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="run a benchmark (JSON and PNG plots into --out)")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TierStoreError, ValueError) as exc:
        print(f"tierstore: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
