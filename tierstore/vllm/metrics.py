"""tierstore's Prometheus metrics, declared for vLLM and filled on the scheduler side.

vLLM's API server builds one Prometheus metric per entry of
``TierStoreSpec.build_metric_definitions`` and asserts that every name the manager emits
through ``get_stats`` was declared, so the declarations and the recorder live together.
Bytes and times of each transfer job are vLLM's own ``vllm:kv_offload_*`` metrics (the
worker reports them in ``TransferResult``). Cluster-wide state (tier occupancy, what the
Evictor evicted, demoted, promoted, skipped, found corrupt, store jobs workers lost, disk
writes NodeStores failed) comes from the Evictor's status, polled off the scheduler
thread, as gauges: every engine reports the same totals.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from tierstore.keys import TierName

PREFIX = "tierstore:"
LOOKUP_HITS = PREFIX + "lookup_hits"
LOOKUP_MISSES = PREFIX + "lookup_misses"
LOOKUP_TIMEOUTS = PREFIX + "lookup_timeouts"
# View hits: HITs answered from the scheduler's cluster view (its local copy of which
# chunks the cluster holds, polled from the Evictor) before their lease. The metric names
# predate the term and are kept: dashboards use them.
VIEW_HITS = PREFIX + "picture_hits"
VIEW_HITS_UNLEASED = PREFIX + "picture_hits_unleased"
LOADED_CHUNKS = PREFIX + "loaded_chunks"
STORED_CHUNKS = PREFIX + "stored_chunks"
FAILED_LOADS = PREFIX + "failed_loads"
LOOKUP_WAIT = PREFIX + "lookup_wait_seconds"
STORE_LATENCY = PREFIX + "store_latency_seconds"
LOAD_LATENCY = PREFIX + "load_latency_seconds"
TIER_USED = PREFIX + "tier_used_bytes"
TIER_CAPACITY = PREFIX + "tier_capacity_bytes"
TIER_CHUNKS = PREFIX + "tier_chunks"
CLUSTER = PREFIX + "cluster_"  # + an IndexStats field, e.g. cluster_evicted_chunks
# Disk writes that failed on any node (a full or failing filesystem): the shards kept
# their memory copies and the node's disk tier was degraded; `tierstore status` names the
# node. A cluster total, as the cluster_* ones (IndexStats.disk_write_failures).
DISK_WRITE_FAILURES = PREFIX + "disk_write_failures"

# The Evictor's cumulative counters, exported as gauges (the same cluster totals reach
# every engine, so summing them as counters would count each once per engine).
CLUSTER_TOTALS = {
    "hits": "Cluster-wide lookups answered HIT, since the Evictor started.",
    "misses": "Cluster-wide lookups answered MISS, since the Evictor started.",
    "stored_chunks": "Shards admitted into the cluster, since the Evictor started.",
    "loaded_chunks": "Chunks loaded by engines, since the Evictor started.",
    "evicted_chunks": "Chunks dropped from every tier to make room.",
    "demoted_shards": "Shards demoted from CPU to disk.",
    "promoted_shards": "Shards promoted from disk to CPU (read and verified on the way).",
    "disk_hits": "Lookups answered HIT whose bytes may be read from disk (not promoted yet).",
    "refused_promotions": "Promotions a node had no free extent for (the chunk stays on disk).",
    "skipped_stores": "Stores refused because only leased or pinned chunks were left.",
    "failed_stores": "Store jobs a worker could not hand to its NodeStore (not kept).",
    "replicated_chunks": "Hot chunks copied to a node that kept loading them from another.",
    "corrupt_before_hit": "Chunks that failed verification while promoted (became misses).",
    "corrupt_after_hit": "Chunks that failed verification on load (the request recomputed).",
}

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_TIER = ("tier",)
_NODE_TIER = ("node", "tier")
# Node ids are 56 hex characters; 12 keep them unique in any real cluster.
_NODE_LABEL_CHARS = 12


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    counters = {
        LOOKUP_HITS: ("Chunk lookups answered HIT, by the tier that served them.", _TIER),
        LOOKUP_MISSES: ("Chunk lookups answered MISS.", ()),
        LOOKUP_TIMEOUTS: (
            "Chunk lookups not answered within lookup_timeout_ms (computed as misses).",
            (),
        ),
        VIEW_HITS: (
            "Chunk lookups answered HIT from the scheduler's cluster view (which chunks the "
            "cluster holds, polled from the Evictor), before the Evictor leased them (also "
            "counted in lookup_hits).",
            (),
        ),
        VIEW_HITS_UNLEASED: (
            "HITs from the cluster view that the Evictor then answered MISS (the chunk went "
            "meanwhile: its load reads another copy, or the request recomputes).",
            (),
        ),
        LOADED_CHUNKS: ("Chunks loaded into the KV cache, by the tier that served them.", _TIER),
        STORED_CHUNKS: ("Chunks this engine stored into tierstore.", ()),
        FAILED_LOADS: ("Load jobs that failed; their requests were recomputed.", ()),
    }
    histograms = {
        LOOKUP_WAIT: "Time from a lookup's first RETRY to the Evictor's answer.",
        STORE_LATENCY: "Time from prepare_store to complete_store of a store job.",
        LOAD_LATENCY: "Time from prepare_load to complete_load of a load job.",
    }
    gauges = {
        TIER_USED: "Bytes held by each node's tier.",
        TIER_CAPACITY: "Capacity of each node's tier, in bytes.",
        TIER_CHUNKS: "Shards held by each node's tier.",
    }
    out: dict[str, OffloadingMetricMetadata] = {}
    for name, (doc, labels) in counters.items():
        out[name] = OffloadingCounterMetadata(documentation=doc, labelnames=labels)
    for name, doc in histograms.items():
        out[name] = OffloadingHistogramMetadata(documentation=doc, buckets=_LATENCY_BUCKETS_S)
    for name, doc in gauges.items():
        out[name] = OffloadingGaugeMetadata(documentation=doc, labelnames=_NODE_TIER)
    for field_name, doc in CLUSTER_TOTALS.items():
        out[CLUSTER + field_name] = OffloadingGaugeMetadata(documentation=doc)
    out[DISK_WRITE_FAILURES] = OffloadingGaugeMetadata(
        documentation="Disk writes that failed on any node since the Evictor started (the "
        "shards kept their memory copies; the node's disk tier is retried later)."
    )
    return out


def sum_status(statuses: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Evictor shards' ``status()`` as one cluster's, for :meth:`ManagerMetrics.cluster_status`:
    each node's tier figures and the totals summed over the shards (each shard holds its
    share of every node's capacity, its own chunks, its own counters)."""
    nodes: dict[str, dict[str, dict[str, int]]] = {}
    totals: dict[str, int] = {}
    for status in statuses:
        for node, tiers in status.get("nodes", {}).items():
            node_tiers = nodes.setdefault(node, {})
            for tier, figures in tiers.items():
                summed = node_tiers.setdefault(tier, {})
                for name, value in figures.items():
                    summed[name] = summed.get(name, 0) + value
        for name, value in status.get("totals", {}).items():
            if isinstance(value, int):
                totals[name] = totals.get(name, 0) + value
    return {"nodes": nodes, "totals": totals}


