"""The Evictor's index at scale: operations per second and memory per indexed chunk.

The plain :class:`ChunkIndex` is all of the Evictor's logic; it is measured at each size
in a fresh process (so the RSS delta is the index's own), and so is the compact index
(:class:`~tierstore.control.compact_index.CompactChunkIndex`: the same decisions from
flat arrays in C), also at 10^7 chunks, where ChunkIndex would need about 12 GB. The
shape is a realistic cache: 4 nodes, requests of 16 chained chunks, a CPU tier holding
half the chunks and a disk tier holding all of them (write-through, default watermarks).
Then one row goes through the real Evictor actor on a local Ray cluster, in batched
calls, so the cost of a Ray call per operation shows beside the index's own. And
admission of a TP group's chunks (ranks x KV cache groups shards per boundary), shard by
shard against one decision per boundary (``units``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from tierstore.deploy.bench import plots
from tierstore.deploy.bench.common import ray_session

from tierstore.control import compact_index
from tierstore.control.compact_index import CompactChunkIndex
from tierstore.control.index import ChunkIndex, LookupState, ShardOffer
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.wire import units_of

logger = logging.getLogger(__name__)

NS = Namespace("e71c")
NODES = [NodeId(f"bench-node-{i}") for i in range(4)]
CHAIN = 16  # chunks per request
LEASE_S = 30.0
# The indexes measured, by the name --index takes.
INDEXES: dict[str, type[ChunkIndex] | type[CompactChunkIndex]] = {
    "chunk": ChunkIndex,
    "compact": CompactChunkIndex,
}


KEY_BYTES = 12  # the bench's keys: an 8-byte block number and the 4-byte group
VLLM_KEY_BYTES = 36  # vLLM's: a 32-byte block hash and the group


def _key(i: int, key_bytes: int = KEY_BYTES) -> ChunkKey:
    return ChunkKey(i.to_bytes(key_bytes - 4, "big") + b"\0\0\0\0")


def _request(first: int, key_bytes: int = KEY_BYTES) -> list[ShardOffer]:
    """A request's chain of chunks, each 1 byte (capacities count chunks)."""
    return [
        ShardOffer(NS, _key(i, key_bytes), 0, 1, 1, _key(i - 1, key_bytes) if i > first else None)
        for i in range(first, first + CHAIN)
    ]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def _fill(
    index: ChunkIndex | CompactChunkIndex, first: int, n: int, now: float, key_bytes: int
) -> float:
    started = time.perf_counter()
    for r, start in enumerate(range(first, first + n, CHAIN)):
        index.admit(NODES[r % len(NODES)], _request(start, key_bytes), now)
    return time.perf_counter() - started


