"""The tierstore CLI: `up` mirrors every config key, and `status` renders per node and tier."""

from __future__ import annotations

import dataclasses

import pytest
from tierstore.deploy.cli import build_parser, format_status

from tierstore.config import TierStoreConfig
from tierstore.control.index import IndexStats
from tierstore.errors import ConfigError


def _up(*flags: str) -> TierStoreConfig:
    from tierstore.deploy.cli import _config_from_flags

    return _config_from_flags(build_parser().parse_args(["up", *flags]))


def test_up_has_a_flag_for_every_config_key() -> None:
    parser = build_parser()
    up = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["up"]
    dests = {action.dest for action in up._actions}
    missing = [f.name for f in dataclasses.fields(TierStoreConfig) if f.name not in dests]
    assert missing == ["ray_address"]  # given as --address, shared with down and status


def test_up_flags_build_the_same_validated_config_as_the_engine() -> None:
    cfg = _up(
        "--cpu-bytes-per-node=2GiB",
        "--disk-path=/tmp/t",
        "--disk-bytes-per-node=10GiB",
        "--disk-fsync",
        "--eviction-policy=arc",
        "--lease-ttl-s=12.5",
        "--cpu-high-watermark=0.9",
        "--cpu-low-watermark=0.5",
        "--namespace=ns1",
    )
    assert cfg == TierStoreConfig(
        cpu_bytes_per_node=2 << 30,
        namespace="ns1",
        disk_path="/tmp/t",
        disk_bytes_per_node=10 << 30,
        disk_fsync=True,
        eviction_policy="arc",
        lease_ttl_s=12.5,
        cpu_high_watermark=0.9,
        cpu_low_watermark=0.5,
    )
    assert _up("--cpu-bytes-per-node=1GiB", "--disk-fsync=false").disk_fsync is False


def test_up_takes_a_number_of_evictor_shards_or_auto() -> None:
    assert _up("--cpu-bytes-per-node=1GiB").evictor_shards == "auto"
    assert _up("--cpu-bytes-per-node=1GiB", "--evictor-shards=auto").evictor_shards == "auto"
    assert _up("--cpu-bytes-per-node=1GiB", "--evictor-shards=12").evictor_shards == 12


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lease-ttl-s=soon"], "--lease-ttl-s: expected a number"),
        (["--disk-bytes-per-node=1GiB"], "disk_path: required"),
        (["--eviction-policy=lfu"], "supported: arc, lru"),
        (["--disk-fsync=maybe"], "disk_fsync: expected true or false"),
        # Other scripts' digits: str.isdigit(), int() and float() take them (was 12).
        (["--replicate-after-loads=\u0661\u0662"], "replicate_after_loads: expected"),
        (["--lease-ttl-s=\u0661\u0662"], "--lease-ttl-s: expected a number"),
        (["--cpu-bytes-per-node=\u0661\u0662"], "cpu_bytes_per_node: expected a byte size"),
        (["--lease-ttl-s=1e10"], "lease_ttl_s: expected a positive number of s up to 86400"),
        (["--evictor-shards=Auto2"], "evictor_shards: expected .* or 'auto'.*got 'Auto2'"),
        (["--evictor-shards=0"], "evictor_shards: expected .* got 0"),
        (["--evictor-shards=1.5"], "evictor_shards: expected .* got '1.5'"),
    ],
)
def test_up_rejects_bad_values_by_name(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _up("--cpu-bytes-per-node=1GiB", *flags)


def test_status_table_has_a_row_per_node_and_tier_with_stores_loads_corruptions() -> None:
    stats = {
        "stored_shards": 31,
        "loaded_shards": 7,
        "corrupt_on_store": 0,
        "corrupt_before_hit": 2,
        "corrupt_after_hit": 0,
    }
    node = {
        "node_id": "abcdef0123456789",
        "cpu": {"used_bytes": 3 << 20, "capacity_bytes": 1 << 30, "chunks": 31},
        "disk": {"used_bytes": 0, "capacity_bytes": 0, "chunks": 0},
        "stats": stats,
    }
    totals = dict.fromkeys([*vars(IndexStats()), "indexed_chunks"], 0)  # what the Evictor sends
    totals.update(hits=3, misses=1, failed_stores=4)
    text = format_status({"nodes": [node], "totals": totals})
    cpu_row = next(line for line in text.splitlines() if line.startswith("abcdef012345"))
    assert cpu_row.split()[-3:] == ["31", "7", "2"]  # stores, loads, corrupt
    assert "3.0 MiB" in cpu_row and "1.0 GiB" in cpu_row
    assert "hit rate 75.0 %" in text
    assert "failed stores 4" in text
    assert "evictor shards" not in text  # no shards in what it was given
    text = format_status({"nodes": [node], "totals": totals, "evictor_shards": 1, "shards": []})
    assert "evictor shards: 1" in text.splitlines()
