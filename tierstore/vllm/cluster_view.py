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
from tierstore.vllm.key_table import KeyTable
from tierstore.vllm.metrics import ManagerMetrics
from tierstore.vllm.residency import EventQueue
from tierstore.wire import EventBatch, ResidencyEvent

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
        presence = Presence(self._local)
        if batch is not None:  # built off the lock: it may be the whole namespace
            presence.apply(batch.events)
        with self._lock:
            self._in_flight.discard("events")
            if batch is None or sent_at < self._dropped_at:
                return
            self._presence, self._refreshed_at = presence, sent_at
            self._seq, self._epoch = batch.next_seq, batch.epoch
            logger.debug(
                "presence snapshot: %d chunks of %s in %d bytes",
                len(presence),
                self._namespace,
                presence.nbytes,
            )
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
