"""``tierstore bench`` forwards to ``tierstore.deploy.bench``: JSON and plots land in ``--out``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tierstore.deploy.bench import hostcopy, lookup
from tierstore.deploy.cli import main


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


def test_tierstore_bench_crossnode_quick_loads_across_nodes_then_from_the_local_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # two simulated nodes of its own
    out = tmp_path / "results"
    assert main(["bench", "crossnode", "--quick", "--out", str(out)]) == 0
    results = json.loads((out / "crossnode.json").read_text())
    assert results["nodes"].startswith("simulated")
    assert set(results["transports"]) == {"object_store", "nixl"}  # setup.sh installs NIXL
    for sizes in results["transports"].values():
        for size in sizes:  # every load was verified byte for byte by the bench
            assert all(gbps > 0 for gbps in size["GBps"].values())
            assert size["copy_ready_s"] > 0
    assert (out / "crossnode.png").read_bytes().startswith(b"\x89PNG")


def test_host_copy_section_times_every_candidate_against_memcpy() -> None:
    results = hostcopy.run(repeat=1, quick=True)
    for case in results["cases"]:
        for ratios in (case["gather_vs_memcpy_time"], case["scatter_vs_memcpy_time"]):
            assert set(ratios) == {"executor", "memmove", "np-slice", "torch"}
            assert all(r > 0 for r in ratios.values())


def test_lookup_benchmark_clusters_run_the_evictor_at_the_niceness_they_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for setting, niceness in ((None, 15), ("0", 0)):  # Ray's default, then tierstore's
        case = lookup.measure_case(setting, seconds=0.2)
        assert case["evictor_niceness"] == niceness
        assert case["direct"]["n"] >= 3 and case["manager"]["keys"] >= 3 * lookup.KEYS
