"""The soak's faults, each with a bounded recovery, and the counters that judge them.

Everything here runs in the soak's driver process (a driver of the soak's own Ray
cluster), on the injector's thread; each Ray call has a timeout.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from tierstore.actors.bootstrap import running_evictor_names
from tierstore.actors.names import evictor_name, node_store_name

from tierstore.data.tiers.disk import ChunkRecord, chunk_records, read_record

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0
_RECOVERY_TIMEOUT_S = 120.0  # a new NodeStore: the Evictor's reconcile plus an actor start
_CORRUPT_STATS = ("corrupt_before_hit", "corrupt_after_hit")


def _node_store(namespace: str, node_id: str) -> Any | None:
    try:
        return ray.get_actor(node_store_name(node_id), namespace=namespace)
    except ValueError:
        return None


def node_store_status(namespace: str, node_id: str) -> dict[str, Any] | None:
    store = _node_store(namespace, node_id)
    if store is None:
        return None
    try:
        return ray.get(store.status.remote(), timeout=_CALL_TIMEOUT_S)
    except ray.exceptions.RayError:
        return None


@dataclass
class CorruptionLedger:
    """Corruptions the NodeStores detected, kept across NodeStore restarts: a killed
    actor's counters die with it, so each incarnation's last reading is banked."""

    namespace: str
    seen: dict[str, int] = field(default_factory=dict)  # actor id -> its last reading

    def poll(self, node_ids: list[str]) -> int:
        for node_id in node_ids:
            store = _node_store(self.namespace, node_id)
            status = node_store_status(self.namespace, node_id) if store else None
            if store is not None and status is not None:
                found = sum(int(status["stats"][c]) for c in _CORRUPT_STATS)
                self.seen[store._actor_id.hex()] = found
        return self.detected

    @property
    def detected(self) -> int:
        return sum(self.seen.values())


@dataclass
class Injected:
    """What the injector did, for the figures."""

    faults: list[dict[str, Any]] = field(default_factory=list)
    # Each chunk corrupted, as it was before (its header names it).
    corrupted: list[ChunkRecord] = field(default_factory=list)
    disk_acknowledged: int = 0  # shards on disk in a NodeStore's inventory before its kill
    disk_found_after: int = 0  # of those, in the inventory of the NodeStore that replaced it

    def record(self, kind: str, started: float, **facts: Any) -> None:
        took = round(time.monotonic() - started, 2)
        self.faults.append({"fault": kind, "recovery_s": took, **facts})
        logger.info("fault %s done in %.1f s: %s", kind, took, facts)

    def unread(self) -> int:
        """Corrupt chunks still on disk as left: never read, so never detected (nor
        served: a read verifies the checksum)."""
        left = 0
        for before in self.corrupted:
            try:
                now = read_record(before.location)
                if now is not None and now.header == before.header and not now.payload_ok():
                    left += 1
            except OSError:
                continue
        return left


def _disk_inventory(namespace: str, node_id: str) -> set[Any]:
    store = _node_store(namespace, node_id)
    if store is None:
        return set()
    held = ray.get(store.inventory.remote(), timeout=_CALL_TIMEOUT_S)
    return {shard for shard, tier in held if tier == "disk"}


def kill_node_store(namespace: str, node_id: str, ledger: CorruptionLedger, out: Injected):
    """Kills the NodeStore (no restart: the Evictor's reconcile places a new one, which
    re-indexes the node's disk tier); records how many disk shards it found again."""
    started = time.monotonic()
    before = _disk_inventory(namespace, node_id)
    ledger.poll([node_id])
    old = _node_store(namespace, node_id)
    if old is None:
        raise RuntimeError(f"no NodeStore on node {node_id} to kill")
    old_id = old._actor_id.hex()
    ray.kill(old, no_restart=True)

    def replaced() -> bool:
        new = _node_store(namespace, node_id)
        return (
            new is not None
            and new._actor_id.hex() != old_id
            and bool(node_store_status(namespace, node_id))
        )

    _wait(replaced, f"a new NodeStore on node {node_id}")
    after = _disk_inventory(namespace, node_id)
    out.disk_acknowledged += len(before)
    out.disk_found_after += len(before & after)
    out.record("kill_node_store", started, disk_before=len(before), found=len(before & after))


def kill_evictor(namespace: str, out: Injected, shard: int | None = None) -> None:
    """Kills Evictor shard ``shard`` (None: every shard); Ray restarts each and the
    NodeStores re-register their chunks with it."""
    started = time.monotonic()
    names = running_evictor_names(namespace)
    if shard is not None:
        names = [evictor_name(shard)]
    for name in names:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=False)

    def answers() -> bool:
        try:
            for name in names:
                handle = ray.get_actor(name, namespace=namespace)
                status: Any = ray.get(handle.status.remote(), timeout=_CALL_TIMEOUT_S)
                if status["chunks"] < 0:
                    return False
            return True
        except (ValueError, ray.exceptions.RayError):
            return False

    _wait(answers, "the Evictor answering after its restart")
    out.record("kill_evictor", started, shards=len(names))


