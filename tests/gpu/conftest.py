"""GPU tests: collected everywhere, skipped where CUDA (or vLLM's CUDA ops) is absent.

This project's CI machine has no GPU, so they are reported as skipped there; run them
on a CUDA host with vLLM's CUDA build: ``pytest -q tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and vLLM's CUDA build")


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (this project's CI has none)"
    try:
        from vllm import _custom_ops  # noqa: F401

        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as exc:
        return f"needs vLLM's CUDA build (swap_blocks_batch): {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        reason = reason or _why_not() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
