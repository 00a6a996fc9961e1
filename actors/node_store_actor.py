"""The NodeStore actor: Ray around :class:`~tierstore.store.node_store.NodeStoreCore`.

A threaded actor with concurrency groups (:data:`CONCURRENCY_GROUPS`), so a load never
queues behind a store waiting on the Evictor's ``admit`` or behind deferred disk work:

- ``data`` (:data:`DATA_THREADS` threads): ``load`` and the arena's grants, pins and
  unpins. Holds the core's lock only to look shards up and copy them out; never waits
  on the Evictor or a peer.
- ``control`` (one thread): ``store``, ``arena_commit``, ``apply``, ``accept_replicas``,
  ``reregister``, ``flush_gathered``.
  Waits on the Evictor (deadlines below) and writes to disk. One thread keeps the
  Evictor's decisions applied in the order it made them, as before.
- ``pulls`` (:data:`PULL_WAIT_THREADS` threads): ``wait_pulls``, a load joining (or
  starting) this node's lookup-time pulls (each waits at most its deadline); the pulls
  themselves run on :class:`~tierstore.store.pulls.Pulls`' own threads
  (``pulls_per_node``), started by ``pull`` (one-way, from the Evictor) on a data thread
  or by ``wait_pulls``, and ``load_shards`` / ``lend_shards`` (the holder's side, by
  ``pull_transport``) are data calls.
- the default group (one thread): ``inventory``, ``status`` and ``config``: quick
  reads, answered even while a store waits on ``admit``.
- a flusher thread (not Ray's): while a TP group's shards are gathered, sends this
  actor ``flush_gathered`` every ``GATHER_WAIT_S``, so a unit no commit completes is
  offered all the same;
- a write-through thread (not Ray's): copies stored shards to disk after their store is
  answered, in batches, so a commit never waits behind the last one's disk writes and
  no Ray call to itself is made per store.
"""

from __future__ import annotations

import functools
import logging
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import ray
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from tierstore.actors.names import evictor_name, node_store_name

from tierstore.config import TierStoreConfig
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.reaper import start_reaper
from tierstore.data.arena.region import ArenaRegion
from tierstore.data.tiers.arena import ArenaTier
from tierstore.data.tiers.disk import DiskTier
from tierstore.errors import ChunkNotFoundError, UnknownNodeError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.store.arena_store import ArenaStore
from tierstore.store.batch_queue import BatchQueue
from tierstore.store.evictor_shards import (
    ShardedEvictorPort,
    ShareBalancer,
    ShareBook,
    failed_shards,
)
from tierstore.store.loans import ArenaLoans
from tierstore.store.nixl_pulls import NixlArena
from tierstore.store.node_store import NodeStoreCore
from tierstore.store.pulls import Moved, Pulls
from tierstore.store.rank_gather import GATHER_WAIT_S
from tierstore.store.replicas import Landed
from tierstore.wire import (
    NodeActions,
    RegionInfo,
    ShardEntry,
    ShardMeta,
    checked_shard_ids,
    node_actions_of,
    pulls_of,
    replicas_of,
)
from tierstore.wire_nixl import NixlLoan

logger = logging.getLogger(__name__)

# Loads of one node's workers (a TP group loads every rank's shards at once) run side
# by side; their copies and checksums release the GIL for large buffers. More threads
# than this only add memory for buffers in flight on a node with few cores.
DATA_THREADS = 4
# Loads waiting for this node's lookup-time pulls (tierstore.store.pulls): each waits at
# most its deadline, on a group of its own so no data call queues behind it.
PULL_WAIT_THREADS = 8
CONCURRENCY_GROUPS = {"data": DATA_THREADS, "control": 1, "pulls": PULL_WAIT_THREADS}
_DATA = ray.method(concurrency_group="data")
_CONTROL = ray.method(concurrency_group="control")


# Deadline of registering with the Evictor (it answers in milliseconds; this bounds a
# start while it is stuck or restarting). The core's waits on it have theirs
# (tierstore.store.node_store).
_REGISTER_TIMEOUT_S = 30.0
# Pulling a job or replica buffer from its producer's object store: milliseconds on one
# node, a transfer across nodes; a producer that died leaves the ref unresolvable.
_BUFFER_TIMEOUT_S = 60.0
# How often a NodeStore moves its tiers' bytes between the Evictor shards' shares
# (ShareBalancer): each round is a few calls per shard, off the store path; a shift of
# traffic to one shard's prefix trees is followed within a few rounds.
_REBALANCE_PERIOD_S = 1.0
# A graceful stop writes what is queued for write-through up to this long.
_WRITE_THROUGH_DRAIN_S = 10.0
# The arena's room beyond the CPU tier: extents granted to workers and not committed
# yet, and extents pinned by loads after the Evictor dropped their shard.
_GRANT_ROOM_MIN = 256 << 20
_GRANT_ROOM_SHARE = 8


