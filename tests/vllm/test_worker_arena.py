"""Stores and loads through the node's shared arena: real Ray, real NodeStore, real
shared mapping. One copy each way: gathered into granted extents and adopted by the
NodeStore; loaded straight from the extents (unpinned where the arena's directory names
them, else pinned)."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch
from tierstore.actors.bootstrap import find_node_store
from tierstore.actors.clients import NodeStoreClient
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult

from tests.actors.hooks import corrupt_in_memory
from tests.support import poll
from tests.vllm.test_worker_roundtrip import NS, _drain, _keys, _kv, _load_spec, _worker
from tierstore.config import TierStoreConfig
from tierstore.data import fused_copy
from tierstore.data.arena.generations import Generations
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.region import ArenaMapping
from tierstore.keys import NodeId, ShardId
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec
from tierstore.vllm.worker import TierStoreWorker

SRC = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[4, 1], block_indices=[0, 0])
DST = GPULoadStoreSpec([20, 21, 22, 23, 24], group_sizes=[4, 1], block_indices=[0, 0])


def _store(worker: TierStoreWorker, job: int, start: int) -> list:
    keys = _keys(2, 0, start) + _keys(1, 1, start)
    assert worker.submit_store(job, SRC, StoreSpec(NS, tuple(keys)))
    assert _drain(worker, 1) == [job]
    return keys


def _pool_ready(worker: TierStoreWorker) -> None:
    """The first store maps the arena and asks for extents in the background."""
    arena = poll(lambda: worker.arena._arena, 20)
    assert arena is not None, "the worker never mapped the node's arena"
    job_bytes = 2 * 2 * 96 + 2 * 200
    assert poll(lambda: arena.pool.held_bytes >= 2 * job_bytes, 20), "no extents granted"


def _node_store() -> NodeStoreClient:
    node = NodeId(ray.get_runtime_context().get_node_id())
    return NodeStoreClient(find_node_store("tierstore-actor-tests", node), node)


@pytest.fixture(params=["fused", "numpy"])
def scatter_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a same-node load verifies and copies: in one pass (C, jobs from
    ``fused_copy.MIN_BYTES`` on) or hash first, then copy (numpy); these jobs are small,
    so the threshold is moved to take each path."""
    if request.param == "fused" and not fused_copy.available():
        pytest.skip("the C module is not built")
    monkeypatch.setattr(fused_copy, "MIN_BYTES", 0 if request.param == "fused" else 1 << 62)
    return request.param


def test_a_store_and_a_load_go_through_the_arena_byte_exact(
    cfg: TierStoreConfig, scatter_path: str
) -> None:
    kv = _kv()
    original = [t.clone() for t in kv]
    worker = _worker(cfg, kv)
    _store(worker, 1, 0)  # maps the arena; this one may take the object store
    _pool_ready(worker)
    keys = _store(worker, 2, 10)
    assert worker.arena.arena_stores >= 1
    worker.submit_load(3, _load_spec(cfg, keys), DST)
    assert _drain(worker, 1) == [3]
    assert worker.arena.arena_loads == 1
    for s, d in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True):
        assert torch.equal(kv[0][d, :96], original[0][s, :96])
    assert torch.equal(kv[1][24, :200], original[1][5, :200])
    assert torch.equal(kv[0][20, 96:], original[0][20, 96:])  # padding untouched
    arena = _node_store().status().result()["arena"]
    assert arena["pinned_extents"] == 0 or poll(
        lambda: _node_store().status().result()["arena"]["pinned_extents"] == 0, 10
    )
    worker.shutdown()
    # Shut down: what its pool held went back to the arena.
    status = poll(
        lambda: _node_store().status().result(),
        10,
        done=lambda s: s["arena"]["granted_bytes"] == 0,
    )
    assert status["arena"]["granted_bytes"] == 0


def _loaded_exact(kv: list[torch.Tensor], original: list[torch.Tensor]) -> bool:
    """DST's blocks hold SRC's pages."""
    pages = all(
        torch.equal(kv[0][d, :96], original[0][s, :96])
        for s, d in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True)
    )
    return pages and torch.equal(kv[1][24, :200], original[1][5, :200])


def _stored_and_pool_ready(worker: TierStoreWorker) -> list:
    _store(worker, 1, 0)
    _pool_ready(worker)
    keys = _store(worker, 2, 10)
    assert worker.arena.arena_stores >= 1
    return keys


