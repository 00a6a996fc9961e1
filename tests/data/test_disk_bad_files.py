"""Crafted chunk headers and payloads: never served, never crash recovery or a read,
counted and freed.

The disk tier's start-up rebuild is the NodeStore's recovery (``DiskTier.__init__``), and
``get`` is its read on a load; both run on slab files anyone with write access to the
disk directory could have written.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tierstore.data.checksum import CHECKSUM_ALGORITHM, digest
from tierstore.data.tiers.base import ShardMeta, StoredShard
from tierstore.data.tiers.chunk_header import MAGIC
from tierstore.data.tiers.disk import DiskTier, chunk_records
from tierstore.data.tiers.disk_folder import FOLDER_NAME
from tierstore.data.tiers.slab import HEADER_ROOM
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError
from tierstore.fields import MAX_SLOTS
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


def _file(header: Any, magic: bytes = MAGIC, packed: bytes | None = None) -> bytes:
    """A header as the tier writes it, checksum included (its page's zero padding left
    to ``_page``): what a crafter who knows the format writes."""
    packed = msgpack.packb(header) if packed is None else packed
    return struct.pack(">4sIQ", magic, len(packed), digest(packed)) + packed


GOOD = _file(_header())


def _page(content: bytes) -> bytes:
    return content[:HEADER_ROOM].ljust(HEADER_ROOM, b"\0")


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
    # Not a chunk key (another, well-formed key is another chunk's header, not a bad one).
    "key": _values.filter(lambda v: not isinstance(v, bytes) or not 5 <= len(v) <= 68)
    | st.binary(min_size=4, max_size=4).map(lambda g: b"\x07" * 8 + b"\xff" + g[1:]),
    "rank": _not_int | _negative | st.integers(1, _U64),  # rank >= world_size (1)
    "length": _not_int | _negative | st.integers(PAYLOAD.nbytes + 1, _U64),
    # Bytes up to MAX_SLOTS bits are a slot mask too (one of more than 64 slots).
    "slot_mask": _not_int.filter(lambda v: not isinstance(v, bytes))
    | _negative
    | st.binary(min_size=MAX_SLOTS // 8 + 1, max_size=MAX_SLOTS // 8 + 8),
    "checksum": _values.filter(lambda v: v != CHECKSUM_ALGORITHM),
    "digest": _not_int | _negative,
    "world_size": _not_int | st.integers(-(1 << 63), 0) | st.integers(1 << 31, _U64),
    "parent": _values.filter(lambda v: v is not None and not isinstance(v, bytes))
    | st.integers(1 << 40, _U64),  # bytes(int) would allocate that much
    "root": _not_int | _negative,  # absent in GOOD (written before roots): root 0
}


@st.composite
def crafted_headers(draw: st.DrawFn) -> bytes:
    """A header page that must be refused, of one of the shapes an attacker or a crash
    could leave (a page of zeros is a free slot, not a refusal)."""
    kind = draw(
        st.sampled_from(
            [
                "bytes",
                "magic",
                "truncated",
                "header_len",
                "checksum",
                "field",
                "missing",
                "header",
                "nested",
                "huge",
                "other_namespace",
            ]
        )
    )
    if kind == "bytes":
        content = draw(st.binary(min_size=1, max_size=300))
    elif kind == "magic":
        content = _file(
            _header(), magic=draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC))
        )
    elif kind == "truncated":  # the rest of the page never written
        content = GOOD[: draw(st.integers(1, len(GOOD) - 1))]
    elif kind == "header_len":  # the prefix claims more header than there is, or than allowed
        claimed = draw(st.integers(len(GOOD), (1 << 32) - 1))
        content = struct.pack(">4sI", MAGIC, claimed) + GOOD[8:]
    elif kind == "checksum":  # a header altered (or torn) without its checksum
        content = bytearray(GOOD)
        content[draw(st.integers(16, len(GOOD) - 1))] ^= draw(st.integers(1, 255))
        content = bytes(content)
    elif kind == "field":  # "length" among them: not this slab file's chunk size
        name = draw(st.sampled_from(sorted(_BAD_FIELDS)))
        content = _file(_header(**{name: draw(_BAD_FIELDS[name])}))
    elif kind == "missing":
        header = _header()
        del header[draw(st.sampled_from(sorted(header)))]
        content = _file(header)
    elif kind == "header":  # not a map, or a map of anything
        content = _file(
            draw(
                _values.filter(lambda v: not isinstance(v, dict))
                | st.dictionaries(st.text(max_size=8), _values)
            )
        )
    elif kind == "nested":  # deeper than msgpack's stack
        content = _file(None, packed=b"\x91" * draw(st.integers(1025, 2000)) + b"\xc0")
    elif kind == "huge":  # a str/bin/array that claims far more bytes than follow
        packed = draw(st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf"])) + b"\xff\xff\xff\xf0"
        content = _file(None, packed=packed)
    else:  # a valid chunk of another namespace, in this namespace's file
        content = _file(_header(namespace=OTHER_NS))
    page = _page(content)
    assume(page != _page(GOOD) and any(page[:8]))
    return page


def _place(tmp_path: Path, page: bytes, payload: bytes = PAYLOAD.tobytes()) -> Path:
    """A fresh tier directory whose one slot holds ``page`` and ``payload``."""
    root = tmp_path / f"tier-{np.random.default_rng().integers(1 << 62):x}"
    tier = DiskTier(root, 1 << 20)
    tier.put(SHARD, StoredShard(ShardMeta(PAYLOAD.nbytes, digest(PAYLOAD), 1, 1), PAYLOAD))
    _write_slot(tier, page, payload)
    tier.close()
    return root


def _write_slot(tier: DiskTier, page: bytes, payload: bytes) -> None:
    where = tier.location_of(SHARD)
    with open(where.path, "r+b") as f:
        f.seek(where.payload_offset - HEADER_ROOM)
        f.write(page + payload)


def test_the_well_formed_slot_is_recovered(tmp_path: Path) -> None:
    """The baseline every crafted slot departs from: it would be served."""
    root = _place(tmp_path, _page(GOOD))
    tier = DiskTier(root, 1 << 20)
    assert np.array_equal(tier.get(SHARD).data, PAYLOAD)
    assert tier.corrupt_chunks_removed == 0


@_SETTINGS
@given(page=crafted_headers())
def test_recovery_refuses_counts_and_frees_crafted_headers(tmp_path: Path, page: bytes) -> None:
    root = _place(tmp_path, page)
    tier = DiskTier(root, 1 << 20)  # the NodeStore's start-up: must not raise
    assert SHARD not in tier and len(tier) == 0 and tier.used_bytes == 0
    assert tier.corrupt_chunks_removed == 1
    assert not list(chunk_records(root))  # cleared: not indexed after the next restart either
    with pytest.raises(ChunkNotFoundError):
        tier.get(SHARD)


@_SETTINGS
@given(
    page=crafted_headers() | st.just(_page(GOOD)),
    payload=st.binary(min_size=PAYLOAD.nbytes, max_size=PAYLOAD.nbytes),
)
def test_a_slot_rewritten_after_start_is_never_served(
    tmp_path: Path, page: bytes, payload: bytes
) -> None:
    root = _place(tmp_path, _page(GOOD))
    tier = DiskTier(root, 1 << 20)
    _write_slot(tier, page, payload)  # between the rebuild and the load
    try:
        served = tier.get(SHARD)
    except ChunkCorruptError:
        assert SHARD not in tier and tier.corrupt_chunks_removed == 1
        assert not list(chunk_records(root))
    else:
        # Only a header change the load does not depend on can pass, and then the bytes
        # served are exactly the ones that were checksummed when the chunk was stored.
        assert np.array_equal(served.data, PAYLOAD) and payload == PAYLOAD.tobytes()


@_SETTINGS
@given(names=st.lists(st.sampled_from(["7.slab", "1.slab", "ab", "junk", "00"]), max_size=4))
def test_a_directory_where_a_file_should_be_does_not_stop_recovery(
    tmp_path: Path, names: list[str]
) -> None:
    root = _place(tmp_path, _page(GOOD))
    for name in names:
        (root / FOLDER_NAME / NS / name / "00").mkdir(parents=True, exist_ok=True)
        (root / FOLDER_NAME / name).mkdir(exist_ok=True)
    tier = DiskTier(root, 1 << 20)
    assert np.array_equal(tier.get(SHARD).data, PAYLOAD)
