"""`tierstore status` shows a disk tier degraded by failed writes, per node, and the
cluster's failed disk writes."""

from __future__ import annotations

from typing import Any

from tierstore.deploy.cli import format_status

from tierstore.control.index import IndexStats


def _node(node_id: str, disk: dict[str, Any], **stats: int) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "cpu": {"used_bytes": 3 << 20, "capacity_bytes": 1 << 30, "chunks": 31},
        "disk": {"used_bytes": 0, "capacity_bytes": 8 << 20, "chunks": 2, **disk},
        "stats": {"stored_shards": 31, "loaded_shards": 7, **stats},
    }


def _disk_row(text: str, after: str) -> str:
    lines = text.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith(after)) + 1]


def test_a_degraded_disk_tier_is_named_on_its_nodes_row_with_its_error_and_retry() -> None:
    degraded = {
        "degraded": True,
        "degraded_s": 42.3,
        "error": "ENOSPC (No space left on device)",
        "retry_in_s": 7.9,
    }
    nodes = [
        _node("aaaaaaaaaaaa0001", degraded, disk_write_failures=3, disk_writes_skipped=17),
        _node("bbbbbbbbbbbb0002", {"degraded": False}, disk_write_failures=1),
        _node("cccccccccccc0003", {}),  # a NodeStore of before: no such keys
    ]
    totals = dict.fromkeys([*vars(IndexStats()), "indexed_chunks"], 0)
    totals["disk_write_failures"] = 4
    text = format_status({"nodes": nodes, "totals": totals})

    row = _disk_row(text, "aaaaaaaaaaaa")
    assert row.split()[0] == "disk" and "8.0 MiB" in row
    assert "DEGRADED for 42 s: ENOSPC (No space left on device); retry in 8 s" in row
    assert "writes: 3 failed, 17 skipped" in row
    row = _disk_row(text, "bbbbbbbbbbbb")
    assert "DEGRADED" not in row and row.endswith("writes: 1 failed, 0 skipped")
    assert _disk_row(text, "cccccccccccc").split()[-1] == "2"  # ends at its chunks
    assert "disk writes failed 4" in text
