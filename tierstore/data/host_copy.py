"""The CPU executor of a :class:`~tierstore.data.copy_plan.CopyPlan`.

Each row batch is one vectorized numpy copy over ``void`` items of the page's size:
``np.take`` for a gather, fancy assignment for a scatter, both a C loop over pages, so
thousands of small pages cost no Python each. A gather numpy cannot do in one copy
(padded pages, several layers per slot) uses fancy indexing plus a copy, or, for pages
of 16 KiB and more, one ``memmove`` per page.

Chosen by ``deploy/bench/hostcopy.py`` (``tierstore bench dataplane``, "host_copy";
figures in docs/benchmarks.md): the fastest candidate on scattered and small pages; a
``ctypes.memmove`` or numpy slice per run pays Python's per-call cost on every page.

Thread: any. No per-job allocation but numpy's temporary in the two-copy gather.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from tierstore.data.copy_plan import CopyPlan, RowBatch
from tierstore.data.layout import ChunkLayout

# Gathers of pages at least this large that numpy cannot do in one copy (padded pages,
# or a group of several layers) use one memmove per page: measured as fast or faster
# than numpy's two copies from 32 KiB up, slower on small pages, where Python's per-call
# cost dominates.
MEMMOVE_MIN_PAGE = 16 << 10


class HostExecutor:
    """Gathers and scatters plans for KV tensors in host memory."""

    def __init__(self, layout: ChunkLayout) -> None:
        if layout.device.type != "cpu":
            raise ValueError(
                f"the host executor needs KV tensors in host memory, not {layout.device}"
            )
        self._rows = [_as_rows(t) for t in layout.tensors]
        self._addr = [(t.data_ptr(), t.stride(0)) for t in layout.tensors]
        self._views: dict[tuple[int, int], np.ndarray] = {}

    def gather(self, plan: CopyPlan, out: np.ndarray) -> None:
        """Copy the plan's pages into ``out`` (uint8, ``plan.nbytes``), clearing empty slots."""
        _check_buffer(plan, out)
        for offset, nbytes in plan.zeros:
            out[offset : offset + nbytes] = 0
        for batch in plan.batches:
            kv = self._kv(batch)
            single = kv.flags.c_contiguous and batch.stride == batch.page_bytes
            if not single and batch.page_bytes >= MEMMOVE_MIN_PAGE:
                self._memmove_pages(batch, out.ctypes.data)
                continue
            items = _buffer_items(out, batch)
            if single:
                np.take(kv, batch.ids, out=items, mode="wrap")  # one C loop, one copy
            else:
                # Not np.take: it would first copy a strided (padded) source whole, and
                # buffer a strided ``out``. Fancy indexing copies the pages, then ``items``.
                items[...] = kv[batch.ids]

    def scatter(self, plan: CopyPlan, data: np.ndarray) -> None:
        """Copy the plan's pages from ``data`` (may be read-only) into the KV rows."""
        _check_buffer(plan, data)
        for batch in plan.batches:
            self._kv(batch)[batch.ids] = _buffer_items(data, batch)

    def _memmove_pages(self, batch: RowBatch, out_addr: int) -> None:
        """One ``memmove`` per page: numpy would copy twice (padded source or strided
        ``out``); for large pages the per-call cost is the smaller one."""
        base, row_stride = self._addr[batch.tensor_idx]
        src = base + batch.ids * row_stride
        dst = out_addr + batch.offset + np.arange(len(batch.ids), dtype=np.int64) * batch.stride
        page = batch.page_bytes
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            ctypes.memmove(d, s, page)

    def _kv(self, batch: RowBatch) -> np.ndarray:
        """Tensor rows as ``void`` items of the page's size (first ``page_bytes`` of each)."""
        key = (batch.tensor_idx, batch.page_bytes)
        view = self._views.get(key)
        if view is None:
            rows = self._rows[batch.tensor_idx][:, : batch.page_bytes]
            view = rows.view(_item(batch.page_bytes))[:, 0]
            self._views[key] = view
        return view


@functools.cache
def _item(page_bytes: int) -> np.dtype:
    return np.dtype((np.void, page_bytes))  # cached: a job may need it hundreds of times


def _as_rows(tensor: torch.Tensor) -> np.ndarray:
    """A 2-D uint8 numpy view of a KV tensor (no copy)."""
    return tensor.detach().numpy().view(np.uint8)


def _buffer_items(buffer: np.ndarray, batch: RowBatch) -> np.ndarray:
    """The batch's pages in the job buffer as ``void`` items, ``stride`` bytes apart."""
    n, page = len(batch.ids), batch.page_bytes  # n > 0: plans hold no empty spans
    end = batch.offset + (n - 1) * batch.stride + page
    region = buffer[batch.offset : end]
    if batch.stride == page:
        return region.view(_item(page))
    # The constructor, not ``as_strided`` (much dearer per call): one call per page batch and
    # extent, so a job spread over many extents pays it many times.
    return np.ndarray((n,), _item(page), buffer=region, strides=(batch.stride,))


def _check_buffer(plan: CopyPlan, buffer: np.ndarray) -> None:
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise ValueError(
            f"job buffer must be contiguous 1-D uint8, got {buffer.dtype} shape {buffer.shape}"
        )
    if buffer.nbytes != plan.nbytes:
        raise ValueError(f"buffer has {buffer.nbytes} bytes, the job needs {plan.nbytes}")
