"""The scheduler-side manager against a real Evictor: never blocks, leases back its HITs."""

from __future__ import annotations

import time

import ray
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from actors.bootstrap import get_or_create_evictor
from actors.evictor import Evictor
from tierstore.config import TierStoreConfig
from tierstore.control.index import ShardOffer
from tierstore.keys import ChunkKey, Namespace
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.manager import TierStoreManager
from tierstore.vllm.transfer_specs import LoadSpec

NS = Namespace("manager-test")
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
SCHEDULER_CALL_BUDGET_S = 0.005  # far below one Ray round trip under load


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + (0).to_bytes(4, "big"))


def _settle(manager: TierStoreManager, key: ChunkKey, ctx: ReqContext) -> LookupResult:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        result = manager.lookup(key, ctx)
        if result is not LookupResult.RETRY:
            return result
        time.sleep(0.005)
    raise AssertionError("lookup never resolved")


def test_lookup_answers_retry_then_hit_and_leases_until_complete_load(cfg: TierStoreConfig) -> None:
    evictor = get_or_create_evictor(cfg)
    node = ray.get_runtime_context().get_node_id()
    ray.get(evictor.register_node.remote(node, 1000))
    ray.get(evictor.admit.remote(node, [ShardOffer(NS, _key(1), 0, 1, 100)]))
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
    time.sleep(0.2)  # the lease extension is one-way; let it land
    assert ray.get(evictor.status.remote())["totals"]["hits"] == 1
    # Leased: the chunk cannot be evicted to make room.
    accepted, _ = ray.get(evictor.admit.remote(node, [ShardOffer(NS, _key(3), 0, 1, 950)]))
    assert accepted == [False]
    manager.complete_load([_key(1)], ctx)
    manager.on_request_finished(ctx)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        accepted, _ = ray.get(evictor.admit.remote(node, [ShardOffer(NS, _key(3), 0, 1, 950)]))
        if accepted == [True]:
            break
        time.sleep(0.05)
    assert accepted == [True]
    assert ray.get(evictor.status.remote())["totals"]["loaded_chunks"] == 1
    manager.shutdown()


class _SlowEvictor(Evictor):
    """The real Evictor, made to answer lookups slowly."""

    def lookup(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(2.0)
        return super().lookup(*args, **kwargs)


def test_scheduler_calls_do_not_wait_for_a_slow_evictor(cfg: TierStoreConfig) -> None:
    slow = ray.remote(_SlowEvictor).options(num_cpus=0).remote(cfg)
    manager = TierStoreManager(cfg, NS, EvictorChannel(slow))
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
    manager = TierStoreManager(cfg, NS, EvictorChannel(get_or_create_evictor(cfg)))
    ctx = ReqContext(req_id="r3")
    first = manager.prepare_store([_key(1), _key(2)], ctx)
    assert first.keys_to_store == [_key(1), _key(2)]
    assert manager.prepare_store([_key(1), _key(3)], ctx).keys_to_store == [_key(3)]
    manager.complete_store({_key(1), _key(2)}, ctx)
    assert manager.prepare_store([_key(1), _key(2), _key(4)], ctx).keys_to_store == [_key(4)]
    manager.shutdown()
