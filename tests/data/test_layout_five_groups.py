"""DeepSeek-V4's KV cache shape on the chunk layout: 5 groups of 64, 64, 256, 4 and 8 tokens
per block (the groups vLLM allocated before the CPU build stopped at its first forward;
README "DeepSeek-V4"). Block sizes that are not multiples of each other give each group
its own block count, first block index and partial first chunk for the same token range.
The layout plans and copies per group, in blocks, so none of that may leak across groups.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierstore.data.layout import ChunkLayout, as_index

BLOCK_TOKENS = (64, 64, 256, 4, 8)  # per group
# (unpadded page bytes, row bytes) per group: each its own tensor, most rows padded.
PAGES = ((96, 128), (64, 64), (200, 256), (24, 32), (40, 48))
NUM_BLOCKS = 1024


def _layout(bpc: int) -> tuple[ChunkLayout, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    tensors = [
        torch.randint(-128, 127, (NUM_BLOCKS, row), dtype=torch.int8, generator=g)
        for _, row in PAGES
    ]
    return ChunkLayout(tensors, [[(p, page)] for p, (page, _) in enumerate(PAGES)], bpc), tensors


def _job(start: int, end: int) -> tuple[list[int], list[int]]:
    """Per group, the whole blocks inside tokens [start, end): (count, first block index)."""
    sizes, indices = [], []
    for tokens in BLOCK_TOKENS:
        first, last = -(-start // tokens), end // tokens
        sizes.append(max(last - first, 0))
        indices.append(first)
    return sizes, indices


@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize(("start", "end"), [(256, 1280), (192, 1000), (0, 60)])
def test_plan_follows_each_groups_own_block_mapping(bpc: int, start: int, end: int) -> None:
    layout, _ = _layout(bpc)
    sizes, indices = _job(start, end)
    plan = layout.plan(sizes, indices)
    for p, (n_blocks, first) in enumerate(zip(sizes, indices, strict=True)):
        chunks = [c for c in plan.chunks if c.group_pos == p]
        skip = first % bpc
        assert len(chunks) == -(-(n_blocks + skip) // bpc)
        assert all(c.nbytes == bpc * PAGES[p][0] for c in chunks)
        # Every block of the group is in exactly one chunk's slot mask, in order.
        slots = [
            j * bpc + s for j, c in enumerate(chunks) for s in range(bpc) if c.slot_mask >> s & 1
        ]
        assert slots == list(range(skip, skip + n_blocks))
    assert plan.nbytes == sum(c.nbytes for c in plan.chunks)
    assert [c.offset for c in plan.chunks] == [
        sum(c.nbytes for c in plan.chunks[:i]) for i in range(len(plan.chunks))
    ]


@pytest.mark.parametrize("bpc", [1, 4])
def test_roundtrip_of_five_groups_is_byte_exact(bpc: int) -> None:
    layout, tensors = _layout(bpc)
    originals = [t.clone() for t in tensors]
    sizes, indices = _job(192, 1000)  # partial first chunks in several groups
    total = sum(sizes)  # 329 blocks
    assert total <= NUM_BLOCKS // 2
    rng = np.random.default_rng(0)
    src = rng.permutation(NUM_BLOCKS // 2)[:total].astype(np.int32)  # blocks are per group
    dst = (NUM_BLOCKS // 2 + rng.permutation(NUM_BLOCKS // 2)[:total]).astype(np.int32)
    plan = layout.plan(sizes, indices)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    layout.gather(plan, as_index(src, layout.device), buf)
    for t in tensors:
        t.zero_()
    layout.scatter(plan, as_index(dst, layout.device), buf)

    start = 0
    for p, (page, _) in enumerate(PAGES):
        for k in range(sizes[p]):
            s, d = src[start + k], dst[start + k]
            assert torch.equal(tensors[p][d, :page], originals[p][s, :page]), (p, k)
        assert torch.count_nonzero(tensors[p][:, page:]) == 0  # padding never written
        start += sizes[p]
