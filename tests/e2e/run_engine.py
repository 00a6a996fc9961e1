"""Runs one engine's passes in a fresh process and writes them as JSON.

Each engine gets its own process (vLLM engines do not shut down cleanly enough to share
one), started by the tests as ``python -m tests.e2e.run_engine SPEC_JSON OUT_JSON``.
Writes ``{"passes": [...], "block_size": N}``: N is the scheduler's block size after
vLLM's own adjustments (the block size of a model with one KV cache group).
"""

from __future__ import annotations

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
    llm = build_llm(EngineSpec(**args["engine"]))
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


if __name__ == "__main__":
    main()
