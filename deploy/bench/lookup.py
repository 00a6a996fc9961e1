"""Lookup latency beside a CPU-bound engine, with tierstore's actors niced as Ray does
and as tierstore does.

Ray starts worker processes (the Evictor and the NodeStores included) at niceness 15
(``RAY_worker_niceness``); tierstore's bootstrap and ``ray_cluster.yaml`` set 0. Two
private clusters, one after the other: ``ray_default`` (the setting unset: 15) and
``tierstore`` (0). On each, with the cores kept busy by CPU hogs at niceness 0, this
driver (at 0, as vLLM's scheduler is) measures:

- ``direct``: one ``lookup`` call of 16 stored keys to the Evictor, its round trip;
- ``manager``: a request's 16 keys through the real ``TierStoreManager`` and
  ``EvictorChannel`` with the default ``lookup_timeout_ms``, stepping every 5 ms as a
  scheduler does: the time until every key is answered, and how many keys ran past the
  deadline (computed as misses; every key is stored, so any MISS is a timeout).

Hogs: ``spin`` (one busy-looping process per core, as vLLM's OpenMP threads spin) and,
in the full run, ``engine`` (a real vLLM CPU engine generating, its threads bound to
every core: ``lookup_hog``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tierstore.deploy.bench.common import percentile
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext

from tierstore.config import TierStoreConfig
from tierstore.control.index import ShardOffer
from tierstore.keys import ChunkKey, Namespace

NS = Namespace("l00kup-bench")
BENCH_NAMESPACE = "tierstore-bench-lookup"
NICENESS_ENV = "RAY_worker_niceness"
CASES = {"ray_default": None, "tierstore": "0"}  # case -> RAY_worker_niceness (None: unset)
KEYS = 16
STEP_S = 0.005
_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_REPO = Path(__file__).resolve().parents[2]
_ENGINE_READY_S = 600


def _key(i: int) -> OffloadKey:
    """The ``i``-th key of group 0, as vLLM hands it to the manager."""
    return OffloadKey(i.to_bytes(8, "big") + (0).to_bytes(4, "big"))


def _stats(values_s: list[float]) -> dict[str, float]:
    return {
        "n": len(values_s),
        "p50_ms": 1e3 * percentile(values_s, 50),
        "p99_ms": 1e3 * percentile(values_s, 99),
        "max_ms": 1e3 * max(values_s),
    }


def measure_direct(evictor: Any, seconds: float) -> dict[str, float]:
    """Round trips of one 16-key lookup call, every 20 ms, for ``seconds``."""
    keys, times = [_key(i) for i in range(KEYS)], list[float]()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or len(times) < 3:
        started = time.perf_counter()
        evictor.lookup(NS, keys, "bench-direct", 30.0).result()
        times.append(time.perf_counter() - started)
        time.sleep(0.02)
    evictor.release_holder("bench-direct").result()
    return _stats(times)


def measure_manager(cfg: TierStoreConfig, evictor: Any, seconds: float) -> dict[str, Any]:
    """Requests of 16 stored keys through the manager, one at a time, stepping every 5 ms."""
    from tierstore.vllm.evictor_channel import EvictorChannel
    from tierstore.vllm.manager import TierStoreManager

    channel = EvictorChannel(evictor)
    manager = TierStoreManager(cfg, NS, channel, {0: 32})
    keys, times, timeouts, requests = [_key(i) for i in range(KEYS)], [], 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or requests < 3:
        requests += 1
        ctx = ReqContext(req_id=f"req-{requests}")
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * 32)
        manager.on_new_request(ctx)
        started, answered = time.perf_counter(), dict[OffloadKey, LookupResult]()
        while len(answered) < len(keys):
            for key in keys:
                if key not in answered:
                    result = manager.lookup(key, ctx)
                    if result is not LookupResult.RETRY:
                        answered[key] = result
            manager.on_schedule_end(_END)
            if len(answered) < len(keys):
                time.sleep(STEP_S)
        times.append(time.perf_counter() - started)
        timeouts += sum(r is LookupResult.MISS for r in answered.values())
        manager.on_request_finished(ctx)
    channel.close()
    return _stats(times) | {
        "keys": requests * KEYS,
        "keys_timed_out": timeouts,
        "lookup_timeout_ms": cfg.lookup_timeout_ms,
    }


@contextmanager
def spinners(count: int) -> Iterator[str]:
    """``count`` busy-looping processes at niceness 0."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(1.0)
        yield f"{count} busy-looping processes"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextmanager
