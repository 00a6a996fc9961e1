"""The cluster-wide chunk index: where each shard lives, capacity per node, leases, eviction.

This is all of the Evictor's logic as a plain class, so it is unit-tested without Ray.
A chunk (namespace, key) is *loadable* when every rank of its engine's world holds a
shard. Eviction removes whole chunks: one rank's shard alone is useless.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from tierstore.control.policies import POLICIES
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId

logger = logging.getLogger(__name__)


class ChunkId(NamedTuple):
    namespace: Namespace
    key: ChunkKey


class ShardOffer(NamedTuple):
    """A shard a NodeStore wants to hold."""

    namespace: Namespace
    key: ChunkKey
    rank: int
    world_size: int
    nbytes: int


@dataclass
class _Chunk:
    world_size: int
    shards: dict[int, tuple[NodeId, int]] = field(default_factory=dict)  # rank -> (node, bytes)

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.world_size


@dataclass
class _NodeAccount:
    capacity_bytes: int
    used_bytes: int = 0
    chunks: int = 0


@dataclass
class IndexStats:
    stored_chunks: int = 0
    loaded_chunks: int = 0
    hits: int = 0
    misses: int = 0
    evicted_chunks: int = 0
    skipped_stores: int = 0


class AdmitResult(NamedTuple):
    accepted: list[bool]  # one per offer, in order
    drops: dict[NodeId, list[ShardId]]  # shards each node must delete to honour the eviction


class ChunkIndex:
    """Single-threaded: the Evictor actor serialises every call."""

    def __init__(self, policy: str = "lru") -> None:
        self._policy = POLICIES.get(policy)()
        self._chunks: dict[ChunkId, _Chunk] = {}
        self._nodes: dict[NodeId, _NodeAccount] = {}
        self._leases: dict[ChunkId, dict[str, float]] = defaultdict(dict)  # holder -> expiry
        self.stats = IndexStats()

    # ---- nodes -------------------------------------------------------------------------
    def register_node(self, node: NodeId, capacity_bytes: int) -> None:
        account = self._nodes.get(node)
        if account is None:
            self._nodes[node] = _NodeAccount(capacity_bytes)
        else:
            account.capacity_bytes = capacity_bytes

    def forget_node(self, node: NodeId) -> dict[NodeId, list[ShardId]]:
        """A node left: its chunks become incomplete, so drop them everywhere."""
        doomed = [
            cid for cid, c in self._chunks.items() if any(n == node for n, _ in c.shards.values())
        ]
        drops: dict[NodeId, list[ShardId]] = defaultdict(list)
        for cid in doomed:
            self._remove_chunk(cid, drops)
        self._nodes.pop(node, None)
        drops.pop(node, None)
        return dict(drops)

    def forget_shards(self, shard_ids: list[ShardId]) -> dict[NodeId, list[ShardId]]:
        """Shards that turned out missing or bad: their chunks are gone everywhere."""
        drops: dict[NodeId, list[ShardId]] = defaultdict(list)
        for shard_id in shard_ids:
            cid = ChunkId(shard_id.namespace, shard_id.key)
            if cid in self._chunks:
                self._remove_chunk(cid, drops)
        return dict(drops)

    def nodes(self) -> dict[NodeId, tuple[int, int, int]]:
        """node -> (used bytes, capacity bytes, shards)."""
        return {n: (a.used_bytes, a.capacity_bytes, a.chunks) for n, a in self._nodes.items()}

    # ---- stores ------------------------------------------------------------------------
    def admit(self, node: NodeId, offers: list[ShardOffer], now: float) -> AdmitResult:
        """Decide which offered shards ``node`` keeps, evicting LRU chunks to make room.

        A shard is refused (a skipped store, never an error) when it is already held or
        when only leased chunks and this batch's own chunks are left to evict.
        """
        account = self._nodes.get(node)
        if account is None:
            raise KeyError(f"node {node!r} is not registered with the Evictor")
        protected = {ChunkId(o.namespace, o.key) for o in offers}
        drops: dict[NodeId, list[ShardId]] = defaultdict(list)
        accepted: list[bool] = []
        for offer in offers:
            cid = ChunkId(offer.namespace, offer.key)
            chunk = self._chunks.get(cid)
            if chunk is not None and offer.rank in chunk.shards:
                accepted.append(False)
                continue
            if not self._make_room(node, offer.nbytes, protected, now, drops):
                self.stats.skipped_stores += 1
                accepted.append(False)
                continue
            if chunk is None:
                chunk = self._chunks[cid] = _Chunk(offer.world_size)
                self._policy.insert(cid)
            chunk.shards[offer.rank] = (node, offer.nbytes)
            account.used_bytes += offer.nbytes
            account.chunks += 1
            if chunk.complete:
                self.stats.stored_chunks += 1
            accepted.append(True)
        return AdmitResult(accepted, dict(drops))

    def _make_room(
        self,
        node: NodeId,
        nbytes: int,
        protected: set[ChunkId],
        now: float,
        drops: dict[NodeId, list[ShardId]],
    ) -> bool:
        account = self._nodes[node]
        if nbytes > account.capacity_bytes:
            return False
        if account.used_bytes + nbytes <= account.capacity_bytes:
            return True
        for cid in self._policy.candidates():
            chunk = self._chunks[cid]
            if cid in protected or self._is_leased(cid, now):
                continue
            if not any(n == node for n, _ in chunk.shards.values()):
                continue
            self._remove_chunk(cid, drops)
            self.stats.evicted_chunks += 1
            if account.used_bytes + nbytes <= account.capacity_bytes:
                return True
        return False

    def _remove_chunk(self, cid: ChunkId, drops: dict[NodeId, list[ShardId]]) -> None:
        chunk = self._chunks.pop(cid)
        self._policy.remove(cid)
        self._leases.pop(cid, None)
        for rank, (node, nbytes) in chunk.shards.items():
            account = self._nodes.get(node)
            if account is not None:
                account.used_bytes -= nbytes
                account.chunks -= 1
            drops[node].append(ShardId(cid.namespace, cid.key, rank))

    # ---- lookups and leases --------------------------------------------------------------
    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        now: float,
        lease_ttl_s: float,
    ) -> list[dict[int, NodeId] | None]:
        """Per key: rank -> node of each shard (a HIT, now leased to ``holder``), or None."""
        answers: list[dict[int, NodeId] | None] = []
        for key in keys:
            cid = ChunkId(namespace, key)
            chunk = self._chunks.get(cid)
            if chunk is None or not chunk.complete:
                self.stats.misses += 1
                answers.append(None)
                continue
            self.stats.hits += 1
            self._policy.touch(cid)
            self._leases[cid][holder] = now + lease_ttl_s
            answers.append({rank: node for rank, (node, _) in chunk.shards.items()})
        return answers

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

    def shards_on(self, node: NodeId) -> set[ShardId]:
        return {
            ShardId(cid.namespace, cid.key, rank)
            for cid, chunk in self._chunks.items()
            for rank, (n, _) in chunk.shards.items()
            if n == node
        }

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, cid: object) -> bool:
        return cid in self._chunks
