"""The composition root, and the stable import path for vLLM:
``"spec_name": "TierStoreSpec", "spec_module_path": "tierstore.spec"``.

The one module inside ``tierstore/`` that imports the actor layer: it builds the actors'
clients and injects them into the vLLM adapter (``tierstore.vllm``), which knows only the
Protocols it needs (``EvictorCalls``, ``WorkerPorts``). See the README's layer rule.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadingWorker

from tierstore.actors.bootstrap import (
    connect,
    evictor_clients,
    get_or_create_node_store,
    this_node_id,
)
from tierstore.actors.clients import NodeStoreClient
from tierstore.actors.worker_ports import RayWorkerPorts
from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout
from tierstore.keys import NodeId
from tierstore.vllm.cpu_affinity import started_threads_leave_compute_cores
from tierstore.vllm.device_copy import make_copier
from tierstore.vllm.evictor_channel import EvictorCalls
from tierstore.vllm.spec import TierStoreSpecBase
from tierstore.vllm.worker import TierStoreWorker

__all__ = ["TierStoreSpec", "connect_worker"]


class TierStoreSpec(TierStoreSpecBase):
    """The spec vLLM loads: :class:`TierStoreSpecBase` wired to tierstore's Ray actors."""

    def _connect_manager(self) -> tuple[list[EvictorCalls], NodeId]:
        connect(self.store_config)
        evictors: list[EvictorCalls] = list(evictor_clients(self.store_config))
        return evictors, NodeId(this_node_id())

    def _connect_worker(self, layout: ChunkLayout) -> OffloadingWorker:
        with started_threads_leave_compute_cores():  # Ray's threads, on a vLLM-CPU worker
            connect(self.store_config)
        return connect_worker(
            self.store_config,
            layout,
            rank=self.config.parallel.rank,
            world_size=self.config.parallel.world_size,
        )


def connect_worker(
    cfg: TierStoreConfig, layout: ChunkLayout, rank: int = 0, world_size: int = 1
) -> TierStoreWorker:
    """A worker for this process's node (:func:`~tierstore.actors.bootstrap.this_node_id`),
    once that node's NodeStore is up (the spec, the benchmarks and the tests all start a
    worker here).

    Start-up only (never in a step): it waits until the NodeStore has registered what its
    disk tier recovered, so the first lookups already see it.
    """
    node = NodeId(this_node_id())
    evictors = evictor_clients(cfg, cfg.transfer_timeout_s)  # one per Evictor shard
    local_store = NodeStoreClient(get_or_create_node_store(cfg, node), node)
    local_store.status().result(cfg.transfer_timeout_s)
    ports = RayWorkerPorts(cfg.namespace, node, evictors, cfg.transfer_timeout_s)
    copier = make_copier(layout, cfg.pinned_bounce_bytes)
    return TierStoreWorker(layout, rank, world_size, ports, cfg.transfer_timeout_s, copier)