def engine_hog(work: Path) -> Iterator[str]:
    """A vLLM CPU engine generating, its OpenMP threads bound to every core."""
    from tierstore.deploy.models import make_tiny_model

    model = make_tiny_model("llama-0.1b", Path(tempfile.gettempdir()) / "tierstore-models")
    ready = work / "engine.ready"
    ready.unlink(missing_ok=True)
    bind = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = f"{_REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    with open(work / "engine.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.deploy.bench.lookup_hog", str(model), str(ready)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + _ENGINE_READY_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the hog engine did not start: see {work / 'engine.log'}")
            time.sleep(1.0)
        time.sleep(2.0)
        yield f"a vLLM CPU engine (llama-0.1b) generating, OMP bound to {bind}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def private_cluster(niceness: str | None) -> Iterator[str]:
    """A fresh local Ray cluster whose workers start at ``niceness`` (None: Ray's default),
    always private: this benchmark compares two settings of the cluster it starts."""
    import ray
    from tierstore.actors.bootstrap import shutdown_actors

    saved = {k: os.environ.pop(k, None) for k in (NICENESS_ENV, "RAY_ADDRESS")}
    if niceness is not None:
        os.environ[NICENESS_ENV] = niceness
    try:
        ray.init(
            address="local",
            namespace=BENCH_NAMESPACE,
            include_dashboard=False,
            log_to_driver=False,
        )
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            shutdown_actors(BENCH_NAMESPACE)
            ray.shutdown()
    finally:
        os.environ.pop(NICENESS_ENV, None)
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def measure_case(niceness: str | None, seconds: float) -> dict[str, Any]:
    """One private cluster: an Evictor holding 16 keys, its niceness, both latencies."""
    import ray
    from tierstore.actors.bootstrap import get_or_create_evictor
    from tierstore.actors.clients import EvictorClient

    cfg = TierStoreConfig(
        cpu_bytes_per_node=1 << 30, namespace=BENCH_NAMESPACE, evictor_shards=1
    )  # one Evictor, called directly
    with private_cluster(niceness):
        handle = get_or_create_evictor(cfg)
        evictor = EvictorClient(handle)
        node = ray.get_runtime_context().get_node_id()
        evictor.register_node(node, cfg.cpu_bytes_per_node).result()
        offers = [ShardOffer(NS, ChunkKey(_key(i)), 0, 1, 100) for i in range(KEYS)]
        accepted, _ = evictor.admit(node, offers).result()
        assert all(accepted), "the Evictor refused chunks of an empty tier"
        pid: Any = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=120)
        return {
            "RAY_worker_niceness": niceness,
            "evictor_niceness": os.getpriority(os.PRIO_PROCESS, pid),
            "direct": measure_direct(evictor, seconds),
            "manager": measure_manager(cfg, evictor, seconds),
        }


def _hog(name: str, work: Path) -> Any:
    if name == "spin":
        return spinners(os.cpu_count() or 1)
    if name == "engine":
        return engine_hog(work)
    return _no_hog()


@contextmanager
def _no_hog() -> Iterator[str]:
    yield "nothing (idle)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    hogs = ["idle", "spin"] if args.quick else ["idle", "spin", "engine"]
    seconds = 1.0 if args.quick else 8.0
    work = args.out / "lookup-work"
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for hog in hogs:
        with _hog(hog, work) as what:
            results[hog] = {"hog": what} | {
                case: measure_case(niceness, seconds) for case, niceness in CASES.items()
            }
    return {
        "keys_per_lookup": KEYS,
        "step_ms": 1e3 * STEP_S,
        "seconds_per_measure": seconds,
        "driver_niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "hogs": results,
    }
