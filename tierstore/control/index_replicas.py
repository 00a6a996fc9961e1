"""Replicas of hot chunks (a part of ChunkIndex).

A node that kept loading a chunk from elsewhere gets a copy of the whole chunk in its
CPU tier. A replica is a cache: outside the tree rules, the first thing evicted on its
node, dropped with its chunk, and adopted as the chunk's own copy when the original
holder is lost.

Needs from the other parts: the tree (``_gain``, ``_lose``) and leases (``_is_leased``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from tierstore.control.index_model import (
    Actions,
    Chunk,
    ChunkId,
    NodeActions,
    Shard,
    Unit,
    UnitId,
)
from tierstore.control.index_state import IndexState
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName


class ReplicasMixin(IndexState):
    """Starts, completes, serves, evicts and adopts replicas."""

    def record_loads(self, namespace: Namespace, keys: list[ChunkKey], node: NodeId) -> Actions:
        """``node`` loaded ``keys``. A chunk it loaded from elsewhere ``replicate_after_loads``
        times is copied into its CPU tier, if that fits below the low watermark: a replica
        never evicts anything, and one that does not fit is simply not made."""
        if not self._replicate_after:
            return {}
        return self._copies(namespace, keys, node, lambda cid: self._remote_loads.due(cid, node))

    def start_copies(self, namespace: Namespace, keys: list[ChunkKey], node: NodeId) -> Actions:
        """``node`` is about to load ``keys`` from elsewhere (a lookup from it answered
        HIT): start a copy of each complete chunk it holds no shard of, now, under the
        replica rules (:meth:`record_loads`'s, without its count of loads). Returns the
        holders' pushes (the caller may have ``node`` pull instead)."""
        return self._copies(namespace, keys, node, None)

    def _copies(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        node: NodeId,
        due: Callable[[ChunkId], bool] | None,
    ) -> Actions:
        """Copies on ``node`` of the complete chunks of ``keys`` it holds no shard of (and,
        given ``due``, that are due: asked only of those), started now."""
        actions: Actions = defaultdict(NodeActions)
        if node not in self._nodes:
            return {}
        for key in keys:
            cid = ChunkId(namespace, key)
            chunk = self._chunks.get(cid)
            if chunk is None or not chunk.complete or self._holds(chunk, node):
                continue
            if due is not None and not due(cid):
                continue
            self._start_replica(cid, chunk, node, actions)
        return dict(actions)

    @staticmethod
    def _holds(chunk: Chunk, node: NodeId) -> bool:
        return node in (chunk.replicas or {}) or any(s.node == node for _, s in chunk.held())

    def _start_replica(self, cid: ChunkId, chunk: Chunk, node: NodeId, actions: Actions) -> None:
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

    def _drop_replica(self, cid: ChunkId, chunk: Chunk, node: NodeId, actions: Actions) -> None:
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

    def replicas_on(self, node: NodeId) -> set[ChunkId]:
        """Chunks with a complete replica on ``node``."""
        return {c for c in self._replicas_on.get(node, ()) if self._chunks[c].replica_ready(node)}

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
        self, uid: UnitId, unit: Unit, chunk: Chunk, target: NodeId, actions: Actions
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
            adopted = chunk.shards[rank] = Shard(target, shard.nbytes)
            self._gain(uid, unit, adopted, TierName.CPU)  # ...is now the chunk's own
            if self._fits(target, TierName.DISK, shard.nbytes):
                self._gain(uid, unit, adopted, TierName.DISK)
                actions[target].persist.append(ShardId(uid.namespace, chunk.key, rank))
        self._node_units[target].add(uid)
        for node in left:
            if not any(s.node == node for _, _, s in unit.shards()):
                self._node_units[node].discard(uid)
