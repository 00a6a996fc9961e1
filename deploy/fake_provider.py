"""The node provider ``deploy/fake_cluster.yaml`` names: Ray's fake multi-node provider
(``fake_multinode``: worker raylets the autoscaler starts on this machine) plus what
``ray up`` needs to set up its head here. The YAML says why Ray's own cannot be launched
with ``ray up``.

The launcher (``ray up``/``ray down``) and the autoscaler (in the head's monitor
process) load :class:`LocalFakeMultiNodeProvider` by module path, so this module imports
nothing of tierstore's but :mod:`tierstore.deploy.local_cluster` (which imports only
``psutil``). Every address is 127.0.0.1. Used by ``python -m
tierstore.deploy.ray_up_check``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

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
from tierstore.deploy.local_cluster import stop_cluster

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


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
