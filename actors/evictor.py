"""Evictor: one per cluster; the index, capacity accounting, leases and eviction policy.

All decisions live in :class:`~tierstore.control.index.ChunkIndex`; this actor adds the
clock and tells NodeStores to drop what it evicted. It never waits on a NodeStore (they
call it synchronously on store, so waiting back could deadlock): drops are one-way.
"""

from __future__ import annotations

import logging
import time

import ray

from tierstore.control.index import ChunkIndex, ShardOffer
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId

logger = logging.getLogger(__name__)


def node_store_name(node_id: str) -> str:
    return f"tierstore-nodestore-{node_id}"


EVICTOR_NAME = "tierstore-evictor"


class Evictor:
    def __init__(self, namespace: str, policy: str = "lru") -> None:
        self._namespace = namespace
        self._index = ChunkIndex(policy)

    def register_node(self, node_id: str, capacity_bytes: int) -> None:
        self._index.register_node(NodeId(node_id), capacity_bytes)

    def admit(
        self, node_id: str, offers: list[ShardOffer]
    ) -> tuple[list[bool], dict[NodeId, list[ShardId]]]:
        result = self._index.admit(
            NodeId(node_id), [ShardOffer(*o) for o in offers], time.monotonic()
        )
        self._send_drops({n: s for n, s in result.drops.items() if n != node_id})
        return result.accepted, result.drops

    def lookup(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, lease_ttl_s: float
    ) -> list[dict[int, NodeId] | None]:
        return self._index.lookup(namespace, keys, holder, time.monotonic(), lease_ttl_s)

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, ttl_s: float
    ) -> None:
        self._index.extend_leases(namespace, keys, holder, time.monotonic(), ttl_s)

    def release(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, loaded: int = 0
    ) -> None:
        self._index.release(namespace, keys, holder)
        self._index.record_loaded(loaded)

    def release_holder(self, holder: str) -> None:
        self._index.release_holder(holder)

    def forget_shards(self, node_id: str, shard_ids: list[ShardId]) -> None:
        self._send_drops(self._index.forget_shards([ShardId(*s) for s in shard_ids]))

    def forget_node(self, node_id: str) -> None:
        self._send_drops(self._index.forget_node(NodeId(node_id)))

    def status(self) -> dict[str, object]:
        return {
            "nodes": {
                node: {"used_bytes": u, "capacity_bytes": c, "chunks": n}
                for node, (u, c, n) in self._index.nodes().items()
            },
            "chunks": len(self._index),
            "totals": dict(vars(self._index.stats)),
        }

    def _send_drops(self, drops: dict[NodeId, list[ShardId]]) -> None:
        for node, shard_ids in drops.items():
            if not shard_ids:
                continue
            try:
                store = ray.get_actor(node_store_name(node), namespace=self._namespace)
            except ValueError:
                logger.warning("no NodeStore for node %s; %d drops lost", node, len(shard_ids))
                continue
            store.drop.remote(shard_ids)
