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
   file and no holder lock of its namespace in ``/dev/shm`` may be left.

Whatever fails, the cluster's processes are stopped and the directory removed. Every
wait has a deadline. The exit status is 0 only if every check passed; a JSON summary
(nodes, NodeStores, the status text, the job's result, what cleanup found, wall times)
is printed last.

The module also holds the node provider the YAML names, :class:`LocalFakeMultiNodeProvider`
(Ray's fake multi-node provider, plus what ``ray up`` needs to set up its head on this
machine; the YAML says why Ray's own cannot be launched with ``ray up``). The launcher
(``ray up``/``ray down``) and the autoscaler (in the head's monitor process) load it by
module path, so it imports nothing of tierstore's but this module.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
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
from ray.autoscaler._private.command_runner import _with_environment_variables
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.command_runner import CommandRunnerInterface
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

logger = logging.getLogger(__name__)

CONFIG = Path(__file__).resolve().parent / "fake_cluster.yaml"
LOOPBACK = "127.0.0.1"
# The values fake_cluster.yaml is written with; each run replaces them with its own.
_YAML_GCS_PORT = "6379"
_YAML_DASHBOARD_PORT = "8265"
_YAML_TEMP_DIR = "/tmp/tierstore-fake-ray"
_YAML_NAMESPACE = "--namespace=tierstore"

_STOP_GRACE_S = 10.0
_UP_TIMEOUT_S = 300.0
_NODES_TIMEOUT_S = 180.0
_JOB_TIMEOUT_S = 420.0
_DOWN_TIMEOUT_S = 120.0
_CLI_TIMEOUT_S = 120.0

T = TypeVar("T")


# --- the node provider the YAML names -------------------------------------------------


def cluster_processes(scope: str) -> list[psutil.Process]:
    """This fake cluster's processes: those whose command line names ``scope`` (its
    Ray temp dir: every raylet, GCS and agent names its session dir) and all their
    descendants (the workers, whose titles ``ray::NodeStore`` etc. name nothing). The
    caller and its parents are never included."""
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid in mine or not any(scope in arg for arg in proc.info["cmdline"] or []):
            continue
        found[proc.pid] = proc
        try:
            found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return [p for pid, p in found.items() if pid not in mine]


def _signal_and_wait(procs: list[psutil.Process], grace_s: float) -> list[psutil.Process]:
    """SIGTERM, then after ``grace_s`` SIGKILL; returns those still alive after both."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
        if not procs:
            break
    return procs


def stop_cluster(scope: str, grace_s: float = _STOP_GRACE_S) -> list[psutil.Process]:
    """``ray stop`` for one fake cluster: the raylets first (SIGTERM, then SIGKILL after
    ``grace_s``; their workers exit with them), then everything else of ``scope``, the
    GCS last, as ``ray stop`` orders them. Returns what is still alive. Blocks up to
    about ``4 * grace_s``."""
    procs = cluster_processes(scope)
    raylets = [p for p in procs if _named(p, "raylet")]
    gcs = [p for p in procs if _named(p, "gcs_server")]
    rest = [p for p in procs if p not in raylets and p not in gcs]
    left = []
    for bucket in (raylets, rest, gcs):
        left += _signal_and_wait(bucket, grace_s)
    return left + [p for p in cluster_processes(scope) if p not in left]


def _named(proc: psutil.Process, name: str) -> bool:
    try:
        return proc.name() == name or any(os.path.basename(a) == name for a in proc.cmdline()[:1])
    except psutil.Error:
        return False


def _is_ray_stop(cmd: str) -> bool:
    try:
        words = shlex.split(cmd)
    except ValueError:
        return False
    return len(words) >= 2 and os.path.basename(words[0]) == "ray" and words[1] == "stop"


class LocalCommandRunner(CommandRunnerInterface):
    """Runs a node's commands on this machine, as SSH would on the node: ``bash -c``
    with the updater's environment variables exported. ``ray stop`` stops this cluster's
    processes only (:func:`stop_cluster`), not every Ray cluster on the machine. A file
    mount is a copy. Blocks for the command; raises ``CalledProcessError`` if it fails."""

    def __init__(self, log_prefix: str, scope: str) -> None:
        self._log_prefix = log_prefix
        self._scope = scope

    def run(  # noqa: PLR0913 - Ray's CommandRunnerInterface.run
        self,
        cmd: str | None = None,
        timeout: int = 120,
        exit_on_fail: bool = False,
        port_forward: Any = None,
        with_output: bool = False,
        environment_variables: dict[str, object] | None = None,
        run_env: str = "auto",
        ssh_options_override_ssh_key: str = "",
        shutdown_after_run: bool = False,
    ) -> str:
        if not cmd:
            return ""
        if _is_ray_stop(cmd):
            left = stop_cluster(self._scope)
            if left:
                raise subprocess.CalledProcessError(1, cmd, f"still alive: {left}")
            return ""
        if environment_variables:
            cmd = _with_environment_variables(cmd, environment_variables)
        logger.info("%srunning locally: %s", self._log_prefix, cmd)
        # Output to a file, never a pipe: `ray start` leaves daemons that would hold it.
        with tempfile.TemporaryFile() as out:
            done = subprocess.run(
                ["bash", "-c", cmd],
                stdout=out if with_output else None,
                stdin=subprocess.DEVNULL,
                timeout=timeout,
                check=False,
            )
            out.seek(0)
            text = out.read().decode(errors="replace")
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, cmd, text)
        return text

    def run_rsync_up(self, source: str, target: str, options: Any = None) -> None:
        _copy(source, target)

    def run_rsync_down(self, source: str, target: str, options: Any = None) -> None:
        _copy(source, target)

    def remote_shell_command_str(self) -> str:
        return "bash"

    def run_init(self, *, as_head: bool, file_mounts: dict[str, str], sync_run_yet: bool) -> None:
        return None


def _copy(source: str, target: str) -> None:
    src = Path(os.path.expanduser(source.rstrip("/") or "/"))
    dst = Path(os.path.expanduser(target.rstrip("/") or "/"))
    if src.resolve() == dst.resolve():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        shutil.copy2(src, dst)


class LocalFakeMultiNodeProvider(FakeMultiNodeProvider):
    """Ray's fake multi-node provider (``fake_multinode``) that ``ray up`` can launch:
    its head is this machine, set up by :class:`LocalCommandRunner`; ``ray up`` may tag
    it and ``ray down`` terminate it (stops the cluster's processes). Worker nodes are
    Ray's fake ones: raylets the autoscaler starts in its own process, here on
    127.0.0.1 and in the head's temp dir.

    Provider config keys besides Ray's: ``gcs_address`` (host:port, required here),
    ``temp_dir`` (the head's ``--temp-dir``; what ``ray stop`` stops)."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        os.environ.setdefault("RAY_FAKE_CLUSTER", "1")  # the base refuses to start without
        super().__init__(provider_config, cluster_name)
        self._scope = str(provider_config["temp_dir"])

    def get_command_runner(  # noqa: PLR0913 - Ray's NodeProvider.get_command_runner
        self,
        log_prefix: str,
        node_id: str,
        auth_config: dict[str, Any],
        cluster_name: str,
        process_runner: Any,
        use_internal_ip: bool,
        docker_config: dict[str, Any] | None = None,
    ) -> CommandRunnerInterface:
        return LocalCommandRunner(log_prefix, self._scope)

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        with self.lock:
            self._nodes[node_id]["tags"].update(tags)

    def create_node(self, node_config: dict[str, Any], tags: dict[str, str], count: int) -> None:
        if tags.get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD:
            with self.lock:  # this machine: the head "exists" once `ray up` asks for it
                self._nodes[self._head_node_id] = {"tags": dict(tags)}
            return
        self.create_node_with_resources_and_labels(node_config, tags, count, {}, {})

    def terminate_node(self, node_id: str) -> None:
        with self.lock:
            if node_id != self._head_node_id:
                super().terminate_node(node_id)
                return
            left = stop_cluster(self._scope)
            if left:
                raise RuntimeError(f"head processes still alive: {[p.pid for p in left]}")
            self._nodes.pop(node_id, None)

    def _create_node_with_resources_and_labels(
        self,
        node_config: dict[str, Any],
        tags: dict[str, str],
        count: int,
        resources: dict[str, Any],
        labels: dict[str, str],
    ) -> None:
        """As Ray's, but on 127.0.0.1 (Ray's would pick the machine's address)."""
        import ray
        import ray._private.ray_constants as ray_constants

        resources = copy.deepcopy(resources)
        with self.lock:
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            next_id = self._next_hex_node_id()
            ray_params = ray._private.parameter.RayParams(
                node_ip_address=LOOPBACK,
                min_worker_port=0,
                max_worker_port=0,
                dashboard_port=None,
                dashboard_agent_listen_port=0,
                num_cpus=resources.pop("CPU", 0),
                num_gpus=resources.pop("GPU", 0),
                object_store_memory=resources.pop("object_store_memory", None),
                resources=resources,
                labels=labels,
                redis_address=self._gcs_address,
                gcs_address=self._gcs_address,
                env_vars={
                    "RAY_OVERRIDE_NODE_ID_FOR_TESTING": next_id,
                    "RAY_CLOUD_INSTANCE_ID": next_id,
                    "RAY_NODE_TYPE_NAME": node_type,
                    ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: json.dumps(resources),
                    ray_constants.LABELS_ENVIRONMENT_VARIABLE: json.dumps(labels),
                },
            )
            node = ray._private.node.Node(
                ray_params, head=False, shutdown_at_exit=False, spawn_reaper=False
            )
            entry: dict[str, Any] = {
                "tags": {
                    TAG_RAY_NODE_KIND: NODE_KIND_WORKER,
                    TAG_RAY_USER_NODE_TYPE: node_type,
                    TAG_RAY_NODE_NAME: next_id,
                    TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
                    **tags,
                },
                "node": node,
            }
            self._nodes[next_id] = entry


# --- the check ------------------------------------------------------------------------


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
        with _phase(timings, "ray job submit"):
            summary["job"] = _submit_bench(run)
        with _phase(timings, "ray down"):
            run.logged("ray", "down", "-y", str(run.config), timeout_s=_DOWN_TIMEOUT_S)
        summary["cleanup"] = cleanup = {
            "cluster_processes": [p.pid for p in cluster_processes(str(run.temp_dir))],
            "actor_processes": _alive(actor_pids),
            "arena_and_lock_files": _arena_files(run.namespace),
        }
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
    processes that outlived it, arena files; records what it removed in ``summary``."""
    left = stop_cluster(str(run.temp_dir))
    for name, pid in _alive(actor_pids).items():
        logger.warning("killing %s (pid %d): it outlived its cluster", name, pid)
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    summary["killed_after"] = [p.pid for p in left]
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
