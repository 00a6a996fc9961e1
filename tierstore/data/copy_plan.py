"""A job's copies, described once from its plan, for either direction and any executor.

A :class:`CopyPlan` lists the job's pages as row batches: for one layer of one group's
span, KV rows ``ids`` of a tensor go to (gather) or come from (scatter) buffer offsets
``offset + k * stride``. :func:`dma_runs` expands the same plan into flat
``(KV address, buffer offset, bytes)`` runs, merging runs contiguous on both sides,
which is what a batched DMA call (vLLM's ``swap_blocks_batch``) takes; the CPU executor
(:mod:`tierstore.data.host_copy`) runs the batches as vectorized numpy copies.

The buffer side is always an offset, so one plan serves whatever host buffer holds the
bytes. Slots a job does not fill are listed as ``zeros``: a gather clears them so
digests are deterministic (see :mod:`tierstore.data.layout`).

Pure numpy/torch: no Ray, no vLLM, no CUDA call (only ``data_ptr`` and strides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierstore.data.layout import ChunkLayout, JobPlan


@dataclass(frozen=True)
class RowBatch:
    """``page_bytes`` of KV rows ``ids`` of tensor ``tensor_idx`` <-> the buffer at
    ``offset + k * stride`` for the k-th id."""

    tensor_idx: int
    page_bytes: int
    ids: np.ndarray  # int64, checked against the tensor's rows
    offset: int
    stride: int


@dataclass(frozen=True)
class CopyPlan:
    batches: tuple[RowBatch, ...]
    zeros: tuple[tuple[int, int], ...]  # (offset, nbytes) of buffer ranges no page fills
    nbytes: int  # the job buffer's size (``JobPlan.nbytes``)


@dataclass(frozen=True)
class DmaRuns:
    """Flat runs in buffer order: ``kv_addr[i]`` <-> ``buffer + offset[i]``, ``nbytes[i]``."""

    kv_addr: np.ndarray  # int64 absolute addresses in the KV tensors
    offset: np.ndarray  # int64; increasing in a job buffer (arena offsets: extent_dma)
    nbytes: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.nbytes)


def window(plan: CopyPlan, lo: int, hi: int) -> CopyPlan:
    """The part of ``plan`` whose buffer bytes lie in ``[lo, hi)``, rebased to ``lo``.

    ``lo`` and ``hi`` must be chunk boundaries (no page straddles one), so a job's chunks
    can each live in their own extent: each window is run against its extent.
    """
    if not 0 <= lo <= hi <= plan.nbytes:
        raise ValueError(f"window [{lo}, {hi}) is outside the {plan.nbytes}-byte job")
    batches = []
    for b in plan.batches:
        # rows k with lo <= offset + k * stride and offset + k * stride + page <= hi
        k0 = max(0, -(-(lo - b.offset) // b.stride))
        k1 = min(len(b.ids), (hi - b.page_bytes - b.offset) // b.stride + 1)
        if k1 > k0:
            offset = b.offset + k0 * b.stride - lo
            batches.append(RowBatch(b.tensor_idx, b.page_bytes, b.ids[k0:k1], offset, b.stride))
    zeros = tuple(
        (max(o, lo) - lo, min(o + n, hi) - max(o, lo))
        for o, n in plan.zeros
        if o < hi and o + n > lo
    )
    return CopyPlan(tuple(batches), zeros, hi - lo)


class CopyPlanner:
    """Builds :class:`CopyPlan` s for one worker's KV tensors (built once per worker)."""

    def __init__(self, layout: ChunkLayout) -> None:
        for i, t in enumerate(layout.tensors):
            if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
                raise ValueError(
                    f"KV tensor {i}: pages must be contiguous bytes, got shape "
                    f"{tuple(t.shape)} strides {t.stride()}"
                )
        self.layout = layout

    def build(self, plan: JobPlan, block_ids: np.ndarray | Sequence[int]) -> CopyPlan:
        """The job's copies. Block ids are range-checked: executors use raw addresses."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        needed = sum(s.n_blocks for s in plan.spans)
        if len(ids) != needed:
            raise ValueError(f"job has {len(ids)} block ids, its plan covers {needed} blocks")
        batches: list[RowBatch] = []
        zeros: list[tuple[int, int]] = []
        for span in plan.spans:
            group = self.layout.groups[span.group_pos]
            span_ids = ids[span.ids_start : span.ids_start + span.n_blocks]
            self._check_ids(span.group_pos, span_ids, [r.tensor_idx for r in group.refs])
            first = span.offset + span.skip * group.slot_bytes
            for ref in group.refs:
                batches.append(
                    RowBatch(
                        ref.tensor_idx,
                        ref.page_bytes,
                        span_ids,
                        first + ref.slot_offset,
                        group.slot_bytes,
                    )
                )
            end = span.offset + span.n_chunks * group.chunk_bytes
            filled_end = first + span.n_blocks * group.slot_bytes
            zeros += [
                (lo, hi - lo) for lo, hi in ((span.offset, first), (filled_end, end)) if hi > lo
            ]
        return CopyPlan(tuple(batches), tuple(zeros), plan.nbytes)

    def _check_ids(self, group_pos: int, ids: np.ndarray, tensor_idx: list[int]) -> None:
        rows = min(self.layout.tensors[i].shape[0] for i in tensor_idx)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise ValueError(
                f"group {group_pos}: block ids {int(ids.min())}..{int(ids.max())} are outside "
                f"the KV cache's {rows} blocks"
            )

    def dma_runs(self, plan: CopyPlan) -> DmaRuns:
        """The plan as flat runs, merged where both sides are contiguous."""
        addrs, offsets, sizes = [], [], []
        for b in plan.batches:
            tensor = self.layout.tensors[b.tensor_idx]
            addrs.append(tensor.data_ptr() + b.ids * tensor.stride(0))
            offsets.append(b.offset + np.arange(len(b.ids), dtype=np.int64) * b.stride)
            sizes.append(np.full(len(b.ids), b.page_bytes, dtype=np.int64))
        if not addrs:
            empty = np.empty(0, dtype=np.int64)
            return DmaRuns(empty, empty, empty)
        addr, off, size = np.concatenate(addrs), np.concatenate(offsets), np.concatenate(sizes)
        order = np.argsort(off, kind="stable")  # batches of one span interleave by layer
        addr, off, size = addr[order], off[order], size[order]
        if len(size) > 1:
            joins = (off[:-1] + size[:-1] == off[1:]) & (addr[:-1] + size[:-1] == addr[1:])
            starts = np.flatnonzero(np.concatenate(([True], ~joins)))
            addr, off, size = addr[starts], off[starts], np.add.reduceat(size, starts)
        return DmaRuns(
            np.ascontiguousarray(addr, dtype=np.int64),
            np.ascontiguousarray(off, dtype=np.int64),
            np.ascontiguousarray(size, dtype=np.int64),
        )


def fill_descriptors(
    runs: DmaRuns,
    buffer_addr: int,
    to_buffer: bool,
    src: np.ndarray,
    dst: np.ndarray,
    sizes: np.ndarray,
) -> int:
    """Write the runs as (src, dst, size) pointer triples for ``swap_blocks_batch``.

    ``to_buffer``: a gather (KV -> buffer at ``buffer_addr``), else a scatter. The three
    int64 arrays must hold ``len(runs)`` entries; returns that count.
    """
    n = len(runs)
    host = runs.offset + np.int64(buffer_addr)
    src[:n], dst[:n] = (runs.kv_addr, host) if to_buffer else (host, runs.kv_addr)
    sizes[:n] = runs.nbytes
    return n
