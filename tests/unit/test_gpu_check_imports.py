"""The GPU check runs on a bare CUDA machine: no Ray, no vLLM there.

Every module ``tests/gpu`` imports (the CUDA copier, its executors, the arena) must
import without pulling in Ray or vLLM, even where both are installed (here): checked
in a fresh interpreter, as ``tests/gpu/check.sh`` runs it (``PYTHONPATH=.``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK_MODULES = [
    "tierstore.vllm.cuda_copy",
    "tierstore.vllm.batch_copy",
    "tierstore.vllm.device_copy",
    "tierstore.vllm.host_register",
    "tierstore.data.arena.region",
    "tierstore.data.extent_dma",
    "tests.gpu.kv",
    "tests.gpu.bench",
    "tests.data.test_extent_copy",
]


def test_the_gpu_checks_modules_import_neither_ray_nor_vllm() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for name in {GPU_CHECK_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
