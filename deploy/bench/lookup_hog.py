"""A CPU-bound vLLM engine for the lookup benchmark: generates until it is stopped.

``python -m tierstore.deploy.bench.lookup_hog MODEL_DIR READY_FILE``: builds a CPU engine
(no connector), writes ``READY_FILE`` once it serves, then sends 512-token prompts one
after another, its OpenMP threads spinning on the cores ``VLLM_CPU_OMP_THREADS_BIND``
names, until SIGTERM; then it stops its engine in order.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from tierstore.deploy.passes import (
    EngineSpec,
    build_llm,
    random_prompt,
    run_request,
    sampling_params,
    shutdown_engine,
    warm_up,
)


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    llm = build_llm(EngineSpec(model=sys.argv[1], max_model_len=1024))
    try:
        warm_up(llm)
        Path(sys.argv[2]).write_text("ready")
        params = sampling_params(16)
        seed = 0
        while True:
            seed += 1
            run_request(llm, random_prompt(512, seed=seed), params)
    finally:
        shutdown_engine(llm)


if __name__ == "__main__":
    main()
