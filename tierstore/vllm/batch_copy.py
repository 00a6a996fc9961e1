"""The four ways the CUDA copier issues a job's copies, fed by the same descriptor table.

A job's copies reach the GPU as one pointer table: int64 rows ``(src, dst, size)``
(:func:`tierstore.data.copy_plan.fill_descriptors`). Four executors run such a table
on a stream, chosen once per worker by :func:`select_executor` in the order of
:data:`EXECUTOR_NAMES`:

1. :class:`VllmBatchCopy`: vLLM's ``ops.swap_blocks_batch`` (its own CUDA build), one
   driver call per job (``cuMemcpyBatchAsync`` on CUDA 12.8+), as vLLM's own
   ``kv_offload/cpu/gpu_worker.py`` does. Its signature is checked first
   (:func:`check_swap_signature`): a vLLM whose function changed is not called, the
   next executor is used, and the log names the vLLM version.
2. :class:`DriverBatchCopy`: the same driver call through NVIDIA's ``cuda-bindings``
   (``cuda.bindings.driver.cuMemcpyBatchAsync``), for a machine without vLLM.
3. :class:`KernelBatchCopy`: one Triton kernel over the table
   (:mod:`tierstore.vllm.copy_kernel`): the GPU's threads load and store through the
   table's pointers, host memory reached through unified virtual addressing (SM-driven,
   not the DMA engines). Needs Triton; copies of host memory the device cannot address
   (a pageable arena) go to a DMA executor instead.
4. :class:`RunCopy`: one ``cudaMemcpyAsync`` per run, through torch (``Tensor.copy_``
   with ``non_blocking``): slower for jobs of many runs (Python per run), but needs
   nothing beyond torch, and the only one that also runs on the CPU (tests).

Every executor is checked by a probe copy before it is chosen
(:func:`select_executor`), so a driver or binding that refuses the call is found at
start, not at the first job.

Thread: any; each call enqueues on the stream it is given and returns (no wait).
"""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# What vLLM 0.33's ``vllm._custom_ops.swap_blocks_batch`` takes, in order.
SWAP_PARAMETERS = ("src_ptrs", "dst_ptrs", "sizes", "is_src_access_order_any")
# The oldest driver with ``cuMemcpyBatchAsync`` (CUDA 12.8), as cuDriverGetVersion says.
BATCH_DRIVER_VERSION = 12080
_PROBE_BYTES = 4096  # the probe copy at selection: one page each way

# The selection order, best first. The kernel's place in it is this line's to change.
EXECUTOR_NAMES = ("vllm", "driver", "kernel", "runs")


class BatchCopy(ABC):
    """Runs a descriptor table's copies on a stream. ``table`` is an int64 CPU tensor of
    shape ``(3, >= n)``: rows src, dst, size; ``host`` is the host memory its host-side
    pointers fall in (:class:`RunCopy` and :class:`KernelBatchCopy` read it).

    ``pinned_tables``: the executor reads the table on the device after :meth:`launch`
    returns (through UVA), so its caller should give it tables in pinned host memory and
    leave each unchanged until its copy is done (the CUDA copier does both); the others
    read the table within :meth:`launch`."""

    name: str = ""
    pinned_tables: bool = False

    @abstractmethod
    def launch(
        self, table: torch.Tensor, n: int, stream: Any, src_any: bool, host: np.ndarray
    ) -> None:
        """Enqueue the ``n`` copies on ``stream`` (the caller made it current and
        ordered it after its inputs); ``src_any``: the source is host memory no stream
        writes, so the DMA engine may read it ahead of stream order."""


class VllmBatchCopy(BatchCopy):
    """vLLM's ``swap_blocks_batch`` (CUDA build only)."""

    name = "vllm"

    def __init__(self, swap: Callable[..., None]) -> None:
        self._swap = swap

    def launch(
        self, table: torch.Tensor, n: int, stream: Any, src_any: bool, host: np.ndarray
    ) -> None:
        self._swap(table[0, :n], table[1, :n], table[2, :n], src_any)


class DriverBatchCopy(BatchCopy):
    """``cuMemcpyBatchAsync`` through ``cuda-bindings`` (driver 12.8+)."""

    name = "driver"

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        order = driver.CUmemcpySrcAccessOrder
        self._attrs = {}
        for src_any, value in (
            (False, order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM),
            (True, order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY),
        ):
            attr = driver.CUmemcpyAttributes()
            attr.srcAccessOrder = value
            self._attrs[src_any] = attr

    def launch(
        self, table: torch.Tensor, n: int, stream: Any, src_any: bool, host: np.ndarray
    ) -> None:
        d = self._driver
        rows = table[:, :n].tolist()
        dsts = [d.CUdeviceptr(p) for p in rows[1]]
        srcs = [d.CUdeviceptr(p) for p in rows[0]]
        result = d.cuMemcpyBatchAsync(
            dsts, srcs, rows[2], n, [self._attrs[src_any]], [0], 1, d.CUstream(stream.cuda_stream)
        )
        err = result[0] if isinstance(result, tuple) else result
        if err != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync of {n} copies failed: {err!r}")


