"""A slow Evictor costs a request at most ``lookup_timeout_ms``: the lookup then answers
MISS, the timeout is counted, and the late answer's lease is given back."""

from __future__ import annotations

import dataclasses
import time

import ray
from tierstore.actors.clients import EvictorClient
from tierstore.actors.evictor import Evictor
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from tests.support import wait_for
from tierstore.config import TierStoreConfig
from tierstore.control.index import ShardOffer
from tierstore.keys import ChunkKey, Namespace
from tierstore.vllm import metrics
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.manager import TierStoreManager

NS = Namespace("deadline-test")
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_EVICTOR_DELAY_S = 1.5
_TIMEOUT_MS = 100.0


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + (0).to_bytes(4, "big"))


class _SlowEvictor(Evictor):
    """The real Evictor, answering lookups only after ``_EVICTOR_DELAY_S``."""

    def lookup(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(_EVICTOR_DELAY_S)
        return super().lookup(*args, **kwargs)


def test_a_late_answer_is_a_counted_miss_and_its_lease_is_given_back(
    cfg: TierStoreConfig,
) -> None:
    # A lone Evictor started here: one shard.
    cfg = dataclasses.replace(cfg, lookup_timeout_ms=_TIMEOUT_MS, evictor_shards=1)
    handle = ray.remote(_SlowEvictor).options(num_cpus=0).remote(cfg)
    slow = EvictorClient(handle)
    node = ray.get_runtime_context().get_node_id()
    slow.register_node(node, 1000).result()
    slow.admit(node, [ShardOffer(NS, _key(1), 0, 1, 100)]).result()
    manager = TierStoreManager(cfg, NS, EvictorChannel(slow))
    ctx = ReqContext(req_id="late")
    manager.on_new_request(ctx)

    asked = time.monotonic()
    assert manager.lookup(_key(1), ctx) is LookupResult.RETRY
    manager.on_schedule_end(END)
    result = wait_for(
        lambda: manager.lookup(_key(1), ctx) is LookupResult.MISS and LookupResult.MISS,
        "the lookup giving up",
        timeout_s=_EVICTOR_DELAY_S,  # well before the Evictor answers
    )
    waited = time.monotonic() - asked
    assert result is LookupResult.MISS and waited < _EVICTOR_DELAY_S
    assert not manager.has_pending_work()  # nothing left for the engine to wait on
    assert manager.get_stats().data["data"][metrics.LOOKUP_TIMEOUTS] == {(): 1}

    # The Evictor did grant a lease (its answer was a HIT); the manager gives it back
    # once the answer lands, so the chunk is evictable again: a store that needs its
    # room is accepted.
    def room_made() -> bool:
        accepted, _ = slow.admit(node, [ShardOffer(NS, _key(2), 0, 1, 950)]).result()
        return accepted == [True]

    wait_for(room_made, "the late HIT's lease released", timeout_s=10 * _EVICTOR_DELAY_S)
    assert slow.status().result()["totals"]["hits"] == 1  # it was a HIT, given up
    manager.shutdown()
    ray.kill(handle)
