"""A chunk's prefix tree root in its disk header (tierstore.data.tiers.chunk_header): it
survives a write and a restart's re-index, so a restarted NodeStore re-offers each shard
to its own Evictor shard; a header written before roots were kept still parses, as root
0; a bad root is refused like any other bad field."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tierstore.data.checksum import digest
from tierstore.data.tiers.base import ShardMeta, StoredShard
from tierstore.data.tiers.chunk_header import (
    PREFIX,
    decode_header,
    encode_header,
    parse_header,
)
from tierstore.data.tiers.disk import DiskTier, chunk_records
from tierstore.keys import ChunkKey, Namespace, ShardId, root_of

NS = Namespace("0123abcd")
SHARD = ShardId(NS, ChunkKey(b"\x07" * 8 + b"\0\0\0\1"), 1)
ROOT = root_of(NS, SHARD.key)
PAYLOAD = np.arange(64, dtype=np.uint8)
META = ShardMeta(PAYLOAD.nbytes, digest(PAYLOAD), 0b11, 2, b"\x06" * 8 + b"\0\0\0\1", ROOT)


def _reencoded(header: dict[str, object]) -> bytes:
    """``header`` packed with a valid prefix (what a crafter who knows the format writes)."""
    packed = msgpack.packb(header)
    return PREFIX.pack(b"TSC2", len(packed), digest(packed)) + packed


def test_a_headers_root_round_trips() -> None:
    assert parse_header(decode_header(encode_header(SHARD, META))) == (SHARD, META)
    top = ShardMeta(1, 0, 1, 2, None, (1 << 64) - 1)
    assert parse_header(decode_header(encode_header(SHARD, top)))[1].root == (1 << 64) - 1


def test_a_header_written_before_roots_parses_as_root_0() -> None:
    header = decode_header(encode_header(SHARD, META))
    del header["root"]
    shard_id, meta = parse_header(decode_header(_reencoded(header)))
    assert shard_id == SHARD and meta == replace(META, root=0)


@pytest.mark.parametrize("root", [-1, 1.5, "7", None, True, b"\x01", [1]])
def test_a_bad_root_is_refused(root: object) -> None:
    header = decode_header(encode_header(SHARD, META))
    header["root"] = root
    with pytest.raises(ValueError, match="root"):
        parse_header(decode_header(_reencoded(header)))


def test_a_shards_root_survives_a_restart_of_its_disk_tier(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(SHARD, StoredShard(META, PAYLOAD))
    other = ShardId(NS, ChunkKey(b"\x08" * 8 + b"\0\0\0\1"), 0)
    tier.put(other, StoredShard(ShardMeta(PAYLOAD.nbytes, digest(PAYLOAD), 1), PAYLOAD))
    tier.close()

    reopened = DiskTier(tmp_path, 1 << 20)
    assert reopened.meta(SHARD).root == ROOT
    assert reopened.meta(other).root == 0
    assert np.array_equal(reopened.get(SHARD).data, PAYLOAD)
    assert {r.header["root"] for r in chunk_records(tmp_path)} == {ROOT, 0}
