"""Scheduler side: answers vLLM's lookups from local state and talks to the Evictor off-thread.

Runtime rules (vLLM's OffloadingConnector calls every method on the scheduler thread):
- no method waits on Ray. A key not answered yet is ``RETRY``; the keys of a step are
  sent in one batch by :class:`EvictorChannel`'s thread, and the answer lands in
  per-request state, under :attr:`lock`.
- a ``HIT`` is backed by a lease the Evictor granted this request, so the chunk stays
  loadable until ``prepare_load``, which extends the lease until ``complete_load``.
- ``lock`` is an ``RLock``: vLLM 0.33 holds it around its calls, 0.32 does not, and the
  methods also take it themselves, so both versions are safe.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

from typing_extensions import override
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from tierstore.config import TierStoreConfig
from tierstore.control.index import LookupAnswer, LookupState
from tierstore.errors import TierStoreError
from tierstore.keys import ChunkKey, Namespace, NodeId, group_of
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec

logger = logging.getLogger(__name__)

# Keys this engine knows are stored, so it does not offer them again; bounded because an
# engine may run for weeks. Forgetting one only costs a duplicate store, which the
# Evictor refuses.
_KNOWN_STORED_MAX = 1_000_000
# A MISS is trusted this long, then asked again: another engine may have stored it since.
_MISS_TTL_S = 1.0
# A chunk being promoted from disk is asked about again after this long.
_PENDING_RETRY_S = 0.005


_RESULTS = {
    LookupState.HIT: LookupResult.HIT,
    LookupState.MISS: LookupResult.MISS,
    LookupState.PENDING: LookupResult.RETRY,  # promotion from disk under way
}


@dataclass
class _Answer:
    state: LookupState
    where: dict[int, NodeId] | None  # rank -> node of a HIT
    expires_at: float


@dataclass
class _RequestState:
    holder: str  # lease holder id at the Evictor
    answers: dict[ChunkKey, _Answer] = field(default_factory=dict)
    pending: set[ChunkKey] = field(default_factory=set)
    unsent: list[ChunkKey] = field(default_factory=list)
    leased: set[ChunkKey] = field(default_factory=set)
    loading: set[ChunkKey] = field(default_factory=set)
    # (group, end token) -> key, to name each stored chunk's parent in its chain.
    positions: dict[tuple[int, int], ChunkKey] = field(default_factory=dict)
    finished: bool = False


class TierStoreManager(OffloadingManager):
    def __init__(
        self,
        cfg: TierStoreConfig,
        namespace: Namespace,
        channel: EvictorChannel,
        tokens_per_chunk: dict[int, int] | None = None,
    ) -> None:
        """``tokens_per_chunk``: original group id -> tokens one chunk of it covers."""
        self._cfg = cfg
        self._namespace = namespace
        self._tokens_per_chunk = tokens_per_chunk or {}
        self._channel = channel
        self._lock = threading.RLock()
        self._id = uuid.uuid4().hex[:12]
        self._requests: dict[str, _RequestState] = {}
        self._storing: set[ChunkKey] = set()
        self._known_stored: OrderedDict[ChunkKey, None] = OrderedDict()

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    # ---- lookups ---------------------------------------------------------------------------
    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        with self._lock:
            self._state(req_context)
        return RequestOffloadingContext()

    def _state(self, req_context: ReqContext) -> _RequestState:
        state = self._requests.get(req_context.req_id)
        if state is None:
            state = _RequestState(holder=f"{self._id}/{req_context.req_id}")
            self._requests[req_context.req_id] = state
        return state

    def _remember_position(self, state: _RequestState, key: ChunkKey, ctx: ReqContext) -> None:
        end = ctx.get_offload_key_position(key)
        if end is not None:
            state.positions[(group_of(key), end)] = key

    def _parent(self, state: _RequestState, key: ChunkKey, ctx: ReqContext) -> ChunkKey | None:
        end = ctx.get_offload_key_position(key)
        step = self._tokens_per_chunk.get(group_of(key))
        if end is None or not step:
            return None
        return state.positions.get((group_of(key), end - step))

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._lock:
            state = self._state(req_context)
            self._remember_position(state, key, req_context)
            answer = state.answers.get(key)
            if answer is not None:
                if answer.expires_at > time.monotonic():
                    return _RESULTS[answer.state]
                del state.answers[key]
                state.leased.discard(key)
            if key not in state.pending:
                state.pending.add(key)
                state.unsent.append(key)
            return LookupResult.RETRY

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # The step's lookups are done (0.32 calls this first in build_connector_meta, 0.33
        # last): send them as one batch per request.
        with self._lock:
            for req_id, state in self._requests.items():
                if state.unsent:
                    keys, state.unsent = state.unsent, []
                    self._channel.lookup(
                        self._namespace,
                        keys,
                        state.holder,
                        self._cfg.lease_ttl_s,
                        lambda answers, r=req_id, k=keys: self._on_answers(r, k, answers),
                    )

    def _on_answers(self, req_id: str, keys: list[ChunkKey], answers: list[LookupAnswer]) -> None:
        """Runs on the channel's thread."""
        now = time.monotonic()
        ttls = {
            LookupState.HIT: self._cfg.lease_ttl_s / 2,  # re-ask well before the lease ends
            LookupState.MISS: _MISS_TTL_S,
            LookupState.PENDING: _PENDING_RETRY_S,
        }
        with self._lock:
            state = self._requests.get(req_id)
            if state is None:  # finished meanwhile: give the leases back
                held = [
                    k for k, a in zip(keys, answers, strict=True) if a.state != LookupState.MISS
                ]
                if held:
                    self._channel.release(self._namespace, held, f"{self._id}/{req_id}")
                return
            for key, (answer_state, where) in zip(keys, answers, strict=True):
                answer_state = LookupState(answer_state)
                state.pending.discard(key)
                state.answers[key] = _Answer(answer_state, where, now + ttls[answer_state])
                if answer_state == LookupState.MISS:
                    # Evicted (or never stored): let the next prepare_store offer it again.
                    self._known_stored.pop(key, None)
                else:
                    state.leased.add(key)

    @override
    def has_pending_work(self) -> bool:
        with self._lock:
            return any(s.pending for s in self._requests.values())

    # ---- loads -----------------------------------------------------------------------------
    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadSpec:
        with self._lock:
            state = self._state(req_context)
            ordered = list(keys)
            where = []
            for key in ordered:
                answer = state.answers.get(key)
                if answer is None or answer.state != LookupState.HIT or answer.where is None:
                    raise TierStoreError(
                        f"prepare_load for {key.hex()} of request {req_context.req_id}, "
                        "which was never a HIT"
                    )
                where.append(answer.where)
            state.loading.update(ordered)
            self._channel.extend_leases(
                self._namespace, ordered, state.holder, self._cfg.lease_ttl_s
            )
            return LoadSpec.build(self._namespace, ordered, where)

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        with self._lock:
            state = self._requests.get(req_context.req_id)
            holder = state.holder if state else f"{self._id}/{req_context.req_id}"
            self._channel.release(self._namespace, list(keys), holder, loaded=len(keys))
            if state is not None:
                state.loading.difference_update(keys)
                state.leased.difference_update(keys)
                self._maybe_forget(req_context.req_id, state)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        with self._lock:
            state = self._requests.get(req_context.req_id)
            if state is None:
                return
            state.finished = True
            idle = state.leased - state.loading
            if idle:
                self._channel.release(self._namespace, list(idle), state.holder)
                state.leased -= idle
            self._maybe_forget(req_context.req_id, state)

    def _maybe_forget(self, req_id: str, state: _RequestState) -> None:
        if state.finished and not state.loading:
            self._requests.pop(req_id, None)

    # ---- stores ----------------------------------------------------------------------------
    @override
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput:
        with self._lock:
            state = self._state(req_context)
            for key in keys:
                self._remember_position(state, key, req_context)
            fresh = [k for k in keys if k not in self._known_stored and k not in self._storing]
            self._storing.update(fresh)
            parents = tuple(self._parent(state, k, req_context) for k in fresh)
            return PrepareStoreOutput(
                keys_to_store=fresh,
                store_spec=StoreSpec(self._namespace, tuple(fresh), parents),
                evicted_keys=[],
            )

    @override
    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        with self._lock:
            self._storing.difference_update(keys)
            if not success:
                return
            for key in keys:
                self._known_stored[key] = None
                self._known_stored.move_to_end(key)
            while len(self._known_stored) > _KNOWN_STORED_MAX:
                self._known_stored.popitem(last=False)

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

    def on_reset_flushed(self) -> None:  # vLLM 0.33 hook; nothing is slot-based here
        return

    @override
    def shutdown(self) -> None:
        with self._lock:
            holders = [s.holder for s in self._requests.values()]
            self._requests.clear()
        for holder in holders:
            self._channel.release_holder(holder)
        self._channel.close()
