"""The scheduler-side manager against a real Evictor: never blocks, leases back its HITs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import ray
from tierstore.actors.bootstrap import get_or_create_evictor
from tierstore.actors.clients import EvictorClient
from tierstore.actors.evictor import Evictor
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
)

from tests.support import poll, wait_for
from tierstore.config import TierStoreConfig
from tierstore.control.index import ShardOffer
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.spec import TierStoreSpec
from tierstore.vllm import metrics
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.manager import TierStoreManager
from tierstore.vllm.transfer_specs import LoadSpec

NS = Namespace("manager-test")
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
SCHEDULER_CALL_BUDGET_S = 0.005  # far below one Ray round trip under load


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + (0).to_bytes(4, "big"))


def _evictor_holding(cfg: TierStoreConfig, *keys: ChunkKey) -> tuple[EvictorClient, str]:
    """The real Evictor, this node registered with 1,000 bytes, ``keys`` admitted (100 B)."""
    evictor = EvictorClient(get_or_create_evictor(cfg))
    node = ray.get_runtime_context().get_node_id()
    evictor.register_node(node, 1000).result()
    if keys:
        evictor.admit(node, [ShardOffer(NS, k, 0, 1, 100) for k in keys]).result()
    return evictor, node


def _settle(manager: TierStoreManager, key: ChunkKey, ctx: ReqContext) -> LookupResult:
    """Ask ``key`` every 5 ms until it is no longer RETRY, ending a scheduler step after
    each ask as vLLM does: a re-ask queued by a late answer is sent with the next step."""

    def resolved() -> LookupResult | None:
        result = manager.lookup(key, ctx)
        if result is LookupResult.RETRY:
            manager.on_schedule_end(END)
            return None
        return result

    return wait_for(resolved, "the lookup resolved", 10, poll_s=0.005)


def test_lookup_answers_retry_then_hit_and_leases_until_complete_load(cfg: TierStoreConfig) -> None:
    evictor, node = _evictor_holding(cfg, _key(1))
    manager = TierStoreManager(cfg, NS, EvictorChannel(evictor))
    ctx = ReqContext(req_id="r1")
    manager.on_new_request(ctx)

    assert manager.lookup(_key(1), ctx) is LookupResult.RETRY
    assert manager.lookup(_key(2), ctx) is LookupResult.RETRY
    manager.on_schedule_end(END)
    assert _settle(manager, _key(1), ctx) is LookupResult.HIT
    assert _settle(manager, _key(2), ctx) is LookupResult.MISS

    spec = manager.prepare_load([_key(1)], ctx)
    assert isinstance(spec, LoadSpec) and spec.keys == (_key(1),) and spec.nodes == (node,)
    # The lease extension is one-way; the HIT was counted (and leased) by the lookup.
    hits = poll(lambda: evictor.status().result()["totals"]["hits"], 10, done=lambda n: n)
    assert hits == 1
    # Leased: the chunk cannot be evicted to make room.
    accepted, _ = evictor.admit(node, [ShardOffer(NS, _key(3), 0, 1, 950)]).result()
    assert accepted == [False]
    manager.complete_load([_key(1)], ctx)
    manager.on_request_finished(ctx)
    accepted = poll(
        lambda: evictor.admit(node, [ShardOffer(NS, _key(3), 0, 1, 950)]).result()[0],
        5,
        done=lambda a: a == [True],
    )
    assert accepted == [True]
    assert evictor.status().result()["totals"]["loaded_chunks"] == 1
    manager.shutdown()


class _SlowEvictor(Evictor):
    """The real Evictor, made to answer lookups slowly."""

    def lookup(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(2.0)
        return super().lookup(*args, **kwargs)


def test_scheduler_calls_do_not_wait_for_a_slow_evictor(cfg: TierStoreConfig) -> None:
    # RETRY throughout; a lone Evictor started here: one shard.
    cfg = dataclasses.replace(cfg, lookup_timeout_ms=60_000.0, evictor_shards=1)
    slow = ray.remote(_SlowEvictor).options(num_cpus=0).remote(cfg)
    manager = TierStoreManager(cfg, NS, EvictorChannel(EvictorClient(slow)))
    ctx = ReqContext(req_id="r2")
    manager.on_new_request(ctx)
    worst = 0.0
    for step in range(20):
        started = time.perf_counter()
        for i in range(50):
            assert manager.lookup(_key(i), ctx) is LookupResult.RETRY
        manager.on_schedule_end(END)
        manager.prepare_store([_key(100 + step)], ctx)
        worst = max(worst, time.perf_counter() - started)
    assert worst < SCHEDULER_CALL_BUDGET_S * 50
    assert manager.has_pending_work()
    manager.shutdown()
    ray.kill(slow)


def test_prepare_store_skips_keys_stored_or_in_flight(cfg: TierStoreConfig) -> None:
    manager = TierStoreManager(cfg, NS, EvictorChannel(EvictorClient(get_or_create_evictor(cfg))))
    ctx = ReqContext(req_id="r3")
    first = manager.prepare_store([_key(1), _key(2)], ctx)
    assert first.keys_to_store == [_key(1), _key(2)]
    assert manager.prepare_store([_key(1), _key(3)], ctx).keys_to_store == [_key(3)]
    manager.complete_store({_key(1), _key(2)}, ctx)
    assert manager.prepare_store([_key(1), _key(2), _key(4)], ctx).keys_to_store == [_key(4)]
    manager.shutdown()


_WAIT_S = 10.0


def test_a_key_just_stored_is_asked_again_until_its_commit_is_indexed(
    cfg: TierStoreConfig,
) -> None:
    """A worker reports a store done before its commit reaches the Evictor: a lookup in
    between must not settle as a MISS (the prefix would be recomputed and stored again),
    but wait for the index, within the lookup deadline; a key never stored is a MISS."""
    evictor, node = _evictor_holding(cfg)
    patient = dataclasses.replace(cfg, lookup_timeout_ms=30_000.0)
    manager = TierStoreManager(patient, NS, EvictorChannel(evictor))
    writer, reader = ReqContext(req_id="writer"), ReqContext(req_id="reader")
    manager.on_new_request(writer)
    manager.prepare_store([_key(1)], writer)
    manager.complete_store([_key(1)], writer)  # reported done; not committed yet
    manager.on_new_request(reader)
    assert manager.lookup(_key(1), reader) is LookupResult.RETRY
    assert manager.lookup(_key(2), reader) is LookupResult.RETRY
    manager.on_schedule_end(END)
    assert _settle(manager, _key(2), reader) is LookupResult.MISS
    # The Evictor answered MISS for key 1 as well: still RETRY, asked again.
    for _ in range(5):
        time.sleep(0.01)
        assert manager.lookup(_key(1), reader) is LookupResult.RETRY
        manager.on_schedule_end(END)
    evictor.admit(node, [ShardOffer(NS, _key(1), 0, 1, 100)]).result()  # the commit lands
    assert _settle(manager, _key(1), reader) is LookupResult.HIT
    manager.shutdown()

    # A commit that never lands (failed, refused) costs at most the lookup deadline.
    manager = TierStoreManager(cfg, NS, EvictorChannel(evictor))
    manager.on_new_request(writer)
    manager.prepare_store([_key(3)], writer)
    manager.complete_store([_key(3)], writer)
    manager.on_new_request(reader)
    assert manager.lookup(_key(3), reader) is LookupResult.RETRY
    manager.on_schedule_end(END)
    assert _settle(manager, _key(3), reader) is LookupResult.MISS
    manager.shutdown()


def test_stats_count_hits_by_tier_and_use_only_declared_metrics(cfg: TierStoreConfig) -> None:
    evictor, node = _evictor_holding(cfg, _key(1))
    manager = TierStoreManager(cfg, NS, EvictorChannel(evictor))
    ctx = ReqContext(req_id="r4")
    manager.on_new_request(ctx)
    for key in (_key(1), _key(2)):
        manager.lookup(key, ctx)
    manager.on_schedule_end(END)
    assert _settle(manager, _key(1), ctx) is LookupResult.HIT
    assert _settle(manager, _key(2), ctx) is LookupResult.MISS
    manager.prepare_load([_key(1)], ctx)
    manager.complete_load([_key(1)], ctx)

    values = manager.get_stats().data["data"]
    assert values[metrics.LOOKUP_HITS] == {("cpu",): 1}
    assert values[metrics.LOOKUP_MISSES] == {(): 1}
    assert values[metrics.LOADED_CHUNKS] == {("cpu",): 1}
    assert len(values[metrics.LOAD_LATENCY][()]) == 1
    payloads = [values]

    def tier_gauges() -> dict | None:  # type: ignore[type-arg]
        manager.on_schedule_end(END)  # polls the Evictor's status, at most once a second
        stats = manager.get_stats()
        if stats is not None:
            payloads.append(stats.data["data"])
        return next((p[metrics.TIER_USED] for p in payloads if metrics.TIER_USED in p), None)

    assert wait_for(tier_gauges, "the Evictor's status", _WAIT_S)[(node[:12], "cpu")] == 100
    # Taken counters are not sent twice.
    assert all(metrics.LOOKUP_HITS not in p for p in payloads[1:])
    # vLLM's API server asserts that every emitted name was declared, with its labels.
    declared = TierStoreSpec.build_metric_definitions({})
    for payload in payloads:
        for name, by_labels in payload.items():
            assert name in declared
            assert all(len(labels) == len(declared[name].labelnames) for labels in by_labels)
    manager.shutdown()


def _events_of(m: TierStoreManager) -> list[OffloadingEvent]:
    m.on_schedule_end(END)  # polls the Evictor
    time.sleep(0.1)
    return list(m.take_events())


def _events_until(m: TierStoreManager, done: Callable[[list[OffloadingEvent]], bool]):  # type: ignore[no-untyped-def]
    seen: list[OffloadingEvent] = []

    def more() -> bool:
        seen.extend(_events_of(m))
        return done(seen)

    wait_for(more, "KV events", _WAIT_S)
    return seen


def test_kv_events_report_stores_and_evictions_with_medium_and_locality(
    cfg: TierStoreConfig,
) -> None:
    evictor, node = _evictor_holding(cfg)
    manager = TierStoreManager(
        cfg, NS, EvictorChannel(evictor), local_node=NodeId(node), events_enabled=True
    )
    other = TierStoreManager(
        cfg, NS, EvictorChannel(evictor), local_node=NodeId("elsewhere"), events_enabled=True
    )
    assert _events_of(manager) == _events_of(other) == []  # nothing held yet
    evictor.admit(node, [ShardOffer(NS, _key(1), 0, 1, 600)]).result()
    # A different namespace's chunks are never announced to this engine.
    evictor.admit(node, [ShardOffer(Namespace("other"), _key(9), 0, 1, 10)]).result()
    # No room for both: key 1 is dropped (this node has no disk tier).
    evictor.admit(node, [ShardOffer(NS, _key(3), 0, 1, 600)]).result()

    seen = _events_until(manager, lambda seen: any(e.removed for e in seen))
    stored = [(e.keys, e.medium) for e in seen if not e.removed]
    removed = [(e.keys, e.medium) for e in seen if e.removed]
    assert stored == [([_key(1)], Medium.CPU), ([_key(3)], Medium.CPU)]
    assert ([_key(1)], Medium.CPU) in removed
    assert all(e.locality is Locality.LOCAL for e in seen)
    remote = _events_until(other, lambda seen: len(seen) >= 3)
    assert all(e.locality is Locality.REMOTE for e in remote)
    # An engine that starts now hears what is held now, not the history before it.
    late = TierStoreManager(
        cfg, NS, EvictorChannel(evictor), local_node=NodeId(node), events_enabled=True
    )
    first = _events_until(late, bool)
    assert [(e.keys, e.medium, e.removed) for e in first] == [([_key(3)], Medium.CPU, False)]
    for m in (manager, other, late):
        m.shutdown()


def test_a_request_loads_only_from_the_tiers_it_allows(cfg: TierStoreConfig) -> None:
    """vLLM's per-request ``kv_load_tiers`` (medium and locality) filters HITs."""
    evictor, node = _evictor_holding(cfg, _key(1))
    local_only = TierFilter((TierMatcher(Medium.CPU, Locality.LOCAL),))
    remote_only = TierFilter((TierMatcher(locality=Locality.REMOTE),))
    manager = TierStoreManager(cfg, NS, EvictorChannel(evictor), local_node=NodeId(node))
    results = {}
    for name, tier_filter in [("local", local_only), ("remote", remote_only)]:
        ctx = ReqContext(req_id=name, load_tier_filter=tier_filter)
        manager.on_new_request(ctx)
        manager.lookup(_key(1), ctx)
        manager.on_schedule_end(END)
        results[name] = _settle(manager, _key(1), ctx)
    assert results == {"local": LookupResult.HIT, "remote": LookupResult.MISS}
    manager.shutdown()


