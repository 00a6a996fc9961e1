"""Pack/unpack is byte-exact for groups of different page sizes, padding and partial chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierstore.data.layout import ChunkLayout, as_index


def _kv(num_blocks: int, row_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 127, (num_blocks, row_bytes), dtype=torch.int8, generator=g)


def _layout(bpc: int) -> tuple[ChunkLayout, list[torch.Tensor]]:
    # Tensor 0: attention pages of 96 bytes padded to 128-byte rows (two layers share it
    # as the HMA overlay does); tensor 1: a Mamba-like state page of 200 of 256 bytes.
    tensors = [_kv(16, 128, 1), _kv(16, 256, 2), _kv(16, 64, 3)]
    groups = [[(0, 96), (2, 64)], [(1, 200)], [(0, 128)]]
    return ChunkLayout(tensors, groups, bpc), tensors


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_roundtrip_restores_exact_bytes_and_leaves_padding_alone(bpc: int) -> None:
    layout, tensors = _layout(bpc)
    originals = [t.clone() for t in tensors]
    group_sizes, block_indices = [3, 1, 2], [5, 7, 0]
    src = np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)
    plan = layout.plan(group_sizes, block_indices)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    layout.gather(plan, as_index(src, layout.device), buf)

    for t in tensors:  # wipe, then restore into other blocks
        t.zero_()
    dst = np.array([9, 10, 11, 12, 13, 14], dtype=np.int32)
    layout.scatter(plan, as_index(dst, layout.device), buf)

    for p, refs in enumerate([[(0, 96), (2, 64)], [(1, 200)], [(0, 128)]]):
        start = sum(group_sizes[:p])
        for k in range(group_sizes[p]):
            for tensor_idx, page in refs:
                s, d = src[start + k], dst[start + k]
                assert torch.equal(tensors[tensor_idx][d, :page], originals[tensor_idx][s, :page])
    # Bytes past a group's unpadded page are never written.
    assert torch.count_nonzero(tensors[1][:, 200:]) == 0


def test_plan_sizes_and_slot_masks_follow_vllm_chunk_mapping() -> None:
    layout, _ = _layout(4)
    plan = layout.plan([3, 1, 0], [5, 7, 0])
    # group 0: skip 1, blocks in slots 1..3 of one chunk; group 1: skip 3, slot 3.
    assert [c.group_pos for c in plan.chunks] == [0, 1]
    assert [c.slot_mask for c in plan.chunks] == [0b1110, 0b1000]
    assert plan.chunks[0].nbytes == 4 * (96 + 64)
    assert plan.chunks[1].nbytes == 4 * 200
    assert plan.nbytes == sum(c.nbytes for c in plan.chunks)


def test_unwritten_slots_are_zero_so_digests_are_deterministic() -> None:
    layout, _ = _layout(4)
    plan = layout.plan([1, 0, 0], [2, 0, 0])
    buf = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8)
    layout.gather(plan, as_index([3], layout.device), buf)
    rows = buf.view(4, 160)
    assert torch.count_nonzero(rows[[0, 1, 3]]) == 0


def test_job_with_wrong_group_count_is_refused() -> None:
    layout, _ = _layout(1)
    with pytest.raises(ValueError, match="groups"):
        layout.plan([1, 1], [0, 0])


def test_pages_that_are_not_word_sized_take_the_byte_path_and_stay_exact() -> None:
    tensors = [_kv(8, 128, 5), _kv(8, 64, 6)]
    originals = [t.clone() for t in tensors]
    layout = ChunkLayout(tensors, [[(0, 100), (1, 37)]], blocks_per_chunk=2)
    assert layout._word is None
    plan = layout.plan([3], [1])
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    layout.gather(plan, as_index([1, 2, 3], layout.device), buf)
    layout.scatter(plan, as_index([5, 6, 7], layout.device), buf)
    for s, d in zip([1, 2, 3], [5, 6, 7], strict=True):
        assert torch.equal(tensors[0][d, :100], originals[0][s, :100])
        assert torch.equal(tensors[1][d, :37], originals[1][s, :37])
        assert torch.equal(tensors[0][d, 100:], originals[0][d, 100:])
