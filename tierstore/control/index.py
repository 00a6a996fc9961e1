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

Decisions are returned as :class:`NodeActions` for the NodeStores to carry out, in the
order drop, demote, promote, persist, so a promotion always finds the room made for it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from tierstore.control.policies import POLICIES
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName, boundary_of

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

    def __bool__(self) -> bool:
        return bool(self.drop or self.demote or self.promote or self.persist)


Actions = dict[NodeId, NodeActions]


class AdmitResult(NamedTuple):
    accepted: list[bool]  # one per offer, in order
    actions: Actions  # what each node must do to honour the decision


@dataclass
class _Shard:
    node: NodeId
    nbytes: int
    tiers: set[TierName]  # where copies are (or are being made): never empty
    promoting: bool = False


@dataclass
class _Chunk:
    world_size: int
    parent: ChunkKey | None
    shards: dict[int, _Shard] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.world_size


@dataclass
class _Unit:
    keys: set[ChunkKey] = field(default_factory=set)
    parents: set[UnitId] = field(default_factory=set)
    children: set[UnitId] = field(default_factory=set)
    waiting_for: set[UnitId] = field(default_factory=set)  # parents not (yet) resident


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
    corrupt_before_hit: int = 0  # failed verification while promoting: became a miss
    corrupt_after_hit: int = 0  # failed verification on load: the engine was stopped


@dataclass(frozen=True)
class Watermarks:
    """Demote CPU shards to disk once a node's CPU tier passes ``high``, down to ``low``."""

    high: float = 0.95
    low: float = 0.85


_RESTORE_GRACE_HOLDER = "tierstore/restore-grace"


