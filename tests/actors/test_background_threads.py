"""Every background loop survives its own exceptions: one raises, the next call still runs.

Real parts: the real Evictor actor on a local Ray, the real EvictorChannel thread.
"""

from __future__ import annotations

import threading

import numpy as np
import ray
from tierstore.actors.bootstrap import get_or_create_evictor, get_or_create_node_store
from tierstore.actors.clients import EvictorClient, NodeStoreClient

from tests.actors.hooks import start_evictor_for_tests
from tests.support import wait_for
from tierstore.config import TierStoreConfig
from tierstore.data.checksum import digest
from tierstore.keys import ChunkKey, Namespace
from tierstore.vllm.evictor_channel import EvictorChannel
from tierstore.wire import LookupAnswer, LookupState, NodeActions, ShardEntry, ShardOffer

NS = Namespace("threads-test")
KEY = ChunkKey(b"\1" * 8 + b"\0" * 4)
# Generous: a local Ray answers in milliseconds; the reconcile ticks every 2 s.
_WAIT_S = 30.0


def test_a_raising_callback_does_not_stop_the_channel(cfg: TierStoreConfig) -> None:
    evictor = EvictorClient(get_or_create_evictor(cfg))
    node = ray.get_runtime_context().get_node_id()
    evictor.register_node(node, 1000).result()
    evictor.admit(node, [ShardOffer(NS, KEY, 0, 1, 100)]).result()
    channel = EvictorChannel(evictor)
    raised = threading.Event()

    def explode(answers: list[LookupAnswer]) -> None:
        raised.set()
        raise RuntimeError("a callback failed on purpose")

    channel.lookup(NS, [KEY], "t", 5.0, explode)
    wait_for(raised.is_set, "the raising callback run", _WAIT_S)
    got: list[list[LookupAnswer]] = []
    channel.lookup(NS, [KEY], "t", 5.0, got.append)
    (answers,) = wait_for(lambda: got, "the next lookup answered", _WAIT_S)
    assert [a.state for a in answers] == [LookupState.HIT]
    assert channel.failed_callbacks == 1
    channel.close()


def test_a_failed_reconcile_does_not_stop_the_evictor_ticker(cfg: TierStoreConfig) -> None:
    handle = start_evictor_for_tests(cfg)
    evictor = EvictorClient(handle)

    def reconciles() -> dict[str, int]:
        return evictor.status().result()["reconciles"]

    wait_for(lambda: reconciles()["done"] >= 1, "a first reconcile", _WAIT_S)
    ray.get(handle.fail_next_reconcile.remote(), timeout=_WAIT_S)
    failed = wait_for(lambda: reconciles()["failed"] == 1 and reconciles(), "a failure", _WAIT_S)
    wait_for(
        lambda: reconciles()["done"] > failed["done"], "a reconcile after the failure", _WAIT_S
    )
    assert reconciles()["failed"] == 1


def test_a_failed_deferred_apply_does_not_stop_the_node_store(cfg: TierStoreConfig) -> None:
    """``apply`` (the Evictor's decisions and the NodeStore's own deferred work) is one-way:
    a bad one is logged and counted, and the NodeStore keeps storing."""
    node = ray.get_runtime_context().get_node_id()
    store = NodeStoreClient(get_or_create_node_store(cfg, node), node)
    malformed = NodeActions(drop=[("not a shard id",)])  # type: ignore[list-item]
    assert store.apply(malformed).result() is None
    assert store.status().result()["apply_failures"] == 1
    data = np.arange(100, dtype=np.uint8)
    entries = [ShardEntry(KEY, 0, data.nbytes, digest(data), 1)]
    assert store.store(NS, 0, 1, entries, data).result() == 1
