"""Config errors name the key; sizes and booleans parse strictly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tierstore.config import TierStoreConfig, parse_bool, parse_bytes
from tierstore.errors import ConfigError

BASE = {"spec_name": "TierStoreSpec", "spec_module_path": "tierstore.spec"}


def test_minimal_config_parses_with_defaults() -> None:
    cfg = TierStoreConfig.from_extra_config({**BASE, "cpu_bytes_per_node": 1 << 30})
    assert cfg.cpu_bytes_per_node == 1 << 30
    assert cfg.namespace == "tierstore"
    assert cfg.ray_address is None


def test_sizes_accept_units() -> None:
    cfg = TierStoreConfig.from_extra_config({**BASE, "cpu_bytes_per_node": "2GiB"})
    assert cfg.cpu_bytes_per_node == 2 << 30
    assert parse_bytes("k", "512MB") == 512_000_000
    assert parse_bytes("k", 4096) == 4096


@pytest.mark.parametrize("bad", ["lots", "-1GiB", True, [1], "1 parsec"])
def test_bad_size_names_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_per_node"):
        TierStoreConfig.from_extra_config({**BASE, "cpu_bytes_per_node": bad})


def test_missing_required_key_names_it() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_per_node: missing"):
        TierStoreConfig.from_extra_config(BASE)


def test_unknown_key_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(
        ConfigError, match=r"'cpu_byte_per_node' \(did you mean 'cpu_bytes_per_node'\?\)"
    ):
        TierStoreConfig.from_extra_config({**BASE, "cpu_bytes_per_node": 1, "cpu_byte_per_node": 2})


def test_vllm_keys_are_accepted() -> None:
    TierStoreConfig.from_extra_config(
        {**BASE, "cpu_bytes_per_node": 1, "blocks_per_chunk": 2, "offload_prompt_only": False}
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("namespace", "has space"),
        ("namespace", ""),
        ("lease_ttl_s", 0),
        ("lease_ttl_s", "soon"),
        ("transfer_timeout_s", -1),
        ("ray_address", ""),
        ("replicate_after_loads", -1),
        ("replicate_after_loads", True),
        ("replicate_after_loads", "twice"),
    ],
)
def test_bad_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        TierStoreConfig.from_extra_config({**BASE, "cpu_bytes_per_node": 1, key: value})


def test_ray_address_comes_from_env_only_when_unset() -> None:
    cfg = TierStoreConfig.from_extra_config({**BASE, "cpu_bytes_per_node": 1}, "10.0.0.1:6379")
    assert cfg.ray_address == "10.0.0.1:6379"
    cfg = TierStoreConfig.from_extra_config(
        {**BASE, "cpu_bytes_per_node": 1, "ray_address": "auto"}, "10.0.0.1:6379"
    )
    assert cfg.ray_address == "auto"


def test_config_is_frozen() -> None:
    cfg = TierStoreConfig(cpu_bytes_per_node=1)
    with pytest.raises(AttributeError):
        cfg.namespace = "other"  # type: ignore[misc]


def test_parse_bool_is_strict() -> None:
    assert parse_bool("k", "false") is False
    assert parse_bool("k", "TRUE") is True
    with pytest.raises(ConfigError, match="k"):
        parse_bool("k", "maybe")


def test_disk_keys_parse_and_validate() -> None:
    cfg = TierStoreConfig.from_extra_config(
        {
            **BASE,
            "cpu_bytes_per_node": "1GiB",
            "disk_path": "/data/ts",
            "disk_bytes_per_node": "100GiB",
            "disk_fsync": "true",
            "eviction_policy": "arc",
        }
    )
    assert cfg.disk_bytes_per_node == 100 << 30 and cfg.disk_fsync is True
    with pytest.raises(ConfigError, match="disk_path: required"):
        TierStoreConfig.from_extra_config(
            {**BASE, "cpu_bytes_per_node": 1, "disk_bytes_per_node": 5}
        )
    with pytest.raises(
        ConfigError, match="eviction_policy: unknown policy 'mru'; supported: arc, lru"
    ):
        TierStoreConfig.from_extra_config(
            {**BASE, "cpu_bytes_per_node": 1, "eviction_policy": "mru"}
        )
    with pytest.raises(ConfigError, match="cpu_low_watermark"):
        TierStoreConfig.from_extra_config(
            {**BASE, "cpu_bytes_per_node": 1, "cpu_high_watermark": 0.5, "cpu_low_watermark": 0.8}
        )
    with pytest.raises(ConfigError, match="disk_fsync"):
        TierStoreConfig.from_extra_config({**BASE, "cpu_bytes_per_node": 1, "disk_fsync": "often"})


def test_the_readme_documents_every_key() -> None:
    """The README's configuration table has a row, with bounds, for every config key."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {
        cell.strip("` ")
        for line in section.splitlines()
        if line.startswith("| `")
        for cell in line.split("|")[1].split(",")
    }
    missing = {f.name for f in dataclasses.fields(TierStoreConfig)} - rows
    assert not missing, f"README configuration table lacks {sorted(missing)}"
