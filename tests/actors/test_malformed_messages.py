"""What a NodeStore sends the Evictor, and what a worker commits, is checked before any
book changes: a malformed item is refused and counted, the rest go in.

Real Ray: the Evictor actor takes offers (columns), restored copies and shard ids as a
NodeStore sends them (plain tuples, as msgpack delivers them); a real worker commits through the
node's real NodeStore, one of its store jobs carrying a malformed entry.
"""

from __future__ import annotations

from typing import Any

import pytest
import ray
from tierstore.actors.bootstrap import find_node_store, get_or_create_evictor
from tierstore.actors.clients import EvictorClient

from tests.support import poll, wait_for
from tests.vllm.test_worker_arena import SRC, _pool_ready
from tests.vllm.test_worker_roundtrip import NS, _drain, _keys, _kv, _lookup, _worker
from tierstore.config import TierStoreConfig
from tierstore.fields import MalformedField
from tierstore.keys import ChunkKey, ShardId, TierName
from tierstore.vllm.arena_jobs import ArenaJobs
from tierstore.vllm.transfer_specs import StoreSpec
from tierstore.wire import LookupState, ShardEntry, ShardOffer, UnitOffer, offer_columns


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def _offer(i: int, nbytes: int = 256, key: Any = None) -> tuple[Any, ...]:
    """A ShardOffer as msgpack delivers it: a plain tuple."""
    return (NS, _key(i) if key is None else key, 0, 1, nbytes, None)


def _evictor_on_this_node(cfg: TierStoreConfig) -> tuple[Any, str]:
    evictor = get_or_create_evictor(cfg)
    node = ray.get_runtime_context().get_node_id()
    wait_for(  # the reconcile places the node's NodeStore, which registers the node
        lambda: node in ray.get(evictor.status.remote(), timeout=10)["nodes"],
        "this node registered with the Evictor",
        timeout_s=60,
    )
    return evictor, node


def _malformed(evictor: Any) -> int:
    return ray.get(evictor.status.remote(), timeout=10)["totals"]["malformed_items"]  # type: ignore[no-any-return]


def test_the_evictor_refuses_malformed_offers_and_indexes_the_rest(cfg: TierStoreConfig) -> None:
    evictor, node = _evictor_on_this_node(cfg)
    offers = [
        ShardOffer(NS, _key(1), 0, 1, 256),
        ShardOffer(NS, _key(2), 0, 1, -1),  # negative size
        ShardOffer(NS, b"short", 0, 1, 256),  # a key of no KV cache group's length
        ShardOffer(NS, b"\1" * 8 + (1 << 20).to_bytes(4, "big"), 0, 1, 256),  # no such group
        ShardOffer(NS, _key(5), 3, 2, 256),  # a rank outside its world
        ShardOffer("not a namespace", _key(6), 0, 1, 256),
        ShardOffer(NS, _key(7), 0, 1, 256),
    ]
    # Columns that do not fit together: refused whole (nothing indexed, nothing counted).
    broken = offer_columns(offers)._replace(ranks=b"\0" * 3)
    with pytest.raises(MalformedField, match=r"offers\.ranks"):
        ray.get(evictor.admit.remote(node, broken), timeout=30)
    with pytest.raises(MalformedField, match="not OfferColumns"):
        ray.get(evictor.admit.remote(node, [tuple(o) for o in offers]), timeout=30)
    assert not ray.get(evictor.index_view.remote(node), timeout=10)

    accepted, _ = ray.get(evictor.admit.remote(node, offer_columns(offers)), timeout=30)
    assert accepted == [True, False, False, False, False, False, True]
    indexed = ray.get(evictor.index_view.remote(node), timeout=10)
    assert {ShardId(*s).key for s, _ in indexed} == {_key(1), _key(7)}
    assert _malformed(evictor) == 5

    # Shard ids a NodeStore reports: the malformed one is refused, the good one applied.
    ray.get(evictor.forget_shards.remote(node, [(NS, _key(1), 0), (NS, 5, "x")]), timeout=10)
    indexed = ray.get(evictor.index_view.remote(node), timeout=10)
    assert {ShardId(*s).key for s, _ in indexed} == {_key(7)}
    assert _malformed(evictor) == 6


