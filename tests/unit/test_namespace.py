"""Chunks are namespaced by everything that shapes their bytes or their meaning, and
nothing else: the byte shape (``OffloadingConfig``) and the engine identity (vLLM's model
hash, cache settings, a fingerprint of the weights: ``tierstore.vllm.model_identity``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
from tierstore.deploy.models import make_tiny_model, replace_weights
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from tierstore.errors import TierStoreError
from tierstore.spec import TierStoreSpec
from tierstore.vllm import model_identity
from tierstore.vllm.model_identity import building_for, engine_identity, weights_fingerprint
from tierstore.vllm.spec import namespace_for

# An engine identity for the shape tests: what engine_identity returns, in form.
ENGINE = {"model": "m" * 64, "weights": "w" * 64, "cache": {"cache_dtype": "auto"}}


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
    base = namespace_for(_config(), ENGINE)
    assert namespace_for(_config(engine_id="e2"), ENGINE) == base
    assert namespace_for(_config(data_parallel_index=3), ENGINE) == base  # DP replicas share
    assert namespace_for(_config(rank=0), ENGINE) == base


def test_anything_that_changes_the_bytes_changes_the_namespace() -> None:
    base = namespace_for(_config(), ENGINE)
    variants = [
        _config(model=OffloadingModelConfig("org/other", "float16")),
        _config(model=OffloadingModelConfig("org/model", "bfloat16")),
        _config(cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=2)),
        _config(groups=(OffloadingGroupConfig(64, ("model.layers.0.attn",), 0),)),
        _config(tp_size=2, world_size=2),
        _config(kv_cache_layout="NHD"),
        _config(worker_kv_bytes_per_block=8192),
    ]
    namespaces = {namespace_for(v, ENGINE) for v in variants}
    assert base not in namespaces and len(namespaces) == len(variants)
    assert all(len(n) == 32 and int(n, 16) >= 0 for n in namespaces)  # hex: safe in paths


def test_engines_whose_pages_differ_never_share_keys() -> None:
    """Same model and dtype, other page bytes (e.g. another mamba_ssm_cache_dtype): the
    worker's size check would fail every HIT, so they must not share a namespace."""
    fp32_state = _config(worker_kv_bytes_per_block=4096 + 1024)
    bf16_state = _config(worker_kv_bytes_per_block=4096 + 512)
    assert namespace_for(fp32_state, ENGINE) != namespace_for(bf16_state, ENGINE)
    assert namespace_for(fp32_state, ENGINE) == namespace_for(
        _config(worker_kv_bytes_per_block=5120), ENGINE
    )


def test_the_same_shape_of_another_engine_identity_is_another_namespace() -> None:
    """The page shape alone does not say which model computed the bytes."""
    base = namespace_for(_config(), ENGINE)
    for key in ENGINE:
        assert namespace_for(_config(), {**ENGINE, key: "other"}) != base, key


# --- The engine identity, from real vLLM configs of a real tiny model folder.


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"))


def _engine(model: str | Path, **model_kw: Any) -> Any:
    """The parts of a ``VllmConfig`` that the identity reads, as vLLM builds them."""
    from vllm.config import CacheConfig, LoadConfig, ModelConfig

    model_kw.setdefault("dtype", "float32")
    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, **model_kw)
    return types.SimpleNamespace(
        model_config=model_config,
        cache_config=CacheConfig(),
        load_config=LoadConfig(),
        speculative_config=None,
    )


def _namespace(engine: Any) -> str:
    return namespace_for(_config(), engine_identity(engine))


def test_revision_quantization_dtype_and_hf_overrides_change_the_namespace(
    model_dir: Path,
) -> None:
    """Each changes every K/V value under the same model name and page shape (the
    OffloadingConfig of all of these is the same: fp8 weights keep the KV dtype)."""
    base = _namespace(_engine(model_dir))
    variants = {
        "hf_overrides": _engine(model_dir, hf_overrides={"rms_norm_eps": 0.3}),
        "rope scaling": _engine(
            model_dir, hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
        ),
        "revision": _engine(model_dir, revision="v2"),
        "quantization": _engine(model_dir, quantization="fp8"),
        "dtype": _engine(model_dir, dtype="bfloat16"),
    }
    namespaces = {name: _namespace(engine) for name, engine in variants.items()}
    for name, namespace in namespaces.items():
        assert namespace != base, name
    assert len(set(namespaces.values())) == len(variants)


def test_settings_that_leave_the_kv_alone_keep_the_namespace(model_dir: Path) -> None:
    """vLLM may fit max_model_len to memory per engine; seeds and served names vary by
    deployment: none changes a K/V value, so engines keep sharing."""
    base = _namespace(_engine(model_dir))
    assert _namespace(_engine(model_dir, max_model_len=1024)) == base
    assert _namespace(_engine(model_dir, seed=5)) == base
    assert _namespace(_engine(model_dir, served_model_name="other")) == base
    assert _namespace(_engine(model_dir)) == base  # and it is deterministic


def test_the_identity_survives_the_trip_to_a_worker_process(model_dir: Path) -> None:
    """vLLM's workers get a pickled copy of the engine config: same identity."""
    engine = _engine(model_dir)
    copied = pickle.loads(pickle.dumps(engine))
    assert engine_identity(copied) == engine_identity(engine)


