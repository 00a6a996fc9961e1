"""Joining the Ray cluster and starting or finding tierstore's actors.

Every actor (the Evictor's shards, a NodeStore per node) is named and detached in the
configured Ray namespace, so they outlive any engine and a later engine, in a new
process, finds the chunks an earlier one stored.
Their owner is ``tierstore down`` (:func:`shutdown_actors`).
"""

from __future__ import annotations

import dataclasses
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
from typing import cast

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tierstore.actors.calls import Pending
from tierstore.actors.clients import DEFAULT_TIMEOUT_S, EvictorClient, NodeStoreClient
from tierstore.actors.evictor import Evictor
from tierstore.actors.names import evictor_name
from tierstore.actors.placement import alive_node_ids, node_store_name, place_node_store

from tierstore.config import (
    AUTO_SHARDS,
    MAX_EVICTOR_SHARDS,
    TierStoreConfig,
    check_running_config,
    evictor_shards_for,
)
from tierstore.errors import ActorUnavailableError, ClusterUnavailableError
from tierstore.private_files import LockTimeoutError, locked_file, user_dir

logger = logging.getLogger(__name__)

# The lock that keeps this user's engines on this machine from starting two Ray clusters
# at once: in this user's 0700 directory of the temporary folder (start_lock_path).
_START_LOCK_NAME = "ray-start.lock"
# Its holder runs `ray start --head` (up to _RAY_START_TIMEOUT_S) and joins the cluster;
# one held longer than this is stuck, or another process's: fail naming the file.
_RAY_START_TIMEOUT_S = 120.0
_START_LOCK_TIMEOUT_S = _RAY_START_TIMEOUT_S + 60.0
_GRACE_S = 5.0  # given to an actor's __ray_terminate__ before it is killed
_PROBE_TIMEOUT_S = 5.0  # a GCS that does not accept a TCP connection by then is not there
# Starting every actor: a process per actor, and a NodeStore re-indexes its disk tier
# first; minutes on a loaded machine, never forever.
START_TIMEOUT_S = 300.0
_RESTART_POLL_S = 0.2  # between asks of an Evictor shard that is restarting


def connect(cfg: TierStoreConfig) -> None:
    """Join Ray once per process: the configured address, else a local cluster.

    When no address is configured and no local cluster runs, start one with
    ``ray start --head`` (not in-process), so it outlives this engine and the next engine
    finds what this one stored. A file lock keeps concurrent workers from starting two;
    blocks up to ``_START_LOCK_TIMEOUT_S`` for it, then raises
    :class:`~tierstore.private_files.LockTimeoutError` naming the file.
    """
    if ray.is_initialized():
        return
    if cfg.ray_address is not None:
        _init(cfg.ray_address, cfg)
        return
    lock_path = start_lock_path()
    try:
        with locked_file(lock_path, _START_LOCK_TIMEOUT_S):
            try:
                _init("auto", cfg)
                return
            except ConnectionError:
                logger.info("no Ray cluster is running here; starting one with `ray start --head`")
            _start_local_head()
            _init("auto", cfg)
    except LockTimeoutError as exc:
        raise LockTimeoutError(
            f"cannot start a local Ray cluster: {exc}; or set ray_address (RAY_ADDRESS) to "
            "join a running cluster"
        ) from exc


def this_node_id() -> str:
    """The Ray node this process works for; start-up only (one GCS call, bounded by
    Ray's client timeout).

    That is the node of the raylet that started this process or its nearest Ray worker
    ancestor (``RAY_RAYLET_PID``: Ray sets it for every worker, and children inherit
    it), else the node this process's own Ray connection attached to. The two differ
    for a process a Ray worker starts outside Ray (vLLM's engine core and workers under
    Ray Serve LLM) on a host that runs several raylets: ``ray.init`` attaches a driver
    to the host's head raylet, whichever raylet its parent belongs to. A ``ray job
    submit`` driver has no such variable (Ray strips it). An unreadable or stale one
    (that process gone, or not a raylet of this cluster) falls back with a warning.
    """
    attached = ray.get_runtime_context().get_node_id()
    raylet_pid = os.environ.get("RAY_RAYLET_PID")
    if raylet_pid is None:
        return attached
    parent = _raylet_node_id(raylet_pid)
    if parent is None or (parent != attached and parent not in alive_node_ids()):
        logger.warning(
            "RAY_RAYLET_PID=%r names no raylet of this cluster; working for node %s, the "
            "one this process attached to",
            raylet_pid,
            attached,
        )
        return attached
    return parent


def _raylet_node_id(pid: str) -> str | None:
    """The ``--node_id`` of the raylet process ``pid`` (from its command line), or None."""
    try:
        cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    words = cmdline.replace(b"\0", b" ").decode(errors="replace").split()
    if not words or Path(words[0]).name != "raylet":
        return None
    for word in words:
        if word.startswith("--node_id="):
            return word.removeprefix("--node_id=")
    return None


