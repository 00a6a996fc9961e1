"""The scheduler side with sharded Evictors: each request's calls go to the shard of its
prefix tree's root only (one lookup per request and step, its leases extended and
released there), a holder's leases are released on every shard, and view hits loaded
here are reported to each root's own shard.

The two shards are in-process stand-ins over the real index (``ChunkIndex``) and event
log, behind the real EvictorChannel threads (one per shard); the Ray Evictor shards are
covered in tests/actors."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from tests.support import Answered, wait_for
from tierstore.config import TierStoreConfig
from tierstore.control.events import EventLog
from tierstore.control.index import ChunkIndex
from tierstore.keys import ChunkKey, Namespace, NodeId, root_of, shard_of
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.manager import TierStoreManager
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec
from tierstore.wire import EventBatch, LookupAnswer, ShardOffer

NS = Namespace("shards-test")
NODE = NodeId("node-here")
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
TOKENS_PER_CHUNK = 16
CHUNKS = 3
_WAIT_S = 10.0


class IndexShard:
    """One Evictor shard in process (its ``EvictorCalls``): the real index and event
    log, every call recorded as (method, holder, keys). Called from the channel's
    threads (its lookups' and its polls'), hence the lock."""

    def __init__(self) -> None:
        self.index = ChunkIndex()
        self.events = EventLog()
        self.calls: list[tuple[str, str, tuple[ChunkKey, ...]]] = []
        self._lock = threading.Lock()
        self.index.register_node(NODE, 100_000)

    def hold(self, keys: list[ChunkKey]) -> None:
        parents = [None, *keys[:-1]]
        offers = [ShardOffer(NS, k, 0, 1, 100, p) for k, p in zip(keys, parents, strict=True)]
        assert self.index.admit(NODE, offers, time.monotonic()).accepted == [True] * len(keys)

    def calls_of(self, holder_suffix: str, method: str | None = None) -> list[tuple[ChunkKey, ...]]:
        with self._lock:
            return [
                keys
                for m, holder, keys in self.calls
                if holder.endswith(holder_suffix) and method in (None, m)
            ]

    def _record(self, method: str, holder: str, keys: list[ChunkKey]) -> None:
        self.calls.append((method, holder, tuple(keys)))

    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        lease_ttl_s: float,
        node_id: str | None = None,
    ) -> Answered[list[LookupAnswer]]:
        with self._lock:
            self._record("lookup", holder, keys)
            node = NodeId(node_id) if node_id else None
            answers, _ = self.index.lookup(
                namespace, keys, holder, time.monotonic(), lease_ttl_s, node
            )
            return Answered(answers)

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, ttl_s: float
    ) -> Answered[None]:
        with self._lock:
            self._record("extend_leases", holder, keys)
            self.index.extend_leases(namespace, keys, holder, time.monotonic(), ttl_s)
            return Answered(None)

    def release(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        loaded: int = 0,
        node_id: str | None = None,
    ) -> Answered[None]:
        with self._lock:
            self._record("release", holder, keys)
            self.index.release(namespace, keys, holder)
            self.index.record_loaded(loaded)
            return Answered(None)

    def release_holder(self, holder: str) -> Answered[None]:
        with self._lock:
            self._record("release_holder", holder, [])
            self.index.release_holder(holder)
            return Answered(None)

    def events_since(self, after: int, namespace: Namespace) -> Answered[EventBatch]:
        with self._lock:
            return Answered(self.events.since(after, namespace))

    def presence(self, namespace: Namespace) -> Answered[EventBatch]:
        with self._lock:
            held = {node: self.index.shards_on(node) for node in self.index.nodes()}
            return Answered(self.events.snapshot(namespace, held))

    def status(self) -> Answered[dict[str, Any]]:
        with self._lock:
            return Answered({"nodes": {}, "totals": dict(vars(self.index.stats))})


def _prompt(shard: int, taken: set[int]) -> list[ChunkKey]:
    """A prompt's chunk keys (first chunk first) whose root maps to ``shard`` of two."""
    for n in itertools.count(1):
        first = _key(n * 100)
        if n not in taken and shard_of(root_of(NS, first), 2) == shard:
            taken.add(n)
            return [_key(n * 100 + i) for i in range(CHUNKS)]
    raise AssertionError("unreachable")


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + (0).to_bytes(4, "big"))


