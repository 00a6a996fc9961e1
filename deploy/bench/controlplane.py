"""Control plane: lookups per second and the scheduler time tierstore adds to a step.

A simulated vLLM scheduler drives the real TierStoreManager, its EvictorChannel thread
and the Evictor actor the way OffloadingConnector does: every step each waiting
request's keys are looked up (``RETRY`` until the Evictor's answer lands),
``on_schedule_end`` sends the step's keys in one batch per request, and a resolved
request loads its HITs (``prepare_load``/``complete_load``), stores as many new chunks
(``prepare_store``/``complete_store``) and finishes. Every looked-up key is stored, so
each is a HIT: the most lookups a request can make.

Per key count, two runs:

- *capacity*: the scheduler spins (no model time) with a few requests waiting: the
  lookups per second the whole path sustains, and how long a request waits for its
  answers.
- *budget*: each step sleeps a fixed model time and one request arrives per step: the
  time spent inside manager calls per step, against that step budget.

Baselines in the same run: the same key batches sent as one call to the Evictor
directly (no manager, no channel), to a Ray actor that only echoes (Ray's round trip,
no index), and to a ``ChunkIndex`` in this process (the index alone, no Ray).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from tierstore.deploy.bench import plots
from tierstore.deploy.bench.common import percentile, ray_session
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext

from tierstore.config import TierStoreConfig
from tierstore.control.index import ChunkIndex, LookupAnswer, LookupState, ShardOffer
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.manager import TierStoreManager

NS = Namespace("c0ntrol-bench")
BENCH_NAMESPACE = "tierstore-bench-control"
TOKENS_PER_CHUNK = 32
# A decode step of a mid-size model on one GPU; the scheduler's share should be small.
STEP_BUDGET_S = 0.010
_MAX_WAITING = 4  # requests waiting for lookups at once in the capacity run
_CHUNK_BYTES = 100  # the index only accounts bytes: no chunk data exists in this benchmark
_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_NO_DEADLINE_MS = 3_600_000.0


def _key(i: int) -> OffloadKey:
    """The ``i``-th key of group 0, as vLLM hands it to the manager."""
    return OffloadKey(i.to_bytes(8, "big") + (0).to_bytes(4, "big"))


@dataclass
class _Request:
    ctx: ReqContext
    lookups: list[OffloadKey]
    stores: list[OffloadKey]
    arrived: float


@dataclass
class _Record:
    scheduler_s: list[float] = field(default_factory=list)  # per step
    lookup_calls: list[int] = field(default_factory=list)  # per step
    resolve_s: list[float] = field(default_factory=list)  # per request
    resolve_steps: list[int] = field(default_factory=list)
    resolved_keys: int = 0
    hits: int = 0


class SimulatedScheduler:
    """Calls the manager as vLLM's OffloadingConnector does, on this (the scheduler) thread."""

    def __init__(
        self, manager: TierStoreManager, stored: list[OffloadKey], fresh_from: int
    ) -> None:
        self._manager = manager
        self._stored = stored
        self._fresh = itertools.count(fresh_from)
        self._ids = itertools.count()
        self._waiting: dict[str, tuple[_Request, int]] = {}
        self._step = 0
        self._calls = 0
        self.record = _Record()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def arrive(self, n_keys: int) -> None:
        ctx = ReqContext(req_id=f"req-{next(self._ids)}")
        lookups = self._stored[:n_keys]
        stores = [_key(next(self._fresh)) for _ in range(n_keys)]
        for i, key in enumerate(lookups + stores):
            ctx.set_offload_key_position(key, (i + 1) * TOKENS_PER_CHUNK)
        self._manager.on_new_request(ctx)
        request = _Request(ctx, lookups, stores, time.perf_counter())
        self._waiting[ctx.req_id] = (request, self._step)

    def step(self) -> None:
        started = time.perf_counter()
        self._calls = 0
        for req_id, (request, first_step) in list(self._waiting.items()):
            hits = self._lookup(request)
            if hits is None:
                continue
            self._finish(request, hits)
            del self._waiting[req_id]
            self.record.resolve_s.append(time.perf_counter() - request.arrived)
            self.record.resolve_steps.append(self._step - first_step)
        self._manager.on_schedule_end(_END)
        self.record.scheduler_s.append(time.perf_counter() - started)
        self.record.lookup_calls.append(self._calls)
        self._step += 1

    def _lookup(self, request: _Request) -> list[OffloadKey] | None:
        """vLLM's prefix scan: keeps going past RETRY, stops at the first MISS."""
        hits, deferred = [], False
        for key in request.lookups:
            self._calls += 1
            result = self._manager.lookup(key, request.ctx)
            if result is LookupResult.MISS:
                break
            if result is LookupResult.RETRY:
                deferred = True
            else:
                hits.append(key)
        return None if deferred else hits

    def _finish(self, request: _Request, hits: list[OffloadKey]) -> None:
        if hits:
            self._manager.prepare_load(hits, request.ctx)
            self._manager.complete_load(hits, request.ctx)
        out = self._manager.prepare_store(request.stores, request.ctx)
        self._manager.complete_store(out.keys_to_store, request.ctx)
        self._manager.on_request_finished(request.ctx)
        self.record.resolved_keys += len(request.lookups)
        self.record.hits += len(hits)


