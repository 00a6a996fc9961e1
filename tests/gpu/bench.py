"""GB/s of tierstore's CUDA copies between a KV cache and a registered arena, each set
against torch's pinned contiguous copy of the same bytes in the same run.

The KV cache is an 8B Llama's shape (32 layers, 64 KiB pages, one page per layer and
block); a job of 16 MiB or 256 MiB is stored (device -> arena extents) and loaded back
(extents -> other blocks) by each copy executor this machine has
(:mod:`tierstore.vllm.batch_copy`: vLLM's when present, the driver's through
cuda-bindings, the Triton copy kernel where Triton is, one copy per run). torch's
``copy_`` between one contiguous device buffer and one pinned host buffer of the same
size is the link's practical limit (PCIe or C2C): the ratio says how close a scattered
job gets to it. Wall time from the submit to the copy's end (what a job costs the
worker), median of :data:`REPEATS`.

Run: ``PYTHONPATH=. python3 -m tests.gpu.bench`` (``tests/gpu/check.sh`` runs it);
prints one line per case and, with ``--json PATH``, writes them there. A ratio, not a
test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from tierstore.data.extent_copy import runs_of
from tierstore.data.layout import ChunkLayout
from tierstore.vllm.batch_copy import EXECUTOR_NAMES, make_executor, probe
from tierstore.vllm.cuda_copy import CudaCopier

LAYERS, PAGE = 32, 64 << 10  # an 8B Llama: 8 KV heads of 128, bf16, 16-token blocks
SIZES = (16 << 20, 256 << 20)
REPEATS = 5
BLOCKS = 2 * max(SIZES) // (LAYERS * PAGE)  # room for a job's source and destination


def _median_s(run: Callable[[], None]) -> float:
    run()  # warm-up
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _torch_pinned(nbytes: int) -> dict[str, float]:
    """Seconds of torch's contiguous copies, device <-> one pinned buffer."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def store() -> None:
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()

    def load() -> None:
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    return {"store": _median_s(store), "load": _median_s(load)}


def _tierstore(copier: CudaCopier, layout: ChunkLayout, arena: np.ndarray, nbytes: int):
    """Seconds of one job of ``nbytes`` into scattered arena extents and back."""
    n = nbytes // (LAYERS * PAGE)
    plan = layout.plan([n], [0])
    rng = np.random.default_rng(nbytes)
    src, dst = np.split(rng.permutation(BLOCKS)[: 2 * n], 2)
    slots = rng.permutation(arena.nbytes // (LAYERS * PAGE))[:n]  # extents out of order
    offsets = [int(s) * LAYERS * PAGE for s in slots]
    runs = runs_of(plan.chunks, offsets)

    dma_s: list[float] = []

    def store() -> None:
        gathered = copier.gather_into(plan, src, arena, offsets)
        gathered.wait_copied()
        dma_s.append(gathered.copy_seconds)

    def load() -> None:
        copier.prepare_scatter(plan, dst).from_extents(arena, runs)

    store_s = _median_s(store)
    return {"store": store_s, "load": _median_s(load), "store_dma": statistics.median(dma_s)}


def run() -> list[dict[str, object]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    gpu = [
        torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, device="cuda", generator=gen)
        for _ in range(LAYERS)
    ]
    layout = ChunkLayout(gpu, [[(i, PAGE) for i in range(LAYERS)]], blocks_per_chunk=1)
    memory = mmap.mmap(-1, 2 * max(SIZES))  # anonymous, as the node's arena in /dev/shm
    arena = np.frombuffer(memory, dtype=np.uint8)
    rows: list[dict[str, object]] = []
    base = {nbytes: _torch_pinned(nbytes) for nbytes in SIZES}
    for name in EXECUTOR_NAMES:
        executor = make_executor(name, gpu)
        why = "not available here" if executor is None else probe(executor, gpu)
        if executor is None or why is not None:
            rows.append({"executor": name, "available": False, "why": why})
            continue
        copier = CudaCopier(layout, executor)
        copier.attach_arena(arena)
        for nbytes in SIZES:
            mine = _tierstore(copier, layout, arena, nbytes)
            for direction in ("store", "load"):
                rows.append(
                    {
                        "executor": name,
                        "available": True,
                        "registered": copier.pageable_arenas == 0,
                        "direction": direction,
                        "mib": nbytes >> 20,
                        "gbps": nbytes / mine[direction] / 1e9,
                        "torch_pinned_gbps": nbytes / base[nbytes][direction] / 1e9,
                        # the copy alone, by its stream's events (stores): what is left
                        # without the executor's Python per copy (vLLM's takes tensors)
                        "dma_gbps": nbytes / mine["store_dma"] / 1e9
                        if direction == "store"
                        else None,
                        # tables the kernel left to its DMA fallback (host memory it
                        # could not address): its numbers are then not its own
                        "fallbacks": getattr(executor, "fallbacks", 0),
                    }
                )
        copier.detach_arena(arena)
    return rows  # the mapping goes with the process (copiers may still reference it)


def _line(row: dict[str, object]) -> str:
    if not row["available"]:
        return f"{row['executor']:>6}: {row['why']}"
    ratio = float(row["gbps"]) / float(row["torch_pinned_gbps"])  # type: ignore[arg-type]
    pinned = "" if row["registered"] else " (arena PAGEABLE: registration failed)"
    if row["fallbacks"]:
        pinned += f" ({row['fallbacks']} tables went to the kernel's DMA fallback)"
    dma = "" if row["dma_gbps"] is None else f"; the copy alone {row['dma_gbps']:.1f} GB/s"
    return (
        f"{row['executor']:>6} {row['direction']:>5} {row['mib']:>4} MiB: "
        f"{row['gbps']:6.1f} GB/s = {ratio:4.2f} x torch pinned contiguous "
        f"({row['torch_pinned_gbps']:.1f} GB/s){dma}{pinned}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        sys.stdout.write("bench skipped: no CUDA device\n")
        return 0
    rows = run()
    sys.stdout.write("".join(_line(r) + "\n" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