def test_hits_read_straight_from_disk_count_as_storage(cfg: TierStoreConfig) -> None:
    """A prompt larger than the CPU tier: its head is on disk, with no CPU room to
    promote it (its own chunks hold the room), so those HITs are read from disk. They
    count as the disk tier, and a request that loads only from CPU computes them."""
    evictor = EvictorClient(get_or_create_evictor(cfg))
    node = ray.get_runtime_context().get_node_id()
    evictor.register_node(node, 200, 10_000).result()
    keys = [_key(i) for i in range(4)]
    parents = [None, *keys[:-1]]
    offers = [ShardOffer(NS, k, 0, 1, 100, p) for k, p in zip(keys, parents, strict=True)]
    assert evictor.admit(node, offers).result()[0] == [True] * 4  # two demoted on admission
    manager = TierStoreManager(cfg, NS, EvictorChannel(evictor), local_node=NodeId(node))
    results = {}
    cpu_only = TierFilter((TierMatcher(Medium.CPU),))
    for name, tier_filter in [("all", TierFilter.ALL), ("cpu", cpu_only)]:
        ctx = ReqContext(req_id=name, load_tier_filter=tier_filter)
        manager.on_new_request(ctx)
        for key in keys:
            manager.lookup(key, ctx)
        manager.on_schedule_end(END)
        results[name] = [_settle(manager, key, ctx) for key in keys]
    hit, miss = LookupResult.HIT, LookupResult.MISS
    assert results == {"all": [hit] * 4, "cpu": [miss, miss, hit, hit]}
    assert manager.get_stats().data["data"][metrics.LOOKUP_HITS] == {("disk",): 4, ("cpu",): 4}
    manager.shutdown()


