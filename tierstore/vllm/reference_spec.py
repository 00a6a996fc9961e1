"""The simplest correct restore: an in-process byte copy, for the differential tests
(``tests/e2e``) and as the e2e benchmark's cheapest-correct-offload engine.

Its manager answers lookups at once from the keys whose stores completed; its worker
keeps a clone of every page it stored, block by block, in the worker process, and copies
them back on load. It shares no code with tierstore's layout, so the two agreeing to the
bit is evidence, not tautology. Same connector path, same hit boundaries: tierstore's
output must equal this one's exactly. Not for serving: it keeps every page forever.
Load it with ``REFERENCE_SPEC`` (``tierstore.deploy.passes``).

It needs no namespace (``tierstore.vllm.spec.namespace_for``): its pages live in the
engine's own worker process and die with it, so no other engine, model or weights can
ever read them.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)


class KeysSpec(LoadStoreSpec):
    def __init__(self, keys: list[OffloadKey]) -> None:
        self.keys = keys


class ReferenceManager(OffloadingManager):
    def __init__(self) -> None:
        self.stored: set[OffloadKey] = set()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.stored else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> KeysSpec:
        return KeysSpec(list(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput:
        fresh = [k for k in keys if k not in self.stored]
        return PrepareStoreOutput(fresh, KeysSpec(fresh), [])

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.stored.update(keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


class ReferenceWorker(OffloadingWorker):
    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, corrupt: bool = False
    ) -> None:
        self.kv = kv_caches
        self.bpc = blocks_per_chunk
        self.corrupt = corrupt  # flips every restored byte: proves the parity checks can fail
        self.pages: dict[tuple[OffloadKey, int, int], torch.Tensor] = {}  # (key, slot, layer)
        self.done: list[TransferResult] = []

    def _walk(self, gpu: GPULoadStoreSpec, keys: list[OffloadKey]):
        """Yield (key, slot, block_id, group position) for every block of the job."""
        chunk = 0
        offset = 0
        for p, size in enumerate(gpu.group_sizes):
            if size == 0:
                continue
            skip = int(gpu.block_indices[p]) % self.bpc
            for k in range(size):
                yield (
                    keys[chunk + (skip + k) // self.bpc],
                    (skip + k) % self.bpc,
                    int(gpu.block_ids[offset + k]),
                    p,
                )
            chunk += -(-(size + skip) // self.bpc)
            offset += size
        assert chunk == len(keys), (chunk, len(keys))

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, KeysSpec)
        for key, slot, block, p in self._walk(src_spec, dst_spec.keys):
            for i, ref in enumerate(self.kv.group_data_refs[p]):
                tensor = self.kv.tensors[ref.tensor_idx].tensor
                self.pages[(key, slot, i)] = tensor[block, : ref.page_size_bytes].clone()
        self.done.append(TransferResult(job_id, True))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        assert isinstance(src_spec, KeysSpec)
        for key, slot, block, p in self._walk(dst_spec, src_spec.keys):
            for i, ref in enumerate(self.kv.group_data_refs[p]):
                tensor = self.kv.tensors[ref.tensor_idx].tensor
                page = self.pages[(key, slot, i)]
                tensor[block, : ref.page_size_bytes] = ~page if self.corrupt else page
        self.done.append(TransferResult(job_id, True))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return


class ReferenceSpec(OffloadingSpec):
    def get_manager(self) -> OffloadingManager:
        return ReferenceManager()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        corrupt = bool(self.extra_config.get("reference_corrupts_loads", False))
        return ReferenceWorker(kv_caches, self.blocks_per_chunk, corrupt)