class ManagerMetrics:
    """Collects one stats payload between two ``get_stats`` calls (scheduler lock held)."""

    def __init__(self) -> None:
        self._stats = OffloadingConnectorStats()

    def count(self, name: str, value: int = 1, tier: TierName | None = None) -> None:
        if value:
            labels = (tier.value,) if tier is not None else ()
            self._stats.increase_counter(name, value, labels)

    def observe(self, name: str, seconds: float) -> None:
        self._stats.observe_histogram(name, seconds)

    def cluster_status(self, status: dict[str, Any]) -> None:
        """The Evictor's ``status()``: tier gauges per node, and the cluster totals."""
        for node, tiers in status.get("nodes", {}).items():
            for tier, figures in tiers.items():
                labels = (str(node)[:_NODE_LABEL_CHARS], str(tier))
                self._stats.set_gauge(TIER_USED, figures["used_bytes"], labels)
                self._stats.set_gauge(TIER_CAPACITY, figures["capacity_bytes"], labels)
                self._stats.set_gauge(TIER_CHUNKS, figures["chunks"], labels)
        totals = status.get("totals", {})
        for field_name in CLUSTER_TOTALS:
            if field_name in totals:
                self._stats.set_gauge(CLUSTER + field_name, totals[field_name])
        if "disk_write_failures" in totals:
            self._stats.set_gauge(DISK_WRITE_FAILURES, totals["disk_write_failures"])

    def take(self) -> OffloadingConnectorStats | None:
        """The payload so far, or None when empty."""
        stats = self._stats
        if stats.is_empty():
            return None
        self._stats = OffloadingConnectorStats()
        return stats
