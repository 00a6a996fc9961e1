"""One request's lookups as the scheduler side tracks them: asked, sent, answered, leased.

Plain bookkeeping, no Ray and no metrics: :class:`~tierstore.vllm.manager.TierStoreManager`
owns one :class:`RequestState` per request and calls these methods with its lock held
(scheduler thread, or the channel's thread when an answer lands).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from tierstore.keys import ChunkKey, NodeId, TierName, group_of
from tierstore.wire import LookupState

# A MISS is trusted this long, then asked again: another engine may have stored it since.
MISS_TTL_S = 1.0
# A chunk being promoted from disk is asked about again after this long.
PENDING_RETRY_S = 0.005


@dataclass
class Answer:
    state: LookupState
    where: dict[int, NodeId] | None  # rank -> node of a HIT
    expires_at: float
    tier: TierName = TierName.CPU  # where a HIT came from: DISK if it was promoted first


@dataclass
class RequestState:
    holder: str  # lease holder id at the Evictor
    # The root of the request's prefix tree (tierstore.keys.root_of), set once by the
    # manager from the request's first keys: names the Evictor shard its calls go to.
    # 0 until known.
    root: int = 0
    answers: dict[ChunkKey, Answer] = field(default_factory=dict)
    # key -> when it was first asked and not answered for good (HIT or MISS) since; a
    # PENDING answer (promotion under way) keeps the first ask's time.
    pending: dict[ChunkKey, float] = field(default_factory=dict)
    unsent: list[ChunkKey] = field(default_factory=list)
    unsent_since: float = 0.0  # when the oldest unsent key was first answered RETRY
    in_flight: set[ChunkKey] = field(default_factory=set)  # sent, no answer back yet
    promoting: set[ChunkKey] = field(default_factory=set)  # answered PENDING (on disk)
    leased: set[ChunkKey] = field(default_factory=set)
    # answered HIT from the cluster view (a view hit); the Evictor's answer is to come
    view_hits: set[ChunkKey] = field(default_factory=set)
    # view hits in this node's memory, never asked: no lease, the Evictor hears of them
    # once they are loaded
    unasked: set[ChunkKey] = field(default_factory=set)
    loading: set[ChunkKey] = field(default_factory=set)
    # (group, end token) -> key, to name each stored chunk's parent in its chain.
    positions: dict[tuple[int, int], ChunkKey] = field(default_factory=dict)
    finished: bool = False
    load_failed: bool = False  # a load of it failed: it recomputes, never loads again

    # ---- chains --------------------------------------------------------------------------
    def remember_position(self, key: ChunkKey, ctx: ReqContext) -> None:
        end = ctx.get_offload_key_position(OffloadKey(key))
        if end is not None:
            self.positions[(group_of(key), end)] = key

    def parent(
        self, key: ChunkKey, ctx: ReqContext, tokens_per_chunk: int | None
    ) -> ChunkKey | None:
        """The previous chunk of ``key``'s group in this request's prefix, if known."""
        end = ctx.get_offload_key_position(OffloadKey(key))
        if end is None or not tokens_per_chunk:
            return None
        return self.positions.get((group_of(key), end - tokens_per_chunk))

    # ---- asking --------------------------------------------------------------------------
    def expire(self, key: ChunkKey) -> None:
        """``key``'s answer is stale: it must be asked again."""
        del self.answers[key]
        self.leased.discard(key)

    def ask(self, key: ChunkKey, ctx: ReqContext, now: float) -> None:
        """First ask of ``key`` since its last final answer: send it with the step's batch."""
        self.remember_position(key, ctx)  # once per ask is enough
        self.pending[key] = now
        self.send_later(key, now)

    def send_later(self, key: ChunkKey, now: float) -> None:
        if not self.unsent:
            self.unsent_since = now
        self.unsent.append(key)
        self.in_flight.add(key)

    def take_unsent(self) -> list[ChunkKey]:
        keys, self.unsent = self.unsent, []
        return keys

    def give_up(self, key: ChunkKey, now: float) -> None:
        """No answer within the deadline: a MISS for now (asked again after its TTL); the
        late answer, when it lands, finds the key no longer pending."""
        del self.pending[key]
        self.in_flight.discard(key)
        self.promoting.discard(key)
        self.answers[key] = Answer(LookupState.MISS, None, now + MISS_TTL_S)

    def ask_again(self, key: ChunkKey, now: float) -> None:
        """A MISS not trusted (the key's store finished moments ago, its commit may not
        be indexed yet): RETRY for a moment, then ask again. The first ask's time is kept,
        so the lookup deadline bounds the wait."""
        self.in_flight.discard(key)
        self.answers[key] = Answer(LookupState.PENDING, None, now + PENDING_RETRY_S)

    def hit_from_view(
        self, key: ChunkKey, where: dict[int, NodeId], now: float, ttl_s: float
    ) -> None:
        """A view hit for a ``key`` just asked: the cluster view shows it loadable from
        memory on ``where`` now; the Evictor's answer, when it lands, replaces it (and
        its lease is then held)."""
        self.view_hits.add(key)
        self.answers[key] = Answer(LookupState.HIT, where, now + ttl_s, TierName.CPU)

    def hit_unasked(
        self, key: ChunkKey, ctx: ReqContext, where: dict[int, NodeId], now: float, ttl_s: float
    ) -> None:
        """A view hit in this node's memory: a HIT with no ask (so no lease) at all."""
        self.remember_position(key, ctx)
        self.unasked.add(key)
        self.answers[key] = Answer(LookupState.HIT, where, now + ttl_s, TierName.CPU)

    def take_view_hit(self, key: ChunkKey) -> bool:
        """Whether ``key``'s HIT came from the cluster view; asked once, as the Evictor's
        answer lands."""
        if key in self.view_hits:
            self.view_hits.discard(key)
            return True
        return False

    # ---- answers -------------------------------------------------------------------------
    def is_late(self, key: ChunkKey, state: LookupState) -> bool:
        """An answer for an ask given up. Its lease is given back only if no later ask
        holds it: leases are per holder, so one still in use must not be released."""
        return key not in self.pending and state != LookupState.MISS and key not in self.leased

    def take(
        self,
        key: ChunkKey,
        state: LookupState,
        where: dict[int, NodeId] | None,
        now: float,
        hit_ttl_s: float,
        from_tier: TierName | str | None = None,
    ) -> TierName:
        """Record the Evictor's answer for a pending ``key``; returns the tier a HIT came
        from: DISK when it was promoted first, or is read straight from disk
        (``from_tier``, the Evictor's word for where the HIT's bytes are)."""
        self.in_flight.discard(key)
        tier = TierName.DISK if from_tier == TierName.DISK else TierName.CPU
        if state == LookupState.PENDING:  # still waiting: keeps its first ask's time
            self.promoting.add(key)
        else:
            del self.pending[key]
            if state == LookupState.HIT and key in self.promoting:
                tier = TierName.DISK
            self.promoting.discard(key)
        ttl = {LookupState.HIT: hit_ttl_s, LookupState.MISS: MISS_TTL_S}.get(state, PENDING_RETRY_S)
        self.answers[key] = Answer(state, where, now + ttl, tier)
        if state != LookupState.MISS:
            self.leased.add(key)
        return tier
