"""A worker's view of the cluster over Ray: NodeStore handles, the Evictor, and the one
place a worker is wired up (the spec, the benchmarks and the tests all start it here)."""

from __future__ import annotations

import logging

import ray

from tierstore.actors.bootstrap import (
    find_node_store,
    get_or_create_evictor,
    get_or_create_node_store,
)
from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.vllm.worker import TierStoreWorker

logger = logging.getLogger(__name__)


class RayWorkerPorts:
    """NodeStore handles by node, each looked up once (a lookup is a GCS round trip) and
    again after a failure, since a NodeStore that died is replaced under the same name."""

    def __init__(
        self, namespace: str, local_node: NodeId, evictor: ray.actor.ActorHandle, timeout_s: float
    ) -> None:
        self.local_node = local_node
        self._namespace = namespace
        self._evictor = evictor
        self._timeout_s = timeout_s
        self._handles: dict[NodeId, ray.actor.ActorHandle] = {}

    def node_store(self, node: NodeId) -> ray.actor.ActorHandle:
        handle = self._handles.get(node)
        if handle is None:
            handle = self._handles[node] = find_node_store(self._namespace, node)
        return handle

    def forget_node_store(self, node: NodeId) -> None:
        self._handles.pop(node, None)

    def report_failed_stores(self, n_jobs: int) -> None:
        self._evictor.report_failed_stores.remote(n_jobs)

    def other_copies(
        self, namespace: Namespace, keys: list[ChunkKey], rank: int, avoid: NodeId
    ) -> list[NodeId | None]:
        return ray.get(
            self._evictor.locate.remote(namespace, keys, rank, avoid), timeout=self._timeout_s
        )


def connect_worker(
    cfg: TierStoreConfig, layout: ChunkLayout, rank: int = 0, world_size: int = 1
) -> TierStoreWorker:
    """A worker for this process's node, once that node's NodeStore is up.

    Start-up only (never in a step): it waits until the NodeStore has registered what its
    disk tier recovered, so the first lookups already see it.
    """
    node = NodeId(ray.get_runtime_context().get_node_id())
    evictor = get_or_create_evictor(cfg)
    local_store = get_or_create_node_store(cfg, node)
    ray.get(local_store.status.remote(), timeout=cfg.transfer_timeout_s)
    ports = RayWorkerPorts(cfg.namespace, node, evictor, cfg.transfer_timeout_s)
    return TierStoreWorker(layout, rank, world_size, ports, cfg.transfer_timeout_s)