def grant_room(cpu_bytes_per_node: int) -> int:
    """Bytes of the arena beyond the CPU tier: an eighth of it, at least 256 MiB (never
    more than the tier itself). It scales with the tier because a worker's pool may hold
    half of it and a store job larger than its pool takes the object store: a 32k-token
    prefill of an 8B model is a 4 GiB job."""
    share = max(_GRANT_ROOM_MIN, cpu_bytes_per_node // _GRANT_ROOM_SHARE)
    return min(cpu_bytes_per_node, share)


def _open_arena(cfg: TierStoreConfig, node_id: str, disk_folder: Path | None) -> ArenaTier:
    """The node's CPU tier in a new shared arena (a stale one of this name is replaced).
    Where ``/dev/shm`` has no room, a file-backed one inside the disk tier's own folder
    (else the temp directory)."""
    room = grant_room(cfg.cpu_bytes_per_node)
    fallback = disk_folder if disk_folder is not None else Path(tempfile.gettempdir())
    region = ArenaRegion.create(
        cfg.namespace, node_id, cfg.cpu_bytes_per_node + room, fallback_dir=fallback
    )
    return ArenaTier(region, cfg.cpu_bytes_per_node)


class RayPeers:
    """Other nodes' NodeStores seen from this one (a ``PeerPort``). A push is one-way: the
    receiver pulls the bytes from this node's object store, so two NodeStores pushing to
    each other never wait on one another."""

    def __init__(self, namespace: str) -> None:
        self._namespace = namespace

    def accept_replicas(
        self, node: NodeId, shards: list[tuple[ShardId, ShardMeta]], views: list[np.ndarray]
    ) -> None:
        try:
            store = ray.get_actor(node_store_name(node), namespace=self._namespace)
        except ValueError:
            logger.warning("no NodeStore on node %s; replicas not sent", node)
            return  # the node is gone: the Evictor forgets its replicas with it
        NodeStoreClient(store, node).accept_replicas(shards, views)


def capacity_shares(total: int, shards: int) -> list[int]:
    """Each Evictor shard's part of a node tier of ``total`` bytes: ``total // shards``,
    shard 0 also the remainder (so the parts add up to the tier)."""
    share = total // shards
    return [share + (total % shards if shard == 0 else 0) for shard in range(shards)]


class NodeStore:
    """One node's tiers. Talks to every Evictor shard (found by name, ``cfg.evictor_shards``
    of them: a number, never ``"auto"``, which its starter resolves): registers with each
    its share of the node's tiers (:func:`capacity_shares`), and offers each the shards
    whose root maps to it (the core's port is a
    :class:`~tierstore.store.evictor_shards.ShardedEvictorPort` over the shards' clients).
    A shard that restarted and no longer knows this node (``UnknownNodeError``) has it
    register and re-offer that shard's part again, as the shard's own reconcile would."""

    def __init__(self, node_id: str, cfg: TierStoreConfig) -> None:
        self._evictors = [
            EvictorClient(ray.get_actor(evictor_name(shard), namespace=cfg.namespace))
            for shard in range(cfg.shard_count)
        ]
        self._me = NodeStoreClient(ray.get_runtime_context().current_actor, node_id)
        self._reregistering: set[int] = set()  # shards a reregister was sent for
        self._reregistering_lock = threading.Lock()
        evictor = ShardedEvictorPort(self._evictors, self._root_of, self._shard_failed)
        self._node_id = node_id
        self._cfg = cfg
        self._shares = ShareBook(
            capacity_shares(cfg.cpu_bytes_per_node, cfg.shard_count),
            capacity_shares(cfg.disk_bytes_per_node, cfg.shard_count),
        )
        self._id = ray.get_runtime_context().get_actor_id()
        self._register()
        disk = None
        if cfg.disk_bytes_per_node > 0 and cfg.disk_path:
            path = Path(cfg.disk_path)  # absolute: the config refuses anything else
            disk = DiskTier(path, cfg.disk_bytes_per_node, fsync=cfg.disk_fsync, node_id=node_id)
        self._cpu = _open_arena(cfg, node_id, disk.folder if disk is not None else None)
        # Unlinks the arena once this process is gone, however it dies (ray down, kill).
        self._reaper = start_reaper(self._cpu.info)  # None: logged; the sweep remains
        self._apply_failures = 0
        self._write_through: BatchQueue[list[ShardId]] = BatchQueue(
            self._write, "tierstore-write-through"
        )
        self._core = NodeStoreCore(
            NodeId(node_id),
            self._cpu,
            disk,
            evictor,
            defer=self._write_through.put,
            peers=RayPeers(cfg.namespace),
        )
        self._arena = ArenaStore(self._core, self._cpu)
        self._holders: dict[NodeId, NodeStoreClient] = {}  # other nodes' NodeStores, pulled from
        self._nixl: NixlArena | None = None
        if cfg.pull_transport == "nixl":
            # This NodeStore's own holder of pins (lent extents) and grants (pulled ones).
            self._holder_lock = HolderLock(self._cpu.info.path)
            holder, timeout_s = self._holder_lock.holder, self._pull_timeout_s
            loans = ArenaLoans(self._core, self._cpu, holder, timeout_s)
            self._nixl = NixlArena(loans, self._cpu.region.array, node_id, timeout_s)
        self._pulls = Pulls(
            self._move, self._core.report_replicas, self._core.holds, cfg.pulls_per_node
        )
        self._parked = 0  # shards gathered for their TP group (read by the flusher)
        self._stop = threading.Event()
        # Sends this actor a flush of gathered units no commit came to offer; all arena
        # work stays on the control thread, so nothing here needs a lock.
        self._flusher = threading.Thread(
            target=self._flush_loop, args=(self._me,), name="tierstore-gather-flush", daemon=True
        )
        self._flusher.start()
        self._start_rebalancer()
        recovered = self._core.register_inventory()
        if recovered:
            logger.info("NodeStore %s: %d shards recovered from disk", node_id, recovered)

    def _write(self, batches: list[list[ShardId]]) -> None:
        """Write-through thread: the shards of the stores queued since the last batch."""
        self._core.write_through([shard_id for batch in batches for shard_id in batch])

    def _register(self, shard: int | None = None) -> None:
        """Register this node with Evictor shard ``shard`` (None: every shard, the calls
        sent at once), each with its share of the tiers; waits for every answer."""
        shards = range(len(self._evictors)) if shard is None else [shard]
        with self._shares.lock:  # its current share, sent in order with the resizes
            sent = [
                self._evictors[i].register_node(
                    self._node_id, self._shares.cpu[i], self._shares.disk[i], store_id=self._id
                )
                for i in shards
            ]
        for reply in sent:
            reply.result(_REGISTER_TIMEOUT_S)

    def _start_rebalancer(self) -> None:
        """With several Evictor shards, a thread (not Ray's) that moves this node's tier
        bytes between their shares every :data:`_REBALANCE_PERIOD_S` (ShareBalancer: the
        givers shrink and their evictions are applied here, through :meth:`apply`, before
        a taker grows). Its calls wait with their clients' deadlines; none is made on the
        store path."""
        self._balancer: ShareBalancer | None = None
        if len(self._evictors) < 2:
            return
        me = self._me
        self._balancer = ShareBalancer(
            self._node_id,
            self._evictors,
            self._shares,
            self._cfg.cpu_bytes_per_node,
            self._cfg.disk_bytes_per_node,
            lambda actions: me.apply(actions).result(),
        )
        threading.Thread(
            target=self._rebalance_loop, name="tierstore-rebalance", daemon=True
        ).start()

    def _rebalance_loop(self) -> None:
        """The rebalancer thread: a failed round is logged, never its end."""
        while not self._stop.wait(_REBALANCE_PERIOD_S):
            try:
                if self._balancer is not None:
                    self._balancer.run_round()
            except Exception as exc:
                logger.info("NodeStore %s: shares not rebalanced: %s", self._node_id, exc)

    @_CONTROL
    def reregister(self, shard: int | None = None) -> int:
        """Evictor shard ``shard`` (None: every shard) restarted and lost its index:
        register with it and offer it again what is held here of its prefix trees."""
        if shard is not None and not (isinstance(shard, int) and 0 <= shard < len(self._evictors)):
            logger.warning("NodeStore %s: reregister of unknown shard %r", self._node_id, shard)
            return 0
        return self._reregister(shard)

    def _reregister(self, shard: int | None = None) -> int:
        with self._reregistering_lock:  # from here on, a new failure sends another
            if shard is None:
                self._reregistering.clear()
            else:
                self._reregistering.discard(shard)
        self._register(shard)
        return self._core.register_inventory(after_evictor_restart=True, shard=shard)

    def _reregister_failed(self, error: UnknownNodeError) -> None:
        """A call every shard it went to failed, some (or the one Evictor) not knowing
        this node: register with the shards that failed and re-offer their parts."""
        shards = failed_shards(error)
        if shards is None:
            self._reregister()
            return
        for shard in shards:
            self._reregister(shard)

    def _root_of(self, shard_id: ShardId) -> int | None:
        """The root of this node's copy of ``shard_id`` (the port routes reports by it)."""
        return self._core.root_of(shard_id)

    def _shard_failed(self, shard: int, error: BaseException) -> None:
        """Evictor shard ``shard``'s part of a call failed while other shards answered
        (its units refused, its copies left unindexed). One that lost this node
        (restarted) gets a reregister of this actor, one-way, once until it runs; any other
        failure (a restart still under way, a stuck shard) is logged: the shard's
        reconcile asks for the reregister once it is back."""
        if not isinstance(error, UnknownNodeError):
            logger.warning("Evictor shard %d did not answer (its part refused): %s", shard, error)
            return
        with self._reregistering_lock:
            if shard in self._reregistering:
                return
            self._reregistering.add(shard)
        logger.info("Evictor shard %d does not know node %s; reregistering", shard, self._node_id)
        self._me.reregister(shard)  # one-way: runs after the current control call

    @_CONTROL
    def store(
        self,
        namespace: Namespace,
        rank: int,
        world_size: int,
        entries: list[ShardEntry],
        buffer_ref: list[ray.ObjectRef],
    ) -> int:
        # The ref comes wrapped in a list so Ray hands it over unresolved; get it here,
        # zero-copy, and let the core copy out what it keeps.
        buffer = ray.get(buffer_ref[0], timeout=_BUFFER_TIMEOUT_S)
        # Entries arrive as plain tuples: the store checks and rebuilds each one.
        try:
            return self._core.store(namespace, rank, world_size, entries, buffer)
        except UnknownNodeError as exc:
            # An Evictor shard restarted and has not reconciled yet: register this node
            # and offer what it holds (as the reconcile would), then admit the new shards.
            logger.info("Evictor does not know node %s yet; registering", self._node_id)
            self._reregister_failed(exc)
            return self._core.store(namespace, rank, world_size, entries, buffer)

    @_DATA
    def load(
        self, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> tuple[list[ray.ObjectRef], list[ShardMeta]]:
        """The shards' bytes in one object, put straight from their extents (one copy,
        made while no extent can be reused), and their metas. This actor owns the object;
        the caller gets it while this actor lives (a ref returned in a list is borrowed,
        so it outlives this call), or retries elsewhere if it died meanwhile."""
        ref, metas = self._core.load_views(namespace, rank, keys, ray.put)
        # Returning the arrays would copy them per call; a ref in a list does not.
        return [ref], metas

    @_DATA
    def load_shards(self, shard_ids: list[ShardId]) -> tuple[list[ray.ObjectRef], list[ShardMeta]]:
        """As :meth:`load`, for shards of any ranks: another node pulling its copies of a
        request's chunks held here, in one object (one ``ray.put`` of the extents)."""
        ids = [s for s in checked_shard_ids(shard_ids) if s is not None]
        if len(ids) != len(shard_ids):
            raise ValueError(f"{len(shard_ids) - len(ids)} malformed shard ids")
        ref, metas = self._core.load_shard_views(ids, ray.put)
        return [ref], metas

    @_DATA
    def lend_shards(
        self, shard_ids: list[ShardId]
    ) -> tuple[NixlLoan | list[ray.ObjectRef], list[ShardMeta]]:
        """As :meth:`load_shards`, with ``pull_transport`` "nixl": the shards' extents
        lent for the caller to read over NIXL (a loan it ends with :meth:`end_loan`),
        or, if one is on disk only, one object-store object of them all (a ref in a
        list, as :meth:`load_shards`); and their metas."""
        ids = [s for s in checked_shard_ids(shard_ids) if s is not None]
        if len(ids) != len(shard_ids):
            raise ValueError(f"{len(shard_ids) - len(ids)} malformed shard ids")
        if self._nixl is None:
            raise ValueError(f"this NodeStore's pull_transport is {self._cfg.pull_transport!r}")
        try:
            return self._nixl.lend(ids)
        except ChunkNotFoundError:  # one is on disk only: read them all, put them
            ref, metas = self._core.load_shard_views(ids, ray.put)
            return [ref], metas

    @_DATA
    def end_loan(self, loan_id: int) -> None:
        """One-way, from the node that read a loan's extents (:meth:`lend_shards`)."""
        if self._nixl is not None and isinstance(loan_id, int):
            self._nixl.end_loan(loan_id)

    # ---- lookup-time pulls (tierstore.store.pulls) -----------------------------------
    @_DATA
    def pull(self, pulls: list[tuple[ShardId, NodeId]]) -> None:
        """One-way, from the Evictor answering a lookup from this node: start pulling each
        shard from its holder (returns at once; the pulls run on their own threads)."""
        try:
            self._pulls.start(pulls_of(pulls))
        except Exception:  # one-way: nobody else would hear of it
            logger.warning("NodeStore %s: a pull message failed", self._node_id, exc_info=True)

    @ray.method(concurrency_group="pulls")
    def wait_pulls(self, pulls: list[tuple[ShardId, NodeId]], timeout_s: float) -> list[str]:
        """A load's join, or its start: ``pulls`` names each shard's holder, and one
        neither held here nor being pulled is pulled now (the load came before the
        Evictor's pull message; not with ``pulls_per_node`` 0). Waits (at most
        ``timeout_s``) for the shards' pulls; per shard, whether it is held here, its
        pull failed, or none ran (or the pull the load started failed: it reads the
        shard itself, as without pulls)."""
        asked = pulls_of(pulls)
        wait_s = max(0.0, min(float(timeout_s), _BUFFER_TIMEOUT_S))
        # pulls_per_node 0: no pulls here at all; a load reads from the holders itself.
        holders = [h for _, h in asked] if self._cfg.pulls_per_node else None
        states = self._pulls.wait([s for s, _ in asked], wait_s, holders)
        return [state.value for state in states]

    @property
    def _pull_timeout_s(self) -> float:
        return min(_BUFFER_TIMEOUT_S, self._cfg.transfer_timeout_s)

    def _move(self, holder: NodeId, shard_ids: list[ShardId]) -> Moved:
        """A pull thread: ``shard_ids`` from ``holder``'s NodeStore in one call and one
        transfer, by ``pull_transport``: read into this node's arena in place (NIXL; the
        loan's end is the Moved's, or sent here if the read failed), or pulled into this
        node's object store and copied into the arena; kept verified."""
        client = self._holders.get(holder)
        if client is None:
            store = ray.get_actor(node_store_name(holder), namespace=self._cfg.namespace)
            client = self._holders[holder] = NodeStoreClient(store, holder, self._pull_timeout_s)
        started = time.perf_counter()
        try:
            if self._nixl is not None:
                lent, metas = client.lend_shards(shard_ids).result(self._pull_timeout_s)
                if isinstance(lent, NixlLoan):
                    end_loan = functools.partial(client.end_loan, lent.loan_id)  # one-way
                    try:  # zip: a reply of another length raises ValueError
                        shards = list(zip(shard_ids, metas, strict=True))
                        moved = self._nixl.read(lent, shards, started)
                    except BaseException:
                        end_loan()
                        raise
                    return moved._replace(end_loan=end_loan)
                views = lent
            else:
                views, metas = client.load_shards(shard_ids).result(self._pull_timeout_s)
            if len(views) != len(shard_ids) or len(metas) != len(shard_ids):
                raise ValueError(f"{len(views)} arrays for {len(shard_ids)} shards")
            fetched = time.perf_counter()
            landed = self._core.keep_replicas(list(zip(shard_ids, metas, strict=True)), views)
            return Moved(sum(int(v.nbytes) for v in views), fetched - started, landed)
        except Exception:
            self._holders.pop(holder, None)  # it may have been replaced: look it up again
            raise

    @_CONTROL
    def apply(self, actions: NodeActions) -> None:
        """The Evictor's decisions, and this actor's deferred work: both one-way, so no
        caller would see an error; it is logged and counted, and the next call runs."""
        try:
            self._core.apply(node_actions_of(actions))
        except Exception:
            self._apply_failures += 1
            logger.error("NodeStore %s: applying actions failed", self._node_id, exc_info=True)

    @_CONTROL
    def accept_replicas(
        self, shards: list[tuple[ShardId, ShardMeta]], buffer_ref: list[ray.ObjectRef]
    ) -> None:
        received = replicas_of(shards)
        try:
            views = list(ray.get(buffer_ref[0], timeout=_BUFFER_TIMEOUT_S))
        except Exception:  # one-way: nobody else would hear of it
            logger.warning(
                "replica buffer unreadable; %d replicas not kept", len(shards), exc_info=True
            )
            self._core.report_replicas(Landed([], [shard_id for shard_id, _ in received]))
            return
        self._core.accept_replicas(received, views)

    # ---- the arena: same-node workers write and read it in place ---------------------
    @_DATA
    def arena_info(self) -> tuple[RegionInfo, int]:
        return self._arena.info()

    @_DATA
    def arena_grant(
        self, holder: str, epoch: str, sizes: list[int]
    ) -> tuple[str, list[int | None]]:
        return self._arena.grant(holder, epoch, sizes)

    @_CONTROL
    def arena_commit(
        self,
        holder: str,
        epoch: str,
        namespace: Namespace,
        rank: int,
        world_size: int,
        jobs: list[list[ShardEntry]],
    ) -> tuple[int, str, list[int | None], list[tuple[int, str]]]:
        # Entries arrive as plain tuples: the commit checks and rebuilds each one.
        try:
            return self._arena.commit(holder, epoch, namespace, rank, world_size, jobs)
        except UnknownNodeError as exc:  # as in store(): an Evictor shard restarted
            self._reregister_failed(exc)
            return self._arena.commit(holder, epoch, namespace, rank, world_size, jobs)
        finally:
            self._parked = self._arena.gathered

    @_CONTROL
    def flush_gathered(self) -> int:
        """Offer the TP groups' units that waited long enough for their other ranks
        (sent by this actor's flusher thread while shards are parked)."""
        try:
            held = self._arena.flush_gathered()
        except UnknownNodeError as exc:  # as in store(): an Evictor shard restarted
            self._reregister_failed(exc)
            held = self._arena.flush_gathered()
        self._parked = self._arena.gathered
        return held

    def _flush_loop(self, me: NodeStoreClient) -> None:
        """The flusher thread: while shards are parked, a flush every
        :data:`GATHER_WAIT_S` (waited for, so they never pile up); a failed one is
        logged, never its end."""
        while not self._stop.wait(GATHER_WAIT_S):
            if not self._parked:
                continue
            try:
                me.flush_gathered().result()
            except Exception:
                logger.warning("flushing gathered shards failed", exc_info=True)

    @_DATA
    def arena_give_back(self, holder: str, epoch: str, offsets: list[int]) -> None:
        self._arena.give_back(holder, epoch, offsets)

    @_DATA
    def arena_pin(
        self, holder: str, epoch: str, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> list[tuple[int, ShardMeta]]:
        return self._arena.pin(holder, epoch, namespace, rank, keys)

    @_DATA
    def arena_unpin(self, holder: str, epoch: str, offsets: list[int]) -> None:
        self._arena.unpin(holder, epoch, offsets)

    @_DATA
    def arena_loaded(self, epoch: str, shards: int, nbytes: int) -> None:
        self._arena.loaded(epoch, shards, nbytes)

    def __ray_shutdown__(self) -> None:
        """Graceful stop: the arena's file goes, and its reaper with it (a killed
        NodeStore's file is removed by its reaper; else replaced or swept by the next
        NodeStore)."""
        self._stop.set()
        self._pulls.close()
        if self._nixl is not None:
            self._nixl.close()
            self._holder_lock.close()
        self._write_through.close(_WRITE_THROUGH_DRAIN_S)
        self._cpu.close()
        if self._reaper is not None:
            self._reaper.release()  # the file is gone: its reaper exits now

    def inventory(self) -> set[tuple[ShardId, TierName]]:
        return self._core.inventory()

    def config(self) -> dict[str, object]:
        """The config this NodeStore was started with (a later engine compares its own)."""
        return self._cfg.to_dict()

    def status(self) -> dict[str, object]:
        return {
            **self._core.status(),
            "apply_failures": self._apply_failures,
            "write_through_queued": self._write_through.queued,
            "gathered_shards": self._parked,
            "shares": {"cpu": list(self._shares.cpu), "disk": list(self._shares.disk)},
            "pulls": {**self._pulls.status(), **(self._nixl.status() if self._nixl else {})},
            "arena": self._cpu.status(),
        }