def test_the_evictor_admits_a_tp_groups_units_refusing_a_malformed_one_whole(
    cfg: TierStoreConfig,
) -> None:
    """A TP=8 3-group NodeStore's batch (units of 24 shards, past the row-by-row size):
    through the client's columns, each good unit is one decision, a malformed unit is
    refused whole (no flag; counted once), a held one's shards are refused alone, and the
    admitted shards' events name each admitted chunk once (its rank 0)."""
    evictor, node = _evictor_on_this_node(cfg)
    client = EvictorClient(evictor)

    def unit(b: int, root: int = 7) -> UnitOffer:
        shards = [
            ShardOffer(NS, _key(b)[:8] + g.to_bytes(4, "big"), r, 8, 1, None, root)
            for g in range(3)
            for r in range(8)
        ]
        return UnitOffer(shards)

    units = [unit(b) for b in range(100, 110)]
    mixed = unit(110)
    units.append(UnitOffer([*mixed.shards[:-1], mixed.shards[-1]._replace(root=8)]))
    empty = unit(111)
    units.append(UnitOffer([*empty.shards[:-1], empty.shards[-1]._replace(nbytes=0)]))
    units += [unit(112), unit(100)]  # the last: held already, each shard refused alone
    before = _malformed(evictor)
    after = client.events_since(0, NS).result().next_seq
    accepted, _ = client.admit_units(node, units).result()
    assert accepted == [[True] * 24] * 10 + [[], []] + [[True] * 24, [False] * 24]
    assert _malformed(evictor) == before + 2
    events = client.events_since(after, NS).result().events
    admitted = [
        k
        for e in events
        if e.node == node and e.tier is TierName.CPU and not e.removed
        for k in e.keys
    ]
    good = [*units[:10], units[12]]
    assert sorted(admitted) == sorted(o.key for u in good for o in u.shards if o.rank == 0)


def test_a_restore_indexes_its_good_copies_and_drops_the_malformed_ones(
    cfg: TierStoreConfig,
) -> None:
    """A restarted NodeStore offers its disk inventory: a malformed copy is refused, and
    the node is told to drop it where it names a shard (the index will not count its
    bytes)."""
    evictor, node = _evictor_on_this_node(cfg)
    held = [
        (_offer(11), TierName.CPU.value),  # (this node has no disk tier)
        (_offer(12, nbytes=0), TierName.DISK.value),
        (_offer(13), "tape"),
        ("not", "a copy", "at all"),
        (_offer(14), TierName.CPU.value),
    ]
    accepted, actions = ray.get(evictor.restore.remote(node, held, False), timeout=30)
    assert accepted == [True, False, False, False, True]
    indexed = ray.get(evictor.index_view.remote(node), timeout=10)
    assert {ShardId(*s).key for s, _ in indexed} == {_key(11), _key(14)}
    assert {ShardId(*s).key for s in actions.drop} == {_key(12), _key(13)}
    assert _malformed(evictor) == 3


def test_a_workers_malformed_store_job_fails_alone(
    cfg: TierStoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One job's entry says -1 bytes: the NodeStore refuses that job whole (counted) and
    keeps the other job; the worker counts a failed store and
    hands the job's extents back; the refused job's chunks are misses, never HITs."""
    worker = _worker(cfg, _kv())
    keys_of = {job: _keys(2, 0, 10 * job) + _keys(1, 1, 10 * job) for job in (1, 2, 3)}
    worker.submit_store(1, SRC, StoreSpec(NS, tuple(keys_of[1])))  # maps the arena
    assert _drain(worker, 1) == [1]
    _pool_ready(worker)  # room for two more jobs in the worker's pool
    bad_key = keys_of[3][1]
    entries = ArenaJobs._entries

    def spoiled(commit: Any) -> list[ShardEntry]:
        return [e._replace(nbytes=-1) if e.key == bad_key else e for e in entries(commit)]

    monkeypatch.setattr(ArenaJobs, "_entries", staticmethod(spoiled))
    stores = worker.arena.arena_stores
    for job in (2, 3):  # queued together: most often one commit call
        assert worker.submit_store(job, SRC, StoreSpec(NS, tuple(keys_of[job])))
    assert sorted(_drain(worker, 2)) == [2, 3]
    assert worker.wait_committed(30)
    assert worker.arena.arena_stores == stores + 2  # both went through the arena
    assert worker.failed_stores == 1
    assert _lookup(cfg, keys_of[2]) == [LookupState.HIT] * 3
    assert _lookup(cfg, keys_of[3]) == [LookupState.MISS] * 3  # refused whole
    store = find_node_store(cfg.namespace, ray.get_runtime_context().get_node_id())
    status = ray.get(store.status.remote(), timeout=10)
    assert status["stats"]["refused_commits"] == 1
    monkeypatch.undo()
    worker.shutdown()  # what it holds goes back: nothing of the refused job leaked
    done = poll(
        lambda: ray.get(store.status.remote(), timeout=10)["arena"]["granted_bytes"],
        10,
        done=lambda granted: granted == 0,
    )
    assert done == 0
    assert ChunkKey(bad_key) not in {s.key for s, _ in ray.get(store.inventory.remote())}
