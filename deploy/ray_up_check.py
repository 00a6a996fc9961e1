"""``ray up`` launched for real on one machine, with tierstore on it, then ``ray down``.

``python -m tierstore.deploy.ray_up_check`` runs, in a private directory (its own HOME,
Ray temp dir, auth token and free ports, all on 127.0.0.1):

1. ``RAY_FAKE_CLUSTER=1 ray up -y`` on a copy of ``deploy/fake_cluster.yaml``: Ray's
   cluster launcher sets up the head with the file's commands (``ray start --head`` with
   token auth and the autoscaler, then ``tierstore up``), and the autoscaler brings up
   the file's one worker at start;
2. ``tierstore status`` shows a NodeStore on the head and that worker;
3. a second worker is asked for (``ray.autoscaler.sdk.request_resources`` of a resource
   only workers have); once the autoscaler brings it up, ``tierstore status`` shows a
   NodeStore on it too (the Evictor's reconcile placed it);
4. ``ray job submit`` runs the control-plane benchmark (``--quick``) on the cluster;
5. ``ray down -y``; then no process of the cluster, no tierstore actor process, no arena
   reaper, no arena file and no holder lock of its namespace in ``/dev/shm`` may be
   left (each killed NodeStore's reaper removes its arena a moment after; waited for up
   to ``_LEFTOVERS_TIMEOUT_S``).

Whatever fails, the cluster's processes are stopped and the directory removed. Every
wait has a deadline. The exit status is 0 only if every check passed; a JSON summary
(nodes, NodeStores, the status text, the job's result, what cleanup found, wall times)
is printed last.

The node provider the YAML names is in :mod:`tierstore.deploy.fake_provider`; the
cluster's processes are found and stopped by :mod:`tierstore.deploy.local_cluster`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psutil  # type: ignore[import-untyped]  # Ray's dependency (also vendored)
from tierstore.deploy.fake_provider import LOOPBACK
from tierstore.deploy.local_cluster import cluster_processes, stop_cluster

from tierstore.data.arena.reaper import is_reaper

logger = logging.getLogger(__name__)

CONFIG = Path(__file__).resolve().parent / "fake_cluster.yaml"
# The values fake_cluster.yaml is written with; each run replaces them with its own.
_YAML_GCS_PORT = "6379"
_YAML_DASHBOARD_PORT = "8265"
_YAML_TEMP_DIR = "/tmp/tierstore-fake-ray"
_YAML_NAMESPACE = "--namespace=tierstore"

_UP_TIMEOUT_S = 300.0
_NODES_TIMEOUT_S = 180.0
_JOB_TIMEOUT_S = 420.0
_DOWN_TIMEOUT_S = 120.0
_LEFTOVERS_TIMEOUT_S = 30.0  # reapers remove arenas at once; a loaded machine may lag
_CLI_TIMEOUT_S = 120.0

T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _wait_for(what: str, check: Callable[[], T | None], timeout_s: float, poll_s: float = 2.0) -> T:
    """``check()`` until it returns a value that is not None; TimeoutError naming
    ``what`` (and the last error ``check`` raised) past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            value = check()
            if value is not None:
                return value
        except Exception as exc:  # a CLI that failed this time: try again until the deadline
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s (last error: {last})")
        time.sleep(poll_s)


