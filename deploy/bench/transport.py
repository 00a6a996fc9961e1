"""Node-to-node transports for a chunk's bytes: Ray's object store against Ray Direct
Transport (RDT), one payload moved from an actor on node A to an actor on node B.

tierstore's cross-node load today goes through the object store: the holder's NodeStore
gathers the chunks' bytes from its arena into one object (a copy into node A's object
store), Ray's object manager moves it to node B's store, and the loading side copies it
out. RDT (Ray 2.60, alpha) instead keeps an actor method's returned torch tensors in the
producing actor and moves them straight to the consuming actor over a tensor transport:
Gloo (two-sided: both actors in one collective group) on CPU, NIXL (one-sided, RDMA)
where it is installed. This module times each on the same two raylets, the same
payloads (uint8 tensors, as arena extents are) and the same shape of call.

Every move is driver-orchestrated the way a load would be: ``loader.take(holder.X())``,
the holder's result passed by reference into the loader's task, which copies the bytes
into its own destination buffer (as a load copies into its pages). Transports:

- ``object_store``: the holder returns a numpy array (one copy into A's store), the
  loader gets it from B's store after Ray's object manager moved it;
- ``object_store_pull``: the loader itself calls the holder's ``put`` and ``ray.get``\\ s
  the object (what tierstore's loads and pulls do: the loading side asks the holder);
- ``rdt_gloo``: the holder's method returns the torch tensor with
  ``tensor_transport="gloo"``; Ray sends it over Gloo's TCP pair to the loader;
- ``rdt_nixl``: the same over NIXL, run only where the ``nixl`` package is installed.

Each repeat moves every transport once, in turn (the machine may be shared: drift hits
all alike); the figure is the median. One more move per transport and size, untimed,
carries fresh random bytes into a zeroed buffer and compares digests: a transport that
drops or corrupts bytes fails the run. Run by hand it simulates two nodes with
``ray.cluster_utils`` (loopback, token auth unless the caller chose otherwise, workers at
niceness 0 as tierstore's ``ray start`` sets); under ``ray job submit`` on a cluster of
two or more nodes it uses two real ones.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tierstore.deploy.bench import plots
from tierstore.deploy.bench.common import two_nodes as common_two_nodes
from tierstore.deploy.ray_auth import MODE_ENV

logger = logging.getLogger(__name__)

NAMESPACE = "tierstore-bench-transport"
REPEATS, QUICK_REPEATS = 7, 3
SIZES, QUICK_SIZES = (1 << 20, 16 << 20, 64 << 20), (1 << 20, 16 << 20)
BASELINE = "object_store"
_CALL_TIMEOUT_S = 120.0  # one move, or one actor call; a group's setup likewise
_NODE_STORE_BYTES = 512 << 20  # each simulated node's object store: a few 64 MiB objects
_NICENESS_ENV = "RAY_worker_niceness"
_GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"  # Gloo's pairs bind this interface's address


def _process_info() -> dict[str, Any]:
    """This process: node, pid, niceness and the CPUs it may run on."""
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
    }


class Holder:
    """Node A's side: one payload of ``size`` bytes, as an arena extent is (uint8)."""

    def __init__(self, size: int) -> None:
        self._payload = torch.zeros(size, dtype=torch.uint8)

    def info(self) -> dict[str, Any]:
        return _process_info()

    def fill(self, seed: int) -> str:
        """Fresh random bytes; returns their digest. Call it only with no move in
        flight: an RDT move sends the tensor itself, not a copy."""
        rng = np.random.default_rng(seed)
        self._payload.numpy()[:] = rng.integers(0, 256, self._payload.numel(), dtype=np.uint8)
        return hashlib.blake2b(self._payload.numpy().data).hexdigest()

    def as_array(self) -> np.ndarray:
        """For the object store: Ray copies the array into this node's store."""
        return self._payload.numpy()

    def put(self) -> list[ray.ObjectRef]:
        """For the loader's own pull: a fresh object in this node's store."""
        return [ray.put(self._payload.numpy())]

    def as_tensor(self) -> torch.Tensor:
        """For RDT (called with ``.options(tensor_transport=...)``): the tensor stays
        here until Ray sends it to the task it is passed to."""
        return self._payload


class Loader:
    """Node B's side: a destination buffer the bytes are copied into, as a load does."""

    def __init__(self, size: int) -> None:
        self._dest = np.zeros(size, dtype=np.uint8)

    def info(self) -> dict[str, Any]:
        return _process_info()

    def take(self, data: np.ndarray | torch.Tensor) -> int:
        """Copies the moved bytes into the destination; returns how many arrived."""
        array = data.numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
        array = array.reshape(-1)
        np.copyto(self._dest[: array.size], array)
        return int(array.size)

    def pull(self, holder: ray.actor.ActorHandle) -> int:
        """Asks the holder for a fresh object and gets it here, as a tierstore load does."""
        refs: list[ray.ObjectRef] = ray.get(holder.put.remote(), timeout=_CALL_TIMEOUT_S)
        return self.take(ray.get(refs[0], timeout=_CALL_TIMEOUT_S))

    def clear(self) -> None:
        self._dest[:] = 0

    def digest(self) -> str:
        return hashlib.blake2b(self._dest.data).hexdigest()


def _actor(cls: type, node: str) -> Any:
    """``cls`` as a Ray actor class with RDT enabled, to be started on ``node``."""
    remote: Any = ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
    return remote(cls).options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))


Mover = Callable[[Any, Any], ray.ObjectRef]  # (holder, loader) -> the loader's byte count

