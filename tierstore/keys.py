"""Identifiers that cross process boundaries, each with its own type.

vLLM's ``OffloadKey`` is a prefix-chained block hash plus a 4-byte group index: it says
nothing of the model, its weights, dtype, chunking or rank (it does carry the request's
LoRA adapter, ``cache_salt``, multimodal items and prompt embeddings: vLLM hashes those
into the block hash). tierstore therefore scopes every key by a :data:`Namespace` (a
digest of everything that shapes a chunk's bytes or what they mean:
``tierstore.vllm.spec.namespace_for``) and by the rank that produced the shard.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from enum import Enum
from typing import NamedTuple, NewType

import xxhash

# vLLM's OffloadKey bytes: block hash + group index (big-endian uint32).
ChunkKey = NewType("ChunkKey", bytes)
# Ray node id (hex).
NodeId = NewType("NodeId", str)
# Hex digest of the chunk-shaping parameters of one engine configuration.
Namespace = NewType("Namespace", str)

_GROUP_SUFFIX_BYTES = 4


class TierName(str, Enum):
    CPU = "cpu"
    DISK = "disk"


class ShardId(NamedTuple):
    """One rank's bytes of one chunk: the unit a NodeStore holds."""

    namespace: Namespace
    key: ChunkKey
    rank: int


def boundary_of(key: ChunkKey) -> bytes:
    """The block hash: the same for every group's chunk ending at one token boundary."""
    return key[:-_GROUP_SUFFIX_BYTES]


def root_of(namespace: Namespace, first_key: ChunkKey) -> int:
    """The root of a prefix tree: a 64-bit hash of the namespace and the token boundary
    of a request's first chunk (``first_key``, any group's). Every chunk of the request's
    prefix, of every group and rank, and of every request sharing its first chunk, has
    this root: block hashes are chained, so a boundary names its whole prefix. Never 0
    (0 stands for "not known")."""
    return xxhash.xxh3_64_intdigest(boundary_of(first_key), seed=_seed(namespace)) or 1


def _seed(namespace: Namespace) -> int:
    return xxhash.xxh3_64_intdigest(namespace.encode())


def shard_of(root: int, shards: int) -> int:
    """The Evictor shard that owns the prefix tree of ``root`` (0 when not known)."""
    return root % shards


def group_of(key: ChunkKey) -> int:
    """The original KV cache group index carried in the key's 4-byte suffix."""
    return int.from_bytes(key[-_GROUP_SUFFIX_BYTES:], "big")


def make_namespace(shape: Mapping[str, object]) -> Namespace:
    """Digest of every parameter that changes what a chunk's bytes mean.

    Two engines share chunks only when the model's identity (vLLM's model hash, the
    weights' fingerprint), dtype, layout, chunking and parallelism all agree; anything
    else would read another model's KV as its own.
    """
    canonical = json.dumps(shape, sort_keys=True, separators=(",", ":"), default=str)
    return Namespace(hashlib.sha256(canonical.encode()).hexdigest()[:32])