def test_weights_replaced_in_place_change_the_namespace(tmp_path: Path) -> None:
    """Same path, same config, same file names and sizes, new values: another namespace.
    Touching the files (or reading them) does not change it."""
    model = make_tiny_model("llama", tmp_path)
    weights = sorted(model.glob("*.safetensors"))
    sizes = [p.stat().st_size for p in weights]
    before = _namespace(_engine(model))
    for path in weights:
        os.utime(path)  # touched, bytes unchanged
    assert _namespace(_engine(model)) == before
    replace_weights(model, "llama", seed=1)
    assert [p.stat().st_size for p in sorted(model.glob("*.safetensors"))] == sizes
    after = _namespace(_engine(model))
    assert after != before
    replace_weights(model, "llama", seed=0)  # the first weights back: the first namespace
    assert _namespace(_engine(model)) == before


def test_a_pinned_model_identity_shares_across_paths_and_nothing_else(tmp_path: Path) -> None:
    """``model_identity`` pins the model part: the same weights at two paths share under
    one pin (their derived namespaces differ by name), another pin is another namespace,
    and the cache settings and page shape still count."""
    first = make_tiny_model("llama", tmp_path / "a")
    second = make_tiny_model("llama", tmp_path / "b")
    assert _namespace(_engine(first)) != _namespace(_engine(second))  # the name is in it

    def pinned(model: Path, pin: str, **model_kw: Any) -> str:
        return namespace_for(_config(), engine_identity(_engine(model, **model_kw), pin))

    assert pinned(first, "llama-tiny@1") == pinned(second, "llama-tiny@1")
    assert pinned(first, "llama-tiny@1") != pinned(first, "llama-tiny@2")
    assert pinned(first, "llama-tiny@1") != _namespace(_engine(first))
    cache = _engine(first)
    cache.cache_config.cache_dtype = "fp8"
    assert namespace_for(_config(), engine_identity(cache, "llama-tiny@1")) != pinned(
        first, "llama-tiny@1"
    )


def test_the_fingerprint_samples_each_tensor(tmp_path: Path, model_dir: Path) -> None:
    """One value changed in one tensor (at its start) changes the fingerprint; the file
    is never read whole."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (weights,) = model.glob("*.safetensors")
    before = weights_fingerprint(_engine(model).model_config).digest
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    import json

    header = json.loads(weights.read_bytes()[8 : 8 + header_len])
    last = max((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    offset = 8 + header_len + last[0]
    with open(weights, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    assert weights_fingerprint(_engine(model).model_config).digest != before


def test_the_same_bytes_elsewhere_share_the_weights_fingerprint(
    tmp_path: Path, model_dir: Path
) -> None:
    """Another node's copy (another folder, other modification times) and the HF cache's
    snapshot of the same files fingerprint alike: nodes keep sharing chunks."""
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy, copy_function=shutil.copyfile)  # new mtimes
    local = weights_fingerprint(_engine(model_dir).model_config)
    assert weights_fingerprint(_engine(copy).model_config).digest == local.digest

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "models--org--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    hub = types.SimpleNamespace(model="org/tiny", revision=None)
    found = weights_fingerprint(hub, download_dir=str(tmp_path / "hf"))
    assert found.digest == local.digest and commit in found.covers


def test_weights_not_found_fall_back_to_name_and_revision(
    caplog: pytest.LogCaptureFixture, model_dir: Path
) -> None:
    """A name never downloaded here (or an object store): the name and revision only,
    and the log says so."""
    hub = types.SimpleNamespace(model="org/never-downloaded", revision="v1")
    fingerprint = weights_fingerprint(hub)
    assert "name 'org/never-downloaded' and revision 'v1' only" in fingerprint.covers
    assert (
        weights_fingerprint(
            types.SimpleNamespace(model="org/never-downloaded", revision="v2")
        ).digest
        != fingerprint.digest
    )
    engine = _engine(model_dir)
    with caplog.at_level(logging.INFO, logger=model_identity.__name__):
        engine_identity(engine)
    assert "fingerprint covers 1 file(s)" in caplog.text
    assert "safetensors headers" in caplog.text


def test_the_spec_reads_the_engine_config_the_connector_hands_it(model_dir: Path) -> None:
    """``TierStoreConnector`` wraps the spec's construction in ``building_for``; a spec
    built where no engine config is reachable (the plain OffloadingConnector's scheduler)
    refuses to make a manager rather than share another model's namespace."""
    extra = {
        "spec_name": "TierStoreSpec",
        "spec_module_path": "tierstore.spec",
        "cpu_bytes_per_node": 1 << 20,
    }
    config = _config(extra_config=extra)
    engine = _engine(model_dir)
    with building_for(engine):
        spec = TierStoreSpec(config)
    assert spec.namespace == namespace_for(config, engine_identity(engine))
    with building_for(_engine(model_dir, hf_overrides={"rms_norm_eps": 0.3})):
        assert TierStoreSpec(config).namespace != spec.namespace

    blind = TierStoreSpec(config)
    assert blind.namespace is None
    with pytest.raises(TierStoreError, match="TierStoreConnector"):
        blind.get_manager()
