"""The control plane at cluster scale: ``tierstore bench controlplane --shards 1,2``.

Real Evictor shards (``evictor_shards`` = S) on a simulated cluster (``--nodes``
raylets of ``ray.cluster_utils`` on this machine, each with its real NodeStore), driven
by ``--engines`` simulated engines. The engines do what a scheduler and a NodeStore ask
of the Evictors, and nothing else: no bytes move.

The trace is multi-turn chat with shared prefixes: each conversation starts from one of
``SYSTEM_PROMPTS`` system prompts (``SYSTEM_CHUNKS`` chunks) and grows by
``TURN_CHUNKS`` chunks a turn for up to ``TURNS`` turns; then a new one starts. Each
chunk has ``--groups`` KV cache groups and ``--tp`` ranks (36-byte keys, as vLLM's).
Each engine runs one request at a time, as three calls to the shard of the request's
root: its lookup of every key (with leases), the admission of its new chunks as a
NodeStore offers them (one unit per token boundary: every group and rank), and a one-way
release of its hits. The trace's arguments are built before the run (and sent by
value), so the driver's share of a call is sending it (the engines' and NodeStores' own work is
not what is measured; ``driver_cpu_share`` says what it cost).

The CPU tiers hold a fraction of the working set, so admits evict once warm. Reported
per S: lookup keys/s, admitted shards and offered units/s, lookup call p50/p99, each
shard's memory per indexed chunk (its index's bytes over its chunk count; its process's
RSS growth per chunk beside it) and CPU share, and messages per operation. No shard ever
calls another (an Evictor has no client of another), and a request's three calls go to
one shard.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tierstore.deploy.bench.common import percentile

from tierstore.config import TierStoreConfig
from tierstore.keys import ChunkKey, Namespace, NodeId, root_of, shard_of
from tierstore.wire import LookupState, ShardOffer, UnitOffer, units_of

T = TypeVar("T")

SYSTEM_PROMPTS = 64
SYSTEM_CHUNKS = 32  # 512 tokens in 16-token chunks
TURN_CHUNKS = 16
TURNS = 6  # the last turn's prompt: 112 chunks, 1,792 tokens
CHUNK_BYTES = 4096  # the index only accounts bytes: none exist
WORKING_SET_SHARE = 4  # the working set is this many times what the CPU tiers hold
_LEASE_TTL_S = 30.0
_BENCH_NAMESPACE = "tierstore-bench-controlplane"


@dataclass(frozen=True)
class Shape:
    engines: int
    nodes: int
    groups: int
    tp: int
    seconds: float
    warmup_s: float


def _chunk_key(parent: bytes, token_block: int, group: int) -> ChunkKey:
    """A 36-byte key: a 32-byte chained hash and the 4-byte group index."""
    digest = hashlib.blake2b(parent + token_block.to_bytes(8, "big"), digest_size=32).digest()
    return ChunkKey(digest + group.to_bytes(4, "big"))


class Conversation:
    """One chat: a system prompt, then turns; the keys of its prompt so far per group."""

    def __init__(self, rng: random.Random, groups: int) -> None:
        self.system = rng.randrange(SYSTEM_PROMPTS)
        self.turn = 0
        self._rng = rng
        self._groups = groups
        self._blocks = [1_000_000 * self.system + i for i in range(SYSTEM_CHUNKS)]

    def next_prompt(self) -> list[int] | None:
        """The token blocks of the next turn's prompt, or None when the chat is over."""
        if self.turn >= TURNS:
            return None
        if self.turn:
            self._blocks += [self._rng.getrandbits(62) for _ in range(TURN_CHUNKS)]
        self.turn += 1
        return list(self._blocks)


def chain_keys(blocks: list[int], groups: int) -> list[list[ChunkKey]]:
    """Per chunk, its key of each group (the chain is shared: the group is a suffix)."""
    keys = []
    parent = b""
    for block in blocks:
        per_group = [_chunk_key(parent, block, g) for g in range(groups)]
        keys.append(per_group)
        parent = per_group[0][:-4]
    return keys


@dataclass(frozen=True)
class Request:
    """One request of the trace, its arguments built beforehand (so the driver's share
    of a call is sending it). They are sent by value, as a scheduler and a NodeStore
    send theirs: a shard on another node than the driver would otherwise pull each from
    the driver's object store, through two raylets."""

    shard: int
    keys: list[ChunkKey]  # every group's, in chain order
    units: list[UnitOffer] | None  # the unit offers of its new chunks (None: none new)

    @property
    def n_keys(self) -> int:
        return len(self.keys)

    @property
    def n_units(self) -> int:
        return len(self.units or ())


