"""Kill the Evictor: it comes back and rebuilds its index from the NodeStores."""

from __future__ import annotations

import ray
from tierstore.actors.bootstrap import find_node_store, get_or_create_evictor
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.support import poll, wait_for
from tests.vllm.test_worker_roundtrip import NS, _drain, _keys, _kv, _load_spec, _lookup, _worker
from tierstore.config import TierStoreConfig
from tierstore.errors import ClusterUnavailableError, TierStoreError
from tierstore.vllm.transfer_specs import StoreSpec
from tierstore.wire import LookupState


def test_killed_evictor_restarts_and_reindexes_every_chunk(cfg: TierStoreConfig) -> None:
    worker = _worker(cfg, _kv())
    keys = _keys(5, 0)
    for i, key in enumerate(keys):
        src = GPULoadStoreSpec([1, 2], group_sizes=[2, 0], block_indices=[0, 0])
        worker.submit_store(i, src, StoreSpec(NS, (key,)))
    assert len(_drain(worker, len(keys))) == len(keys)
    evictor = get_or_create_evictor(cfg)
    assert ray.get(evictor.status.remote())["chunks"] == 5

    ray.kill(evictor, no_restart=False)

    # Wait until the restarted Evictor answers HITs again. Ray may deliver the kill more
    # than once (a second restart, seen under load): each incarnation rebuilds the index
    # from the NodeStores within one reconcile period, so only the end state matters.
    def states() -> list[LookupState]:
        try:
            return _lookup(cfg, keys, ttl=1.0)
        except (ray.exceptions.RayError, TierStoreError):  # unavailable while it restarts
            return []

    found = poll(states, 90, poll_s=0.2, done=lambda s: s == [LookupState.HIT] * 5)
    assert found == [LookupState.HIT] * 5, "the restarted Evictor did not rebuild its index"

    def indexed() -> int:  # a second delivery of the kill may restart it once more
        try:
            return ray.get(evictor.status.remote(), timeout=10)["chunks"]
        except ray.exceptions.RayError:
            return 0

    wait_for(lambda: indexed() == 5, "all 5 chunks indexed after the restart", timeout_s=90)
    _load_spec(cfg, keys)  # and they load


def test_a_killed_node_store_is_replaced_and_its_memory_chunks_become_misses(
    cfg: TierStoreConfig,
) -> None:
    """Its memory died with it: lookups must miss (a HIT would fail its load and stop the
    engine), and the new NodeStore takes stores again."""
    worker = _worker(cfg, _kv())
    keys = _keys(3, 0)
    src = GPULoadStoreSpec([1, 2, 3, 4, 5, 6], group_sizes=[6, 0], block_indices=[0, 0])
    worker.submit_store(1, src, StoreSpec(NS, tuple(keys)))
    assert _drain(worker, 1) == [1]
    assert _lookup(cfg, keys) == [LookupState.HIT] * 3
    node = ray.get_runtime_context().get_node_id()
    ray.kill(find_node_store(cfg.namespace, node))

    def replaced() -> bool:  # the Evictor's reconcile (every 2 s) places a new one
        try:
            ray.get(find_node_store(cfg.namespace, node).status.remote(), timeout=5)
            return True
        except (ClusterUnavailableError, ray.exceptions.RayError):
            return False

    wait_for(replaced, "a new NodeStore on the node", timeout_s=30)
    assert _lookup(cfg, keys) == [LookupState.MISS] * 3
    # The same worker stores again: its first job may still meet the dead NodeStore (a
    # lost store, counted), after which it looks the node's NodeStore up afresh.
    for job in (2, 3):
        worker.submit_store(job, src, StoreSpec(NS, tuple(keys)))
        assert _drain(worker, 1) == [job]
    assert worker.failed_stores <= 1
    _load_spec(cfg, keys)
