"""``tierstore bench controlplane --shards``: real Evictor shards on a simulated cluster.

One quick run of S = 1 and 2 on two ``cluster_utils`` raylets with a few simulated
engines, each shard bound to a core of its own (``--shard-cores``), in a process of its
own (the benchmark starts and stops its own cluster). What it must report: every
request's calls went to one shard (none to another), lookups were answered and admits
indexed under both S, both shards held chunks, and each shard's process ran on the core
it was given. No assertion is on speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_controlplane_shards_quick_run_reports_each_shard_on_its_core(tmp_path: Path) -> None:
    out = tmp_path / "results"
    command = [sys.executable, "-m", "tierstore.deploy.bench", "controlplane", "--quick"]
    command += ["--shards", "1,2", "--engines", "4", "--nodes", "2", "--shard-cores", "1,0"]
    done = subprocess.run(
        [*command, "--out", str(out)],
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((out / "controlplane-shards.json").read_text())["rows"]
    assert [row["shards"] for row in rows] == [1, 2]
    assert [row["shard_cores"] for row in rows] == [[[1]], [[1], [0]]]
    for row in rows:
        assert row["messages"]["cross_shard"] == 0
        assert row["requests_per_s"] > 0 and row["admitted_shards_per_s"] > 0
        assert row["hit_rate"] > 0  # engines share system prompts: later lookups hit
        assert all(shard["chunks"] > 0 for shard in row["per_shard"])
