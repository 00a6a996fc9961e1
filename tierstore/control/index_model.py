"""The chunk index's data model: what crosses its API and what it keeps per chunk.

The public types (offers, lookup answers, actions, stats, watermarks) are re-exported by
:mod:`tierstore.control.index`, where the rest of the code imports them from. The records
(:class:`Shard`, :class:`Chunk`, :class:`Unit`, :class:`TierAccount`) are the index's own
state, shared by its parts and never handed out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from tierstore import fields
from tierstore.fields import (
    MAX_SHARD_BYTES,
    MalformedField,
    check_shard_id,
    chunk_key,
    integer,
    parent_key,
    rank_in,
    row,
)
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName

logger = logging.getLogger(__name__)


class ChunkId(NamedTuple):
    namespace: Namespace
    key: ChunkKey


class UnitId(NamedTuple):
    namespace: Namespace
    boundary: bytes


class ShardOffer(NamedTuple):
    """A shard a NodeStore wants to hold (or already holds, when re-registering)."""

    namespace: Namespace
    key: ChunkKey
    rank: int
    world_size: int
    nbytes: int
    parent: bytes | None = None


def check_offer(value: object, field: str = "offer") -> ShardOffer:
    """An offer from a NodeStore (a ShardOffer, or the tuple msgpack made of one), every
    field's type and range checked, rebuilt. Raises MalformedField naming the field."""
    namespace, key, rank, world_size, nbytes, *parent = row(field, value, 5, 6)
    checked_key = chunk_key(f"{field}.key", key)
    rank, world_size = rank_in(field, rank, world_size)
    return ShardOffer(
        fields.namespace(f"{field}.namespace", namespace),
        checked_key,
        rank,
        world_size,
        integer(f"{field}.nbytes", nbytes, 1, MAX_SHARD_BYTES),
        parent_key(f"{field}.parent", parent[0] if parent else None, checked_key),
    )


def check_held(value: object, field: str = "held") -> tuple[ShardOffer, TierName]:
    """A copy a NodeStore offers at restore: ``(offer, tier)``, checked."""
    offer, tier = row(field, value, 2, 2)
    if not isinstance(tier, str) or tier not in {t.value for t in TierName}:
        raise MalformedField(f"{field}.tier", tier, "not a tier")
    return check_offer(offer, f"{field}.offer"), TierName(tier)


def held_shard(value: object) -> ShardId | None:
    """The shard a malformed held copy names, if that much of it is readable (the node
    is told to drop its copy: the index will not count it), else None."""
    try:
        offer = row("held", value, 2, 2)[0]
        return check_shard_id(row("held.offer", offer, 5, 6)[:3])
    except MalformedField:
        return None


class LookupState(str, Enum):
    HIT = "hit"
    MISS = "miss"
    PENDING = "pending"  # present, being verified by its promotion from disk: ask again


class LookupAnswer(NamedTuple):
    state: LookupState
    where: dict[int, NodeId] | None = None  # rank -> node, for a HIT
    # Where a HIT's bytes are read from: DISK when any rank may be loaded from its disk
    # copy (not in memory, or its promotion still under way). None unless a HIT.
    tier: TierName | None = None


@dataclass
class NodeActions:
    drop: list[ShardId] = field(default_factory=list)  # delete every copy
    demote: list[ShardId] = field(default_factory=list)  # to disk (write if needed), free memory
    promote: list[ShardId] = field(default_factory=list)  # read the disk copy into memory
    persist: list[ShardId] = field(default_factory=list)  # write-through: copy memory to disk
    # Send a copy of a held shard to another node's CPU tier (a replica of a hot chunk).
    push: list[tuple[ShardId, NodeId]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.drop or self.demote or self.promote or self.persist or self.push)


Actions = dict[NodeId, NodeActions]


class AdmitResult(NamedTuple):
    accepted: list[bool]  # one per offer, in order
    actions: Actions  # what each node must do to honour the decision


