"""The cluster view: the scheduler's local copy of what the Evictor knows, polled
off-thread. It holds the Evictor's status (tier gauges), its residency changes (vLLM's
KV-cache events), and the presence snapshot: which chunks the cluster holds at all, and
on which node and tier.

The presence snapshot lets a lookup of a key no node holds answer MISS at once, and one
some node holds in memory answer HIT at once (a *view hit*, where the manager allows
it: its ``answer_hits_from_picture``). Without it every new request waited one Evictor
round trip and a scheduler step before it could be scheduled. It is built from a
snapshot of the Evictor's index, kept up to date from the Evictor's event log, and
trusted only while it is fresh (``presence_max_age_ms`` since the poll it reflects was
sent): a chunk another engine stored since then reads as absent and is recomputed, a
lost hit and never wrong output. Whatever breaks the chain (the log wrapped past this
reader, the Evictor restarted) drops it until a new snapshot lands; meanwhile, and
whenever it is stale (an idle scheduler polls nothing), every key is asked as before.

With sharded Evictors (``evictor_shards``), every poll goes to every shard: each shard
has its own event cursor (sequence number and epoch), the snapshot is the union of
every shard's (taken only when all of them answered), as fresh as its stalest shard, and
a gap in any shard's chain drops it whole (a new one from every shard next). The status
gauges are every shard's last status, summed.

Polls are sent from the scheduler thread (:meth:`ClusterView.maybe_poll`) and answered on
the Evictor channel's threads (one per shard); both hold the manager's lock.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from tierstore.keys import ChunkKey, Namespace, NodeId, TierName
from tierstore.vllm.evictor_channel import EvictorCalls, EvictorChannel
from tierstore.vllm.key_table import KeyTable
from tierstore.vllm.metrics import ManagerMetrics, sum_status
from tierstore.vllm.residency import EventQueue
from tierstore.wire import EventBatch, Reply, ResidencyEvent

logger = logging.getLogger(__name__)

# The Evictor's status (tier gauges) is fetched at most this often, and so are its KV
# events when no presence snapshot is kept.
STATUS_PERIOD_S = 1.0


class Presence:
    """The chunks of one namespace held anywhere, and where: a :class:`KeyTable` of
    their keys, each with a 16-bit mask of (node, tier) copies (only rank 0's shard
    stands for a chunk, as in the event log). 8 B per chunk in a table kept 50-75 %
    full: at most 16 B per chunk.

    Bits 0-6 are the CPU tiers and 8-14 the disk tiers of the first seven nodes seen of
    each (``local``, this engine's node, first): exact, so adding a copy twice is harmless
    and a removal clears just its copy. Bits 7 and 15 stand for every other node's CPU and
    disk tier: set by any copy there and never cleared (which of those nodes lost its copy
    is not known), so they can only make a key read as held (asked, never answered MISS
    at once) and never name a node to load from. A false positive of the table (another
    key's fingerprint) reads as held the same way: it is asked, or, answered from the view,
    its load finds no such key and the request recomputes."""

    _DEDICATED = 7  # exact bits per tier kind
    _SHARED_CPU = 1 << 7
    _SHARED_DISK = 1 << 15
    _CPU_BITS = 0x7F

    def __init__(self, local: NodeId | None = None) -> None:
        self._table = KeyTable()
        self._bits: dict[tuple[NodeId, TierName], int] = {}
        self._nodes: dict[int, NodeId] = {}  # a dedicated CPU bit -> its node
        self._cpu_nodes = self._disk_nodes = 0
        if local is not None:
            self._bit(local, TierName.CPU)
            self._bit(local, TierName.DISK)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._table

    def __len__(self) -> int:
        return len(self._table)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def _bit(self, node: NodeId, tier: TierName) -> int:
        bit = self._bits.get((node, tier))
        if bit is not None:
            return bit
        if tier is TierName.CPU:
            index, self._cpu_nodes = self._cpu_nodes, self._cpu_nodes + 1
            bit = 1 << index if index < self._DEDICATED else self._SHARED_CPU
            if index < self._DEDICATED:
                self._nodes[bit] = node
        else:
            index, self._disk_nodes = self._disk_nodes, self._disk_nodes + 1
            bit = 1 << (8 + index) if index < self._DEDICATED else self._SHARED_DISK
        self._bits[(node, tier)] = bit
        return bit

    def in_memory(self, key: ChunkKey, prefer: NodeId | None) -> NodeId | None:
        """A node holding ``key`` in memory, ``prefer`` (the asking engine's node) if it
        does; None if no node does, or only nodes past the first seven do."""
        return self.where(key, prefer)[1]

    def where(self, key: ChunkKey, prefer: NodeId | None) -> tuple[bool, NodeId | None]:
        """Whether ``key`` is held anywhere, and :meth:`in_memory`'s node (one probe)."""
        mask = self._table.mask(key)
        cpu = mask & self._CPU_BITS
        if not cpu:
            return mask != 0, None
        if prefer is not None and cpu & self._bits.get((prefer, TierName.CPU), 0):
            return True, prefer
        return True, self._nodes[cpu & -cpu]  # the lowest bit set

    def apply(self, events: Iterable[ResidencyEvent]) -> None:
        for event in events:
            bit = self._bit(event.node, TierName(event.tier))
            if not event.removed:
                self._table.update(event.keys, set_bits=bit)
            elif bit not in (self._SHARED_CPU, self._SHARED_DISK):
                self._table.update(event.keys, clear_bits=bit)


class ClusterView:
    """The scheduler's local copy of which chunks the cluster holds (the presence
    snapshot) and of the Evictor's status, polled from the Evictor. Scheduler thread and
    the Evictor channel's thread, under the manager's lock; nothing here waits on Ray."""

    def __init__(  # noqa: PLR0913 - the manager's state it shares, and its settings
        self,
        channel: EvictorChannel,
        namespace: Namespace,
        lock: threading.RLock,
        metrics: ManagerMetrics,
        events: EventQueue | None,
        max_age_s: float,
        local: NodeId | None = None,
    ) -> None:
        """``channel``: the lookups' channel; polls go on a sibling of it, so a lookup
        never waits behind one. ``events``: where vLLM's KV-cache events go, if it
        drains them. ``max_age_s``: how old the presence snapshot may be and still answer
        MISS; 0 keeps none (every key is asked). ``local``: this engine's node (its copies
        are always told apart in the snapshot)."""
        self._local = local
        self._channel = channel.sibling()
        self._shards = self._channel.shards
        self._namespace = namespace
        self._lock = lock
        self._metrics = metrics
        self._events = events
        self._max_age_s = max_age_s
        # Events are polled this often: the snapshot is refreshed twice within its age.
        self._events_period_s = max_age_s / 2 if max_age_s else STATUS_PERIOD_S
        self._presence: Presence | None = None  # None: none trusted (not built, broken)
        # When the poll each shard's part of the snapshot reflects was sent, and the
        # oldest of them: the snapshot is as fresh as its stalest shard.
        self._shard_refreshed = [float("-inf")] * self._shards
        self._refreshed_at = float("-inf")
        self._dropped_at = float("-inf")  # a snapshot sent before this is not trusted
        # Each shard's event cursor: its log's next sequence number and epoch.
        self._seq = [0] * self._shards
        self._epoch = [""] * self._shards
        self._status: list[dict[str, Any] | None] = [None] * self._shards  # last of each
        self._due = {"status": 0.0, "events": 0.0}
        # Kinds polled and not answered by every shard yet: answers still to come.
        self._in_flight: dict[str, int] = {}

    def close(self) -> None:
        self._channel.close()

    def drop(self, now: float) -> None:
        """Scheduler thread (the engine's cache reset): forget the presence snapshot;
        every key is asked until a snapshot sent after ``now`` lands. A reset also
        forgets which chunks this engine just stored, the guard that kept a snapshot
        polled before their commits from answering them MISS."""
        self._presence = None
        self._dropped_at = now

    def _fresh(self, now: float) -> Presence | None:
        """The presence snapshot, if one is trusted and at most ``max_age_s`` old."""
        presence = self._presence
        if presence is None or now - self._refreshed_at > self._max_age_s:
            return None
        return presence

    def absent(self, key: ChunkKey, now: float) -> bool:
        """No node held ``key`` as of a presence snapshot at most ``max_age_s`` old."""
        presence = self._fresh(now)
        return presence is not None and key not in presence

    def loadable_from(
        self, key: ChunkKey, now: float, local: NodeId | None, stored_here_lately: bool
    ) -> NodeId | None:
        """Where a view hit (answered before its lease) may load ``key`` from: a node the
        fresh snapshot shows holding it in memory (``local``, this engine's node, first).
        If no fresh snapshot shows it at all but this engine stored it lately (its commit came
        after the last poll), ``local``: its workers put it there, and one whose commit
        of it is still on its way waits for it. Without that, a prefix stored within the
        last poll period waited an Evictor round trip and a step more. None: ask.

        A chunk demoted to disk since is read from disk by its NodeStore, one held only
        on another node from there; one gone everywhere fails its load and the request
        recomputes, as with any view hit."""
        return self.locate(key, now, local, stored_here_lately)[1]

    def locate(
        self, key: ChunkKey, now: float, local: NodeId | None, stored_here_lately: bool
    ) -> tuple[bool, NodeId | None]:
        """:meth:`absent` (as False) and :meth:`loadable_from` in one probe: whether
        ``key`` may be held (False: no node held it as of a fresh snapshot), and where a
        view hit may load it from."""
        presence = self._fresh(now)
        if presence is None:
            return True, local if stored_here_lately else None
        held, node = presence.where(key, local)
        if not held:
            return False, local if stored_here_lately else None
        return True, node

    # ---- polls (scheduler thread) ------------------------------------------------------
    def maybe_poll(self, now: float) -> None:
        """Send the polls that are due, each to every Evictor shard; at most one round of
        each kind in flight."""
        if self._ready("status", now, STATUS_PERIOD_S):
            for shard in range(self._shards):
                self._channel.poll(
                    lambda e: e.status(), functools.partial(self._on_status, shard), "status", shard
                )
        if (self._events is None and not self._max_age_s) or not self._ready(
            "events", now, self._events_period_s
        ):
            return
        namespace = self._namespace
        if self._max_age_s and self._presence is None:
            parts: list[EventBatch | None] = [None] * self._shards
            for shard in range(self._shards):
                self._channel.poll(
                    lambda e: e.presence(namespace),
                    functools.partial(self._on_snapshot, shard, parts, now),
                    "events",
                    shard,
                )
            return
        for shard, after in enumerate(self._seq):
            self._channel.poll(
                _events_since(after, namespace),
                functools.partial(self._on_events, shard, now),
                "events",
                shard,
            )

    def _ready(self, kind: str, now: float, period_s: float) -> bool:
        if kind in self._in_flight or now < self._due[kind]:
            return False
        self._in_flight[kind] = self._shards
        self._due[kind] = now + period_s
        return True

    # ---- answers (the channels' threads, one per shard) -------------------------------
    def _answered(self, kind: str) -> bool:
        """One shard answered a poll of ``kind`` (lock held); whether it was the last."""
        left = self._in_flight[kind] - 1
        if left:
            self._in_flight[kind] = left
            return False
        del self._in_flight[kind]
        return True

    def _on_status(self, shard: int, status: dict[str, Any] | None) -> None:
        with self._lock:
            if status is not None:
                self._status[shard] = status
            if self._answered("status"):  # the cluster's: every shard's last one, summed
                self._metrics.cluster_status(sum_status(s for s in self._status if s))

    def _on_snapshot(
        self, shard: int, parts: list[EventBatch | None], sent_at: float, batch: EventBatch | None
    ) -> None:
        """A shard's part of a snapshot round: the round is kept only once every shard's
        part landed, and only if none failed."""
        with self._lock:
            parts[shard] = batch
            if not self._answered("events"):
                return
        batches = [b for b in parts if b is not None]
        if len(batches) < len(parts):
            return  # a shard failed: the next round asks every shard again
        presence = Presence(self._local)
        for part in batches:  # built off the lock: it may be the whole namespace
            presence.apply(part.events)
        with self._lock:
            if sent_at < self._dropped_at:
                return
            self._presence = presence
            self._shard_refreshed = [sent_at] * self._shards
            self._refreshed_at = sent_at
            self._seq = [b.next_seq for b in batches]
            self._epoch = [b.epoch for b in batches]
            logger.debug(
                "presence snapshot: %d chunks of %s in %d bytes (%d Evictor shards)",
                len(presence),
                self._namespace,
                presence.nbytes,
                self._shards,
            )
            for part in batches:
                self._forward(part.events)

    def _on_events(self, shard: int, sent_at: float, batch: EventBatch | None) -> None:
        with self._lock:
            self._answered("events")
            if batch is None:
                return  # not refreshed: the snapshot ages out unless the next poll lands
            if batch.lost:
                logger.warning(
                    "KV events: %d residency changes lost (Evictor shard %d's log wrapped)",
                    batch.lost,
                    shard,
                )
            if batch.lost or (self._epoch[shard] and batch.epoch != self._epoch[shard]):
                self._presence = None  # a gap in a shard's chain: a new snapshot next
            elif self._presence is not None:
                self._presence.apply(batch.events)
                self._shard_refreshed[shard] = sent_at
                self._refreshed_at = min(self._shard_refreshed)
            self._seq[shard], self._epoch[shard] = batch.next_seq, batch.epoch
            self._forward(batch.events)

    def _forward(self, events: list[ResidencyEvent]) -> None:
        if self._events is not None:
            self._events.extend(events)


def _events_since(after: int, namespace: Namespace) -> Callable[[EvictorCalls], Reply[EventBatch]]:
    """The poll of a shard's events after its cursor ``after``."""
    return lambda e: e.events_since(after, namespace)
