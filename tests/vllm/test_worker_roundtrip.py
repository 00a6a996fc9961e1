"""The worker and the actors together, without an engine: real Ray, real KV tensors."""

from __future__ import annotations

import ray
import torch
from tierstore.actors.bootstrap import find_node_store, get_or_create_evictor
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from tierstore.deploy.cli import collect_status
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult

from tests.actors.hooks import corrupt_in_memory
from tests.support import poll, wait_for
from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId
from tierstore.spec import connect_worker
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec
from tierstore.vllm.worker import TierStoreWorker
from tierstore.wire import LookupState

NS = Namespace("7e57da7a")
PAGE_BYTES = (96, 200)  # two groups with different pages, padded rows below


def _kv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(-128, 127, (32, 128), dtype=torch.int8, generator=g),
        torch.randint(-128, 127, (32, 256), dtype=torch.int8, generator=g),
    ]


def _worker(cfg: TierStoreConfig, kv: list[torch.Tensor]) -> TierStoreWorker:
    layout = ChunkLayout(kv, [[(0, PAGE_BYTES[0])], [(1, PAGE_BYTES[1])]], blocks_per_chunk=2)
    return connect_worker(cfg, layout)


def _keys(n: int, group: int, start: int = 0) -> list[ChunkKey]:
    return [
        ChunkKey(i.to_bytes(8, "big") + group.to_bytes(4, "big")) for i in range(start, start + n)
    ]


def _drain(worker: TierStoreWorker, n_jobs: int) -> list[int]:
    done: list[int] = []

    def all_done() -> bool:
        done.extend(r.job_id for r in worker.get_finished() if r.success)
        return len(done) >= n_jobs

    poll(all_done, 30, poll_s=0.01)
    # A store is done once its bytes are in the arena; the NodeStore indexes it after.
    assert worker.wait_committed(30), "store commits still unanswered after 30 s"
    return done


def _store_job(worker: TierStoreWorker) -> list[ChunkKey]:
    keys = _keys(2, 0) + _keys(1, 1)
    src = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[4, 1], block_indices=[0, 0])
    assert worker.submit_store(1, src, StoreSpec(NS, tuple(keys)))
    assert _drain(worker, 1) == [1]
    return keys


def _lookup(cfg: TierStoreConfig, keys: list[ChunkKey], ttl: float = 30.0) -> list[LookupState]:
    answers = EvictorClient(get_or_create_evictor(cfg)).lookup(NS, keys, "test", ttl).result()
    return [a.state for a in answers]


def _load_spec(cfg: TierStoreConfig, keys: list[ChunkKey]) -> LoadSpec:
    """Look the keys up until every one is a HIT (promotions from disk take a moment)."""
    evictor = EvictorClient(get_or_create_evictor(cfg))
    answers = poll(
        lambda: evictor.lookup(NS, keys, "test", 30.0).result(),
        10,
        poll_s=0.02,
        done=lambda found: all(a.state is LookupState.HIT for a in found),
    )
    assert all(a.state is LookupState.HIT for a in answers), answers
    return LoadSpec.build(NS, keys, [a.where for a in answers])


def test_store_then_load_into_other_blocks_is_byte_exact(cfg: TierStoreConfig) -> None:
    kv = _kv()
    original = [t.clone() for t in kv]
    worker = _worker(cfg, kv)
    keys = _store_job(worker)
    dst = GPULoadStoreSpec([20, 21, 22, 23, 24], group_sizes=[4, 1], block_indices=[0, 0])
    assert worker.submit_load(2, _load_spec(cfg, keys), dst)
    worker.wait({2})
    assert _drain(worker, 1) == [2]
    for s, d in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True):
        assert torch.equal(kv[0][d, :96], original[0][s, :96])
    assert torch.equal(kv[1][24, :200], original[1][5, :200])
    # The padding past each page is not tierstore's to write.
    assert torch.equal(kv[0][20, 96:], original[0][20, 96:])
    status = collect_status(cfg.namespace)
    (node,) = status["nodes"]
    assert node["cpu"]["chunks"] == 3
    assert node["cpu"]["used_bytes"] == 2 * 2 * 96 + 2 * 200
    assert status["totals"]["stored_chunks"] == 3
    assert status["totals"]["hits"] == 3


def test_chunks_survive_the_worker_process_that_stored_them(cfg: TierStoreConfig) -> None:
    @ray.remote(num_cpus=0)
    def store_and_exit(config: TierStoreConfig) -> None:
        worker = _worker(config, _kv())
        _store_job(worker)

    ray.get(store_and_exit.remote(cfg))  # the task's worker process owned the put
    kv = [torch.zeros_like(t) for t in _kv()]
    worker = _worker(cfg, kv)
    keys = _keys(2, 0) + _keys(1, 1)
    dst = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[4, 1], block_indices=[0, 0])
    worker.submit_load(7, _load_spec(cfg, keys), dst)
    assert _drain(worker, 1) == [7]
    assert torch.equal(kv[0][1:5, :96], _kv()[0][1:5, :96])


