"""The prefix tree of units and its per-copy counters (a part of ChunkIndex).

Units are linked to their parents as chunks arrive (a child that arrives first waits as
an orphan), and every copy gained or lost updates the byte accounts, the unit's CPU
copy count and its parents' count of children with CPU copies. Those counters are what
let the candidate heaps judge a unit without walking its subtree.

Needs from the other parts: the candidate heaps (``_push``, ``_queue_tier``) and the
replicas (``_drop_replica``, when a unit goes).
"""

from __future__ import annotations

from tierstore.control.index_model import (
    Actions,
    Chunk,
    ChunkId,
    Shard,
    ShardOffer,
    Unit,
    UnitId,
)
from tierstore.control.index_state import IndexState
from tierstore.keys import ChunkKey, NodeId, ShardId, TierName, boundary_of


class TreeMixin(IndexState):
    """Adds and drops shards and units, keeping edges and counters in step."""

    def _add_shard(
        self, node: NodeId, offer: ShardOffer, tier: TierName, queue: bool = True
    ) -> tuple[UnitId, Shard]:
        cid = ChunkId(offer.namespace, offer.key)
        uid = UnitId(offer.namespace, boundary_of(offer.key))
        chunk = self._chunks.get(cid)
        if chunk is None:
            parent = ChunkKey(offer.parent) if offer.parent is not None else None
            chunk = Chunk(offer.key, offer.world_size, parent, [None] * offer.world_size)
            self._chunks[cid] = chunk
            self._link(uid, chunk)
        shard = chunk.shards[offer.rank] = Shard(node, offer.nbytes)
        chunk.present += 1
        self._node_units[node].add(uid)
        self._gain(uid, self._units[uid], shard, tier, queue)
        if chunk.complete:
            self.stats.stored_chunks += 1
        return uid, shard

    def _link(self, uid: UnitId, chunk: Chunk) -> None:
        unit = self._units.get(uid)
        if unit is None:
            unit = self._units[uid] = Unit()
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

    def _gain(
        self, uid: UnitId, unit: Unit, shard: Shard, tier: TierName, queue: bool = True
    ) -> None:
        """``shard`` gets a copy in ``tier``: accounted, and a candidate there (unless
        not ``queue``: the caller pushes the unit once for all the shards it adds)."""
        if shard.has(tier):
            return
        shard.set(tier, True)
        if tier is TierName.DISK:
            shard.disk_unverified = False  # written now; ``restore`` marks what it found
        self._account(shard.node, tier, shard.nbytes, +1)
        if tier is TierName.CPU:
            unit.cpu_copies += 1
            if unit.cpu_copies == 1:
                for parent in unit.parents:
                    self._units[parent].cpu_children += 1
        if queue:
            self._push(uid, shard.node, tier)

    def _lose(self, uid: UnitId, unit: Unit, shard: Shard, tier: TierName) -> None:
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
