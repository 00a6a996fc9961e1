"""Joining the Ray cluster and starting or finding tierstore's actors.

Both actors are named and detached in the configured Ray namespace, so they outlive any
engine and a later engine, in a new process, finds the chunks an earlier one stored.
Their owner is ``tierstore down`` (:func:`shutdown_actors`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tierstore.actors.evictor import Evictor
from tierstore.actors.placement import (
    EVICTOR_NAME,
    alive_node_ids,
    node_store_name,
    place_node_store,
)

from tierstore.config import TierStoreConfig
from tierstore.errors import ClusterUnavailableError

logger = logging.getLogger(__name__)

_START_LOCK = Path(tempfile.gettempdir()) / "tierstore-ray-start.lock"
_GRACE_S = 5.0  # given to an actor's __ray_terminate__ before it is killed
_PROBE_TIMEOUT_S = 5.0  # a GCS that does not accept a TCP connection by then is not there
# Starting every actor: a process per actor, and a NodeStore re-indexes its disk tier
# first; minutes on a loaded machine, never forever.
_START_TIMEOUT_S = 300.0


def connect(cfg: TierStoreConfig) -> None:
    """Join Ray once per process: the configured address, else a local cluster.

    When no address is configured and no local cluster runs, start one with
    ``ray start --head`` (not in-process), so it outlives this engine and the next engine
    finds what this one stored. A file lock keeps concurrent workers from starting two.
    """
    if ray.is_initialized():
        return
    if cfg.ray_address is not None:
        _init(cfg.ray_address, cfg)
        return
    with open(_START_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _init("auto", cfg)
            return
        except ConnectionError:
            logger.info("no Ray cluster is running here; starting one with `ray start --head`")
        _start_local_head()
        _init("auto", cfg)


def check_reachable(address: str, timeout_s: float = _PROBE_TIMEOUT_S) -> None:
    """Fail fast on an ``ip:port`` with no GCS behind it: ``ray.init`` would retry for
    minutes before it gives up with a vaguer error."""
    if address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise ClusterUnavailableError(
            f"no Ray cluster at {address}: start one with `ray start --head` or pass "
            f"--address / ray_address / RAY_ADDRESS ({exc})"
        ) from exc


def _init(address: str, cfg: TierStoreConfig) -> None:
    check_reachable(address)
    try:
        ray.init(
            address=address,
            namespace=cfg.namespace,
            ignore_reinit_error=True,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except ConnectionError as exc:
        if address != "auto":
            raise ClusterUnavailableError(
                f"no Ray cluster at {address!r}: start one with `ray start --head` or fix "
                f"ray_address / RAY_ADDRESS ({exc})"
            ) from exc
        raise


# Ray starts worker processes, tierstore's actors among them, at niceness 15: beside a
# CPU engine's spinning threads they then get almost no CPU (Evictor calls time out, Ray
# once declared the Evictor dead). The raylet reads this at `ray start`; 0 = as any
# process. A value the caller already set is kept.
WORKER_NICENESS_ENV = "RAY_worker_niceness"
WORKER_NICENESS = "0"


def ray_start_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for a `ray start` whose workers are not starved."""
    return {WORKER_NICENESS_ENV: WORKER_NICENESS, **environ}


def _start_local_head() -> None:
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_cli is None:
        raise ClusterUnavailableError("cannot start Ray: the `ray` command is not installed")
    result = subprocess.run(
        [ray_cli, "start", "--head", "--disable-usage-stats"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ray_start_env(os.environ),
    )
    if result.returncode != 0:
        raise ClusterUnavailableError(
            f"`ray start --head` failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
        )


def get_or_create_evictor(cfg: TierStoreConfig) -> ray.actor.ActorHandle:
    """Created next to its first caller (`tierstore up` runs on the head node, which
    lives as long as the cluster); soft, so a restart after that node's loss goes
    elsewhere."""
    here = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(Evictor)
        .options(
            name=EVICTOR_NAME,
            namespace=cfg.namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            # Killed or crashed, it comes back and rebuilds its index from the NodeStores.
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
        )
        .remote(cfg)
    )


def get_or_create_node_store(
    cfg: TierStoreConfig, node_id: str | None = None
) -> ray.actor.ActorHandle:
    """The NodeStore of ``node_id`` (default: this process's node), pinned to it."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    get_or_create_evictor(cfg)
    return place_node_store(cfg, node_id)


def find_node_store(namespace: str, node_id: str) -> ray.actor.ActorHandle:
    try:
        return ray.get_actor(node_store_name(node_id), namespace=namespace)
    except ValueError as exc:
        raise ClusterUnavailableError(f"no NodeStore on node {node_id}") from exc


def start_actors(cfg: TierStoreConfig) -> list[ray.ObjectRef]:
    """Start (or find) the Evictor and one NodeStore on every alive node; returns one
    ``status`` call per actor, ready once that actor is up (a caller may show progress)."""
    evictor = get_or_create_evictor(cfg)
    handles = [get_or_create_node_store(cfg, node_id) for node_id in alive_node_ids()]
    return [evictor.status.remote(), *[h.status.remote() for h in handles]]


def ensure_actors(cfg: TierStoreConfig) -> None:
    """Evictor plus one NodeStore on every alive node; returns once all answer."""
    ray.get(start_actors(cfg), timeout=_START_TIMEOUT_S)


def shutdown_actors(namespace: str) -> int:
    """Stop every tierstore actor in ``namespace``: graceful first, then forced."""
    names = [EVICTOR_NAME] + [node_store_name(n["NodeID"]) for n in ray.nodes()]
    stopped = 0
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        done = handle.__ray_terminate__.remote()
        ready, _ = ray.wait([done], timeout=_GRACE_S)
        if not ready:
            ray.kill(handle)
        stopped += 1
    deadline = time.monotonic() + _GRACE_S
    while time.monotonic() < deadline and any(_exists(n, namespace) for n in names):
        time.sleep(0.1)
    return stopped


def _exists(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False
