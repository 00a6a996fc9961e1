"""Where tierstore's actors live: names, and one NodeStore pinned to each node."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tierstore.actors.names import EVICTOR_NAME, node_store_name
from tierstore.actors.node_store_actor import CONCURRENCY_GROUPS, NodeStore

from tierstore.config import TierStoreConfig

__all__ = ["EVICTOR_NAME", "alive_node_ids", "node_store_name", "place_node_store"]


def place_node_store(cfg: TierStoreConfig, node_id: str) -> ray.actor.ActorHandle:
    """Start (or find) the NodeStore of ``node_id``; returns at once, never waits on it.
    Its concurrency groups are given here: Ray takes them only in ``ray.remote``. It
    finds the Evictor shards by name (``cfg.evictor_shards`` of them: ``cfg`` names the
    number the shards run with, as :func:`~tierstore.actors.bootstrap.running_evictors`
    returns it, or an Evictor's own)."""
    return (
        ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(NodeStore)  # type: ignore[call-overload]
        .options(
            name=node_store_name(node_id),
            namespace=cfg.namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(node_id, cfg)
    )


def alive_node_ids() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}
