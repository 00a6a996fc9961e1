"""The CUDA copier: ordering against the compute stream, exact bytes, bounded memory.

Skipped unless CUDA is present (see conftest.py); each executor this machine has is
tested against the host reference, so against the others byte for byte. The test
thread plays vLLM's model-runner thread (:mod:`tests.gpu.kv`), and loads run on a
second thread as the worker's transfer pool runs them. No assertion is on time: each
checks what was (not) done when a call returned.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tests.gpu.conftest import ExecutorFor
from tests.gpu.kv import (
    GROUPS,
    SLEEP_CYCLES,
    assert_loaded,
    kv_pair,
    random_job,
    reference_gather,
    sleeping_forward,
)
from tierstore.data.layout import ChunkLayout, as_index
from tierstore.vllm.batch_copy import EXECUTOR_NAMES, make_executor
from tierstore.vllm.cuda_copy import CudaCopier
from tierstore.vllm.device_copy import make_copier

pytestmark = pytest.mark.gpu


def test_cuda_tensors_get_the_cuda_copier_with_a_probed_executor() -> None:
    gpu, _ = kv_pair("hybrid")
    copier = make_copier(ChunkLayout(gpu, GROUPS["hybrid"][1], 2))
    assert isinstance(copier, CudaCopier)
    print(f"executor chosen: {copier.executor}")


@pytest.mark.parametrize("name", EXECUTOR_NAMES)
@pytest.mark.parametrize("src_any", [False, True])
def test_an_executors_load_lands_after_the_event_its_stream_waits_for(
    name: str, src_any: bool
) -> None:
    """The executor contract the copier's loads rest on: a host -> device copy launched
    on a stream that waits for a compute stream's event writes after that stream's
    work, with the source in any access order too (``src_any`` lets the DMA engine read
    the pinned source ahead; the destination stays in stream order)."""
    nbytes = 1 << 20
    dst = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    executor = make_executor(name, [dst])
    if executor is None:
        pytest.skip(f"the {name!r} copy executor is not available here")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(torch.arange(nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8))
    compute, copy = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(SLEEP_CYCLES)
        dst.zero_()  # what vLLM does to the blocks a load will fill
        zeroed = torch.cuda.Event()
        zeroed.record(compute)
    copy.wait_event(zeroed)
    table = torch.tensor([[pinned.data_ptr()], [dst.data_ptr()], [nbytes]], dtype=torch.int64)
    with torch.cuda.stream(copy):
        executor.launch(table, 1, copy, src_any, pinned.numpy())
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), pinned), "the copy landed before the compute stream's zeroing"


@pytest.mark.parametrize("name", sorted(GROUPS))
@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize("expedited", [False, True])
def test_round_trip_gpu_host_gpu_is_bit_exact(
    executor_for: ExecutorFor, name: str, bpc: int, expedited: bool
) -> None:
    gpu, host = kv_pair(name, seed=bpc)
    layout, ref_layout = (
        ChunkLayout(gpu, GROUPS[name][1], bpc),
        ChunkLayout(host, GROUPS[name][1], bpc),
    )
    copier = CudaCopier(layout, executor_for(gpu))
    plan, src, dst = random_job(layout, np.random.default_rng(bpc), 64)

    stored = copier.gather(plan, src)()
    assert np.array_equal(stored, reference_gather(ref_layout, plan, src))

    data = stored.copy()
    data.flags.writeable = False  # as Ray hands bytes out
    scatter = copier.prepare_scatter(plan, dst, expedited)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(scatter, data).result(timeout=60)
    ref_layout.scatter(plan, as_index(dst, ref_layout.device), torch.from_numpy(data.copy()))
    for mine, theirs in zip(gpu, host, strict=True):
        assert torch.equal(mine.cpu(), theirs)  # padding and other blocks untouched


def test_a_load_lands_after_the_compute_stream_zeroes_its_blocks(
    executor_for: ExecutorFor,
) -> None:
    gpu, host = kv_pair("hybrid")
    layout = ChunkLayout(gpu, GROUPS["hybrid"][1], 2)
    copier = CudaCopier(layout, executor_for(gpu))
    plan, _, dst = random_job(layout, np.random.default_rng(7), 64)
    data = np.random.default_rng(8).integers(1, 256, plan.nbytes, dtype=np.uint8)
    with sleeping_forward(gpu, dst, 0):  # zeroes the blocks the load writes
        scatter = copier.prepare_scatter(plan, dst)
    with ThreadPoolExecutor(1) as pool:  # the worker's transfer thread
        pool.submit(scatter, data).result(timeout=120)
    assert_loaded(gpu, host, ChunkLayout(host, GROUPS["hybrid"][1], 2), plan, dst, data, 0)


def test_submit_store_returns_while_the_forward_still_runs(executor_for: ExecutorFor) -> None:
    gpu, host = kv_pair("hybrid")
    layout = ChunkLayout(gpu, GROUPS["hybrid"][1], 2)
    copier = CudaCopier(layout, executor_for(gpu))
    copier.gather(*random_job(layout, np.random.default_rng(1), 64)[:2])()  # warm the pools
    plan, src, _ = random_job(layout, np.random.default_rng(2), 64)
    with sleeping_forward(gpu, src, 5) as forward_done:  # writes the KV this store reads
        gathered = copier.gather(plan, src)  # what submit_store calls
        assert not forward_done.query(), "the store's submit waited for the forward"
        assert not gathered.copied(), "the store's copy did not wait for the forward"
    stored = gathered()
    assert forward_done.query()
    for t in host:
        t[torch.as_tensor(src)] = 5
    assert np.array_equal(
        stored, reference_gather(ChunkLayout(host, GROUPS["hybrid"][1], 2), plan, src)
    )
    assert gathered.copy_seconds > 0


def test_an_expedited_load_does_not_queue_behind_a_blocked_load() -> None:
    gpu, _ = kv_pair("hybrid")
    layout = ChunkLayout(gpu, GROUPS["hybrid"][1], 1)
    copier = CudaCopier(layout)
    plan, _, dst = random_job(layout, np.random.default_rng(3), 64)
    data = np.zeros(plan.nbytes, dtype=np.uint8)
    blocked = torch.cuda.Stream()
    with torch.cuda.stream(blocked):
        torch.cuda._sleep(SLEEP_CYCLES)
        slow = copier.prepare_scatter(plan, dst)
    with torch.cuda.stream(torch.cuda.Stream()):  # an idle compute stream
        urgent = copier.prepare_scatter(plan, dst, expedited=True)
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(slow, data)
        pool.submit(urgent, data).result(timeout=60)
        assert not waiting.done(), "the regular load was not held back by its stream"
        waiting.result(timeout=120)


def test_an_expedited_load_passes_a_store_held_by_the_forward() -> None:
    gpu, host = kv_pair("hybrid")
    layout = ChunkLayout(gpu, GROUPS["hybrid"][1], 1)
    copier = CudaCopier(layout)
    plan, src, dst = random_job(layout, np.random.default_rng(4), 64)
    dst = np.setdiff1d(np.arange(64), src)[: len(dst)]  # blocks the forward leaves alone
    data = np.random.default_rng(5).integers(0, 256, plan.nbytes, dtype=np.uint8)
    with sleeping_forward(gpu, src, 9) as forward_done:
        stored = copier.gather(plan, src)  # its copy waits for the forward
        with torch.cuda.stream(torch.cuda.Stream()):  # an idle compute stream
            urgent = copier.prepare_scatter(plan, dst, expedited=True)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(urgent, data).result(timeout=60)
        assert not forward_done.query(), "the forward ended before the check"
        assert not stored.copied(), "the store did not wait for the forward"
    stored.wait_copied()
    assert_loaded(gpu, host, ChunkLayout(host, GROUPS["hybrid"][1], 1), plan, dst, data)


def test_a_32k_token_job_goes_through_the_fixed_bounce_pool_with_no_gpu_staging() -> None:
    # An 8B Llama's KV: 32 layers, 8 KV heads of 128, bf16, 16-token blocks -> 64 KiB
    # pages; 2048 blocks are 32k tokens, 4 GiB per job: larger than the bounce pool.
    layers, page, blocks = 32, 16 * 2 * 8 * 128 * 2, 2048
    gpu = [torch.empty((blocks, page), dtype=torch.int8, device="cuda") for _ in range(layers)]
    for t in gpu:
        t.random_(-128, 127)
    layout = ChunkLayout(gpu, [[(i, page) for i in range(layers)]], blocks_per_chunk=1)
    copier = CudaCopier(layout)
    pinned = copier.host_bytes
    plan = layout.plan([blocks], [0])
    ids = np.random.default_rng(0).permutation(blocks)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()

    stored = copier.gather(plan, ids)()
    assert np.array_equal(stored[:page], gpu[0][int(ids[0])].cpu().numpy().view(np.uint8))
    kept = stored.copy()
    for t in gpu:
        t.zero_()
    copier.scatter(plan, ids, kept)
    del stored
    again = copier.gather(plan, ids)()
    torch.cuda.synchronize()

    peak = torch.cuda.max_memory_allocated() - before
    gib = plan.nbytes / 2**30
    print(f"32k-token job {gib:.2f} GiB: GPU peak +{peak} B, pinned {pinned / 2**30:.2f} GiB")
    assert peak <= 2 << 20, f"{peak} bytes of GPU memory allocated for the job"
    assert np.array_equal(again, kept)
    assert copier.split_jobs == 3  # two stores and a load, each in pieces
    assert copier.host_bytes == pinned  # no pinned memory allocated after the start