def _wait_for_fresh_snapshot(manager: TierStoreManager) -> None:
    def fresh_miss() -> bool:
        manager.on_schedule_end(END)  # polls: the snapshot, then its events
        time.sleep(0.01)
        probe = ReqContext(req_id=f"probe-{time.monotonic()}")
        manager.on_new_request(probe)
        return manager.lookup(_key(77), probe) is LookupResult.MISS

    wait_for(fresh_miss, "a MISS from the presence snapshot", _WAIT_S)


def _viewing(
    cfg: TierStoreConfig, evictor: EvictorClient, node: str, ranks: int = 1
) -> TierStoreManager:
    """A manager on ``node`` answering HITs from its cluster view for ``ranks`` ranks
    (as after a failed load), its view fresh."""
    manager = TierStoreManager(cfg, NS, EvictorChannel(evictor), local_node=NodeId(node))
    manager.answer_hits_from_picture(ranks)
    _wait_for_fresh_snapshot(manager)
    return manager


def test_a_key_held_nowhere_is_a_miss_at_once_while_the_snapshot_is_fresh(
    cfg: TierStoreConfig,
) -> None:
    """No Evictor round trip (and no scheduler step) for a key the cluster does not hold;
    a held key, and one another engine stored since, are still asked and HIT."""
    evictor, node = _evictor_holding(cfg, _key(1))
    manager = TierStoreManager(cfg, NS, EvictorChannel(evictor))
    ctx = ReqContext(req_id="r1")
    manager.on_new_request(ctx)
    assert manager.lookup(_key(2), ctx) is LookupResult.RETRY  # no snapshot yet: asked

    _wait_for_fresh_snapshot(manager)
    assert manager.lookup(_key(5), ctx) is LookupResult.MISS  # at once, never RETRY
    assert manager.lookup(_key(1), ctx) is LookupResult.RETRY  # held: asked
    assert _settle(manager, _key(1), ctx) is LookupResult.HIT

    evictor.admit(node, [ShardOffer(NS, _key(8), 0, 1, 100)]).result()  # another engine
    for _ in range(30):  # steps for 0.3 s: the snapshot catches up within its age
        manager.on_schedule_end(END)
        time.sleep(0.01)
    late = ReqContext(req_id="late")
    manager.on_new_request(late)
    assert manager.lookup(_key(8), late) is LookupResult.RETRY
    assert _settle(manager, _key(8), late) is LookupResult.HIT

    time.sleep(cfg.presence_max_age_ms / 1000 + 0.05)  # no steps: the snapshot went stale
    idle = ReqContext(req_id="idle")
    manager.on_new_request(idle)
    assert manager.lookup(_key(9), idle) is LookupResult.RETRY
    manager.shutdown()

    off = TierStoreManager(
        dataclasses.replace(cfg, presence_max_age_ms=0), NS, EvictorChannel(evictor)
    )
    for _ in range(5):
        off.on_schedule_end(END)
        time.sleep(0.02)
    off.on_new_request(ctx)
    assert off.lookup(_key(5), ctx) is LookupResult.RETRY  # every key asked
    off.shutdown()


