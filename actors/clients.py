"""Typed clients of tierstore's actors: every caller talks to an actor through one.

Each method has the name and parameters of the actor method it calls, sends the call at
once and returns a :class:`~tierstore.actors.calls.Pending`: ``.result()`` waits (never
past the client's deadline), rebuilds the answer's types (:mod:`tierstore.wire`) and
raises tierstore's own errors. A one-way caller drops the Pending. Creating a client
never blocks.

The Ray-free code that calls an actor names the part of a client it needs as a Protocol
(:class:`tierstore.store.ports.EvictorPort` for a NodeStore,
``tierstore.vllm.evictor_channel.EvictorCalls`` for the scheduler,
``tierstore.vllm.worker_ports.NodeStoreCalls`` for a worker) and is handed the client
itself; ``tests/actors/test_ports.py`` holds each to the client and the actor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
from tierstore.actors.calls import Pending, send

from tierstore.config import TierStoreConfig
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.wire import (
    EventBatch,
    LookupAnswer,
    NodeActions,
    NodeLoad,
    PullState,
    RegionInfo,
    ShardEntry,
    ShardMeta,
    ShardOffer,
    UnitOffer,
    answers_of,
    arena_info_of,
    config_of,
    decision_of,
    event_batch_of,
    holders_of,
    metas_of,
    node_load_of,
    nodes_of,
    offer_columns,
    pins_of,
    pull_states_of,
    resized_of,
    unit_decision_of,
)
from tierstore.wire_nixl import NixlLoan, nixl_loan_of

# Default deadline of an answer: the Evictor answers in milliseconds; 30 s means it is
# stuck or gone (the scheduler's lookups then count as misses).
DEFAULT_TIMEOUT_S = 30.0


class EvictorClient:
    """One Evictor shard (``tierstore.actors.evictor.Evictor``); a caller of every shard
    holds one client each (``tierstore.actors.bootstrap.evictor_clients``)."""

    def __init__(self, handle: ray.actor.ActorHandle, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.handle = handle
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any, convert: Any = None) -> Pending[Any]:
        what = f"Evictor.{method}"
        ref = send(what, getattr(self.handle, method), *args, timeout_s=self.timeout_s)
        if convert is None:
            return Pending(what, ref, self.timeout_s)
        return Pending(what, ref, self.timeout_s, convert)

    def reconcile(self) -> Pending[dict[str, list[str]]]:
        return self._call("reconcile")

    def register_node(
        self, node_id: str, cpu_bytes: int, disk_bytes: int = 0, store_id: str | None = None
    ) -> Pending[None]:
        return self._call("register_node", node_id, cpu_bytes, disk_bytes, store_id)

    def node_load(self, node_id: str) -> Pending[NodeLoad | None]:
        return self._call("node_load", node_id, convert=node_load_of)

    def resize_node(
        self, node_id: str, cpu_bytes: int, disk_bytes: int
    ) -> Pending[tuple[NodeLoad | None, NodeActions]]:
        return self._call("resize_node", node_id, cpu_bytes, disk_bytes, convert=resized_of)

    def admit(
        self, node_id: str, offers: list[ShardOffer]
    ) -> Pending[tuple[list[bool], NodeActions]]:
        """Sends ``offers`` as columns (:func:`~tierstore.wire.offer_columns`)."""
        return self._call("admit", node_id, offer_columns(offers), convert=decision_of)

    def admit_units(
        self, node_id: str, units: list[UnitOffer]
    ) -> Pending[tuple[list[list[bool]], NodeActions]]:
        """Sends ``units`` as columns: their shards, and how many each unit has."""
        shards = [offer for unit in units for offer in unit.shards]
        columns = offer_columns(shards, [len(unit.shards) for unit in units])
        return self._call("admit_units", node_id, columns, convert=unit_decision_of)

    def restore(
        self, node_id: str, held: list[tuple[ShardOffer, TierName]], grace: bool = False
    ) -> Pending[tuple[list[bool], NodeActions]]:
        return self._call("restore", node_id, held, grace, convert=decision_of)

    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        lease_ttl_s: float,
        node_id: str | None = None,
    ) -> Pending[list[LookupAnswer]]:
        """Answered as columns (:class:`~tierstore.wire.AnswerColumns`), rebuilt into
        one LookupAnswer per key by ``result`` (on the caller's thread)."""
        return self._call(
            "lookup", namespace, keys, holder, lease_ttl_s, node_id, convert=answers_of
        )

    def promoted(
        self, node_id: str, done: list[ShardId], failed: list[ShardId], refused: list[ShardId]
    ) -> Pending[None]:
        return self._call("promoted", node_id, done, failed, refused)

    def forget_shards(self, node_id: str, shard_ids: list[ShardId]) -> Pending[None]:
        return self._call("forget_shards", node_id, shard_ids)

    def report_corrupt_after_hit(self, node_id: str, shard_ids: list[ShardId]) -> Pending[None]:
        return self._call("report_corrupt_after_hit", node_id, shard_ids)

    def report_disk_writes(
        self, node_id: str, unwritten: list[ShardId], failures: int, writable: bool
    ) -> Pending[None]:
        return self._call("report_disk_writes", node_id, unwritten, failures, writable)

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, ttl_s: float
    ) -> Pending[None]:
        return self._call("extend_leases", namespace, keys, holder, ttl_s)

    def release(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        loaded: int = 0,
        node_id: str | None = None,
    ) -> Pending[None]:
        return self._call("release", namespace, keys, holder, loaded, node_id)

    def locate(
        self, namespace: Namespace, keys: list[ChunkKey], rank: int, avoid_node: str
    ) -> Pending[list[NodeId | None]]:
        return self._call("locate", namespace, keys, rank, avoid_node, convert=nodes_of)

    def holders(
        self, namespace: Namespace, keys: list[ChunkKey], world_size: int = 1
    ) -> Pending[list[frozenset[NodeId]]]:
        """Read-only (no lease, no pull): per key, the nodes holding every rank of it."""
        return self._call("holders", namespace, keys, world_size, convert=holders_of)

    def replicated(self, node_id: str, done: list[ShardId], failed: list[ShardId]) -> Pending[None]:
        return self._call("replicated", node_id, done, failed)

    def report_failed_stores(self, n_jobs: int) -> Pending[None]:
        return self._call("report_failed_stores", n_jobs)

    def release_holder(self, holder: str) -> Pending[None]:
        return self._call("release_holder", holder)

    def forget_node(self, node_id: str) -> Pending[None]:
        return self._call("forget_node", node_id)

    def events_since(self, after: int, namespace: Namespace) -> Pending[EventBatch]:
        return self._call("events_since", after, namespace, convert=event_batch_of)

    def presence(self, namespace: Namespace) -> Pending[EventBatch]:
        return self._call("presence", namespace, convert=event_batch_of)

    def index_view(self, node_id: str) -> Pending[set[tuple[ShardId, TierName]]]:
        return self._call("index_view", node_id)

    def status(self) -> Pending[dict[str, Any]]:
        return self._call("status")

    def config(self) -> Pending[TierStoreConfig]:
        """The config the actor runs with."""
        return self._call("config", convert=config_of)