class RunCopy(BatchCopy):
    """One async copy per run through torch: each pointer is resolved to a byte view of
    the KV tensor's storage it falls in, or of ``host``."""

    name = "runs"

    def __init__(self, kv: Sequence[torch.Tensor]) -> None:
        spans = {}
        for t in kv:
            storage = t.untyped_storage()
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            spans[storage.data_ptr()] = flat
        self._bases = np.array(sorted(spans), dtype=np.int64)
        self._flats = [spans[b] for b in self._bases.tolist()]

    def _kv_view(self, address: int, size: int) -> torch.Tensor:
        i = int(np.searchsorted(self._bases, address, side="right")) - 1
        flat = self._flats[i] if i >= 0 else None
        start = address - int(self._bases[i])
        if flat is None or start + size > flat.numel():
            raise ValueError(f"copy of {size} bytes at {address:#x} is in no KV tensor")
        return flat[start : start + size]

    def launch(
        self, table: torch.Tensor, n: int, stream: Any, src_any: bool, host: np.ndarray
    ) -> None:
        host_t = torch.from_numpy(host.reshape(-1).view(np.uint8))
        lo, hi = int(host.ctypes.data), int(host.ctypes.data) + host.nbytes
        for src, dst, size in zip(*table[:, :n].tolist(), strict=True):
            if lo <= dst and dst + size <= hi:  # device -> host
                host_t[dst - lo : dst - lo + size].copy_(self._kv_view(src, size), True)
            elif lo <= src and src + size <= hi:  # host -> device
                self._kv_view(dst, size).copy_(host_t[src - lo : src - lo + size], True)
            else:
                raise ValueError(f"copy {src:#x} -> {dst:#x} has no side in the host buffer")


class KernelBatchCopy(BatchCopy):
    """One Triton kernel over the table (:func:`tierstore.vllm.copy_kernel.copy_table`),
    enqueued on the current stream (the caller's ``stream``). The table is read by the
    kernel: a pinned one in place through UVA, any other first copied to the device on
    the stream (a small GPU allocation per launch; the copier gives pinned ones). A
    table whose host memory the device cannot address (``host`` is neither pinned nor
    registered: a pageable arena) goes to ``fallback``, a DMA executor, in full.
    ``src_any`` has no meaning for a kernel: it is passed on to ``fallback`` only."""

    name = "kernel"
    pinned_tables = True

    def __init__(
        self, run: Callable[[torch.Tensor, int, int | None], None], fallback: BatchCopy
    ) -> None:
        """``run(table, n, largest)``: enqueue the kernel on the current stream
        (``copy_table``; ``largest``: the largest size in the table)."""
        self._run = run
        self._fallback = fallback
        self.fallbacks = 0  # tables sent to ``fallback`` (host memory not addressable)

    def launch(
        self, table: torch.Tensor, n: int, stream: Any, src_any: bool, host: np.ndarray
    ) -> None:
        if not _device_addressable(host):
            self.fallbacks += 1
            self._fallback.launch(table, n, stream, src_any, host)
            return
        if n == 0:
            return
        largest = int(table[2, :n].max())
        if not table.is_pinned():
            table = table[:, :n].contiguous().to(torch.cuda.current_device(), non_blocking=True)
        self._run(table, n, largest)


def _device_addressable(host: np.ndarray) -> bool:
    """Whether the device can address ``host`` at its host address: pinned or registered
    memory (what ``cudaPointerGetAttributes`` calls host memory, torch's ``is_pinned``)."""
    return host.size > 0 and torch.from_numpy(host).is_pinned()


def check_swap_signature(swap: Callable[..., Any]) -> str | None:
    """None if ``swap`` takes vLLM 0.33's ``swap_blocks_batch`` arguments in order (a
    fifth one only with a default), else why not."""
    try:
        params = list(inspect.signature(swap).parameters.values())
    except (TypeError, ValueError) as exc:
        return f"its signature cannot be read ({exc})"
    names = tuple(p.name for p in params[: len(SWAP_PARAMETERS)])
    extra = [p.name for p in params[len(SWAP_PARAMETERS) :] if p.default is p.empty]
    if names != SWAP_PARAMETERS or extra:
        got = ", ".join(p.name for p in params)
        return f"it takes ({got}), tierstore calls it with ({', '.join(SWAP_PARAMETERS)})"
    return None


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "absent"


def _cuda_op_present() -> bool:
    """Whether vLLM's compiled ``swap_blocks_batch`` op is loaded (its CUDA build)."""
    try:
        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _vllm_executor() -> BatchCopy | None:
    try:  # this also loads vLLM's compiled ops, where it has them
        from vllm import _custom_ops as ops
    except ImportError as exc:
        logger.info("vLLM is not here (%s)", exc)
        return None
    swap = getattr(ops, "swap_blocks_batch", None)
    if swap is None or not _cuda_op_present():
        logger.info("this vLLM has no swap_blocks_batch op (not its CUDA build)")
        return None
    why = check_swap_signature(swap)
    if why is not None:
        logger.warning(
            "vLLM %s's swap_blocks_batch does not match what tierstore was written for: "
            "%s; tierstore copies through cuda-bindings instead",
            vllm_version(),
            why,
        )
        return None
    return VllmBatchCopy(swap)


