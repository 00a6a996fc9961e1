"""Every malformed ``kv_connector_extra_config`` fails at start-up with a ConfigError that
names the key: hypothesis draws a key and a value that is wrong for it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.config import VLLM_OWNED_KEYS, TierStoreConfig
from tierstore.errors import ConfigError

BASE = {"spec_name": "TierStoreSpec", "spec_module_path": "tierstore.spec", "cpu_bytes_per_node": 1}

# Any JSON-ish value (what a --kv-transfer-config or a Python dict can carry).
_anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_not_number = _anything.filter(lambda v: isinstance(v, bool) or not isinstance(v, int | float))
_non_finite = st.sampled_from([math.nan, math.inf, -math.inf])
_unicode_digits = st.characters(categories=["Nd"]).filter(lambda c: not c.isascii())
_bad_size = (
    _anything.filter(lambda v: isinstance(v, bool | list | dict) or v is None)
    | st.integers(max_value=-1)
    | st.floats().filter(lambda v: not v.is_integer())
    | st.text(max_size=12).filter(lambda s: not s.strip()[:1].isdigit())
    | st.sampled_from(["1" * 400, "1" * 400 + "GiB", "-1GiB", "1 parsec", "1e9", "0x10"])
    | st.sampled_from(["0.5", "1.5", "0.5B", str(1 << 61), "2EiB"])  # fractions, too large
    | st.integers(min_value=(1 << 60) + 1)
    # Other scripts' digits, which Python's \d, int() and float() take: never a size.
    | st.text(alphabet=_unicode_digits, min_size=1, max_size=4).map(lambda d: d + "GiB")
)
_not_bool = _anything.filter(
    lambda v: (
        not isinstance(v, bool)
        and not (
            isinstance(v, str)
            and v.strip().lower() in {"true", "false", "1", "0", "yes", "no", "on", "off"}
        )
    )
)
_bad_seconds = (
    _not_number
    | st.floats(max_value=0)
    | st.integers(max_value=0)
    | _non_finite
    | st.floats(min_value=86_400, exclude_min=True)  # past a day (1e10 s overflowed later)
    | st.integers(min_value=86_401)
)
_bad_milliseconds = (
    _not_number
    | st.floats(max_value=0)
    | st.integers(max_value=0)
    | _non_finite
    | st.floats(min_value=86_400_000, exclude_min=True)
    | st.integers(min_value=86_400_001)
)
_bad_fraction = (
    _not_number
    | st.floats(max_value=0)
    | st.floats(min_value=1, exclude_min=True)
    | st.integers(max_value=0)
    | st.integers(min_value=2)
    | _non_finite
)
_not_str = _anything.filter(lambda v: not isinstance(v, str))

BAD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "cpu_bytes_per_node": _bad_size | st.just(0),
    "disk_bytes_per_node": _bad_size,
    "pinned_bounce_bytes": _bad_size | st.integers(0, (1 << 20) - 1) | st.just("1KiB"),
    "namespace": _not_str
    | st.text(min_size=65, max_size=80, alphabet="abc")
    | st.just("")
    | st.text(min_size=1, max_size=10).filter(
        lambda s: not all(c.isalnum() or c in "_.-" for c in s)
    )
    | st.just("naïve")
    | st.from_regex(r"[a-z]{1,8}", fullmatch=True).map(lambda s: s + "\n")  # "$" took it
    | st.text(alphabet=_unicode_digits, min_size=1, max_size=4),
    "ray_address": _not_str.filter(lambda v: v is not None)
    | st.sampled_from(["", "  ", "10.0.0.1:6379\n", "host:1\x00", "a b:1"]),
    "lease_ttl_s": _bad_seconds,
    "transfer_timeout_s": _bad_seconds,
    "lookup_timeout_ms": _bad_milliseconds,
    "presence_max_age_ms": _not_number
    | st.floats(max_value=0, exclude_max=True)
    | st.integers(max_value=-1)
    | _non_finite
    | st.floats(min_value=86_400_000, exclude_min=True),
    "disk_path": _not_str.filter(lambda v: v is not None)
    | st.sampled_from(["", " \t", "~/ts", "./ts", "/data/ts\x00"])
    | st.text(max_size=12).filter(lambda s: not s.startswith("/"))  # relative
    | st.text(min_size=1, max_size=12)
    .map(lambda s: "/" + s)
    .filter(
        lambda s: not (s.isascii() and s.isprintable())  # NUL, control, non-ASCII
    ),
    "disk_fsync": _not_bool,
    "hits_from_picture": _not_bool,
    "eviction_policy": _anything.filter(lambda v: v not in ("lru", "arc")),
    "cpu_high_watermark": _bad_fraction,
    "cpu_low_watermark": _bad_fraction | st.floats(0.96, 1.0),  # above the high mark
    "replicate_after_loads": _not_number | st.integers(max_value=-1) | st.floats(),
    "pulls_per_node": _not_number
    | st.integers(max_value=-1)
    | st.integers(min_value=65)
    | st.floats(),
    "pull_transport": _anything.filter(lambda v: v not in ("object_store", "nixl")),
    "evictor_shards": _not_number.filter(lambda v: v != "auto")
    | st.integers(max_value=0)
    | st.integers(min_value=257)
    | st.floats(),
    "model_identity": _not_str.filter(lambda v: v is not None)
    | st.just("")
    | st.text(min_size=257, max_size=300)
    | st.text(min_size=1, max_size=12).filter(lambda s: not (s.isascii() and s.isprintable())),
}


def test_every_tierstore_key_is_fuzzed() -> None:
    own = {f.name for f in dataclasses.fields(TierStoreConfig)}
    assert set(BAD_VALUES) == own


@settings(max_examples=400, deadline=None)
@given(data=st.data(), key=st.sampled_from(sorted(BAD_VALUES)))
def test_a_bad_value_fails_with_its_key_named(data: st.DataObject, key: str) -> None:
    value = data.draw(BAD_VALUES[key], label=key)
    with pytest.raises(ConfigError) as error:
        TierStoreConfig.from_extra_config({**BASE, key: value})
    assert key in str(error.value)
    # What the user wrote, quoted as written (not a parsed or rounded value).
    assert repr(value) in str(error.value)


_known = {f.name for f in dataclasses.fields(TierStoreConfig)} | VLLM_OWNED_KEYS


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(
        st.text(min_size=1, max_size=20).filter(lambda k: k not in _known), min_size=1, max_size=3
    ),
    value=_anything,
)
def test_an_unknown_key_fails_with_its_name(keys: list[str], value: Any) -> None:
    with pytest.raises(ConfigError) as error:
        TierStoreConfig.from_extra_config({**BASE, **dict.fromkeys(keys, value)})
    assert all(repr(k) in str(error.value) for k in keys)


@settings(max_examples=100, deadline=None)
@given(key=st.integers() | st.none() | st.tuples(st.integers()), value=_anything)
def test_a_non_string_key_fails_with_its_name(key: Any, value: Any) -> None:
    with pytest.raises(ConfigError) as error:
        TierStoreConfig.from_extra_config({**BASE, key: value, "typo_key": 1})
    assert repr(key) in str(error.value)
