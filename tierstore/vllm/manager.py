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
from tierstore.errors import TierStoreError
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec

logger = logging.getLogger(__name__)

# Keys this engine knows are stored, so it does not offer them again; bounded because an
# engine may run for weeks. Forgetting one only costs a duplicate store, which the
# Evictor refuses.
_KNOWN_STORED_MAX = 1_000_000
# A MISS is trusted this long, then asked again: another engine may have stored it since.
_MISS_TTL_S = 1.0


@dataclass
class _Answer:
    where: dict[int, NodeId] | None  # rank -> node of a HIT; None = MISS
    expires_at: float


@dataclass
class _RequestState:
    holder: str  # lease holder id at the Evictor
    answers: dict[ChunkKey, _Answer] = field(default_factory=dict)
    pending: set[ChunkKey] = field(default_factory=set)
    unsent: list[ChunkKey] = field(default_factory=list)
    leased: set[ChunkKey] = field(default_factory=set)
    loading: set[ChunkKey] = field(default_factory=set)
    finished: bool = False


class TierStoreManager(OffloadingManager):
    def __init__(self, cfg: TierStoreConfig, namespace: Namespace, channel: EvictorChannel) -> None:
        self._cfg = cfg
        self._namespace = namespace
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

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._lock:
            state = self._state(req_context)
            answer = state.answers.get(key)
            if answer is not None:
                if answer.expires_at > time.monotonic():
                    return LookupResult.HIT if answer.where is not None else LookupResult.MISS
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

    def _on_answers(
        self, req_id: str, keys: list[ChunkKey], answers: list[dict[int, NodeId] | None]
    ) -> None:
        """Runs on the channel's thread."""
        now = time.monotonic()
        hit_ttl = self._cfg.lease_ttl_s / 2  # re-ask well before the Evictor's lease ends
        with self._lock:
            state = self._requests.get(req_id)
            if state is None:  # finished meanwhile: give the leases back
                hits = [k for k, a in zip(keys, answers, strict=True) if a is not None]
                if hits:
                    self._channel.release(self._namespace, hits, f"{self._id}/{req_id}")
                return
            for key, where in zip(keys, answers, strict=True):
                state.pending.discard(key)
                ttl = hit_ttl if where is not None else _MISS_TTL_S
                state.answers[key] = _Answer(where, now + ttl)
                if where is not None:
                    state.leased.add(key)
                else:
                    # Evicted (or never stored): let the next prepare_store offer it again.
                    self._known_stored.pop(key, None)

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
                if answer is None or answer.where is None:
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
            fresh = [k for k in keys if k not in self._known_stored and k not in self._storing]
            self._storing.update(fresh)
            return PrepareStoreOutput(
                keys_to_store=fresh,
                store_spec=StoreSpec(self._namespace, tuple(fresh)),
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