def test_a_chunk_the_snapshot_shows_in_memory_here_is_a_hit_with_no_evictor_call(
    cfg: TierStoreConfig,
) -> None:
    """Under answer_hits_from_picture (a failed load recomputes), a chunk the fresh snapshot
    shows in this node's memory is a HIT with no RETRY step and no Evictor call in the step:
    not leased, loadable from this node by every rank. Once loaded, the next step reports
    it (the Evictor counts the hit and the load). One the Evictor lost after the snapshot
    (a lost race) is a HIT all the same; its load fails, and the request's next lookups
    are MISS (it recomputes) and its chunks may be stored again."""
    cfg = dataclasses.replace(cfg, presence_max_age_ms=20_000.0)  # no events poll meanwhile
    evictor, node = _evictor_holding(cfg, _key(1), _key(2))
    manager = _viewing(cfg, evictor, node, ranks=2)

    def totals() -> dict[str, int]:
        return evictor.status().result()["totals"]

    ctx = ReqContext(req_id="r1")
    manager.on_new_request(ctx)
    assert manager.lookup(_key(1), ctx) is LookupResult.HIT  # no RETRY step
    spec = manager.prepare_load([_key(1)], ctx)
    assert spec.keys == (_key(1),)  # the worker looks the whole key up
    assert spec.nodes == (node,) and spec.locations == ((0, 0),)
    manager.on_schedule_end(END)
    assert totals()["hits"] == 0  # nothing asked in the step
    manager.complete_load([_key(1)], ctx)
    manager.on_schedule_end(END)  # the load's step: not reported yet
    manager.on_schedule_end(END)  # the next: reported
    reported = poll(totals, _WAIT_S, done=lambda t: t["loaded_chunks"])
    assert reported["hits"] == 1 and reported["loaded_chunks"] == 1
    manager.on_request_finished(ctx)

    # Key 2 goes (evicted for key 4's room) after the snapshot's last poll.
    accepted, _ = evictor.admit(node, [ShardOffer(NS, _key(4), 0, 1, 850)]).result()
    assert accepted == [True]
    late = ReqContext(req_id="late")
    manager.on_new_request(late)
    assert manager.lookup(_key(2), late) is LookupResult.HIT  # the snapshot's word
    manager.prepare_load([_key(2)], late)
    manager.on_load_failed("late")  # the worker found no key 2: the load failed
    manager.complete_load([_key(2)], late)
    assert manager.lookup(_key(2), late) is LookupResult.MISS  # recomputed
    assert manager.prepare_store([_key(2)], late).keys_to_store == [_key(2)]
    manager.on_request_finished(late)
    counters = manager.get_stats().data["data"]
    assert counters[metrics.VIEW_HITS] == {(): 2}
    assert counters[metrics.LOOKUP_HITS] == {("cpu",): 2}  # each HIT counted once
    assert counters[metrics.FAILED_LOADS] == {(): 1}
    assert poll(totals, 1.0, done=lambda t: t["loaded_chunks"] > 1)["loaded_chunks"] == 1
    manager.shutdown()

    off = _viewing(dataclasses.replace(cfg, hits_from_picture=False), evictor, node)
    off.on_new_request(ctx)
    assert off.lookup(_key(1), ctx) is LookupResult.RETRY  # asked first, as before
    off.shutdown()


