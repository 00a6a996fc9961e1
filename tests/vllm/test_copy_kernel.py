"""The ``kernel`` copy executor on CPU: the Triton kernel's logic under Triton's
interpreter, its table checks and grid, and the executor's choices that need no GPU.

The kernel runs here under ``TRITON_INTERPRET=1``, which Triton reads when a kernel is
defined: so in a fresh interpreter (this module run as ``python -m``), where
:mod:`tierstore.vllm.copy_kernel` is first imported with it set. The interpreter follows
the kernel's raw pointers into this process's memory, so the descriptors point into
numpy buffers as a GPU's would into host memory and the KV cache. Each case: scattered,
non-overlapping descriptors of varied sizes (zero, under a word, over a step, over a
program's share), at addresses 16-byte aligned or not; the destinations must hold the
sources' bytes and nothing else in the destination buffer may change.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tierstore.vllm import batch_copy
from tierstore.vllm.batch_copy import EXECUTOR_NAMES, BatchCopy, KernelBatchCopy, make_executor

ROOT = Path(__file__).resolve().parents[2]
# Sizes around the kernel's boundaries: a 16-byte word pair, a step of 1024 words
# (8 KiB), a program's share (64 KiB).
SIZES = [0, 0, 1, 7, 15, 16, 17, 31, 100, 4095, 4096, 4097, 8191, 8192, 8193]
LARGE = [3 * 8192 + 5, (64 << 10) + 48 + 7, (150 << 10) + 3]
SPREADS = (1, 3, 7)  # programs per descriptor, besides copy_table's own choice
GUARD = 0xCD


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeros starting at a multiple of 64."""
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip : skip + nbytes]


def _place(sizes: list[int], rng: np.random.Generator, capacity: int) -> list[int]:
    """Offsets for ``sizes``, in a random order, with gaps, none overlapping: each at a
    multiple of 16 or a few bytes past one."""
    offsets = [0] * len(sizes)
    cursor = 0
    for i in rng.permutation(len(sizes)).tolist():
        cursor += int(rng.integers(0, 64))
        cursor += -cursor % 16 + int(rng.choice([0, 0, 1, 3, 8, 13]))
        offsets[i] = cursor
        cursor += sizes[i]
    assert cursor <= capacity
    return offsets


def _case(seed: int):
    """Source and destination buffers, a ``(3, capacity)`` table of ``n`` descriptors
    from one into the other, and past ``n`` entries that would write the guard area."""
    rng = np.random.default_rng(seed)
    sizes = SIZES + LARGE + [int(s) for s in rng.integers(0, 20000, 8)]
    room = 2 * sum(sizes) + 64 * len(sizes) + 4096
    src, dst = _aligned(room), _aligned(room)
    src[:] = rng.integers(0, 256, room, dtype=np.uint8)
    dst[:] = GUARD
    src_at, dst_at = _place(sizes, rng, room), _place(sizes, rng, room)
    n = len(sizes)
    table = torch.zeros((3, n + 5), dtype=torch.int64)
    table[0, :n] = torch.tensor([src.ctypes.data + a for a in src_at])
    table[1, :n] = torch.tensor([dst.ctypes.data + a for a in dst_at])
    table[2, :n] = torch.tensor(sizes)
    table[:, n:] = torch.tensor([[src.ctypes.data], [dst.ctypes.data + room - 64], [64]])
    return src, dst, table, n, list(zip(src_at, dst_at, sizes, strict=True))


def _check(src: np.ndarray, dst: np.ndarray, copies, kept: np.ndarray) -> None:
    outside = np.ones(dst.nbytes, dtype=bool)
    for s, d, size in copies:
        assert np.array_equal(dst[d : d + size], src[s : s + size]), (s, d, size)
        outside[d : d + size] = False
    assert np.all(dst[outside] == GUARD), "a byte outside the destinations changed"
    assert np.array_equal(src, kept), "a source byte changed"


