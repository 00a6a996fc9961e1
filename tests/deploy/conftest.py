"""A private ``ray start --head`` cluster with a dashboard, for job submission tests.

Every port is picked free (other sessions may run Ray on this machine, on the default
ports too), and ``--temp-dir`` is private, so ``ray_current_cluster`` is written there
and no one else's ``address="auto"`` finds this cluster. It is stopped by killing only
its own processes (those naming its temp dir, and their children; deploy's
:func:`~tierstore.deploy.local_cluster.stop_cluster`, as the ``ray up`` check's fake
cluster is): ``ray stop`` would stop every Ray cluster on the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tierstore.actors.bootstrap import WORKER_NICENESS_ENV, ray_start_env
from tierstore.deploy.local_cluster import stop_cluster

from tests.support import LOOPBACK, free_port

_START_TIMEOUT_S = 180


@dataclass(frozen=True)
class RayHead:
    gcs_port: int
    dashboard_url: str
    temp_dir: Path
    env: dict[str, str]  # for `ray` commands against it (its auth token, the venv's `python`)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    temp_dir = Path(tempfile.mkdtemp(prefix="tsj-", dir="/tmp"))  # short: socket paths
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ)  # the session's Ray token auth (tests/conftest.py)
    env.pop(WORKER_NICENESS_ENV, None)  # the head starts as tierstore starts one:
    env = ray_start_env(env)  # its workers at niceness 0, not Ray's 15
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"  # the job's `python`
    gcs_port, dashboard_port = free_port(), free_port()
    cmd = [os.path.join(bin_dir, "ray"), "start", "--head", "--disable-usage-stats"]
    cmd += ["--node-ip-address", LOOPBACK]
    cmd += ["--port", str(gcs_port), "--num-cpus", "2", "--temp-dir", str(temp_dir)]
    cmd += ["--dashboard-port", str(dashboard_port), "--include-dashboard=true"]
    cmd += ["--dashboard-agent-listen-port", str(free_port())]
    cmd += ["--ray-client-server-port", str(free_port())]
    try:
        started = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=_START_TIMEOUT_S
        )
        assert started.returncode == 0, f"ray start failed:\n{started.stdout}\n{started.stderr}"
        yield RayHead(
            gcs_port=gcs_port,
            dashboard_url=f"http://127.0.0.1:{dashboard_port}",
            temp_dir=temp_dir,
            env=env,
        )
    finally:
        left = stop_cluster(str(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the test's Ray head survived: {[p.pid for p in left]}"
