"""End-to-end fixtures: one real Ray cluster for the session, engines in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tierstore.deploy.models import ENGINE_LIMITS, make_tiny_model
from tierstore.deploy.passes import TIERSTORE_SPEC, random_prompt

from tests.support import LOOPBACK

REPO = Path(__file__).resolve().parents[2]
RAY_NAMESPACE = "tierstore-e2e"
CPU_BYTES = 1 << 30
_ENGINE_TIMEOUT_S = 900

REFERENCE_SPEC = {"spec_name": "ReferenceSpec", "spec_module_path": "tests.e2e.reference_spec"}


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cached = os.environ.get("TIERSTORE_TEST_MODELS")
    return Path(cached) if cached else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A real local Ray cluster owned by this test session; yields its address."""
    import ray

    # "local" starts a fresh cluster even if another runs on this machine.
    ray.init(
        address="local",
        namespace=RAY_NAMESPACE,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address=LOOPBACK,
    )
    address = ray.get_runtime_context().gcs_address
    yield address
    ray.shutdown()


@pytest.fixture(scope="session")
def run_engine(
    ray_cluster: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., list[dict[str, Any]]]:
    """Run one engine's passes in a fresh process; returns the passes as dicts."""
    out_dir = tmp_path_factory.mktemp("engine-runs")
    counter = iter(range(1_000_000))

    def run(
        engine: dict[str, Any],
        prompts: list[list[int]],
        n_passes: int,
        ray_address: str | None = None,
        extra_env: dict[str, str] | None = None,
        **kw: Any,
    ) -> list[dict[str, Any]]:
        out = out_dir / f"run-{next(counter)}.json"
        env = dict(os.environ)
        env.update(
            RAY_ADDRESS=ray_address or ray_cluster,
            PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        )
        env.update(extra_env or {})
        args = {"engine": engine, "prompts": prompts, "n_passes": n_passes, **kw}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.run_engine", json.dumps(args), str(out)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=_ENGINE_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"engine run failed ({proc.returncode}):\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
            )
        return json.loads(out.read_text())

    return run


def tierstore_extra(**overrides: Any) -> dict[str, Any]:
    return {
        **TIERSTORE_SPEC,
        "cpu_bytes_per_node": CPU_BYTES,
        "namespace": RAY_NAMESPACE,
        **overrides,
    }


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Callable[[str, str], str]:
    def make(name: str, dtype: str = "float32") -> str:
        return str(make_tiny_model(name, models_dir, dtype))

    return make


PROMPT = random_prompt(1000, seed=7)
FP32_LOGPROB_TOL = 1e-4
MIN_CACHED_FRACTION = 0.75

# (tiny model, dtype): Qwen3-Next's GDN kernel on the CPU build requires bf16.
FAMILIES = [
    ("llama", "float32"),  # 1 group
    ("gemma3", "float32"),  # 3 groups: sliding + full attention
    ("gpt-oss", "float32"),  # 2 groups: sliding + full attention
    ("qwen3-next", "bfloat16"),  # 2 groups: GDN (Mamba-style state) + full attention
    ("nemotron-h", "float32"),  # 3 groups: Mamba2 (align mode) + full attention
]


def only(passes: list[dict[str, Any]], index: int, request: int = 0) -> dict[str, Any]:
    """One request's result in one pass."""
    return passes[index]["requests"][request]


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def engine_for(tiny_model: Callable[[str, str], str], name: str, dtype: str) -> dict[str, Any]:
    return {"model": tiny_model(name, dtype), "dtype": dtype, **ENGINE_LIMITS.get(name, {})}


@pytest.fixture(scope="session")
def runs(run_engine, tiny_model) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Per family, PROMPT run twice by three engines (each takes about a minute, so once):
    tierstore (device cache reset between passes), the reference restore (likewise),
    and no connector with the device prefix cache kept."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, dtype in FAMILIES:
        engine = engine_for(tiny_model, name, dtype)
        out[name] = {
            "tierstore": run_engine({**engine, "kv_extra_config": tierstore_extra()}, [PROMPT], 2),
            "reference": run_engine({**engine, "kv_extra_config": REFERENCE_SPEC}, [PROMPT], 2),
            "device": run_engine(engine, [PROMPT], 2, reset_between=False),
        }
    return out
