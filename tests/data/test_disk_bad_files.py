"""Crafted chunk files: never served, never crash recovery or a read, counted and removed.

The disk tier's start-up rebuild is the NodeStore's recovery (``DiskTier.__init__``), and
``get`` is its read on a load; both run on files anyone with write access to the disk
directory could have made.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.data.checksum import CHECKSUM_ALGORITHM, digest
from tierstore.data.tiers.base import ShardMeta, StoredShard
from tierstore.data.tiers.disk import MAGIC, DiskTier
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError
from tierstore.keys import ChunkKey, Namespace, ShardId

NS = Namespace("0123abcd")
OTHER_NS = Namespace("fedc9876")
SHARD = ShardId(NS, ChunkKey(b"\x07" * 8 + b"\0\0\0\1"), 0)
PAYLOAD = np.arange(64, dtype=np.uint8)
_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _header(**changes: Any) -> dict[str, Any]:
    header = {
        "namespace": NS,
        "key": bytes(SHARD.key),
        "group": 1,
        "rank": 0,
        "length": PAYLOAD.nbytes,
        "slot_mask": 1,
        "checksum": CHECKSUM_ALGORITHM,
        "digest": digest(PAYLOAD),
        "world_size": 1,
        "parent": None,
    }
    header.update(changes)
    return header


def _file(header: Any, payload: bytes = PAYLOAD.tobytes(), magic: bytes = MAGIC) -> bytes:
    packed = msgpack.packb(header)
    return struct.pack(">4sI", magic, len(packed)) + packed + payload


GOOD = _file(_header())

# Any msgpack value, nested.
_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# A value that is wrong for each field: another type, or out of range.
_not_int = _values.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))
_negative = st.integers(-(1 << 63), -1)
_U64 = (1 << 64) - 1  # msgpack's largest integer
_BAD_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "namespace": _values.filter(lambda v: v != NS),
    "key": _values.filter(lambda v: v != bytes(SHARD.key)),
    "rank": _not_int | _negative | st.integers(1, _U64),  # rank >= world_size (1)
    "length": _not_int | _negative | st.integers(PAYLOAD.nbytes + 1, _U64),
    "slot_mask": _not_int | _negative,
    "checksum": _values.filter(lambda v: v != CHECKSUM_ALGORITHM),
    "digest": _not_int | _negative,
    "world_size": _not_int | st.integers(-(1 << 63), 0) | st.integers(1 << 31, _U64),
    "parent": _values.filter(lambda v: v is not None and not isinstance(v, bytes))
    | st.integers(1 << 40, _U64),  # bytes(int) would allocate that much
}


@st.composite
def crafted_files(draw: st.DrawFn) -> bytes:
    """A chunk file that must be refused, of one of the shapes an attacker or a crash
    could leave."""
    kind = draw(
        st.sampled_from(
            [
                "bytes",
                "magic",
                "truncated",
                "header_len",
                "field",
                "missing",
                "header",
                "nested",
                "huge",
                "other_namespace",
                "extra",
                "short_payload",
            ]
        )
    )
    if kind == "bytes":
        return draw(st.binary(max_size=300).filter(lambda b: b != GOOD))
    if kind == "magic":
        return _file(
            _header(), magic=draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC))
        )
    if kind == "truncated":
        return GOOD[: draw(st.integers(0, len(GOOD) - 1))]
    if kind == "header_len":  # the prefix claims more header than there is, or than allowed
        claimed = draw(st.integers(len(GOOD), (1 << 32) - 1))
        return struct.pack(">4sI", MAGIC, claimed) + GOOD[8:]
    if kind == "field":
        name = draw(st.sampled_from(sorted(_BAD_FIELDS)))
        return _file(_header(**{name: draw(_BAD_FIELDS[name])}))
    if kind == "missing":
        header = _header()
        del header[draw(st.sampled_from(sorted(set(header) - {"group", "parent"})))]
        return _file(header)
    if kind == "header":  # not a map, or a map of anything
        return _file(
            draw(
                _values.filter(lambda v: not isinstance(v, dict))
                | st.dictionaries(st.text(max_size=8), _values)
            )
        )
    if kind == "nested":  # deeper than msgpack's stack
        depth = draw(st.integers(1025, 5000))
        packed = b"\x91" * depth + b"\xc0"
        return struct.pack(">4sI", MAGIC, len(packed)) + packed + PAYLOAD.tobytes()
    if kind == "huge":  # a str/bin/array that claims far more bytes than follow
        packed = draw(st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf"])) + b"\xff\xff\xff\xf0"
        return struct.pack(">4sI", MAGIC, len(packed)) + packed + PAYLOAD.tobytes()
    if kind == "other_namespace":  # a valid chunk of another namespace, under this name
        return _file(_header(namespace=OTHER_NS))
    if kind == "extra":  # payload longer than the header says
        return GOOD + draw(st.binary(min_size=1, max_size=64))
    return GOOD[: -draw(st.integers(1, PAYLOAD.nbytes))]  # payload shorter


def _place(tmp_path: Path, content: bytes) -> tuple[Path, Path]:
    """A fresh tier directory holding ``content`` under the file name of SHARD."""
    root = tmp_path / f"tier-{np.random.default_rng().integers(1 << 62):x}"
    tier = DiskTier(root, 1 << 20)
    tier.put(SHARD, StoredShard(ShardMeta(PAYLOAD.nbytes, digest(PAYLOAD), 1, 1), PAYLOAD))
    path = tier.path_of(SHARD)
    path.write_bytes(content)
    return root, path


def test_the_well_formed_file_is_recovered(tmp_path: Path) -> None:
    """The baseline every crafted file departs from: it would be served."""
    root, _ = _place(tmp_path, GOOD)
    tier = DiskTier(root, 1 << 20)
    assert np.array_equal(tier.get(SHARD).data, PAYLOAD)
    assert tier.corrupt_files_removed == 0


@_SETTINGS
@given(content=crafted_files())
def test_recovery_refuses_counts_and_removes_crafted_files(tmp_path: Path, content: bytes) -> None:
    root, path = _place(tmp_path, content)
    tier = DiskTier(root, 1 << 20)  # the NodeStore's start-up: must not raise
    assert SHARD not in tier and len(tier) == 0 and tier.used_bytes == 0
    assert tier.corrupt_files_removed == 1
    assert not path.exists()
    with pytest.raises(ChunkNotFoundError):
        tier.get(SHARD)


@_SETTINGS
@given(content=crafted_files())
def test_a_file_replaced_after_start_is_never_served(tmp_path: Path, content: bytes) -> None:
    root, path = _place(tmp_path, GOOD)
    tier = DiskTier(root, 1 << 20)
    path.write_bytes(content)  # between the rebuild and the load
    try:
        served = tier.get(SHARD)
    except ChunkCorruptError:
        assert SHARD not in tier and not path.exists()
        assert tier.corrupt_files_removed == 1
    else:
        # Only a header change the load does not depend on can pass, and then the bytes
        # served are exactly the ones that were checksummed when the chunk was stored.
        assert np.array_equal(served.data, PAYLOAD)


@_SETTINGS
@given(names=st.lists(st.sampled_from(["a.chunk", "b.chunk", "c.tmp", "d"]), max_size=4))
def test_a_directory_where_a_file_should_be_does_not_stop_recovery(
    tmp_path: Path, names: list[str]
) -> None:
    root, _ = _place(tmp_path, GOOD)
    shard_dir = root / NS / "00"
    for name in names:
        (shard_dir / name).mkdir(parents=True, exist_ok=True)
    tier = DiskTier(root, 1 << 20)
    assert np.array_equal(tier.get(SHARD).data, PAYLOAD)
