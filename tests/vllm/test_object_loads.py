"""Loads through the object store (another node's, or when the arena cannot serve): the
NodeStore puts its shards' extents in one object, the worker verifies each fetched shard
and scatters it in place. Real Ray and a real NodeStore; the same node stands for the
other one (the path is the same: a NodeStore call, an object, a get)."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from tierstore.actors.bootstrap import get_or_create_evictor
from tierstore.actors.clients import EvictorClient
from tierstore.actors.worker_ports import RayWorkerPorts
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.vllm.test_worker_roundtrip import _kv, _load_spec, _store_job, _worker
from tierstore.config import TierStoreConfig
from tierstore.data.checksum import digest
from tierstore.data.layout import ChunkLayout, ChunkPlacement, JobPlan
from tierstore.data.tiers.base import ShardMeta
from tierstore.errors import ChunkCorruptError
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.vllm.device_copy import Scatter, make_copier
from tierstore.vllm.object_loads import ObjectLoads, scatter_shards, verify
from tierstore.vllm.transfer_specs import LoadSpec

DST = GPULoadStoreSpec([20, 21, 22, 23, 24], group_sizes=[4, 1], block_indices=[0, 0])


@pytest.mark.parametrize("in_place", [True, False], ids=["per-shard", "one-buffer"])
def test_object_store_load_is_byte_exact(cfg: TierStoreConfig, in_place: bool) -> None:
    kv = _kv()
    original = [t.clone() for t in kv]
    worker = _worker(cfg, kv)
    keys = _store_job(worker)
    node = NodeId(ray.get_runtime_context().get_node_id())
    ports = RayWorkerPorts(cfg.namespace, node, [EvictorClient(get_or_create_evictor(cfg))], 30.0)
    layout = worker._layout
    plan = layout.plan(DST.group_sizes, DST.block_indices)
    copier = make_copier(layout)
    scatter = copier.prepare_scatter(plan, DST.block_ids)
    if not in_place:  # as the CUDA copier: one job buffer
        scatter = Scatter(lambda data: copier.scatter(plan, DST.block_ids, data))
    assert scatter.in_place is in_place

    ObjectLoads(ports, 0, 30.0).load(_load_spec(cfg, keys), plan, scatter)

    for s, d in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True):
        assert torch.equal(kv[0][d, :96], original[0][s, :96])
    assert torch.equal(kv[1][24, :200], original[1][5, :200])
    assert torch.equal(kv[0][20, 96:], original[0][20, 96:])  # padding untouched
    stats = ports.node_store(node).status().result()["stats"]
    assert stats["loaded_shards"] == 3


def _one_chunk() -> tuple[LoadSpec, JobPlan, np.ndarray, ShardMeta]:
    shard = np.arange(64, dtype=np.uint8)
    plan = JobPlan((ChunkPlacement(0, 0, 64, 0b11),), (), 64)
    spec = LoadSpec.build(Namespace("ab"), [ChunkKey(b"k" * 12)], [{0: NodeId("n")}])
    return spec, plan, shard, ShardMeta(64, digest(shard), 0b11)


def test_verify_accepts_a_good_shard() -> None:
    spec, plan, shard, meta = _one_chunk()
    verify(spec, plan, [0], [shard], [meta])


@pytest.mark.parametrize(
    "damage, message",
    [
        ("short", "got 63 bytes"),
        ("slots", "only 0x1"),
        ("count", "shards"),
        ("dtype", "int16"),
    ],
)
def test_verify_rejects_a_bad_shard(damage: str, message: str) -> None:
    spec, plan, shard, meta = _one_chunk()
    shards, metas = [shard.copy()], [meta]
    if damage == "short":
        shards = [shard[:63]]
    elif damage == "slots":
        metas = [ShardMeta(64, meta.digest, 0b01)]
    elif damage == "count":
        shards = []
    elif damage == "dtype":
        shards = [shard.view(np.int16)]
        metas = [ShardMeta(64, meta.digest, meta.slot_mask)]
    with pytest.raises(ChunkCorruptError, match=message):
        verify(spec, plan, [0], shards, metas)


@pytest.mark.parametrize("in_place", [True, False], ids=["per-shard", "one-buffer"])
def test_a_shard_that_fails_its_checksum_fails_the_load_by_name(in_place: bool) -> None:
    """Three fetched shards, the second one flipped: the load raises naming it, and no
    block of the third chunk is written (per shard: the C walk stops at the bad one;
    one buffer: every shard is hashed before any byte is copied)."""
    kv = [torch.zeros((8, 64), dtype=torch.int8)]
    layout = ChunkLayout(kv, [[(0, 64)]], blocks_per_chunk=1)
    plan = layout.plan([3], [0])
    keys = [ChunkKey(bytes([k]) * 12) for k in range(3)]
    spec = LoadSpec.build(Namespace("ab"), keys, [{0: NodeId("n")}] * 3)
    rng = np.random.default_rng(5)
    shards = [rng.integers(1, 256, 64, dtype=np.uint8) for _ in range(3)]
    fetched = [(s, digest(s)) for s in shards]
    fetched[1] = (shards[1], fetched[1][1] ^ 1)
    copier = make_copier(layout)
    scatter = copier.prepare_scatter(plan, [2, 4, 6])
    if not in_place:  # as the CUDA copier: one job buffer
        scatter = Scatter(lambda data: copier.scatter(plan, [2, 4, 6], data))
    with pytest.raises(ChunkCorruptError, match=keys[1].hex()):
        scatter_shards(scatter, spec, plan, fetched)
    assert not kv[0][6].any()  # the third chunk's block
    fetched[1] = (shards[1], digest(shards[1]))
    scatter_shards(scatter, spec, plan, fetched)
    for block, shard in zip([2, 4, 6], shards, strict=True):
        assert np.array_equal(kv[0][block].numpy().view(np.uint8), shard)