def _context(req_id: str, keys: list[ChunkKey]) -> ReqContext:
    """A request as vLLM's scheduler hands it over: every offload key's end position
    recorded (the first chunk at TOKENS_PER_CHUNK) before any lookup or store."""
    ctx = ReqContext(req_id=req_id)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * TOKENS_PER_CHUNK)  # type: ignore[arg-type]
    return ctx


def _settle(manager: TierStoreManager, keys: list[ChunkKey], ctx: ReqContext) -> list[Any]:
    """Ask ``keys`` until none is RETRY, ending a scheduler step after each round."""

    def resolved() -> list[LookupResult] | None:
        results = [manager.lookup(k, ctx) for k in keys]  # type: ignore[arg-type]
        if LookupResult.RETRY in results:
            manager.on_schedule_end(END)
            return None
        return results

    return wait_for(resolved, "the lookups resolved", _WAIT_S, poll_s=0.005)


def _two_held_prompts() -> tuple[list[IndexShard], dict[str, list[ChunkKey]], dict[str, int]]:
    """Two shards, and requests "a" and "b" whose prompts are rooted on (and held by)
    shard 0 and shard 1."""
    shards = [IndexShard(), IndexShard()]
    taken: set[int] = set()
    prompts = {"a": _prompt(0, taken), "b": _prompt(1, taken)}
    home = {"a": 0, "b": 1}
    for req, keys in prompts.items():
        shards[home[req]].hold(keys)
    return shards, prompts, home


def _manager(cfg: TierStoreConfig, shards: list[IndexShard]) -> TierStoreManager:
    return TierStoreManager(cfg, NS, EvictorChannel(shards), {0: TOKENS_PER_CHUNK}, local_node=NODE)


def _eventually(check: Callable[[], bool], what: str) -> None:
    wait_for(lambda: check() or None, what, _WAIT_S)


def test_each_requests_calls_go_to_its_roots_shard_only() -> None:
    cfg = TierStoreConfig(cpu_bytes_per_node=1 << 20, presence_max_age_ms=0)
    shards, prompts, home = _two_held_prompts()
    manager = _manager(cfg, shards)
    contexts = {req: _context(req, keys) for req, keys in prompts.items()}
    for ctx in contexts.values():
        manager.on_new_request(ctx)

    # One step asks both prompts: one lookup each, to its own shard.
    for req, keys in prompts.items():
        assert [manager.lookup(k, contexts[req]) for k in keys] == [LookupResult.RETRY] * CHUNKS  # type: ignore[arg-type]
    manager.on_schedule_end(END)
    for req, keys in prompts.items():
        assert _settle(manager, keys, contexts[req]) == [LookupResult.HIT] * CHUNKS
        mine, other = shards[home[req]], shards[1 - home[req]]
        assert mine.calls_of(f"/{req}", "lookup") == [tuple(keys)]
        assert other.calls_of(f"/{req}") == []

    # Loads: the specs carry the root; leases extended and released on the same shard.
    for req, keys in prompts.items():
        spec = manager.prepare_load(keys, contexts[req])  # type: ignore[arg-type]
        assert isinstance(spec, LoadSpec) and spec.root == root_of(NS, keys[0])
        manager.complete_load(keys, contexts[req])  # type: ignore[arg-type]
        manager.on_request_finished(contexts[req])
    for req, keys in prompts.items():
        mine, other = shards[home[req]], shards[1 - home[req]]
        _eventually(lambda m=mine, r=req: bool(m.calls_of(f"/{r}", "release")), "the release")
        assert mine.calls_of(f"/{req}", "extend_leases") == [tuple(keys)]
        assert mine.calls_of(f"/{req}", "release") == [tuple(keys)]
        assert other.calls_of(f"/{req}") == []
    assert [s.index.stats.loaded_chunks for s in shards] == [CHUNKS, CHUNKS]

    # A holder's leases go on every shard: a cache reset releases them all.
    late = _context("late", prompts["b"])
    manager.on_new_request(late)
    _settle(manager, prompts["b"], late)
    manager.reset_cache()
    for shard in shards:
        _eventually(lambda s=shard: bool(s.calls_of("/late", "release_holder")), "release_holder")
    manager.shutdown()


