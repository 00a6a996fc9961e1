"""``tierstore:disk_write_failures``: what NodeStores report of failed disk writes reaches
the Evictor's totals, and the scheduler's metrics from there, as a declared gauge."""

from __future__ import annotations

import ray
from tierstore.actors.bootstrap import get_or_create_evictor
from tierstore.actors.clients import EvictorClient
from vllm.v1.kv_offload.base import ScheduleEndContext

from tests.support import wait_for
from tierstore.config import TierStoreConfig
from tierstore.control.index import ShardOffer
from tierstore.keys import ChunkKey, Namespace, ShardId, TierName
from tierstore.spec import TierStoreSpec
from tierstore.vllm import metrics
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.vllm.manager import TierStoreManager

NS = Namespace("disk-metrics-test")
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def test_failed_disk_writes_reach_the_evictors_totals_and_the_metrics(
    cfg: TierStoreConfig,
) -> None:
    evictor = EvictorClient(get_or_create_evictor(cfg))
    node = ray.get_runtime_context().get_node_id()
    evictor.register_node(node, 1000, 1000).result()
    key = ChunkKey(bytes(12))
    evictor.admit(node, [ShardOffer(NS, key, 0, 1, 100)]).result()  # written through
    # The NodeStore's report: its write failed, the shard is in memory only, the tier is
    # degraded; then a retry that failed too.
    evictor.report_disk_writes(node, [ShardId(NS, key, 0)], 1, False).result()
    evictor.report_disk_writes(node, [], 1, False).result()
    assert evictor.status().result()["totals"]["disk_write_failures"] == 2
    held = evictor.index_view(node).result()
    assert (ShardId(NS, key, 0), TierName.CPU) in held
    assert (ShardId(NS, key, 0), TierName.DISK) not in held

    manager = TierStoreManager(cfg, NS, EvictorChannel(evictor))
    payloads = []

    def gauge() -> float | None:
        manager.on_schedule_end(END)  # polls the Evictor's status, at most once a second
        stats = manager.get_stats()
        if stats is not None:
            payloads.append(stats.data["data"])
        found = [
            p[metrics.DISK_WRITE_FAILURES] for p in payloads if metrics.DISK_WRITE_FAILURES in p
        ]
        return found[-1][()] if found else None

    assert wait_for(gauge, "the disk write failures gauge", 30) == 2
    declared = TierStoreSpec.build_metric_definitions({})
    assert metrics.DISK_WRITE_FAILURES == "tierstore:disk_write_failures"
    assert declared[metrics.DISK_WRITE_FAILURES].labelnames == ()
    manager.shutdown()