def test_a_chunk_the_snapshot_shows_only_on_another_node_is_leased_in_the_same_step(
    cfg: TierStoreConfig,
) -> None:
    """A view hit on another node is a HIT at once too, with pulls at lookup or without:
    its lookup goes out at the end of the same step, and the lease keeps the chunk (its
    load joins or starts this node's pull: tests/data/test_pulls.py)."""
    cfg = dataclasses.replace(cfg, presence_max_age_ms=20_000.0)
    assert cfg.pulls_per_node
    evictor, node = _evictor_holding(cfg)
    other = "other-node"
    evictor.register_node(other, 1000).result()
    key = _key(5)
    evictor.admit(other, [ShardOffer(NS, key, 0, 1, 100)]).result()
    for pulls in (cfg.pulls_per_node, 0):
        manager = _viewing(dataclasses.replace(cfg, pulls_per_node=pulls), evictor, node)
        ctx = ReqContext(req_id=f"remote-{pulls}")
        manager.on_new_request(ctx)
        hits_before = evictor.status().result()["totals"]["hits"]
        assert manager.lookup(key, ctx) is LookupResult.HIT
        assert manager.prepare_load([key], ctx).nodes == (other,)
        manager.on_schedule_end(END)  # the step's asks go out
        hits = poll(
            lambda before=hits_before: evictor.status().result()["totals"]["hits"] - before,
            _WAIT_S,
            done=lambda n: n,
        )
        assert hits == 1
        accepted, _ = evictor.admit(other, [ShardOffer(NS, _key(6), 0, 1, 950)]).result()
        assert accepted == [False]  # leased: not evicted for room
        manager.complete_load([key], ctx)
        manager.on_request_finished(ctx)
        manager.shutdown()


