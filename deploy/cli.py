"""The ``tierstore`` command: up, down, status, demo, bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import typing
from typing import TYPE_CHECKING, Any

from tierstore.deploy.bench.__main__ import add_arguments as add_bench_arguments
from tierstore.deploy.bench.__main__ import run_benchmark
from tierstore.deploy.quiet import add_log_arguments

from tierstore.config import DEFAULT_NAMESPACE, TierStoreConfig
from tierstore.errors import ConfigError, RemoteCallTimeout, TierStoreError

if TYPE_CHECKING:
    from tierstore.actors.calls import Pending

logger = logging.getLogger("tierstore.cli")


# A status answer is immediate; one that takes longer means the actor is stuck or
# restarting, and `tierstore status` should say so rather than hang.
_STATUS_TIMEOUT_S = 30.0


def _connect(address: str | None, namespace: str) -> None:
    import ray
    from tierstore.actors.bootstrap import check_reachable, not_joined

    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    check_reachable(target)
    try:
        ray.init(
            address=target, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING
        )
    except ConnectionError as exc:
        raise SystemExit(not_joined(target, exc)) from exc


def collect_status(namespace: str) -> dict[str, Any]:
    """Per node and tier: used and capacity bytes and chunks (the NodeStores'); cluster
    totals (the Evictor shards' counters summed); the number of Evictor shards the actors
    run with (``evictor_shards``, resolved if the config said ``"auto"``); per Evictor
    shard, its share of the nodes' tiers and its chunks (``shards``). A shard that does
    not answer is listed with its error and left out of the totals; if none answers, its
    error is raised."""
    shards, answered = _evictor_statuses(namespace)
    nodes = _node_statuses(namespace)
    stats: dict[str, int] = {}
    for answer in answered:
        for counter, value in answer["totals"].items():
            stats[counter] = stats.get(counter, 0) + value
    # Corruption is detected where the bytes are. Neither count is whole: the NodeStores
    # alive now include files rejected while re-indexing their disks (never reported to
    # the Evictor) but not what a NodeStore that since restarted found; the Evictor's
    # total keeps those. Report the larger, a lower bound on what was detected. Failed
    # disk writes likewise: the NodeStores' reports of the last ones may be on their way.
    for counter in ("corrupt_before_hit", "corrupt_after_hit", "disk_write_failures"):
        found_by_nodes = sum(node["stats"].get(counter, 0) for node in nodes)
        stats[counter] = max(stats.get(counter, 0), found_by_nodes)
    indexed = sum(answer["chunks"] for answer in answered)
    return {
        "nodes": nodes,
        "totals": {**stats, "indexed_chunks": indexed},
        "evictor_shards": answered[0]["shards"],
        "shards": shards,
    }


def _evictor_statuses(namespace: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every Evictor shard's line of ``shards`` (its chunks and tier sums, or its error),
    and the status of those that answered; asked all at once."""
    import ray
    from tierstore.actors.bootstrap import running_evictor_names
    from tierstore.actors.clients import EvictorClient

    names = running_evictor_names(namespace)
    if not names:
        raise TierStoreError(
            f"no tierstore actors in namespace {namespace!r}: run `tierstore up` first"
        )
    asked = [EvictorClient(ray.get_actor(name, namespace=namespace)).status() for name in names]
    shards, answered = [], []
    for shard, pending in enumerate(asked):
        try:
            answer = pending.result(_STATUS_TIMEOUT_S)
        except TierStoreError as exc:
            if len(asked) == 1:
                raise
            shards.append({"shard": shard, "error": str(exc)})
            continue
        answered.append(answer)
        shards.append({"shard": shard, "chunks": answer["chunks"], **_tier_sums(answer)})
    if not answered:
        raise TierStoreError(f"no Evictor shard answered: {shards[0]['error']}")
    return shards, answered


def _node_statuses(namespace: str) -> list[dict[str, Any]]:
    """The status of the NodeStore of every alive node that has one."""
    import ray
    from tierstore.actors.clients import NodeStoreClient
    from tierstore.actors.placement import node_store_name

    nodes = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        try:
            store = ray.get_actor(node_store_name(node["NodeID"]), namespace=namespace)
        except ValueError:
            continue
        nodes.append(NodeStoreClient(store, node["NodeID"]).status().result(_STATUS_TIMEOUT_S))
    return nodes


def _tier_sums(evictor_status: dict[str, Any]) -> dict[str, dict[str, int]]:
    """An Evictor shard's share of every node's tiers, summed per tier over the nodes."""
    sums = {tier: {"used_bytes": 0, "capacity_bytes": 0, "chunks": 0} for tier in ("cpu", "disk")}
    for tiers in evictor_status["nodes"].values():
        for tier, counts in tiers.items():
            for name, value in counts.items():
                sums[tier][name] += value
    return sums


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _rate(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "n/a"


def _disk_note(node: dict[str, Any]) -> str:
    """The end of a node's disk row: a degraded disk tier (a write failed: the shards stay
    in memory only until a retry), and its failed and skipped writes."""
    stats, disk = node["stats"], node["disk"]
    failed, skipped = stats.get("disk_write_failures", 0), stats.get("disk_writes_skipped", 0)
    counts = f"writes: {failed} failed, {skipped} skipped" if failed or skipped else ""
    if not disk.get("degraded"):
        return f" {counts}" if counts else ""
    return (
        f" DEGRADED for {disk['degraded_s']:.0f} s: {disk['error']}; retry in "
        f"{disk['retry_in_s']:.0f} s; {counts}"
    )


def format_status(status: dict[str, Any]) -> str:
    """Per node and tier: occupancy; per node: what it stored, served and found corrupt,
    and a disk tier degraded by failed writes; how many Evictor shards run, and with
    several, a line each."""
    header = (
        f"{'node':<13} {'tier':<4} {'used':>10} {'capacity':>10} {'chunks':>7} "
        f"{'stores':>7} {'loads':>7} {'corrupt':>7}"
    )
    lines = [header, "-" * len(header)]
    for node in status["nodes"]:
        stats = node["stats"]
        corrupt = sum(v for k, v in stats.items() if k.startswith("corrupt"))
        per_node = f"{stats['stored_shards']:>7} {stats['loaded_shards']:>7} {corrupt:>7}"
        for tier in ("cpu", "disk"):
            t = node[tier]
            lines.append(
                f"{node['node_id'][:12] if tier == 'cpu' else '':<13} {tier:<4} "
                f"{_fmt_bytes(t['used_bytes']):>10} {_fmt_bytes(t['capacity_bytes']):>10} "
                f"{t['chunks']:>7}" + (f" {per_node}" if tier == "cpu" else _disk_note(node))
            )
    totals = status["totals"]
    lookups = totals["hits"] + totals["misses"]
    lines.append("")
    lines.append(
        f"hit rate {_rate(totals['hits'], lookups)} ({totals['hits']} hits, "
        f"{totals['misses']} misses; {totals['promoted_shards']} shards promoted from disk "
        f"first); stored {totals['stored_chunks']}, loaded {totals['loaded_chunks']}, "
        f"indexed {totals['indexed_chunks']} chunks"
    )
    lines.append(
        f"evicted {totals['evicted_chunks']}, demoted {totals['demoted_shards']}, copied to "
        f"a hot chunk's loading node {totals['replicated_chunks']}, skipped "
        f"stores {totals['skipped_stores']}, failed stores {totals['failed_stores']}, corrupt "
        f"{totals['corrupt_before_hit']} before HIT (became misses) / "
        f"{totals['corrupt_after_hit']} after HIT, disk writes failed "
        f"{totals.get('disk_write_failures', 0)}"
    )
    if "evictor_shards" in status:
        lines.append(f"evictor shards: {status['evictor_shards']}")
    return "\n".join(lines + _shard_lines(status.get("shards", [])))


def _shard_lines(shards: list[dict[str, Any]]) -> list[str]:
    """One line per Evictor shard (none when there is one): its chunks and its share
    of the nodes' tiers, or why it did not answer."""
    if len(shards) < 2:
        return []
    lines = []
    for shard in shards:
        if "error" in shard:
            lines.append(f"evictor shard {shard['shard']}: no answer ({shard['error']})")
            continue
        cpu, disk = shard["cpu"], shard["disk"]
        lines.append(
            f"evictor shard {shard['shard']}: indexed {shard['chunks']} chunks; cpu "
            f"{_fmt_bytes(cpu['used_bytes'])} of {_fmt_bytes(cpu['capacity_bytes'])}, disk "
            f"{_fmt_bytes(disk['used_bytes'])} of {_fmt_bytes(disk['capacity_bytes'])}"
        )
    return lines


# `tierstore up` takes one flag per config key; these come from the cluster arguments.
_CLUSTER_KEYS = ("namespace", "ray_address")


def _config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--key`` per TierStoreConfig field, parsed by the same validation as the
    engine's ``kv_connector_extra_config``; see the README's reference table."""
    for field in dataclasses.fields(TierStoreConfig):
        if field.name in _CLUSTER_KEYS:
            continue
        is_bool = field.type in ("bool", bool)
        required = field.default is dataclasses.MISSING
        parser.add_argument(
            _flag_of(field.name),
            dest=field.name,
            default=None,
            required=required,
            nargs="?" if is_bool else None,
            const="true" if is_bool else None,
            help=f"config key {field.name} (required), e.g. 8GiB"
            if required
            else f"config key {field.name} (default {field.default!r})",
        )


def _flag_of(key: str) -> str:
    return "--" + key.replace("_", "-")


def _takes_int(key: str) -> bool:
    """Whether config key ``key`` takes an int, alone or beside other forms (``"auto"``)."""
    hint = typing.get_type_hints(TierStoreConfig)[key]
    return hint is int or int in typing.get_args(hint)


def _config_from_flags(args: argparse.Namespace) -> TierStoreConfig:
    given: dict[str, Any] = {"namespace": args.namespace, "ray_address": args.address}
    for field in dataclasses.fields(TierStoreConfig):
        value = getattr(args, field.name, None)
        if field.name in _CLUSTER_KEYS or value is None:
            continue
        if _takes_int(field.name) and value.isascii() and value.isdigit():
            value = int(value)  # other forms ("8GiB", "auto") are parsed by the config
        elif field.type in ("float", float):
            try:
                if not value.isascii():  # float() takes other scripts' digits too
                    raise ValueError(value)
                value = float(value)
            except ValueError:
                raise ConfigError(
                    f"{_flag_of(field.name)}: expected a number, got {value!r}"
                ) from None
        given[field.name] = value
    return TierStoreConfig.from_extra_config(given)


def _wait_with_progress(
    cfg: TierStoreConfig, started: list[Pending[TierStoreConfig]], what: str, timeout_s: float
) -> None:
    """Wait for :func:`~tierstore.actors.bootstrap.start_actors`' calls, all within
    ``timeout_s``, with a progress bar on a terminal. Raises an actor's start-up error,
    its :class:`~tierstore.config.ConfigMismatchError`, or, past the deadline,
    :class:`~tierstore.errors.RemoteCallTimeout` naming the actors that never answered."""
    import ray
    from tierstore.actors.bootstrap import check_started
    from tqdm import tqdm

    by_ref = {call.ref: call for call in started}
    deadline = time.monotonic() + timeout_s
    with tqdm(total=len(started), desc=what, unit="actor", disable=not sys.stderr.isatty()) as bar:
        pending = list(by_ref)
        while pending:
            left = deadline - time.monotonic()
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, left))
            if not done:
                late = ", ".join(by_ref[ref].what for ref in pending)
                raise RemoteCallTimeout(
                    f"{what}: no answer within {timeout_s:g} s from {late}; see "
                    "`ray status` and the actors' logs (Ray dashboard or `ray logs`)"
                )
            for ref in done:
                check_started(cfg, by_ref[ref], timeout_s=0.0)  # answered: never waits
            bar.update(len(done))


def cmd_up(args: argparse.Namespace) -> int:
    from tierstore.actors.bootstrap import START_TIMEOUT_S, start_actors

    cfg = _config_from_flags(args)
    _connect(args.address, cfg.namespace)
    _wait_with_progress(cfg, start_actors(cfg), "starting tierstore actors", START_TIMEOUT_S)
    print(format_status(collect_status(cfg.namespace)))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from tierstore.actors.bootstrap import shutdown_actors

    _connect(args.address, args.namespace)
    print(f"stopped {shutdown_actors(args.namespace)} tierstore actor(s)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _connect(args.address, args.namespace)
    status = collect_status(args.namespace)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tierstore.deploy.demo import format_table, run_demo
    from tierstore.deploy.quiet import default_log_path, logs_to_file

    log_path = None if args.verbose else args.log_file or default_log_path("demo")
    if log_path is not None:
        print(f"vLLM and Ray logs: {log_path}", file=sys.stderr)
    print("starting local Ray and a vLLM engine (about a minute)", file=sys.stderr)
    with logs_to_file(log_path) as terminal:
        result = run_demo(progress_file=terminal.err)
    print()
    print(format_table(result.rows))
    print()
    print(format_status(result.status))
    return 0 if all(r["same_tokens"] for r in result.rows) else 1


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
    _config_flags(up)
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the actors (the chunks they hold are dropped)")
    cluster_args(down)
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="per node and tier: bytes, chunks, hits")
    cluster_args(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="local Ray + tiny Gemma 3 model, served twice")
    add_log_arguments(demo)
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
