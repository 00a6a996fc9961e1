"""What a worker's arena path does when a call to its NodeStore fails (real Ray, real
NodeStore, real mapping): a give-back that did not reach the NodeStore is warned of,
counted and sent again, so its extents do not stay granted while the worker lives; a
pin that fails falls back to the object store, at INFO when the NodeStore refused it on
purpose, at WARNING with its traceback (and counted) when it is a bug."""

from __future__ import annotations

import logging

import pytest
import ray
import torch
from tierstore.actors.clients import NodeStoreClient

from tests.support import poll
from tests.vllm.test_worker_arena import DST, _node_store, _pool_ready, _store
from tests.vllm.test_worker_roundtrip import NS, _drain, _keys, _kv, _load_spec, _worker
from tierstore.config import TierStoreConfig
from tierstore.keys import NodeId
from tierstore.vllm.transfer_specs import LoadSpec
from tierstore.vllm.worker_arena import WorkerArena

_SIZES = [4096] * 4


@ray.remote(num_cpus=0)
class _GoneNodeStore:
    """Stands in for a NodeStore that went away: killed before it is called."""

    def arena_give_back(self, holder: str, epoch: str, offsets: list[int]) -> None:
        pass


def _granted_bytes() -> int:
    return _node_store().status().result()["arena"]["granted_bytes"]


def test_a_give_back_the_node_store_did_not_get_is_warned_counted_and_sent_again(
    cfg: TierStoreConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's handle to its NodeStore fails while it gives extents back: they are
    owed, not forgotten. Once the NodeStore answers again, the next grant call returns
    them: the NodeStore's granted bytes are what the worker's pool holds, nothing more."""
    worker = _worker(cfg, _kv())  # starts the actors
    store = _node_store()
    gone_handle = _GoneNodeStore.remote()
    ray.kill(gone_handle)
    gone = NodeStoreClient(gone_handle, store.node)
    reachable = [True]
    arena = WorkerArena.connect(lambda: store if reachable[0] else gone, 10.0)
    assert arena is not None
    arena.expect(_SIZES)
    assert poll(lambda: arena.pool.held_bytes >= sum(_SIZES), 20), "no extents granted"
    offsets = arena.take(_SIZES)
    assert offsets is not None

    caplog.set_level(logging.WARNING, logger="tierstore.vllm.worker_arena")
    reachable[0] = False
    arena.give_back(offsets)
    assert poll(lambda: arena.failed_give_backs, 20) == 1
    warned = [r for r in caplog.records if "could not give 4 granted extents" in r.message]
    assert warned and warned[0].levelno == logging.WARNING and warned[0].exc_info

    reachable[0] = True
    arena.refill()  # the next grant call sends what is owed
    settled = poll(_granted_bytes, 20, done=lambda granted: granted == arena.pool.held_bytes)
    assert settled == arena.pool.held_bytes, "the extents given back are still granted"
    assert arena.failed_give_backs == 1
    arena.close()
    assert poll(_granted_bytes, 10, done=lambda granted: granted == 0) == 0
    worker.shutdown()


def test_a_pin_that_fails_unexpectedly_is_warned_counted_and_served_by_the_object_store(
    cfg: TierStoreConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """The NodeStore raises something it never raises on purpose (here: its check that
    the worker holds its lock, which the worker lost): the load is still served,
    byte-exact, through the object store, and the failure is a WARNING with its
    traceback, counted in ``pin_errors``."""
    kv = _kv()
    original = [t.clone() for t in kv]
    worker = _worker(cfg, kv)
    _store(worker, 1, 0)
    _pool_ready(worker)
    keys = _store(worker, 2, 10)
    worker.arena.read_unpinned = False  # every same-node load pins
    worker.arena._arena._lock_file.close()
    caplog.set_level(logging.INFO, logger="tierstore.vllm.arena_jobs")
    worker.submit_load(3, _load_spec(cfg, keys), DST)
    assert _drain(worker, 1) == [3]
    assert worker.arena.pin_errors == 1 and worker.arena.arena_loads == 0
    for s, d in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True):
        assert torch.equal(kv[0][d, :96], original[0][s, :96])
    assert torch.equal(kv[1][24, :200], original[1][5, :200])
    (record,) = [r for r in caplog.records if "pin failed unexpectedly" in r.message]
    assert record.levelno == logging.WARNING and record.exc_info
    assert "PermissionError" in caplog.text
    worker.shutdown()


def test_a_pin_refused_for_a_shard_not_in_memory_falls_back_at_info_uncounted(
    cfg: TierStoreConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """A load names shards on this node that its NodeStore does not hold in memory (the
    scheduler's view was stale): the pin is refused on purpose, which is no bug, so it
    is logged at INFO and not counted; the object store then finds nothing either, and
    the load is reported failed (its request recomputes)."""
    worker = _worker(cfg, _kv())
    _store(worker, 1, 0)
    _pool_ready(worker)
    worker.arena.read_unpinned = False
    node = NodeId(ray.get_runtime_context().get_node_id())
    absent = _keys(2, 0, 500) + _keys(1, 1, 500)
    caplog.set_level(logging.INFO, logger="tierstore.vllm.arena_jobs")
    worker.submit_load(3, LoadSpec.build(NS, absent, [{0: node}] * len(absent)), DST)
    worker.wait({3})
    assert [r.success for r in worker.get_finished()] == [False]
    assert worker.arena.pin_errors == 0
    (record,) = [r for r in caplog.records if "arena pin refused" in r.message]
    assert record.levelno == logging.INFO
    worker.shutdown()
