"""Cross-node loads: tierstore's load of a chunk held on node A into a worker on node B,
set against a raw ``ray.get`` of the same bytes between the same two nodes, in one run.

Each side is an actor pinned to its node, running a real :class:`TierStoreWorker`. Every
repeat moves fresh bytes: the NodeStore puts a new object per load, and the baseline
gets a new object per repeat (a second get of one object would be served from node B's
own copy). Baselines: ``ray_get`` (an object already in node A's store, pulled to B) and
``ray_put_get`` (A puts, B pulls: what a tierstore load also pays). Then B reports its
loads as an engine's manager does, the Evictor copies the now hot chunk to B
(``replicate_after_loads``), and the same load is timed again from B's own copy. The
whole set runs once per ``pull_transport`` (the object store, then NIXL where it imports),
with the actors started anew for each. Run by hand it simulates two nodes with
``ray.cluster_utils``; under ``ray job submit`` on a cluster of two or more nodes it uses
two real ones.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tierstore.actors.bootstrap import ensure_actors, get_or_create_evictor, shutdown_actors
from tierstore.actors.clients import EvictorClient
from tierstore.deploy.bench import plots
from tierstore.deploy.bench.common import two_nodes
from tierstore.deploy.bench.dataplane import PageJobs

from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.store.nixl_pulls import check_nixl
from tierstore.vllm.transfer_specs import LoadSpec

logger = logging.getLogger(__name__)

NAMESPACE = "tierstore-bench-crossnode"
NS = Namespace("c055")
_REPEATS = 5
_SEED = 1234
# The scheduler's step between a lookup's answer and the load it schedules (vLLM runs the
# step's forward, then schedules the request whose lookup answered, then loads).
_STEP_S = 0.02


class Endpoint:
    """One side: a KV cache of random pages and a tierstore worker on this node."""

    def __init__(self, cfg: TierStoreConfig, size: int) -> None:
        self._cfg = cfg
        self._jobs = PageJobs(cfg, NS, size, seed=_SEED)
        self._size = size
        self._payload = np.random.default_rng(_SEED).integers(0, 255, size, dtype=np.uint8)

    def store(self, key: bytes) -> str:
        """Stores the source pages as one chunk, held and indexed; returns this node's id."""
        self._jobs.store(ChunkKey(key))
        self._jobs.wait_committed()
        return ray.get_runtime_context().get_node_id()

    def load_s(self, key: bytes, where: str) -> float:
        """Median seconds to load the chunk from ``where`` into the destination pages."""
        spec = LoadSpec.build(NS, [ChunkKey(key)], [{0: NodeId(where)}])
        times = []
        for _ in range(_REPEATS):
            self._jobs.clear_loaded()
            started = time.perf_counter()
            self._jobs.load(spec)
            times.append(time.perf_counter() - started)
        # The same seed made node A's source pages: the bytes must have arrived intact.
        assert self._jobs.loaded_intact()
        return statistics.median(times)

    def load_after_lookup_s(self, keys: list[bytes], where: str, gap_s: float) -> dict[str, float]:
        """Each chunk (a fresh one each time, held on ``where`` only) as an engine here
        meets it: its manager's lookup answers HIT naming ``where`` (this node's NodeStore
        starts pulling it), the scheduler's step takes ``gap_s``, then the worker loads
        it. Medians: seconds from the lookup's answer to the load's end, and of the load
        itself; the fraction of the bytes already here when the load started."""
        evictor = EvictorClient(get_or_create_evictor(self._cfg))
        node = ray.get_runtime_context().get_node_id()
        worker = self._jobs._worker  # its counters: bytes already here at a load's start
        named, local = worker.remote_named_bytes, worker.remote_named_bytes_local
        from_answer, load_only = [], []
        for key in keys:
            spec = LoadSpec.build(NS, [ChunkKey(key)], [{0: NodeId(where)}])
            self._jobs.clear_loaded()
            ((state, at, _),) = evictor.lookup(NS, [ChunkKey(key)], "bench", 30.0, node).result()
            answered = time.perf_counter()
            assert at == {0: where}, (state, at)
            if gap_s:
                time.sleep(gap_s)
            started = time.perf_counter()
            self._jobs.load(spec)
            ended = time.perf_counter()
            assert self._jobs.loaded_intact()
            from_answer.append(ended - answered)
            load_only.append(ended - started)
        return {
            "from_answer_s": statistics.median(from_answer),
            "load_s": statistics.median(load_only),
            "local_at_start": (worker.remote_named_bytes_local - local)
            / max(1, worker.remote_named_bytes - named),
        }

    def put(self) -> list[ray.ObjectRef]:
        """A fresh object of the chunk's size, in this node's object store."""
        return [ray.put(self._payload)]

    def get_s(self, refs: list[ray.ObjectRef]) -> float:
        started = time.perf_counter()
        data = ray.get(refs[0])
        elapsed = time.perf_counter() - started
        assert data.nbytes == self._size
        return elapsed

    def put_get_s(self, producer: ray.actor.ActorHandle) -> float:
        started = time.perf_counter()
        data: Any = ray.get(ray.get(producer.put.remote())[0])
        elapsed = time.perf_counter() - started
        assert data.nbytes == self._size
        return elapsed

    def shutdown(self) -> None:
        self._jobs.shutdown()


