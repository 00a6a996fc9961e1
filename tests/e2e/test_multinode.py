"""Across simulated nodes (``ray.cluster_utils``): cross-node loads, TP shards, node loss.

The CPU build refuses vLLM's Ray executor ("current platform cpu does not support ray"),
so an engine on a chosen node is a Ray actor pinned there (``tierstore/deploy/engine_host.py``),
which is what the Ray executor's workers are; TP=2 runs with vLLM's multiprocessing
executor.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest
import ray
from tierstore.actors.bootstrap import find_node_store

from tests.e2e.conftest import (
    FP32_LOGPROB_TOL,
    MIN_CACHED_FRACTION,
    PROMPT,
    RAY_NAMESPACE,
    engine_for,
    max_logprob_diff,
    only,
    run_scenario,
    tierstore_extra,
)

pytestmark = pytest.mark.e2e

_SCENARIO_TIMEOUT_S = 900
_PROMPT_TOKENS = 1000
_BLOCK = 32


@pytest.fixture(scope="module")
def multinode(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("multinode") / "facts.json"
    extra_env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return run_scenario(
        "tests.e2e.multinode_scenario", tiny_model("llama"), out, _SCENARIO_TIMEOUT_S, extra_env
    )


def test_an_engine_on_another_node_loads_what_the_first_stored(multinode: dict[str, Any]) -> None:
    facts = multinode
    assert facts["engine_a_node"] == facts["node_a"]
    assert facts["engine_b_node"] == facts["node_b"] != facts["node_a"]
    computed, loaded = facts["a"], facts["b_from_a"]
    assert computed["num_cached_tokens"] == 0
    assert loaded["num_cached_tokens"] >= MIN_CACHED_FRACTION * _PROMPT_TOKENS
    assert loaded["tokens"] == computed["tokens"]
    assert max_logprob_diff(loaded, computed) <= FP32_LOGPROB_TOL
    # The bytes came from node A's NodeStore (engine A was already dead) ...
    chunks = loaded["num_cached_tokens"] // _BLOCK
    served = facts["node_a_after"]["stats"]["loaded_shards"]
    assert served - facts["node_a_before"]["stats"]["loaded_shards"] == chunks
    # ... and node B holds none of them.
    assert facts["node_b_after"]["cpu"]["chunks"] == 0


def test_a_chunk_node_b_keeps_loading_gets_a_copy_on_b_that_outlives_node_a(
    multinode: dict[str, Any],
) -> None:
    facts = multinode
    expected = facts["a_hot"]["tokens"]
    # Loaded from node A twice (replicate_after_loads = 2) ...
    for run in facts["b_hot_remote"]:
        assert run["num_cached_tokens"] >= MIN_CACHED_FRACTION * _PROMPT_TOKENS
        assert run["tokens"] == expected
    # ... then from node B's own copy: B's NodeStore served every chunk of the third run.
    local = facts["b_hot_local"]
    assert local["num_cached_tokens"] >= MIN_CACHED_FRACTION * _PROMPT_TOKENS
    assert local["tokens"] == expected
    assert max_logprob_diff(local, facts["a_hot"]) <= FP32_LOGPROB_TOL
    before, after = facts["node_b_before_hot"]["stats"], facts["node_b_after_hot"]["stats"]
    assert after["replicas_received"] >= local["num_cached_tokens"] // _BLOCK
    assert after["loaded_shards"] - before["loaded_shards"] == local["num_cached_tokens"] // _BLOCK
    # Node A is gone, HOT is not: it hits from B, with the same output.
    survived = facts["b_hot_after_loss"]
    assert survived["num_cached_tokens"] >= MIN_CACHED_FRACTION * _PROMPT_TOKENS
    assert survived["tokens"] == expected


def test_losing_the_storing_node_turns_hits_into_correct_recomputes(
    multinode: dict[str, Any],
) -> None:
    facts = multinode
    assert facts["node_a"] not in facts["status_nodes"]
    assert facts["node_b"] in facts["status_nodes"]
    after_loss, again = facts["b_after_loss"], facts["b_again"]
    assert after_loss["num_cached_tokens"] == 0  # node A's chunks are gone, not hung on
    assert after_loss["tokens"] == facts["a"]["tokens"]
    # The recompute was stored on node B, and served from there next time.
    assert again["num_cached_tokens"] >= MIN_CACHED_FRACTION * _PROMPT_TOKENS
    assert again["tokens"] == facts["a"]["tokens"]
    assert facts["node_b_end"]["stats"]["loaded_shards"] >= again["num_cached_tokens"] // _BLOCK


def _two_cpu_binding() -> str:
    """One core list per rank: the CPU build refuses to bind 2 ranks on one NUMA node."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return f"{','.join(map(str, cores[:half]))}|{','.join(map(str, cores[half:] or cores))}"


def test_tp2_ranks_store_and_load_their_own_shards(run_engine, tiny_model, runs) -> None:
    # ``runs`` first stored PROMPT with TP=1 engines of the same model: a TP=2 engine must
    # not read those (the namespace includes the parallel layout).
    assert runs["llama"]["tierstore"][1]["requests"][0]["num_cached_tokens"] > 0
    engine = {**engine_for(tiny_model, "llama", "float32"), "tensor_parallel_size": 2}
    passes = run_engine(
        {**engine, "kv_extra_config": tierstore_extra()},
        [PROMPT],
        2,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": _two_cpu_binding()},
    )
    computed, loaded = only(passes, 0), only(passes, 1)
    assert computed["num_cached_tokens"] == 0
    assert loaded["num_cached_tokens"] >= MIN_CACHED_FRACTION * len(PROMPT)
    assert loaded["tokens"] == computed["tokens"]
    assert max_logprob_diff(loaded, computed) <= FP32_LOGPROB_TOL
    # Both ranks stored a shard of every chunk.
    node = ray.get_runtime_context().get_node_id()
    inventory = ray.get(find_node_store(RAY_NAMESPACE, node).inventory.remote())
    ranks: dict[tuple[str, bytes], set[int]] = defaultdict(set)
    for (namespace, key, rank), _tier in inventory:
        ranks[(namespace, key)].add(rank)
    tp2_chunks = [k for k, r in ranks.items() if r == {0, 1}]
    assert len(tp2_chunks) >= loaded["num_cached_tokens"] // _BLOCK


def test_an_engine_keeps_serving_while_the_evictor_restarts(multinode: dict[str, Any]) -> None:
    facts = multinode
    expected = facts["a"]["tokens"]
    # Served at once, right after the kill: lookups become misses, never errors.
    assert facts["b_evictor_down"]["tokens"] == expected
    # Rebuilt from the NodeStores' inventories, the index serves the prefix again.
    rebuilt = facts["b_rebuilt"]
    assert rebuilt["num_cached_tokens"] >= MIN_CACHED_FRACTION * _PROMPT_TOKENS
    assert rebuilt["tokens"] == expected