def test_a_load_of_shards_this_worker_committed_reads_them_unpinned_and_counts_them(
    cfg: TierStoreConfig,
) -> None:
    """The worker remembers where it committed each shard and the extent's generation
    then: a same-node load of them costs no round trip (no pin), is byte-exact, and the
    NodeStore still counts the shards as loaded. A small one on the host executor is
    copied at submit: done by the first ``get_finished`` after it."""
    kv = _kv()
    original = [t.clone() for t in kv]
    worker = _worker(cfg, kv)
    keys = _stored_and_pool_ready(worker)
    loaded_before = _node_store().status().result()["stats"]["loaded_shards"]
    worker.submit_load(3, _load_spec(cfg, keys), DST)
    assert [r.job_id for r in worker.get_finished() if r.success] == [3]
    assert _loaded_exact(kv, original)
    assert (worker.arena.arena_loads, worker.arena.unpinned_loads) == (1, 1)
    stats = poll(
        lambda: _node_store().status().result()["stats"],
        10,
        done=lambda s: s["loaded_shards"] == loaded_before + len(keys),
    )
    assert stats["loaded_shards"] == loaded_before + len(keys)
    assert _node_store().status().result()["arena"]["pinned_extents"] == 0
    worker.shutdown()


def test_a_load_of_chunks_whose_commit_is_on_its_way_waits_for_it_and_reads_unpinned(
    cfg: TierStoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler answers a chunk its engine just stored as a HIT at once, so a load
    may come before this worker's commit of it was answered: no pin or NodeStore could
    find it yet. The load waits for that commit, then reads the extents unpinned."""
    kv = _kv()
    original = [t.clone() for t in kv]
    worker = _worker(cfg, kv)
    _stored_and_pool_ready(worker)
    gate = threading.Event()
    commit = worker.arena.commit

    def held_commit(batch: list) -> tuple:  # the NodeStore's answer, delayed
        gate.wait(30)
        return commit(batch)

    monkeypatch.setattr(worker.arena, "commit", held_commit)
    keys = _keys(2, 0, 20) + _keys(1, 1, 20)
    assert worker.submit_store(3, SRC, StoreSpec(NS, tuple(keys)))
    assert [r.job_id for r in worker.get_finished()] == [3]  # done at the copy
    node = NodeId(ray.get_runtime_context().get_node_id())
    # As a view hit names it: this node, before the commit reached the Evictor.
    view_hit = LoadSpec.build(NS, keys, [{0: node}] * len(keys))
    worker.submit_load(4, view_hit, DST)
    time.sleep(0.3)
    assert worker.get_finished() == []  # waiting for the commit, not failed
    gate.set()
    assert _drain(worker, 1) == [4]
    assert _loaded_exact(kv, original)
    assert worker.arena.unpinned_loads == 1
    worker.shutdown()


def test_another_engine_on_the_node_loads_the_shards_unpinned_from_the_arena_directory(
    cfg: TierStoreConfig,
) -> None:
    """A worker that never saw the shards (another engine, or this one restarted) finds
    their extents in the arena's directory: its load pins nothing, makes no round trip,
    and is byte-exact."""
    kv = _kv()
    original = [t.clone() for t in kv]
    writer = _worker(cfg, kv)
    keys = _stored_and_pool_ready(writer)
    other_kv = [torch.zeros_like(t) for t in kv]
    other = _worker(cfg, other_kv)
    other.arena._ready()  # maps the arena in the background, as its first job would
    assert poll(lambda: other.arena._arena, 20) is not None
    other.submit_load(3, _load_spec(cfg, keys), DST)
    assert [r.job_id for r in other.get_finished() if r.success] == [3]  # done at submit
    assert (other.arena.arena_loads, other.arena.unpinned_loads) == (1, 1)
    for s, d in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True):
        assert torch.equal(other_kv[0][d, :96], original[0][s, :96])
    assert torch.equal(other_kv[1][24, :200], original[1][5, :200])

    # A load whose spec names another node (a remote copy the scheduler knew of) is
    # served from this node's copy all the same: no call to that node.
    for t in other_kv:
        t.zero_()
    elsewhere = LoadSpec.build(NS, keys, [{0: NodeId("f" * 56)}] * len(keys))
    other.submit_load(4, elsewhere, DST)
    assert [r.job_id for r in other.get_finished() if r.success] == [4]
    assert (other.arena.arena_loads, other.arena.unpinned_loads) == (2, 2)
    assert _loaded_exact(other_kv, original)
    other.shutdown()
    writer.shutdown()


def test_an_extent_freed_and_rewritten_during_an_unpinned_copy_is_loaded_again_pinned(
    cfg: TierStoreConfig, scatter_path: str
) -> None:
    """The seqlock's second read: while the unpinned copy runs, the shard's extent is
    freed (its generation bumped, in the shared table, as the NodeStore's free does)
    and rewritten. The copy got other bytes, so the load must not end there: it pins
    and scatters the shard again, and is reported done only with the right bytes."""
    kv = _kv()
    original = [t.clone() for t in kv]
    worker = _worker(cfg, kv)
    keys = _stored_and_pool_ready(worker)
    arena = worker.arena._arena
    hints = arena.directory.find([ShardId(NS, k, 0) for k in keys])
    assert hints is not None, "the arena's directory does not name the shards committed"
    table = Generations(ArenaMapping(arena.info).array)  # another mapping of the file
    first = hints[0]
    prepare = worker._copier.prepare_scatter
    tampered = []

    def prepare_tampered(*args, **kwargs):
        scatter = prepare(*args, **kwargs)
        copy = scatter.from_verified_extents

        def freed_and_rewritten_meanwhile(view, chunks, extents) -> bool:
            verified = copy(view, chunks, extents)  # hashed the shard's bytes, then...
            if not tampered:  # the first try, the unpinned one: ...freed and rewritten
                table.bump(first.offset)  # before the copy read it: other bytes landed
                for t in kv:
                    t[20:25] = 7
                tampered.append(True)
            return verified

        scatter.from_verified_extents = freed_and_rewritten_meanwhile
        return scatter

    worker._copier.prepare_scatter = prepare_tampered
    worker.submit_load(3, _load_spec(cfg, keys), DST)
    assert _drain(worker, 1) == [3]
    assert tampered and _loaded_exact(kv, original)
    assert (worker.arena.arena_loads, worker.arena.unpinned_loads) == (1, 0)
    # The pin wrote the directory entry again (the bumped generation): the next load
    # is unpinned.
    worker._copier.prepare_scatter = prepare
    for t in kv:
        t[20:25].zero_()
    worker.submit_load(4, _load_spec(cfg, keys), DST)
    assert _drain(worker, 1) == [4]
    assert _loaded_exact(kv, original)
    assert (worker.arena.arena_loads, worker.arena.unpinned_loads) == (2, 1)
    worker.shutdown()


def test_a_corrupt_extent_fails_the_load_and_is_never_reported_done(
    cfg: TierStoreConfig, scatter_path: str
) -> None:
    """A shard whose extent changed after its commit fails the same-node load's check
    and the object store's again: the job is reported failed (its request recomputes),
    never done. The corrupt shard's bytes may have reached its blocks (the one-pass
    verified scatter hashes each piece right after copying it), and those of the shard
    before it are the right ones."""
    kv = _kv()
    worker = _worker(cfg, kv)
    _store(worker, 1, 0)
    _pool_ready(worker)
    keys = _store(worker, 2, 10)
    assert worker.arena.arena_stores >= 1
    corrupt_in_memory(_node_store(), [ShardId(NS, keys[1], 0)])
    worker.submit_load(3, _load_spec(cfg, keys), DST)
    worker.wait({3})
    assert worker.get_finished() == [TransferResult(3, False)]
    assert worker.arena.arena_rejected == 1 and worker.arena.arena_loads == 0
    stats = _node_store().status().result()["stats"]
    assert stats["corrupt_after_hit"] == 1
    worker.shutdown()


def test_a_full_arena_skips_and_counts_stores_without_blocking(cfg: TierStoreConfig) -> None:
    kv = _kv()
    worker = _worker(cfg, kv)  # starts the NodeStore; the worker maps no arena before a store
    store = _node_store()
    region, _ = store.arena_info().result()
    hog = HolderLock(region.path)  # another worker of the node takes every free extent
    try:
        while None not in store.arena_grant(hog.holder, region.epoch, [4096] * 64).result()[1]:
            pass
        store.arena_grant(hog.holder, region.epoch, [64] * 64).result()
        before = store.status().result()["stats"]["skipped_shards"]
        for job in range(3):
            _store(worker, 10 + job, 100 + 10 * job)  # each reported done
        stats = store.status().result()["stats"]
        assert stats["skipped_shards"] >= before + 3
        assert worker.failed_stores == 0
    finally:
        hog.close()
    worker.shutdown()
