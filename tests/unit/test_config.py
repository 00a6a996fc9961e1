"""Config errors name the key; sizes and booleans parse strictly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tierstore.config import (
    ACTOR_KEYS,
    ENGINE_KEYS,
    MAX_EVICTOR_SHARDS,
    ConfigMismatchError,
    TierStoreConfig,
    check_running_config,
    evictor_shards_for,
    parse_bool,
    parse_bytes,
)
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


# ---- values accepted once and failing later (issue 26) ---------------------------------------
def _extra(**values: object) -> dict[str, object]:
    return {**BASE, "cpu_bytes_per_node": 1, **values}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lease_ttl_s", 1e300),  # a lease that never ends
        ("lease_ttl_s", 86_401),
        ("transfer_timeout_s", 1e10),  # OverflowError in threading/Ray waits, later
        ("lookup_timeout_ms", 86_400_001),
        ("presence_max_age_ms", 1e10),
        ("disk_path", "data/tierstore"),  # relative: each actor's working directory
        ("disk_path", "~/tierstore"),  # each actor's HOME, not expanded
        ("disk_path", "/data/ts\x00x"),  # fails only inside the NodeStore
        ("disk_path", "/data/t\u00e4"),
        ("disk_path", "/data/ts\n"),
        ("cpu_bytes_per_node", "\u0661\u0662GiB"),  # Arabic-Indic 12: was 12 GiB
        ("cpu_bytes_per_node", "\uff11\uff12GiB"),  # fullwidth 12
        ("cpu_bytes_per_node", "0.5"),  # was "must be positive, got 0"
        ("cpu_bytes_per_node", "0.0001KiB"),  # 0 whole bytes
        ("cpu_bytes_per_node", 1 << 61),
        ("disk_bytes_per_node", "\u0969GiB"),  # Devanagari 3
        ("namespace", "tierstore\n"),  # re.match with "$" took it: two arenas, one file
        ("namespace", "tier\u0661"),
        ("ray_address", "10.0.0.1:6379\n"),
        ("ray_address", "10.0.0.1:6379\x00"),
    ],
)
def test_values_that_failed_later_fail_at_start_quoting_what_was_written(
    key: str, value: object
) -> None:
    extra = _extra(**{key: value})
    if key == "disk_bytes_per_node":
        extra["disk_path"] = "/data/ts"
    with pytest.raises(ConfigError) as error:
        TierStoreConfig.from_extra_config(extra)
    assert str(error.value).startswith(f"{key}:")
    assert repr(value) in str(error.value)


def test_bounds_themselves_are_accepted() -> None:
    cfg = TierStoreConfig.from_extra_config(
        _extra(
            lease_ttl_s=86_400,
            transfer_timeout_s=86_400.0,
            lookup_timeout_ms=86_400_000,
            presence_max_age_ms=0,
            disk_path="/var/lib/tier store",
            disk_bytes_per_node="1.5GiB",
            namespace="a" * 64,
        )
    )
    assert cfg.disk_bytes_per_node == 3 << 29
    assert parse_bytes("k", " 12 GiB ") == 12 << 30
    assert parse_bytes("k", "1.1GiB") == int(1.1 * (1 << 30))  # decimals with a unit: floor
    assert parse_bytes("k", 1 << 60) == 1 << 60


def test_a_size_below_one_byte_quotes_the_text_not_the_rounded_number() -> None:
    with pytest.raises(ConfigError, match=r"cpu_bytes_per_node: a byte count is a whole.*'0\.5'"):
        TierStoreConfig.from_extra_config(_extra(cpu_bytes_per_node="0.5"))
    with pytest.raises(ConfigError, match=r"got '0KiB' \(= 0 bytes\)"):
        TierStoreConfig.from_extra_config(_extra(cpu_bytes_per_node="0KiB"))


# ---- one config per set of actors -----------------------------------------------------------
def test_every_key_either_defines_the_actors_or_belongs_to_one_engine() -> None:
    fields = [f.name for f in dataclasses.fields(TierStoreConfig)]
    assert sorted(ACTOR_KEYS + ENGINE_KEYS) == sorted(fields)
    assert not set(ACTOR_KEYS) & set(ENGINE_KEYS)


def test_a_running_config_that_differs_is_refused_naming_each_key_and_both_values() -> None:
    running = TierStoreConfig(
        cpu_bytes_per_node=8 << 30, disk_path="/data/ts", disk_bytes_per_node=1 << 40
    )
    mine = dataclasses.replace(
        running, cpu_bytes_per_node=4 << 30, eviction_policy="arc", lease_ttl_s=5.0
    )
    with pytest.raises(ConfigMismatchError) as error:
        check_running_config(mine, running, "the Evictor")
    message = str(error.value)
    assert "cpu_bytes_per_node: running 8589934592, this config 4294967296" in message
    assert "eviction_policy: running 'lru', this config 'arc'" in message
    assert "lease_ttl_s" not in message  # each engine's own
    assert "tierstore down --namespace tierstore" in message
    # Keys of the engine alone may differ freely.
    engine_only = dataclasses.replace(
        running,
        lease_ttl_s=5.0,
        lookup_timeout_ms=1.0,
        presence_max_age_ms=0.0,
        hits_from_picture=False,
        transfer_timeout_s=3.0,
        ray_address="10.0.0.1:6379",
    )
    check_running_config(engine_only, running, "the Evictor")


def test_the_pinned_bounce_pool_size_parses_and_has_a_floor() -> None:
    assert TierStoreConfig(cpu_bytes_per_node=1).pinned_bounce_bytes == 256 << 20
    base = {**BASE, "cpu_bytes_per_node": 1}
    cfg = TierStoreConfig.from_extra_config({**base, "pinned_bounce_bytes": "64MiB"})
    assert cfg.pinned_bounce_bytes == 64 << 20
    for bad in ("512KiB", 0, -1, "lots", True):
        with pytest.raises(ConfigError, match="pinned_bounce_bytes") as error:
            TierStoreConfig.from_extra_config({**base, "pinned_bounce_bytes": bad})
        assert repr(bad) in str(error.value)


# ---- evictor_shards: a number, or "auto" from the node count (issue 28 item 1) -------------
def test_evictor_shards_is_auto_by_default_and_takes_a_number_or_auto() -> None:
    assert TierStoreConfig(cpu_bytes_per_node=1).evictor_shards == "auto"
    for value in ("auto", 1, 7, MAX_EVICTOR_SHARDS):
        cfg = TierStoreConfig.from_extra_config(_extra(evictor_shards=value))
        assert cfg.evictor_shards == value
    assert TierStoreConfig(cpu_bytes_per_node=1, evictor_shards=7).shard_count == 7


@pytest.mark.parametrize("bad", ["Auto2", "AUTO", " auto", "4", 0, 257, 1.5, 2.0, True, None])
def test_other_shard_counts_are_refused_naming_the_key_and_its_forms(bad: object) -> None:
    with pytest.raises(ConfigError) as error:
        TierStoreConfig.from_extra_config(_extra(evictor_shards=bad))
    message = str(error.value)
    assert message.startswith("evictor_shards: expected a number of shards from 1 to 256, or")
    assert "'auto' (chosen from the node count" in message
    assert message.endswith(f"got {bad!r}")


def test_an_auto_shard_count_has_no_number_until_it_is_resolved() -> None:
    with pytest.raises(ConfigError, match="evictor_shards: 'auto' is chosen when Evictor shard 0"):
        _ = TierStoreConfig(cpu_bytes_per_node=1).shard_count


@pytest.mark.parametrize(
    ("nodes", "shards"),
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (8, 3), (16, 5), (64, 22), (752, 256)],
)
def test_auto_runs_a_third_of_a_shard_per_node_rounded(nodes: int, shards: int) -> None:
    """docs/scaling.md's rule: 0.34 shards per node, to the nearest, one at least."""
    assert evictor_shards_for(nodes) == shards


def test_auto_is_capped_at_the_most_shards() -> None:
    """1,000 nodes would need 340 by the cost model: past the cap."""
    assert evictor_shards_for(1_000) == MAX_EVICTOR_SHARDS
    assert evictor_shards_for(751) == MAX_EVICTOR_SHARDS - 1


def test_auto_matches_any_running_shard_count_and_a_number_must_equal_it() -> None:
    running = TierStoreConfig(cpu_bytes_per_node=1, evictor_shards=3)
    check_running_config(TierStoreConfig(cpu_bytes_per_node=1), running, "Evictor shard 0")
    check_running_config(dataclasses.replace(running, lease_ttl_s=1.0), running, "shard 0")
    with pytest.raises(ConfigMismatchError, match="evictor_shards: running 3, this config 2"):
        check_running_config(dataclasses.replace(running, evictor_shards=2), running, "shard 0")
    # "auto" matches only the shard count: another actor key still differs.
    other = TierStoreConfig(cpu_bytes_per_node=2)
    with pytest.raises(ConfigMismatchError) as error:
        check_running_config(other, running, "Evictor shard 0")
    assert "cpu_bytes_per_node: running 1, this config 2" in str(error.value)
    assert "evictor_shards" not in str(error.value)
