"""The chunk index's data model: what its API returns and what it keeps per chunk.

The messages its API takes and gives (offers, lookup answers, actions) are those that
cross the wire (:mod:`tierstore.wire`); they and the index's own results (stats,
watermarks, :class:`AdmitResult`) are re-exported by :mod:`tierstore.control.index`. The records
(:class:`Shard`, :class:`Chunk`, :class:`Unit`, :class:`TierAccount`) are the index's own
state, shared by its parts and never handed out.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from tierstore.keys import ChunkKey, Namespace, NodeId, TierName

# Re-exported: the index's API takes and gives these messages (tierstore.control.index).
from tierstore.wire import LookupAnswer as LookupAnswer
from tierstore.wire import LookupState as LookupState
from tierstore.wire import NodeActions, ShardOffer
from tierstore.wire import UnitOffer as UnitOffer

logger = logging.getLogger(__name__)


class ChunkId(NamedTuple):
    namespace: Namespace
    key: ChunkKey


class RemoteLoads:
    """How often each node loaded each chunk from another node, until a replica is due.

    Bounded: at most ``MAX_KEPT`` (chunk, node) counts; the oldest are forgotten."""

    MAX_KEPT = 1 << 16

    def __init__(self, replicate_after: int) -> None:
        self.replicate_after = replicate_after
        self._counts: OrderedDict[tuple[ChunkId, NodeId], int] = OrderedDict()

    def due(self, cid: ChunkId, node: NodeId) -> bool:
        """Count one more load of ``cid`` by ``node``: True (and its count forgotten) when
        it reaches ``replicate_after``."""
        loads = self._counts.pop((cid, node), 0) + 1
        if loads >= self.replicate_after:
            return True
        self._counts[(cid, node)] = loads
        if len(self._counts) > self.MAX_KEPT:
            self._counts.popitem(last=False)
        return False


class UnitId(NamedTuple):
    namespace: Namespace
    boundary: bytes


Actions = dict[NodeId, NodeActions]


class AdmitResult(NamedTuple):
    accepted: list[bool]  # one per offer, in order
    actions: Actions  # what each node must do to honour the decision


class UnitAdmitResult(NamedTuple):
    accepted: list[list[bool]]  # per unit offer, one per shard, in order
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
    # HITs of lookups that named the asking node, by where the chunk is read from: every
    # rank on that node (its own copy or a complete replica), or some rank elsewhere
    # (crosses nodes: the load, or the pull the lookup starts).
    hits_same_node: int = 0
    hits_other_node: int = 0
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
    admit_calls: int = 0  # admit and admit_units calls
    # Admission decisions made: one per unit offer (admit_units), one per shard (admit).
    # The Evictor's work per prompt: O(chunks) when NodeStores offer units.
    admitted_units: int = 0


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


def count_hit_places(stats: IndexStats, answers: list[LookupAnswer], node: NodeId | None) -> None:
    """Adds ``answers``' HITs to ``stats.hits_same_node`` / ``hits_other_node`` by
    whether every rank's bytes are on ``node`` (the asking engine's); nothing without it."""
    if node is None:
        return
    for answer in answers:
        if answer.state is LookupState.HIT and answer.where:
            if all(held == node for held in answer.where.values()):
                stats.hits_same_node += 1
            else:
                stats.hits_other_node += 1
