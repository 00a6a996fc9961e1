"""``tierstore bench`` forwards to ``deploy.bench``: JSON and plots land in ``--out``."""

from __future__ import annotations

import json
from pathlib import Path

from deploy.cli import main


def test_tierstore_bench_disk_quick_writes_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "results"
    argv = ["bench", "disk", "--quick", "--out", str(out), "--disk-root", str(tmp_path)]
    assert main(argv) == 0
    results = json.loads((out / "disk.json").read_text())
    assert {r["chunk_bytes"] for r in results["throughput"]} == {256 << 10, 2 << 20}
    assert all(r["read_MBps"]["tierstore"] > 0 for r in results["throughput"])
    assert results["machine"]["cpus"] >= 1
    for name in ("disk_throughput.png", "disk_promotion.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
