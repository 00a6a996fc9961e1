"""Data plane: tierstore store and load GB/s against memcpy and a plain ray.put/ray.get.

All in one run on the same Ray cluster: a job of ``size`` bytes of KV pages is stored
and loaded back by a real worker on the node. A store gathers straight into extents of
the node's arena and is done (for vLLM: its blocks are free) once its bytes are there:
``store_vs_memcpy``. The worker's commit thread then hashes it and commits it, answered
once the NodeStore adopted it and the Evictor indexed it: ``store_committed_vs_memcpy``
times all of that. A same-node load finds its shards' extents in the arena's directory
and reads them without a round trip (generation, digest, scatter, generation again):
``load_vs_memcpy``; ``load_pinned_vs_memcpy`` times a load that first pins the extents,
as one whose shards the arena's directory no longer names does.
The baselines move the same bytes with ``numpy.copyto`` and with ``ray.put`` +
``ray.get`` of a numpy array. The "host_copy" section times the host copy executors
alone (``hostcopy``), no Ray."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from tierstore.actors.bootstrap import get_or_create_evictor, shutdown_actors
from tierstore.actors.clients import EvictorClient
from tierstore.deploy.bench import hostcopy, plots
from tierstore.deploy.bench.common import ray_session
from tierstore.deploy.bench.soak_faults import node_store_status
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tierstore.config import TierStoreConfig
from tierstore.control.index_model import LookupAnswer
from tierstore.data.layout import ChunkLayout
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.spec import connect_worker
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec

NS = Namespace("da7a")
PAGE = 64 * 1024  # bytes of one block's page (one layer)
_REPEATS = 5
_STREAM_JOBS = 4


def _median_s(run: Callable[[], object]) -> float:
    times = []
    for _ in range(_REPEATS):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class PageJobs:
    """A one-group KV cache of ``2 * blocks + 1`` random pages and a real tierstore worker
    on this node: a store sends blocks ``1..blocks`` as one chunk, a load writes blocks
    ``blocks+1..2*blocks``, so what a load wrote can be checked against the source.
    The data-plane and cross-node benchmarks both drive one."""

    def __init__(
        self, cfg: TierStoreConfig, namespace: Namespace, size: int, seed: int | None = None
    ) -> None:
        self._namespace = namespace
        self._blocks = size // PAGE
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self._kv = torch.randint(
            -128, 127, (2 * self._blocks + 1, PAGE), dtype=torch.int8, generator=generator
        )
        layout = ChunkLayout([self._kv], [[(0, PAGE)]], blocks_per_chunk=self._blocks)
        self._worker = connect_worker(cfg, layout)
        self._source = self._pages_from(1)
        self._destination = self._pages_from(self._blocks + 1)
        self._job = 0

    def _pages_from(self, first_block: int) -> GPULoadStoreSpec:
        ids = list(range(first_block, first_block + self._blocks))
        return GPULoadStoreSpec(ids, group_sizes=[self._blocks], block_indices=[0])

    def _run(self, submit: Callable[[int], object]) -> None:
        """Submits one job and returns once the worker reports it done."""
        self._job += 1
        submit(self._job)
        self._wait({self._job})

    def _wait(self, jobs: set[int]) -> None:
        while True:
            jobs -= {r.job_id for r in self._worker.get_finished()}
            if not jobs:
                return
            time.sleep(0.0001)

    def store(self, key: ChunkKey) -> None:
        """Returns once the worker reports it done: its bytes are in the arena (on the
        object-store path: the NodeStore holds them)."""
        spec = StoreSpec(self._namespace, (key,))
        self._run(lambda job: self._worker.submit_store(job, self._source, spec))

    def wait_committed(self) -> None:
        """Returns once every store so far is held by the NodeStore and indexed."""
        if not self._worker.wait_committed(60.0):
            raise TimeoutError("store commits unanswered after 60 s")

    def store_stream(self, keys: list[ChunkKey]) -> None:
        """One store per key, submitted back to back as a serving engine does (it never
        waits for a store); returns once every one is reported done and committed."""
        first = self._job + 1
        for key in keys:
            self._job += 1
            self._worker.submit_store(self._job, self._source, StoreSpec(self._namespace, (key,)))
        self._wait(set(range(first, self._job + 1)))
        self.wait_committed()

    @property
    def pool_misses(self) -> int:
        """Stores that found no granted extents and took the object store instead."""
        return self._worker.arena.pool_misses

    def load(self, spec: LoadSpec) -> None:
        self._run(lambda job: self._worker.submit_load(job, spec, self._destination))

    def load_pinned(self, spec: LoadSpec) -> None:
        """A load that pins its extents first, as where the arena's directory lost them
        (or off x86-64)."""
        arena = self._worker.arena
        unpinned, arena.read_unpinned = arena.read_unpinned, False
        try:
            self.load(spec)
        finally:
            arena.read_unpinned = unpinned

    def clear_loaded(self) -> None:
        self._kv[self._blocks + 1 :].zero_()

    def loaded_intact(self) -> bool:
        """The destination pages equal the source pages (same seed on another node)."""
        return torch.equal(self._kv[self._blocks + 1 :], self._kv[1 : self._blocks + 1])

    def shutdown(self) -> None:
        self._worker.shutdown()


def _stored_shards(namespace: str) -> int:
    """Shards this node's NodeStore has adopted so far (an eviction does not undo it)."""
    status = node_store_status(namespace, ray.get_runtime_context().get_node_id())
    if status is None:
        raise RuntimeError("this node's NodeStore does not answer")
    return status["stats"]["stored_shards"]