def test_a_chunk_this_engine_just_stored_is_a_hit_at_once_from_its_node(
    cfg: TierStoreConfig,
) -> None:
    """A worker's commit may reach the Evictor after the snapshot's last poll: a chunk this
    engine stored within the commit grace that no fresh snapshot shows is a HIT at once,
    from this node (the worker waits for its own commit). One the snapshot shows on disk
    only is asked (its lookup starts the promotion); one stored longer ago is what the
    snapshot says (here: held nowhere, a MISS)."""
    cfg = dataclasses.replace(cfg, presence_max_age_ms=20_000.0)  # no events poll meanwhile
    evictor = EvictorClient(get_or_create_evictor(cfg))
    node = ray.get_runtime_context().get_node_id()
    evictor.register_node(node, 1000, 10_000).result()
    evictor.admit(node, [ShardOffer(NS, _key(2), 0, 1, 100)]).result()  # and on disk
    evictor.admit(node, [ShardOffer(NS, _key(3), 0, 1, 950)]).result()  # key 2: disk only
    manager = _viewing(cfg, evictor, node)
    writer, reader = ReqContext(req_id="writer"), ReqContext(req_id="reader")
    manager.on_new_request(writer)
    stored = [_key(1), _key(2), _key(4)]
    manager.prepare_store(stored, writer)
    manager.complete_store(stored, writer)  # copied; not committed (key 1 and 4)
    manager.on_new_request(reader)
    assert manager.lookup(_key(1), reader) is LookupResult.HIT  # no RETRY step
    assert manager.prepare_load([_key(1)], reader).nodes == (node,)
    assert manager.lookup(_key(2), reader) is LookupResult.RETRY  # the snapshot knows better
    time.sleep(1.05)  # past the commit grace: the commit would be in the snapshot by now
    assert manager.lookup(_key(4), reader) is LookupResult.MISS
    assert manager.get_stats().data["data"][metrics.VIEW_HITS] == {(): 1}
    manager.shutdown()