Trace = list[tuple[int, list[ChunkKey], list[UnitOffer]]]  # (root, keys, new units)


def engine_trace(engine: int, shape: Shape, count: int) -> Trace:
    """An engine's ``count`` requests: (root, keys, units of its new chunks). A turn's new
    chunks are those it adds; a conversation's system prompt is new to the engine the
    first time it uses it (engines share system prompts: the others' offers of it find it
    indexed, or admit it again where it was evicted)."""
    rng = random.Random(engine)
    seen_systems: set[int] = set()
    trace: Trace = []
    chat = Conversation(rng, shape.groups)
    while len(trace) < count:
        blocks = chat.next_prompt()
        if blocks is None:
            chat = Conversation(rng, shape.groups)
            continue
        keys = chain_keys(blocks, shape.groups)
        root = root_of(NS, keys[0][0])
        if chat.turn == 1:
            new_from = SYSTEM_CHUNKS if chat.system in seen_systems else 0
            seen_systems.add(chat.system)
        else:
            new_from = len(keys) - TURN_CHUNKS
        offers = [
            ShardOffer(NS, key, rank, shape.tp, CHUNK_BYTES, parent, root)
            for i in range(new_from, len(keys))
            for g, key in enumerate(keys[i])
            for parent in [keys[i - 1][g] if i else None]
            for rank in range(shape.tp)
        ]
        trace.append((root, [k for per_group in keys for k in per_group], units_of(offers)))
    return trace


@dataclass
class Counts:
    lookup_keys: int = 0
    lookup_calls: int = 0
    hits: int = 0
    admit_calls: int = 0
    offered_units: int = 0
    admitted_shards: int = 0
    release_calls: int = 0
    lookup_ms: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Driver:
    """Engine threads on this process, each a request at a time: its lookup (one call
    to its root's shard), its new chunks' admission as its node's NodeStore would offer
    them (one call, to the same shard: a request's units share its root), and a
    one-way release of its hits. Every argument was built before the run."""

    def __init__(
        self, shape: Shape, clients: list[Any], nodes: list[NodeId], traces: list[list[Request]]
    ) -> None:
        self._shape = shape
        self._clients = clients
        self._nodes = nodes
        self._traces = traces
        self.counts = Counts()
        self._measuring = threading.Event()
        self._stop = threading.Event()
        self.cpu_s = 0.0  # this process's CPU seconds while measuring
        self.cycled = 0  # engines that ran through their trace and started it again

    def run(self, sample: Callable[[], T]) -> tuple[float, T, T]:
        """Warm up, then measure for ``shape.seconds``; ``sample()`` is taken as the
        measurement starts and ends (the shards' usage). Returns the seconds measured
        and both samples."""
        threads = [
            threading.Thread(target=self._engine, args=(e,), daemon=True)
            for e in range(self._shape.engines)
        ]
        for thread in threads:
            thread.start()
        time.sleep(self._shape.warmup_s)
        first = sample()
        self.counts = Counts()
        self._measuring.set()
        started, cpu_started = time.perf_counter(), _own_cpu_s()
        time.sleep(self._shape.seconds)
        self._measuring.clear()
        elapsed = time.perf_counter() - started
        self.cpu_s = _own_cpu_s() - cpu_started
        last = sample()
        self._stop.set()
        for thread in threads:
            thread.join(timeout=60)
        return elapsed, first, last

    def _engine(self, engine: int) -> None:
        import ray

        node = self._nodes[engine % len(self._nodes)]
        trace = self._traces[engine]
        for n in itertools.count():
            if self._stop.is_set():
                return
            if n and n % len(trace) == 0:
                self.cycled += 1
            request = trace[n % len(trace)]
            client = self._clients[request.shard]
            holder = f"engine-{engine}/{n}"
            started = time.perf_counter()
            # The answers as Ray decoded them (wire.AnswerColumns): rebuilding them
            # (wire.answers_of) is the engine's manager's work, not the shard's.
            answers = ray.get(
                client.lookup(NS, request.keys, holder, _LEASE_TTL_S, node).ref, timeout=120
            )
            took_ms = 1e3 * (time.perf_counter() - started)
            hits = answers.count(LookupState.HIT)
            admitted = 0
            if request.units is not None:
                flags, _ = ray.get(client.admit_units(node, request.units).ref, timeout=120)
                admitted = sum(map(sum, flags))
            if hits:
                client.release(NS, request.keys, holder, hits, node)  # one-way
            if self._measuring.is_set():
                with self.counts.lock:
                    self.counts.lookup_keys += request.n_keys
                    self.counts.lookup_calls += 1
                    self.counts.hits += hits
                    self.counts.release_calls += bool(hits)
                    self.counts.lookup_ms.append(took_ms)
                    self.counts.admit_calls += request.units is not None
                    self.counts.offered_units += request.n_units
                    self.counts.admitted_shards += admitted