class Run:
    """One run's private directory, ports, environment and the commands against it."""

    def __init__(self, root: Path, config: Path) -> None:
        self.root = root
        self.home = root / "home"
        self.temp_dir = root / "ray"  # short: Ray's socket paths must stay < 108 bytes
        self.gcs_port = _free_port()
        self.dashboard_port = _free_port()
        self.namespace = f"raycheck{secrets.token_hex(4)}"
        self.gcs = f"{LOOPBACK}:{self.gcs_port}"
        self.dashboard = f"http://{LOOPBACK}:{self.dashboard_port}"
        self.config = root / "cluster.yaml"
        self.log = root / "launcher.log"
        text = config.read_text()
        for old, new in (
            (_YAML_GCS_PORT, str(self.gcs_port)),
            (_YAML_DASHBOARD_PORT, str(self.dashboard_port)),
            (_YAML_TEMP_DIR, str(self.temp_dir)),
            (_YAML_NAMESPACE, f"--namespace={self.namespace}"),
        ):
            if old not in text:
                raise ValueError(f"{config}: expected {old!r} in it")
            text = text.replace(old, new)
        self.config.write_text(text)
        self.home.mkdir(mode=0o700)
        (self.home / ".ray").mkdir(mode=0o700)
        token = self.home / ".ray" / "auth_token"  # as `ray get-auth-token --generate`
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        bin_dir = os.path.dirname(sys.executable)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(
            HOME=str(self.home),  # ~/.ray/auth_token, ~/ray_bootstrap_config.yaml: here
            PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
            RAY_FAKE_CLUSTER="1",
            RAY_AUTH_MODE="token",
            RAY_USAGE_STATS_ENABLED="0",
            RAY_UP_enable_autoscaler_v2="1",
            # Every process of the cluster (head, autoscaler, raylets, drivers) resolves
            # 127.0.0.1 as 127.0.0.1, not as the machine's address (tests/conftest.py).
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        )
        self.env = env

    def cli(self, *args: str, timeout_s: float = _CLI_TIMEOUT_S) -> str:
        """Run a command of the venv with the run's environment; its stdout. Raises
        ``RuntimeError`` (with the output) if it fails."""
        done = subprocess.run(
            list(args),
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(args)[:200]} exited {done.returncode}:\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            )
        return done.stdout

    def logged(self, *args: str, timeout_s: float) -> None:
        """Run a command with its output appended to ``launcher.log`` (never a pipe: a
        command that starts daemons leaves them holding it)."""
        with self.log.open("ab") as log:
            log.write(f"\n$ {shlex.join(args)}\n".encode())
            log.flush()
            done = subprocess.run(
                list(args),
                env=self.env,
                cwd=self.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=timeout_s,
            )
        if done.returncode != 0:
            tail = self.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{shlex.join(args)} exited {done.returncode}:\n{tail}")

    def python(self, code: str, *args: str) -> Any:
        """Run ``code`` in a fresh venv Python with the run's environment; it prints one
        line ``RESULT <json>``, whose value is returned here."""
        out = self.cli(sys.executable, "-c", code, *args)
        # Ray's driver prints too (autoscaler events): take the line that is ours.
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")][-1:]
        return json.loads(line.removeprefix("RESULT "))

    def tierstore(self, *args: str) -> str:
        return self.cli(
            sys.executable,
            "-m",
            "tierstore.deploy.cli",
            *args,
            f"--address={self.gcs}",
            f"--namespace={self.namespace}",
        )


# Alive nodes and which have tierstore actors, as a driver sees them (ray.nodes()).
_NODES = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level="ERROR")
nodes = [n for n in ray.nodes() if n["Alive"]]
print("RESULT", json.dumps([
    {"node_id": n["NodeID"], "ip": n["NodeManagerAddress"],
     "head": "node:__internal_head__" in n["Resources"],
     "worker_type": n["Resources"].get("tierstore_worker", 0) > 0} for n in nodes]))
