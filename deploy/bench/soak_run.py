"""The soak's run: the reference server, then tierstore's under load and a fault injector,
then a sweep that reads back every stored chunk. Imported once Ray's token auth is set."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ray
from tierstore.actors.bootstrap import ensure_actors
from tierstore.deploy.bench import soak_faults as faults
from tierstore.deploy.bench.soak import (
    NAMESPACE,
    SCHEDULE,
    Plan,
    compare,
    disk_tier_fs,
    soak_cluster,
    store_extra,
    ttfts,
)
from tierstore.deploy.bench.soak_load import Response, answers, replay, run_rounds
from tierstore.deploy.bench.soak_server import ApiServer, server_argv
from tierstore.deploy.cli import collect_status
from tierstore.deploy.models import make_tiny_model

from tierstore.config import TierStoreConfig

logger = logging.getLogger(__name__)

DEVICE_BLOCKS = 160  # 5,120 tokens: a few conversations; the rest must come from tierstore


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]


def _engine_node() -> str:
    """The node whose NodeStore holds the most chunks: the engine's (it stores locally)."""

    def held(node_id: str) -> int:
        status = faults.node_store_status(NAMESPACE, node_id) or {}
        return sum(status.get(t, {}).get("chunks", 0) for t in ("cpu", "disk"))

    return max(_alive_nodes(), key=held)


class Injector(threading.Thread):
    """Runs the fault schedule ``plan.cycles`` times, ``plan.gap_s`` apart, while the load
    runs; an exception stops it and is reported (the soak then fails)."""

    def __init__(self, cluster: Any, server: ApiServer, root: Path, fs: bool, plan: Plan):
        super().__init__(name="soak-injector", daemon=True)
        self.cluster, self.server, self.root, self.fs, self.plan = cluster, server, root, fs, plan
        self.ledger = faults.CorruptionLedger(NAMESPACE)
        self.out = faults.Injected()
        self.sweep_restart = faults.Injected()  # the sweep's own NodeStore restart
        self.errors: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            for cycle in range(self.plan.cycles):
                for name in SCHEDULE:
                    time.sleep(self.plan.gap_s)
                    self._inject(name, cycle)
                    self.ledger.poll(_alive_nodes())
        except Exception as exc:
            logger.exception("the injector stopped")
            self.errors.append(f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            self.done.set()

    def _inject(self, name: str, cycle: int) -> None:
        out, plan = self.out, self.plan
        if name == "kill_evictor":
            faults.kill_evictor(NAMESPACE, out)
        elif name == "kill_node_store":
            faults.kill_node_store(NAMESPACE, _engine_node(), self.ledger, out)
        elif name == "remove_node":
            engine = _engine_node()
            spare = next(n for n in self.cluster.worker_nodes if n.node_id != engine)
            faults.remove_node(self.cluster, spare, out)
        elif name == "corrupt_files":
            faults.corrupt_files(self.root, plan.flips, plan.tears, cycle, out)
        elif name == "fill_disk" and self.fs:
            faults.fill_disk(self.root, plan.gap_s, out)
        elif name == "fill_disk":
            out.record("fill_disk", time.monotonic(), skipped="no tmpfs: not a real full disk")
        elif name == "restart_server":
            faults.restart_server(self.server, out)


def _server_env(ray_address: str | None) -> dict[str, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return env


def reference_run(model: str, plan: Plan, out_dir: Path) -> list[Response]:
    """One round of the workload, no faults, on the same server without tierstore."""
    argv = server_argv(model, _free_port(), None, DEVICE_BLOCKS)
    server = ApiServer(argv, _server_env(None), out_dir / "soak-reference-server.log")
    server.start()
    try:
        return run_rounds(server.base, model, plan.workload, plan.concurrency, lambda _: False)
    finally:
        server.stop()


def _sweep(server: ApiServer, model: str, reference: dict, injector: Injector, plan: Plan):
    """Every reference prompt again until every corrupt file has been read. Before each
    pass the engine node's NodeStore is restarted, so no chunk is left in its CPU tier
    (where a load would never read the corrupt file behind it: a pass that finds one
    corrupt file recomputes the rest of its chain, and those chunks' new copies land in
    memory) and every hit is a promotion from disk, which verifies it; the device cache
    is emptied too. A chain with several corrupt files needs a pass per file: as many
    passes as files were corrupted (all in one chain at worst), stopping once every one
    has been read."""
    engine = _engine_node()
    swept: list[Response] = []
    prompts = [list(p) for p in reference]
    for _ in range(max(1, len(injector.out.corrupted))):
        faults.kill_node_store(NAMESPACE, engine, injector.ledger, injector.sweep_restart)
        server.reset_prefix_cache()
        swept += replay(server.base, model, prompts, plan.workload)
        injector.ledger.poll(_alive_nodes())
        if injector.out.unread() == 0:
            break
    return swept


def _figures(
    ref: list[Response], load: list[Response], swept: list[Response], inj: Injector, unread: int
) -> dict[str, Any]:
    reference = answers(ref)
    injected = len(inj.out.corrupted)
    return {
        "reference": {**compare(ref, reference), **ttfts(ref)},
        "under_faults": {**compare(load, reference), **ttfts(load)},
        "sweep": {**compare(swept, reference), **ttfts(swept)},
        "corruptions": {
            "injected": injected,
            "detected": inj.ledger.detected,
            "unread_at_end": unread,
        },
        "disk_restart": {
            "acknowledged": inj.out.disk_acknowledged,
            "found_after": inj.out.disk_found_after,
        },
        "sweep_restart": {  # after the corruption: chunks found corrupt before it are gone
            "acknowledged": inj.sweep_restart.disk_acknowledged,
            "found_after": inj.sweep_restart.disk_found_after,
        },
        "faults": inj.out.faults,
        "injector_errors": inj.errors,
    }


def soak(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    started = time.monotonic()
    models = Path(os.environ.get("TIERSTORE_TEST_MODELS") or args.out / "models")
    model = str(make_tiny_model("llama", models, "float32"))
    ref = reference_run(model, plan, args.out)
    root = args.out / "disk-tier"
    with disk_tier_fs(root, plan.tmpfs_mib) as fs, soak_cluster(1 + plan.cycles) as cluster:
        extra = store_extra(root, args.quick)
        ensure_actors(TierStoreConfig.from_extra_config(extra))
        argv = server_argv(model, _free_port(), extra, DEVICE_BLOCKS)
        server = ApiServer(argv, _server_env(cluster.address), args.out / "soak-server.log")
        server.start()
        injector = Injector(cluster, server, root, fs, plan)
        try:
            injector.start()
            load = run_rounds(
                server.base,
                model,
                plan.workload,
                plan.concurrency,
                lambda _: not injector.done.is_set(),
            )
            injector.join()
            swept = _sweep(server, model, answers(ref), injector, plan)
            unread = injector.out.unread()  # before the disk tier's tmpfs goes
            status = collect_status(NAMESPACE)["totals"]
            metrics = server.metrics()
        finally:
            injector.done.wait(600)
            server.stop()
    figures = _figures(ref, load, swept, injector, unread)
    figures.update(
        cluster_totals=status,
        server_metrics=metrics,
        tmpfs=fs,
        ray_auth_mode=os.environ.get("RAY_AUTH_MODE"),
        plan=repr(plan),
        wall_s=round(time.monotonic() - started, 1),
    )
    return figures
