"""The NodeStore's counters, and a tier's fill for ``status``."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from tierstore.data.tiers.base import Tier


@dataclass
class NodeStoreStats:
    """The counters' values (what ``status`` shows); kept by :class:`StoreCounters`."""

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


_NAMES = frozenset(f.name for f in dataclasses.fields(NodeStoreStats))


class StoreCounters:
    """A NodeStore's counters, owned with their lock: one object shared by the parts that
    count (the core, its replica transfers, the arena calls).

    Any thread may call any method (loads count from several at once); each takes the
    counters' own lock briefly and never calls out while holding it, so a caller may
    hold its own locks."""

    def __init__(self) -> None:
        self._values = NodeStoreStats()
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        """Add each delta to its counter (a field of :class:`NodeStoreStats`), all at
        once. An unknown name raises ValueError and changes nothing."""
        unknown = sorted(set(deltas) - _NAMES)
        if unknown:
            raise ValueError(f"no such NodeStore counter: {', '.join(unknown)}")
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._values, name, getattr(self._values, name) + delta)

    def value(self, name: str) -> int:
        """One counter's value now."""
        if name not in _NAMES:
            raise ValueError(f"no such NodeStore counter: {name}")
        with self._lock:
            return int(getattr(self._values, name))

    def snapshot(self) -> dict[str, int]:
        """Every counter, read at one instant."""
        with self._lock:
            return dataclasses.asdict(self._values)


def tier_status(tier: Tier | None) -> dict[str, int]:
    if tier is None:
        return {"used_bytes": 0, "capacity_bytes": 0, "chunks": 0}
    return {
        "used_bytes": tier.used_bytes,
        "capacity_bytes": tier.capacity_bytes,
        "chunks": len(tier),
    }