def _run_interpreted() -> None:
    """In a process started with ``TRITON_INTERPRET=1``: every case through
    :func:`copy_table` and through the kernel at several spreads; raises on a mismatch."""
    from tierstore.vllm import copy_kernel

    kind = type(copy_kernel._copy_descriptors).__name__
    assert kind == "InterpretedFunction", f"the kernel is a {kind}, not interpreted"
    checked = 0
    for seed in range(2):
        for spread in (None, *SPREADS):
            src, dst, table, n, copies = _case(seed)
            kept = src.copy()
            if spread is None:
                copy_kernel.copy_table(table, n)
            else:
                copy_kernel._copy_descriptors[(n, spread)](
                    table, table.stride(0), BLOCK=copy_kernel.BLOCK
                )
            _check(src, dst, copies, kept)
            checked += n
    sys.stdout.write(f"interpreted: {checked} descriptors copied exactly\n")


def test_the_kernel_copies_scattered_descriptors_exactly_under_the_interpreter() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.test_copy_kernel"],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-10000:]
    assert "descriptors copied exactly" in done.stdout


def test_tables_the_kernel_cannot_index_are_refused() -> None:
    from tierstore.vllm.copy_kernel import check_table, copy_table

    good = torch.zeros((3, 8), dtype=torch.int64)
    check_table(good, 8)
    check_table(good, 0)
    for table, n in [
        (good.to(torch.int32), 4),  # not int64
        (torch.zeros((2, 8), dtype=torch.int64), 4),  # no size row
        (good, 9),  # more descriptors than columns
        (torch.zeros((8, 3), dtype=torch.int64).t(), 4),  # columns not contiguous
    ]:
        with pytest.raises(ValueError, match="descriptor"):
            copy_table(table, n)
    copy_table(good, 0)  # nothing to copy: no launch


def test_programs_per_descriptor_follow_the_largest_and_stay_in_the_grid() -> None:
    from tierstore.vllm.copy_kernel import MAX_PROGRAMS, PROGRAM_BYTES, spread_for

    assert spread_for(1, 0) == 1 and spread_for(4096, PROGRAM_BYTES) == 1
    assert spread_for(1, PROGRAM_BYTES + 1) == 2
    assert spread_for(1, 256 << 20) == (256 << 20) // PROGRAM_BYTES
    assert spread_for(1, 1 << 40) == 65535  # CUDA's limit on the grid's second dimension
    assert spread_for(MAX_PROGRAMS // 4, 1 << 30) == 4
    assert spread_for(2 * MAX_PROGRAMS, 1 << 30) == 1


class _Recorded(BatchCopy):
    name = "recorded"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def launch(self, table, n, stream, src_any, host) -> None:
        self.calls.append(n)


def test_host_memory_the_device_cannot_address_goes_to_the_fallback() -> None:
    """A pageable ``host`` (here every array is: no CUDA) never reaches the kernel."""
    ran: list[int] = []
    fallback = _Recorded()
    executor = KernelBatchCopy(lambda table, n, largest: ran.append(n), fallback)
    assert executor.pinned_tables and not fallback.pinned_tables
    table = torch.zeros((3, 4), dtype=torch.int64)
    executor.launch(table, 3, None, True, np.zeros(64, dtype=np.uint8))
    assert fallback.calls == [3] and ran == [] and executor.fallbacks == 1


def test_the_kernel_executor_needs_cuda_and_says_why_not(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert "kernel" in EXECUTOR_NAMES
    kv = [torch.zeros((4, 64), dtype=torch.int8)]
    with caplog.at_level("INFO", logger=batch_copy.__name__):
        assert make_executor("kernel", kv) is None
    assert "no CUDA device" in caplog.text
    # Past the CUDA check (Triton imports here): the driver library is asked next.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    from tierstore.vllm import copy_kernel

    monkeypatch.setattr(copy_kernel, "registered_memory_reachable", lambda i: "not here")
    caplog.clear()
    with caplog.at_level("INFO", logger=batch_copy.__name__):
        assert make_executor("kernel", kv) is None
    assert "no copy kernel: not here" in caplog.text


if __name__ == "__main__":
    _run_interpreted()
