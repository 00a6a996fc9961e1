"""The header that precedes every chunk on disk: enough to re-index it after a restart.

Format::

    b"TSC2" | u32 big-endian header length | u64 xxh3 of the map | msgpack map

The checksum makes a header torn by a crash (its page only partly written) a refusal at
start-up rather than a chunk indexed under a wrong field. The map holds namespace, key,
group, rank, payload length, slot mask, checksum algorithm and digest, plus what the
Evictor needs to re-index the chunk after a restart (the world size, the chunk's
parent in its prefix chain, and its prefix tree's root: which Evictor shard indexes it).
A header written before the root was kept has no "root" field and reads as root 0 (not
known: Evictor shard 0), so existing disk tiers keep working. Anyone who can write the
disk directory can craft one, so decoding is bounded and every field is type- and
range-checked: a bad header raises ValueError (or one of :data:`UNREADABLE`), nothing
else.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import msgpack

from tierstore.data.checksum import CHECKSUM_ALGORITHM, digest
from tierstore.data.tiers.base import ShardMeta
from tierstore.fields import MAX_SLOTS, ROOT_LIMIT, chunk_key
from tierstore.keys import Namespace, ShardId, group_of

MAGIC = b"TSC2"
PREFIX = struct.Struct(">4sIQ")
MAX_HEADER_BYTES = 2048  # a header is ~150 bytes; anything bigger is corruption
HEX = re.compile(r"[0-9a-f]{1,64}")  # fullmatch only: "$" would also take a trailing "\n"
_FIELDS = frozenset(
    {"namespace", "key", "group", "rank", "length", "slot_mask", "checksum", "digest"}
    | {"world_size", "parent", "root"}
)
_FIELDS_WITHOUT_ROOT = _FIELDS - {"root"}  # as written before the root was kept
# What decoding a damaged or crafted header may raise (msgpack's errors are ValueErrors;
# its depth limit, StackError, too).
UNREADABLE = (OSError, ValueError, msgpack.UnpackException)


def check_namespace(namespace: str) -> str:
    """Namespaces name directories: only hex digests, never raw input."""
    if not HEX.fullmatch(namespace):
        raise ValueError(f"namespace must be a hex digest, got {namespace!r}")
    return namespace


def encode_header(shard_id: ShardId, meta: ShardMeta) -> bytes:
    """The prefix and header of one chunk (see the module docstring)."""
    header = msgpack.packb(
        {
            "namespace": check_namespace(shard_id.namespace),
            "key": bytes(shard_id.key),
            "group": group_of(shard_id.key),
            "rank": shard_id.rank,
            "length": meta.nbytes,
            "slot_mask": _pack_mask(meta.slot_mask),
            "checksum": CHECKSUM_ALGORITHM,
            "digest": meta.digest,
            "world_size": meta.world_size,
            "parent": meta.parent,
            "root": meta.root,
        }
    )
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"{len(header)}-byte chunk header (key of {len(shard_id.key)} bytes)")
    return PREFIX.pack(MAGIC, len(header), digest(header)) + header


def decode_header(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The map of an encoded header (``raw`` may run on past its end)."""
    if len(raw) < PREFIX.size:
        raise ValueError("shorter than a chunk header's prefix")
    magic, length, checksum = PREFIX.unpack_from(raw)
    if magic != MAGIC or length > MAX_HEADER_BYTES or PREFIX.size + length > len(raw):
        raise ValueError("not a tierstore chunk header")
    packed = bytes(raw[PREFIX.size : PREFIX.size + length])
    if digest(packed) != checksum:
        raise ValueError("chunk header checksum mismatch (torn or altered)")
    header = msgpack.unpackb(packed)
    if not isinstance(header, dict):
        raise ValueError("header is not a map")
    return header


def _field(header: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"header field {name!r} is {type(value).__name__}, not {kind}")
    return value


def _bounded(header: dict[str, Any], name: str, low: int, high: int) -> int:
    value = _field(header, name, int)
    if not low <= value < high:
        raise ValueError(f"header field {name!r} = {value} is outside [{low}, {high})")
    return value


def _pack_mask(slot_mask: int) -> int | bytes:
    """A slot mask as msgpack holds it: an int below 2**64, else its little-endian bytes
    (a chunk of more than 64 slots)."""
    if not 0 <= slot_mask < 1 << MAX_SLOTS:
        raise ValueError(f"slot mask {slot_mask!r} is outside [0, 2**{MAX_SLOTS})")
    if slot_mask < 1 << 64:
        return slot_mask
    return slot_mask.to_bytes((slot_mask.bit_length() + 7) // 8, "little")


def _slot_mask(header: dict[str, Any]) -> int:
    value = header.get("slot_mask")
    if isinstance(value, bytes) and len(value) <= MAX_SLOTS // 8:
        return int.from_bytes(value, "little")
    return _bounded(header, "slot_mask", 0, 1 << 64)


def parse_header(header: dict[str, Any]) -> tuple[ShardId, ShardMeta]:
    """A decoded header's shard id and metadata; every field type- and range-checked, so
    a crafted header raises ValueError and nothing else (``int(inf)`` raises
    OverflowError, ``bytes(10**12)`` allocates a terabyte: never call them on it)."""
    if header.keys() != _FIELDS and header.keys() != _FIELDS_WITHOUT_ROOT:
        raise ValueError(f"header fields {sorted(map(str, header))} are not {sorted(_FIELDS)}")
    if _field(header, "checksum", str) != CHECKSUM_ALGORITHM:
        raise ValueError(f"unknown checksum {header['checksum']!r}")
    namespace = _field(header, "namespace", str)
    if not HEX.fullmatch(namespace):
        raise ValueError("header namespace is not a hex digest")
    parent = header.get("parent")
    if parent is not None and not isinstance(parent, bytes):
        raise ValueError(f"header field 'parent' is {type(parent).__name__}, not bytes")
    world_size = _bounded(header, "world_size", 1, 1 << 31)
    shard_id = ShardId(
        Namespace(namespace),
        chunk_key("header field 'key'", _field(header, "key", bytes)),  # as on the wire
        _bounded(header, "rank", 0, world_size),
    )
    meta = ShardMeta(
        _bounded(header, "length", 0, 1 << 62),
        _bounded(header, "digest", 0, 1 << 64),
        _slot_mask(header),
        world_size,
        parent,
        _bounded(header, "root", 0, ROOT_LIMIT) if "root" in header else 0,
    )
    return shard_id, meta
