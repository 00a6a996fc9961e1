"""The benchmarks run as a Ray job against a running cluster, as the docs tell users to.

One small run (the control-plane benchmark, ``--quick``: the real manager, channel and
Evictor, no engine) is submitted with ``ray job submit`` to a private ``ray start
--head`` cluster; it must succeed on that cluster (not on one of its own) and leave its
JSON and PNG plots in the absolute ``--out`` folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.deploy.conftest import RayHead

_JOB_TIMEOUT_S = 600
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_controlplane_benchmark_runs_as_a_ray_job(ray_head: RayHead, tmp_path: Path) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    out = tmp_path / "results"  # absolute: the job runs in a directory of Ray's choosing
    job_id = f"tierstore-bench-{uuid.uuid4().hex[:8]}"
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    submit = [ray_cli, "job", "submit", "--address", ray_head.dashboard_url]
    # No --working-dir, as the README says: the job imports the installed tierstore.
    submit += ["--submission-id", job_id, "--"]
    bench = ["python", "-m", "tierstore.deploy.bench", "controlplane", "--quick", "--out", str(out)]
    submitted = subprocess.run(
        submit + bench, env=ray_head.env, capture_output=True, text=True, timeout=_JOB_TIMEOUT_S
    )
    client = JobSubmissionClient(ray_head.dashboard_url)
    status = client.get_job_status(job_id)
    assert status == JobStatus.SUCCEEDED, (
        f"job {status}:\n{submitted.stdout[-4000:]}\n{submitted.stderr[-4000:]}\n"
        f"{client.get_job_logs(job_id)[-6000:]}"
    )

    results = json.loads((out / "controlplane.json").read_text())
    # The job's cluster, not a private one it started.
    assert results["ray_cluster"].endswith(f":{ray_head.gcs_port}")
    rows = results["rows"]
    assert [r["keys_per_request"] for r in rows] == [16, 256]
    for row in rows:
        assert row["hit_fraction"] == 1.0  # every looked-up key was stored: all HITs
        assert all(rate > 0 for rate in row["lookups_per_s"].values())
        assert row["budget"]["lookup_calls_per_step_p50"] >= row["keys_per_request"]
    for name in ("controlplane_lookups.png", "controlplane_step.png"):
        data = (out / name).read_bytes()
        assert data.startswith(_PNG_MAGIC) and len(data) > 5_000, name
