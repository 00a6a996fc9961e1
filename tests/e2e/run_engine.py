"""Runs one engine's passes in a fresh process and writes them as JSON.

Each engine gets its own process (vLLM engines do not shut down cleanly enough to share
one), started by the tests as ``python -m tests.e2e.run_engine SPEC_JSON OUT_JSON``.
"""

from __future__ import annotations

import json
import sys

from tierstore.deploy.passes import EngineSpec, run_passes


def main() -> None:
    args = json.loads(sys.argv[1])
    spec = EngineSpec(**args["engine"])
    passes = run_passes(
        spec,
        args["prompts"],
        n_passes=args["n_passes"],
        max_tokens=args.get("max_tokens", 8),
        reset_between=args.get("reset_between", True),
        reset_each=args.get("reset_each", False),
    )
    with open(sys.argv[2], "w") as out:
        json.dump(passes, out)


if __name__ == "__main__":
    main()
