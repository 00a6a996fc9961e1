"""What the GPU tests share: KV caches on the GPU with a host twin, random jobs, the
host reference copies, and a forward still running on the model-runner thread's stream.

The test thread plays vLLM's model-runner thread: it makes its own stream current (vLLM
runs its forward on such a per-thread stream, not the legacy default one). A long
``torch.cuda._sleep`` on that stream stands for a forward still in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from tierstore.data.layout import ChunkLayout, as_index

SLEEP_CYCLES = 2_000_000_000  # about a second at a ~2 GHz SM clock
GROUPS = {
    "hybrid": ([128, 256, 64], [[(0, 96), (2, 64)], [(1, 200)], [(0, 128)]]),
    "odd": ([128, 64, 40], [[(0, 100), (1, 37)], [(2, 33)]]),
}


def kv_pair(name: str, num_blocks: int = 64, seed: int = 0):
    """The same random KV on the GPU and on the host (the reference)."""
    rows, _ = GROUPS[name]
    g = torch.Generator().manual_seed(seed)
    host = [torch.randint(-128, 127, (num_blocks, r), dtype=torch.int8, generator=g) for r in rows]
    return [t.to("cuda") for t in host], host


def random_job(layout: ChunkLayout, rng: np.random.Generator, num_blocks: int):
    sizes = [int(x) for x in rng.integers(1, 6, len(layout.groups))]
    indices = [int(x) for x in rng.integers(0, 9, len(layout.groups))]
    src = rng.choice(num_blocks, sum(sizes), replace=False)
    dst = rng.choice(num_blocks, sum(sizes), replace=False)
    return layout.plan(sizes, indices), src, dst


def reference_gather(layout: ChunkLayout, plan, ids) -> np.ndarray:
    out = torch.empty(plan.nbytes, dtype=torch.uint8)
    layout.gather(plan, as_index(ids, layout.device), out)
    return out.numpy()


@contextmanager
def sleeping_forward(gpu: list[torch.Tensor], blocks, fill: int) -> Iterator[torch.cuda.Event]:
    """A forward in flight on the current (model-runner) stream: it sleeps, then fills
    ``blocks`` of every KV tensor with ``fill`` (vLLM zeroes the blocks a load will
    write; a forward writes the KV a store reads). The body runs with that stream
    current, as ``submit_*`` does; yields the event recorded when the forward ends."""
    index = torch.as_tensor(blocks, device="cuda")
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in gpu:
            t.index_fill_(0, index, fill)
        forward_done = torch.cuda.Event()
        forward_done.record(compute)
        yield forward_done


def assert_loaded(
    gpu, host, layout: ChunkLayout, plan, dst, data: np.ndarray, fill: int | None = None
) -> None:
    """The load's blocks hold ``data`` as the host reference scatters it (``layout`` is
    the host twin's), not what the forward wrote there; ``fill``: what the forward
    wrote over the whole of each ``dst`` block first (a block's bytes no group of the
    load covers keep it), None if it left them alone."""
    torch.cuda.synchronize()
    rows = torch.as_tensor(dst)
    if fill is not None:
        for ref in host:
            ref[rows] = fill
    layout.scatter(plan, as_index(dst, "cpu"), torch.from_numpy(data.copy()))
    for t, ref in zip(gpu, host, strict=True):
        assert torch.equal(t.cpu()[rows], ref[rows])  # loaded bytes, not the zeroing's
