"""The `tierstore` CLI as an operator runs it, against a private `ray start --head`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.deploy.conftest import RayHead
from tests.support import poll

_CLI_TIMEOUT_S = 180
_JOIN_TIMEOUT_S = 60  # the Evictor reconciles every 2 s; a raylet takes a few to register
NAMESPACE = "tierstore-cli-test"

# `ray start`, with the one check that keeps it off loopback lifted. tests/conftest.py keeps
# every cluster on 127.0.0.1 with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and Ray 2.60's
# `ray start --address` refuses to add a node under that setting (it would say 127.0.0.1
# otherwise, as the head does); turned back on, the same flag makes Ray resolve 127.0.0.1
# to the machine's routable IP. So the flag is set and the node IP is pinned to loopback.
_RAY_START_ON_LOOPBACK = """
import sys
import ray._private.ray_constants as constants
import ray._private.services as services
from ray.scripts.scripts import main

constants.ENABLE_RAY_CLUSTER = True
services.get_node_ip_address = lambda address=None: "127.0.0.1"
sys.argv[0] = "ray"
sys.exit(main())
"""


def _tierstore(head: RayHead, *args: str) -> subprocess.CompletedProcess[str]:
    cli = os.path.join(os.path.dirname(sys.executable), "tierstore")
    return subprocess.run(
        [cli, *args], env=head.env, capture_output=True, text=True, timeout=_CLI_TIMEOUT_S
    )


def test_up_status_down_on_a_running_cluster(ray_head: RayHead) -> None:
    address = f"--address=127.0.0.1:{ray_head.gcs_port}"
    cluster = (address, f"--namespace={NAMESPACE}")
    up = _tierstore(ray_head, "up", *cluster, "--cpu-bytes-per-node=64MiB", "--lease-ttl-s=5")
    assert up.returncode == 0, up.stderr[-4000:]
    assert "64.0 MiB" in up.stdout  # the status table it prints: the CPU tier's capacity
    assert "evictor shards: 1" in up.stdout.splitlines()  # "auto", on one node

    again = _tierstore(ray_head, "up", *cluster, "--cpu-bytes-per-node=64MiB")
    assert again.returncode == 0, again.stderr[-4000:]  # finds the running actors
    # Keys that define the actors must match the running ones (lease_ttl_s differed above:
    # each engine's own); other values are refused by name, both shown, nothing changed.
    other = _tierstore(
        ray_head, "up", *cluster, "--cpu-bytes-per-node=32MiB", "--eviction-policy=arc"
    )
    assert other.returncode == 2, other.stderr[-4000:]
    assert "cpu_bytes_per_node: running 67108864, this config 33554432" in other.stderr
    assert "eviction_policy: running 'lru', this config 'arc'" in other.stderr
    assert "lease_ttl_s" not in other.stderr

    status = _tierstore(ray_head, "status", *cluster, "--json")
    assert status.returncode == 0, status.stderr[-4000:]
    report = json.loads(status.stdout)
    (node,) = report["nodes"]
    assert node["cpu"] == {"used_bytes": 0, "capacity_bytes": 64 << 20, "chunks": 0}
    assert report["totals"]["indexed_chunks"] == 0
    assert report["evictor_shards"] == 1

    down = _tierstore(ray_head, "down", *cluster)
    assert down.returncode == 0, down.stderr[-4000:]
    assert "stopped 2 tierstore actor(s)" in down.stdout  # the Evictor and one NodeStore
    gone = _tierstore(ray_head, "status", *cluster)
    assert gone.returncode == 2
    assert "run `tierstore up` first" in gone.stderr


def test_errors_say_what_to_do_next(ray_head: RayHead) -> None:
    nowhere = _tierstore(ray_head, "status", "--address=127.0.0.1:1")
    assert nowhere.returncode != 0
    assert "no Ray cluster at 127.0.0.1:1" in nowhere.stderr
    assert "ray start --head" in nowhere.stderr
    typo = _tierstore(
        ray_head, "up", f"--address=127.0.0.1:{ray_head.gcs_port}", "--cpu-bytes-per-node=8XB"
    )
    assert typo.returncode == 2
    assert "cpu_bytes_per_node: expected a byte size" in typo.stderr


def test_a_raylet_started_by_hand_gets_its_node_store(ray_head: RayHead) -> None:
    """`ray start --address=...` after `tierstore up`, and nothing else run."""
    cluster = (f"--address=127.0.0.1:{ray_head.gcs_port}", f"--namespace={NAMESPACE}-join")
    up = _tierstore(ray_head, "up", *cluster, "--cpu-bytes-per-node=16MiB")
    assert up.returncode == 0, up.stderr[-4000:]
    ray_start = [sys.executable, "-c", _RAY_START_ON_LOOPBACK, "start"]
    joined = subprocess.run(
        [*ray_start, f"--address=127.0.0.1:{ray_head.gcs_port}", "--num-cpus=1"],
        env=ray_head.env,
        capture_output=True,
        text=True,
        timeout=_CLI_TIMEOUT_S,
    )
    assert joined.returncode == 0, joined.stderr[-4000:]
    # Its processes use the head's temp dir: the fixture stops them too.
    nodes = poll(
        lambda: json.loads(_tierstore(ray_head, "status", *cluster, "--json").stdout)["nodes"],
        _JOIN_TIMEOUT_S,
        poll_s=1,
        done=lambda found: len(found) >= 2,
    )
    assert len(nodes) == 2, nodes
    assert all(n["cpu"]["capacity_bytes"] == 16 << 20 for n in nodes)
    assert _tierstore(ray_head, "down", *cluster).returncode == 0