class NodeStoreClient:
    """One node's NodeStore actor (``tierstore.actors.node_store_actor.NodeStore``)."""

    def __init__(
        self, handle: ray.actor.ActorHandle, node: str = "?", timeout_s: float = DEFAULT_TIMEOUT_S
    ):
        self.handle = handle
        self.node = node
        self.timeout_s = timeout_s

    def _call(
        self, method: str, *args: Any, convert: Any = None, keep_alive: object = None
    ) -> Pending[Any]:
        what = f"NodeStore.{method} on node {self.node}"
        ref = send(what, getattr(self.handle, method), *args, timeout_s=self.timeout_s)
        if convert is None:
            return Pending(what, ref, self.timeout_s, keep_alive=keep_alive)
        return Pending(what, ref, self.timeout_s, convert, keep_alive=keep_alive)

    def reregister(self, shard: int | None = None) -> Pending[int]:
        return self._call("reregister", shard)

    def store(
        self,
        namespace: Namespace,
        rank: int,
        world_size: int,
        entries: list[ShardEntry],
        buffer: np.ndarray,
    ) -> Pending[int]:
        """Puts ``buffer`` from this process (it owns the object until the store answers)."""
        ref = ray.put(buffer)
        return self._call("store", namespace, rank, world_size, entries, [ref], keep_alive=ref)

    def load(
        self, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> Pending[tuple[list[np.ndarray], list[ShardMeta]]]:
        """The shards, one read-only array each, in key order (zero-copy views of the
        fetched object, which they keep alive), and their metas."""
        return self._call("load", namespace, rank, keys, convert=self._fetched)

    def load_shards(
        self, shard_ids: list[ShardId]
    ) -> Pending[tuple[list[np.ndarray], list[ShardMeta]]]:
        """As :meth:`load`, for shards of any ranks and namespace order: a node pulling
        its copies of a request's chunks from this holder (one call, one object)."""
        return self._call("load_shards", shard_ids, convert=self._fetched)

    def lend_shards(
        self, shard_ids: list[ShardId]
    ) -> Pending[tuple[NixlLoan | list[np.ndarray], list[ShardMeta]]]:
        """As :meth:`load_shards` with ``pull_transport`` "nixl": a loan of the holder's
        extents to read over NIXL (end it with :meth:`end_loan`), or, for shards on
        its disk, their arrays as :meth:`load_shards` gives them; and the metas."""

        def lent(value: Any) -> tuple[NixlLoan | list[np.ndarray], list[ShardMeta]]:
            how, metas = value
            if isinstance(how, list):  # an object-store ref, in a list
                return self._fetched(value)
            return nixl_loan_of(how), metas_of(metas)

        return self._call("lend_shards", shard_ids, convert=lent)

    def _fetched(self, value: Any) -> tuple[list[np.ndarray], list[ShardMeta]]:
        """A ``[ref], metas`` answer: the object's arrays (zero-copy views it keeps
        alive), fetched within this client's deadline, and the metas."""
        refs, metas = value
        return list(ray.get(refs[0], timeout=self.timeout_s)), metas_of(metas)

    def end_loan(self, loan_id: int) -> Pending[None]:
        """One-way: this node is done reading the loan's extents."""
        return self._call("end_loan", loan_id)

    def pull(self, pulls: list[tuple[ShardId, NodeId]]) -> Pending[None]:
        """One-way (the Evictor, answering a lookup from this node): pull each shard from
        the node named with it, as the hot-chunk copy the Evictor reserved here."""
        return self._call("pull", pulls)

    def wait_pulls(
        self, pulls: list[tuple[ShardId, NodeId]], timeout_s: float
    ) -> Pending[list[PullState]]:
        """A load's join, or its start: each shard with its holder; a shard neither held
        on that node nor being pulled there is pulled now. Waits (at most ``timeout_s``,
        less than this client's deadline) for the shards' pulls; what each is now."""
        return self._call("wait_pulls", pulls, timeout_s, convert=pull_states_of)

    def apply(self, actions: NodeActions) -> Pending[None]:
        return self._call("apply", actions)

    def arena_info(self) -> Pending[tuple[RegionInfo | None, int]]:
        return self._call("arena_info", convert=arena_info_of)

    def arena_grant(
        self, holder: str, epoch: str, sizes: list[int]
    ) -> Pending[tuple[str, list[int | None]]]:
        return self._call("arena_grant", holder, epoch, sizes)

    def arena_commit(
        self,
        holder: str,
        epoch: str,
        namespace: Namespace,
        rank: int,
        world_size: int,
        jobs: list[list[ShardEntry]],
    ) -> Pending[tuple[int, str, list[int | None], list[tuple[int, str]]]]:
        return self._call("arena_commit", holder, epoch, namespace, rank, world_size, jobs)

    def flush_gathered(self) -> Pending[int]:
        return self._call("flush_gathered")

    def arena_give_back(self, holder: str, epoch: str, offsets: list[int]) -> Pending[None]:
        return self._call("arena_give_back", holder, epoch, offsets)

    def arena_pin(
        self, holder: str, epoch: str, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> Pending[list[tuple[int, ShardMeta]]]:
        return self._call("arena_pin", holder, epoch, namespace, rank, keys, convert=pins_of)

    def arena_unpin(self, holder: str, epoch: str, offsets: list[int]) -> Pending[None]:
        return self._call("arena_unpin", holder, epoch, offsets)

    def arena_loaded(self, epoch: str, shards: int, nbytes: int) -> Pending[None]:
        return self._call("arena_loaded", epoch, shards, nbytes)

    def accept_replicas(
        self, shards: list[tuple[ShardId, ShardMeta]], views: list[np.ndarray]
    ) -> Pending[None]:
        """Puts the shards' bytes (one array each) into one object, copied before this
        returns; this process owns it until the call answers."""
        ref = ray.put(views)
        return self._call("accept_replicas", shards, [ref], keep_alive=ref)

    def inventory(self) -> Pending[set[tuple[ShardId, TierName]]]:
        return self._call("inventory")

    def status(self) -> Pending[dict[str, Any]]:
        return self._call("status")

    def config(self) -> Pending[TierStoreConfig]:
        """The config the actor runs with."""
        return self._call("config", convert=config_of)
