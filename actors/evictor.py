"""Evictor: the index, capacity accounting, leases and eviction policy, in
``evictor_shards`` actors (shards): shard ``i`` owns the prefix trees whose root maps to
it (:func:`~tierstore.keys.shard_of`) and ``1/evictor_shards`` of every node's tiers.

All decisions live in the index (:func:`~tierstore.control.compact_index.make_index`: the
compact C index, or :class:`~tierstore.control.index.ChunkIndex` for ARC or without the
C build; the same decisions either way); this actor adds the clock and sends each
NodeStore its share of a decision. It never waits on a NodeStore (they call it
synchronously on store, so waiting back could deadlock): what it sends them is one-way,
and the calling NodeStore gets its own share in the reply.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from itertools import chain, compress
from operator import itemgetter
from typing import TypeVar

import ray
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from tierstore.actors.placement import alive_node_ids, node_store_name, place_node_store

from tierstore.config import TierStoreConfig
from tierstore.control.compact_index import make_index
from tierstore.control.events import EventLog
from tierstore.control.index import Actions, Watermarks
from tierstore.errors import ConfigError
from tierstore.fields import MalformedField, integer
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.wire import (
    MAX_ENTRIES,
    AnswerColumns,
    EventBatch,
    LookupAnswer,
    LookupState,
    NodeActions,
    OfferColumns,
    ShardOffer,
    answer_columns,
    checked_shard_ids,
    held_of,
    held_shard,
    offers_of,
    unit_offers_of,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often the Evictor reconciles NodeStores with Ray's alive nodes. Ray itself marks
# a lost node dead after ~14 s of failed health checks, so polling faster gains little.
_RECONCILE_PERIOD_S = 2.0
# The ticker waits for each reconcile (so they never pile up behind a slow one); one that
# takes longer than this is counted as failed and the next is sent.
_RECONCILE_TIMEOUT_S = 60.0


class Evictor:
    """One shard of the index (``shard``, of ``cfg.evictor_shards``: a number, never
    ``"auto"``, which its starter resolves, :mod:`tierstore.actors.bootstrap`). Shard 0
    also keeps one NodeStore on every alive node: a node that joins gets one within a
    reconcile period. Every shard forgets the chunks of a node that leaves, and has a
    NodeStore it does not know offer it its share again (:meth:`reconcile`)."""

    def __init__(self, cfg: TierStoreConfig, shard: int = 0) -> None:
        if not 0 <= shard < cfg.shard_count:
            raise ConfigError(
                f"Evictor shard {shard!r}: expected 0 to {cfg.shard_count - 1} "
                f"(evictor_shards is {cfg.shard_count})"
            )
        self._cfg = cfg
        self._shard = shard
        self._namespace = cfg.namespace
        self._index = make_index(
            cfg.eviction_policy,
            Watermarks(cfg.cpu_high_watermark, cfg.cpu_low_watermark),
            replicate_after_loads=cfg.replicate_after_loads,
        )
        self._events = EventLog()
        self._store_ids: dict[NodeId, str] = {}  # node -> the NodeStore that registered it
        # node -> its NodeStore's client, looked up once per registration (``_node_store``)
        self._stores: dict[NodeId, NodeStoreClient] = {}
        # Each node's pressure (shards evicted, demoted or refused by its stores) and this
        # shard's calls asked of it (lookups, admits), counted from the start: a NodeStore
        # rebalancing this shard's share of its node reads their growth (node_load).
        self._pressure: dict[NodeId, int] = {}
        self._asked = 0
        self._stop = threading.Event()
        self._reconciles = 0  # done, on the actor's thread
        self._reconcile_failures = 0  # counted on the ticker's thread
        me = EvictorClient(ray.get_runtime_context().current_actor, _RECONCILE_TIMEOUT_S)
        # The thread only sends calls to this actor and waits for them: all index work
        # stays on the actor's own thread, so nothing here needs a lock.
        self._ticker = threading.Thread(
            target=self._tick, args=(me,), name="tierstore-reconcile", daemon=True
        )
        self._ticker.start()
        # What this process holds now (Ray's and tierstore's modules) lives as long as it:
        # out of the cyclic GC's sight from the start, as the index is after each
        # reconcile, so a young Evictor's first full collection does not scan it.
        gc.freeze()

    def _tick(self, me: EvictorClient) -> None:
        """The ticker thread: a failed reconcile is logged and counted, never its end."""
        while not self._stop.wait(_RECONCILE_PERIOD_S):
            try:
                me.reconcile().result()
            except Exception:
                self._reconcile_failures += 1
                logger.warning(
                    "reconcile failed; the next runs in %s s", _RECONCILE_PERIOD_S, exc_info=True
                )

    def reconcile(self) -> dict[str, list[str]]:
        """Place NodeStores on new nodes (shard 0 only); forget the chunks of nodes that
        left (every shard).

        A NodeStore this shard does not know (this shard restarted and lost its index,
        or the NodeStore is still starting) is asked to register with this shard and
        offer it its share of the inventory again (``reregister(shard)``): one-way, and
        idempotent, as everything sent to a NodeStore.
        """
        # The index is millions of small long-lived objects without reference cycles
        # (units name each other by id): keep the cyclic GC from re-scanning them.
        # Measured 1.2-1.45x more admits/s at 1e5 chunks. Refcounting still frees them.
        gc.freeze()
        alive = alive_node_ids()
        known = set(self._index.nodes())
        started = []
        for node_id in alive:
            try:
                store = ray.get_actor(node_store_name(node_id), namespace=self._namespace)
            except ValueError:
                if self._shard == 0:  # one placer: the shards would race to place it
                    place_node_store(self._cfg, node_id)  # registers itself when it is up
                    started.append(node_id)
                continue
            if node_id not in known:
                NodeStoreClient(store, node_id).reregister(self._shard)  # one-way
        gone: list[str] = sorted(known - alive)
        for node_id in gone:
            logger.warning("node %s left the cluster; forgetting its chunks", node_id)
            self.forget_node(node_id)
        self._reconciles += 1
        return {"started": started, "forgotten": gone}

    def register_node(
        self, node_id: str, cpu_bytes: int, disk_bytes: int = 0, store_id: str | None = None
    ) -> None:
        """``store_id``: the registering NodeStore's actor id. If another NodeStore held
        the node before (it died and the reconcile placed a new one), what it held in
        memory died with it: forget it now, so no lookup promises it; the new one offers
        its disk copies next."""
        node = NodeId(node_id)
        self._stores.pop(node, None)  # a NodeStore (re)registering: look its handle up anew
        if store_id is not None:
            previous = self._store_ids.get(node)
            if previous not in (None, store_id) and node in self._index.nodes():
                logger.warning("NodeStore on node %s restarted; forgetting what it held", node)
                self.forget_node(node_id)
            self._store_ids[node] = store_id
        self._index.register_node(node, cpu_bytes, disk_bytes)

    def admit(self, node_id: str, offers: OfferColumns) -> tuple[list[bool], NodeActions]:
        """A NodeStore's offers, as columns (:class:`~tierstore.wire.OfferColumns`): one
        admission decision each. A malformed offer is refused (counted), never indexed;
        the rest go on. A malformed message raises MalformedField, nothing indexed."""
        checked = self._checked(offers_of(offers))
        shard_offers = [o for o in checked if o is not None]
        before = self._evictions()
        result = self._index.admit(NodeId(node_id), shard_offers, time.monotonic())
        self._pressed(NodeId(node_id), before)
        admitted = [o for o, ok in zip(shard_offers, result.accepted, strict=True) if ok]
        self._events.record_offers(NodeId(node_id), TierName.CPU, admitted)
        own = self._send(result.actions, caller=NodeId(node_id))
        return _spread(checked, result.accepted), own

    def admit_units(
        self, node_id: str, units: OfferColumns
    ) -> tuple[list[list[bool]], NodeActions]:
        """A NodeStore's batch, one offer per token boundary (every rank's and group's
        shards it holds), as columns with the units' sizes: one admission decision each.
        A malformed unit is refused whole (counted), never indexed; the rest go on. A
        malformed message raises MalformedField, nothing indexed."""
        checked = self._checked(unit_offers_of(units))
        good = [u for u in checked if u is not None]
        before = self._evictions()
        result = self._index.admit_units(NodeId(node_id), good, time.monotonic())
        self._pressed(NodeId(node_id), before)
        shards = list(chain.from_iterable(map(itemgetter(0), good)))  # each unit's, in order
        flags = list(chain.from_iterable(result.accepted))
        if len(result.accepted) != len(good) or len(flags) != len(shards):  # as zip(strict)
            raise ValueError("the index answered other units or shards than it was offered")
        self._events.record_offers(NodeId(node_id), TierName.CPU, compress(shards, flags))
        own = self._send(result.actions, caller=NodeId(node_id))
        if len(good) == len(checked):
            return result.accepted, own
        answers = iter(result.accepted)  # a refused unit's answer: no flag (none kept)
        return [next(answers) if u is not None else [] for u in checked], own

    def restore(
        self, node_id: str, held: list[tuple[ShardOffer, TierName]], grace: bool = False
    ) -> tuple[list[bool], NodeActions]:
        """A malformed copy is refused (counted), never indexed, and dropped where it
        names a shard: the node's tier would hold bytes the index does not count."""
        node = NodeId(node_id)
        checked = self._checked(held_of(held))
        shards = [h for h in checked if h is not None]
        accepted, actions = self._index.restore(
            node,
            shards,
            now=time.monotonic(),
            grace_s=self._cfg.lease_ttl_s if grace else 0.0,
        )
        kept = [(_shard_of(o), t) for (o, t), ok in zip(shards, accepted, strict=True) if ok]
        self._events.record_held(node, False, kept)
        own = self._send(actions, caller=node)
        indexed = {shard_id for shard_id, _ in kept}
        refused = (held_shard(h) for h, c in zip(held, checked, strict=True) if c is None)
        own.drop += [s for s in refused if s is not None and s not in indexed]
        return _spread(checked, accepted), own

    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        lease_ttl_s: float,
        node_id: str | None = None,
    ) -> AnswerColumns:
        """``node_id``: the asking engine's node, so a replica there is named first.
        Answered as columns (:func:`~tierstore.wire.answer_columns`), one per key."""
        self._asked += 1
        answers, actions = self._index.lookup(
            namespace,
            keys,
            holder,
            time.monotonic(),
            lease_ttl_s,
            NodeId(node_id) if node_id else None,
        )
        self._send(actions)
        if node_id and self._cfg.pulls_per_node:
            self._start_pulls(namespace, keys, answers, NodeId(node_id))
        return answer_columns(answers)

    def _start_pulls(
        self, namespace: Namespace, keys: list[ChunkKey], answers: list[LookupAnswer], node: NodeId
    ) -> None:
        """Issue 30: chunks a lookup from ``node`` answered HIT for, held only elsewhere,
        get a hot-chunk copy on ``node`` now (the replica rules: ``start_copies``), which
        ``node``'s NodeStore pulls itself, one pull per holder (one-way: this call never
        waits on a NodeStore), while the request is still being scheduled."""
        remote = [
            key
            for key, (state, where, _) in zip(keys, answers, strict=True)
            if LookupState(state) is LookupState.HIT
            and where
            and all(holder != node for holder in where.values())
        ]
        if not remote:
            return
        pulls = [
            (shard_id, holder)
            for holder, actions in self._index.start_copies(namespace, remote, node).items()
            for shard_id, _ in actions.push
        ]
        if not pulls:
            return
        store = self._node_store(node)
        try:
            if store is None:
                raise ValueError("no NodeStore is named for it")
            store.pull(pulls)  # one-way
        except Exception as exc:  # no NodeStore there (yet), or Ray refused: room back
            logger.warning("node %s's copies are not pulled: %s", node, exc)
            self._send(self._index.replicated(node, [], [s for s, _ in pulls]))

    def promoted(
        self, node_id: str, done: list[ShardId], failed: list[ShardId], refused: list[ShardId]
    ) -> None:
        done, failed, refused = (self._checked_ids(ids) for ids in (done, failed, refused))
        self._events.record(NodeId(node_id), TierName.CPU, False, done)
        self._send(self._index.promoted(NodeId(node_id), done, failed, refused))

    def forget_shards(self, node_id: str, shard_ids: list[ShardId]) -> None:
        ids = self._checked_ids(shard_ids)
        self._record_removed(NodeId(node_id), ids)
        self._send(self._index.forget_shards(ids))

    def report_corrupt_after_hit(self, node_id: str, shard_ids: list[ShardId]) -> None:
        self._send(self._index.report_corrupt_after_hit(self._checked_ids(shard_ids)))

    def report_disk_writes(
        self, node_id: str, unwritten: list[ShardId], failures: int, writable: bool
    ) -> None:
        """A NodeStore's failed or skipped disk writes, and whether its disk takes writes
        (see ChunkIndex.disk_writes): the memory copies of ``unwritten`` stay. A report
        whose count or flag is malformed is refused whole (counted)."""
        try:
            failed = integer("failures", failures, 0, 1 << 32)
            if not isinstance(writable, bool):
                raise MalformedField("writable", writable, "not a bool")
        except MalformedField as exc:
            logger.warning("refused a disk write report from node %s: %s", node_id, exc)
            self._index.stats.malformed_items += 1
            return
        node = NodeId(node_id)
        ids = self._checked_ids(unwritten)
        self._events.record(
            node, TierName.DISK, True, self._index.disk_writes(node, ids, failed, writable)
        )

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, ttl_s: float
    ) -> None:
        self._index.extend_leases(namespace, keys, holder, time.monotonic(), ttl_s)

    def release(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        loaded: int = 0,
        node_id: str | None = None,
    ) -> None:
        """``loaded``: the keys were loaded (into an engine on ``node_id``), not given up."""
        self._index.release(namespace, keys, holder)
        self._index.record_loaded(loaded)
        if loaded and node_id:
            self._send(self._index.record_loads(namespace, keys, NodeId(node_id)))

    def locate(
        self, namespace: Namespace, keys: list[ChunkKey], rank: int, avoid_node: str
    ) -> list[NodeId | None]:
        """Where else a worker can load from, after a load from ``avoid_node`` failed."""
        return self._index.locate(namespace, keys, rank, NodeId(avoid_node))

    def holders(
        self, namespace: Namespace, keys: list[ChunkKey], world_size: int = 1
    ) -> list[list[str]]:
        """Read-only, for a request router: per key, the nodes whose own tiers hold every
        rank (``0..world_size-1``) of its chunk. No lease, no pull, no recency touch, not
        counted as asked: it changes nothing an engine's lookup would see.

        Built from :meth:`locate`'s index query, so it sees per rank the chunk's holder
        (not while it is being promoted from disk) and one complete copy on another node
        (a hot-chunk copy); a third copy is not named. At most ``MAX_ENTRIES`` keys."""
        world = integer("world_size", world_size, 1, 1 << 16)
        if len(keys) > MAX_ENTRIES:
            raise MalformedField("keys", len(keys), f"more than {MAX_ENTRIES}")
        keys = list(keys)
        nowhere = NodeId("")  # no node has this id: locate avoids none
        held: list[set[NodeId]] | None = None
        for rank in range(world):
            first = self._index.locate(namespace, keys, rank, nowhere)
            on_rank: list[set[NodeId]] = [set() if n is None else {n} for n in first]
            for node in {n for n in first if n is not None}:
                picked = [i for i, n in enumerate(first) if n == node]
                other = self._index.locate(namespace, [keys[i] for i in picked], rank, node)
                for i, n in zip(picked, other, strict=True):
                    if n is not None:
                        on_rank[i].add(n)
            held = on_rank if held is None else [a & b for a, b in zip(held, on_rank, strict=True)]
        return [sorted(nodes) for nodes in held or []]

    def replicated(self, node_id: str, done: list[ShardId], failed: list[ShardId]) -> None:
        """A NodeStore received replica shards (``done``) or could not (``failed``)."""
        node = NodeId(node_id)
        done, failed = self._checked_ids(done), self._checked_ids(failed)
        self._events.record(node, TierName.CPU, False, done)
        self._send(self._index.replicated(node, done, failed))

    def report_failed_stores(self, n_jobs: int) -> None:
        """A worker lost store jobs (vLLM has no failure path, so only this counts them)."""
        self._index.record_failed_stores(n_jobs)

    def release_holder(self, holder: str) -> None:
        self._index.release_holder(holder)

    def node_load(self, node_id: str) -> tuple[int, int, int, int, int, int] | None:
        """This shard's part of ``node_id``'s tiers, for the NodeStore that rebalances the
        shards' shares (:class:`~tierstore.store.evictor_shards.ShareBalancer`): CPU
        capacity and used bytes, disk capacity and used bytes, the node's pressure (shards
        its stores had evicted, demoted or refused here) and this shard's calls (lookups
        and admits of every node), both counted since this shard started. None: the
        node is not registered here."""
        tiers = self._index.node(NodeId(node_id))
        if tiers is None:
            return None
        cpu_used, cpu_cap, _ = tiers[TierName.CPU]
        disk_used, disk_cap, _ = tiers[TierName.DISK]
        pressure = self._pressure.get(NodeId(node_id), 0)
        return cpu_cap, cpu_used, disk_cap, disk_used, pressure, self._asked

    def resize_node(
        self, node_id: str, cpu_bytes: int, disk_bytes: int
    ) -> tuple[tuple[int, int, int, int, int, int] | None, NodeActions]:
        """The node's NodeStore moved this shard's share of its tiers to ``cpu_bytes`` and
        ``disk_bytes``: room is made down to them as a store makes it (demoting before
        dropping; leased chunks stay). Returns :meth:`node_load` after, and the node's
        own actions (to apply before it grants another shard the freed bytes); other
        nodes' are sent to them. Raises UnknownNodeError for a node not registered."""
        cpu = integer("cpu_bytes", cpu_bytes, 0, 1 << 62)
        disk = integer("disk_bytes", disk_bytes, 0, 1 << 62)
        node = NodeId(node_id)
        actions = self._index.resize_node(node, cpu, disk, time.monotonic())
        own = self._send(actions, caller=node)
        return self.node_load(node_id), own

    def forget_node(self, node_id: str) -> None:
        self._store_ids.pop(NodeId(node_id), None)
        self._stores.pop(NodeId(node_id), None)
        self._pressure.pop(NodeId(node_id), None)
        self._events.record_held(NodeId(node_id), True, self._index.shards_on(NodeId(node_id)))
        self._send(self._index.forget_node(NodeId(node_id)))

    def events_since(self, after: int, namespace: Namespace) -> EventBatch:
        """Residency changes of ``namespace`` (KV-cache events), oldest first."""
        return self._events.since(after, namespace)

    def presence(self, namespace: Namespace) -> EventBatch:
        """Every copy of ``namespace``'s chunks held now, as events, and the log position
        that follows them: where a reader's picture of the cluster starts."""
        held = {node: self._index.shards_on(node) for node in self._index.nodes()}
        return self._events.snapshot(namespace, held)

    def index_view(self, node_id: str) -> set[tuple[ShardId, TierName]]:
        """What the index believes ``node_id`` holds (tests compare it with the node)."""
        return self._index.shards_on(NodeId(node_id))

    def config(self) -> dict[str, object]:
        """The config this Evictor was started with (a later engine compares its own)."""
        return self._cfg.to_dict()

    def status(self) -> dict[str, object]:
        """This shard's view: per node and tier its share's used and capacity bytes and
        chunks, its chunk count and counters."""
        return {
            "shard": self._shard,
            "shards": self._cfg.shard_count,
            "nodes": {
                node: {
                    tier.value: {"used_bytes": u, "capacity_bytes": c, "chunks": n}
                    for tier, (u, c, n) in tiers.items()
                }
                for node, tiers in self._index.nodes().items()
            },
            "chunks": len(self._index),
            # The compact index's arrays and pools (None: ChunkIndex, Python objects).
            "index_bytes": getattr(self._index, "memory_bytes", lambda: None)(),
            "totals": dict(vars(self._index.stats)),
            "reconciles": {"done": self._reconciles, "failed": self._reconcile_failures},
        }

    def _evictions(self) -> int:
        stats = self._index.stats
        return stats.evicted_chunks + stats.demoted_shards + stats.skipped_stores

    def _pressed(self, node: NodeId, before: int) -> None:
        """Count the evictions, demotions and refusals of a store of ``node`` since
        ``before`` (:meth:`_evictions`) as its pressure on this shard."""
        self._asked += 1
        made = self._evictions() - before
        if made:
            self._pressure[node] = self._pressure.get(node, 0) + made

    def _checked(self, items: list[T | None]) -> list[T | None]:
        """Items of a NodeStore's message as :mod:`tierstore.wire` checked them
        (None: malformed, refused and logged there), the refused counted."""
        self._index.stats.malformed_items += items.count(None)
        return items

    def _checked_ids(self, values: list[ShardId]) -> list[ShardId]:
        """ShardIds a NodeStore reports, checked: a malformed one is refused (counted)."""
        return [s for s in self._checked(checked_shard_ids(values)) if s is not None]

    def _send(self, actions: Actions, caller: NodeId | None = None) -> NodeActions:
        """Send each node its actions, one-way; return (not send) those of ``caller``
        (the NodeStore whose call this answers gets its own share in the reply)."""
        own = NodeActions()
        for node, node_actions in actions.items():
            self._record_actions(node, node_actions)
            if node == caller:
                own = node_actions
                continue
            if not node_actions:
                continue
            store = self._node_store(node)
            if store is None:
                logger.warning("no NodeStore for node %s; its actions are lost", node)
                continue
            store.apply(node_actions)  # one-way
        return own

    def _node_store(self, node: NodeId) -> NodeStoreClient | None:
        """``node``'s NodeStore, or None when none is named: the handle is looked up in
        Ray's GCS once per registration (a round trip per call otherwise; a lookup that
        starts pulls and every action sent used to pay it). A NodeStore that restarts
        registers again, which drops the old handle."""
        store = self._stores.get(node)
        if store is None:
            try:
                handle = ray.get_actor(node_store_name(node), namespace=self._namespace)
            except ValueError:
                return None
            store = self._stores[node] = NodeStoreClient(handle, node)
        return store

    def _record_actions(self, node: NodeId, actions: NodeActions) -> None:
        """Promotions are recorded when done (``promoted``): they may fail."""
        self._record_removed(node, actions.drop)
        self._events.record(node, TierName.CPU, True, actions.demote)
        self._events.record(node, TierName.DISK, False, actions.demote + actions.persist)

    def _record_removed(self, node: NodeId, shard_ids: list[ShardId]) -> None:
        for tier in TierName:  # a consumer ignores the removal of a copy it never saw
            self._events.record(node, tier, True, shard_ids)


def _spread(checked: list[T | None], answers: list[bool]) -> list[bool]:
    """One answer per item of a message: ``answers`` for its well-formed ones, in order,
    False for each refused (None) one."""
    given = iter(answers)
    return [item is not None and next(given) for item in checked]


def _shard_of(offer: ShardOffer) -> ShardId:
    return ShardId(offer.namespace, offer.key, offer.rank)
