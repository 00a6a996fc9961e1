"""What a worker needs of the cluster, as Protocols: its NodeStores and the Evictor's
answers. The actors implement them (``tierstore.actors.worker_ports``,
``tierstore.actors.clients.NodeStoreClient``); ``tests/actors/test_ports.py`` holds the
two to the same names and parameters."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId
from tierstore.vllm.worker_arena import ArenaCalls
from tierstore.wire import PullState, Reply, ShardEntry, ShardMeta

# A load's answer: the shards (read-only arrays, in key order) and their metas.
Loaded = tuple[list[np.ndarray], list[ShardMeta]]


class NodeStoreCalls(ArenaCalls, Protocol):
    """One node's NodeStore (its client): each call is sent at once; ``result`` waits."""

    def store(
        self,
        namespace: Namespace,
        rank: int,
        world_size: int,
        entries: list[ShardEntry],
        buffer: np.ndarray,
    ) -> Reply[int]: ...

    def load(self, namespace: Namespace, rank: int, keys: list[ChunkKey]) -> Reply[Loaded]: ...

    def wait_pulls(
        self, pulls: list[tuple[ShardId, NodeId]], timeout_s: float
    ) -> Reply[list[PullState]]:
        """The node's lookup-time pulls of these shards (each with its holder), started
        there if none runs and the shard is not held, waited for (at most
        ``timeout_s``): per shard, held there, failed, or none made."""
        ...


class WorkerPorts(Protocol):
    """What a worker needs of the cluster; called on transfer threads only. Injected by
    the composition root (``tierstore.spec.connect_worker``)."""

    local_node: NodeId

    def node_store(self, node: NodeId) -> NodeStoreCalls:
        """The NodeStore of ``node`` (looked up once, until forgotten)."""
        ...

    def forget_node_store(self, node: NodeId) -> None:
        """A call to it failed: it may have been replaced, look it up again next time."""
        ...

    def report_failed_stores(self, n_jobs: int) -> None:
        """Store jobs lost (vLLM has no failure path to count them by): Evictor shard 0
        counts them."""
        ...

    def locate(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        rank: int,
        avoid_node: NodeId,
        root: int = 0,
    ) -> list[NodeId | None]:
        """Per key, another node holding ``rank``'s shard, if any: asks the Evictor shard
        of ``root``, the root of the keys' prefix tree (their load's ``LoadSpec.root``)."""
        ...
