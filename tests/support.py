"""What several test folders share: simulated clusters with Ray's fast failure detection,
free ports, polling, processes holding an arena, full filesystems."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import pytest

if TYPE_CHECKING:
    import numpy as np

    from tierstore.data.arena.region import RegionInfo
    from tierstore.keys import ChunkKey
    from tierstore.wire import ShardEntry

T = TypeVar("T")

# Every cluster the tests start listens here only (tests/conftest.py says how).
LOOPBACK = "127.0.0.1"

# For clusters whose tests remove a node: a removed node is declared dead in ~3 s instead
# of ~14 s. Ray's own tests use 100 ms and 3 misses (ray-notes.md), but on this 2-core
# machine a raylet starved by engines starting beside it misses that many and a live
# node is declared dead (seen in Ray Serve LLM's scenario: a replica's node, mid-start).
# A cluster that loses no node keeps Ray's defaults.
FAST_HEALTH_CHECKS = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 5,
    "health_check_initial_delay_ms": 0,
}


# Engine tests assert that prefixes are served; on this 2-core machine a spinning CPU
# engine can delay the Evictor's answers past lookup_timeout_ms's 200 ms default
# (controlplane benchmark under full load: p50 156 ms), which would turn hits into
# correct but unasserted recomputes. The deadline itself: tests/vllm/test_lookup_deadline.py.
E2E_LOOKUP_TIMEOUT_MS = 10_000.0


def chain_entries(keys: list[ChunkKey], payload: np.ndarray, chunk_bytes: int) -> list[ShardEntry]:
    """The entries a worker stores for a chain of one-group chunks laid out back to back
    in ``payload`` (rank 0's shard of each, each naming its parent)."""
    from tierstore.data.checksum import digest
    from tierstore.wire import ShardEntry

    return [
        ShardEntry(
            key,
            i * chunk_bytes,
            chunk_bytes,
            digest(payload[i * chunk_bytes : (i + 1) * chunk_bytes]),
            1,
            keys[i - 1] if i else None,
        )
        for i, key in enumerate(keys)
    ]


class Answered(Generic[T]):
    """A reply already in hand (a ``tierstore.wire.Reply``): what an in-process double
    of an actor returns for a call its caller waits on."""

    def __init__(self, value: T) -> None:
        self.value = value

    def result(self, timeout_s: float | None = None) -> T:
        return self.value


def can_build_c() -> bool:
    """Whether ``pip install`` here compiles tierstore's optional C module: a C compiler
    and Python's headers."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which("cc") is not None and headers.exists()


def init_local_ray(namespace: str) -> str:
    """Join a fresh private Ray cluster on loopback ("local" starts one even if another
    runs on this machine); returns its GCS address."""
    import ray

    ray.init(
        address="local",
        namespace=namespace,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address=LOOPBACK,
    )
    return ray.get_runtime_context().gcs_address


def simulated_cluster(n_nodes: int, namespace: str, head_cpus: int = 0) -> tuple[Any, list[Any]]:
    """A head and ``n_nodes`` raylets of one CPU each on this machine (``ray.cluster_utils``),
    with fast failure detection; this process joins it as the driver."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "node_ip_address": LOOPBACK,
            "_system_config": FAST_HEALTH_CHECKS,
        },
    )
    nodes = [cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK) for _ in range(n_nodes)]
    ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
    return cluster, nodes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def poll(
    check: Callable[[], T],
    timeout_s: float,
    poll_s: float = 0.05,
    done: Callable[[T], object] = bool,
) -> T:
    """``check()``'s first value that ``done`` accepts (default: the first truthy one), or
    its last value once ``timeout_s`` has passed: for a caller whose own assertion on the
    value says more than a timeout message would."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(poll_s)


def wait_for(check: Callable[[], T], what: str, timeout_s: float, poll_s: float = 0.05) -> T:
    """``check()``'s first truthy value; fails the test with ``what`` after ``timeout_s``."""
    value = poll(check, timeout_s, poll_s)
    if not value:
        raise AssertionError(f"never saw {what} in {timeout_s} s (last: {value!r})")
    return value


def holder_process(arena_path: str) -> tuple[subprocess.Popen[str], str]:
    """A worker-like process holding extents of an arena: its holder lock stays taken
    until it is killed. Returns the process and its holder id."""
    code = (
        "import time\n"
        "from tierstore.data.arena.holders import HolderLock\n"
        f"lock = HolderLock({arena_path!r})\n"
        "print(lock.holder, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def overwrite(path: str | Path, offset: int, data: bytes) -> bytes:
    """Write ``data`` at ``offset`` of an existing file (damage a stored chunk on
    purpose); returns the bytes it replaced."""
    with open(path, "r+b") as f:
        f.seek(offset)
        replaced = f.read(len(data))
        f.seek(offset)
        f.write(data)
    return replaced


def flip_bit(path: str | Path, offset: int, mask: int = 0x01) -> None:
    """Flip the bits of ``mask`` in the byte at ``offset`` of a file."""
    with open(path, "rb") as f:
        f.seek(offset)
        byte = f.read(1)[0]
    overwrite(path, offset, bytes([byte ^ mask]))


def nodestore_process(
    namespace: str, node: str, nbytes: int, shm_dir: Path | None = None, reaper: bool = False
) -> tuple[subprocess.Popen[str], RegionInfo]:
    """A NodeStore-like process owning an arena (its first 8 bytes 7) until it is
    killed: it runs no shutdown hook, so its file stays (unless ``reaper``: it starts the
    arena's reaper, as a NodeStore does), its lock goes with it. Returns the process and
    its arena's ``RegionInfo``; ``shm_dir``: the region's default."""
    from tierstore.data.arena.region import SHM_DIR, RegionInfo

    code = (
        "import dataclasses, json, sys, time\n"
        "from pathlib import Path\n"
        "from tierstore.data.arena.region import ArenaRegion\n"
        "from tierstore.data.arena.reaper import start_reaper\n"
        f"r = ArenaRegion.create({namespace!r}, {node!r}, {nbytes}, "
        f"shm_dir=Path({str(shm_dir or SHM_DIR)!r}), held_wait_s=0)\n"
        f"reaper = start_reaper(r.info) if {reaper!r} else None\n"
        "r.view(0, 8)[:] = 7\n"
        "print(json.dumps(dataclasses.asdict(r.info)), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the NodeStore-like process failed to create its arena"
    return proc, RegionInfo(**json.loads(line))


@contextlib.contextmanager
def small_tmpfs(root: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` mounted at ``root`` for the ``with`` block (a real
    filesystem that fills: ENOSPC from the kernel). Mounting needs root: without it the
    calling test is skipped."""
    from tierstore.deploy.bench.soak import disk_tier_fs

    with disk_tier_fs(root, size_mib) as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root")
        yield root


def fill_filesystem(root: Path, left_free: int) -> Path:
    """Fill ``root``'s filesystem to ENOSPC, then give ``left_free`` bytes back. Returns
    the file that fills it (unlink it to free the filesystem)."""
    filler = root / "filler"
    written = 0
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                written += f.write(bytes(64 << 10))
        except OSError:
            pass
    os.truncate(filler, max(0, written - left_free))
    return filler
