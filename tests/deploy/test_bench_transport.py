"""``tierstore bench transport``: every transport it measures (the object store, the
loader's own pull, RDT over Gloo) moves a payload from node A's actor to node B's, and
the bytes that arrive are the bytes that were sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tierstore.deploy.cli import main


def test_tierstore_bench_transport_quick_moves_every_byte_by_every_transport(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # two simulated nodes of its own
    out = tmp_path / "results"
    assert main(["bench", "transport", "--quick", "--out", str(out)]) == 0
    results = json.loads((out / "transport.json").read_text())
    assert results["nodes"].startswith("simulated")
    assert {"object_store", "object_store_pull", "rdt_gloo"} <= set(results["transports"])
    assert results["ray_auth_mode"] == "token"
    for size in results["sizes"]:
        assert size["holder"]["node"] != size["loader"]["node"]
        assert size["holder"]["niceness"] == size["loader"]["niceness"] == 0
        # Fresh random bytes into a zeroed buffer, digests compared: nothing dropped or
        # corrupted on the way.
        assert size["intact"] == {name: True for name in results["transports"]}, size
        assert all(len(times) == results["repeats"] for times in size["seconds"].values())
        assert all(gbps > 0 for gbps in size["GBps"].values())
    assert (out / "transport.png").read_bytes().startswith(b"\x89PNG")
