"""How the pages of one transfer job are packed into one contiguous buffer, and back.

A job holds chunks of one or more KV cache groups, group by group in ``config.groups``
order, chunk order within a group (vLLM's ``GPULoadStoreSpec``). A chunk of group ``p``
is ``blocks_per_chunk`` *slots*; a slot is one block's record: the unpadded page of every
layer of the group, back to back. So a chunk is ``blocks_per_chunk * block_bytes(p)``
bytes, whatever the page padding or the other groups' page sizes.

The first chunk of a group may start part-way (vLLM's ``block_indices[p] %
blocks_per_chunk``), and so may a Mamba boundary store of one block: the slots a job did
not write are zero and left out of the chunk's ``slot_mask``, so a later load can refuse
to read them instead of restoring zeros.

Pure torch/numpy: no Ray, no vLLM. The buffer is a flat ``uint8`` tensor; the KV tensors
are ``(num_blocks, block_stride_bytes)`` int8 views as vLLM's ``CanonicalKVCaches`` gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Job plans kept per layout (a few hundred bytes each); the cache starts over when full.
_MAX_CACHED_PLANS = 4096


@dataclass(frozen=True)
class PageRef:
    """One layer's page inside a slot: which KV tensor, how many bytes, where in the slot."""

    tensor_idx: int
    page_bytes: int
    slot_offset: int


@dataclass(frozen=True)
class GroupLayout:
    refs: tuple[PageRef, ...]
    slot_bytes: int
    chunk_bytes: int


@dataclass(frozen=True)
class ChunkPlacement:
    """One chunk of a job: where it sits in the job buffer and which slots it covers."""

    group_pos: int
    offset: int
    nbytes: int
    slot_mask: int


@dataclass(frozen=True)
class _GroupSpan:
    group_pos: int
    offset: int  # of the group's first chunk in the job buffer
    n_chunks: int
    skip: int  # empty slots before the group's first block
    ids_start: int  # into the job's block_ids
    n_blocks: int


@dataclass(frozen=True)
class JobPlan:
    chunks: tuple[ChunkPlacement, ...]
    spans: tuple[_GroupSpan, ...]
    nbytes: int


def _slot_mask(first: int, end: int) -> int:
    """Bits [first, end) set."""
    return ((1 << end) - 1) & ~((1 << first) - 1)