def _endpoint(cfg: TierStoreConfig, node_id: str, size: int) -> ray.actor.ActorHandle:
    return (
        ray.remote(Endpoint)  # type: ignore[return-value]  # Ray: ActorHandle | type
        .options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(cfg, size)
    )


def bench_size(cfg: TierStoreConfig, node_a: str, node_b: str, size: int) -> dict[str, Any]:
    a, b = _endpoint(cfg, node_a, size), _endpoint(cfg, node_b, size)
    key = size.to_bytes(8, "big") + b"\0\0\0\0"
    assert ray.get(a.store.remote(key)) == node_a
    # No lookup (the path before pulls at lookup): the worker pulls at its load's start.
    no_pull_s = ray.get(b.load_s.remote(key, node_a))
    fresh = [size.to_bytes(8, "big") + i.to_bytes(4, "big") for i in range(1, 2 * _REPEATS + 1)]
    for k in fresh:
        assert ray.get(a.store.remote(k)) == node_a
    at_once = ray.get(b.load_after_lookup_s.remote(fresh[:_REPEATS], node_a, 0.0))
    after_step = ray.get(b.load_after_lookup_s.remote(fresh[_REPEATS:], node_a, _STEP_S))
    load_s = at_once["from_answer_s"]
    get_s = statistics.median(ray.get(b.get_s.remote(a.put.remote())) for _ in range(_REPEATS))
    put_get_s = statistics.median(ray.get(b.put_get_s.remote(a)) for _ in range(_REPEATS))
    copy_ready_s = _make_hot(cfg, key, node_b)
    local_s = ray.get(b.load_s.remote(key, node_b))
    ray.get([a.shutdown.remote(), b.shutdown.remote()])
    for handle in (a, b):
        ray.kill(handle)
    gbps = lambda seconds: size / seconds / 1e9  # noqa: E731
    return {
        "bytes": size,
        "GBps": {
            "tierstore_load": gbps(load_s),
            "tierstore_load_after_step": gbps(after_step["load_s"]),
            "tierstore_load_no_pull": gbps(no_pull_s),
            "ray_get": gbps(get_s),
            "ray_put_get": gbps(put_get_s),
            "tierstore_load_local_copy": gbps(local_s),
        },
        "load_vs_ray_get": get_s / load_s,
        "load_after_step_vs_ray_get": get_s / after_step["load_s"],
        "no_pull_vs_ray_get": get_s / no_pull_s,
        "local_at_load_start": at_once["local_at_start"],
        "local_at_load_start_after_step": after_step["local_at_start"],
        "load_vs_ray_put_get": put_get_s / load_s,
        "local_copy_vs_remote_load": load_s / local_s,
        "copy_ready_s": copy_ready_s,
    }


def _make_hot(cfg: TierStoreConfig, key: bytes, node_b: str) -> float:
    """Report B's loads as its engine's manager would; seconds until lookups from B name
    B's own copy."""
    evictor = EvictorClient(get_or_create_evictor(cfg))
    chunk = ChunkKey(key)
    started = time.perf_counter()
    for _ in range(cfg.replicate_after_loads):
        evictor.release(NS, [chunk], "bench", 1, node_b).result()
    while True:
        ((state, where, _),) = evictor.lookup(NS, [chunk], "bench", 1.0, node_b).result()
        if where == {0: node_b}:
            return time.perf_counter() - started
        if time.perf_counter() - started > 60:
            raise TimeoutError(f"no copy of a hot chunk on node B after 60 s ({state})")
        time.sleep(0.002)


def run(args: Any) -> dict[str, Any]:
    sizes = [1 << 20, 16 << 20] if args.quick else [1 << 20, 16 << 20, 64 << 20]
    transports = ["object_store"]
    try:
        check_nixl()
        transports.append("nixl")
    except ConfigError as exc:
        logger.warning("crossnode: no NIXL row (%s)", exc)
    results: dict[str, list[dict[str, Any]]] = {}
    with two_nodes(NAMESPACE, "crossnode") as (node_a, node_b, how):
        for transport in transports:
            # Room for every chunk the run stores on A and copies to B, below the low
            # watermark. One Evictor, called directly (load_after_lookup_s, _make_hot).
            cfg = TierStoreConfig(
                cpu_bytes_per_node=32 * (64 << 20),
                namespace=NAMESPACE,
                evictor_shards=1,
                pull_transport=transport,
            )
            ensure_actors(cfg)
            try:
                results[transport] = [bench_size(cfg, node_a, node_b, size) for size in sizes]
            finally:
                shutdown_actors(NAMESPACE)
    return {"nodes": how, "repeats": _REPEATS, "transports": results}


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    transports: dict[str, list[dict[str, Any]]] = results["transports"]
    first = next(iter(transports.values()))
    loads = ["tierstore_load_no_pull", "tierstore_load", "tierstore_load_after_step"]
    series = {
        f"{name} ({transport})": [s["GBps"][name] for s in sizes]
        for transport, sizes in transports.items()
        for name in loads
    }
    for name in ("tierstore_load_local_copy", "ray_put_get", "ray_get"):
        series[name] = [s["GBps"][name] for s in first]
    return [
        plots.bars(
            out / "crossnode.png",
            f"Cross-node load, node A -> node B ({results['nodes']})",
            "GB/s",
            [f"{s['bytes'] >> 20} MiB" for s in first],
            series,
        )
    ]