def build_traces(shape: Shape, shards: int, per_engine: int) -> list[list[Request]]:
    """Every engine's trace, each request's arguments built."""
    return [
        [
            Request(shard_of(root, shards), keys, units or None)
            for root, keys, units in engine_trace(engine, shape, per_engine)
        ]
        for engine in range(shape.engines)
    ]


NS = Namespace("c0ffee5ca1e")


def _usage(handle: Any) -> tuple[int, float]:
    """An actor process's resident bytes and CPU seconds (user + system) so far."""
    import ray

    def usage(_self: object) -> tuple[int, float]:
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        times = os.times()
        return rss, times.user + times.system

    rss, cpu = ray.get(handle.__ray_call__.remote(usage), timeout=60)
    return int(rss), float(cpu)


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _bind_to_core(handle: Any, core: int) -> list[int]:
    """Bind every thread of an actor's process to ``core`` (threads it starts later
    inherit it); returns the cores it may run on now."""
    import ray

    def bind(_self: object, core: int) -> list[int]:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), {core})
        return sorted(os.sched_getaffinity(0))

    return list(ray.get(handle.__ray_call__.remote(bind, core), timeout=60))


def bench_shards(
    shards: int,
    shape: Shape,
    chunks_per_node: int,
    per_engine: int,
    shard_cores: list[int] | None = None,
) -> dict[str, Any]:
    """One S on a fresh simulated cluster of ``shape.nodes`` raylets; with
    ``shard_cores``, shard ``i``'s process is bound to ``shard_cores[i]``."""
    import ray
    from ray.cluster_utils import Cluster
    from tierstore.actors.bootstrap import evictor_clients, shutdown_actors

    os.environ["RAY_worker_niceness"] = "0"  # as tierstore's bootstrap starts Ray
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"}
    )
    for _ in range(shape.nodes):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, namespace=_BENCH_NAMESPACE, log_to_driver=False)
    try:
        cfg = TierStoreConfig(
            cpu_bytes_per_node=chunks_per_node * CHUNK_BYTES,
            namespace=_BENCH_NAMESPACE,
            evictor_shards=shards,
            # The NodeStores hold none of the bytes: a hot chunk's copy would fail there.
            replicate_after_loads=0,
        )
        clients = evictor_clients(cfg)
        nodes = _nodes_with_stores(clients, shape.nodes)
        handles = [c.handle for c in clients]
        bound = (
            [_bind_to_core(h, shard_cores[i % len(shard_cores)]) for i, h in enumerate(handles)]
            if shard_cores
            else None
        )
        traces = build_traces(shape, shards, per_engine)
        empty = [_usage(h)[0] for h in handles]  # before any chunk
        driver = Driver(shape, clients, nodes, traces)
        elapsed, before, after = driver.run(lambda: [_usage(h) for h in handles])
        counts = driver.counts
        statuses = [c.status().result() for c in clients]
        row = _row(shards, elapsed, counts, statuses, before, after)
        for shard, rss in zip(row["per_shard"], empty, strict=True):
            n = shard["chunks"]
            shard["rss_growth_per_chunk"] = (shard["rss_bytes"] - rss) / n if n else None
        row["driver_cpu_share"] = driver.cpu_s / elapsed
        row["shard_cores"] = bound  # each shard's allowed cores (None: not bound)
        row["engines_that_cycled_their_trace"] = driver.cycled
        return row
    finally:
        shutdown_actors(_BENCH_NAMESPACE)
        ray.shutdown()
        cluster.shutdown()