class ChunkLayout:
    """Packs and unpacks job buffers for one worker's KV caches."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group_refs: Sequence[Sequence[tuple[int, int]]],
        blocks_per_chunk: int,
    ) -> None:
        """``group_refs[p]`` lists ``(tensor_idx, unpadded_page_bytes)`` per layer of group p."""
        if blocks_per_chunk <= 0:
            raise ValueError(f"blocks_per_chunk must be positive, got {blocks_per_chunk!r}")
        # Same-size reinterpretation: works for any strides, copies nothing.
        self.tensors = [t.view(torch.uint8) for t in tensors]
        self.blocks_per_chunk = blocks_per_chunk
        groups = []
        for p, refs in enumerate(group_refs):
            page_refs: list[PageRef] = []
            offset = 0
            for tensor_idx, page_bytes in refs:
                row_bytes = self.tensors[tensor_idx].shape[1]
                if page_bytes > row_bytes:
                    raise ValueError(
                        f"group {p}: page of {page_bytes} bytes exceeds its tensor's "
                        f"{row_bytes}-byte block"
                    )
                page_refs.append(PageRef(tensor_idx, page_bytes, offset))
                offset += page_bytes
            groups.append(GroupLayout(tuple(page_refs), offset, offset * blocks_per_chunk))
        self.groups: tuple[GroupLayout, ...] = tuple(groups)
        self._plans: dict[tuple[tuple[int, ...], tuple[int, ...]], JobPlan] = {}
        # Copy in 8-byte words when every page, row and base allows it: torch's row
        # gathers move int64 rows much faster than uint8 rows (docs/benchmarks.md).
        self._word = (
            _WORD
            if all(_aligned(t) for t in self.tensors)
            and all(r.page_bytes % _WORD_BYTES == 0 for g in groups for r in g.refs)
            else None
        )

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def chunk_bytes(self, group_pos: int) -> int:
        return self.groups[group_pos].chunk_bytes

    def plan(self, group_sizes: Sequence[int], block_indices: Sequence[int]) -> JobPlan:
        """Mirror of vLLM's block -> chunk mapping: block k of group p goes to slot skip + k."""
        if len(group_sizes) != len(self.groups) or len(block_indices) != len(self.groups):
            raise ValueError(
                f"job names {len(group_sizes)} groups, the KV cache has {len(self.groups)}"
            )
        bpc = self.blocks_per_chunk
        # A plan depends on the sizes and each group's first slot only: jobs of a serving
        # engine repeat a few shapes, and building one is Python work per chunk.
        shape = (tuple(map(int, group_sizes)), tuple(int(i) % bpc for i in block_indices))
        cached = self._plans.get(shape)
        if cached is None:
            if len(self._plans) >= _MAX_CACHED_PLANS:
                self._plans.clear()
            cached = self._plans[shape] = self._build_plan(*shape)
        return cached

    def _build_plan(self, group_sizes: tuple[int, ...], skips: tuple[int, ...]) -> JobPlan:
        bpc = self.blocks_per_chunk
        chunks: list[ChunkPlacement] = []
        spans: list[_GroupSpan] = []
        offset = ids_start = 0
        for p, (n_blocks, skip) in enumerate(zip(group_sizes, skips, strict=True)):
            if n_blocks == 0:
                continue
            n_chunks = -(-(n_blocks + skip) // bpc)
            spans.append(_GroupSpan(p, offset, n_chunks, skip, ids_start, n_blocks))
            chunk_bytes = self.groups[p].chunk_bytes
            for j in range(n_chunks):
                first = max(skip - j * bpc, 0)
                end = min(skip + n_blocks - j * bpc, bpc)
                chunks.append(ChunkPlacement(p, offset, chunk_bytes, _slot_mask(first, end)))
                offset += chunk_bytes
            ids_start += n_blocks
        return JobPlan(tuple(chunks), tuple(spans), offset)

    def _unit(self, buffer: torch.Tensor) -> int:
        """Bytes per element of the views used: 8 when everything is word-aligned."""
        return _WORD_BYTES if self._word is not None and _aligned(buffer) else 1

    def _slot_rows(self, buffer: torch.Tensor, span: _GroupSpan, unit: int) -> torch.Tensor:
        layout = self.groups[span.group_pos]
        region = buffer[span.offset : span.offset + span.n_chunks * layout.chunk_bytes]
        if self._word is not None and unit != 1:
            region = region.view(self._word)
        return region.view(span.n_chunks * self.blocks_per_chunk, layout.slot_bytes // unit)

    def _pages(self, ref: PageRef, unit: int) -> torch.Tensor:
        tensor = self.tensors[ref.tensor_idx]
        if self._word is not None and unit != 1:
            tensor = tensor.view(self._word)
        return tensor[:, : ref.page_bytes // unit]

    def gather(self, plan: JobPlan, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the job's pages into ``out`` (uint8, ``plan.nbytes``, on the KV device)."""
        if out.numel() != plan.nbytes:
            raise ValueError(f"buffer has {out.numel()} bytes, the job needs {plan.nbytes}")
        unit = self._unit(out)
        for span in plan.spans:
            rows = self._slot_rows(out, span, unit)
            ids = block_ids[span.ids_start : span.ids_start + span.n_blocks]
            rows[: span.skip].zero_()
            rows[span.skip + span.n_blocks :].zero_()
            filled = rows[span.skip : span.skip + span.n_blocks]
            refs = self.groups[span.group_pos].refs
            if len(refs) == 1 and filled.is_contiguous():  # whole slot: gather in place
                torch.index_select(self._pages(refs[0], unit), 0, ids, out=filled)
                continue
            for ref in refs:
                start = ref.slot_offset // unit
                filled[:, start : start + ref.page_bytes // unit] = self._pages(ref, unit)[ids]

    def scatter(self, plan: JobPlan, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
        """Copy the job's pages from ``buffer`` into the KV cache blocks ``block_ids``."""
        if buffer.numel() != plan.nbytes:
            raise ValueError(f"buffer has {buffer.numel()} bytes, the job needs {plan.nbytes}")
        unit = self._unit(buffer)
        for span in plan.spans:
            rows = self._slot_rows(buffer, span, unit)[span.skip : span.skip + span.n_blocks]
            ids = block_ids[span.ids_start : span.ids_start + span.n_blocks]
            for ref in self.groups[span.group_pos].refs:
                start = ref.slot_offset // unit
                pages = self._pages(ref, unit)
                pages[ids] = rows[:, start : start + ref.page_bytes // unit]


_WORD = torch.int64
_WORD_BYTES = 8


def _aligned(tensor: torch.Tensor) -> bool:
    """A uint8 tensor whose rows and base can be read as 8-byte words."""
    if tensor.dim() == 1:
        return tensor.data_ptr() % _WORD_BYTES == 0 and tensor.numel() % _WORD_BYTES == 0
    return (
        tensor.data_ptr() % _WORD_BYTES == 0
        and tensor.shape[1] % _WORD_BYTES == 0
        and tensor.stride(0) % _WORD_BYTES == 0
        and tensor.stride(1) == 1
    )


def as_index(block_ids: np.ndarray | Sequence[int], device: torch.device) -> torch.Tensor:
    """vLLM's int32 block ids as an int64 index tensor on the KV device."""
    return torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=device)
