"""Choosing the CUDA copy executor, and the checks of vLLM's functions it would call.

On CPU: the signature checks run against the installed vLLM's own functions (the
wrapper ``_custom_ops.swap_blocks_batch`` and ``host_register`` exist in the CPU build
too, though its op does not), and against changed ones; the selection falls back to
the per-run executor here, where neither vLLM's CUDA op nor cuda-bindings is.
"""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops
from vllm.v1.kv_offload.cpu.host_register import host_register

from tierstore.vllm import batch_copy
from tierstore.vllm.batch_copy import (
    RunCopy,
    check_swap_signature,
    make_executor,
    select_executor,
)
from tierstore.vllm.host_register import check_register_signature


def test_the_pinned_vllm_functions_match_what_the_copier_calls() -> None:
    assert check_swap_signature(_custom_ops.swap_blocks_batch) is None
    assert check_register_signature(host_register) is None


def _three_args(src_ptrs, dst_ptrs, sizes) -> None: ...


def _renamed(src, dst, sizes, is_src_access_order_any=False) -> None: ...


def _one_more_required(src_ptrs, dst_ptrs, sizes, is_src_access_order_any, stream) -> None: ...


@pytest.mark.parametrize("changed", [_three_args, _renamed, _one_more_required])
def test_a_changed_swap_blocks_batch_is_refused_with_a_reason(changed) -> None:
    why = check_swap_signature(changed)
    assert why is not None and "src_ptrs, dst_ptrs, sizes, is_src_access_order_any" in why


def test_a_changed_host_register_is_refused() -> None:
    assert check_register_signature(lambda ptr, num_bytes, flags: True) is not None
    assert check_register_signature(lambda address, size: True) is not None
    assert check_register_signature(lambda ptr, num_bytes, flags=0: True) is None


def test_a_vllm_whose_swap_changed_falls_back_and_names_its_version(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_custom_ops, "swap_blocks_batch", _three_args)
    # As on a CUDA build: the op exists, only the Python wrapper changed.
    monkeypatch.setattr(batch_copy, "_cuda_op_present", lambda: True)
    with caplog.at_level("WARNING", logger=batch_copy.__name__):
        assert make_executor("vllm", []) is None
    import vllm

    assert vllm.__version__ in caplog.text and "cuda-bindings instead" in caplog.text


def test_without_vllms_cuda_op_or_cuda_bindings_the_per_run_executor_is_chosen() -> None:
    kv = [torch.zeros((4, 64), dtype=torch.int8)]
    assert make_executor("vllm", kv) is None  # the CPU build has no swap_blocks_batch op
    assert isinstance(select_executor(kv), RunCopy)
    with pytest.raises(ValueError, match="unknown copy executor 'dma'"):
        make_executor("dma", kv)
