"""Scheduler side: answers vLLM's lookups from local state and talks to the Evictor off-thread.

Runtime rules (vLLM's OffloadingConnector calls every method on the scheduler thread):
- no method waits on Ray. A key not answered yet is ``RETRY``; the keys of a step are
  sent in one batch by :class:`EvictorChannel`'s thread, and the answer lands in
  per-request state, under :attr:`lock`.
- a key gets its answer within ``lookup_timeout_ms`` of its first ask, or counts as a
  MISS (``tierstore:lookup_timeouts``): a slow Evictor never holds a request up for
  longer. An answer that lands after that is dropped, and its leases given back.
- a ``HIT`` the Evictor answers is backed by a lease it granted this request, so the
  chunk stays loadable until ``prepare_load``, which extends the lease until
  ``complete_load``. A *view hit* (:meth:`TierStoreManager.answer_hits_from_picture`) is
  answered from the cluster view (:mod:`tierstore.vllm.cluster_view`: the scheduler's
  local copy of which chunks the cluster holds, polled from the Evictor; it also counts
  what this engine just stored) with no round trip. One in this node's memory is not
  asked at all: its load reads this node's arena and verifies what it reads, and a chunk
  gone meanwhile (a lost race, or a false positive of the view's compact key table)
  fails the load, and the request recomputes. Once loaded, such chunks are reported to
  the Evictor (a lookup, for their recency, and a release that counts them loaded) with
  the next step's batch, off the step that schedules the request's forward. One on
  another node is leased by a lookup sent in the same step, as its load waits on that
  node (with pulls at lookup, ``pulls_per_node``, the load joins or starts this node's
  pull of it, and the lookup's pull message joins that).
- ``lock`` is an ``RLock``: vLLM 0.33 holds it around its calls, 0.32 does not, and the
  methods also take it themselves, so both versions are safe.
- sharded Evictors (``evictor_shards``): each request's root (the root of its prefix
  tree, :func:`tierstore.keys.root_of` of its first chunk) is computed once, at its first
  key, and kept in its :class:`RequestState`; its lookups, lease extensions and releases
  go to that root's shard only (one call per request and step), and its transfer specs
  carry the root to the workers.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Collection, Iterable
from typing import Any, cast

from typing_extensions import override
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
)

from tierstore.config import TierStoreConfig
from tierstore.errors import TierStoreError
from tierstore.keys import ChunkKey, Namespace, NodeId, TierName, group_of, root_of
from tierstore.vllm import metrics
from tierstore.vllm.cluster_view import ClusterView
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.request_state import Answer, RequestState
from tierstore.vllm.residency import MEDIUMS, EventQueue, locality
from tierstore.vllm.stored_keys import StoredKeys
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec
from tierstore.wire import LookupAnswer, LookupState

logger = logging.getLogger(__name__)


_RESULTS = {
    LookupState.HIT: LookupResult.HIT,
    LookupState.MISS: LookupResult.MISS,
    LookupState.PENDING: LookupResult.RETRY,  # promotion from disk under way
}


class TierStoreManager(OffloadingManager):
    def __init__(
        self,
        cfg: TierStoreConfig,
        namespace: Namespace,
        channel: EvictorChannel,
        tokens_per_chunk: dict[int, int] | None = None,
        local_node: NodeId | None = None,
        events_enabled: bool = False,
    ) -> None:
        """``tokens_per_chunk``: original group id -> tokens one chunk of it covers.

        ``local_node``: this engine's node, so KV events can say LOCAL or REMOTE.
        ``events_enabled``: vLLM drains ``take_events`` only with KV-cache events on.
        """
        self._cfg = cfg
        self._namespace = namespace
        self._tokens_per_chunk = tokens_per_chunk or {}
        self._channel = channel
        self._lookup_timeout_s = cfg.lookup_timeout_ms / 1000
        self._lock = threading.RLock()
        self._id = uuid.uuid4().hex[:12]
        self._requests: dict[str, RequestState] = {}
        self._storing: set[ChunkKey] = set()
        self._known_stored = StoredKeys()
        self._metrics = metrics.ManagerMetrics()
        self._job_started: dict[frozenset[ChunkKey], float] = {}  # store/load job start
        self._local_node = local_node
        self._view_hit_ranks = 0  # ranks a view hit names; 0: no view hits (see below)
        self._view_hit_ttl_s = cfg.presence_max_age_ms / 1000
        self._view_hits = 0  # view hits not counted in the metrics yet (one count a step)
        # Unasked view hits loaded (to report to the Evictor), each with its request's
        # root: this step's, and the last step's, reported at this step's end.
        self._loaded_now: list[tuple[int, ChunkKey]] = []
        self._loaded_before: list[tuple[int, ChunkKey]] = []
        self._events = EventQueue(local_node) if events_enabled else None
        self._view = ClusterView(
            channel,
            namespace,
            self._lock,
            self._metrics,
            self._events,
            cfg.presence_max_age_ms / 1000,
            local_node,
        )

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    # ---- lookups ---------------------------------------------------------------------------
    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        with self._lock:
            self._state(req_context)
        return RequestOffloadingContext()

    def _state(self, req_context: ReqContext) -> RequestState:
        state = self._requests.get(req_context.req_id)
        if state is None:
            state = RequestState(holder=f"{self._id}/{req_context.req_id}")
            self._requests[req_context.req_id] = state
        return state

    def _root(self, state: RequestState, ctx: ReqContext, seen: ChunkKey) -> int:
        """The request's root, computed at its first key (``seen``) and kept: its calls
        to the Evictor go to one shard for its whole life."""
        if not state.root:
            state.root = self._root_of(ctx, seen)
        return state.root

    def _root_of(self, ctx: ReqContext, seen: ChunkKey) -> int:
        """The root of the request's prefix tree: that of its first chunk, the key with
        the smallest position among those vLLM's scheduler recorded for it (it records
        every offload key of the request, from its first chunk on, before it asks or
        stores any). Once per request: O(its chunks). Without that record (not a field
        of this vLLM's ReqContext, or still empty), ``seen``, the first key the manager
        sees of it: a root that differs from another request's for the same prefix
        sends their calls to different shards, which costs hits, never correctness."""
        positions = getattr(ctx, "_offload_key_positions", None)  # a ReqContext field
        first = min(positions, key=positions.__getitem__) if positions else seen
        return root_of(self._namespace, cast(ChunkKey, first))

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        chunk = cast(ChunkKey, key)  # vLLM's key is tierstore's chunk key
        with self._lock:
            # The hot path: vLLM asks again for every waiting key each step.
            state = self._requests.get(req_context.req_id) or self._state(req_context)
            if state.load_failed:
                return LookupResult.MISS
            answer = state.answers.get(chunk)
            if answer is not None:
                if answer.expires_at > time.monotonic():
                    tier_filter = req_context.load_tier_filter
                    if (
                        tier_filter is not TierFilter.ALL
                        and answer.state is LookupState.HIT
                        and not self._allowed(answer, tier_filter)
                    ):
                        return LookupResult.MISS  # held where this request may not load from
                    return _RESULTS[answer.state]
                state.expire(chunk)
            now = time.monotonic()
            asked_at = state.pending.get(chunk)
            if asked_at is None:
                return self._first_lookup(state, chunk, req_context, now)
            if now - asked_at > self._lookup_timeout_s:
                # Computed as a miss; the late answer's lease is given back when it lands.
                state.give_up(chunk, now)
                self._metrics.count(metrics.LOOKUP_TIMEOUTS)
                logger.debug("lookup of %s timed out; computed as a miss", chunk.hex())
                return LookupResult.MISS
            if chunk not in state.in_flight:  # answered PENDING: ask again
                state.send_later(chunk, now)
            return LookupResult.RETRY

    def _first_lookup(
        self, state: RequestState, key: ChunkKey, ctx: ReqContext, now: float
    ) -> LookupResult:
        """``key``'s first lookup since its last final answer: MISS if the view says no
        node holds it, HIT if it says one holds it in memory (a view hit, asked only when
        that node is not this one), else RETRY until the Evictor answers."""
        self._root(state, ctx, key)
        lately = self._known_stored.committing(key, now)  # its commit may not be polled yet
        held, node = self._view.locate(key, now, self._local_node, stored_here_lately=lately)
        if not held and not lately:
            self._metrics.count(metrics.LOOKUP_MISSES)  # held nowhere: no ask
            return LookupResult.MISS
        # No node when it is on disk only: asked, as the lookup starts its promotion, and
        # the load a step later mostly finds it in memory. Loaded at once, it raced the
        # promotion through the object store and waited longer than asking does.
        if not self._view_hit_ranks or ctx.load_tier_filter is not TierFilter.ALL:
            node = None
        if node is not None and node == self._local_node:
            where = dict.fromkeys(range(self._view_hit_ranks), node)
            state.hit_unasked(key, ctx, where, now, self._view_hit_ttl_s)
            self._view_hits += 1
            return LookupResult.HIT
        state.ask(key, ctx, now)
        if node is None:
            return LookupResult.RETRY
        where = dict.fromkeys(range(self._view_hit_ranks), node)
        state.hit_from_view(key, where, now, self._view_hit_ttl_s)
        self._view_hits += 1
        return LookupResult.HIT

    def answer_hits_from_picture(self, world_size: int) -> None:
        """Start-up, scheduler thread: :class:`~tierstore.connector.TierStoreConnector`
        calls this when a failed load recomputes its request (the name follows the
        config key ``hits_from_picture``, which turns it on). From then on, a chunk the
        fresh cluster view shows in some node's memory is a HIT at once (a view hit),
        loadable by each of the engine's ``world_size`` ranks from that copy (this
        node's first). One in this node's memory is not asked (no Ray call in the step);
        one on another node is leased by a lookup sent in the same step (its load joins
        or starts this node's pull of it: :mod:`tierstore.store.pulls`).
        The request is scheduled a step sooner than when it waited for the Evictor's
        round trip. A chunk gone in between (or never there: a false positive of the
        view's key table) is read from another copy the Evictor names, or its load fails
        and the request recomputes: a lost hit, never wrong bytes (every load looks its
        key up in full and verifies what it reads)."""
        with self._lock:
            self._view_hit_ranks = world_size if self._cfg.hits_from_picture else 0

    def _allowed(self, answer: Answer, tier_filter: TierFilter) -> bool:
        """The request's ``kv_load_tiers``: a chunk promoted from disk counts as STORAGE,
        and one held on another node (any rank) as REMOTE."""
        where = (answer.where or {}).values()
        return tier_filter.allows(MEDIUMS[answer.tier], locality(where, self._local_node))

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # The step's lookups are done (0.32 calls this first in build_connector_meta, 0.33
        # last): send them as one batch per request.
        with self._lock:
            for req_id, state in self._requests.items():
                if state.unsent:
                    keys = state.take_unsent()
                    self._channel.lookup(
                        self._namespace,
                        keys,
                        state.holder,
                        self._cfg.lease_ttl_s,
                        functools.partial(
                            self._on_answers,
                            req_id,
                            keys,
                            asked_at=state.unsent_since,
                            root=state.root,
                        ),
                        node=self._local_node,
                        root=state.root,
                    )
            self._count_view_hits()
            self._report_loaded(self._loaded_before)
            self._loaded_before, self._loaded_now = self._loaded_now, []
            self._view.maybe_poll(time.monotonic())

    def _count_view_hits(self) -> None:
        if self._view_hits:
            self._metrics.count(metrics.LOOKUP_HITS, self._view_hits, tier=TierName.CPU)
            self._metrics.count(metrics.VIEW_HITS, self._view_hits)
            self._view_hits = 0

    def _report_loaded(self, loaded: list[tuple[int, ChunkKey]]) -> None:
        """Tell the Evictor that unasked view hits (each with its request's root) were
        loaded here: a lookup (their recency, as for any hit) and a release counting them
        loaded, in one batch, per root (to its shard). A chunk it no longer holds may be
        offered to a store again."""
        by_root: dict[int, list[ChunkKey]] = {}
        for root, key in loaded:
            by_root.setdefault(root, []).append(key)
        holder = f"{self._id}/loaded"
        for root, keys in by_root.items():
            self._channel.lookup(
                self._namespace,
                keys,
                holder,
                self._cfg.lease_ttl_s,
                functools.partial(self._on_reported, keys),
                node=self._local_node,
                root=root,
            )
            self._channel.release(
                self._namespace, keys, holder, loaded=len(keys), node=self._local_node, root=root
            )

    def _on_reported(self, keys: list[ChunkKey], answers: list[LookupAnswer]) -> None:
        """Runs on the channel's thread."""
        with self._lock:
            for key, (answer_state, _, _) in zip(keys, answers, strict=True):
                if LookupState(answer_state) == LookupState.MISS:
                    self._known_stored.forget(key)

    def _on_answers(
        self,
        req_id: str,
        keys: list[ChunkKey],
        answers: list[LookupAnswer],
        asked_at: float,
        root: int = 0,
    ) -> None:
        """Runs on the channel's thread (``root``'s shard's)."""
        now = time.monotonic()
        with self._lock:
            state = self._requests.get(req_id)
            holder = state.holder if state is not None else f"{self._id}/{req_id}"
            late = []  # leased for an ask given up: finished, or timed out
            if state is not None:
                self._metrics.observe(metrics.LOOKUP_WAIT, now - asked_at)
            for key, (answer_state, where, from_tier) in zip(keys, answers, strict=True):
                answer_state = LookupState(answer_state)
                if state is None or key not in state.pending:
                    if state is None or state.is_late(key, answer_state):
                        late.append(key)
                    continue
                if answer_state == LookupState.MISS and self._known_stored.committing(key, now):
                    state.take_view_hit(key)
                    state.ask_again(key, now)
                    continue
                # Re-ask a HIT well before its lease ends.
                view_hit = state.take_view_hit(key)  # a HIT already, counted as one
                tier = state.take(
                    key, answer_state, where, now, self._cfg.lease_ttl_s / 2, from_tier
                )
                if answer_state == LookupState.HIT and not view_hit:
                    self._metrics.count(metrics.LOOKUP_HITS, tier=tier)
                elif answer_state == LookupState.MISS:
                    self._metrics.count(
                        metrics.VIEW_HITS_UNLEASED if view_hit else metrics.LOOKUP_MISSES
                    )
                    # Evicted (or never stored): let the next prepare_store offer it again.
                    self._known_stored.forget(key)
            if late:
                self._channel.release(self._namespace, late, holder, root=root)

    @override
    def has_pending_work(self) -> bool:
        with self._lock:
            return any(s.pending for s in self._requests.values())

    # ---- loads -----------------------------------------------------------------------------
    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadSpec:
        with self._lock:
            state = self._state(req_context)
            ordered = _chunk_keys(keys)
            if ordered:
                self._root(state, req_context, ordered[0])
            where = []
            tiers: Counter[TierName] = Counter()
            for key in ordered:
                answer = state.answers.get(key)
                if answer is None or answer.state != LookupState.HIT or answer.where is None:
                    raise TierStoreError(
                        f"prepare_load for {key.hex()} of request {req_context.req_id}, "
                        "which was never a HIT"
                    )
                where.append(answer.where)
                tiers[answer.tier] += 1
            for tier, n in tiers.items():
                self._metrics.count(metrics.LOADED_CHUNKS, n, tier=tier)
            self._job_started[frozenset(ordered)] = time.monotonic()
            state.loading.update(ordered)
            # A key still asked (a remote view hit) gets a whole lease as its ask lands;
            # an unasked view hit has none.
            not_leased = state.in_flight | state.unasked
            if held := [k for k in ordered if k not in not_leased]:
                ttl_s = self._cfg.lease_ttl_s
                self._channel.extend_leases(
                    self._namespace, held, state.holder, ttl_s, root=state.root
                )
            return LoadSpec.build(self._namespace, ordered, where, state.root)

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        with self._lock:
            state = self._requests.get(req_context.req_id)
            holder = state.holder if state else f"{self._id}/{req_context.req_id}"
            failed = state is not None and state.load_failed
            chunk_keys = _chunk_keys(keys)
            unasked = state.unasked if state is not None else set()
            root = state.root if state is not None else 0
            if not root and chunk_keys:
                root = self._root_of(req_context, chunk_keys[0])
            if leased := [k for k in chunk_keys if k not in unasked]:
                loaded = 0 if failed else len(leased)
                self._channel.release(
                    self._namespace, leased, holder, loaded=loaded, node=self._local_node, root=root
                )
            if not failed:  # reported with the next step's batch
                self._loaded_now.extend((root, k) for k in chunk_keys if k in unasked)
            self._observe_job(metrics.LOAD_LATENCY, chunk_keys)
            if state is not None:
                state.unasked.difference_update(chunk_keys)
                state.loading.difference_update(chunk_keys)
                state.leased.difference_update(chunk_keys)
                self._maybe_forget(req_context.req_id, state)

    def on_load_failed(self, req_id: str) -> None:
        """A load job of ``req_id`` failed (``TierStoreConnector`` says so before its
        ``complete_load``): the request recomputes, so its next lookups are MISS and the
        chunks of the job may be offered again (one of them may be gone)."""
        with self._lock:
            self._metrics.count(metrics.FAILED_LOADS)
            state = self._requests.get(req_id)
            if state is None:
                return
            state.load_failed = True
            for key in state.loading:
                self._known_stored.forget(key)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        with self._lock:
            state = self._requests.get(req_context.req_id)
            if state is None:
                return
            state.finished = True
            self._report_loaded(self._loaded_before + self._loaded_now)
            self._loaded_before, self._loaded_now = [], []
            idle = state.leased - state.loading
            if idle:
                self._channel.release(self._namespace, list(idle), state.holder, root=state.root)
                state.leased -= idle
            self._maybe_forget(req_context.req_id, state)

    def _maybe_forget(self, req_id: str, state: RequestState) -> None:
        if state.finished and not state.loading:
            self._requests.pop(req_id, None)

    # ---- stores ----------------------------------------------------------------------------
    @override
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput:
        with self._lock:
            state = self._state(req_context)
            chunk_keys = _chunk_keys(keys)
            if chunk_keys:
                self._root(state, req_context, chunk_keys[0])
            for key in chunk_keys:
                state.remember_position(key, req_context)
            fresh = [
                k for k in chunk_keys if k not in self._known_stored and k not in self._storing
            ]
            self._storing.update(fresh)
            if fresh:
                self._job_started[frozenset(fresh)] = time.monotonic()
            parents = tuple(
                state.parent(k, req_context, self._tokens_per_chunk.get(group_of(k))) for k in fresh
            )
            return PrepareStoreOutput(
                keys_to_store=cast("list[OffloadKey]", fresh),
                store_spec=StoreSpec(self._namespace, tuple(fresh), parents, state.root),
                evicted_keys=[],
            )

    @override
    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        with self._lock:
            chunk_keys = _chunk_keys(keys)
            self._storing.difference_update(chunk_keys)
            self._observe_job(metrics.STORE_LATENCY, chunk_keys)
            if not success:  # vLLM 0.32/0.33 never say so: the worker reports failures
                return
            self._metrics.count(metrics.STORED_CHUNKS, len(chunk_keys))
            self._known_stored.add(chunk_keys, time.monotonic())

    def _observe_job(self, histogram: str, keys: Collection[ChunkKey]) -> None:
        started = self._job_started.pop(frozenset(keys), None)
        if started is not None:
            self._metrics.observe(histogram, time.monotonic() - started)

    # ---- metrics and events ----------------------------------------------------------------
    @override
    def get_stats(self) -> Any:
        with self._lock:
            self._count_view_hits()
            return self._metrics.take()

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        with self._lock:
            return self._events.take() if self._events is not None else []

    # ---- lifecycle -------------------------------------------------------------------------
    @override
    def reset_cache(self) -> None:
        """Forget this engine's view; the cluster's chunks belong to every engine and stay."""
        with self._lock:
            for state in self._requests.values():
                self._channel.release_holder(state.holder)
            self._requests.clear()
            self._storing.clear()
            self._known_stored.clear()
            self._job_started.clear()
            self._view.drop(time.monotonic())

    def on_reset_flushed(self) -> None:  # vLLM 0.33 hook; nothing is slot-based here
        return

    @override
    def shutdown(self) -> None:
        with self._lock:
            holders = [s.holder for s in self._requests.values()]
            self._requests.clear()
            self._report_loaded(self._loaded_before + self._loaded_now)
            self._loaded_before, self._loaded_now = [], []
        for holder in holders:
            self._channel.release_holder(holder)
        self._channel.close()
        self._view.close()


def _chunk_keys(keys: Collection[OffloadKey]) -> list[ChunkKey]:
    """vLLM's keys as tierstore's chunk keys (the same bytes; a list, in vLLM's order)."""
    return cast("list[ChunkKey]", list(keys))
