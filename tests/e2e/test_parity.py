"""Output with tierstore equals output without it, for every KV cache family the CPU build runs.

Per model, two engines run the same ~1,000-token prompt (``conftest.FamilyRuns``):
- tierstore: pass 1 computes and stores; the device prefix cache is reset; pass 2 must
  load the prefix from tierstore's actors;
- the reference restore (an in-process byte copy, same connector path): tierstore's
  pass 2 must equal its restore bit for bit, in any dtype; the same engine's pass
  without a reset is vLLM's own device prefix cache: the same tokens, and in float32
  log-probs within 1e-4.
Gemma 4 and Qwen3.6 run with weight offloading (``--cpu-offload-gb``) beside tierstore,
the combination vLLM's own report was about: one engine pair covers both.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    FAMILIES,
    FP32_LOGPROB_TOL,
    MIN_CACHED_FRACTION,
    MLA_NO_PREFIX_CACHING_LOG,
    PROMPT,
    REFERENCE_SPEC,
    Family,
    max_logprob_diff,
    only,
    tierstore_extra,
)

pytestmark = pytest.mark.e2e

_IDS = [f.name for f in FAMILIES]


@pytest.mark.parametrize("family", FAMILIES, ids=_IDS)
def test_restore_matches_reference_and_device_cache(runs, family: Family) -> None:
    engines = runs[family.name]
    tierstore, reference, device = engines["tierstore"], engines["reference"], engines["device"]
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
    if not family.device_cache:
        # Not a gap in this test: vLLM itself says it runs the family without a prefix
        # cache (see conftest.FAMILIES), so there is no device hit to compare with.
        assert MLA_NO_PREFIX_CACHING_LOG in tierstore.log
        return
    # Against the device prefix cache, without tierstore.
    device_hit = only(device, 1)
    assert device_hit["num_cached_tokens"] > 0
    assert restored["tokens"] == device_hit["tokens"] == cold["tokens"]
    if family.dtype == "float32":
        assert max_logprob_diff(restored, device_hit) <= FP32_LOGPROB_TOL


@pytest.mark.parametrize("family", FAMILIES, ids=_IDS)
def test_tiny_models_keep_their_family_kv_cache_groups(runs, family: Family) -> None:
    """What tierstore restores is the group structure: the tiny model must keep its family's
    (group count, block size per group), as vLLM reports it in both engines."""
    for engine in ("tierstore", "reference"):
        assert runs[family.name][engine].group_block_sizes == family.block_sizes, engine


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


def test_second_engine_in_new_process_reuses_stored_prefix(runs, run_engine, tiny_model) -> None:
    """The Llama family's tierstore engine stored PROMPT and exited; a new engine process
    (new workers, new connector) loads it."""
    first = only(runs["llama"]["tierstore"], 0)
    engine = {"model": tiny_model("llama", "float32"), "kv_extra_config": tierstore_extra()}
    second = only(run_engine(engine, [PROMPT], 1), 0)
    assert second["num_cached_tokens"] >= MIN_CACHED_FRACTION * len(PROMPT)
    assert second["tokens"] == first["tokens"]
    assert max_logprob_diff(second, first) <= FP32_LOGPROB_TOL
