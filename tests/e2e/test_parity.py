"""Output with tierstore equals output without it, for every KV cache family the CPU build runs.

Per model, three engines run the same ~1,000-token prompt twice:
- tierstore: pass 1 computes and stores; the device prefix cache is reset; pass 2 must
  load the prefix from tierstore's actors;
- the reference restore (an in-process byte copy, same connector path): tierstore's
  pass 2 must equal it bit for bit, in any dtype;
- no connector at all, with the device prefix cache kept: the same tokens, and in
  float32 log-probs within 1e-4.
"""

from __future__ import annotations

import pytest
from tierstore.deploy.passes import random_prompt

from tests.e2e.conftest import (
    FAMILIES,
    FP32_LOGPROB_TOL,
    MIN_CACHED_FRACTION,
    PROMPT,
    REFERENCE_SPEC,
    max_logprob_diff,
    only,
    tierstore_extra,
)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("name", "dtype"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_restore_matches_reference_and_device_cache(runs, name: str, dtype: str) -> None:
    tierstore, reference, device = (runs[name][k] for k in ("tierstore", "reference", "device"))
    cold, restored = only(tierstore, 0), only(tierstore, 1)

    # Every family hashes PROMPT to the same block hashes (vLLM hashes tokens only), and
    # the families before this one stored theirs on the same cluster: keys collide, and
    # only the namespace (model, dtype, layout, ...) keeps this engine from reading them.
    assert cold["num_cached_tokens"] == 0
    assert restored["num_cached_tokens"] >= MIN_CACHED_FRACTION * len(PROMPT), restored
    # Same connector path, same hit boundary, same bytes: identical output.
    ref_restored = only(reference, 1)
    assert restored["num_cached_tokens"] == ref_restored["num_cached_tokens"]
    assert restored["tokens"] == ref_restored["tokens"]
    assert restored["logprobs"] == ref_restored["logprobs"]
    # Against the device prefix cache, without tierstore.
    device_hit = only(device, 1)
    assert device_hit["num_cached_tokens"] > 0
    assert restored["tokens"] == device_hit["tokens"] == cold["tokens"]
    if dtype == "float32":
        assert max_logprob_diff(restored, device_hit) <= FP32_LOGPROB_TOL


def test_parity_checks_catch_a_wrong_restore(runs, run_engine, tiny_model) -> None:
    """A restore that flips the loaded bytes must fail the checks the tests above rely on."""
    engine = {
        "model": tiny_model("llama", "float32"),
        "kv_extra_config": {**REFERENCE_SPEC, "reference_corrupts_loads": True},
    }
    wrong = only(run_engine(engine, [PROMPT], 2), 1)
    right = only(runs["llama"]["tierstore"], 1)
    assert wrong["num_cached_tokens"] == right["num_cached_tokens"]
    assert wrong["logprobs"] != right["logprobs"]
    assert max_logprob_diff(wrong, right) > 100 * FP32_LOGPROB_TOL


def test_weight_offloading_beside_tierstore_keeps_parity(runs, run_engine, tiny_model) -> None:
    """Qwen3-Next raises its block size to 288; with --cpu-offload-gb that mix once broke vLLM."""
    engine = {
        "model": tiny_model("qwen3-next", "bfloat16"),
        "dtype": "bfloat16",
        "cpu_offload_gb": 0.01,
        "kv_extra_config": tierstore_extra(),
    }
    prompt = random_prompt(1000, seed=11)
    offloaded = run_engine(engine, [prompt], 2)
    reference = run_engine({**engine, "kv_extra_config": REFERENCE_SPEC}, [prompt], 2)
    cold, restored = only(offloaded, 0), only(offloaded, 1)
    assert restored["num_cached_tokens"] >= MIN_CACHED_FRACTION * len(prompt)
    assert restored["tokens"] == cold["tokens"]
    assert restored["tokens"] == only(reference, 1)["tokens"]
    assert restored["logprobs"] == only(reference, 1)["logprobs"]


def test_second_engine_in_new_process_reuses_stored_prefix(run_engine, tiny_model) -> None:
    engine = {"model": tiny_model("llama", "float32"), "kv_extra_config": tierstore_extra()}
    prompt = random_prompt(1000, seed=23)
    first = only(run_engine(engine, [prompt], 1), 0)
    second = only(run_engine(engine, [prompt], 1), 0)
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] >= MIN_CACHED_FRACTION * len(prompt)
    assert second["tokens"] == first["tokens"]
    assert max_logprob_diff(second, first) <= FP32_LOGPROB_TOL
