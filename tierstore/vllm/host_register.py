"""The node's arena registered for DMA in a CUDA worker (``cudaHostRegister``), once.

A shared mapping cannot come from CUDA's pinned allocator, so it is registered after
the fact, as vLLM 0.33 does for its ``SharedOffloadRegion`` (``cpu/gpu_worker.py``,
``pin_mmap_region``): through vLLM's own helper (``kv_offload/cpu/host_register.py``,
which also clears the runtime's error on failure, so torch does not trip over it later)
when its signature is the one this was written for, else through cuda-bindings' runtime
(the same calls), in ranges of at most :data:`MAX_REGISTER_BYTES`, rolled back whole if
one fails (the copier then uses the arena as pageable memory). No copy may straddle two
ranges: the copier cuts its DMA runs at multiples of :data:`MAX_REGISTER_BYTES`
(:func:`tierstore.data.extent_dma.arena_runs`).

Unregistering memory a queued copy still reads or writes is undefined, so
:meth:`HostRegistry.unregister` first waits for every copy queued so far, and holds
:attr:`HostRegistry.lock` throughout: copies into or out of the arena are launched under
it, so none can slip in between. A registered array is referenced here, so its mapping
cannot be unmapped while registered.

Threads: ``register`` on the worker's arena set-up thread (it pins every page: seconds
for a large arena, never on the model-runner thread); ``unregister`` on the thread that
closes the arena (it blocks until queued copies are done); launches from any thread.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Each cudaHostRegister call pins at most this much: a failure costs one GiB's retry, not
# the arena's, and large ranges hit driver limits (vLLM registers 64 GiB at most).
MAX_REGISTER_BYTES = 1 << 30

Register = Callable[[int, int], bool]
Unregister = Callable[[int], None]

_REGISTER_PARAMETERS = ("ptr", "num_bytes")  # vLLM 0.33's host_register(ptr, num_bytes)


def check_register_signature(register: Callable[..., object]) -> str | None:
    """None if ``register`` takes vLLM 0.33's ``host_register(ptr, num_bytes)``, else why
    not."""
    try:
        params = list(inspect.signature(register).parameters.values())
    except (TypeError, ValueError) as exc:
        return f"its signature cannot be read ({exc})"
    names = tuple(p.name for p in params)
    if names[:2] != _REGISTER_PARAMETERS or any(p.default is p.empty for p in params[2:]):
        return f"it takes ({', '.join(names)}), tierstore calls it with (ptr, num_bytes)"
    return None


def _vllm_helpers() -> tuple[Register, Unregister] | None:
    try:  # CUDA hosts only: imported when an arena is first registered
        from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister
    except ImportError:
        return None
    why = check_register_signature(host_register)
    if why is not None:
        from tierstore.vllm.batch_copy import vllm_version

        logger.warning(
            "vLLM %s's host_register does not match what tierstore was written for: %s; "
            "tierstore registers the arena through the CUDA runtime itself",
            vllm_version(),
            why,
        )
        return None
    return host_register, host_unregister


def _runtime_helpers() -> tuple[Register, Unregister] | None:
    """``cudaHostRegister`` through cuda-bindings (a machine without vLLM)."""
    try:
        from cuda.bindings import runtime  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None

    def register(ptr: int, num_bytes: int) -> bool:
        (err,) = runtime.cudaHostRegister(ptr, num_bytes, runtime.cudaHostRegisterDefault)
        if err != runtime.cudaError_t.cudaSuccess:
            runtime.cudaGetLastError()  # clear it, so torch does not trip over it later
            logger.warning("cudaHostRegister failed (%r)", err)
            return False
        return True

    def unregister(ptr: int) -> None:
        (err,) = runtime.cudaHostUnregister(ptr)
        if err != runtime.cudaError_t.cudaSuccess:
            runtime.cudaGetLastError()
            logger.warning("cudaHostUnregister failed (%r)", err)

    return register, unregister


def default_helpers() -> tuple[Register, Unregister] | None:
    """vLLM's registration helpers, else cuda-bindings'; None if neither is here."""
    helpers = _vllm_helpers() or _runtime_helpers()
    if helpers is None:
        logger.warning("neither vLLM's host_register nor cuda-bindings is here")
    return helpers


class HostRegistry:
    """Arena mappings this worker registered, by base address."""

    def __init__(
        self,
        quiesce: Callable[[], None],
        device: torch.device | None = None,
        helpers: tuple[Register, Unregister] | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """``quiesce`` blocks until every copy queued so far on the copier's streams is
        done. ``device``: the worker's GPU, current while (un)registering. ``helpers``:
        (register, unregister), vLLM's by default; ``max_bytes``: the largest range
        (:data:`MAX_REGISTER_BYTES` by default)."""
        self._quiesce = quiesce
        self._device = device
        self._helpers = helpers
        self._max_bytes = max_bytes or MAX_REGISTER_BYTES
        self._ranges: dict[int, tuple[list[int], np.ndarray]] = {}
        self.lock = threading.Lock()

    @property
    def range_bytes(self) -> int:
        """No registered range is longer, and each starts at a multiple of this past the
        mapping's base: copies are cut there."""
        return self._max_bytes

    def active(self) -> bool:
        """Whether any arena is registered now."""
        with self.lock:
            return bool(self._ranges)

    def registered(self, array: np.ndarray) -> bool:
        with self.lock:
            return int(array.ctypes.data) in self._ranges

    def register(self, array: np.ndarray) -> bool:
        """Register the whole mapping; False (nothing left registered) if it cannot be."""
        base, nbytes = int(array.ctypes.data), int(array.nbytes)
        if self.registered(array):
            return True
        if nbytes == 0:
            return False
        self._helpers = self._helpers or default_helpers()
        if self._helpers is None:
            return False
        register, unregister = self._helpers
        done: list[int] = []
        with self._on_device():
            for offset in range(0, nbytes, self._max_bytes):
                size = min(self._max_bytes, nbytes - offset)
                try:
                    ok = register(base + offset, size)
                except Exception:
                    logger.warning("cudaHostRegister raised", exc_info=True)
                    ok = False
                if not ok:
                    logger.warning(
                        "cudaHostRegister of the arena failed at %d of %d bytes; "
                        "nothing of it stays registered",
                        offset,
                        nbytes,
                    )
                    for address in reversed(done):
                        unregister(address)
                    return False
                done.append(base + offset)
        with self.lock:
            self._ranges[base] = (done, array)
        logger.info("arena of %d bytes registered for DMA in %d range(s)", nbytes, len(done))
        return True

    def unregister(self, array: np.ndarray) -> None:
        """Wait for queued copies, then unregister the mapping (if it was registered)."""
        self._unregister(int(array.ctypes.data))

    def _unregister(self, base: int) -> None:
        with self.lock:
            entry = self._ranges.pop(base, None)
            if entry is None or self._helpers is None:
                return
            self._quiesce()
            _, unregister = self._helpers
            with self._on_device():
                for address in reversed(entry[0]):
                    unregister(address)

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext() if self._device is None else torch.cuda.device(self._device)