"""

# Ask the autoscaler for the resources of two workers, so that a second one joins.
_REQUEST_TWO_WORKERS = """
import json, sys, ray
from ray.autoscaler.sdk import request_resources
ray.init(address=sys.argv[1], logging_level="ERROR")
request_resources(bundles=[{"tierstore_worker": 1}] * 2)
print("RESULT", json.dumps(True))
"""

_ACTOR_TITLES = ("ray::NodeStore", "ray::Evictor")  # tierstore's actors' process titles


def tierstore_actor_processes(scope: str) -> dict[int, dict[str, Any]]:
    """The cluster's tierstore actor processes (a NodeStore per node, the Evictor): pid
    -> title and niceness (0, not Ray's 15, when RAY_worker_niceness=0 reached the
    node's raylet)."""
    found = {}
    for proc in cluster_processes(scope):
        try:
            title = (proc.cmdline() or [""])[0]
            if title.startswith(_ACTOR_TITLES):
                found[proc.pid] = {"title": title.split()[0], "nice": proc.nice()}
        except psutil.Error:
            pass
    return found


def _status(run: Run) -> dict[str, Any]:
    return json.loads(run.tierstore("status", "--json"))


def _stores_on_every_node(run: Run, count: int) -> tuple[list[dict[str, Any]], dict] | None:
    """The alive nodes and the status, once ``count`` nodes are alive and ``tierstore
    status`` lists a NodeStore on each of them; else None."""
    nodes = run.python(_NODES, run.gcs, run.namespace)
    if len(nodes) != count:
        return None
    status = _status(run)
    stores = {_node_id_of(s) for s in status["nodes"]}
    if stores != {n["node_id"] for n in nodes}:
        return None
    return nodes, status


def _node_id_of(node_status: dict[str, Any]) -> str:
    for key in ("node_id", "node"):
        if key in node_status:
            return str(node_status[key])
    raise KeyError(f"no node id in a NodeStore's status: {sorted(node_status)}")


def _arena_files(namespace: str) -> list[str]:
    """This namespace's arena files and their holder locks (``/dev/shm/tierstore-<uid>/
    tierstore-<ns>+<node>`` and ``...holder-<id>.lock``), and its disk files if any."""
    found = []
    for base in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        private = base / f"tierstore-{os.getuid()}"
        if private.is_dir():
            found += [
                str(p) for p in private.iterdir() if p.name.startswith(f"tierstore-{namespace}+")
            ]
    return sorted(found)


def _remove_arena_files(namespace: str) -> list[str]:
    """Remove this namespace's arena and holder files that no process holds (what a
    NodeStore starting later would sweep); returns those removed."""
    from tierstore.data.arena.locks import unlink_if_free

    return [path for path in _arena_files(namespace) if unlink_if_free(Path(path))]


def _remove_config_cache(root: Path) -> list[str]:
    """``ray up``/``ray down`` cache the bootstrapped config in
    ``<tmp>/ray-config-<hash>`` (``ray down`` has no ``--no-config-cache``); remove the
    ones of this run (they name its directory). Returns those removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob("ray-config-*"):
        try:
            if path.is_file() and str(root) in path.read_text(errors="replace"):
                path.unlink()
                removed.append(str(path))
        except OSError:
            pass
    return removed


def arena_reapers(namespace: str) -> dict[int, str]:
    """The arena reapers of this namespace's NodeStores, pid -> the arena each watches
    (:mod:`tierstore.data.arena.reaper`): one per NodeStore while it lives, gone a
    moment after it."""
    prefix = f"tierstore-{namespace}+"
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if is_reaper(cmdline) and os.path.basename(cmdline[-1]).startswith(prefix):
            found[proc.pid] = cmdline[-1]
    return found


def _leftovers(run: Run, actor_pids: dict[str, int]) -> dict[str, list[Any] | dict[str, int]]:
    """What of the cluster and of tierstore is still there (all empty after a clean
    ``ray down``)."""
    return {
        "cluster_processes": [p.pid for p in cluster_processes(str(run.temp_dir))],
        "actor_processes": _alive(actor_pids),
        "arena_reapers": sorted(arena_reapers(run.namespace)),
        "arena_and_lock_files": _arena_files(run.namespace),
    }


def _wait_for_leftovers(run: Run, actor_pids: dict[str, int]) -> dict[str, Any]:
    """:func:`_leftovers` once all are gone, or as they are after ``_LEFTOVERS_TIMEOUT_S``
    (a killed NodeStore's reaper removes its arena a moment after ``ray down``)."""
    deadline = time.monotonic() + _LEFTOVERS_TIMEOUT_S
    while True:
        left = _leftovers(run, actor_pids)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _alive(pids: dict[str, int]) -> dict[str, int]:
    return {name: pid for name, pid in pids.items() if pid and psutil.pid_exists(pid)}


@contextmanager
def _phase(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.monotonic()
    logger.info("%s ...", name)
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - start, 1)
        logger.info("%s: %.1f s", name, timings[name])


def run_check(config: Path = CONFIG, keep: bool = False) -> dict[str, Any]:
    """The whole check (module docstring); returns its summary, ``ok`` true only if
    every step and every cleanup check passed. Never leaves the cluster running."""
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="tsu-", dir="/tmp"))  # short: socket paths
    summary: dict[str, Any] = {"ok": False, "dir": str(root), "timings_s": {}}
    timings = summary["timings_s"]
    run = Run(root, config)
    summary.update(namespace=run.namespace, gcs=run.gcs, dashboard=run.dashboard)
    actor_pids: dict[str, int] = {}
    try:
        with _phase(timings, "ray up"):
            run.logged(
                "ray", "up", "-y", "--no-config-cache", str(run.config), timeout_s=_UP_TIMEOUT_S
            )
        with _phase(timings, "head + min worker with NodeStores"):
            nodes, _ = _wait_for(
                "2 alive nodes, a NodeStore on each",
                lambda: _stores_on_every_node(run, 2),
                _NODES_TIMEOUT_S,
            )
        summary["nodes_at_start"] = nodes
        with _phase(timings, "second worker joins, gets a NodeStore"):
            run.python(_REQUEST_TWO_WORKERS, run.gcs)
            nodes, status = _wait_for(
                "3 alive nodes, a NodeStore on each",
                lambda: _stores_on_every_node(run, 3),
                _NODES_TIMEOUT_S,
            )
        summary["nodes"] = nodes
        summary["node_stores"] = [_node_id_of(s) for s in status["nodes"]]
        summary["tierstore_status"] = run.tierstore("status")
        actors = tierstore_actor_processes(str(run.temp_dir))
        actor_pids = {f"{a['title']} {pid}": pid for pid, a in actors.items()}
        summary["actor_processes"] = actors
        summary["arena_reapers"] = arena_reapers(run.namespace)
        with _phase(timings, "ray job submit"):
            summary["job"] = _submit_bench(run)
        with _phase(timings, "ray down"):
            run.logged("ray", "down", "-y", str(run.config), timeout_s=_DOWN_TIMEOUT_S)
        with _phase(timings, "after ray down, until nothing is left"):
            summary["cleanup"] = cleanup = _wait_for_leftovers(run, actor_pids)
        summary["ok"] = not any(cleanup.values())
        summary["ray_config_cache"] = _remove_config_cache(run.root)
    except Exception as exc:
        logger.exception("the check failed")
        summary["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _clean_up(run, actor_pids, summary)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
        timings["total"] = round(time.monotonic() - started, 1)
    return summary


def _clean_up(run: Run, actor_pids: dict[str, int], summary: dict[str, Any]) -> None:
    """Stops whatever the check left (none if it passed): the cluster's processes, actor
    processes and arena reapers that outlived it, arena files; records what it removed
    in ``summary``."""
    left = [p.pid for p in stop_cluster(str(run.temp_dir))]
    reapers = {f"arena reaper {pid}": pid for pid in arena_reapers(run.namespace)}
    for name, pid in {**_alive(actor_pids), **reapers}.items():
        logger.warning("killing %s (pid %d): it outlived its cluster", name, pid)
        left.append(pid)
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    summary["killed_after"] = left
    summary["arena_files_removed_after"] = _remove_arena_files(run.namespace)
    summary["log_tail"] = run.log.read_text(errors="replace")[-3000:] if run.log.exists() else ""


def _submit_bench(run: Run) -> dict[str, Any]:
    """The control-plane benchmark (``--quick``) as a Ray job, as the README tells users;
    its JSON rows."""
    out = run.root / "bench"
    job_id = f"tierstore-raycheck-{secrets.token_hex(4)}"
    run.logged(
        "ray",
        "job",
        "submit",
        "--address",
        run.dashboard,
        "--submission-id",
        job_id,
        "--",
        "python",
        "-m",
        "tierstore.deploy.bench",
        "controlplane",
        "--quick",
        "--out",
        str(out),
        timeout_s=_JOB_TIMEOUT_S,
    )
    results = json.loads((out / "controlplane.json").read_text())
    return {
        "job_id": job_id,
        "ray_cluster": results.get("ray_cluster"),
        "rows": [
            {
                "keys_per_request": r["keys_per_request"],
                "hit_fraction": r["hit_fraction"],
                "lookups_per_s": r["lookups_per_s"],
            }
            for r in results["rows"]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG, help="the cluster YAML")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    summary = run_check(args.config, keep=args.keep)
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
