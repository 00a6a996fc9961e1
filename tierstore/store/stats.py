"""The NodeStore's counters, and a tier's fill for ``status``."""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.data.tiers.base import Tier


@dataclass
class NodeStoreStats:
    """Counters; written only through :meth:`NodeStoreCore._count` (under its lock)."""

    stored_shards: int = 0
    skipped_shards: int = 0
    loaded_shards: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    dropped_shards: int = 0
    demoted_shards: int = 0
    promoted_shards: int = 0
    refused_promotions: int = 0  # no extent free: the shard stayed on disk
    replicas_sent: int = 0  # shards pushed to nodes that kept loading them
    replicas_received: int = 0
    failed_demotions: int = 0  # not written to disk: the shard was dropped (and forgotten)
    # Disk writes (write-through, demotion) that failed: the filesystem's error (ENOSPC,
    # EIO...), which degrades the disk tier, or the tier's refusal. The shard kept its
    # memory copy, or was dropped knowingly if it had none left.
    disk_write_failures: int = 0
    disk_writes_skipped: int = 0  # not tried, the disk tier degraded: as a failed one
    corrupt_on_store: int = 0
    corrupt_before_hit: int = 0
    corrupt_after_hit: int = 0
    refused_commits: int = 0  # store jobs refused whole: a malformed field (wire.check_job)


def tier_status(tier: Tier | None) -> dict[str, int]:
    if tier is None:
        return {"used_bytes": 0, "capacity_bytes": 0, "chunks": 0}
    return {
        "used_bytes": tier.used_bytes,
        "capacity_bytes": tier.capacity_bytes,
        "chunks": len(tier),
    }
