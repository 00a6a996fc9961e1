"""Where chunks come and go, for KV-cache events: a bounded, sequence-numbered log.

The Evictor records every residency change it decides (a shard entering or leaving a
node's CPU or disk tier); each engine's manager polls the changes of its namespace and
hands them to vLLM as ``OffloadingEvent``s, so a cache-aware router sees the offloaded
tiers of the whole cluster. The log is bounded: a reader that fell behind gets a
``lost`` count and continues from the oldest entry still held.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from itertools import islice

from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.wire import EventBatch, ResidencyEvent, ShardOffer

__all__ = ["EventBatch", "EventLog", "ResidencyEvent"]

# Entries (one per batch of keys) kept for slow readers: ~100 bytes each plus keys.
DEFAULT_EVENT_LOG_ENTRIES = 100_000


class EventLog:
    """Single-threaded, like the index it mirrors."""

    def __init__(self, max_entries: int = DEFAULT_EVENT_LOG_ENTRIES) -> None:
        self._entries: deque[ResidencyEvent] = deque(maxlen=max_entries)
        self._next_seq = 0
        self.epoch = uuid.uuid4().hex

    def snapshot(
        self, namespace: Namespace, held: Mapping[NodeId, Iterable[tuple[ShardId, TierName]]]
    ) -> EventBatch:
        """``held`` (every node's copies, as the index has them now) as events that a
        reader applies before the log's next entry: a picture that need not start at 0."""
        events = [
            ResidencyEvent(-1, namespace, node, tier, False, keys)
            for node, copies in held.items()
            for (tier, _), keys in _by_tier_and_namespace(
                (shard, tier) for shard, tier in copies if shard.namespace == namespace
            ).items()
        ]
        return EventBatch(self._next_seq, 0, events, self.epoch)

    def record(self, node: NodeId, tier: TierName, removed: bool, shard_ids: list[ShardId]) -> None:
        """One entry per namespace."""
        self._append(node, removed, _by_tier_and_namespace((s, tier) for s in shard_ids))

    def record_offers(self, node: NodeId, tier: TierName, offers: Iterable[ShardOffer]) -> None:
        """Offers admitted into ``node``'s ``tier``: as :meth:`record` of their shards
        (not removed), without building a ShardId each."""
        self._append(node, False, _by_tier_and_namespace((offer, tier) for offer in offers))

    def record_held(
        self, node: NodeId, removed: bool, held: Iterable[tuple[ShardId, TierName]]
    ) -> None:
        """``held``'s copies, each under its own tier (a restore, a lost node)."""
        self._append(node, removed, _by_tier_and_namespace(held))

    def _append(
        self, node: NodeId, removed: bool, groups: dict[tuple[TierName, Namespace], list[ChunkKey]]
    ) -> None:
        for (tier, namespace), keys in groups.items():
            self._entries.append(
                ResidencyEvent(self._next_seq, namespace, node, tier, removed, keys)
            )
            self._next_seq += 1

    def since(self, after: int, namespace: Namespace, limit: int = 10_000) -> EventBatch:
        """Events of ``namespace`` with ``seq >= after``, oldest first."""
        if after > self._next_seq:  # this Evictor restarted: its log began again at 0
            after = 0
        oldest = self._entries[0].seq if self._entries else self._next_seq
        lost = max(0, oldest - after)
        next_seq = max(after, oldest)
        events = []
        for entry in islice(self._entries, next_seq - oldest, None):
            next_seq = entry.seq + 1
            if entry.namespace == namespace:
                events.append(entry)
                if len(events) >= limit:
                    break
        return EventBatch(next_seq, lost, events, self.epoch)


def _by_tier_and_namespace(
    held: Iterable[tuple[ShardId | ShardOffer, TierName]],
) -> dict[tuple[TierName, Namespace], list[ChunkKey]]:
    """The keys of rank 0's shards, by tier and namespace: rank 0 stands for its chunk, so
    a TP engine's chunk is announced once."""
    groups: dict[tuple[TierName, Namespace], list[ChunkKey]] = {}
    for shard, tier in held:
        if shard.rank == 0:
            groups.setdefault((tier, shard.namespace), []).append(shard.key)
    return groups
