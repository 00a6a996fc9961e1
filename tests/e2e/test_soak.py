"""The fault soak: ``vllm serve`` with tierstore under concurrent load while the Evictor,
a NodeStore, a node, chunk files, the disk's free space and the server itself fail.

Runs ``tierstore bench soak --quick`` in its own process: it is the driver of its own
``ray.cluster_utils`` cluster with Ray token auth on (as every test's Ray does),
and starts two servers (one without tierstore for the reference answers). The invariants
a user sees are asserted; the timings are only reported (``soak.json``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import REPO

pytestmark = pytest.mark.e2e

_SOAK_TIMEOUT_S = 1200  # about 5 minutes alone


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("soak")
    argv = [sys.executable, "-m", "tierstore.deploy.bench", "soak", "--quick", "--out", str(out)]
    proc = subprocess.run(
        argv, cwd=REPO, env=dict(os.environ), capture_output=True, text=True,
        timeout=_SOAK_TIMEOUT_S,
    )  # fmt: skip
    log = out / "soak.log"
    tail = log.read_text(errors="replace")[-8000:] if log.exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n{tail}"
    return json.loads((out / "soak.json").read_text())


def test_every_fault_was_injected_on_a_token_auth_cluster(soak: dict) -> None:
    assert soak["injector_errors"] == []
    assert soak["ray_auth_mode"] == "token"
    done = {f["fault"] for f in soak["faults"]}
    assert done == {
        "kill_evictor",
        "kill_node_store",
        "remove_node",
        "corrupt_files",
        "fill_disk",
        "restart_server",
    }
    fill = next(f for f in soak["faults"] if f["fault"] == "fill_disk")
    if soak["tmpfs"]:  # a real full filesystem (not possible without root)
        assert fill["bytes_left"] < 64 * 1024, fill


def test_no_request_failed_and_every_output_matches_the_server_without_tierstore(
    soak: dict,
) -> None:
    for phase in ("reference", "under_faults", "sweep"):
        figures = soak[phase]
        assert figures["failed"] == 0, (phase, figures)
        assert figures["wrong_outputs"] == 0, (phase, figures)
        assert figures["served"] == figures["requests_sent"] > 0, (phase, figures)
    # tierstore served some of it (else the comparison would prove little)
    assert soak["cluster_totals"]["loaded_chunks"] > 0, soak["cluster_totals"]


def test_every_injected_corruption_is_detected(soak: dict) -> None:
    corruptions = soak["corruptions"]
    assert corruptions["injected"] > 0
    assert corruptions["unread_at_end"] == 0, corruptions  # the sweep read every one
    assert corruptions["detected"] == corruptions["injected"], corruptions


def test_chunks_on_disk_before_a_node_store_restart_are_found_after_it(soak: dict) -> None:
    restart = soak["disk_restart"]
    assert restart["acknowledged"] > 0, restart
    # --quick corrupts files only after the NodeStore restart: every chunk is found.
    assert restart["found_after"] == restart["acknowledged"], restart
    # The sweep's restart comes after the corruption: only corrupt files may be missing.
    swept = soak["sweep_restart"]
    lost = swept["acknowledged"] - swept["found_after"]
    assert swept["acknowledged"] > 0 and 0 <= lost <= soak["corruptions"]["injected"], swept