def test_a_corrupt_chunk_fails_its_load_and_no_block_after_it_is_written(
    cfg: TierStoreConfig,
) -> None:
    kv = _kv()
    worker = _worker(cfg, kv)
    keys = _store_job(worker)
    node = NodeId(ray.get_runtime_context().get_node_id())
    store = NodeStoreClient(find_node_store(cfg.namespace, node), node)
    corrupt_in_memory(store, [ShardId(NS, keys[0], 0)])
    before = [t.clone() for t in kv]
    dst = GPULoadStoreSpec([20, 21, 22, 23, 24], group_sizes=[4, 1], block_indices=[0, 0])
    worker.submit_load(3, _load_spec(cfg, keys), dst)
    worker.wait({3})
    # Reported as a failed job (TierStoreConnector recomputes its request), never as done.
    assert worker.get_finished() == [TransferResult(3, False)]
    assert worker.failed_loads == 1
    # Each try stops at the corrupt chunk (the job's first: blocks 20-21). Its blocks may
    # hold some of its bytes (copied as they are hashed; vLLM frees them uncached), but
    # no block after it was written.
    assert torch.equal(kv[0][22:24], before[0][22:24]) and torch.equal(kv[1][24], before[1][24])
    # The NodeStore dropped the corrupt shard and counted it.
    assert collect_status(cfg.namespace)["nodes"][0]["stats"]["corrupt_after_hit"] == 1


def test_cpu_tier_stays_within_its_bound(cfg: TierStoreConfig) -> None:
    worker = _worker(cfg, _kv())
    chunk = 2 * 96
    n = cfg.cpu_bytes_per_node // chunk + 20  # more than fits
    for job in range(n):
        src = GPULoadStoreSpec([1, 2], group_sizes=[2, 0], block_indices=[0, 0])
        worker.submit_store(100 + job, src, StoreSpec(NS, tuple(_keys(1, 0, start=job))))
    assert len(_drain(worker, n)) == n
    status = collect_status(cfg.namespace)
    cpu = status["nodes"][0]["cpu"]
    assert cpu["used_bytes"] <= cpu["capacity_bytes"]
    assert cpu["chunks"] == cfg.cpu_bytes_per_node // chunk
    assert status["totals"]["evicted_chunks"] == n - cpu["chunks"]
    # Exactly the oldest chunks went first (stores reach the Evictor in submission
    # order, whether they went through the arena or, the pool run dry, the object store).
    evicted = n - cpu["chunks"]
    states = [_lookup(cfg, _keys(1, 0, start=job), 1.0)[0] for job in range(n)]
    assert states == [LookupState.MISS] * evicted + [LookupState.HIT] * (n - evicted)


def test_unknown_load_wait_ids_are_ignored(cfg: TierStoreConfig) -> None:
    worker = _worker(cfg, _kv())
    worker.wait({12345})
    assert worker.get_finished() == []


def test_store_to_a_dead_node_store_is_skipped_not_fatal(cfg: TierStoreConfig) -> None:
    kv = _kv()
    worker = _worker(cfg, kv)
    keys = _store_job(worker)
    spec = _load_spec(cfg, keys)
    ray.kill(find_node_store(cfg.namespace, ray.get_runtime_context().get_node_id()))
    src = GPULoadStoreSpec([6, 7], group_sizes=[2, 0], block_indices=[0, 0])
    worker.submit_store(2, src, StoreSpec(NS, tuple(_keys(1, 0, start=50))))
    assert _drain(worker, 1) == [2]  # reported done: a lost store only costs a recompute
    assert worker.failed_stores == 1
    # vLLM cannot be told, so the worker tells the Evictor: it shows in `tierstore status`.
    evictor = EvictorClient(get_or_create_evictor(cfg))
    wait_for(
        lambda: evictor.status().result()["totals"]["failed_stores"] == 1,
        "the failed store counted by the Evictor",
        timeout_s=10,
    )
    # A load from the dead NodeStore must never be reported done. (Through the round
    # trips, as off x86-64: an unpinned read may still serve it, verified, from the
    # arena the dead NodeStore left mapped.)
    worker.arena.read_unpinned = False
    before = [t.clone() for t in kv]
    dst = GPULoadStoreSpec([20, 21, 22, 23, 24], group_sizes=[4, 1], block_indices=[0, 0])
    worker.submit_load(3, spec, dst)
    worker.wait({3})
    assert worker.get_finished() == [TransferResult(3, False)]
    assert worker.failed_loads == 1
    # Each try stops at the corrupt chunk (the job's first: blocks 20-21). Its blocks may
    # hold some of its bytes (copied as they are hashed; vLLM frees them uncached), but
    # no block after it was written.
    assert torch.equal(kv[0][22:24], before[0][22:24]) and torch.equal(kv[1][24], before[1][24])


def test_engines_of_different_models_never_read_each_others_chunks(cfg: TierStoreConfig) -> None:
    """Same block hashes (keys), two namespaces: each engine gets back only its own bytes."""
    kv_a, kv_b = _kv(), [torch.full_like(t, 7) for t in _kv()]
    keys = _keys(1, 0)
    src = GPULoadStoreSpec([1, 2], group_sizes=[2, 0], block_indices=[0, 0])
    for namespace, kv in ((Namespace("aaaa"), kv_a), (Namespace("bbbb"), kv_b)):
        worker = _worker(cfg, kv)
        worker.submit_store(1, src, StoreSpec(namespace, tuple(keys)))
        assert _drain(worker, 1) == [1]
    evictor = EvictorClient(get_or_create_evictor(cfg))
    for namespace, expected in ((Namespace("aaaa"), kv_a[0]), (Namespace("bbbb"), kv_b[0])):
        (answer,) = evictor.lookup(namespace, keys, "t", 5.0).result()
        target = [torch.zeros_like(t) for t in _kv()]
        worker = _worker(cfg, target)
        spec = LoadSpec.build(namespace, keys, [answer.where])
        worker.submit_load(
            2, spec, GPULoadStoreSpec([5, 6], group_sizes=[2, 0], block_indices=[0, 0])
        )
        assert _drain(worker, 1) == [2]
        assert torch.equal(target[0][5:7, :96], expected[1:3, :96])
    (answer,) = evictor.lookup(Namespace("cccc"), keys, "t", 5.0).result()
    assert answer.state is LookupState.MISS