def remove_node(cluster: Any, node: Any, out: Injected) -> None:
    """Removes a raylet abruptly: its NodeStore and whatever it held go with it (and the
    Evictor, if it lived there: Ray restarts it elsewhere). ``cluster.add_node`` works
    only on the main thread, so the cluster starts with a spare raylet per removal."""
    started = time.monotonic()
    cluster.remove_node(node, allow_graceful=False)
    out.record("remove_node", started, removed=node.node_id)


def corrupt_files(root: Path, flips: int, tears: int, seed: int, out: Injected) -> None:
    """Flips the last payload byte of some stored chunks and zeroes the last bytes of
    others (a write the disk never finished)."""
    started = time.monotonic()
    records = list(chunk_records(root))
    chosen = random.Random(seed).sample(records, min(len(records), flips + tears))
    for i, record in enumerate(chosen):
        where = record.location
        with open(where.path, "r+b") as f:
            f.seek(where.payload_offset + where.nbytes - 8)
            tail = f.read(8)
            torn = i >= flips and any(tail)  # a tail already zero gets a flip instead
            damaged = bytes(8) if torn else tail[:7] + bytes([tail[7] ^ 0xFF])
            f.seek(where.payload_offset + where.nbytes - 8)
            f.write(damaged)
        out.corrupted.append(record)
    out.record(
        "corrupt_files",
        started,
        chunks=len(records),
        flipped=len(chosen[:flips]),
        torn=len(chosen[flips:]),
    )


def fill_disk(root: Path, hold_s: float, out: Injected) -> None:
    """Fills the disk tier's filesystem to the last byte for ``hold_s``, then frees it."""
    started = time.monotonic()
    filler = root / "soak-filler"
    stat = os.statvfs(root)
    free = stat.f_bavail * stat.f_frsize
    # Unbuffered: a buffered file would flush what did not fit once more at close, and
    # that ENOSPC escaped this function (seen in CI as an injector error).
    with open(filler, "wb", buffering=0) as f:
        try:
            os.posix_fallocate(f.fileno(), 0, free)
        except OSError:
            pass
        try:  # whatever fallocate left (tmpfs rounds to pages): until ENOSPC
            while f.write(b"\0" * 65536):
                pass
        except OSError:
            pass
    stat = os.statvfs(root)
    left = stat.f_bavail * stat.f_frsize
    time.sleep(hold_s)
    filler.unlink()
    out.record("fill_disk", started, filled_bytes=free, bytes_left=left, held_s=hold_s)


def restart_server(server: Any, out: Injected) -> None:
    """SIGKILLs the API server's process group (server, engine core, worker), starts it."""
    started = time.monotonic()
    server.kill()
    start_s = server.start()
    out.record("restart_server", started, start_s=round(start_s, 1))


def _wait(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _RECOVERY_TIMEOUT_S
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"never saw {what} in {_RECOVERY_TIMEOUT_S} s")
        time.sleep(0.2)
