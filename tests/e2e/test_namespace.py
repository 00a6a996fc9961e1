"""A namespace is the identity of the bytes: engines on one model path whose KV differs
never read each other's chunks (issue 26).

Found as a new user: an engine stored two prompts on a tiny Llama; then an engine on the
same path with ``hf_overrides``, and one after the weights were replaced in place, each
loaded ~1,400 prompt tokens of the first engine's KV (wrong output, checksums passing).

Here, on a model folder of this module's own (its weights get replaced), one engine at a
time, the device prefix cache emptied before every request (so each cached token came
from tierstore):

- A stores PROMPTS. It also shows that vLLM's own block hashes keep ``cache_salt``
  requests apart: PROMPTS[0] with a salt loads nothing, then hits its own salted chunks.
- The weights are replaced in place (same config, names and sizes; new values).
  C, otherwise A's engine, loads nothing of A's.
- B (C's weights, ``hf_overrides``) loads nothing of C's or A's.
- D (C's weights, another ``revision``) loads nothing either. A quantization would do as
  well, but the CPU build has no fp8 kernels (``_C::static_scaled_fp8_quant``), so
  ``tests/unit/test_namespace.py`` covers quantization.
- Each one's output equals the same engine's without tierstore (B0, C0; a local folder
  has one revision, so D's is C0).

In every engine the scheduler and the worker (two processes) derive the same namespace.
Six engine starts (about a minute each here): A, C, B, D, B0, C0.
"""

from __future__ import annotations

from typing import Any

import pytest
from tierstore.deploy.cli import collect_status
from tierstore.deploy.models import make_tiny_model, replace_weights
from tierstore.deploy.passes import random_prompt

from tests.e2e.conftest import (
    FP32_LOGPROB_TOL,
    MIN_CACHED_FRACTION,
    RAY_NAMESPACE,
    EngineRun,
    logged_namespaces,
    max_logprob_diff,
    tierstore_extra,
)
from tierstore.errors import TierStoreError

pytestmark = pytest.mark.e2e

PROMPTS = [random_prompt(512, seed=41), random_prompt(512, seed=42)]
SALT = "tenant-b"
HF_OVERRIDES = {"rms_norm_eps": 0.3}
TIERSTORE_ENGINES = ("A", "C", "B", "D")


def _loaded_shards() -> int:
    """Shards that tierstore's NodeStores served, all told (0 before any actor runs)."""
    try:
        nodes = collect_status(RAY_NAMESPACE)["nodes"]
    except TierStoreError:
        return 0
    return sum(node["stats"]["loaded_shards"] for node in nodes)


@pytest.fixture(scope="module")
def engines(
    run_engine, tmp_path_factory: pytest.TempPathFactory, tierstore_logs_env: dict[str, str]
) -> dict[str, Any]:
    model = make_tiny_model("llama", tmp_path_factory.mktemp("namespace-model"))
    base: dict[str, Any] = {"model": str(model), "dtype": "float32"}
    with_tierstore = {**base, "kv_extra_config": tierstore_extra()}
    overrides = {"llm_kwargs": {"hf_overrides": HF_OVERRIDES}}
    revision = {"llm_kwargs": {"revision": "v2"}}
    runs: dict[str, Any] = {"loaded_shards": {}}

    def run(name: str, engine: dict[str, Any], **kw: Any) -> None:
        before = _loaded_shards()
        runs[name] = run_engine(
            engine,
            kw.pop("prompts", PROMPTS),
            1,
            extra_env=tierstore_logs_env,
            reset_each=True,
            **kw,
        )
        runs["loaded_shards"][name] = _loaded_shards() - before

    # PROMPTS[0] and [1]; PROMPTS[0] salted twice (the second hits the first's chunks);
    # PROMPTS[0] again, unsalted (hits its own chunks).
    run(
        "A",
        with_tierstore,
        prompts=[*PROMPTS, PROMPTS[0], PROMPTS[0], PROMPTS[0]],
        cache_salts=[None, None, SALT, SALT, None],
    )
    replace_weights(model, "llama", seed=1)
    run("C", with_tierstore)
    run("B", {**with_tierstore, **overrides})
    run("D", {**with_tierstore, **revision})
    run("B0", {**base, **overrides})
    run("C0", base)
    return runs


def _requests(run: EngineRun) -> list[dict[str, Any]]:
    return run[0]["requests"]


@pytest.mark.parametrize(
    ("name", "without_tierstore"),
    [("C", "C0"), ("B", "B0"), ("D", "C0")],
    ids=["weights-replaced-in-place", "hf-overrides", "revision"],
)
def test_an_engine_whose_kv_differs_loads_nothing_and_computes_its_own(
    engines: dict[str, Any], name: str, without_tierstore: str
) -> None:
    stored_by_a = _requests(engines["A"])
    for i, (request, alone) in enumerate(
        zip(_requests(engines[name]), _requests(engines[without_tierstore]), strict=True)
    ):
        # A (and the engines before this one) stored this very prompt on this path.
        assert request["num_cached_tokens"] == 0, (name, i, request["num_cached_tokens"])
        assert request["tokens"] == alone["tokens"], (name, i)
        assert max_logprob_diff(request, alone) <= FP32_LOGPROB_TOL, (name, i)
        # This engine computes other KV than A's: A's chunks would have changed its
        # output (D's weights are C's: this holds for B, C and D alike).
        assert max_logprob_diff(request, stored_by_a[i]) > 100 * FP32_LOGPROB_TOL, (name, i)
    assert engines["loaded_shards"][name] == 0


def test_the_first_engine_stored_and_reloads_its_own_prompts(engines: dict[str, Any]) -> None:
    """The positive control: what the other engines did not load was there to load."""
    first, second, _, _, again = _requests(engines["A"])
    assert first["num_cached_tokens"] == second["num_cached_tokens"] == 0
    assert again["num_cached_tokens"] >= MIN_CACHED_FRACTION * len(PROMPTS[0])
    assert again["tokens"] == first["tokens"]
    assert max_logprob_diff(again, first) <= FP32_LOGPROB_TOL


def test_vllms_block_hashes_keep_cache_salts_apart(engines: dict[str, Any]) -> None:
    """The same tokens under another ``cache_salt`` get other block hashes (vLLM puts the
    salt in the first block's extra keys, and every later hash chains from it), so they
    never hit the unsalted chunks in tierstore, and do hit their own."""
    first, _, salted, salted_again, _ = _requests(engines["A"])
    assert salted["num_cached_tokens"] == 0
    assert salted["tokens"] == first["tokens"]
    assert salted_again["num_cached_tokens"] >= MIN_CACHED_FRACTION * len(PROMPTS[0])
    assert salted_again["tokens"] == salted["tokens"]


def test_scheduler_and_worker_derive_the_same_namespace(engines: dict[str, Any]) -> None:
    """The engine core (scheduler) and its worker are two processes, each building the
    spec from its own copy of the engine config: same namespace. Each engine whose KV
    differs has its own."""
    namespaces = {}
    for name in TIERSTORE_ENGINES:
        logged = logged_namespaces(engines[name].log)
        assert set(logged) == {"manager", "worker rank 0"}, (name, logged)
        (scheduler_pid, scheduler_ns), (worker_pid, worker_ns) = (
            logged["manager"],
            logged["worker rank 0"],
        )
        assert scheduler_pid != worker_pid, name
        assert scheduler_ns == worker_ns, name
        namespaces[name] = scheduler_ns
    assert len(set(namespaces.values())) == len(TIERSTORE_ENGINES), namespaces
