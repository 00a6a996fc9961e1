"""Data plane: tierstore store and load GB/s against memcpy and a plain ray.put/ray.get.

All in one run on the same Ray cluster: a job of ``size`` bytes of KV pages is stored
and loaded back by a real worker on the node. A store gathers straight into extents of
the node's arena, hashing as it copies, and is done once the NodeStore acknowledged its
commit (the Evictor indexed it). A load pins the extents, scatters straight from them
hashing as it copies, and checks the digests. The baselines move the same bytes with
``numpy.copyto`` and with ``ray.put`` + ``ray.get`` of a numpy array. The "host_copy"
section times the host copy executors alone (``hostcopy``), no Ray."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from tierstore.actors.bootstrap import get_or_create_evictor
from tierstore.actors.clients import EvictorClient
from tierstore.deploy.bench import hostcopy, plots
from tierstore.deploy.bench.common import ray_session
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout
from tierstore.keys import ChunkKey, Namespace
from tierstore.spec import connect_worker
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec

NS = Namespace("da7a")
PAGE = 64 * 1024  # bytes of one block's page (one layer)
_REPEATS = 5


def _median_s(run: Callable[[], None]) -> float:
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
        while not any(r.job_id == self._job for r in self._worker.get_finished()):
            time.sleep(0.0005)

    def store(self, key: ChunkKey) -> None:
        """Returns once the worker reports it done: the NodeStore holds it."""
        spec = StoreSpec(self._namespace, (key,))
        self._run(lambda job: self._worker.submit_store(job, self._source, spec))

    def load(self, spec: LoadSpec) -> None:
        self._run(lambda job: self._worker.submit_load(job, spec, self._destination))

    def clear_loaded(self) -> None:
        self._kv[self._blocks + 1 :].zero_()

    def loaded_intact(self) -> bool:
        """The destination pages equal the source pages (same seed on another node)."""
        return torch.equal(self._kv[self._blocks + 1 :], self._kv[1 : self._blocks + 1])

    def shutdown(self) -> None:
        self._worker.shutdown()


def bench_size(cfg: TierStoreConfig, size: int, round_: list[int]) -> dict[str, Any]:
    jobs = PageJobs(cfg, NS, size)
    evictor = EvictorClient(get_or_create_evictor(cfg))

    keys: list[ChunkKey] = []

    def store_once() -> None:
        round_[0] += 1
        keys.append(ChunkKey(round_[0].to_bytes(8, "big") + b"\0\0\0\0"))
        jobs.store(keys[-1])

    store_s = _median_s(store_once)
    (answer,) = evictor.lookup(NS, [keys[-1]], "bench", 60.0).result()
    spec = LoadSpec.build(NS, [keys[-1]], [answer[1]])
    load_s = _median_s(lambda: jobs.load(spec))
    assert jobs.loaded_intact()  # the bytes really moved
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
            "tierstore_load": gbps(load_s),
            "memcpy": gbps(memcpy_s),
            "ray_put": gbps(put_s),
            "ray_get": gbps(get_s),
            "ray_put_get": gbps(roundtrip_s),
        },
        "store_vs_memcpy": memcpy_s / store_s,
        "load_vs_memcpy": memcpy_s / load_s,
        "store_vs_ray_put_get": roundtrip_s / store_s,
        "load_vs_ray_put_get": roundtrip_s / load_s,
    }


def run(quick: bool = False) -> dict[str, Any]:
    sizes = [1 << 20, 16 << 20] if quick else [1 << 20, 16 << 20, 64 << 20]
    cfg = TierStoreConfig(cpu_bytes_per_node=2 * (64 << 20) * _REPEATS, namespace="tierstore-bench")
    with ray_session(cfg.namespace) as address:
        counter = [0]
        rows = [bench_size(cfg, size, counter) for size in sizes]
    host_copy = hostcopy.run(repeat=5 if quick else 30, quick=quick)
    return {"ray_cluster": address, "sizes": rows, "host_copy": host_copy}


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    sizes = results["sizes"]
    labels = [f"{s['bytes'] >> 20} MiB" for s in sizes]
    names = ["tierstore_store", "tierstore_load", "ray_put_get", "ray_put", "ray_get", "memcpy"]
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
