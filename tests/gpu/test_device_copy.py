"""The CUDA copier: ordering against the compute stream, exact bytes, bounded memory.

Skipped unless CUDA and vLLM's CUDA ops are present (see conftest.py). The test
thread plays vLLM's model-runner thread: it makes its own stream current (vLLM runs
its forward on such a per-thread stream, not the legacy default one), and loads run
on a second thread as the worker's transfer pool runs them. A long
``torch.cuda._sleep`` on the compute stream stands for a forward still in flight.
No assertion is on time: each checks what was (not) done when a call returned.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tierstore.data.layout import ChunkLayout, as_index
from tierstore.vllm.cuda_copy import CudaCopier
from tierstore.vllm.device_copy import make_copier

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 2_000_000_000  # about a second at a ~2 GHz SM clock
GROUPS = {
    "hybrid": ([128, 256, 64], [[(0, 96), (2, 64)], [(1, 200)], [(0, 128)]]),
    "odd": ([128, 64, 40], [[(0, 100), (1, 37)], [(2, 33)]]),
}


def _kv_pair(name: str, num_blocks: int = 64, seed: int = 0):
    """The same random KV on the GPU and on the host (the reference)."""
    rows, _ = GROUPS[name]
    g = torch.Generator().manual_seed(seed)
    host = [torch.randint(-128, 127, (num_blocks, r), dtype=torch.int8, generator=g) for r in rows]
    return [t.to("cuda") for t in host], host


def _job(layout: ChunkLayout, rng: np.random.Generator, num_blocks: int):
    sizes = [int(x) for x in rng.integers(1, 6, len(layout.groups))]
    indices = [int(x) for x in rng.integers(0, 9, len(layout.groups))]
    src = rng.choice(num_blocks, sum(sizes), replace=False)
    dst = rng.choice(num_blocks, sum(sizes), replace=False)
    return layout.plan(sizes, indices), src, dst


def _reference_gather(layout: ChunkLayout, plan, ids) -> np.ndarray:
    out = torch.empty(plan.nbytes, dtype=torch.uint8)
    layout.gather(plan, as_index(ids, layout.device), out)
    return out.numpy()


def test_cuda_tensors_get_the_cuda_copier() -> None:
    gpu, _ = _kv_pair("hybrid")
    assert isinstance(make_copier(ChunkLayout(gpu, GROUPS["hybrid"][1], 2)), CudaCopier)


@pytest.mark.parametrize("name", sorted(GROUPS))
@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize("expedited", [False, True])
def test_round_trip_gpu_host_gpu_is_bit_exact(name: str, bpc: int, expedited: bool) -> None:
    gpu, host = _kv_pair(name, seed=bpc)
    layout, ref_layout = (
        ChunkLayout(gpu, GROUPS[name][1], bpc),
        ChunkLayout(host, GROUPS[name][1], bpc),
    )
    copier = CudaCopier(layout)
    plan, src, dst = _job(layout, np.random.default_rng(bpc), 64)

    stored = copier.gather(plan, src)()
    assert np.array_equal(stored, _reference_gather(ref_layout, plan, src))

    data = stored.copy()
    data.flags.writeable = False  # as Ray hands bytes out
    scatter = copier.prepare_scatter(plan, dst, expedited)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(scatter, data).result(timeout=60)
    ref_layout.scatter(plan, as_index(dst, ref_layout.device), torch.from_numpy(data.copy()))
    for mine, theirs in zip(gpu, host, strict=True):
        assert torch.equal(mine.cpu(), theirs)  # padding and other blocks untouched


def test_a_load_lands_after_the_compute_stream_zeroes_its_blocks() -> None:
    gpu, host = _kv_pair("hybrid")
    layout = ChunkLayout(gpu, GROUPS["hybrid"][1], 2)
    copier = CudaCopier(layout)
    plan, _, dst = _job(layout, np.random.default_rng(7), 64)
    data = np.random.default_rng(8).integers(1, 256, plan.nbytes, dtype=np.uint8)
    dst_index = torch.as_tensor(dst, device="cuda")
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):  # the model-runner thread's stream
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in gpu:  # vLLM zeroes newly allocated blocks in the step that loads them
            t.index_fill_(0, dst_index, 0)
        scatter = copier.prepare_scatter(plan, dst)
    with ThreadPoolExecutor(1) as pool:  # the worker's transfer thread
        pool.submit(scatter, data).result(timeout=120)
    torch.cuda.synchronize()
    ChunkLayout(host, GROUPS["hybrid"][1], 2).scatter(
        plan, as_index(dst, "cpu"), torch.from_numpy(data.copy())
    )
    rows = torch.as_tensor(dst)
    for t, ref in zip(gpu, host, strict=True):
        assert torch.equal(t.cpu()[rows], ref[rows])  # loaded bytes, not the zeroing's


def test_submit_store_returns_while_the_forward_still_runs() -> None:
    gpu, host = _kv_pair("hybrid")
    layout = ChunkLayout(gpu, GROUPS["hybrid"][1], 2)
    copier = CudaCopier(layout)
    copier.gather(*_job(layout, np.random.default_rng(1), 64)[:2])()  # warm the pools
    plan, src, _ = _job(layout, np.random.default_rng(2), 64)
    src_index = torch.as_tensor(src, device="cuda")
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in gpu:  # the forward writes the KV this store reads
            t.index_fill_(0, src_index, 5)
        forward_done = torch.cuda.Event()
        forward_done.record(compute)
        gathered = copier.gather(plan, src)  # what submit_store calls
        assert not forward_done.query(), "the store's submit waited for the forward"
        assert not gathered.copied(), "the store's copy did not wait for the forward"
    stored = gathered()
    assert forward_done.query()
    for t in host:
        t[torch.as_tensor(src)] = 5
    assert np.array_equal(
        stored, _reference_gather(ChunkLayout(host, GROUPS["hybrid"][1], 2), plan, src)
    )
    assert gathered.copy_seconds > 0


def test_an_expedited_load_does_not_queue_behind_a_blocked_load() -> None:
    gpu, _ = _kv_pair("hybrid")
    layout = ChunkLayout(gpu, GROUPS["hybrid"][1], 1)
    copier = CudaCopier(layout)
    plan, _, dst = _job(layout, np.random.default_rng(3), 64)
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


def test_a_32k_token_job_needs_no_gpu_staging_and_reuses_its_pinned_buffers() -> None:
    # An 8B Llama's KV: 32 layers, 8 KV heads of 128, bf16, 16-token blocks -> 64 KiB
    # pages; 2048 blocks are 32k tokens, 4 GiB per job.
    layers, page, blocks = 32, 16 * 2 * 8 * 128 * 2, 2048
    gpu = [torch.empty((blocks, page), dtype=torch.int8, device="cuda") for _ in range(layers)]
    for t in gpu:
        t.random_(-128, 127)
    layout = ChunkLayout(gpu, [[(i, page) for i in range(layers)]], blocks_per_chunk=1)
    copier = CudaCopier(layout)
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
    pinned = copier.host_bytes
    again = copier.gather(plan, ids)()
    torch.cuda.synchronize()

    peak = torch.cuda.max_memory_allocated() - before
    gib = plan.nbytes / 2**30
    print(f"32k-token job {gib:.2f} GiB: GPU peak +{peak} B, pinned {pinned / 2**30:.2f} GiB")
    assert peak <= 2 << 20, f"{peak} bytes of GPU memory allocated for the job"
    assert np.array_equal(again, kept)
    assert pinned <= 2 * plan.nbytes + (64 << 20)  # the store's buffer and the load's
    assert copier.host_bytes == pinned  # the second job allocated no pinned memory
