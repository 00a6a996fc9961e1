"""Checks of the fields that cross a process boundary, made before any book changes.

A worker's commit, a NodeStore's offer, a word of the arena's directory: each comes
from another process (through Ray, where msgpack flattens a NamedTuple into a plain
tuple and keeps a numpy integer as one, or through shared memory) and is trusted by
nothing here until its fields pass these checks. Each message type has one function
that checks all of its fields, next to the message's definition in
:mod:`tierstore.wire` (:func:`~tierstore.wire.check_entry`,
:func:`~tierstore.wire.check_offer`; the arena directory's words: its ``_find_one``);
they build on the primitives below, which raise :class:`MalformedField` naming the field and
the value, and nothing else (never ``OverflowError``, ``TypeError``, or an allocation
the size of a crafted number).
"""

from __future__ import annotations

import operator
import re
import struct
from typing import Any

import numpy as np

from tierstore.errors import TierStoreError
from tierstore.keys import ChunkKey, Namespace, ShardId

# vLLM's OffloadKey: a block hash (8 to 32 bytes for the hash functions vLLM ships; room
# for 64) and a 4-byte big-endian KV cache group index.
GROUP_BYTES = 4
MIN_KEY_BYTES = GROUP_BYTES + 1
MAX_KEY_BYTES = GROUP_BYTES + 64
MAX_GROUPS = 1 << 16  # KV cache groups of one model: a handful
MAX_WORLD_SIZE = 1 << 31  # as the disk tier's chunk header bounds it
MAX_SHARD_BYTES = 1 << 62  # as the disk tier's chunk header bounds a payload
MAX_SLOTS = 1 << 12  # slots (blocks) of one chunk: its slot mask has at most this many bits
ROOT_LIMIT = 1 << 64  # a prefix tree's root (tierstore.keys.root_of) is a 64-bit hash; 0: unknown
# tierstore's namespaces are hex digests (the disk tier takes nothing else); tests and the
# object path also see short readable names. ASCII only, matched in full.
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,128}", re.ASCII)
_HOLDER = re.compile(r"[0-9a-f]{8,64}", re.ASCII)  # a worker's id in its node's arena
_SHOWN_CHARS = 80  # of a value's repr in a refusal's message


class MalformedField(TierStoreError, ValueError):
    """A field of a message from another process is missing, of the wrong type or out of
    range: the message (or its item) is refused, and nothing was changed for it."""

    def __init__(self, field: str, value: object, why: str) -> None:
        shown = repr(value)
        if len(shown) > _SHOWN_CHARS:
            shown = shown[: _SHOWN_CHARS - 3] + "..."
        super().__init__(f"{field} = {shown}: {why}")
        self.field = field

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled as its field and message: an actor's refusal reaches its caller (Ray
        pickles the error) as this error, not one Ray cannot rebuild."""
        return (_rebuilt, (self.field, str(self)))


def _rebuilt(field: str, message: str) -> MalformedField:
    """A MalformedField as pickled (:meth:`MalformedField.__reduce__`)."""
    error = MalformedField.__new__(MalformedField)
    ValueError.__init__(error, message)
    error.field = field
    return error


def integer(field: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high)``: an int or numpy integer, never a bool or a
    float."""
    if isinstance(value, bool):
        raise MalformedField(field, value, "a bool, not an integer")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise MalformedField(field, value, f"a {type(value).__name__}, not an integer") from None
    if not low <= number < high:
        raise MalformedField(field, value, f"outside [{low}, {high})")
    return number


def byte_string(field: str, value: object, low: int, high: int) -> bytes:
    """``value``, bytes of ``low`` to ``high`` (inclusive) bytes."""
    if not isinstance(value, bytes):
        raise MalformedField(field, value, f"a {type(value).__name__}, not bytes")
    if not low <= len(value) <= high:
        raise MalformedField(field, value, f"{len(value)} bytes, not {low} to {high}")
    return value


def chunk_key(field: str, value: object) -> ChunkKey:
    """A vLLM OffloadKey: a block hash and a KV cache group index below :data:`MAX_GROUPS`."""
    key = byte_string(field, value, MIN_KEY_BYTES, MAX_KEY_BYTES)
    if int.from_bytes(key[-GROUP_BYTES:], "big") >= MAX_GROUPS:
        raise MalformedField(field, value, f"its group index is not below {MAX_GROUPS}")
    return ChunkKey(key)


