"""What the Ray-free store asks of the cluster, as Protocols (the actors implement them).

Each port method carries the name and parameters of the actor method behind it
(``tests/actors/test_ports.py`` compares them), so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import numpy as np

from tierstore.control.index import AdmitResult, NodeActions, ShardOffer
from tierstore.data.tiers.base import ShardMeta
from tierstore.keys import NodeId, ShardId, TierName

T_co = TypeVar("T_co", covariant=True)


class Reply(Protocol[T_co]):
    """A remote call in flight: ``result`` blocks until its answer (or its deadline)."""

    def result(self, timeout_s: float | None = None) -> T_co: ...


class EvictorPort(Protocol):
    """What a NodeStore asks of the Evictor. ``admit``/``restore`` answer; the rest are one-way."""

    def admit(self, node_id: NodeId, offers: list[ShardOffer]) -> AdmitResult: ...

    def restore(
        self, node_id: NodeId, held: list[tuple[ShardOffer, TierName]], grace: bool = False
    ) -> tuple[list[bool], NodeActions]: ...

    def promoted(
        self, node_id: NodeId, done: list[ShardId], failed: list[ShardId], refused: list[ShardId]
    ) -> None: ...

    def forget_shards(self, node_id: NodeId, shard_ids: list[ShardId]) -> None: ...

    def report_corrupt_after_hit(self, node_id: NodeId, shard_ids: list[ShardId]) -> None: ...

    def report_disk_writes(
        self, node_id: NodeId, unwritten: list[ShardId], failures: int, writable: bool
    ) -> None: ...

    def replicated(self, node_id: NodeId, done: list[ShardId], failed: list[ShardId]) -> None: ...


class PeerPort(Protocol):
    """How a NodeStore hands replica shards to another node's NodeStore: one-way. The
    call copies ``views`` out (into the object store) before it returns."""

    def accept_replicas(
        self, node: NodeId, shards: list[tuple[ShardId, ShardMeta]], views: list[np.ndarray]
    ) -> None: ...