class ChunkIndex:
    """Single-threaded: the Evictor actor serialises every call."""

    def __init__(self, policy: str = "lru", watermarks: Watermarks | None = None) -> None:
        self._policy = POLICIES.get(policy)()
        self._watermarks = watermarks or Watermarks()
        self._chunks: dict[ChunkId, _Chunk] = {}
        self._units: dict[UnitId, _Unit] = {}
        self._orphans: dict[UnitId, set[UnitId]] = defaultdict(set)  # absent parent -> children
        self._nodes: dict[NodeId, dict[TierName, _TierAccount]] = {}
        self._leases: dict[ChunkId, dict[str, float]] = defaultdict(dict)  # holder -> expiry
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
            chunk = self._chunks.get(ChunkId(offer.namespace, offer.key))
            shard = chunk.shards.get(offer.rank) if chunk is not None else None
            fits = account.used_bytes + offer.nbytes <= account.capacity_bytes
            if shard is not None and shard.node == node and tier in shard.tiers:
                accepted[i] = True  # already indexed: offering it again changes nothing
            elif shard is not None and shard.node == node and fits:
                shard.tiers.add(tier)
                self._account(node, tier, offer.nbytes, +1)
                accepted[i] = True
            elif shard is None and fits:
                self._add_shard(node, offer, tier)
                accepted[i] = True
                if grace_s > 0:
                    cid = ChunkId(offer.namespace, offer.key)
                    self._leases[cid][_RESTORE_GRACE_HOLDER] = now + grace_s
            elif shard is not None and shard.node == node and TierName.DISK in shard.tiers:
                actions[node].demote.append(shard_id)  # keep the disk copy, free memory
            elif shard is not None and shard.node == node:
                # A disk copy that no longer fits beside an indexed memory copy: rare
                # enough to forget the chunk rather than track half of it.
                self._drop_unit(UnitId(offer.namespace, boundary_of(offer.key)), actions)
            else:
                actions[node].drop.append(shard_id)
        return accepted, dict(actions)

    def forget_node(self, node: NodeId) -> Actions:
        """A node left: its chunks are incomplete now, so drop them everywhere."""
        doomed = {
            UnitId(cid.namespace, boundary_of(cid.key))
            for cid, chunk in self._chunks.items()
            if any(s.node == node for s in chunk.shards.values())
        }
        actions: Actions = defaultdict(NodeActions)
        for uid in doomed:
            self._drop_unit(uid, actions)
        self._nodes.pop(node, None)
        actions.pop(node, None)
        return dict(actions)

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
            raise KeyError(f"node {node!r} is not registered with the Evictor")
        # Never make room by evicting the offered chunks' own parents: it would leave the
        # new chunks unreachable the moment they land.
        protected = {UnitId(o.namespace, boundary_of(o.key)) for o in offers} | {
            UnitId(o.namespace, boundary_of(o.parent)) for o in offers if o.parent is not None
        }
        actions: Actions = defaultdict(NodeActions)
        accepted: list[bool] = []
        for offer in offers:
            chunk = self._chunks.get(ChunkId(offer.namespace, offer.key))
            if chunk is not None and offer.rank in chunk.shards:
                accepted.append(False)
                continue
            if not self._make_cpu_room(node, offer.nbytes, protected, now, actions):
                self.stats.skipped_stores += 1
                accepted.append(False)
                continue
            shard = self._add_shard(node, offer, TierName.CPU)
            accepted.append(True)
            if self._make_disk_room(node, offer.nbytes, protected, now, actions):
                shard.tiers.add(TierName.DISK)
                self._account(node, TierName.DISK, offer.nbytes, +1)
                actions[node].persist.append(ShardId(offer.namespace, offer.key, offer.rank))
        self._demote_to_watermark(node, protected, now, actions)
        return AdmitResult(accepted, dict(actions))

    def _account(self, node: NodeId, tier: TierName, nbytes: int, sign: int) -> None:
        account = self._nodes.get(node, {}).get(tier)
        if account is not None:
            account.used_bytes += sign * nbytes
            account.shards += sign

    def _add_shard(self, node: NodeId, offer: ShardOffer, tier: TierName) -> _Shard:
        cid = ChunkId(offer.namespace, offer.key)
        chunk = self._chunks.get(cid)
        if chunk is None:
            parent = ChunkKey(offer.parent) if offer.parent is not None else None
            chunk = self._chunks[cid] = _Chunk(offer.world_size, parent)
            self._link(cid, chunk)
        shard = chunk.shards[offer.rank] = _Shard(node, offer.nbytes, {tier})
        self._account(node, tier, offer.nbytes, +1)
        if chunk.complete:
            self.stats.stored_chunks += 1
        return shard

    def _link(self, cid: ChunkId, chunk: _Chunk) -> None:
        uid = UnitId(cid.namespace, boundary_of(cid.key))
        unit = self._units.get(uid)
        if unit is None:
            unit = self._units[uid] = _Unit()
            self._policy.insert(uid)
            for child in self._orphans.pop(uid, set()):  # children that arrived first
                self._units[child].waiting_for.discard(uid)
                self._units[child].parents.add(uid)
                unit.children.add(child)
        unit.keys.add(cid.key)
        if chunk.parent is not None:
            puid = UnitId(cid.namespace, boundary_of(chunk.parent))
            if puid == uid:
                return
            if puid in self._units:
                unit.parents.add(puid)
                self._units[puid].children.add(uid)
            else:
                self._orphans[puid].add(uid)
                unit.waiting_for.add(puid)

    # ---- making room -------------------------------------------------------------------
    def _blocked(self, uid: UnitId, protected: set[UnitId], now: float) -> bool:
        if uid in protected:
            return True
        for key in self._units[uid].keys:
            cid = ChunkId(uid.namespace, key)
            if self._is_leased(cid, now) or any(
                s.promoting for s in self._chunks[cid].shards.values()
            ):
                return True
        return False

    def _unit_shards(self, uid: UnitId) -> list[tuple[ShardId, _Shard]]:
        return [
            (ShardId(uid.namespace, key, rank), shard)
            for key in self._units[uid].keys
            for rank, shard in self._chunks[ChunkId(uid.namespace, key)].shards.items()
        ]

    def _has_tier(self, uid: UnitId, tier: TierName, node: NodeId | None = None) -> bool:
        return any(
            tier in s.tiers and (node is None or s.node == node) for _, s in self._unit_shards(uid)
        )

    def _make_room(
        self,
        node: NodeId,
        tier: TierName,
        nbytes: int,
        protected: set[UnitId],
        now: float,
        free_one: Callable[[UnitId], None],
    ) -> bool:
        """Walk the policy's candidates, letting ``free_one`` free each, until ``nbytes`` fit."""
        account = self._nodes[node][tier]
        if nbytes > account.capacity_bytes:
            return False
        for uid in self._policy.candidates():
            if account.used_bytes + nbytes <= account.capacity_bytes:
                return True
            if uid in self._units and not self._blocked(uid, protected, now):
                free_one(uid)
        return account.used_bytes + nbytes <= account.capacity_bytes

    def _make_cpu_room(
        self, node: NodeId, nbytes: int, protected: set[UnitId], now: float, actions: Actions
    ) -> bool:
        def free_one(uid: UnitId) -> None:
            if not self._has_tier(uid, TierName.CPU, node):
                return
            if self._cpu_leaf(uid) and self._demote(uid, node, protected, now, actions):
                return
            if not self._units[uid].children:  # a tail: safe to drop everywhere
                self._drop_unit(uid, actions)
                self.stats.evicted_chunks += 1

        return self._make_room(node, TierName.CPU, nbytes, protected, now, free_one)

    def _cpu_leaf(self, uid: UnitId) -> bool:
        """No child unit still has a CPU copy: demoting this one keeps heads above tails."""
        return not any(self._has_tier(c, TierName.CPU) for c in self._units[uid].children)

    def _demote(
        self, uid: UnitId, node: NodeId, protected: set[UnitId], now: float, actions: Actions
    ) -> bool:
        """Free ``uid``'s CPU copies on ``node``, writing those not on disk yet."""
        moving = [
            (sid, s)
            for sid, s in self._unit_shards(uid)
            if s.node == node and TierName.CPU in s.tiers
        ]
        to_write = sum(s.nbytes for _, s in moving if TierName.DISK not in s.tiers)
        if to_write and not self._make_disk_room(node, to_write, protected | {uid}, now, actions):
            return False
        for shard_id, shard in moving:
            if TierName.DISK not in shard.tiers:
                shard.tiers.add(TierName.DISK)
                self._account(node, TierName.DISK, shard.nbytes, +1)
            shard.tiers.discard(TierName.CPU)
            self._account(node, TierName.CPU, shard.nbytes, -1)
            actions[node].demote.append(shard_id)
            self.stats.demoted_shards += 1
        return True

    def _make_disk_room(
        self, node: NodeId, nbytes: int, protected: set[UnitId], now: float, actions: Actions
    ) -> bool:
        """Drop disk-only tails; a unit with a copy in memory is never dropped for disk room."""

        def free_one(uid: UnitId) -> None:
            if self._units[uid].children or self._has_tier(uid, TierName.CPU):
                return
            if self._has_tier(uid, TierName.DISK, node):
                self._drop_unit(uid, actions)
                self.stats.evicted_chunks += 1

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
        for uid in self._policy.candidates():
            if cpu.used_bytes <= target:
                return
            if uid not in self._units or not self._has_tier(uid, TierName.CPU, node):
                continue
            if not self._blocked(uid, protected, now) and self._cpu_leaf(uid):
                self._demote(uid, node, protected, now, actions)

    def _drop_unit(self, uid: UnitId, actions: Actions) -> None:
        unit = self._units.pop(uid)
        self._policy.remove(uid)
        for key in unit.keys:
            cid = ChunkId(uid.namespace, key)
            chunk = self._chunks.pop(cid)
            self._leases.pop(cid, None)
            for rank, shard in chunk.shards.items():
                for tier in shard.tiers:
                    self._account(shard.node, tier, shard.nbytes, -1)
                actions[shard.node].drop.append(ShardId(uid.namespace, key, rank))
        for parent in unit.parents:
            self._units[parent].children.discard(uid)
        for parent in unit.waiting_for:
            self._orphans[parent].discard(uid)
            if not self._orphans[parent]:
                del self._orphans[parent]
        for child in unit.children:  # only when forced (corruption, node loss)
            self._units[child].parents.discard(uid)
            self._units[child].waiting_for.add(uid)
            self._orphans[uid].add(child)  # re-linked if this boundary comes back

    # ---- lookups, promotion and leases -------------------------------------------------
    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        now: float,
        lease_ttl_s: float,
    ) -> tuple[list[LookupAnswer], Actions]:
        """Answer each key; a chunk with shards on disk is promoted first (PENDING).

        A HIT and a PENDING are leased to ``holder``, so they stay until loaded.
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
            on_disk = [(r, s) for r, s in chunk.shards.items() if TierName.CPU not in s.tiers]
            if on_disk and not self._promote(cid, on_disk, protected, now, actions):
                self.stats.misses += 1
                answers.append(LookupAnswer(LookupState.MISS))
                continue
            self._leases[cid][holder] = now + lease_ttl_s
            self._policy.touch(UnitId(namespace, boundary_of(key)))
            if any(s.promoting for s in chunk.shards.values()):
                answers.append(LookupAnswer(LookupState.PENDING))
                continue
            self.stats.hits += 1
            answers.append(
                LookupAnswer(LookupState.HIT, {r: s.node for r, s in chunk.shards.items()})
            )
        return answers, dict(actions)

    def _promote(
        self,
        cid: ChunkId,
        on_disk: list[tuple[int, _Shard]],
        protected: set[UnitId],
        now: float,
        actions: Actions,
    ) -> bool:
        for _, shard in on_disk:
            if not self._make_cpu_room(shard.node, shard.nbytes, protected, now, actions):
                return False
        for rank, shard in on_disk:
            shard.tiers.add(TierName.CPU)  # the disk copy stays: demoting it again is free
            self._account(shard.node, TierName.CPU, shard.nbytes, +1)
            shard.promoting = True
            actions[shard.node].promote.append(ShardId(cid.namespace, cid.key, rank))
        return True

    def promoted(self, node: NodeId, done: list[ShardId], failed: list[ShardId]) -> Actions:
        """A node reports its promotions; a failed one (corrupt, missing) drops the unit."""
        for shard_id in done:
            chunk = self._chunks.get(ChunkId(shard_id.namespace, shard_id.key))
            if chunk is not None and shard_id.rank in chunk.shards:
                chunk.shards[shard_id.rank].promoting = False
                self.stats.promoted_shards += 1
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
            if holders is not None:
                holders.pop(holder, None)
                if not holders:
                    del self._leases[cid]

    def release_holder(self, holder: str) -> None:
        """An engine went away: everything it held is evictable again."""
        for cid in list(self._leases):
            self._leases[cid].pop(holder, None)
            if not self._leases[cid]:
                del self._leases[cid]

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

    # ---- introspection -------------------------------------------------------------------
    def record_loaded(self, n_chunks: int) -> None:
        self.stats.loaded_chunks += n_chunks

    def shards_on(self, node: NodeId) -> set[tuple[ShardId, TierName]]:
        """Every copy the index believes ``node`` holds."""
        return {
            (ShardId(cid.namespace, cid.key, rank), tier)
            for cid, chunk in self._chunks.items()
            for rank, shard in chunk.shards.items()
            if shard.node == node
            for tier in shard.tiers
        }

    def units(self) -> dict[UnitId, tuple[set[UnitId], set[UnitId]]]:
        """unit -> (parents, children), for tests and status."""
        return {uid: (set(u.parents), set(u.children)) for uid, u in self._units.items()}

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, cid: object) -> bool:
        return cid in self._chunks
