"""Evictor: one per cluster; the index, capacity accounting, leases and eviction policy.

All decisions live in :class:`~tierstore.control.index.ChunkIndex`; this actor adds the
clock and sends each NodeStore its share of a decision. It never waits on a NodeStore
(they call it synchronously on store, so waiting back could deadlock): what it sends
them is one-way, and the calling NodeStore gets its own share in the reply.
"""

from __future__ import annotations

import logging
import time

import ray

from tierstore.control.index import (
    Actions,
    ChunkIndex,
    LookupAnswer,
    NodeActions,
    ShardOffer,
    Watermarks,
)
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName

logger = logging.getLogger(__name__)

EVICTOR_NAME = "tierstore-evictor"


def node_store_name(node_id: str) -> str:
    return f"tierstore-nodestore-{node_id}"


class Evictor:
    def __init__(
        self, namespace: str, policy: str = "lru", watermarks: Watermarks | None = None
    ) -> None:
        self._namespace = namespace
        self._index = ChunkIndex(policy, watermarks)

    def register_node(self, node_id: str, cpu_bytes: int, disk_bytes: int = 0) -> None:
        self._index.register_node(NodeId(node_id), cpu_bytes, disk_bytes)

    def admit(self, node_id: str, offers: list[ShardOffer]) -> tuple[list[bool], NodeActions]:
        result = self._index.admit(
            NodeId(node_id), [ShardOffer(*o) for o in offers], time.monotonic()
        )
        return result.accepted, self._send(result.actions, keep=NodeId(node_id))

    def restore(
        self, node_id: str, held: list[tuple[ShardOffer, TierName]]
    ) -> tuple[list[bool], NodeActions]:
        accepted, actions = self._index.restore(
            NodeId(node_id), [(ShardOffer(*o), TierName(t)) for o, t in held]
        )
        return accepted, self._send(actions, keep=NodeId(node_id))

    def lookup(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, lease_ttl_s: float
    ) -> list[LookupAnswer]:
        answers, actions = self._index.lookup(
            namespace, keys, holder, time.monotonic(), lease_ttl_s
        )
        self._send(actions)
        return answers

    def promoted(self, node_id: str, done: list[ShardId], failed: list[ShardId]) -> None:
        self._send(self._index.promoted(NodeId(node_id), _ids(done), _ids(failed)))

    def forget_shards(self, node_id: str, shard_ids: list[ShardId]) -> None:
        self._send(self._index.forget_shards(_ids(shard_ids)))

    def report_corrupt_after_hit(self, node_id: str, shard_ids: list[ShardId]) -> None:
        self._send(self._index.report_corrupt_after_hit(_ids(shard_ids)))

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

    def forget_node(self, node_id: str) -> None:
        self._send(self._index.forget_node(NodeId(node_id)))

    def index_view(self, node_id: str) -> set[tuple[ShardId, TierName]]:
        """What the index believes ``node_id`` holds (tests compare it with the node)."""
        return self._index.shards_on(NodeId(node_id))

    def status(self) -> dict[str, object]:
        return {
            "nodes": {
                node: {
                    tier.value: {"used_bytes": u, "capacity_bytes": c, "chunks": n}
                    for tier, (u, c, n) in tiers.items()
                }
                for node, tiers in self._index.nodes().items()
            },
            "chunks": len(self._index),
            "totals": dict(vars(self._index.stats)),
        }

    def _send(self, actions: Actions, keep: NodeId | None = None) -> NodeActions:
        """Send each node its actions, one-way; return (not send) those of ``keep``."""
        own = NodeActions()
        for node, node_actions in actions.items():
            if node == keep:
                own = node_actions
                continue
            if not node_actions:
                continue
            try:
                store = ray.get_actor(node_store_name(node), namespace=self._namespace)
            except ValueError:
                logger.warning("no NodeStore for node %s; its actions are lost", node)
                continue
            store.apply.remote(node_actions)
        return own


def _ids(shard_ids: list[ShardId]) -> list[ShardId]:
    return [ShardId(Namespace(n), ChunkKey(k), int(r)) for n, k, r in shard_ids]