def parent_key(field: str, value: object, key: ChunkKey) -> ChunkKey | None:
    """A chunk's parent in its prefix chain: None, or a key of the same length as ``key``
    (one engine hashes every block with one function)."""
    if value is None:
        return None
    parent = chunk_key(field, value)
    if len(parent) != len(key):
        raise MalformedField(field, value, f"{len(parent)} bytes, its key {len(key)}")
    return parent


def root(field: str, value: object) -> int:
    """A prefix tree's root (:func:`tierstore.keys.root_of`): an int in ``[0, 2**64)``,
    0 where the sender does not know it."""
    return integer(field, value, 0, ROOT_LIMIT)


def namespace(field: str, value: object) -> Namespace:
    if not isinstance(value, str) or not _NAMESPACE.fullmatch(value):
        raise MalformedField(field, value, "not a namespace (1-128 of A-Z a-z 0-9 _ . -)")
    return Namespace(value)


def holder_id(field: str, value: object) -> str:
    """A worker's holder id in its node's arena (its lock file's name)."""
    if not isinstance(value, str) or not _HOLDER.fullmatch(value):
        raise MalformedField(field, value, "not a holder id (8-64 lowercase hex digits)")
    return value


def rank_in(field: str, rank: object, world_size: object) -> tuple[int, int]:
    """``(rank, world_size)``: a world of 1 to :data:`MAX_WORLD_SIZE` ranks, a rank in it."""
    size = integer(f"{field}.world_size", world_size, 1, MAX_WORLD_SIZE)
    return integer(f"{field}.rank", rank, 0, size), size


def row(field: str, value: object, low: int, high: int) -> tuple[object, ...]:
    """A message's item as msgpack delivers a NamedTuple: a tuple or list of ``low`` to
    ``high`` fields (trailing ones may have defaults)."""
    if not isinstance(value, (tuple, list)):
        raise MalformedField(field, value, f"a {type(value).__name__}, not a tuple")
    if not low <= len(value) <= high:
        raise MalformedField(field, value, f"{len(value)} fields, not {low} to {high}")
    return tuple(value)


def items(field: str, value: object, most: int) -> list[object]:
    """A message's list of items: a list or tuple of at most ``most``."""
    if not isinstance(value, (list, tuple)):
        raise MalformedField(field, value, f"a {type(value).__name__}, not a list")
    if len(value) > most:
        raise MalformedField(field, f"{len(value)} items", f"more than {most}")
    return list(value)


def column_width(field: str, value: object, itemsize: int, n: int | None) -> int:
    """How many items of ``itemsize`` bytes the column ``value`` (of a message sent as
    columns, :class:`~tierstore.wire.OfferColumns`) holds: bytes, ``n`` of them (any
    whole number when ``n`` is None)."""
    if not isinstance(value, bytes):
        raise MalformedField(field, type(value).__name__, "not bytes")
    if len(value) % itemsize or (n is not None and len(value) != n * itemsize):
        want = "whole items" if n is None else f"{n} items"
        raise MalformedField(field, f"{len(value)} bytes", f"not {want} of {itemsize}")
    return len(value) // itemsize


def column(field: str, value: object, dtype: np.dtype[Any], n: int | None = None) -> np.ndarray:
    """A fixed-width column as an array (:func:`column_width`)."""
    column_width(field, value, dtype.itemsize, n)
    return np.frombuffer(value, dtype)  # type: ignore[call-overload]  # bytes: checked


def int_column(field: str, value: object, code: str, n: int) -> tuple[int, ...]:
    """A fixed-width column of ``n`` items as ints (``code``: a struct format letter,
    little-endian), without numpy (whose fixed cost per call outweighs a few items)."""
    column_width(field, value, struct.calcsize(code), n)
    return struct.unpack(f"<{n}{code}", value)  # type: ignore[arg-type]  # bytes: checked


def check_shard_id(value: object, field: str = "shard") -> ShardId:
    """A :class:`~tierstore.keys.ShardId` from another process, rebuilt; its rank is only
    bounded (a ShardId does not carry its world size)."""
    namespace_, key, rank = row(field, value, 3, 3)
    return ShardId(
        namespace(f"{field}.namespace", namespace_),
        chunk_key(f"{field}.key", key),
        integer(f"{field}.rank", rank, 0, MAX_WORLD_SIZE),
    )