def _capacity(scheduler: SimulatedScheduler, n_keys: int, n_requests: int) -> float:
    """Lookups per second with the scheduler spinning and a few requests waiting."""
    started = time.perf_counter()
    arrived = 0
    while arrived < n_requests or scheduler.waiting:
        while arrived < n_requests and scheduler.waiting < _MAX_WAITING:
            scheduler.arrive(n_keys)
            arrived += 1
        scheduler.step()
        time.sleep(0)  # let the channel thread take the GIL, as vLLM's busy loop does
    return scheduler.record.resolved_keys / (time.perf_counter() - started)


def _budget(scheduler: SimulatedScheduler, n_keys: int, n_steps: int) -> None:
    """One request arrives per step; the rest of each step is the model's forward pass."""
    for step in range(n_steps):
        if step < n_steps - 1:
            scheduler.arrive(n_keys)
        started = time.perf_counter()
        scheduler.step()
        time.sleep(max(0.0, STEP_BUDGET_S - (time.perf_counter() - started)))
    record = scheduler.record
    measured = len(record.scheduler_s)
    deadline = time.monotonic() + 30
    while scheduler.waiting and time.monotonic() < deadline:  # drain: requests count, steps not
        scheduler.step()
        time.sleep(STEP_BUDGET_S)
    del record.scheduler_s[measured:], record.lookup_calls[measured:]


class _Echo:
    """Answers a lookup batch without an index: Ray's round trip alone."""

    def lookup(
        self, namespace: Namespace, keys: list[OffloadKey], holder: str, lease_ttl_s: float
    ) -> list[LookupAnswer]:
        return [LookupAnswer(LookupState.MISS)] * len(keys)


def _calls_per_s(call: Any, n_keys: int, seconds: float) -> float:
    """Keys per second of ``call`` (one batch of ``n_keys``) repeated for ``seconds``."""
    call()  # warm-up: the first call to a new actor waits for its process
    calls = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds or calls < 3:
        call()
        calls += 1
    return calls * n_keys / (time.perf_counter() - started)


def _baselines(
    evictor: Any, echo: Any, node: str, keys: list[OffloadKey], seconds: float
) -> dict[str, float]:
    chunk_keys = [ChunkKey(k) for k in keys]
    index = ChunkIndex()
    index.register_node(NodeId(node), 1 << 40)
    index.admit(NodeId(node), [ShardOffer(NS, k, 0, 1, _CHUNK_BYTES) for k in chunk_keys], 0.0)
    now = time.monotonic()
    result = {
        "evictor_direct": _calls_per_s(
            lambda: evictor.lookup(NS, keys, "bench-direct", 30.0).result(),
            len(keys),
            seconds,
        ),
        "ray_echo": _calls_per_s(
            lambda: ray.get(echo.lookup.remote(NS, keys, "bench-echo", 30.0)), len(keys), seconds
        ),
        "index_in_process": _calls_per_s(
            lambda: index.lookup(NS, chunk_keys, "bench-local", now, 30.0), len(keys), seconds
        ),
    }
    evictor.release_holder("bench-direct").result()
    return result