@dataclass(slots=True)
class Shard:
    node: NodeId
    nbytes: int
    cpu: bool = False  # a copy in the CPU tier (or one being promoted into it)
    disk: bool = False  # a copy in the disk tier (or one being written to it)
    promoting: bool = False
    # The disk copy was found at start-up and no read has verified it since: it is
    # promoted (and so verified) before it is a HIT, so a corrupt file is a clean miss.
    # A copy written by the running NodeStore is a HIT at once, read from disk.
    disk_unverified: bool = False

    def has(self, tier: TierName) -> bool:
        return self.cpu if tier is TierName.CPU else self.disk

    def set(self, tier: TierName, present: bool) -> None:
        if tier is TierName.CPU:
            self.cpu = present
        else:
            self.disk = present

    @property
    def tiers(self) -> tuple[TierName, ...]:
        return (TierName.CPU,) * self.cpu + (TierName.DISK,) * self.disk


@dataclass(slots=True)
class Chunk:
    key: ChunkKey
    world_size: int
    parent: ChunkKey | None
    shards: list[Shard | None]  # by rank
    present: int = 0
    replicas: dict[NodeId, int] | None = None  # node -> ranks landed there (ready at all)

    @property
    def complete(self) -> bool:
        return self.present == self.world_size

    def held(self) -> Iterator[tuple[int, Shard]]:
        return ((rank, s) for rank, s in enumerate(self.shards) if s is not None)

    def replica_ready(self, node: NodeId) -> bool:
        """Every rank of this chunk has landed in ``node``'s replica."""
        return (self.replicas or {}).get(node) == self.world_size


@dataclass(slots=True)
class Unit:
    """One boundary. Tuples and a lazily made set: most units have one chunk, one parent
    and at most one child, and a million of them must fit in memory."""

    chunks: tuple[Chunk, ...] = ()
    parents: tuple[UnitId, ...] = ()
    children: set[UnitId] | None = None
    waiting_for: tuple[UnitId, ...] = ()  # parents not (yet) resident
    cpu_copies: int = 0  # shards with a CPU copy, on any node
    cpu_children: int = 0  # children with cpu_copies > 0: demotable only at 0

    def shards(self) -> Iterator[tuple[Chunk, int, Shard]]:
        return ((c, rank, s) for c in self.chunks for rank, s in c.held())


@dataclass
class TierAccount:
    capacity_bytes: int
    used_bytes: int = 0
    shards: int = 0
    # A disk tier that takes no writes (degraded: a write failed, see ChunkIndex.disk_writes)
    # keeps its capacity here, and ``capacity_bytes`` is 0 until it takes writes again:
    # nothing is demoted or written through there meanwhile.
    parked_capacity: int | None = None


@dataclass
class IndexStats:
    stored_chunks: int = 0
    loaded_chunks: int = 0
    hits: int = 0
    misses: int = 0
    evicted_chunks: int = 0  # dropped for room (from any tier)
    demoted_shards: int = 0
    promoted_shards: int = 0
    disk_hits: int = 0  # HITs whose bytes may be read from disk (not promoted yet)
    refused_promotions: int = 0  # the node had no extent free: stayed on disk
    skipped_stores: int = 0
    replicated_chunks: int = 0  # hot chunks copied to a node that kept loading them
    failed_stores: int = 0  # store jobs a worker could not hand to its NodeStore
    disk_write_failures: int = 0  # disk writes NodeStores reported failed (report_disk_writes)
    corrupt_before_hit: int = 0  # failed verification while promoting: became a miss
    corrupt_after_hit: int = 0  # failed verification on load: the request recomputes
    malformed_items: int = 0  # offers and shard ids from NodeStores refused unread


@dataclass(frozen=True)
class Watermarks:
    """Demote CPU shards to disk once a node's CPU tier passes ``high``, down to ``low``."""

    high: float = 0.95
    low: float = 0.85


def valid_offer(offer: ShardOffer) -> bool:
    if 0 <= offer.rank < offer.world_size:
        return True
    logger.warning("refusing shard of rank %d in a world of %d", offer.rank, offer.world_size)
    return False