def start_lock_path() -> Path:
    """The start lock: in this user's private directory of the temporary folder (made
    0700 on first use), so no other user can plant, hold or link it."""
    return user_dir(Path(tempfile.gettempdir())) / _START_LOCK_NAME


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
            raise ClusterUnavailableError(not_joined(address, exc)) from exc
        raise


def not_joined(address: str, exc: BaseException) -> str:
    """What to do when ``ray.init(address)`` failed: no cluster there, or (its port
    answered) one whose token authentication this process does not match."""
    return (
        f"could not join a Ray cluster at {address!r}: start one with `ray start --head`, or "
        "fix ray_address / RAY_ADDRESS / --address; if one runs there, RAY_AUTH_MODE and the "
        f"token (RAY_AUTH_TOKEN, ~/.ray/auth_token) must match the cluster's ({exc})"
    )


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
        timeout=_RAY_START_TIMEOUT_S,
        env=ray_start_env(os.environ),
    )
    if result.returncode != 0:
        raise ClusterUnavailableError(
            f"`ray start --head` failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
        )


def get_or_create_evictor(cfg: TierStoreConfig) -> ray.actor.ActorHandle:
    """Evictor shard 0's handle, after every shard is started or found and checked
    (:func:`get_or_create_evictors`); what a caller of shard 0 alone holds."""
    return get_or_create_evictors(cfg)[0]


def evictor_clients(
    cfg: TierStoreConfig, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[EvictorClient]:
    """One client per Evictor shard, in shard order (index = shard), each with
    ``timeout_s`` as its deadline; the shards are started or found and checked first
    (:func:`get_or_create_evictors`). As many as shard 0 runs with, whatever ``cfg``'s
    ``evictor_shards`` (``"auto"`` included)."""
    return [EvictorClient(handle, timeout_s) for handle in get_or_create_evictors(cfg)]


def get_or_create_evictors(cfg: TierStoreConfig) -> list[ray.actor.ActorHandle]:
    """Every Evictor shard (named :func:`~tierstore.actors.names.evictor_name`), in shard
    order: :func:`running_evictors`' handles."""
    return running_evictors(cfg)[1]


def running_evictors(cfg: TierStoreConfig) -> tuple[TierStoreConfig, list[ray.actor.ActorHandle]]:
    """``cfg`` as the actors run it, and every Evictor shard's handle in shard order.

    Shard 0 is started or found first, next to its first caller (`tierstore up` runs on
    the head node, which lives as long as the cluster), and its config checked: one
    started earlier with other values of :data:`~tierstore.config.ACTOR_KEYS` raises
    :class:`~tierstore.config.ConfigMismatchError` naming them, and nothing more is
    started. ``evictor_shards`` is fixed there: a new shard 0 gets ``cfg``'s number, or
    for ``"auto"`` :func:`~tierstore.config.evictor_shards_for` the nodes alive now; a
    caller whose ``cfg`` says ``"auto"`` adopts the number shard 0 runs with (of two
    racing, both end with the winner's), and the config returned names it. Shard ``i``
    then starts on the ``i``-th alive node after this one (round-robin); soft, so a
    restart after that node's loss goes elsewhere. Blocks until every shard answers
    which config it runs with (up to ``START_TIMEOUT_S`` in all)."""
    here = this_node_id()
    nodes = [here, *sorted(alive_node_ids() - {here})]
    deadline = time.monotonic() + START_TIMEOUT_S
    first = _start_evictor(_first_shard_config(cfg, len(nodes)), 0, here)
    cfg = _adopt_shards(cfg, _running_config(first, deadline))
    rest = [_start_evictor(cfg, i, nodes[i % len(nodes)]) for i in range(1, cfg.shard_count)]
    for shard, handle in enumerate(rest, start=1):
        running = _running_config(handle, deadline)
        check_running_config(cfg, running, _evictor_what(shard, cfg.shard_count))
    return cfg, [first, *rest]


def _running_config(handle: ray.actor.ActorHandle, deadline: float) -> TierStoreConfig:
    """The config an Evictor shard runs with; one that is restarting (its node was lost:
    Ray brings it back elsewhere) is asked again until ``deadline``, then raises."""
    while True:
        left = max(0.0, deadline - time.monotonic())
        try:
            return EvictorClient(handle, left).config().result(left)
        except ActorUnavailableError:
            if deadline - time.monotonic() <= _RESTART_POLL_S:
                raise
            time.sleep(_RESTART_POLL_S)


def _first_shard_config(cfg: TierStoreConfig, nodes: int) -> TierStoreConfig:
    """What Evictor shard 0 starts with if none runs yet: ``cfg``, its ``"auto"`` shards
    chosen for ``nodes`` alive nodes."""
    if cfg.evictor_shards != AUTO_SHARDS:
        return cfg
    return dataclasses.replace(cfg, evictor_shards=evictor_shards_for(nodes))


def _adopt_shards(cfg: TierStoreConfig, running: TierStoreConfig) -> TierStoreConfig:
    """``cfg`` checked against shard 0's ``running`` config, with its shard count."""
    check_running_config(cfg, running, _evictor_what(0, running.shard_count))
    if cfg.evictor_shards == AUTO_SHARDS:
        logger.info("evictor_shards 'auto': %d, as Evictor shard 0 runs", running.shard_count)
    return dataclasses.replace(cfg, evictor_shards=running.shard_count)


def _start_evictor(cfg: TierStoreConfig, shard: int, node_id: str) -> ray.actor.ActorHandle:
    """Start (or find) Evictor shard ``shard``, softly on ``node_id``; never waits."""
    # Ray's stubs type .remote() on a class as the class or its handle: it is a handle.
    return cast(
        "ray.actor.ActorHandle",
        ray.remote(Evictor)
        .options(
            name=evictor_name(shard),
            namespace=cfg.namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            # Killed or crashed, it comes back and rebuilds its index from the NodeStores.
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True),
        )
        .remote(cfg, shard),
    )


