"""What the Ray-free store asks of the cluster, as Protocols.

:class:`EvictorPort` is the part of the Evictor's client
(``tierstore.actors.clients.EvictorClient``) a NodeStore calls: the client is passed in
as it is, and ``tests/actors/test_ports.py`` holds each method to the client's and the
actor's names and parameters; an in-process Evictor (a test's) implements it too.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tierstore.keys import NodeId, ShardId, TierName
from tierstore.wire import NodeActions, Reply, ShardMeta, ShardOffer, UnitOffer

__all__ = ["EvictorPort", "PeerPort", "Reply"]

# A restore's answer: one flag per copy offered, and the asking node's own actions.
Decision = tuple[list[bool], NodeActions]
# An admit_units' answer: per unit, one flag per shard (none for a unit refused whole),
# and the asking node's own actions.
UnitDecision = tuple[list[list[bool]], NodeActions]


class EvictorPort(Protocol):
    """What a NodeStore asks of the Evictor. Each call is sent at once and returns its
    :class:`~tierstore.wire.Reply`: ``admit_units``/``restore`` are waited for (with the
    NodeStore's deadlines); the rest are one-way (the reply is dropped). Called from the
    NodeStore's control and write-through threads, never with a lock held."""

    def admit_units(self, node_id: str, units: list[UnitOffer]) -> Reply[UnitDecision]: ...

    def restore(
        self, node_id: str, held: list[tuple[ShardOffer, TierName]], grace: bool = False
    ) -> Reply[Decision]: ...

    def promoted(
        self, node_id: str, done: list[ShardId], failed: list[ShardId], refused: list[ShardId]
    ) -> Reply[None]: ...

    def forget_shards(self, node_id: str, shard_ids: list[ShardId]) -> Reply[None]: ...

    def report_corrupt_after_hit(self, node_id: str, shard_ids: list[ShardId]) -> Reply[None]: ...

    def report_disk_writes(
        self, node_id: str, unwritten: list[ShardId], failures: int, writable: bool
    ) -> Reply[None]: ...

    def replicated(
        self, node_id: str, done: list[ShardId], failed: list[ShardId]
    ) -> Reply[None]: ...


class PeerPort(Protocol):
    """How a NodeStore hands replica shards to another node's NodeStore: one-way. The
    call copies ``views`` out (into the object store) before it returns."""

    def accept_replicas(
        self, node: NodeId, shards: list[tuple[ShardId, ShardMeta]], views: list[np.ndarray]
    ) -> None: ...