def _nodes_with_stores(clients: list[Any], n_nodes: int) -> list[NodeId]:
    """The simulated nodes, once each has a NodeStore registered with every shard."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        registered = [set(c.status().result()["nodes"]) for c in clients]
        common = set.intersection(*registered)
        if len(common) >= n_nodes:
            return sorted(NodeId(n) for n in common)
        time.sleep(0.5)
    raise RuntimeError(f"NodeStores did not register with every shard: {registered}")


def _row(
    shards: int,
    elapsed: float,
    counts: Counts,
    statuses: list[dict[str, Any]],
    before: list[tuple[int, float]],
    after: list[tuple[int, float]],
) -> dict[str, Any]:
    chunks = [int(s["chunks"]) for s in statuses]
    index_bytes = [s.get("index_bytes") for s in statuses]
    lookups = counts.lookup_calls or 1
    admits = counts.admit_calls or 1
    return {
        "shards": shards,
        "seconds": elapsed,
        "lookup_keys_per_s": counts.lookup_keys / elapsed,
        "requests_per_s": counts.lookup_calls / elapsed,
        "admitted_shards_per_s": counts.admitted_shards / elapsed,
        "offered_units_per_s": counts.offered_units / elapsed,
        "hit_rate": counts.hits / max(1, counts.lookup_keys),
        "lookup_ms_p50": percentile(counts.lookup_ms, 50) if counts.lookup_ms else None,
        "lookup_ms_p99": percentile(counts.lookup_ms, 99) if counts.lookup_ms else None,
        "messages": {
            "lookup_calls_per_request": 1,
            "admit_calls_per_store_job": 1,
            "release_calls_per_request": counts.release_calls / lookups,
            "units_per_admit_call": counts.offered_units / admits,
            "keys_per_lookup_call": counts.lookup_keys / lookups,
            "cross_shard": 0,
        },
        "per_shard": [
            {
                "chunks": n,
                "index_bytes": nbytes,
                "bytes_per_chunk": nbytes / n if n and nbytes else None,
                "rss_bytes": rss,
                "cpu_share": (cpu - cpu_before) / elapsed,
            }
            for n, nbytes, (_, cpu_before), (rss, cpu) in zip(
                chunks, index_bytes, before, after, strict=True
            )
        ],
    }


@dataclass(frozen=True)
class ClusterLoad:
    """What a cluster asks of its control plane (the cost model's input)."""

    nodes: int
    requests_per_node_s: float = 40.0  # 8 GPUs, 5 prompts/s each
    keys_per_request: int = 384  # 2,048 tokens in 16-token chunks, 3 KV cache groups
    chunks_per_node: int = 4_700_000  # 1 TiB CPU + 8 TiB disk in 2 MiB chunks
    shard_memory_bytes: int = 8 << 30  # what one shard's index may take
    shard_busy: float = 0.5  # a shard busy half the time keeps lookups' p99 near p50


def shards_needed(load: ClusterLoad, measured: dict[str, Any]) -> dict[str, Any]:
    """Evictor shards for ``load``: the larger of what its calls' CPU and its index's
    memory need. A shard's CPU per looked-up key comes from the first row (one shard: its
    CPU seconds over the keys it looked up, the trace's admits and releases included, so
    the load is taken to mix them as the trace does); shards add no work of their own
    (no cross-shard message), so S shards serve S times one's keys where each has a core.
    Memory: the largest measured bytes per indexed chunk of any shard."""
    one = measured["rows"][0]
    shard = one["per_shard"][0]
    cpu_per_key_s = shard["cpu_share"] / one["lookup_keys_per_s"]
    keys_per_s = load.nodes * load.requests_per_node_s * load.keys_per_request
    cores = keys_per_s * cpu_per_key_s
    bytes_per_chunk = max(
        (s["bytes_per_chunk"] or 0.0) for row in measured["rows"] for s in row["per_shard"]
    )
    index_bytes = load.nodes * load.chunks_per_node * bytes_per_chunk
    by_cpu = math.ceil(cores / load.shard_busy)
    by_memory = math.ceil(index_bytes / load.shard_memory_bytes)
    return {
        "load": vars(load),
        "keys_per_s": keys_per_s,
        "shard_cpu_us_per_key": 1e6 * cpu_per_key_s,
        "shard_cores": cores,
        "bytes_per_chunk": bytes_per_chunk,
        "index_bytes": index_bytes,
        "shards_for_cpu": by_cpu,
        "shards_for_memory": by_memory,
        "shards": max(1, by_cpu, by_memory),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each S of ``--shards`` in turn, same trace and cluster shape; the speedup of each
    over the first."""
    shape = Shape(
        engines=args.engines,
        nodes=args.nodes,
        groups=args.groups,
        tp=args.tp,
        seconds=5.0 if args.quick else 20.0,
        warmup_s=2.0 if args.quick else 8.0,
    )
    chunks_per_node = 5_000 if args.quick else 50_000
    per_engine = 60 if args.quick else 300
    cores = getattr(args, "shard_cores", None)
    rows = [bench_shards(s, shape, chunks_per_node, per_engine, cores) for s in args.shards]
    base = rows[0]
    for row in rows:
        row["speedup"] = {
            k: row[k] / base[k] if base[k] else None
            for k in ("lookup_keys_per_s", "admitted_shards_per_s", "requests_per_s")
        }
    results: dict[str, Any] = {
        "shape": vars(shape),
        "cpu_count": os.cpu_count(),
        "chunks_per_node": chunks_per_node,
        "rows": rows,
    }
    results["cost_model"] = [shards_needed(ClusterLoad(n), results) for n in (64, 1000)]
    return results
