"""The cluster-wide chunk index: where each shard lives, capacity per node and tier,
leases, and the prefix-aware eviction across tiers.

This is all of the Evictor's logic as a plain class, so it is tested without Ray.

Vocabulary:
- a *shard* is one rank's bytes of one chunk, held by one node: in its CPU tier, its
  disk tier, or both. The disk tier is written through (each new shard is copied to
  disk after it is acknowledged, when there is room), so a restart loses nothing that
  reached disk, and demoting a shard that is already on disk only frees its memory;
- a *chunk* ``(namespace, key)`` is loadable when every rank's shard is in a CPU tier;
- a *unit* is every group's chunk at one token boundary (the key minus its group
  suffix). Units are what the policy orders and what is evicted: a hybrid model's
  boundary is only usable with every group present.
- a unit's *parents* are the units of the previous chunk of each of its chains. A unit
  is dropped only when no resident unit names it as parent (tail first), and demoted
  from CPU only when no child still has a CPU shard.
- a *replica* is a second copy of a whole chunk (every rank) in the CPU tier of a node
  that kept loading it from elsewhere. It is a cache: outside the tree rules, the first
  thing evicted on its node, dropped with its chunk, and made the chunk's own copy when
  the original holder is lost.

Decisions are returned as :class:`NodeActions` for the NodeStores to carry out, in the
order drop, demote, promote, persist, push, so a promotion always finds the room made
for it.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from itertools import count
from typing import NamedTuple

from tierstore.control.policies import POLICIES
from tierstore.errors import UnknownNodeError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName, boundary_of

logger = logging.getLogger(__name__)

_COMPACT_MIN = 1024  # a candidate heap is never compacted below this many entries
_REMOTE_LOADS_MAX = 1 << 16  # (chunk, node) load counts kept; the oldest are forgotten


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


class LookupState(str, Enum):
    HIT = "hit"
    MISS = "miss"
    PENDING = "pending"  # present, being promoted from disk: ask again shortly


class LookupAnswer(NamedTuple):
    state: LookupState
    where: dict[int, NodeId] | None = None  # rank -> node, for a HIT


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
class _Shard:
    node: NodeId
    nbytes: int
    cpu: bool = False  # a copy in the CPU tier (or one being promoted into it)
    disk: bool = False  # a copy in the disk tier (or one being written to it)
    promoting: bool = False

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
class _Chunk:
    key: ChunkKey
    world_size: int
    parent: ChunkKey | None
    shards: list[_Shard | None]  # by rank
    present: int = 0
    replicas: dict[NodeId, int] | None = None  # node -> ranks landed there (ready at all)

    @property
    def complete(self) -> bool:
        return self.present == self.world_size

    def held(self) -> Iterator[tuple[int, _Shard]]:
        return ((rank, s) for rank, s in enumerate(self.shards) if s is not None)

    def replica_ready(self, node: NodeId) -> bool:
        """Every rank of this chunk has landed in ``node``'s replica."""
        return (self.replicas or {}).get(node) == self.world_size


@dataclass(slots=True)
class _Unit:
    """One boundary. Tuples and a lazily made set: most units have one chunk, one parent
    and at most one child, and a million of them must fit in memory."""

    chunks: tuple[_Chunk, ...] = ()
    parents: tuple[UnitId, ...] = ()
    children: set[UnitId] | None = None
    waiting_for: tuple[UnitId, ...] = ()  # parents not (yet) resident
    cpu_copies: int = 0  # shards with a CPU copy, on any node
    cpu_children: int = 0  # children with cpu_copies > 0: demotable only at 0

    def shards(self) -> Iterator[tuple[_Chunk, int, _Shard]]:
        return ((c, rank, s) for c in self.chunks for rank, s in c.held())


@dataclass(slots=True)
class _Queue:
    """Candidates of one (node, tier, policy segment): a heap of ``(rank, unit)``.

    Entries are checked when popped, never removed eagerly: an entry may be stale (the
    unit was touched, moved, dropped, or is no longer evictable there). Whenever a unit
    may have become evictable somewhere, it is pushed again; the heap is compacted once
    it doubles, so upkeep stays O(log n) amortized per change.
    """

    heap: list[tuple[int, UnitId]] = field(default_factory=list)
    compact_at: int = _COMPACT_MIN


@dataclass
class _TierAccount:
    capacity_bytes: int
    used_bytes: int = 0
    shards: int = 0


@dataclass
class IndexStats:
    stored_chunks: int = 0
    loaded_chunks: int = 0
    hits: int = 0
    misses: int = 0
    evicted_chunks: int = 0  # dropped for room (from any tier)
    demoted_shards: int = 0
    promoted_shards: int = 0
    skipped_stores: int = 0
    replicated_chunks: int = 0  # hot chunks copied to a node that kept loading them
    failed_stores: int = 0  # store jobs a worker could not hand to its NodeStore
    corrupt_before_hit: int = 0  # failed verification while promoting: became a miss
    corrupt_after_hit: int = 0  # failed verification on load: the engine was stopped


@dataclass(frozen=True)
class Watermarks:
    """Demote CPU shards to disk once a node's CPU tier passes ``high``, down to ``low``."""

    high: float = 0.95
    low: float = 0.85