def _evictor_what(shard: int, shards: int) -> str:
    """How errors name an Evictor shard ("the Evictor" when there is one)."""
    return "the Evictor" if shards == 1 else f"Evictor shard {shard}"


def get_or_create_node_store(
    cfg: TierStoreConfig, node_id: str | None = None
) -> ray.actor.ActorHandle:
    """The NodeStore of ``node_id`` (default: this process's node), pinned to it; after
    the Evictor shards' configs are checked (:func:`running_evictors`), so a config
    that differs starts nothing; a new NodeStore runs with their shard count. Returns
    without waiting on the NodeStore."""
    node_id = node_id or this_node_id()
    resolved, _ = running_evictors(cfg)
    return place_node_store(resolved, node_id)


def find_node_store(namespace: str, node_id: str) -> ray.actor.ActorHandle:
    try:
        return ray.get_actor(node_store_name(node_id), namespace=namespace)
    except ValueError as exc:
        raise ClusterUnavailableError(f"no NodeStore on node {node_id}") from exc


def start_actors(cfg: TierStoreConfig) -> list[Pending[TierStoreConfig]]:
    """Start (or find) every Evictor shard and one NodeStore on every alive node. Blocks
    until the shards answer (a config that differs from theirs raises there, before any
    NodeStore starts); returns one ``config`` call per actor, each answered once that
    actor is up, with ``START_TIMEOUT_S`` as its deadline (a caller may show progress,
    and checks each with :func:`check_started`). New NodeStores run with the shards'
    shard count (:func:`running_evictors`)."""
    resolved, handles = running_evictors(cfg)
    evictors = [EvictorClient(handle, START_TIMEOUT_S) for handle in handles]
    stores = [
        NodeStoreClient(place_node_store(resolved, node_id), node_id, START_TIMEOUT_S)
        for node_id in sorted(alive_node_ids())
    ]
    return [*[evictor.config() for evictor in evictors], *[store.config() for store in stores]]


def check_started(
    cfg: TierStoreConfig, started: Pending[TierStoreConfig], timeout_s: float
) -> None:
    """Wait up to ``timeout_s`` for one of :func:`start_actors`' calls; raise if that
    actor failed to start, or runs with other values of the actor keys than ``cfg``."""
    actor = started.what.replace(".config", "", 1)  # "NodeStore on node ..."
    check_running_config(cfg, started.result(timeout_s), actor)


def ensure_actors(cfg: TierStoreConfig) -> None:
    """Every Evictor shard plus one NodeStore on every alive node; returns once all
    answer, within ``START_TIMEOUT_S`` in all."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for started in start_actors(cfg):
        check_started(cfg, started, max(0.0, deadline - time.monotonic()))


def shutdown_actors(namespace: str) -> int:
    """Stop every tierstore actor in ``namespace``: graceful first, then forced. The
    Evictor shards go first, the last shard first (:func:`running_evictor_names`), then
    the NodeStores."""
    names = running_evictor_names(namespace)[::-1]
    names += [node_store_name(n["NodeID"]) for n in ray.nodes()]
    stopped = 0
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        done: ray.ObjectRef = handle.__ray_terminate__.remote()
        ready, _ = ray.wait([done], timeout=_GRACE_S)
        if not ready:
            ray.kill(handle)
        stopped += 1
    deadline = time.monotonic() + _GRACE_S
    while time.monotonic() < deadline and any(_exists(n, namespace) for n in names):
        time.sleep(0.1)
    return stopped


def running_evictor_names(namespace: str) -> list[str]:
    """The names of the Evictor shards running in ``namespace``, in shard order, with no
    config in hand: shard 0, 1, ... up to the first one missing. Shards are stopped last
    first (:func:`shutdown_actors`), so one stopped half-way still leaves shards
    0..k-1 to find."""
    names = []
    for shard in range(MAX_EVICTOR_SHARDS):
        if not _exists(evictor_name(shard), namespace):
            break
        names.append(evictor_name(shard))
    return names


def _exists(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False
