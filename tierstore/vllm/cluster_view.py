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

Polls are sent from the scheduler thread (:meth:`ClusterView.maybe_poll`) and answered on
the Evictor channel's thread; both hold the manager's lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from tierstore.keys import ChunkKey, Namespace, NodeId, TierName
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.metrics import ManagerMetrics
from tierstore.vllm.residency import EventQueue
from tierstore.wire import EventBatch, ResidencyEvent

logger = logging.getLogger(__name__)

# The Evictor's status (tier gauges) is fetched at most this often, and so are its KV
# events when no presence snapshot is kept.
STATUS_PERIOD_S = 1.0


class Presence:
    """The chunks of one namespace held anywhere: per key, a bit per (node, tier) copy
    (only rank 0's shard stands for a chunk, as in the event log). Adding a copy twice
    is harmless, so replayed or overlapping events cannot leave a phantom count."""

    def __init__(self) -> None:
        self._copies: dict[ChunkKey, int] = {}
        self._bits: dict[tuple[NodeId, TierName], int] = {}

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._copies

    def __len__(self) -> int:
        return len(self._copies)

    def in_memory(self, key: ChunkKey, prefer: NodeId | None) -> NodeId | None:
        """A node holding ``key`` in memory, ``prefer`` (the asking engine's node) if it
        does; None if no node does."""
        copies = self._copies.get(key, 0)
        found = None
        if copies:
            for (node, tier), bit in self._bits.items():
                if copies & bit and tier is TierName.CPU:
                    if node == prefer:
                        return node
                    found = node
        return found

    def apply(self, events: Iterable[ResidencyEvent]) -> None:
        copies = self._copies
        for event in events:
            where = (event.node, TierName(event.tier))
            bit = self._bits.setdefault(where, 1 << len(self._bits))
            if not event.removed:
                for key in event.keys:
                    copies[key] = copies.get(key, 0) | bit
                continue
            for key in event.keys:
                left = copies.get(key, 0) & ~bit
                if left:
                    copies[key] = left
                else:
                    copies.pop(key, None)


class ClusterView:
    """The scheduler's local copy of which chunks the cluster holds (the presence
    snapshot) and of the Evictor's status, polled from the Evictor. Scheduler thread and
    the Evictor channel's thread, under the manager's lock; nothing here waits on Ray."""

    def __init__(
        self,
        channel: EvictorChannel,
        namespace: Namespace,
        lock: threading.RLock,
        metrics: ManagerMetrics,
        events: EventQueue | None,
        max_age_s: float,
    ) -> None:
        """``channel``: the lookups' channel; polls go on a sibling of it, so a lookup
        never waits behind one. ``events``: where vLLM's KV-cache events go, if it
        drains them. ``max_age_s``: how old the presence snapshot may be and still answer
        MISS; 0 keeps none (every key is asked)."""
        self._channel = channel.sibling()
        self._namespace = namespace
        self._lock = lock
        self._metrics = metrics
        self._events = events
        self._max_age_s = max_age_s
        # Events are polled this often: the snapshot is refreshed twice within its age.
        self._events_period_s = max_age_s / 2 if max_age_s else STATUS_PERIOD_S
        self._presence: Presence | None = None  # None: none trusted (not built, broken)
        self._refreshed_at = float("-inf")  # when the poll the snapshot reflects was sent
        self._dropped_at = float("-inf")  # a snapshot sent before this is not trusted
        self._seq = 0
        self._epoch = ""
        self._due = {"status": 0.0, "events": 0.0}
        self._in_flight: set[str] = set()

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
        presence = self._fresh(now)
        if presence is not None and key in presence:
            return presence.in_memory(key, local)
        return local if stored_here_lately else None

    # ---- polls (scheduler thread) ------------------------------------------------------
    def maybe_poll(self, now: float) -> None:
        """Send the polls that are due; at most one of each kind in flight."""
        if self._ready("status", now, STATUS_PERIOD_S):
            self._channel.poll(lambda e: e.status(), self._on_status, "status")
        if (self._events is None and not self._max_age_s) or not self._ready(
            "events", now, self._events_period_s
        ):
            return
        namespace = self._namespace
        if self._max_age_s and self._presence is None:
            self._channel.poll(
                lambda e: e.presence(namespace), lambda b: self._on_snapshot(b, now), "events"
            )
            return
        after = self._seq
        self._channel.poll(
            lambda e: e.events_since(after, namespace), lambda b: self._on_events(b, now), "events"
        )

    def _ready(self, kind: str, now: float, period_s: float) -> bool:
        if kind in self._in_flight or now < self._due[kind]:
            return False
        self._in_flight.add(kind)
        self._due[kind] = now + period_s
        return True

    # ---- answers (the channel's thread) ------------------------------------------------
    def _on_status(self, status: dict[str, Any] | None) -> None:
        with self._lock:
            self._in_flight.discard("status")
            if status is not None:
                self._metrics.cluster_status(status)

    def _on_snapshot(self, batch: EventBatch | None, sent_at: float) -> None:
        presence = Presence()
        if batch is not None:  # built off the lock: it may be the whole namespace
            presence.apply(batch.events)
        with self._lock:
            self._in_flight.discard("events")
            if batch is None or sent_at < self._dropped_at:
                return
            self._presence, self._refreshed_at = presence, sent_at
            self._seq, self._epoch = batch.next_seq, batch.epoch
            logger.debug("presence snapshot: %d chunks of %s", len(presence), self._namespace)
            self._forward(batch.events)

    def _on_events(self, batch: EventBatch | None, sent_at: float) -> None:
        with self._lock:
            self._in_flight.discard("events")
            if batch is None:
                return  # not refreshed: the snapshot ages out unless the next poll lands
            if batch.lost:
                logger.warning("KV events: %d residency changes lost (log wrapped)", batch.lost)
            if batch.lost or (self._epoch and batch.epoch != self._epoch):
                self._presence = None  # a gap in the chain: a new snapshot next
            elif self._presence is not None:
                self._presence.apply(batch.events)
                self._refreshed_at = sent_at
            self._seq, self._epoch = batch.next_seq, batch.epoch
            self._forward(batch.events)

    def _forward(self, events: list[ResidencyEvent]) -> None:
        if self._events is not None:
            self._events.extend(events)
