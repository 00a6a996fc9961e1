"""Runs one engine's passes in a fresh process and writes them as JSON.

Each engine gets its own process (vLLM engines do not shut down cleanly enough to share
one), started by the tests as ``python -m tests.e2e.run_engine SPEC_JSON OUT_JSON``.
Writes ``{"passes": [...], "block_size": N}``: N is the scheduler's block size after
vLLM's own adjustments (the block size of a model with one KV cache group).

Beyond ``EngineSpec``: ``engine["llm_kwargs"]`` passes more arguments to vLLM's ``LLM``
(``hf_overrides``, ``revision``), and ``cache_salts`` gives the i-th request of every
pass vLLM's ``cache_salt`` (None: none).
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import asdict
from typing import Any

from tierstore.deploy.passes import EngineSpec, build_llm, drain, run_pass


def main() -> None:
    args = json.loads(sys.argv[1])
    n_passes = args["n_passes"]
    # resets[i]: empty the device prefix cache after pass i (default: after every pass,
    # or after none with reset_between=False).
    resets: list[bool] = args.get("resets") or [args.get("reset_between", True)] * n_passes
    if len(resets) != n_passes:
        raise ValueError(f"resets names {len(resets)} passes, n_passes is {n_passes}")
    llm = _build(dict(args["engine"]))
    if args.get("cache_salts"):
        _salt_requests(llm, args["cache_salts"], len(args["prompts"]))
    passes: list[dict[str, Any]] = []
    for reset in resets:
        result = run_pass(
            llm, args["prompts"], args.get("max_tokens", 8), args.get("reset_each", False)
        )
        passes.append(asdict(result))
        drain(llm)
        if reset:
            llm.reset_prefix_cache()
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    with open(sys.argv[2], "w") as out:
        json.dump({"passes": passes, "block_size": block_size}, out)


def _build(engine: dict[str, Any]) -> Any:
    """``build_llm``, with ``engine["llm_kwargs"]`` added to the ``LLM`` call (it imports
    ``vllm.LLM`` when called: that name is bound to a partial for the call)."""
    import vllm

    llm_kwargs = engine.pop("llm_kwargs", None) or {}
    plain = vllm.LLM
    vllm.LLM = functools.partial(plain, **llm_kwargs)  # type: ignore[misc]
    try:
        return build_llm(EngineSpec(**engine))
    finally:
        vllm.LLM = plain  # type: ignore[misc]


def _salt_requests(llm: Any, salts: list[str | None], n_prompts: int) -> None:
    """The i-th request of every pass carries ``cache_salt`` ``salts[i]``: ``run_pass``
    sends one prompt per ``generate`` call, in order."""
    if len(salts) != n_prompts:
        raise ValueError(f"cache_salts names {len(salts)} prompts, there are {n_prompts}")
    generate = llm.generate
    pending: list[str | None] = []

    def salted(prompts: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        if not pending:
            pending.extend(salts)
        salt = pending.pop(0)
        if salt is not None:
            prompts = [{**prompt, "cache_salt": salt} for prompt in prompts]
        return generate(prompts, *args, **kwargs)

    llm.generate = salted


if __name__ == "__main__":
    main()
