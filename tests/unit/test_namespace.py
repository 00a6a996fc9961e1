"""Chunks are namespaced by everything that shapes their bytes, and nothing else."""

from __future__ import annotations

import dataclasses

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from tierstore.vllm.spec import namespace_for


def _config(**changes: object) -> OffloadingConfig:
    parallel = OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=True,
    )
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(32, ("model.layers.0.attn",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e1",
        model=OffloadingModelConfig("org/model", "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=parallel,
        kv_cache_layout="LBHNC",
    )
    for key, value in changes.items():
        if key in {"rank", "world_size", "tp_size", "data_parallel_index"}:
            parallel = dataclasses.replace(config.parallel, **{key: value})
            config = dataclasses.replace(config, parallel=parallel)
        else:
            config = dataclasses.replace(config, **{key: value})
    return config


def test_same_shape_same_namespace_whatever_the_engine_or_rank() -> None:
    base = namespace_for(_config())
    assert namespace_for(_config(engine_id="e2")) == base
    assert namespace_for(_config(data_parallel_index=3)) == base  # DP replicas share
    assert namespace_for(_config(rank=0)) == base


def test_anything_that_changes_the_bytes_changes_the_namespace() -> None:
    base = namespace_for(_config())
    variants = [
        _config(model=OffloadingModelConfig("org/other", "float16")),
        _config(model=OffloadingModelConfig("org/model", "bfloat16")),
        _config(cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=2)),
        _config(groups=(OffloadingGroupConfig(64, ("model.layers.0.attn",), 0),)),
        _config(tp_size=2, world_size=2),
        _config(kv_cache_layout="NHD"),
        _config(worker_kv_bytes_per_block=8192),
    ]
    namespaces = {namespace_for(v) for v in variants}
    assert base not in namespaces and len(namespaces) == len(variants)
    assert all(len(n) == 32 and int(n, 16) >= 0 for n in namespaces)  # hex: safe in paths


def test_engines_whose_pages_differ_never_share_keys() -> None:
    """Same model and dtype, other page bytes (e.g. another mamba_ssm_cache_dtype): the
    worker's size check would fail every HIT, so they must not share a namespace."""
    fp32_state = _config(worker_kv_bytes_per_block=4096 + 1024)
    bf16_state = _config(worker_kv_bytes_per_block=4096 + 512)
    assert namespace_for(fp32_state) != namespace_for(bf16_state)
    assert namespace_for(fp32_state) == namespace_for(_config(worker_kv_bytes_per_block=5120))
