"""End-to-end fixtures: one real Ray cluster for the session, engines in subprocesses."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.deploy.models import ENGINE_LIMITS, make_tiny_model
from tierstore.deploy.passes import REFERENCE_SPEC, TIERSTORE_SPEC, random_prompt

from tests.support import E2E_LOOKUP_TIMEOUT_MS, init_local_ray

REPO = Path(__file__).resolve().parents[2]
RAY_NAMESPACE = "tierstore-e2e"
CPU_BYTES = 1 << 30
_ENGINE_TIMEOUT_S = 900


# A torchvision stand-in for the engine processes (see tests/e2e/stubs/torchvision), used
# only where no torchvision is installed: deploy/setup.sh removes PyPI's, which cannot
# load beside the CPU torch, and Qwen3.6's vLLM module imports it through transformers.
STUBS = REPO / "tests" / "e2e" / "stubs"
_GROUP_SIZES_LOG = re.compile(r"kv cache group sizes \(([\d, ]+)\)")


class EngineRun(list):
    """One engine's passes (a list of pass dicts), with what vLLM reported about its KV cache."""

    def __init__(self, passes: list[dict[str, Any]], block_size: int, log: str) -> None:
        super().__init__(passes)
        self.block_size = block_size  # the scheduler's, after vLLM's adjustments
        self.log = log  # the engine processes' stdout and stderr

    def subset(self, *indices: int) -> EngineRun:
        """Some of the passes, with the same engine facts."""
        return EngineRun([self[i] for i in indices], self.block_size, self.log)

    @property
    def group_block_sizes(self) -> tuple[int, ...]:
        """Block size per KV cache group, from vLLM's log (which names them only when
        there are several groups: one group has the scheduler's block size)."""
        found = _GROUP_SIZES_LOG.search(self.log)
        if found is None:
            return (self.block_size,)
        return tuple(int(n) for n in found.group(1).split(","))


def _python_path() -> str:
    paths = [str(REPO)]
    if importlib.util.find_spec("torchvision") is None:
        paths.append(str(STUBS))
    return os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])


@pytest.fixture(scope="package")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cached = os.environ.get("TIERSTORE_TEST_MODELS")
    return Path(cached) if cached else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[str]:
    """A real local Ray cluster owned by the e2e tests; yields its address. Package-scoped:
    it is shut down before later folders (tests/vllm) start their own."""
    import ray

    yield init_local_ray(RAY_NAMESPACE)
    ray.shutdown()