MOVES: dict[str, Mover] = {
    "object_store": lambda h, ld: ld.take.remote(h.as_array.remote()),
    "object_store_pull": lambda h, ld: ld.pull.remote(h),
    "rdt_gloo": lambda h, ld: ld.take.remote(h.as_tensor.options(tensor_transport="gloo").remote()),
    "rdt_nixl": lambda h, ld: ld.take.remote(h.as_tensor.options(tensor_transport="nixl").remote()),
}


def unavailable_transports() -> dict[str, str]:
    """RDT backends that cannot run here, and why (Ray 2.60 ships NIXL, Gloo, NCCL and
    CUDA IPC; only Gloo and NIXL move CPU tensors)."""
    out = {
        "rdt_nccl": "CUDA tensors only",
        "rdt_cuda_ipc": "CUDA tensors only, within one node",
    }
    if importlib.util.find_spec("nixl") is None:
        out["rdt_nixl"] = "the nixl package is not installed"
    return out


def move(name: str, holder: Any, loader: Any) -> float:
    """Seconds for one move of the holder's payload into the loader's buffer."""
    started = time.perf_counter()
    arrived = ray.get(MOVES[name](holder, loader), timeout=_CALL_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    if not isinstance(arrived, int) or arrived <= 0:
        raise RuntimeError(f"{name}: the loader got {arrived!r}")
    return elapsed


def verify(name: str, holder: Any, loader: Any, seed: int) -> bool:
    """One untimed move of fresh bytes into a zeroed buffer: True if every byte arrived."""
    sent = ray.get(holder.fill.remote(seed), timeout=_CALL_TIMEOUT_S)
    ray.get(loader.clear.remote(), timeout=_CALL_TIMEOUT_S)
    move(name, holder, loader)
    return bool(ray.get(loader.digest.remote(), timeout=_CALL_TIMEOUT_S) == sent)


def _pair(node_a: str, node_b: str, size: int, transports: list[str]) -> tuple[Any, Any]:
    """A holder on node A and a loader on node B; in one Gloo group if Gloo is measured."""
    holder = _actor(Holder, node_a).remote(size)
    loader = _actor(Loader, node_b).remote(size)
    ray.get([holder.info.remote(), loader.info.remote()], timeout=_CALL_TIMEOUT_S)
    if "rdt_gloo" in transports:
        from ray.experimental.collective import create_collective_group

        # Its own setup has no deadline (Gloo's rendezvous waits 30 min): give it one.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(create_collective_group, [holder, loader], "gloo").result(
                timeout=_CALL_TIMEOUT_S
            )
    return holder, loader


def bench_size(
    node_a: str, node_b: str, size: int, transports: list[str], repeats: int
) -> dict[str, Any]:
    """Every transport at one payload size: medians, ratios to the object store, and
    whether the bytes arrived intact."""
    holder, loader = _pair(node_a, node_b, size, transports)
    try:
        ray.get(holder.fill.remote(size), timeout=_CALL_TIMEOUT_S)
        for name in transports:  # warm-up: workers, connections, pools
            move(name, holder, loader)
        times: dict[str, list[float]] = {name: [] for name in transports}
        for _ in range(repeats):
            for name in transports:
                times[name].append(move(name, holder, loader))
        intact = {name: verify(name, holder, loader, seed) for seed, name in enumerate(transports)}
        processes = ray.get([holder.info.remote(), loader.info.remote()], timeout=_CALL_TIMEOUT_S)
    finally:
        for handle in (holder, loader):
            ray.kill(handle)  # a Gloo group dies with its actors
    gbps = {name: size / statistics.median(t) / 1e9 for name, t in times.items()}
    return {
        "bytes": size,
        "GBps": gbps,
        "seconds": times,
        "vs_object_store": {name: v / gbps[BASELINE] for name, v in gbps.items()},
        "intact": intact,
        "holder": processes[0],
        "loader": processes[1],
    }


@contextmanager
def two_nodes() -> Iterator[tuple[str, str, str]]:
    """:func:`common.two_nodes`, Gloo too on loopback, object stores sized for the moves."""
    os.environ.setdefault(_GLOO_IFNAME_ENV, "lo")  # Gloo's pairs bind this interface
    with common_two_nodes(
        NAMESPACE, "transport", {"object_store_memory": _NODE_STORE_BYTES}
    ) as nodes:
        yield nodes


def measure(sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Every available transport at every size, on two nodes."""
    skipped = unavailable_transports()
    transports = [name for name in MOVES if name not in skipped]
    with two_nodes() as (node_a, node_b, how):
        results = [bench_size(node_a, node_b, size, transports, repeats) for size in sizes]
        driver = _process_info()
    return {
        "nodes": how,
        "repeats": repeats,
        "transports": transports,
        "unavailable": skipped,
        "ray_auth_mode": os.environ.get(MODE_ENV),
        "RAY_worker_niceness": os.environ.get(_NICENESS_ENV),
        "driver": driver,
        "sizes": results,
    }


def run(args: Any) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    return measure(QUICK_SIZES if quick else SIZES, QUICK_REPEATS if quick else REPEATS)


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    sizes = results["sizes"]
    return [
        plots.bars(
            out / "transport.png",
            f"Node A -> node B, one payload ({results['nodes']})",
            "GB/s",
            [f"{s['bytes'] >> 20} MiB" for s in sizes],
            {name: [s["GBps"][name] for s in sizes] for name in results["transports"]},
        )
    ]
