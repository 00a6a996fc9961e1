"""TierStoreConnector: loaded by vLLM's factory from the recommended config, and its
worker side turns a failed load job into its request's ``failed_recving``.

The engine-level proof (a real failed load recomputed, the engine serving on) is
``tests/e2e/test_failed_load.py``; here the job bookkeeping is checked against vLLM's own
connector-worker code, with a scripted ``OffloadingWorker`` in place of the transfers.
"""

from __future__ import annotations

import pytest
from tierstore.deploy.passes import TIERSTORE_SPEC, kv_transfer_config
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tests.unit.test_namespace import _config
from tierstore.connector import TierStoreConnector
from tierstore.errors import TierStoreError
from tierstore.spec import TierStoreSpec
from tierstore.vllm.connector import TierStoreConnectorWorker


class _ScriptedWorker(OffloadingWorker):
    """Finishes each submitted job with the outcome the test chose for it."""

    def __init__(self, outcomes: dict[int, bool]) -> None:
        self._outcomes = outcomes
        self._submitted: list[int] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._submitted.append(job_id)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        self._submitted.append(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._submitted = self._submitted, []
        return [
            TransferResult(j, self._outcomes[j], 100, 0.1)
            if self._outcomes[j]
            else TransferResult(j, False)
            for j in done
        ]

    def wait(self, job_ids: set[int]) -> None:
        return


def _connector_worker(outcomes: dict[int, bool]) -> TierStoreConnectorWorker:
    extra = {**TIERSTORE_SPEC, "cpu_bytes_per_node": 1 << 20}
    spec = TierStoreSpec(_config(extra_config=extra))
    worker = TierStoreConnectorWorker(spec, None, None)  # type: ignore[arg-type]
    worker.worker = _ScriptedWorker(outcomes)
    return worker


def _job(req_id: str) -> TransferJob:
    return TransferJob(
        req_id, LoadStoreSpec(), GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0])
    )


def _store(req_id: str) -> TransferJob:
    return TransferJob(
        req_id, GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0]), LoadStoreSpec()
    )


def test_the_recommended_config_loads_tierstores_connector() -> None:
    config = KVTransferConfig(**kv_transfer_config({**TIERSTORE_SPEC, "cpu_bytes_per_node": 1}))
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls is TierStoreConnector and issubclass(cls, OffloadingConnector)
    assert config.kv_load_failure_policy == "recompute"


def test_a_failed_load_fails_its_request_and_completes_its_job() -> None:
    worker = _connector_worker({1: True, 2: False, 3: True})
    worker.start_kv_transfers(
        OffloadingConnectorMetadata(load_jobs={1: _job("ok"), 2: _job("lost")}, store_jobs={})
    )
    worker.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs={3: _store("s")}))
    worker.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    results = worker.get_transfer_results()
    # vLLM's contract: a failed receive is also a finished one (it leaves the wait state).
    assert results.finished_recving == {"ok", "lost"}
    assert results.failed_recving == {"lost"}
    assert results.finished_sending == set()
    meta = worker.build_connector_worker_meta()
    assert meta is not None and meta.completed_jobs == {1: 1, 2: 1, 3: 1}  # leases released
    # Only the successful jobs' bytes reach vllm:kv_offload_* metrics.
    assert meta.transfer_stats.load.sizes == [100] and meta.transfer_stats.store.sizes == [100]


def test_a_failure_with_no_request_to_fail_stops_loudly() -> None:
    worker = _connector_worker({5: False})
    worker.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs={5: _store("s")}))
    worker.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    with pytest.raises(TierStoreError, match="job 5 failed and is not a load"):
        worker.get_transfer_results()