def test_the_root_is_the_first_chunks_whatever_key_comes_first() -> None:
    """A store of a later chunk (vLLM backfills out of order) names the first chunk's
    root all the same; a request vLLM recorded no positions for takes its first key's."""
    cfg = TierStoreConfig(cpu_bytes_per_node=1 << 20, presence_max_age_ms=0)
    manager = _manager(cfg, [IndexShard(), IndexShard()])
    keys = _prompt(1, set())
    ctx = _context("backfill", keys)
    manager.on_new_request(ctx)
    spec = manager.prepare_store([keys[2]], ctx).store_spec  # type: ignore[list-item]
    assert isinstance(spec, StoreSpec) and spec.root == root_of(NS, keys[0])
    spec = manager.prepare_store([keys[0], keys[1]], ctx).store_spec  # type: ignore[list-item]
    assert isinstance(spec, StoreSpec) and spec.root == root_of(NS, keys[0])
    bare = ReqContext(req_id="no-positions")
    spec = manager.prepare_store([keys[1]], bare).store_spec  # type: ignore[list-item]
    assert isinstance(spec, StoreSpec) and spec.root == root_of(NS, keys[1])
    manager.shutdown()


def test_view_hits_loaded_here_are_reported_to_each_roots_shard() -> None:
    """Unasked view hits (this node's memory, no lease) of two requests rooted on two
    shards, loaded in one step: each shard hears of its own chunks only (the lookup that
    counts their recency and the release that counts them loaded)."""
    cfg = TierStoreConfig(cpu_bytes_per_node=1 << 20, presence_max_age_ms=60_000)
    shards, prompts, home = _two_held_prompts()
    manager = _manager(cfg, shards)
    manager.answer_hits_from_picture(1)

    # The view's snapshot (both shards') is fresh once a key held nowhere is a MISS
    # without an ask; each probe is a new request.
    probes = iter(range(10_000_000, 20_000_000))

    def fresh() -> bool:
        probe = next(probes)
        result = manager.lookup(_key(probe), ReqContext(req_id=f"probe-{probe}"))  # type: ignore[arg-type]
        manager.on_schedule_end(END)
        return result is LookupResult.MISS

    _eventually(fresh, "a presence snapshot from both shards")
    contexts = {req: _context(req, keys) for req, keys in prompts.items()}
    for req, keys in prompts.items():
        manager.on_new_request(contexts[req])
        results = [manager.lookup(k, contexts[req]) for k in keys]  # type: ignore[arg-type]
        assert results == [LookupResult.HIT] * CHUNKS  # view hits, unasked
        manager.prepare_load(keys, contexts[req])  # type: ignore[arg-type]
        manager.complete_load(keys, contexts[req])  # type: ignore[arg-type]
        manager.on_request_finished(contexts[req])
    for req in prompts:  # never asked under its own holder
        assert all(s.calls_of(f"/{req}") == [] for s in shards)
    manager.on_schedule_end(END)
    manager.on_schedule_end(END)  # the last step's loads are reported with this one
    for req, keys in prompts.items():
        mine, other = shards[home[req]], shards[1 - home[req]]
        _eventually(lambda m=mine: bool(m.calls_of("/loaded", "release")), "the report")
        assert mine.calls_of("/loaded", "lookup") == [tuple(keys)]
        assert mine.calls_of("/loaded", "release") == [tuple(keys)]
        assert not set(keys) & {k for c in other.calls_of("/loaded") for k in c}
    assert [s.index.stats.loaded_chunks for s in shards] == [CHUNKS, CHUNKS]
    manager.shutdown()


def test_one_shard_behaves_as_before() -> None:
    """A channel given one client (``evictor_shards`` 1): every call goes to it."""
    cfg = TierStoreConfig(cpu_bytes_per_node=1 << 20, presence_max_age_ms=0)
    shard = IndexShard()
    keys = _prompt(1, set())
    shard.hold(keys)
    manager = TierStoreManager(cfg, NS, EvictorChannel(shard), {0: TOKENS_PER_CHUNK})
    ctx = _context("one", keys)
    manager.on_new_request(ctx)
    [manager.lookup(k, ctx) for k in keys]  # type: ignore[arg-type]
    manager.on_schedule_end(END)
    assert _settle(manager, keys, ctx) == [LookupResult.HIT] * CHUNKS
    assert shard.calls_of("/one", "lookup") == [tuple(keys)]
    manager.shutdown()
