"""Host copy executors: gather and scatter of one job against memcpy (``dataplane``'s
"host_copy" section; it chose ``tierstore.data.host_copy``'s executor).

Each candidate gathers (KV pages -> job buffer) and scatters (back) the same job; the
time is the best of ``--repeat`` interleaved rounds, as a ratio to ``numpy.copyto`` of
the job's bytes measured in the same rounds (lower is better, 1.0 = memcpy). Candidates:
- ``executor``: the CPU executor kept (``HostExecutor``: one ``np.take``/fancy
  assignment per batch; a memmove per page for large pages gathered into a strided
  region), the copy plan's build included;
- ``memmove``: ``ctypes.memmove`` per merged DMA run;
- ``np-slice``: numpy slice assignment per merged run;
- ``torch``: the former path (``ChunkLayout.gather``/``scatter``, index ops per layer).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tierstore.data.copy_plan import CopyPlanner, DmaRuns
from tierstore.data.host_copy import HostExecutor
from tierstore.data.layout import ChunkLayout, as_index

CASES = [  # name, layers, page bytes, row bytes, blocks per job, blocks per chunk, consecutive
    ("16 layers x 4 KiB pages, scattered blocks", 16, 4096, 4096, 256, 1, False),
    ("16 layers x 16 KiB pages, scattered blocks", 16, 16384, 16384, 64, 1, False),
    ("16 layers x 32 KiB pages, scattered blocks", 16, 32768, 32768, 32, 1, False),
    ("1 layer x 64 KiB pages, consecutive (dataplane)", 1, 65536, 65536, 256, 4, True),
    ("2 layers x 1 KiB pages, scattered blocks", 2, 1024, 1024, 2048, 2, False),
    ("1 layer x 3 KiB pages in 4 KiB rows (padded)", 1, 3072, 4096, 1024, 2, False),
]


def _best(fns: dict[str, Callable[[], None]], repeat: int) -> dict[str, float]:
    """Best time of each, over ``repeat`` rounds that run every candidate once: on a
    busy machine the candidates share the same noise."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def _memmove(runs: DmaRuns, buffer: np.ndarray, to_buffer: bool) -> None:
    base = buffer.ctypes.data
    for addr, off, n in zip(
        runs.kv_addr.tolist(), runs.offset.tolist(), runs.nbytes.tolist(), strict=True
    ):
        if to_buffer:
            ctypes.memmove(base + off, addr, n)
        else:
            ctypes.memmove(addr, base + off, n)


def _slices(runs: DmaRuns, layout: ChunkLayout, buffer: np.ndarray, to_buffer: bool) -> None:
    flats = [t.numpy().reshape(-1) for t in layout.tensors]  # contiguous here
    bases = np.array([t.data_ptr() for t in layout.tensors], dtype=np.int64)
    which = np.searchsorted(bases, runs.kv_addr, side="right") - 1
    rel = runs.kv_addr - bases[which]
    for t, r, o, n in zip(
        which.tolist(), rel.tolist(), runs.offset.tolist(), runs.nbytes.tolist(), strict=True
    ):
        if to_buffer:
            buffer[o : o + n] = flats[t][r : r + n]
        else:
            flats[t][r : r + n] = buffer[o : o + n]


def run_case(case: tuple, repeat: int) -> dict[str, Any]:
    name, layers, page, row, n_blocks, bpc, consecutive = case
    rows = 4096
    g = torch.Generator().manual_seed(0)
    # One allocation, sliced per layer: tensors in address order, as vLLM allocates.
    pool = torch.randint(-128, 127, (layers, rows, row), dtype=torch.int8, generator=g)
    kv = [pool[i] for i in range(layers)]
    layout = ChunkLayout(kv, [[(i, page) for i in range(layers)]], bpc)
    rng = np.random.default_rng(0)
    ids = np.arange(100, 100 + n_blocks) if consecutive else rng.permutation(rows)[:n_blocks]
    plan = layout.plan([n_blocks], [0])
    planner, executor = CopyPlanner(layout), HostExecutor(layout)
    copy_plan = planner.build(plan, ids)
    runs = planner.dma_runs(copy_plan)
    out, data = np.empty(plan.nbytes, np.uint8), np.empty(plan.nbytes, np.uint8)
    executor.gather(copy_plan, data)
    index = as_index(ids, layout.device)
    gathers = {
        "executor": lambda: executor.gather(planner.build(plan, ids), out),
        "memmove": lambda: _memmove(runs, out, True),
        "np-slice": lambda: _slices(runs, layout, out, True),
        "torch": lambda: layout.gather(plan, index, torch.from_numpy(out)),
    }
    scatters = {
        "executor": lambda: executor.scatter(planner.build(plan, ids), data),
        "memmove": lambda: _memmove(runs, data, False),
        "np-slice": lambda: _slices(runs, layout, data, False),
        "torch": lambda: layout.scatter(plan, index, torch.from_numpy(data)),
    }
    copy = {"memcpy": lambda: np.copyto(out, data)}
    gather = _best(copy | gathers, repeat)
    scatter = _best(copy | scatters, repeat)
    result: dict[str, Any] = {
        "case": name,
        "bytes": plan.nbytes,
        "dma_runs": len(runs),
        "memcpy_GBps": plan.nbytes / gather["memcpy"] / 1e9,
    }
    for label, times in (("gather_vs_memcpy_time", gather), ("scatter_vs_memcpy_time", scatter)):
        memcpy = times.pop("memcpy")
        result[label] = {k: v / memcpy for k, v in times.items()}
    return result


def run(repeat: int = 30, quick: bool = False) -> dict[str, Any]:
    """Every case (the first two with ``quick``), best of ``repeat`` rounds, one torch
    thread (as the worker's copies run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases = CASES[:2] if quick else CASES
        return {"repeat": repeat, "cases": [run_case(case, repeat) for case in cases]}
    finally:
        torch.set_num_threads(threads)
