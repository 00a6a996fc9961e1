"""Faults the tests set off in the real actors, from outside the library.

The production actors hold no test hooks. A fault a real system meets (a stray write
into memory, a flipped byte on disk) is made here the way it happens: by writing into
the arena file or the chunk file directly. A fault of the Evictor's own (a reconcile
that raises, an Evictor stuck) comes from :class:`EvictorForTests`, the real Evictor
with two more methods, started under the Evictor's name before anything looks it up.
Ray pickles the class by reference: its actor process imports it from this module
(``tests`` is a package on the driver's path, as for the other test actors).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import ray
from tierstore.actors.clients import NodeStoreClient
from tierstore.actors.evictor import Evictor
from tierstore.actors.names import evictor_name
from tierstore.actors.placement import alive_node_ids

from tierstore.config import AUTO_SHARDS, TierStoreConfig, evictor_shards_for
from tierstore.data.arena.directory import arena_tables
from tierstore.data.arena.region import ArenaMapping
from tierstore.data.tiers.disk import ChunkLocation, chunk_records
from tierstore.keys import ChunkKey, ShardId

_START_TIMEOUT_S = 60.0  # an actor's start on a loaded machine


class EvictorForTests(Evictor):
    """The real Evictor; ``fail_next_reconcile`` makes its next reconcile raise (the
    ticker must outlive it), ``pause_reconciles`` makes them do nothing, ``stall`` holds
    up its only thread (a NodeStore must serve loads while its store waits on ``admit``;
    a caller's deadline must fire)."""

    def __init__(self, cfg: TierStoreConfig, shard: int = 0) -> None:
        self._fail_next_reconcile = False
        self._reconciles_paused = False
        super().__init__(cfg, shard)

    def fail_next_reconcile(self) -> None:
        self._fail_next_reconcile = True

    def pause_reconciles(self, paused: bool) -> None:
        """While paused, a reconcile does nothing (a node this shard lost is not asked to
        reregister by it)."""
        self._reconciles_paused = paused

    def reconcile(self) -> dict[str, list[str]]:
        if self._fail_next_reconcile:
            self._fail_next_reconcile = False
            raise RuntimeError("reconcile failed on purpose (EvictorForTests)")
        if self._reconciles_paused:
            return {"started": [], "forgotten": []}
        return super().reconcile()

    def stall(self, release_file: str, max_s: float) -> None:
        """Block until ``release_file`` exists (or ``max_s`` passed); writes
        ``<release_file>.stalled`` once blocking, so a test knows it is."""
        deadline = time.monotonic() + max_s
        Path(release_file + ".stalled").touch()
        while not os.path.exists(release_file) and time.monotonic() < deadline:
            time.sleep(0.01)


def start_evictor_for_tests(cfg: TierStoreConfig, shard: int = 0) -> ray.actor.ActorHandle:
    """An :class:`EvictorForTests` under Evictor shard ``shard``'s name (none may run
    yet): the bootstrap, the NodeStores and the clients find it as they would the real
    one. An ``"auto"`` shard count is chosen from the alive nodes, as the bootstrap
    starts shard 0. The ``cfg`` fixture's teardown stops it with the other actors.
    Returns once it answers."""
    if cfg.evictor_shards == AUTO_SHARDS:
        cfg = dataclasses.replace(cfg, evictor_shards=evictor_shards_for(len(alive_node_ids())))
    name = evictor_name(shard)
    handle = cast(
        "ray.actor.ActorHandle",
        ray.remote(EvictorForTests)
        .options(name=name, namespace=cfg.namespace, lifetime="detached", num_cpus=0)
        .remote(cfg, shard),
    )
    ray.get(handle.config.remote(), timeout=_START_TIMEOUT_S)
    return handle


def corrupt_in_memory(store: NodeStoreClient, shard_ids: Iterable[ShardId]) -> int:
    """Flip the first byte of each shard's extent in ``store``'s arena, as a stray write
    would: the arena file mapped from this process (as a worker maps it), each extent
    found through the arena's directory. Returns the shards corrupted."""
    info, _ = store.arena_info().result()
    assert info is not None, f"node {store.node} has no arena"
    mapping = ArenaMapping(info)
    try:
        _, directory = arena_tables(mapping.array)
        wanted = list(shard_ids)
        located = directory.find(wanted)
        assert located is not None, f"not all of {wanted} are in the arena's directory"
        for where in located:
            mapping.array[where.offset] ^= 0xFF
        return len(located)
    finally:
        mapping.close()


def disk_locations(disk_path: Path) -> dict[ChunkKey, ChunkLocation]:
    """Where each chunk's payload lies in the disk tier under ``disk_path``, read from
    the chunk files' own headers (as an operator's tool reads them)."""
    return {
        ChunkKey(bytes(record.header["key"])): record.location
        for record in chunk_records(disk_path)
    }
