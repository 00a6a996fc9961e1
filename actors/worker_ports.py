"""A worker's view of the cluster over Ray (its ``WorkerPorts``): NodeStore clients by
node and the Evictor shards' clients. The composition root (``tierstore.spec``) injects it."""

from __future__ import annotations

import logging

from tierstore.actors.bootstrap import find_node_store
from tierstore.actors.clients import EvictorClient, NodeStoreClient

from tierstore.keys import ChunkKey, Namespace, NodeId, shard_of

logger = logging.getLogger(__name__)


class RayWorkerPorts:
    """NodeStore clients by node, each looked up once (a lookup is a GCS round trip) and
    again after a failure, since a NodeStore that died is replaced under the same name.
    Called on the worker's transfer threads."""

    def __init__(
        self,
        namespace: str,
        local_node: NodeId,
        evictors: list[EvictorClient],
        timeout_s: float,
    ) -> None:
        """``evictors``: one client per Evictor shard, index = shard."""
        self.local_node = local_node
        self._namespace = namespace
        self._evictors = evictors
        self._timeout_s = timeout_s
        self._clients: dict[NodeId, NodeStoreClient] = {}

    def node_store(self, node: NodeId) -> NodeStoreClient:
        client = self._clients.get(node)
        if client is None:
            handle = find_node_store(self._namespace, node)
            client = self._clients[node] = NodeStoreClient(handle, node, self._timeout_s)
        return client

    def forget_node_store(self, node: NodeId) -> None:
        self._clients.pop(node, None)

    def report_failed_stores(self, n_jobs: int) -> None:
        self._evictors[0].report_failed_stores(n_jobs)  # one-way; shard 0 counts them

    def locate(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        rank: int,
        avoid_node: NodeId,
        root: int = 0,
    ) -> list[NodeId | None]:
        evictor = self._evictors[shard_of(root, len(self._evictors))]
        return evictor.locate(namespace, keys, rank, avoid_node).result(self._timeout_s)