def _lookups(
    index: ChunkIndex | CompactChunkIndex,
    n: int,
    rng: random.Random,
    key_bytes: int,
    ops: dict[str, float],
) -> float:
    """Lookups of requests still in memory (the latest quarter), each leased and released
    as an engine does between its HIT and its load, asked from a node as an engine's are
    (HITs counted by place): their rates into ``ops``; the hit ratio returned."""
    lookups = min(n // 4, 200_000) // CHAIN
    starts = [rng.randrange(n - n // 4, n - CHAIN, CHAIN) for _ in range(lookups)]
    requests = [[_key(i, key_bytes) for i in range(start, start + CHAIN)] for start in starts]
    hits = 0
    looking = releasing = 0.0
    for keys in requests:
        started = time.perf_counter()
        answers, _ = index.lookup(NS, keys, "engine", 1.0, LEASE_S, NODES[0])
        looked = time.perf_counter()
        index.release(NS, keys, "engine")
        looking += looked - started
        releasing += time.perf_counter() - looked
        hits += sum(a.state is LookupState.HIT for a in answers)
    ops["lookup_lease"] = _rate(lookups * CHAIN, looking)  # a request's lookup call alone
    ops["lookup_lease_release"] = _rate(lookups * CHAIN, looking + releasing)
    return hits / max(1, lookups * CHAIN)


def bench_index(
    n: int, kind: str = "chunk", key_bytes: int = KEY_BYTES, seed: int = 0
) -> dict[str, Any]:
    """Every operation of the ``kind`` index at ``n`` indexed chunks of ``key_bytes``-byte
    keys (in a fresh process)."""
    rng = random.Random(seed)
    gc.collect()
    rss_before = _rss_bytes()
    index = INDEXES[kind]("lru")
    per_node = n // len(NODES)
    for node in NODES:
        index.register_node(node, cpu_bytes=per_node // 2, disk_bytes=per_node)
    ops: dict[str, float] = {}
    half = n // 2
    ops["admit"] = _rate(half, _fill(index, 0, half, 0.0, key_bytes))  # room in both tiers
    ops["admit_demote"] = _rate(n - half, _fill(index, half, n - half, 0.0, key_bytes))  # CPU full
    memory_per_chunk = (_rss_bytes() - rss_before) / len(index)
    arrays_per_chunk = (
        index.memory_bytes() / len(index) if isinstance(index, CompactChunkIndex) else None
    )

    hit_ratio = _lookups(index, n, rng, key_bytes, ops)

    # Under pressure: every chunk stored now demotes one and drops a disk-only tail.
    extra = min(n // 10, 100_000) // CHAIN * CHAIN
    evicted_before = index.stats.evicted_chunks
    ops["admit_evict"] = _rate(extra, _fill(index, n, extra, 2.0, key_bytes))
    evicted = index.stats.evicted_chunks - evicted_before

    chunks_before = len(index)
    started = time.perf_counter()
    index.forget_node(NODES[0])
    forget_s = time.perf_counter() - started
    ops["forget_node"] = _rate(chunks_before - len(index), forget_s)
    return {
        "index": kind,
        "chunks": n,
        "key_bytes": key_bytes,
        "ops_per_s": ops,
        "memory_bytes_per_chunk": memory_per_chunk,
        "array_bytes_per_chunk": arrays_per_chunk,  # compact: its arrays' capacity
        "lookup_hit_ratio": hit_ratio,
        "evicted_under_pressure": evicted,
        "forget_node_s": forget_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _tp_request(first: int, ranks: int, groups: int) -> list[ShardOffer]:
    """A request's chain as a TP group's NodeStore offers it: every boundary's chunk of
    each KV cache group, every rank's shard (1 byte each: capacities count shards)."""
    return [
        ShardOffer(NS, _group_key(i, g), r, ranks, 1, _group_key(i - 1, g) if i > first else None)
        for i in range(first, first + CHAIN)
        for g in range(groups)
        for r in range(ranks)
    ]


def _group_key(i: int, group: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + group.to_bytes(4, "big"))


def bench_units(boundaries: int, ranks: int, groups: int) -> dict[str, Any]:
    """Admission of ``boundaries`` token boundaries of ``ranks`` x ``groups`` shards each,
    in requests of :data:`CHAIN`, two ways on fresh indexes: ``admit`` decides shard by
    shard (what NodeStores sent before issue 28), ``admit_units`` one decision per
    boundary. Half fits the CPU tier; the rest demotes (write-through to disk)."""
    shards = boundaries * ranks * groups
    row: dict[str, Any] = {"boundaries": boundaries, "ranks": ranks, "groups": groups}
    for mode in ("admit", "admit_units"):
        index = ChunkIndex("lru")
        per_node = shards // len(NODES)
        for node in NODES:
            index.register_node(node, cpu_bytes=per_node // 2, disk_bytes=per_node)
        requests = [_tp_request(start, ranks, groups) for start in range(0, boundaries, CHAIN)]
        gc.collect()
        started = time.perf_counter()
        for r, offers in enumerate(requests):
            node = NODES[r % len(NODES)]
            if mode == "admit":
                index.admit(node, offers, 0.0)
            else:
                index.admit_units(node, units_of(offers), 0.0)
        seconds = time.perf_counter() - started
        row[mode] = {
            "shards_per_s": _rate(shards, seconds),
            "boundaries_per_s": _rate(boundaries, seconds),
            "decisions": index.stats.admitted_units,
            "stored_chunks": index.stats.stored_chunks,
        }
    row["speedup"] = row["admit_units"]["shards_per_s"] / row["admit"]["shards_per_s"]
    return row


# admit_units' units in the actor row: a TP=8 3-group hybrid model's (ranks, groups).
UNIT_SHAPE = (8, 3)
UNIT_SHARDS = UNIT_SHAPE[0] * UNIT_SHAPE[1]


def bench_actor(n: int, batch: int) -> dict[str, Any]:
    """The real Evictor actor on a local Ray cluster: admit, lookup (and, for a batch of
    at least :data:`UNIT_SHARDS`, admit_units, in shards) in calls of ``batch``."""
    import ray
    from tierstore.actors.bootstrap import get_or_create_evictor
    from tierstore.actors.clients import EvictorClient

    from tierstore.config import TierStoreConfig

    cfg = TierStoreConfig(
        cpu_bytes_per_node=4 * n, namespace="tierstore-bench-evictor", evictor_shards=1
    )  # one Evictor, called directly
    with ray_session(cfg.namespace):
        evictor = EvictorClient(get_or_create_evictor(cfg))
        node = ray.get_runtime_context().get_node_id()  # a real node: reconcile keeps it
        evictor.register_node(node, 8 * n, 0).result()  # room for every row's shards
        # 2n offers: n pipelined, then fresh ones one call at a time for the latency.
        offers = [o for start in range(0, 2 * n, CHAIN) for o in _request(start)]
        keys = [o.key for o in offers]
        # admit_units (a batch of 24 or more): a TP=8 3-group NodeStore's units of 24
        # shards (8 ranks x 3 KV cache groups of one boundary), as many whole units a
        # call as ``batch`` holds, 2n shards of other keys; rated in shards.
        per_call = batch // UNIT_SHARDS
        units = units_of(
            o
            for start in range(2 * n, 2 * n + 2 * n // UNIT_SHARDS, CHAIN)
            for o in _tp_request(start, *UNIT_SHAPE)
        )
        rows: list[tuple[str, int, Any]] = [
            ("admit", batch, lambda i: evictor.admit(node, offers[i : i + batch])),
            ("lookup_lease", batch, lambda i: evictor.lookup(NS, keys[i : i + batch], "b", 30.0)),
        ]
        if per_call:
            rows.append(
                (
                    "admit_units",
                    per_call * UNIT_SHARDS,
                    lambda i: evictor.admit_units(
                        node, units[i // batch * per_call : (i // batch + 1) * per_call]
                    ),
                )
            )
        results: dict[str, Any] = {"chunks": n, "batch": batch}
        for name, size, call in rows:
            started = time.perf_counter()
            sent = [call(i) for i in range(0, n, batch)]  # pipelined, as batches arrive
            for pending in sent:
                pending.result()
            pipelined = time.perf_counter() - started
            calls = min(200, n // batch)
            started = time.perf_counter()
            for i in range(n, n + calls * batch, batch):  # one at a time: what a caller waits
                call(i).result()
            latency = (time.perf_counter() - started) / calls
            results[name] = {
                "ops_per_s": _rate(len(sent) * size, pipelined),
                "call_ms": 1e3 * latency,
            }
        return results


def _in_fresh_process(fn: Any, *args: Any) -> Any:
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    rows = [
        r
        for r in results.get("index") or results["compact_index"]
        if r.get("key_bytes", KEY_BYTES) == KEY_BYTES
    ]
    sizes = [r["chunks"] for r in rows]
    series = {op: [r["ops_per_s"][op] for r in rows] for op in rows[0]["ops_per_s"]}
    compact = [
        r
        for r in results.get("compact_index", [])
        if r["chunks"] in sizes and r["key_bytes"] == KEY_BYTES
    ]
    if "index" in results and compact:
        for op in compact[0]["ops_per_s"]:
            series[f"compact {op}"] = [r["ops_per_s"][op] for r in compact]
    for row in results["actor"]:  # flat: the actor row is measured at one size
        for op in ("admit", "lookup_lease", "admit_units"):
            if op in row:  # admit_units: batches of whole units only
                series[f"Evictor actor {op}, {row['batch']}/call"] = [row[op]["ops_per_s"]] * len(
                    rows
                )
    return [
        plots.lines(
            out / "evictor_ops.png",
            "Evictor index: chunk operations per second",
            "indexed chunks",
            "chunk ops / s",
            sizes,
            series,
            logx=True,
            logy=True,
        ),
        plots.lines(
            out / "evictor_memory.png",
            "Evictor index: memory per indexed chunk (RSS delta)",
            "indexed chunks",
            "bytes / chunk",
            sizes,
            {
                "ChunkIndex" if "index" in results else "compact": [
                    r["memory_bytes_per_chunk"] for r in rows
                ],
                **(
                    {"compact": [r["memory_bytes_per_chunk"] for r in compact]}
                    if "index" in results and len(compact) == len(rows)
                    else {}
                ),
            },
            logx=True,
        ),
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both indexes (or the one ``--index`` names) at each size, then the actor's rows."""
    sizes = [10**3, 10**4] if args.quick else [10**4, 10**5, 10**6]
    kinds = ["chunk", "compact"] if getattr(args, "index", "both") == "both" else [args.index]
    if "compact" in kinds and not compact_index.available():
        logger.warning("the compact index's C extension is not built: measuring ChunkIndex only")
        kinds.remove("compact")
    results: dict[str, Any] = {"shape": {"nodes": len(NODES), "chunks_per_request": CHAIN}}
    for kind in kinds:
        # The compact index also at 10^7 chunks (ChunkIndex would need ~12 GB there).
        extra = [10**5] if args.quick else [10**7]
        rows = results["index" if kind == "chunk" else "compact_index"] = []
        for n in sizes + (extra if kind == "compact" else []):
            logger.info("%s index at %d chunks", kind, n)
            rows.append(_in_fresh_process(bench_index, n, kind))
        if kind == "compact":  # and with vLLM's key size at the largest
            rows.append(_in_fresh_process(bench_index, extra[0], kind, VLLM_KEY_BYTES))
    if "chunk" in kinds and "compact" in kinds:
        results["compact_vs_chunk"] = _ratios(results["index"], results["compact_index"])
    boundaries = 2 * 10**3 if args.quick else 5 * 10**4
    results["units"] = [
        _in_fresh_process(bench_units, boundaries, ranks, groups)
        for ranks, groups in ((1, 1), (8, 3))
    ]
    actor_n = 10**3 if args.quick else 10**4
    results["actor"] = [
        _in_fresh_process(bench_actor, actor_n, batch) for batch in (1000, 16 if args.quick else 1)
    ]
    return results


def _ratios(chunk: list[dict[str, Any]], compact: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size both measured at: the compact index's rate over ChunkIndex's, and memory."""
    by_size = {row["chunks"]: row for row in compact if row["key_bytes"] == KEY_BYTES}
    return [
        {
            "chunks": row["chunks"],
            "ops_speedup": {
                op: by_size[row["chunks"]]["ops_per_s"][op] / rate
                for op, rate in row["ops_per_s"].items()
            },
            "memory_ratio": by_size[row["chunks"]]["memory_bytes_per_chunk"]
            / row["memory_bytes_per_chunk"],
        }
        for row in chunk
        if row["chunks"] in by_size
    ]
