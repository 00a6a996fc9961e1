"""``tierstore demo``: a multi-turn chat served twice by a tiny hybrid model, on local Ray.

Gemma 3 style (sliding-window + full attention, 3 KV cache groups). The device prefix
cache is reset before every request, so every cached token below came from tierstore:
in pass 1, later turns reuse what earlier turns stored; in pass 2, everything does.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tierstore.deploy.models import make_tiny_model
from tierstore.deploy.passes import (
    TIERSTORE_SPEC,
    EngineSpec,
    build_llm,
    drain,
    random_prompt,
    run_pass,
    shutdown_engine,
    warm_up,
)

logger = logging.getLogger(__name__)

DEMO_NAMESPACE = "tierstore-demo"


def conversation_prompts(
    conversations: int = 3, turns: int = 3, system_tokens: int = 400, turn_tokens: int = 160
) -> list[list[int]]:
    """Turn t of a conversation repeats all earlier turns, as a chat client sends them."""
    prompts = []
    for c in range(conversations):
        history = random_prompt(system_tokens, seed=1000 + c)
        for t in range(turns):
            history = history + random_prompt(turn_tokens, seed=2000 + 10 * c + t)
            prompts.append(list(history))
    return prompts


@dataclass
class DemoResult:
    rows: list[dict[str, Any]]  # one per request: cached tokens and TTFT in both passes
    status: dict[str, Any]  # `tierstore status` once both passes' stores are indexed


def run_demo(
    models_dir: Path | None = None,
    cpu_bytes_per_node: int = 1 << 30,
    progress_file: TextIO | None = None,
) -> DemoResult:
    """Starts a local Ray cluster and one engine, runs both passes, then stops the engine
    and Ray, in that order (nothing is left to stop at interpreter exit). Progress bars
    go to ``progress_file`` when it is a terminal."""
    import ray

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(
        address="local", namespace=DEMO_NAMESPACE, include_dashboard=False, log_to_driver=False
    )
    try:
        # The engine's processes join this cluster through RAY_ADDRESS.
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        root = models_dir or Path(tempfile.gettempdir()) / "tierstore-models"
        llm = build_llm(_engine_spec(make_tiny_model("gemma3", root), cpu_bytes_per_node))
        try:
            return _serve_twice(llm, progress_file)
        finally:
            shutdown_engine(llm)
    finally:
        ray.shutdown()


def _engine_spec(model: Path, cpu_bytes_per_node: int) -> EngineSpec:
    return EngineSpec(
        model=str(model),
        kv_extra_config={
            **TIERSTORE_SPEC,
            "cpu_bytes_per_node": cpu_bytes_per_node,
            "namespace": DEMO_NAMESPACE,
        },
    )


def _serve_twice(llm: Any, progress_file: TextIO | None) -> DemoResult:
    from tierstore.deploy.cli import collect_status

    warm_up(llm)
    prompts = conversation_prompts()
    passes = [
        run_pass(
            llm,
            prompts,
            max_tokens=8,
            reset_each=True,
            progress=f"pass {n + 1}",
            progress_file=progress_file,
        )
        for n in range(2)
    ]
    drain(llm)  # pass 2's last stores, so the status counts them
    rows = []
    for i, prompt in enumerate(prompts):
        first, second = passes[0].requests[i], passes[1].requests[i]
        rows.append(
            {
                "request": i,
                "prompt_tokens": len(prompt),
                "pass1_from_tierstore": first.num_cached_tokens,
                "pass1_ttft_ms": first.ttft_s * 1000,
                "pass2_from_tierstore": second.num_cached_tokens,
                "pass2_ttft_ms": second.ttft_s * 1000,
                "same_tokens": first.tokens == second.tokens,
            }
        )
    return DemoResult(rows=rows, status=collect_status(DEMO_NAMESPACE))


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'req':>3} {'prompt':>7} | {'pass 1: tierstore':>17} {'TTFT ms':>8} | "
        f"{'pass 2: tierstore':>17} {'TTFT ms':>8} | same output"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['request']:>3} {r['prompt_tokens']:>7} | {r['pass1_from_tierstore']:>17} "
            f"{r['pass1_ttft_ms']:>8.1f} | {r['pass2_from_tierstore']:>17} "
            f"{r['pass2_ttft_ms']:>8.1f} | {'yes' if r['same_tokens'] else 'NO'}"
        )
    return "\n".join(lines)