def _store_stream(jobs: PageJobs, namespace: str, round_: list[int]) -> tuple[float, int]:
    """Median seconds for ``_STREAM_JOBS`` stores in flight together, and how many of
    them missed the extent pool; checks that the NodeStore adopted every one."""
    misses, stored = jobs.pool_misses, _stored_shards(namespace)

    def stream() -> None:
        keys = []
        for _ in range(_STREAM_JOBS):
            round_[0] += 1
            keys.append(ChunkKey(round_[0].to_bytes(8, "big") + b"\0\0\0\0"))
        jobs.store_stream(keys)

    seconds = _median_s(stream)
    assert _stored_shards(namespace) - stored == _REPEATS * _STREAM_JOBS  # really stored
    return seconds, jobs.pool_misses - misses


def _loads(jobs: PageJobs, spec: LoadSpec) -> tuple[float, float]:
    """Median seconds of a load with the worker's own hints (no round trip), then of one
    that pins first; each checked byte-exact."""
    load_s = _median_s(lambda: jobs.load(spec))
    assert jobs.loaded_intact()  # the bytes really moved
    jobs.clear_loaded()
    pinned_s = _median_s(lambda: jobs.load_pinned(spec))
    assert jobs.loaded_intact()
    return load_s, pinned_s


def _held_at(answer: LookupAnswer) -> dict[int, NodeId]:
    """Where a chunk just stored is held (rank -> node)."""
    if answer.where is None:
        raise RuntimeError(f"a chunk just stored is not held: the Evictor answered {answer}")
    return answer.where


