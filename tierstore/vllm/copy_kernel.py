"""The ``kernel`` copy executor's kernel: one Triton launch runs a whole descriptor table,
the GPU's own threads loading and storing through the table's pointers (SM-driven,
not the DMA engines). Host memory is reached through unified virtual addressing: pinned
and registered host memory is device-addressable at its host address, so the table's
host pointers are used as they are (:func:`registered_memory_reachable` checks that the
device allows it for registered memory; :class:`~tierstore.vllm.batch_copy.KernelBatchCopy`
sends copies of other host memory elsewhere).

Importing this module imports Triton; :mod:`tierstore.vllm.batch_copy` does so only
where CUDA is present. Under ``TRITON_INTERPRET=1`` (read by Triton when the kernel is
defined, so before this module is imported) the kernel runs on the CPU over CPU
addresses: how the tests check its logic without a GPU.

The table: an int64 tensor of shape ``(3, >= n)``, rows src, dst, size in bytes, unit
column stride, readable by the kernel: a pinned host tensor (read through UVA) or a
device tensor; under the interpreter, a CPU tensor.

The grid is ``(n, spread)``: program ``(d, j)`` copies descriptor ``d``'s steps ``j``,
``j + spread``, ... of :data:`BLOCK` words, so a large descriptor is copied by
``spread`` programs and a page-sized one by one. Alignment: a descriptor whose source and
destination addresses are both multiples of 16 bytes is copied in 8-byte words, the
compiler told the 16-byte alignment (so it may issue 16-byte accesses), and its last
``size % 16`` bytes byte by byte by program ``j == 0``; any other descriptor is copied
byte by byte throughout (correct at any address and size, slower). Zero-size entries
copy nothing. Descriptors must not overlap one another's destinations (the copier's
never do); their order of execution is unspecified.
"""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl

BLOCK = 1024  # 8-byte words each program copies per step
PROGRAM_BYTES = 64 << 10  # a descriptor gets one program per this many bytes of its size
MAX_PROGRAMS = 1 << 18  # the grid's size past which large descriptors get fewer programs
_MAX_SPREAD = 65535  # CUDA's limit on a grid's second dimension
# cuDeviceGetAttribute's CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
_HOST_POINTER_FOR_REGISTERED_MEM = 91


@triton.jit(do_not_specialize=["stride"])
def _copy_descriptors(table, stride, BLOCK: tl.constexpr):
    d = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    spread = tl.num_programs(1).to(tl.int64)
    size = tl.load(table + 2 * stride + d)
    if j * BLOCK * 8 < size:  # this program has bytes to copy
        src = tl.load(table + d)
        dst = tl.load(table + stride + d)
        if ((src | dst) & 15) == 0:
            # Both 16-byte aligned (checked just above, so the hints hold): the compiler
            # may pair words into 16-byte accesses; ``words`` is even for the same reason.
            words = (size // 16) * 2
            src_w = tl.multiple_of(src.to(tl.pointer_type(tl.int64)), 16)
            dst_w = tl.multiple_of(dst.to(tl.pointer_type(tl.int64)), 16)
            for i in range(0, tl.cdiv(words - j * BLOCK, spread * BLOCK)):
                at = (j + i * spread) * BLOCK + tl.arange(0, BLOCK)
                mask = at < words
                tl.store(dst_w + at, tl.load(src_w + at, mask=mask), mask=mask)
            if j == 0:
                lane = tl.arange(0, 16)
                at = words * 8 + lane
                mask = lane < size - words * 8
                src_b = src.to(tl.pointer_type(tl.uint8))
                dst_b = dst.to(tl.pointer_type(tl.uint8))
                tl.store(dst_b + at, tl.load(src_b + at, mask=mask), mask=mask)
        else:
            src_b = src.to(tl.pointer_type(tl.uint8))
            dst_b = dst.to(tl.pointer_type(tl.uint8))
            # The program's bytes in the word path's steps, each in sub-steps of BLOCK
            # bytes (fewer registers than a step's bytes at once).
            for i in range(0, tl.cdiv(size - j * BLOCK * 8, spread * BLOCK * 8)):
                for k in range(0, 8):
                    at = ((j + i * spread) * 8 + k) * BLOCK + tl.arange(0, BLOCK)
                    mask = at < size
                    tl.store(dst_b + at, tl.load(src_b + at, mask=mask), mask=mask)


def spread_for(n: int, largest: int) -> int:
    """Programs per descriptor for ``n`` descriptors the largest of which has ``largest``
    bytes: one per :data:`PROGRAM_BYTES` of it, fewer where the grid would pass
    :data:`MAX_PROGRAMS` (the smaller descriptors' extra programs only exit), at least one."""
    wanted = -(-largest // PROGRAM_BYTES)
    return max(1, min(wanted, MAX_PROGRAMS // max(n, 1), _MAX_SPREAD))


def check_table(table: torch.Tensor, n: int) -> None:
    """Raise ValueError unless ``table`` is an int64 ``(3, >= n)`` tensor with unit column
    stride (what the kernel indexes)."""
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != 3:
        raise ValueError(
            f"a descriptor table is int64 (3, n), not {table.dtype} {tuple(table.shape)}"
        )
    if not 0 <= n <= table.shape[1] or (n > 1 and table.stride(1) != 1):
        raise ValueError(
            f"{n} descriptors in a table of shape {tuple(table.shape)}, strides {table.stride()}"
        )


def copy_table(table: torch.Tensor, n: int, largest: int | None = None) -> None:
    """Enqueue the copies of the table's first ``n`` descriptors as one kernel on torch's
    current stream of the current device (Triton launches there) and return.
    ``largest``: the largest of their sizes (for the grid), read from the table if not
    given (on the host: give it for a device table). ``table`` must stay unchanged until
    the kernel is done. The first call compiles the kernel (seconds: at start-up, by the
    executor's probe)."""
    check_table(table, n)
    if n == 0:
        return
    if largest is None:
        largest = int(table[2, :n].max())
    _copy_descriptors[(n, spread_for(n, largest))](table, table.stride(0), BLOCK=BLOCK)


def registered_memory_reachable(device: int) -> str | None:
    """None if the device ``device`` (an ordinal, as torch counts them) reaches
    registered host memory at its host address (UVA, and the driver's
    ``CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``), else why not. Asks the driver library
    (``libcuda``) directly; CUDA must be initialised (torch has done so)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"the CUDA driver library cannot be loaded ({exc})"
    handle, value = ctypes.c_int(), ctypes.c_int()
    err = cuda.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device))
    if err == 0:
        err = cuda.cuDeviceGetAttribute(
            ctypes.byref(value), ctypes.c_int(_HOST_POINTER_FOR_REGISTERED_MEM), handle
        )
    if err != 0:
        return f"the driver did not answer whether it can (CUresult {err})"
    if not value.value:
        return "the device cannot reach registered host memory at its host address"
    return None
