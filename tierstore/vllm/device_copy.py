"""Moving a job's bytes between the KV cache and host memory, per platform.

On the CPU platform the KV cache is host memory: gather and scatter are plain copies.
On CUDA the copies run on a side stream ordered after the compute stream (stores must
not read KV the forward is still writing; loads must not race the zeroing of their
destination blocks), through pinned staging, and an event says when they are done.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from tierstore.data.layout import ChunkLayout, JobPlan, as_index


class DeviceCopier(ABC):
    def __init__(self, layout: ChunkLayout) -> None:
        self.layout = layout

    @abstractmethod
    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Callable[[], np.ndarray]:
        """Start copying the job's pages out; the returned call waits and gives the bytes.

        Once it returns, the source blocks may be overwritten.
        """

    @abstractmethod
    def scatter(self, plan: JobPlan, block_ids: np.ndarray, data: np.ndarray) -> None:
        """Copy the bytes into the destination blocks; returns when they are in place."""


class HostCopier(DeviceCopier):
    """KV cache in host memory (vLLM's CPU platform)."""

    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Callable[[], np.ndarray]:
        out = np.empty(plan.nbytes, dtype=np.uint8)
        self.layout.gather(plan, as_index(block_ids, self.layout.device), torch.from_numpy(out))
        return lambda: out

    def scatter(self, plan: JobPlan, block_ids: np.ndarray, data: np.ndarray) -> None:
        self.layout.scatter(plan, as_index(block_ids, self.layout.device), _writable_view(data))


class CudaCopier(DeviceCopier):
    """KV cache on a GPU: side streams, pinned staging, events. Not exercised by CI."""

    def __init__(self, layout: ChunkLayout) -> None:
        super().__init__(layout)
        self._store_stream = torch.cuda.Stream(device=layout.device)
        self._load_stream = torch.cuda.Stream(device=layout.device)

    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> Callable[[], np.ndarray]:
        host = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
        self._store_stream.wait_stream(torch.cuda.current_stream(self.layout.device))
        with torch.cuda.stream(self._store_stream):
            staging = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.layout.device)
            self.layout.gather(plan, as_index(block_ids, self.layout.device), staging)
            host.copy_(staging, non_blocking=True)
            staging.record_stream(self._store_stream)
            done = torch.cuda.Event()
            done.record(self._store_stream)

        def wait() -> np.ndarray:
            done.synchronize()
            return host.numpy()

        return wait

    def scatter(self, plan: JobPlan, block_ids: np.ndarray, data: np.ndarray) -> None:
        host = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
        host.copy_(_writable_view(data))
        self._load_stream.wait_stream(torch.cuda.current_stream(self.layout.device))
        with torch.cuda.stream(self._load_stream):
            staging = host.to(self.layout.device, non_blocking=True)
            self.layout.scatter(plan, as_index(block_ids, self.layout.device), staging)
            done = torch.cuda.Event()
            done.record(self._load_stream)
        done.synchronize()


def _writable_view(data: np.ndarray) -> torch.Tensor:
    """A tensor over bytes that Ray may hand out read-only; tierstore only reads them.

    torch warns when wrapping a read-only array because writes through the tensor would
    be undefined; nothing here writes to it, so the warning is silenced, not the copy made.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def make_copier(layout: ChunkLayout) -> DeviceCopier:
    if layout.device.type == "cuda":
        return CudaCopier(layout)
    return HostCopier(layout)