def _driver_executor() -> BatchCopy | None:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        logger.info("cuda-bindings is not here (%s)", exc)
        return None
    if not hasattr(driver, "cuMemcpyBatchAsync"):
        logger.info("this cuda-bindings has no cuMemcpyBatchAsync")
        return None
    err, version = driver.cuDriverGetVersion()
    if err != driver.CUresult.CUDA_SUCCESS or version < BATCH_DRIVER_VERSION:
        logger.info("driver %s has no batched copies (needs CUDA 12.8+)", version)
        return None
    return DriverBatchCopy(driver)


def _kernel_executor(kv: Sequence[torch.Tensor]) -> BatchCopy | None:
    """The Triton kernel, where CUDA and Triton are here and the device reaches
    registered host memory at its host address; its fallback for host memory the device
    cannot address is the first DMA executor here, else :class:`RunCopy`."""
    if not torch.cuda.is_available():
        logger.info("no CUDA device here: no copy kernel")
        return None
    try:
        from tierstore.vllm import copy_kernel
    except ImportError as exc:
        logger.info("Triton is not here (%s): no copy kernel", exc)
        return None
    device = kv[0].device if kv else torch.device("cuda", torch.cuda.current_device())
    index = torch.cuda.current_device() if device.index is None else device.index
    why = copy_kernel.registered_memory_reachable(index)
    if why is not None:
        logger.info("no copy kernel: %s", why)
        return None
    fallback = _vllm_executor() or _driver_executor() or RunCopy(kv)
    return KernelBatchCopy(copy_kernel.copy_table, fallback)


_FACTORIES: dict[str, Callable[[Sequence[torch.Tensor]], BatchCopy | None]] = {
    "vllm": lambda kv: _vllm_executor(),
    "driver": lambda kv: _driver_executor(),
    "kernel": _kernel_executor,
    "runs": RunCopy,
}


def make_executor(name: str, kv: Sequence[torch.Tensor]) -> BatchCopy | None:
    """The executor ``name`` (one of :data:`EXECUTOR_NAMES`) for these KV tensors, or
    None where it is not available here."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown copy executor {name!r}; choose one of {EXECUTOR_NAMES}")
    return _FACTORIES[name](kv)


def select_executor(kv: Sequence[torch.Tensor], names: Sequence[str] = EXECUTOR_NAMES) -> BatchCopy:
    """Start-up: the first executor of ``names`` that is available and passes
    :func:`probe` on these KV tensors; :class:`RunCopy` if none does."""
    for name in names:
        executor = make_executor(name, kv)
        if executor is None:
            continue
        why = probe(executor, kv) if kv else None
        if why is None:
            logger.info("tierstore copies with the %r executor", executor.name)
            return executor
        logger.warning("the %r copy executor failed its probe copy (%s)", name, why)
    return RunCopy(kv)


def probe(executor: BatchCopy, kv: Sequence[torch.Tensor]) -> str | None:
    """Copy the first page of ``kv[0]``'s memory device -> host and a known pattern
    host -> device through ``executor`` (each executor takes any KV pointer; a
    :class:`RunCopy` only those), then put the page's bytes back; None if both copies
    arrive intact, else what went wrong. Start-up only, before any request (nothing
    reads the page meanwhile; it allocates and waits)."""
    device = kv[0].device
    if device.type != "cuda":
        return None  # the CPU tests exercise RunCopy directly
    try:
        with torch.cuda.device(device):
            storage = kv[0].untyped_storage()
            page = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            page = page[: min(_PROBE_BYTES, page.numel())]
            n = page.numel()
            kept = page.clone()
            pattern = (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)
            pinned = torch.empty(2 * n, dtype=torch.uint8, pin_memory=True)
            pinned[n:] = pattern
            host = pinned.numpy()
            stream = torch.cuda.Stream(device)
            table = torch.empty((3, 1), dtype=torch.int64, pin_memory=executor.pinned_tables)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                table[:, 0] = torch.tensor([page.data_ptr(), host.ctypes.data, n])
                executor.launch(table, 1, stream, False, host)
                stream.synchronize()
                table[:, 0] = torch.tensor([host.ctypes.data + n, page.data_ptr(), n])
                executor.launch(table, 1, stream, True, host)
                stream.synchronize()
            came_out = torch.equal(pinned[:n], kept.cpu())
            went_in = torch.equal(page.cpu(), pattern)
            page.copy_(kept)
            torch.cuda.synchronize(device)
            if not (came_out and went_in):
                return (
                    f"the bytes did not arrive intact (device -> host {came_out}, "
                    f"host -> device {went_in})"
                )
    except Exception as exc:  # a refused call, a bad binding: the next executor
        logger.debug("probe copy raised", exc_info=True)
        return repr(exc)
    return None
