"""tierstore's actors run at niceness 0 on a cluster started the way tierstore starts one.

Ray starts worker processes at niceness 15 (``RAY_worker_niceness``); beside a CPU
engine's spinning threads the Evictor and the NodeStores then got almost no CPU. The
bootstrap's ``ray start`` and ``ray_cluster.yaml`` set it to 0 (``ray_start_env``), and
so does this module's head.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.deploy.conftest import RayHead

NAMESPACE = "tierstore-nice-test"
_TIMEOUT_S = 180

# A driver on the head: the niceness of the Evictor's and the NodeStore's processes, as
# `ps -o ni` shows it.
_DRIVER = """
import json, os, subprocess, sys
import ray
from tierstore.actors.bootstrap import find_node_store, get_or_create_evictor
from tierstore.config import TierStoreConfig

ray.init(address=sys.argv[1], namespace=sys.argv[2], log_to_driver=False)
cfg = TierStoreConfig(cpu_bytes_per_node=1 << 20, namespace=sys.argv[2])
actors = {
    "evictor": get_or_create_evictor(cfg),
    "node_store": find_node_store(sys.argv[2], ray.get_runtime_context().get_node_id()),
}
out = {}
for name, actor in actors.items():
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    ps = subprocess.run(["ps", "-o", "ni=", "-p", str(pid)], capture_output=True, text=True)
    out[name] = int(ps.stdout.strip())
print(json.dumps(out))
"""


def test_tierstore_actors_are_not_niced(ray_head: RayHead) -> None:
    address = f"127.0.0.1:{ray_head.gcs_port}"
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.deploy.cli",
            "up",
            f"--address={address}",
            f"--namespace={NAMESPACE}",
            "--cpu-bytes-per-node=1MiB",
        ],
        env=ray_head.env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert up.returncode == 0, up.stderr[-4000:]
    probe = subprocess.run(
        [sys.executable, "-c", _DRIVER, address, NAMESPACE],
        env=ray_head.env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert probe.returncode == 0, probe.stderr[-4000:]
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == {"evictor": 0, "node_store": 0}