def bench_keys(
    cfg: TierStoreConfig, evictor: Any, echo: Any, node: str, n_keys: int, quick: bool
) -> dict[str, Any]:
    stored = [_key(i) for i in range(n_keys)]
    capacity_run = SimulatedScheduler(
        TierStoreManager(cfg, NS, EvictorChannel(evictor), {0: TOKENS_PER_CHUNK}),
        stored,
        fresh_from=1 << 32,
    )
    lookups_per_s = _capacity(capacity_run, n_keys, 10 if quick else 40)
    budget_run = SimulatedScheduler(
        TierStoreManager(cfg, NS, EvictorChannel(evictor), {0: TOKENS_PER_CHUNK}),
        stored,
        fresh_from=2 << 32,
    )
    _budget(budget_run, n_keys, 20 if quick else 100)
    sched = budget_run.record.scheduler_s
    return {
        "keys_per_request": n_keys,
        "lookups_per_s": {
            "tierstore_manager": lookups_per_s,
            **_baselines(evictor, echo, node, stored, 0.3 if quick else 2.0),
        },
        "hit_fraction": capacity_run.record.hits / max(1, capacity_run.record.resolved_keys),
        "resolve_ms": {
            "p50": 1e3 * percentile(capacity_run.record.resolve_s, 50),
            "p90": 1e3 * percentile(capacity_run.record.resolve_s, 90),
        },
        "budget": {
            "step_budget_ms": 1e3 * STEP_BUDGET_S,
            "scheduler_us_p50": 1e6 * percentile(sched, 50),
            "scheduler_us_p90": 1e6 * percentile(sched, 90),
            "scheduler_us_max": 1e6 * max(sched),
            "fraction_of_budget_p50": percentile(sched, 50) / STEP_BUDGET_S,
            "fraction_of_budget_p90": percentile(sched, 90) / STEP_BUDGET_S,
            "lookup_calls_per_step_p50": percentile(budget_run.record.lookup_calls, 50),
            "us_per_lookup_call": 1e6 * sum(sched) / max(1, sum(budget_run.record.lookup_calls)),
            "resolve_steps_p50": percentile(budget_run.record.resolve_steps, 50),
            "resolve_steps_p90": percentile(budget_run.record.resolve_steps, 90),
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    key_counts = [16, 256] if args.quick else [1, 16, 128, 1024]
    # No lookup deadline: this measures how fast answers come back, and a deadline would
    # turn the slow ones into misses (resolve_ms shows what lookup_timeout_ms must cover).
    # The NodeStore maps its CPU tier up front (the node's arena): keep it small; the
    # index accounts only _CHUNK_BYTES per chunk, so 64 MiB holds every key many times.
    cfg = TierStoreConfig(
        cpu_bytes_per_node=64 << 20,
        namespace=BENCH_NAMESPACE,
        lookup_timeout_ms=_NO_DEADLINE_MS,
        evictor_shards=1,  # one Evictor, called directly
    )
    with ray_session(cfg.namespace) as address:
        from tierstore.actors.bootstrap import get_or_create_evictor
        from tierstore.actors.clients import EvictorClient

        evictor = EvictorClient(get_or_create_evictor(cfg))
        echo: Any = ray.remote(_Echo).options(num_cpus=0).remote()
        node = ray.get_runtime_context().get_node_id()
        evictor.register_node(node, cfg.cpu_bytes_per_node).result()
        offers = [
            ShardOffer(NS, ChunkKey(_key(i)), 0, 1, _CHUNK_BYTES) for i in range(max(key_counts))
        ]
        accepted, _ = evictor.admit(node, offers).result()
        assert all(accepted), "the Evictor refused chunks of an empty, huge tier"
        rows = [bench_keys(cfg, evictor, echo, node, n, args.quick) for n in key_counts]
        ray.kill(echo)
    return {"ray_cluster": address, "step_budget_ms": 1e3 * STEP_BUDGET_S, "rows": rows}


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    rows = results["rows"]
    keys = [r["keys_per_request"] for r in rows]
    names = ["tierstore_manager", "evictor_direct", "ray_echo", "index_in_process"]
    lookups = plots.lines(
        out / "controlplane_lookups.png",
        "Lookups per second (all HITs)",
        "keys per request",
        "lookups / s",
        keys,
        {n: [r["lookups_per_s"][n] for r in rows] for n in names},
        logx=True,
        logy=True,
    )
    budget = results["step_budget_ms"] * 1e3
    step = plots.lines(
        out / "controlplane_step.png",
        f"Scheduler time in tierstore per step ({results['step_budget_ms']:.0f} ms steps)",
        "keys per request (one request arrives per step)",
        "microseconds per step",
        keys,
        {
            "p50": [r["budget"]["scheduler_us_p50"] for r in rows],
            "p90": [r["budget"]["scheduler_us_p90"] for r in rows],
            "step budget": [budget] * len(rows),
        },
        logx=True,
        logy=True,
    )
    return [lookups, step]