def bench_size(cfg: TierStoreConfig, size: int, round_: list[int]) -> dict[str, Any]:
    jobs = PageJobs(cfg, NS, size)
    evictor = EvictorClient(get_or_create_evictor(cfg))

    keys: list[ChunkKey] = []

    def store_once() -> None:
        round_[0] += 1
        keys.append(ChunkKey(round_[0].to_bytes(8, "big") + b"\0\0\0\0"))
        jobs.store(keys[-1])

    # As an engine in steady state: the first store maps the arena and asks for extents
    # in the background (it takes the object store meanwhile).
    for _ in range(2):
        store_once()
        time.sleep(0.2)
    store_s = _median_s(store_once)

    def store_committed() -> None:
        store_once()
        jobs.wait_committed()

    committed_s = _median_s(store_committed)
    (answer,) = evictor.lookup(NS, [keys[-1]], "bench", 60.0).result()
    stream_s, misses = _store_stream(jobs, cfg.namespace, round_)
    spec = LoadSpec.build(NS, [keys[-1]], [_held_at(answer)])
    load_s, pinned_s = _loads(jobs, spec)
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    out = np.empty_like(data)
    memcpy_s = _median_s(lambda: np.copyto(out, data))
    put_s = _median_s(lambda: ray.put(data))
    ref = ray.put(data)
    get_s = _median_s(lambda: ray.get(ref))
    roundtrip_s = _median_s(lambda: ray.get(ray.put(data)))
    jobs.shutdown()
    gbps = lambda seconds: size / seconds / 1e9  # noqa: E731
    return {
        "bytes": size,
        "GBps": {
            "tierstore_store": gbps(store_s),
            "tierstore_store_committed": gbps(committed_s),
            "tierstore_store_stream": gbps(stream_s / _STREAM_JOBS),
            "tierstore_load": gbps(load_s),
            "tierstore_load_pinned": gbps(pinned_s),
            "memcpy": gbps(memcpy_s),
            "ray_put": gbps(put_s),
            "ray_get": gbps(get_s),
            "ray_put_get": gbps(roundtrip_s),
        },
        "store_vs_memcpy": memcpy_s / store_s,
        # until the NodeStore holds it and the Evictor indexed it (answered later)
        "store_committed_vs_memcpy": memcpy_s / committed_s,
        # a stream of stores in flight together: throughput, not one job's latency
        "store_stream_vs_memcpy": memcpy_s * _STREAM_JOBS / stream_s,
        "store_stream_pool_misses": misses,
        "load_vs_memcpy": memcpy_s / load_s,
        "load_pinned_vs_memcpy": memcpy_s / pinned_s,
        "store_vs_ray_put_get": roundtrip_s / store_s,
        "load_vs_ray_put_get": roundtrip_s / load_s,
    }


def run(quick: bool = False) -> dict[str, Any]:
    sizes = [1 << 20, 16 << 20] if quick else [1 << 20, 16 << 20, 64 << 20]
    namespace = "tierstore-bench"
    rows = []
    with ray_session(namespace) as address:
        counter = [0]
        for size in sizes:
            # Each size on a node store of its own, as an engine's one chunk size: an
            # arena left full of smaller chunks would have no room for the next size's
            # extents (its stores would take the object store).
            # Room for every job it stores: a full tier would skip stores (counted), and
            # this measures stores, not evictions.
            cfg = TierStoreConfig(
                cpu_bytes_per_node=(_REPEATS * (2 + _STREAM_JOBS) + 6) * size,
                namespace=f"{namespace}-{size >> 20}m",
                evictor_shards=1,  # one Evictor, called directly (bench_size)
            )
            try:
                rows.append(bench_size(cfg, size, counter))
            finally:
                shutdown_actors(cfg.namespace)
    host_copy = hostcopy.run(repeat=5 if quick else 30, quick=quick)
    return {"ray_cluster": address, "sizes": rows, "host_copy": host_copy}


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    sizes = results["sizes"]
    labels = [f"{s['bytes'] >> 20} MiB" for s in sizes]
    names = [
        "tierstore_store",
        "tierstore_store_committed",
        "tierstore_store_stream",
        "tierstore_load",
        "tierstore_load_pinned",
        "ray_put_get",
        "ray_put",
        "ray_get",
        "memcpy",
    ]
    return [
        plots.bars(
            out / "dataplane.png",
            "Data plane: GB/s per job size (one chunk per job)",
            "GB/s (log)",
            labels,
            {n: [s["GBps"][n] for s in sizes] for n in names},
            log=True,
        )
    ]
