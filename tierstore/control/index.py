"""The cluster-wide chunk index: where each shard lives, capacity per node and tier,
leases, and the prefix-aware eviction across tiers.

This is all of the Evictor's logic as a plain class, so it is tested without Ray.

Vocabulary:
- a *shard* is one rank's bytes of one chunk, held by one node: in its CPU tier, its
  disk tier, or both. The disk tier is written through (each new shard is copied to
  disk after it is acknowledged, when there is room), so a restart loses nothing that
  reached disk, and demoting a shard that is already on disk only frees its memory;
- a *chunk* ``(namespace, key)`` is loadable when every rank's shard is held. A lookup
  of one with disk-only shards promotes them to CPU where there is room and is a HIT at
  once, its load reading whichever copy it finds (see :meth:`ChunkIndex.lookup`);
- a *unit* is every group's chunk at one token boundary (the key minus its group
  suffix). Units are what the policy orders and what is evicted: a hybrid model's
  boundary is only usable with every group present. They are also what a NodeStore
  offers (:meth:`ChunkIndex.admit_units`): every rank's and group's shard of a boundary
  its batch holds, one admission decision, so the work per prompt is O(chunks).
- a unit's *parents* are the units of the previous chunk of each of its chains. A unit
  is dropped only when no resident unit names it as parent (tail first), and demoted
  from CPU only when no child still has a CPU shard.
- a *replica* is a second copy of a whole chunk (every rank) in the CPU tier of a node
  that kept loading it from elsewhere. It is a cache: outside the tree rules, the first
  thing evicted on its node, dropped with its chunk, and made the chunk's own copy when
  the original holder is lost.

Decisions are returned as :class:`NodeActions` for the NodeStores to carry out, in the
order drop, demote, promote, persist, push, so a promotion always finds the room made
for it.

Layout: :class:`ChunkIndex` is the one entry point; this module keeps its public calls
(nodes, stores, lookups and promotions, introspection) and re-exports the data model, so
the rest of the code imports everything from here. The internals are split by concern,
one mixin per module over the shared state of :mod:`~tierstore.control.index_state`:

- :mod:`~tierstore.control.index_model`: offers, answers, actions, stats, records;
- :mod:`~tierstore.control.index_tree`: the unit tree and its copy counters;
- :mod:`~tierstore.control.index_candidates`: the candidate heaps and the eviction walk;
- :mod:`~tierstore.control.index_leases`: leases and parking;
- :mod:`~tierstore.control.index_room`: making room (demote, drop, watermarks);
- :mod:`~tierstore.control.index_replicas`: replicas of hot chunks.

Mixins rather than composed helper objects: every change keeps invariants that span the
parts (byte accounts, CPU counters, heap entries, parked units) in one step, so a helper
object would need most of the others' state anyway. One ``self`` keeps that state in one
place, each file holds one concern, and a subclass can still replace one step (the
reference test overrides ``_next_candidate``).
"""

from __future__ import annotations

from collections import defaultdict

from tierstore.control.index_candidates import CandidatesMixin
from tierstore.control.index_leases import LeasesMixin
from tierstore.control.index_model import (
    Actions,
    AdmitResult,
    Chunk,
    ChunkId,
    IndexStats,
    LookupAnswer,
    LookupState,
    NodeActions,
    Shard,
    ShardOffer,
    TierAccount,
    UnitAdmitResult,
    UnitId,
    UnitOffer,
    Watermarks,
    count_hit_places,
    valid_offer,
)
from tierstore.control.index_replicas import ReplicasMixin
from tierstore.control.index_room import RoomMixin
from tierstore.control.index_tree import TreeMixin
from tierstore.errors import UnknownNodeError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName, boundary_of

__all__ = [
    "Actions",
    "AdmitResult",
    "ChunkId",
    "ChunkIndex",
    "IndexStats",
    "LookupAnswer",
    "LookupState",
    "NodeActions",
    "ShardOffer",
    "UnitAdmitResult",
    "UnitId",
    "UnitOffer",
    "Watermarks",
]