@pytest.fixture(scope="package")
def run_engine(
    ray_cluster: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., EngineRun]:
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
    ) -> EngineRun:
        out = out_dir / f"run-{next(counter)}.json"
        env = dict(os.environ)
        env.update(
            RAY_ADDRESS=ray_address or ray_cluster,
            PYTHONPATH=_python_path(),
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
        log = proc.stdout + proc.stderr
        out.with_suffix(".log").write_text(f"{json.dumps(args)[:2000]}\n{log}")  # for post-mortems
        if proc.returncode != 0:
            raise AssertionError(
                f"engine run failed ({proc.returncode}):\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
            )
        result = json.loads(out.read_text())
        return EngineRun(result["passes"], result["block_size"], log)

    return run


def tierstore_extra(**overrides: Any) -> dict[str, Any]:
    return {
        **TIERSTORE_SPEC,
        "cpu_bytes_per_node": CPU_BYTES,
        "namespace": RAY_NAMESPACE,
        "lookup_timeout_ms": E2E_LOOKUP_TIMEOUT_MS,
        **overrides,
    }


@pytest.fixture(scope="package")
def tiny_model(models_dir: Path) -> Callable[[str, str], str]:
    def make(name: str, dtype: str = "float32") -> str:
        return str(make_tiny_model(name, models_dir, dtype))

    return make


# tierstore logs through Python's logging, which a vLLM process leaves unconfigured below
# WARNING. With VLLM_LOGGING_CONFIG_PATH pointing at this, every engine process (front
# end, engine core, workers) prints tierstore's INFO lines too, with its process id.
_LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(process)d %(name)s: %(message)s"}},
    "handlers": {
        "out": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {
        name: {"handlers": ["out"], "level": "INFO", "propagate": False}
        for name in ("vllm", "tierstore")
    },
}
_NAMESPACE_LOG = re.compile(
    r"INFO (\d+) tierstore\.vllm\.spec: tierstore (manager|worker rank \d+): namespace (\w+)"
)


@pytest.fixture(scope="package")
def tierstore_logs_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``extra_env`` for ``run_engine`` under which the engine's log holds tierstore's
    INFO lines (``logged_namespaces`` reads them)."""
    path = tmp_path_factory.mktemp("logging") / "logging.json"
    path.write_text(json.dumps(_LOGGING_CONFIG))
    return {"VLLM_LOGGING_CONFIG_PATH": str(path)}


def logged_namespaces(log: str) -> dict[str, tuple[int, str]]:
    """``role -> (process id, namespace)`` as the spec logged them (under
    ``tierstore_logs_env``): "manager" for the scheduler's, "worker rank N" for each
    worker's."""
    return {role: (int(pid), ns) for pid, role, ns in _NAMESPACE_LOG.findall(log)}


PROMPT = random_prompt(1000, seed=7)
FP32_LOGPROB_TOL = 1e-4
MIN_CACHED_FRACTION = 0.75
# vLLM on CPU turns prefix caching off for MLA models (below): no device cache to compare.
MLA_NO_PREFIX_CACHING_LOG = "MLA is enabled on a non-GPU platform; forcing chunked prefill"
WEIGHT_OFFLOAD = {"cpu_offload_gb": 0.01}  # --cpu-offload-gb: some weights stay on the host


@dataclass(frozen=True)
class Family:
    """A tiny model of one KV cache family and what its parity test expects of it."""

    name: str
    dtype: str  # Qwen3-Next's and Qwen3.6's GDN kernel on the CPU build requires bf16
    block_sizes: tuple[int, ...]  # per KV cache group, as vLLM reports them
    engine: dict[str, Any] = field(default_factory=dict)  # beyond engine_for()
    device_cache: bool = True  # False: vLLM runs this family without prefix caching


# vLLM raises a GDN model's attention block until an attention page is as large as a GDN
# state page. Where the CPU has AVX-512 BF16, vLLM-CPU's accelerated GDN kernel keeps
# the SSM state in float32 (vllm/platforms/cpu.py: "Reset SSM cache type to float32"),
# twice the bytes of the bf16 state elsewhere: the tiny Qwen models then get 288-token
# blocks instead of 160 (measured on an AMD EPYC with avx512_bf16).
GDN_BLOCK = 288 if torch.cpu._is_avx512_bf16_supported() else 160

# MLA, one latent group. vLLM-CPU 0.32 picks its MLA backend by the CPU
# (vllm/platforms/cpu.py, get_attn_backend_cls):
# - with AMX tiles, AMX_MLA: it packs the absorbed weights for AMX, bf16 only (float32
#   fails at load, v1/attention/backends/mla/amx_mla.py:303), and keeps the block size
#   and prefix caching;
# - without, the reference CPU_MLA: block 16, and prefix caching and chunked prefill off
#   (cpu.py, lines 516-527). The device cache baseline then recomputes the whole prompt,
#   and a suffix computed over loaded context differs from a full prefill even in fp32,
#   so only the reference restore is compared (README "Families on the CPU build").
MLA_FAMILY = (
    Family("deepseek-v3", "bfloat16", (32,))
    if torch.cpu._is_amx_tile_supported()
    else Family("deepseek-v3", "float32", (16,), device_cache=False)
)

FAMILIES = [
    Family("llama", "float32", (32,)),
    Family("gemma3", "float32", (32, 32, 32)),  # sliding + full attention
    Family("gpt-oss", "float32", (32, 32)),  # sliding + full attention
    Family("qwen3-next", "bfloat16", (GDN_BLOCK,) * 4),  # 3 GDN (Mamba-style state) + 1 full
    Family("nemotron-h", "float32", (32, 32, 32)),  # Mamba2 (align mode) + full attention
    # Gemma 4: sliding layers of head dim 32, full ones of 64, per-layer embeddings. vLLM
    # gives the groups one page size, so the full layers' blocks hold half the tokens.
    # With weight offloading (--cpu-offload-gb), the combination vLLM's report was about.
    Family("gemma4", "float32", (64, 64, 32), engine=WEIGHT_OFFLOAD),
    # Qwen3.6: GDN + full attention. vLLM raises the block (GDN_BLOCK) so an attention
    # page is as large as a GDN state page (the group's "Mamba-style" state exists only
    # where a block ends), so a restore resumes at the last block boundary before the
    # prompt's final token: 960 of 1,000 at 160 (README "Families on the CPU build").
    Family("qwen3.6", "bfloat16", (GDN_BLOCK,) * 3, engine=WEIGHT_OFFLOAD),
    Family("qwen3.6-moe", "bfloat16", (GDN_BLOCK,) * 3),
    Family("llama4", "float32", (32, 32, 32, 32)),  # chunked local attention + NoPE full
    MLA_FAMILY,
]
FAMILY = {f.name: f for f in FAMILIES}


def only(passes: list[dict[str, Any]], index: int, request: int = 0) -> dict[str, Any]:
    """One request's result in one pass."""
    return passes[index]["requests"][request]


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def engine_for(tiny_model: Callable[[str, str], str], name: str, dtype: str) -> dict[str, Any]:
    return {"model": tiny_model(name, dtype), "dtype": dtype, **ENGINE_LIMITS.get(name, {})}


class FamilyRuns(dict):
    """Per family, PROMPT through two engines, run on first use (each engine takes about
    a minute to start, so once per session, and only for the families a run selects):

    - "tierstore": pass 1 computes and stores; the device prefix cache is reset; pass 2
      loads from tierstore.
    - the reference restore: pass 1 computes and stores; pass 2 hits vLLM's own device
      prefix cache (the connector has nothing to load past it); reset; pass 3 loads from
      the reference restore. "device" is its passes 1 and 2 ("device"[1] is the hit),
      "reference" its passes 1 and 3, so both read like the tierstore engine's.
    """

    def __init__(self, run_engine: Callable[..., EngineRun], tiny_model: Callable) -> None:
        super().__init__()
        self._run_engine = run_engine
        self._tiny_model = tiny_model

    def __missing__(self, name: str) -> dict[str, EngineRun]:
        family = FAMILY[name]
        engine = {**engine_for(self._tiny_model, name, family.dtype), **family.engine}
        run = self._run_engine
        tierstore = run({**engine, "kv_extra_config": tierstore_extra()}, [PROMPT], 2)
        reference = run(
            {**engine, "kv_extra_config": REFERENCE_SPEC}, [PROMPT], 3, resets=[False, True, True]
        )
        self[name] = {
            "tierstore": tierstore,
            "reference": reference.subset(0, 2),
            "device": reference.subset(0, 1),
        }
        return self[name]


@pytest.fixture(scope="package")
def runs(run_engine, tiny_model) -> FamilyRuns:
    return FamilyRuns(run_engine, tiny_model)


def run_scenario(
    module: str, model: str, out: Path, timeout_s: float, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs ``python -m module model out`` (a scenario driving a Ray cluster of its own)
    and returns the facts it wrote to ``out``; raises with its output if it failed."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **(extra_env or {}),
    }
    env.pop("RAY_ADDRESS", None)  # the scenario drives a cluster of its own
    proc = subprocess.run(
        [sys.executable, "-m", module, model, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    facts = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode != 0:
        raise AssertionError(
            f"{module} failed ({proc.returncode}); facts so far {facts}\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return facts
