"""GPU tests: collected everywhere, skipped where CUDA is absent.

They need only torch (a CUDA build), numpy, xxhash, msgpack, hypothesis and tierstore's
Ray-free modules: no vLLM, no Ray (a bare CUDA machine runs them; see ``check.sh``).
Where vLLM's CUDA build, cuda-bindings or Triton is there too, its executor is tested as
well (``executor_for`` fixture). This project's CI machine has no GPU, so they are reported as
skipped there. Run them on a CUDA host with ``tests/gpu/check.sh``, or
``pytest -q --confcutdir=tests/gpu tests/gpu`` (the confcutdir keeps out tests/conftest.py,
which sets up Ray).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from tierstore.vllm.batch_copy import EXECUTOR_NAMES, BatchCopy, make_executor, probe


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this project's CI has none)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


ExecutorFor = Callable[[Sequence[torch.Tensor]], BatchCopy]


@pytest.fixture(params=EXECUTOR_NAMES)
def executor_for(request: pytest.FixtureRequest) -> ExecutorFor:
    """Each copy executor this machine has (vLLM's, the driver's, the Triton kernel, per
    run), made for a test's own KV tensors and probed on them (a per-run copier knows
    only its tensors)."""
    name = request.param
    if make_executor(name, [torch.zeros((4, 4096), dtype=torch.int8, device="cuda")]) is None:
        pytest.skip(f"the {name!r} copy executor is not available here")

    def make(kv: Sequence[torch.Tensor]) -> BatchCopy:
        chosen = make_executor(name, kv)
        assert chosen is not None
        why = probe(chosen, kv)
        assert why is None, f"the {name!r} executor failed its probe copy: {why}"
        return chosen

    return make