_RESTORE_GRACE_HOLDER = "tierstore/restore-grace"


class ChunkIndex(ReplicasMixin, RoomMixin, LeasesMixin, CandidatesMixin, TreeMixin):
    """Single-threaded: the Evictor actor serialises every call. Built as
    ``ChunkIndex(policy, watermarks, replicate_after_loads)``; the constructor and the
    state every part shares are in :class:`~tierstore.control.index_state.IndexState`.

    Finding what to evict never walks every unit. Each (node, tier, policy segment) has
    a heap of candidates keyed by the policy's rank (``CandidateQueue``); each unit counts
    its CPU copies and its children with CPU copies, so whether it may be demoted or
    dropped is known without looking at its subtree. Leased or promoting units met on
    the way are parked until their lease ends or their promotion is reported, so a
    store that finds only protected units left is skipped without rescanning them.
    """

    # ---- nodes -------------------------------------------------------------------------
    def register_node(self, node: NodeId, cpu_bytes: int, disk_bytes: int = 0) -> None:
        """A NodeStore (re)started: its capacities, its disk taken as writable (the node
        says otherwise through :meth:`disk_writes`)."""
        tiers = self._nodes.setdefault(
            node, {TierName.CPU: TierAccount(cpu_bytes), TierName.DISK: TierAccount(disk_bytes)}
        )
        tiers[TierName.CPU].capacity_bytes = cpu_bytes
        tiers[TierName.DISK].capacity_bytes = disk_bytes
        tiers[TierName.DISK].parked_capacity = None

    def resize_node(self, node: NodeId, cpu_bytes: int, disk_bytes: int, now: float) -> Actions:
        """A node's capacities changed while it holds chunks (its Evictor shard's share
        was rebalanced): room is made down to the new ones as a store makes it (CPU: the
        node's replicas, then demotions to disk, then tails dropped; disk: disk-only
        tails dropped), leased, pinned and promoting units kept (the node's used bytes
        may stay above a capacity until they are free). A disk capacity parked at 0
        (:meth:`disk_writes`) stays parked, the new one kept for when it is writable.
        Raises UnknownNodeError for a node not registered."""
        tiers = self._nodes.get(node)
        if tiers is None:
            raise UnknownNodeError(f"node {node!r} is not registered with the Evictor")
        tiers[TierName.CPU].capacity_bytes = cpu_bytes
        disk = tiers[TierName.DISK]
        if disk.parked_capacity is not None:
            disk.parked_capacity = disk_bytes
        else:
            disk.capacity_bytes = disk_bytes
        actions: Actions = defaultdict(NodeActions)
        self._make_cpu_room(node, 0, set(), now, actions)
        self._make_disk_room(node, 0, set(), now, actions)
        return dict(actions)

    def disk_writes(
        self, node: NodeId, unwritten: list[ShardId], failures: int, writable: bool
    ) -> list[ShardId]:
        """A node's disk writes went wrong: ``failures`` writes failed, and ``unwritten``
        shards, which :meth:`admit` counted on disk, have none there (their write-through
        failed, or was skipped): they lose the disk copy here and keep their memory copy.

        While its disk is not ``writable`` (degraded after a failed write, until a retry
        is due), the node's disk capacity counts as 0: room is made by dropping rather
        than demoting, and nothing is written through, as on a node without a disk tier.
        The disk copies it holds stay indexed and readable. Returns the shards whose
        disk copy the index forgot."""
        self.stats.disk_write_failures += failures
        tiers = self._nodes.get(node)
        if tiers is None:
            return []  # the node left meanwhile
        account = tiers[TierName.DISK]
        if not writable and account.parked_capacity is None:
            account.parked_capacity, account.capacity_bytes = account.capacity_bytes, 0
        elif writable and account.parked_capacity is not None:
            account.capacity_bytes, account.parked_capacity = account.parked_capacity, None
        forgotten = []
        for shard_id in unwritten:
            shard = self._shard(shard_id.namespace, shard_id.key, shard_id.rank)
            # Only a memory copy's disk twin: a shard demoted since (no memory copy in
            # the index) was written by its demotion, or dropped and forgotten with it.
            if shard is not None and shard.node == node and shard.cpu and shard.disk:
                uid = UnitId(shard_id.namespace, boundary_of(shard_id.key))
                self._lose(uid, self._units[uid], shard, TierName.DISK)
                forgotten.append(shard_id)
        return forgotten

    def restore(
        self,
        node: NodeId,
        held: list[tuple[ShardOffer, TierName]],
        now: float = 0.0,
        grace_s: float = 0.0,
    ) -> tuple[list[bool], Actions]:
        """Re-index copies a node already holds (start-up, or after an Evictor restart).

        Disk copies are taken first, and marked unverified: each is promoted (read and
        checked) before it is a HIT, so a file damaged while the node was down is a miss,
        not a failed load. A copy that no longer fits (capacities shrank) or a
        shard already indexed on another node is refused: the node frees the memory copy
        of a shard whose disk copy was kept, and drops the rest. Restored chunks are
        leased for ``grace_s``: the leases of HITs granted before a restart were lost
        with the old index, and those loads must still find their chunks.
        """
        order = sorted(range(len(held)), key=lambda i: held[i][1] != TierName.DISK)
        accepted = [False] * len(held)
        actions: Actions = defaultdict(NodeActions)
        for i in order:
            offer, tier = held[i]
            shard_id = ShardId(offer.namespace, offer.key, offer.rank)
            account = self._nodes[node][tier]
            shard = self._shard(offer.namespace, offer.key, offer.rank)
            fits = account.used_bytes + offer.nbytes <= account.capacity_bytes
            if not valid_offer(offer):
                actions[node].drop.append(shard_id)
            elif shard is not None and shard.node == node and shard.has(tier):
                accepted[i] = True  # already indexed: offering it again changes nothing
            elif shard is not None and shard.node == node and fits:
                uid = UnitId(offer.namespace, boundary_of(offer.key))
                self._gain(uid, self._units[uid], shard, tier)
                shard.disk_unverified |= tier is TierName.DISK
                accepted[i] = True
            elif shard is None and fits:
                _, shard = self._add_shard(node, offer, tier)
                shard.disk_unverified |= tier is TierName.DISK
                accepted[i] = True
                if grace_s > 0:
                    cid = ChunkId(offer.namespace, offer.key)
                    self._lease(cid, _RESTORE_GRACE_HOLDER, now + grace_s)
            elif shard is not None and shard.node == node and shard.disk:
                actions[node].demote.append(shard_id)  # keep the disk copy, free memory
            elif shard is not None and shard.node == node:
                # A disk copy that no longer fits beside an indexed memory copy: rare
                # enough to forget the chunk rather than track half of it.
                self._drop_unit(UnitId(offer.namespace, boundary_of(offer.key)), actions)
            else:
                actions[node].drop.append(shard_id)
        return accepted, dict(actions)

    def forget_node(self, node: NodeId) -> Actions:
        """A node left: its replicas go; a chunk it held lives on in a replica elsewhere,
        or is incomplete now, and its unit is dropped everywhere."""
        actions: Actions = defaultdict(NodeActions)
        for queue_key in [k for k in self._queues if k[0] == node]:
            del self._queues[queue_key]
        for cid in self._replicas_on.pop(node, {}):
            chunk = self._chunks.get(cid)
            if chunk is not None and chunk.replicas is not None:
                chunk.replicas.pop(node, None)
                chunk.replicas = chunk.replicas or None
        held = self._node_units.pop(node, set())
        # Units about to go need not be queued as their children leave first. Rescued in
        # UnitId order, not the set's (which varies with PYTHONHASHSEED): a rescue writes
        # through to its target's disk while there is room, so the order decides which.
        self._dying = {uid for uid in sorted(held) if not self._rescue(uid, node, actions)}
        try:
            for uid in self._dying:
                if uid in self._units:
                    self._drop_unit(uid, actions)
        finally:
            self._dying = set()
        self._nodes.pop(node, None)
        actions.pop(node, None)
        return dict(actions)

    def nodes(self) -> dict[NodeId, dict[TierName, tuple[int, int, int]]]:
        """node -> tier -> (used bytes, capacity bytes, shards)."""
        return {
            n: {t: (a.used_bytes, a.capacity_bytes, a.shards) for t, a in tiers.items()}
            for n, tiers in self._nodes.items()
        }

    def node(self, node: NodeId) -> dict[TierName, tuple[int, int, int]] | None:
        """One node's entry of :meth:`nodes` (None: not registered), without the others."""
        tiers = self._nodes.get(node)
        if tiers is None:
            return None
        return {t: (a.used_bytes, a.capacity_bytes, a.shards) for t, a in tiers.items()}

    # ---- stores ------------------------------------------------------------------------
    def admit(self, node: NodeId, offers: list[ShardOffer], now: float) -> AdmitResult:
        """Decide which offered shards ``node`` keeps in its CPU tier, one shard at a time
        (:meth:`admit_units` decides a token boundary's shards at once).

        Room is made by demoting to disk, then by dropping whole units, tail first, then
        by demoting this batch's own units (never dropping them). A shard is refused (a
        skipped store, never an error) when it is already held or when only leased,
        pinned or promoting units are left (or, without a disk tier, this batch's own).
        Each admitted shard is also written through to disk when the disk has room.
        """
        protected = self._admitting(node, offers)
        actions: Actions = defaultdict(NodeActions)
        accepted = [self._admit_unit(node, [o], protected, now, actions)[0] for o in offers]
        self._demote_to_watermark(node, protected, now, actions)
        return AdmitResult(accepted, dict(actions))

    def admit_units(self, node: NodeId, units: list[UnitOffer], now: float) -> UnitAdmitResult:
        """As :meth:`admit`, with one decision per unit offer (a token boundary's shards:
        every rank's and group's the node's batch holds): room is made once for all of
        its new shards, and they are all kept or all refused. A shard already held is
        refused alone (a rank offered again); the unit's other ranks may come in a later
        offer, and its chunks are HITs once every rank is held."""
        protected = self._admitting(node, [o for unit in units for o in unit.shards])
        actions: Actions = defaultdict(NodeActions)
        accepted = [self._admit_unit(node, unit.shards, protected, now, actions) for unit in units]
        self._demote_to_watermark(node, protected, now, actions)
        return UnitAdmitResult(accepted, dict(actions))

    def _admitting(self, node: NodeId, offers: list[ShardOffer]) -> set[UnitId]:
        """Start an admission: the units no room may be made from (the offered chunks'
        own, and their parents': evicting those would leave the new chunks unreachable
        the moment they land). Raises UnknownNodeError for a node not registered."""
        if node not in self._nodes:
            raise UnknownNodeError(f"node {node!r} is not registered with the Evictor")
        self.stats.admit_calls += 1
        return {UnitId(o.namespace, boundary_of(o.key)) for o in offers} | {
            UnitId(o.namespace, boundary_of(o.parent)) for o in offers if o.parent is not None
        }

    def _admit_unit(
        self,
        node: NodeId,
        shards: list[ShardOffer],
        protected: set[UnitId],
        now: float,
        actions: Actions,
    ) -> list[bool]:
        """One admission decision for ``shards`` (of one unit): which of them ``node``
        keeps. Room is made for the new ones together, CPU then disk (write-through)."""
        self.stats.admitted_units += 1
        new = self._new_shards(shards)
        if not any(new):
            return new
        nbytes = sum(o.nbytes for o, ok in zip(shards, new, strict=True) if ok)
        own = UnitId(shards[0].namespace, boundary_of(shards[0].key))
        if not self._make_cpu_room(
            node, nbytes, protected, now, actions
        ) and not self._demote_for_store(node, nbytes, own, protected, now, actions):
            self.stats.skipped_stores += sum(new)
            return [False] * len(shards)
        added = [
            (o, self._add_shard(node, o, TierName.CPU, queue=False)[1])
            for o, ok in zip(shards, new, strict=True)
            if ok
        ]
        self._push(own, node, TierName.CPU)  # once for the unit, not per shard
        if self._make_disk_room(node, nbytes, protected, now, actions):
            unit = self._units[own]
            for offer, shard in added:
                self._gain(own, unit, shard, TierName.DISK, queue=False)
                actions[node].persist.append(ShardId(offer.namespace, offer.key, offer.rank))
            self._push(own, node, TierName.DISK)
        return new

    def _new_shards(self, shards: list[ShardOffer]) -> list[bool]:
        """Which offers name a valid shard not held yet (nor earlier in ``shards``)."""
        seen: set[tuple[ChunkKey, int]] = set()
        new = []
        for o in shards:
            fresh = (o.key, o.rank) not in seen and valid_offer(o)
            new.append(fresh and self._shard(o.namespace, o.key, o.rank) is None)
            seen.add((o.key, o.rank))
        return new

    # ---- lookups and promotion ---------------------------------------------------------
    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        now: float,
        lease_ttl_s: float,
        node: NodeId | None = None,
    ) -> tuple[list[LookupAnswer], Actions]:
        """Answer each key. A HIT and a PENDING are leased to ``holder``, so they stay until
        loaded; a HIT names the asking engine's ``node`` when a replica there holds the
        whole chunk.

        A chunk with shards on disk is promoted to memory where its node's CPU tier can
        make room, and is a HIT at once (``tier`` DISK): the NodeStore's load verifies and
        reads a disk copy as readily as a memory one, whichever it finds first, and the
        lease keeps the disk copy (a leased unit is never demoted or dropped for room).
        Waiting for the promotion cost a disk hit two more Evictor round trips and a
        scheduler step (22-25 ms against 9-10 ms for a memory hit, e2e tiny). Only a disk
        copy found at start-up and never read since is PENDING until its promotion has
        verified it. Without room (typically a prompt larger than the CPU tier, whose own
        chunks, all asked in this batch, hold the room) even that one is a HIT read from
        disk: answering MISS would recompute a prompt whose every chunk is stored, and a
        PENDING without room would never resolve and cost the request its whole
        ``lookup_timeout_ms``.
        """
        answers: list[LookupAnswer] = []
        actions: Actions = defaultdict(NodeActions)
        protected = {UnitId(namespace, boundary_of(k)) for k in keys}
        for key in keys:
            cid = ChunkId(namespace, key)
            chunk = self._chunks.get(cid)
            if chunk is None or not chunk.complete:
                self.stats.misses += 1
                answers.append(LookupAnswer(LookupState.MISS))
                continue
            uid = UnitId(namespace, boundary_of(key))
            self._lease(cid, holder, now + lease_ttl_s)
            self._touch(uid)
            answers.append(self._answer(uid, chunk, node, protected, now, actions))
        count_hit_places(self.stats, answers, node)
        return answers, dict(actions)

    def _answer(
        self,
        uid: UnitId,
        chunk: Chunk,
        node: NodeId | None,
        protected: set[UnitId],
        now: float,
        actions: Actions,
    ) -> LookupAnswer:
        """A complete, leased chunk: HIT from a replica, from CPU or disk, or PENDING."""
        if node is not None and chunk.replica_ready(node):
            self._replicas_on[node].move_to_end(ChunkId(uid.namespace, chunk.key))
            self.stats.hits += 1
            return LookupAnswer(LookupState.HIT, dict.fromkeys(range(chunk.world_size), node))
        on_disk = [(r, s) for r, s in chunk.held() if not s.cpu]
        if on_disk:
            self._promote(uid, chunk, on_disk, protected, now, actions)
        if any(s.promoting and s.disk_unverified for _, s in chunk.held()):
            return LookupAnswer(LookupState.PENDING)
        self.stats.hits += 1
        from_disk = any(s.promoting or not s.cpu for _, s in chunk.held())
        if from_disk:
            self.stats.disk_hits += 1
        where = {r: s.node for r, s in chunk.held()}
        return LookupAnswer(LookupState.HIT, where, TierName.DISK if from_disk else TierName.CPU)

    def _promote(
        self,
        uid: UnitId,
        chunk: Chunk,
        on_disk: list[tuple[int, Shard]],
        protected: set[UnitId],
        now: float,
        actions: Actions,
    ) -> bool:
        for _, shard in on_disk:
            if not self._make_cpu_room(shard.node, shard.nbytes, protected, now, actions):
                return False
        unit = self._units[uid]
        for rank, shard in on_disk:
            shard.promoting = True
            self._gain(uid, unit, shard, TierName.CPU)  # the disk copy stays: demoting is free
            actions[shard.node].promote.append(ShardId(uid.namespace, chunk.key, rank))
        return True

    def promoted(
        self, node: NodeId, done: list[ShardId], failed: list[ShardId], refused: list[ShardId]
    ) -> Actions:
        """A node reports its promotions. A failed one (corrupt, missing) drops the unit;
        one its CPU tier ``refused`` (no extent free: room the index does not see, such as
        extents granted to workers) keeps its disk copy and is read from disk meanwhile."""
        for shard_id in done:
            shard = self._shard(shard_id.namespace, shard_id.key, shard_id.rank)
            if shard is not None:
                shard.promoting = False
                shard.disk_unverified = False  # read and checked on its way to memory
                self.stats.promoted_shards += 1
                self._unpark(UnitId(shard_id.namespace, boundary_of(shard_id.key)))
        for shard_id in refused:
            shard = self._shard(shard_id.namespace, shard_id.key, shard_id.rank)
            if shard is None or not shard.promoting:
                continue
            uid = UnitId(shard_id.namespace, boundary_of(shard_id.key))
            shard.promoting = False
            self._lose(uid, self._units[uid], shard, TierName.CPU)
            self.stats.refused_promotions += 1
            self._unpark(uid)
        self.stats.corrupt_before_hit += len(failed)
        return self.forget_shards(failed)

    def report_corrupt_after_hit(self, shard_ids: list[ShardId]) -> Actions:
        self.stats.corrupt_after_hit += len(shard_ids)
        return self.forget_shards(shard_ids)

    def forget_shards(self, shard_ids: list[ShardId]) -> Actions:
        """Shards that turned out missing or bad: their units are gone everywhere."""
        actions: Actions = defaultdict(NodeActions)
        for shard_id in shard_ids:
            uid = UnitId(shard_id.namespace, boundary_of(shard_id.key))
            if uid in self._units:
                self._drop_unit(uid, actions)
        return dict(actions)

    # ---- introspection -----------------------------------------------------------------
    def record_loaded(self, n_chunks: int) -> None:
        self.stats.loaded_chunks += n_chunks

    def record_failed_stores(self, n_jobs: int) -> None:
        self.stats.failed_stores += n_jobs

    def shards_on(self, node: NodeId) -> set[tuple[ShardId, TierName]]:
        """Every copy the index believes ``node`` holds (replicas once complete)."""
        held = {
            (ShardId(uid.namespace, chunk.key, rank), tier)
            for uid in self._node_units.get(node, ())
            for chunk, rank, shard in self._units[uid].shards()
            if shard.node == node
            for tier in shard.tiers
        }
        for cid in self._replicas_on.get(node, ()):
            chunk = self._chunks[cid]
            if chunk.replica_ready(node):
                held |= {(ShardId(*cid, rank), TierName.CPU) for rank, _ in chunk.held()}
        return held

    def units(self) -> dict[UnitId, tuple[set[UnitId], set[UnitId]]]:
        """unit -> (parents, children), for tests and status."""
        return {uid: (set(u.parents), set(u.children or ())) for uid, u in self._units.items()}

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, cid: object) -> bool:
        return cid in self._chunks
