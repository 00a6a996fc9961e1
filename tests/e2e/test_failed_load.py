"""A load that fails after its HIT recomputes the request; the engine keeps serving.

Through ``TierStoreConnector`` (``tierstore.connector``) and
``kv_load_failure_policy="recompute"``, as ``deploy/passes.py`` configures every engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import (
    FP32_LOGPROB_TOL,
    MIN_CACHED_FRACTION,
    REPO,
    engine_for,
    max_logprob_diff,
    tierstore_extra,
)

pytestmark = pytest.mark.e2e

_TIMEOUT_S = 900


def _run_fault(ray_address: str, engine: dict[str, Any], fault: str, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(
        RAY_ADDRESS=ray_address,
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    )
    args = json.dumps({"engine": engine, "fault": fault})
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.fault_runner", args, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"fault run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    ("fault", "name", "dtype"),
    [("corrupt", "gemma3", "float32"), ("kill", "llama", "float32")],
)
def test_a_failed_load_recomputes_and_the_engine_keeps_serving(
    ray_cluster: str, tiny_model, tmp_path: Path, fault: str, name: str, dtype: str
) -> None:
    namespace = f"tierstore-e2e-failed-load-{fault}"
    engine = {
        **engine_for(tiny_model, name, dtype),
        "kv_extra_config": tierstore_extra(namespace=namespace),
    }
    facts = _run_fault(ray_cluster, engine, fault, tmp_path / "facts.json")
    print(json.dumps(facts, indent=1))  # shown when an assertion fails

    first, after = facts["first"], facts["after_fault"]
    assert first["num_cached_tokens"] == 0  # computed: what an engine without tierstore gives
    # The load after the HIT failed and was counted; the request was recomputed.
    assert facts["counters"]["tierstore:failed_loads"] == 1
    assert after["tokens"] == first["tokens"]
    assert max_logprob_diff(after, first) <= FP32_LOGPROB_TOL
    if fault == "corrupt":
        assert facts["corrupted_shards"] > 0
        assert facts["node_store"]["stats"]["corrupt_after_hit"] == 1  # found, dropped

    # The engine kept serving, and tierstore with it: OTHER is stored, then loaded.
    again = facts["other_again"]
    assert again["tokens"] == facts["other_first"]["tokens"]
    assert max_logprob_diff(again, facts["other_first"]) <= FP32_LOGPROB_TOL
    assert again["num_cached_tokens"] >= MIN_CACHED_FRACTION * 1000
    assert facts["counters_at_end"]["tierstore:failed_loads"] == 1