_RESTORE_GRACE_HOLDER = "tierstore/restore-grace"


class ChunkIndex:
    """Single-threaded: the Evictor actor serialises every call.

    Finding what to evict never walks every unit. Each (node, tier, policy segment) has
    a heap of candidates keyed by the policy's rank (:class:`_Queue`); each unit counts
    its CPU copies and its children with CPU copies, so whether it may be demoted or
    dropped is known without looking at its subtree. Leased or promoting units met on
    the way are parked until their lease ends or their promotion is reported, so a
    store that finds only protected units left is skipped without rescanning them.
    """

    def __init__(
        self,
        policy: str = "lru",
        watermarks: Watermarks | None = None,
        replicate_after_loads: int = 0,
    ) -> None:
        self._policy = POLICIES.get(policy)()
        self._watermarks = watermarks or Watermarks()
        self._replicate_after = replicate_after_loads
        self._replicas_on: dict[NodeId, OrderedDict[ChunkId, None]] = defaultdict(OrderedDict)
        self._remote_loads: OrderedDict[tuple[ChunkId, NodeId], int] = OrderedDict()
        self._chunks: dict[ChunkId, _Chunk] = {}
        self._units: dict[UnitId, _Unit] = {}
        self._orphans: dict[UnitId, set[UnitId]] = defaultdict(set)  # absent parent -> children
        self._nodes: dict[NodeId, dict[TierName, _TierAccount]] = {}
        self._node_units: dict[NodeId, set[UnitId]] = defaultdict(set)  # units with a shard there
        self._leases: dict[ChunkId, dict[str, float]] = defaultdict(dict)  # holder -> expiry
        self._queues: dict[tuple[NodeId, TierName, int], _Queue] = {}
        self._parked: set[UnitId] = set()  # leased or promoting when last met as a candidate
        self._wakeups: list[tuple[float, int, UnitId]] = []  # (lease end, tie, parked unit)
        self._tie = count()
        self._dying: set[UnitId] = set()  # units forget_node is dropping right now
        self.stats = IndexStats()

    # ---- nodes -------------------------------------------------------------------------
    def register_node(self, node: NodeId, cpu_bytes: int, disk_bytes: int = 0) -> None:
        tiers = self._nodes.setdefault(
            node, {TierName.CPU: _TierAccount(cpu_bytes), TierName.DISK: _TierAccount(disk_bytes)}
        )
        tiers[TierName.CPU].capacity_bytes = cpu_bytes
        tiers[TierName.DISK].capacity_bytes = disk_bytes

    def restore(
        self,
        node: NodeId,
        held: list[tuple[ShardOffer, TierName]],
        now: float = 0.0,
        grace_s: float = 0.0,
    ) -> tuple[list[bool], Actions]:
        """Re-index copies a node already holds (start-up, or after an Evictor restart).

        Disk copies are taken first. A copy that no longer fits (capacities shrank) or a
        shard already indexed on another node is refused: the node frees the memory copy
        of a shard whose disk copy was kept, and drops the rest. Restored chunks are
        leased for ``grace_s``: the leases of HITs granted before a restart were lost
        with the old index, and those loads must still find their chunks.
        """
        order = sorted(range(len(held)), key=lambda i: held[i][1] != TierName.DISK)
        accepted = [False] * len(held)
        actions: Actions = defaultdict(NodeActions)
        for i in order:
            offer, tier = held[i]
            shard_id = ShardId(offer.namespace, offer.key, offer.rank)
            account = self._nodes[node][tier]
            shard = self._shard(offer.namespace, offer.key, offer.rank)
            fits = account.used_bytes + offer.nbytes <= account.capacity_bytes
            if not _valid(offer):
                actions[node].drop.append(shard_id)
            elif shard is not None and shard.node == node and shard.has(tier):
                accepted[i] = True  # already indexed: offering it again changes nothing
            elif shard is not None and shard.node == node and fits:
                uid = UnitId(offer.namespace, boundary_of(offer.key))
                self._gain(uid, self._units[uid], shard, tier)
                accepted[i] = True
            elif shard is None and fits:
                self._add_shard(node, offer, tier)
                accepted[i] = True
                if grace_s > 0:
                    cid = ChunkId(offer.namespace, offer.key)
                    self._leases[cid][_RESTORE_GRACE_HOLDER] = now + grace_s
            elif shard is not None and shard.node == node and shard.disk:
                actions[node].demote.append(shard_id)  # keep the disk copy, free memory
            elif shard is not None and shard.node == node:
                # A disk copy that no longer fits beside an indexed memory copy: rare
                # enough to forget the chunk rather than track half of it.
                self._drop_unit(UnitId(offer.namespace, boundary_of(offer.key)), actions)
            else:
                actions[node].drop.append(shard_id)
        return accepted, dict(actions)

    def forget_node(self, node: NodeId) -> Actions:
        """A node left: its replicas go; a chunk it held lives on in a replica elsewhere,
        or is incomplete now, and its unit is dropped everywhere."""
        actions: Actions = defaultdict(NodeActions)
        for queue_key in [k for k in self._queues if k[0] == node]:
            del self._queues[queue_key]
        for cid in self._replicas_on.pop(node, {}):
            chunk = self._chunks.get(cid)
            if chunk is not None and chunk.replicas is not None:
                chunk.replicas.pop(node, None)
                chunk.replicas = chunk.replicas or None
        held = self._node_units.pop(node, set())
        # Units about to go need not be queued as their children leave first.
        self._dying = {uid for uid in held if not self._rescue(uid, node, actions)}
        try:
            for uid in self._dying:
                if uid in self._units:
                    self._drop_unit(uid, actions)
        finally:
            self._dying = set()
        self._nodes.pop(node, None)
        actions.pop(node, None)
        return dict(actions)

    def _rescue(self, uid: UnitId, lost: NodeId, actions: Actions) -> bool:
        """Keep ``uid`` if each of its chunks held on ``lost`` has a replica elsewhere: the
        replica becomes the chunk's own copy. False: the unit must go."""
        unit = self._units.get(uid)
        if unit is None:
            return True  # already gone
        plan = []
        for chunk in unit.chunks:
            if not any(s.node == lost for _, s in chunk.held()):
                continue
            ready = [n for n in chunk.replicas or () if chunk.replica_ready(n)]
            if not ready:
                return False
            plan.append((chunk, ready[0]))
        for chunk, target in plan:
            self._adopt_replica(uid, unit, chunk, target, actions)
        return True

    def _adopt_replica(
        self, uid: UnitId, unit: _Unit, chunk: _Chunk, target: NodeId, actions: Actions
    ) -> None:
        """Every rank of ``chunk`` is now held by its replica on ``target``, in memory
        (written through to disk when there is room); other copies are dropped."""
        cid = ChunkId(uid.namespace, chunk.key)
        assert chunk.replicas is not None
        del chunk.replicas[target]
        chunk.replicas = chunk.replicas or None
        self._replicas_on[target].pop(cid, None)
        left: set[NodeId] = set()
        for rank, shard in list(chunk.held()):
            for tier in reversed(shard.tiers):  # disk first: nothing is queued on ``lost``
                self._lose(uid, unit, shard, tier)
            if shard.node in self._nodes and shard.node != target:
                actions[shard.node].drop.append(ShardId(uid.namespace, chunk.key, rank))
                left.add(shard.node)
            self._account(target, TierName.CPU, shard.nbytes, -1)  # the replica's share...
            adopted = chunk.shards[rank] = _Shard(target, shard.nbytes)
            self._gain(uid, unit, adopted, TierName.CPU)  # ...is now the chunk's own
            if self._fits(target, TierName.DISK, shard.nbytes):
                self._gain(uid, unit, adopted, TierName.DISK)
                actions[target].persist.append(ShardId(uid.namespace, chunk.key, rank))
        self._node_units[target].add(uid)
        for node in left:
            if not any(s.node == node for _, _, s in unit.shards()):
                self._node_units[node].discard(uid)

    def nodes(self) -> dict[NodeId, dict[TierName, tuple[int, int, int]]]:
        """node -> tier -> (used bytes, capacity bytes, shards)."""
        return {
            n: {t: (a.used_bytes, a.capacity_bytes, a.shards) for t, a in tiers.items()}
            for n, tiers in self._nodes.items()
        }

    # ---- stores ------------------------------------------------------------------------
    def admit(self, node: NodeId, offers: list[ShardOffer], now: float) -> AdmitResult:
        """Decide which offered shards ``node`` keeps in its CPU tier.

        Room is made by demoting to disk, then by dropping whole units, tail first. A
        shard is refused (a skipped store, never an error) when it is already held or
        when only leased, pinned, promoting or this batch's own units are left. Each
        admitted shard is also written through to disk when the disk has room.
        """
        if node not in self._nodes:
            raise UnknownNodeError(f"node {node!r} is not registered with the Evictor")
        # Never make room by evicting the offered chunks' own parents: it would leave the
        # new chunks unreachable the moment they land.
        protected = {UnitId(o.namespace, boundary_of(o.key)) for o in offers} | {
            UnitId(o.namespace, boundary_of(o.parent)) for o in offers if o.parent is not None
        }
        actions: Actions = defaultdict(NodeActions)
        accepted: list[bool] = []
        for offer in offers:
            if not _valid(offer) or self._shard(offer.namespace, offer.key, offer.rank):
                accepted.append(False)
                continue
            if not self._make_cpu_room(node, offer.nbytes, protected, now, actions):
                self.stats.skipped_stores += 1
                accepted.append(False)
                continue
            uid, shard = self._add_shard(node, offer, TierName.CPU)
            accepted.append(True)
            if self._make_disk_room(node, offer.nbytes, protected, now, actions):
                self._gain(uid, self._units[uid], shard, TierName.DISK)
                actions[node].persist.append(ShardId(offer.namespace, offer.key, offer.rank))
        self._demote_to_watermark(node, protected, now, actions)
        return AdmitResult(accepted, dict(actions))

    def _shard(self, namespace: Namespace, key: ChunkKey, rank: int) -> _Shard | None:
        chunk = self._chunks.get(ChunkId(namespace, key))
        if chunk is None or not 0 <= rank < len(chunk.shards):
            return None
        return chunk.shards[rank]

    def _account(self, node: NodeId, tier: TierName, nbytes: int, sign: int) -> None:
        account = self._nodes.get(node, {}).get(tier)
        if account is not None:
            account.used_bytes += sign * nbytes
            account.shards += sign

    def _add_shard(self, node: NodeId, offer: ShardOffer, tier: TierName) -> tuple[UnitId, _Shard]:
        cid = ChunkId(offer.namespace, offer.key)
        uid = UnitId(offer.namespace, boundary_of(offer.key))
        chunk = self._chunks.get(cid)
        if chunk is None:
            parent = ChunkKey(offer.parent) if offer.parent is not None else None
            chunk = _Chunk(offer.key, offer.world_size, parent, [None] * offer.world_size)
            self._chunks[cid] = chunk
            self._link(uid, chunk)
        shard = chunk.shards[offer.rank] = _Shard(node, offer.nbytes)
        chunk.present += 1
        self._node_units[node].add(uid)
        self._gain(uid, self._units[uid], shard, tier)
        if chunk.complete:
            self.stats.stored_chunks += 1
        return uid, shard

    def _link(self, uid: UnitId, chunk: _Chunk) -> None:
        unit = self._units.get(uid)
        if unit is None:
            unit = self._units[uid] = _Unit()
            self._policy.insert(uid)
            for child in self._orphans.pop(uid, ()):  # children that arrived first
                orphan = self._units[child]
                orphan.waiting_for = tuple(p for p in orphan.waiting_for if p != uid)
                self._add_edge(uid, child)
        unit.chunks = (*unit.chunks, chunk)
        if chunk.parent is None:
            return
        puid = UnitId(uid.namespace, boundary_of(chunk.parent))
        if puid == uid or puid in unit.parents or puid in unit.waiting_for:
            return
        if puid in self._units:
            self._add_edge(puid, uid)
        else:
            self._orphans[puid].add(uid)
            unit.waiting_for = (*unit.waiting_for, puid)

    def _add_edge(self, parent: UnitId, child: UnitId) -> None:
        punit, cunit = self._units[parent], self._units[child]
        if punit.children is None:
            punit.children = set()
        punit.children.add(child)
        cunit.parents = (*cunit.parents, parent)
        if cunit.cpu_copies:
            punit.cpu_children += 1

    def _remove_edge(self, parent: UnitId, child: UnitId) -> None:
        """``child`` leaves ``parent``: the parent may have become evictable."""
        punit, cunit = self._units[parent], self._units[child]
        if punit.children is not None:
            punit.children.discard(child)
            if not punit.children:
                punit.children = None
                self._queue_tier(parent, punit, TierName.DISK)
        cunit.parents = tuple(p for p in cunit.parents if p != parent)
        if cunit.cpu_copies:
            punit.cpu_children -= 1
            if not punit.cpu_children:
                self._queue_tier(parent, punit, TierName.CPU)

    # ---- copies and candidate queues -------------------------------------------------
    def _gain(self, uid: UnitId, unit: _Unit, shard: _Shard, tier: TierName) -> None:
        """``shard`` gets a copy in ``tier``: accounted, and a candidate there."""
        if shard.has(tier):
            return
        shard.set(tier, True)
        self._account(shard.node, tier, shard.nbytes, +1)
        if tier is TierName.CPU:
            unit.cpu_copies += 1
            if unit.cpu_copies == 1:
                for parent in unit.parents:
                    self._units[parent].cpu_children += 1
        self._push(uid, shard.node, tier)

    def _lose(self, uid: UnitId, unit: _Unit, shard: _Shard, tier: TierName) -> None:
        """``shard`` loses its copy in ``tier``: its parents may become demotable."""
        if not shard.has(tier):
            return
        shard.set(tier, False)
        self._account(shard.node, tier, shard.nbytes, -1)
        if tier is TierName.CPU:
            unit.cpu_copies -= 1
            if not unit.cpu_copies:
                for parent in unit.parents:
                    punit = self._units[parent]
                    punit.cpu_children -= 1
                    if not punit.cpu_children:
                        self._queue_tier(parent, punit, TierName.CPU)
                self._queue_tier(uid, unit, TierName.DISK)

    def _push(self, uid: UnitId, node: NodeId, tier: TierName) -> None:
        position = self._policy.position(uid)
        if position is None or uid in self._dying:
            return
        segment, rank = position
        queue = self._queues.get((node, tier, segment))
        if queue is None:
            queue = self._queues[(node, tier, segment)] = _Queue()
        heapq.heappush(queue.heap, (rank, uid))
        if len(queue.heap) > queue.compact_at:
            self._compact(node, tier, segment, queue)

    def _queue_tier(self, uid: UnitId, unit: _Unit, tier: TierName) -> None:
        if uid in self._dying:
            return
        for node in {s.node for _, _, s in unit.shards() if s.has(tier)}:
            self._push(uid, node, tier)

    def _queue_everywhere(self, uid: UnitId) -> None:
        unit = self._units.get(uid)
        if unit is not None:
            for tier in TierName:
                self._queue_tier(uid, unit, tier)

    def _compact(self, node: NodeId, tier: TierName, segment: int, queue: _Queue) -> None:
        """Keep one current entry per unit still evictable here; parked units come back
        when unparked."""
        ranks: dict[UnitId, int] = {}
        for _, uid in queue.heap:
            unit = self._units.get(uid)
            position = self._policy.position(uid)
            if unit is None or position is None or position[0] != segment:
                continue
            if uid not in self._parked and self._evictable_from(uid, unit, node, tier):
                ranks[uid] = position[1]
        queue.heap = [(rank, uid) for uid, rank in ranks.items()]
        heapq.heapify(queue.heap)
        queue.compact_at = max(_COMPACT_MIN, 2 * len(queue.heap))

    def _evictable_from(self, uid: UnitId, unit: _Unit, node: NodeId, tier: TierName) -> bool:
        """The tree rules: CPU copies go (demoted, or dropped with the unit) only when no
        child has a CPU copy; disk copies only from disk-only tails."""
        if tier is TierName.CPU:
            if unit.cpu_children:
                return False
        elif unit.children or unit.cpu_copies:
            return False
        return any(s.node == node and s.has(tier) for _, _, s in unit.shards())

    def _pinned(self, uid: UnitId, unit: _Unit, now: float) -> bool:
        return any(
            self._is_leased(ChunkId(uid.namespace, c.key), now) or s.promoting
            for c in unit.chunks
            for _, s in c.held()
        )

    def _park(self, uid: UnitId, unit: _Unit) -> None:
        """Out of every queue until its leases end (or are released) or it is promoted."""
        self._parked.add(uid)
        ends = [
            max(holders.values())
            for c in unit.chunks
            if (holders := self._leases.get(ChunkId(uid.namespace, c.key)))
        ]
        if ends:
            heapq.heappush(self._wakeups, (max(ends), next(self._tie), uid))

    def _unpark(self, uid: UnitId) -> None:
        if uid in self._parked:
            self._parked.discard(uid)
            self._queue_everywhere(uid)

    def _wake(self, now: float) -> None:
        while self._wakeups and self._wakeups[0][0] <= now:
            self._unpark(heapq.heappop(self._wakeups)[2])

    # ---- making room -------------------------------------------------------------------
    def _next_candidate(
        self,
        node: NodeId,
        tier: TierName,
        protected: set[UnitId],
        now: float,
        aside: dict[UnitId, None],
    ) -> UnitId | None:
        """The first unit in policy order whose ``tier`` copies on ``node`` may go now.

        Pops it; protected units go ``aside`` (queued again after this walk), leased and
        promoting ones are parked.
        """
        for segment in self._policy.segment_order():
            queue = self._queues.get((node, tier, segment))
            while queue is not None and queue.heap:
                rank, uid = heapq.heappop(queue.heap)
                unit = self._units.get(uid)
                if unit is None or uid in aside:
                    continue
                position = self._policy.position(uid)
                if position != (segment, rank):
                    if position is not None and position[0] == segment:
                        heapq.heappush(queue.heap, (position[1], uid))  # touched since
                    continue
                if not self._evictable_from(uid, unit, node, tier):
                    continue  # queued again by whatever makes it evictable
                if uid in protected:
                    aside[uid] = None
                elif self._pinned(uid, unit, now):
                    self._park(uid, unit)
                else:
                    return uid
        return None

    def _walk(
        self,
        node: NodeId,
        tier: TierName,
        protected: set[UnitId],
        now: float,
        done: Callable[[], bool],
        free_one: Callable[[UnitId], bool],
    ) -> bool:
        """Let ``free_one`` free candidates in policy order until ``done``; a unit it
        cannot free is passed over for the rest of this walk."""
        if done():
            return True
        self._wake(now)
        aside: dict[UnitId, None] = {}
        try:
            while not done():
                uid = self._next_candidate(node, tier, protected, now, aside)
                if uid is None:
                    return False
                if not free_one(uid):
                    aside[uid] = None
            return True
        finally:
            for uid in aside:
                if uid in self._units:
                    self._push(uid, node, tier)

    def _make_room(
        self,
        node: NodeId,
        tier: TierName,
        nbytes: int,
        protected: set[UnitId],
        now: float,
        free_one: Callable[[UnitId], bool],
    ) -> bool:
        account = self._nodes[node][tier]
        if nbytes > account.capacity_bytes:
            return False

        def fits() -> bool:
            return account.used_bytes + nbytes <= account.capacity_bytes

        return self._walk(node, tier, protected, now, fits, free_one)

    def _fits(self, node: NodeId, tier: TierName, nbytes: int) -> bool:
        account = self._nodes[node][tier]
        return account.used_bytes + nbytes <= account.capacity_bytes

    def _make_cpu_room(
        self, node: NodeId, nbytes: int, protected: set[UnitId], now: float, actions: Actions
    ) -> bool:
        if self._fits(node, TierName.CPU, nbytes):
            return True
        if self._evict_replicas(node, lambda: self._fits(node, TierName.CPU, nbytes), now, actions):
            return True

        def free_one(uid: UnitId) -> bool:
            if self._demote(uid, node, protected, now, actions):
                return True
            if self._units[uid].children:
                return False
            self._drop_unit(uid, actions)  # a tail: safe to drop everywhere
            self.stats.evicted_chunks += 1
            return True

        return self._make_room(node, TierName.CPU, nbytes, protected, now, free_one)

    def _demote(
        self, uid: UnitId, node: NodeId, protected: set[UnitId], now: float, actions: Actions
    ) -> bool:
        """Free ``uid``'s CPU copies on ``node``, writing those not on disk yet."""
        unit = self._units[uid]
        moving = [(c, rank, s) for c, rank, s in unit.shards() if s.node == node and s.cpu]
        to_write = sum(s.nbytes for _, _, s in moving if not s.disk)
        if to_write and not self._make_disk_room(node, to_write, protected | {uid}, now, actions):
            return False
        for chunk, rank, shard in moving:
            self._gain(uid, unit, shard, TierName.DISK)
            self._lose(uid, unit, shard, TierName.CPU)
            actions[node].demote.append(ShardId(uid.namespace, chunk.key, rank))
            self.stats.demoted_shards += 1
        return True

    def _make_disk_room(
        self, node: NodeId, nbytes: int, protected: set[UnitId], now: float, actions: Actions
    ) -> bool:
        """Drop disk-only tails; a unit with a copy in memory is never dropped for disk room."""
        if self._fits(node, TierName.DISK, nbytes):
            return True

        def free_one(uid: UnitId) -> bool:
            self._drop_unit(uid, actions)
            self.stats.evicted_chunks += 1
            return True

        return self._make_room(node, TierName.DISK, nbytes, protected, now, free_one)

    def _demote_to_watermark(
        self, node: NodeId, protected: set[UnitId], now: float, actions: Actions
    ) -> None:
        tiers = self._nodes[node]
        cpu = tiers[TierName.CPU]
        if tiers[TierName.DISK].capacity_bytes == 0:
            return
        if cpu.used_bytes <= self._watermarks.high * cpu.capacity_bytes:
            return
        target = self._watermarks.low * cpu.capacity_bytes
        if self._evict_replicas(node, lambda: cpu.used_bytes <= target, now, actions):
            return
        self._walk(
            node,
            TierName.CPU,
            protected,
            now,
            lambda: cpu.used_bytes <= target,
            lambda uid: self._demote(uid, node, protected, now, actions),
        )

    def _drop_unit(self, uid: UnitId, actions: Actions) -> None:
        unit = self._units[uid]
        for parent in unit.parents:
            self._remove_edge(parent, uid)
        for parent in unit.waiting_for:
            self._orphans[parent].discard(uid)
            if not self._orphans[parent]:
                del self._orphans[parent]
        for child in list(unit.children or ()):  # only when forced (corruption, node loss)
            self._remove_edge(uid, child)
            cunit = self._units[child]
            cunit.waiting_for = (*cunit.waiting_for, uid)
            self._orphans[uid].add(child)  # re-linked if this boundary comes back
        for chunk in unit.chunks:
            cid = ChunkId(uid.namespace, chunk.key)
            for replica_node in list(chunk.replicas or ()):
                self._drop_replica(cid, chunk, replica_node, actions)
            del self._chunks[cid]
            self._leases.pop(cid, None)
            for rank, shard in chunk.held():
                for tier in shard.tiers:
                    self._lose(uid, unit, shard, tier)
                actions[shard.node].drop.append(ShardId(uid.namespace, chunk.key, rank))
                node_units = self._node_units.get(shard.node)
                if node_units is not None:
                    node_units.discard(uid)
        del self._units[uid]
        self._policy.remove(uid)
        self._parked.discard(uid)

    # ---- lookups, promotion and leases -------------------------------------------------
    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        now: float,
        lease_ttl_s: float,
        node: NodeId | None = None,
    ) -> tuple[list[LookupAnswer], Actions]:
        """Answer each key; a chunk with shards on disk is promoted first (PENDING).

        A HIT and a PENDING are leased to ``holder``, so they stay until loaded. A HIT
        names the asking engine's ``node`` when a replica there holds the whole chunk.
        """
        answers: list[LookupAnswer] = []
        actions: Actions = defaultdict(NodeActions)
        protected = {UnitId(namespace, boundary_of(k)) for k in keys}
        for key in keys:
            cid = ChunkId(namespace, key)
            chunk = self._chunks.get(cid)
            if chunk is None or not chunk.complete:
                self.stats.misses += 1
                answers.append(LookupAnswer(LookupState.MISS))
                continue
            uid = UnitId(namespace, boundary_of(key))
            if node is not None and chunk.replica_ready(node):
                self._leases[cid][holder] = now + lease_ttl_s
                self._touch(uid)
                self._replicas_on[node].move_to_end(cid)
                self.stats.hits += 1
                where = dict.fromkeys(range(chunk.world_size), node)
                answers.append(LookupAnswer(LookupState.HIT, where))
                continue
            on_disk = [(r, s) for r, s in chunk.held() if not s.cpu]
            if on_disk and not self._promote(uid, chunk, on_disk, protected, now, actions):
                self.stats.misses += 1
                answers.append(LookupAnswer(LookupState.MISS))
                continue
            self._leases[cid][holder] = now + lease_ttl_s
            self._touch(uid)
            if any(s.promoting for _, s in chunk.held()):
                answers.append(LookupAnswer(LookupState.PENDING))
                continue
            self.stats.hits += 1
            answers.append(LookupAnswer(LookupState.HIT, {r: s.node for r, s in chunk.held()}))
        return answers, dict(actions)

    def _touch(self, uid: UnitId) -> None:
        before = self._policy.position(uid)
        self._policy.touch(uid)
        after = self._policy.position(uid)
        # Within a segment, a stale queue entry is re-ranked when popped; a unit that
        # changed segment must be queued in its new one now.
        if before is not None and after is not None and before[0] != after[0]:
            self._queue_everywhere(uid)

    def _promote(
        self,
        uid: UnitId,
        chunk: _Chunk,
        on_disk: list[tuple[int, _Shard]],
        protected: set[UnitId],
        now: float,
        actions: Actions,
    ) -> bool:
        for _, shard in on_disk:
            if not self._make_cpu_room(shard.node, shard.nbytes, protected, now, actions):
                return False
        unit = self._units[uid]
        for rank, shard in on_disk:
            shard.promoting = True
            self._gain(uid, unit, shard, TierName.CPU)  # the disk copy stays: demoting is free
            actions[shard.node].promote.append(ShardId(uid.namespace, chunk.key, rank))
        return True

    def promoted(self, node: NodeId, done: list[ShardId], failed: list[ShardId]) -> Actions:
        """A node reports its promotions; a failed one (corrupt, missing) drops the unit."""
        for shard_id in done:
            shard = self._shard(shard_id.namespace, shard_id.key, shard_id.rank)
            if shard is not None:
                shard.promoting = False
                self.stats.promoted_shards += 1
                self._unpark(UnitId(shard_id.namespace, boundary_of(shard_id.key)))
        self.stats.corrupt_before_hit += len(failed)
        return self.forget_shards(failed)

    def report_corrupt_after_hit(self, shard_ids: list[ShardId]) -> Actions:
        self.stats.corrupt_after_hit += len(shard_ids)
        return self.forget_shards(shard_ids)

    def forget_shards(self, shard_ids: list[ShardId]) -> Actions:
        """Shards that turned out missing or bad: their units are gone everywhere."""
        actions: Actions = defaultdict(NodeActions)
        for shard_id in shard_ids:
            uid = UnitId(shard_id.namespace, boundary_of(shard_id.key))
            if uid in self._units:
                self._drop_unit(uid, actions)
        return dict(actions)

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, now: float, ttl_s: float
    ) -> None:
        """Keep chunks about to be loaded (pinned from prepare_load to complete_load)."""
        for key in keys:
            cid = ChunkId(namespace, key)
            if cid in self._chunks:
                self._leases[cid][holder] = now + ttl_s

    def release(self, namespace: Namespace, keys: list[ChunkKey], holder: str) -> None:
        for key in keys:
            cid = ChunkId(namespace, key)
            holders = self._leases.get(cid)
            if holders is not None and holders.pop(holder, None) is not None:
                self._released(cid, holders)

    def release_holder(self, holder: str) -> None:
        """An engine went away: everything it held is evictable again."""
        for cid, holders in list(self._leases.items()):
            if holders.pop(holder, None) is not None:
                self._released(cid, holders)

    def _released(self, cid: ChunkId, holders: dict[str, float]) -> None:
        """A holder let go of ``cid``. A parked unit waits only for the leases left: its
        wake-up was set by the longest lease, which may have been this one."""
        uid = UnitId(cid.namespace, boundary_of(cid.key))
        if not holders:
            del self._leases[cid]
            self._unpark(uid)
        elif uid in self._parked:
            heapq.heappush(self._wakeups, (max(holders.values()), next(self._tie), uid))

    def _is_leased(self, cid: ChunkId, now: float) -> bool:
        holders = self._leases.get(cid)
        if not holders:
            return False
        for holder, expiry in list(holders.items()):
            if expiry <= now:
                del holders[holder]
        if not holders:
            del self._leases[cid]
            return False
        return True

    def is_leased(self, namespace: Namespace, key: ChunkKey, now: float) -> bool:
        return self._is_leased(ChunkId(namespace, key), now)

    # ---- replicas of hot chunks ----------------------------------------------------------
    def record_loads(self, namespace: Namespace, keys: list[ChunkKey], node: NodeId) -> Actions:
        """``node`` loaded ``keys``. A chunk it loaded from elsewhere ``replicate_after_loads``
        times is copied into its CPU tier, if that fits below the low watermark: a replica
        never evicts anything, and one that does not fit is simply not made."""
        actions: Actions = defaultdict(NodeActions)
        if not self._replicate_after or node not in self._nodes:
            return {}
        for key in keys:
            cid = ChunkId(namespace, key)
            chunk = self._chunks.get(cid)
            if chunk is None or not chunk.complete or self._holds(chunk, node):
                continue
            loads = self._remote_loads.pop((cid, node), 0) + 1
            if loads < self._replicate_after:
                self._remote_loads[(cid, node)] = loads
                if len(self._remote_loads) > _REMOTE_LOADS_MAX:
                    self._remote_loads.popitem(last=False)
                continue
            self._start_replica(cid, chunk, node, actions)
        return dict(actions)

    @staticmethod
    def _holds(chunk: _Chunk, node: NodeId) -> bool:
        return node in (chunk.replicas or {}) or any(s.node == node for _, s in chunk.held())

    def _start_replica(self, cid: ChunkId, chunk: _Chunk, node: NodeId, actions: Actions) -> None:
        """Reserve the room on ``node`` and ask each holder to push its shard there; the
        replica serves HITs once every rank has landed (:meth:`replicated`)."""
        if any(s.promoting for _, s in chunk.held()):
            return  # asked again on a later load
        nbytes = sum(s.nbytes for _, s in chunk.held())
        cpu = self._nodes[node][TierName.CPU]
        if cpu.used_bytes + nbytes > self._watermarks.low * cpu.capacity_bytes:
            return
        if chunk.replicas is None:
            chunk.replicas = {}
        chunk.replicas[node] = 0
        self._replicas_on[node][cid] = None
        for rank, shard in chunk.held():
            self._account(node, TierName.CPU, shard.nbytes, +1)
            actions[shard.node].push.append((ShardId(cid.namespace, chunk.key, rank), node))

    def replicated(self, node: NodeId, done: list[ShardId], failed: list[ShardId]) -> Actions:
        """``node`` reports replica shards it now holds, or could not get."""
        actions: Actions = defaultdict(NodeActions)
        for shard_id in done:
            cid = ChunkId(shard_id.namespace, shard_id.key)
            chunk = self._chunks.get(cid)
            if chunk is None or node not in (chunk.replicas or {}):
                actions[node].drop.append(shard_id)  # its chunk or replica went meanwhile
                continue
            assert chunk.replicas is not None
            chunk.replicas[node] += 1
            if chunk.replica_ready(node):
                self.stats.replicated_chunks += 1
        for shard_id in failed:
            cid = ChunkId(shard_id.namespace, shard_id.key)
            chunk = self._chunks.get(cid)
            if chunk is not None and node in (chunk.replicas or {}):
                self._drop_replica(cid, chunk, node, actions)
        return dict(actions)

    def _drop_replica(self, cid: ChunkId, chunk: _Chunk, node: NodeId, actions: Actions) -> None:
        assert chunk.replicas is not None
        del chunk.replicas[node]
        chunk.replicas = chunk.replicas or None
        self._replicas_on[node].pop(cid, None)
        for rank, shard in chunk.held():
            self._account(node, TierName.CPU, shard.nbytes, -1)
            actions[node].drop.append(ShardId(cid.namespace, chunk.key, rank))

    def _evict_replicas(
        self, node: NodeId, done: Callable[[], bool], now: float, actions: Actions
    ) -> bool:
        """Drop ``node``'s replicas, least recently used first, until ``done``; those being
        copied or leased stay."""
        replicas = self._replicas_on.get(node)
        for cid in list(replicas or ()):
            if done():
                return True
            chunk = self._chunks[cid]
            assert chunk.replicas is not None
            if chunk.replica_ready(node) and not self._is_leased(cid, now):
                self._drop_replica(cid, chunk, node, actions)
        return done()

    def locate(
        self, namespace: Namespace, keys: list[ChunkKey], rank: int, avoid: NodeId
    ) -> list[NodeId | None]:
        """Per key, a node other than ``avoid`` holding ``rank``'s shard (a load from
        ``avoid`` failed): the holder if that is another node, else a complete copy."""
        found: list[NodeId | None] = []
        for key in keys:
            chunk = self._chunks.get(ChunkId(namespace, key))
            node = None
            if chunk is not None and 0 <= rank < len(chunk.shards):
                shard = chunk.shards[rank]
                if shard is not None and shard.node != avoid and not shard.promoting:
                    node = shard.node
                else:
                    ready = (n for n in chunk.replicas or () if n != avoid)
                    node = next((n for n in ready if chunk.replica_ready(n)), None)
            found.append(node)
        return found

    # ---- introspection -------------------------------------------------------------------
    def record_loaded(self, n_chunks: int) -> None:
        self.stats.loaded_chunks += n_chunks

    def record_failed_stores(self, n_jobs: int) -> None:
        self.stats.failed_stores += n_jobs

    def shards_on(self, node: NodeId) -> set[tuple[ShardId, TierName]]:
        """Every copy the index believes ``node`` holds (replicas once complete)."""
        held = {
            (ShardId(uid.namespace, chunk.key, rank), tier)
            for uid in self._node_units.get(node, ())
            for chunk, rank, shard in self._units[uid].shards()
            if shard.node == node
            for tier in shard.tiers
        }
        for cid in self._replicas_on.get(node, ()):
            chunk = self._chunks[cid]
            if chunk.replica_ready(node):
                held |= {(ShardId(*cid, rank), TierName.CPU) for rank, _ in chunk.held()}
        return held

    def replicas_on(self, node: NodeId) -> set[ChunkId]:
        """Chunks with a complete replica on ``node``."""
        return {c for c in self._replicas_on.get(node, ()) if self._chunks[c].replica_ready(node)}

    def units(self) -> dict[UnitId, tuple[set[UnitId], set[UnitId]]]:
        """unit -> (parents, children), for tests and status."""
        return {uid: (set(u.parents), set(u.children or ())) for uid, u in self._units.items()}

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, cid: object) -> bool:
        return cid in self._chunks


def _valid(offer: ShardOffer) -> bool:
    if 0 <= offer.rank < offer.world_size:
        return True
    logger.warning("refusing shard of rank %d in a world of %d", offer.rank, offer.world_size)
    return False
