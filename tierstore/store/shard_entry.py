"""What a worker hands its NodeStore for each shard it stores, and the checks every one
passes before the NodeStore changes anything for it.

A store job's shards arrive as :class:`ShardEntry` records: in a job buffer (the object
path, ``NodeStoreCore.store``) or in extents of the node's arena the worker was granted
(a commit, ``ArenaStore.commit``). A worker is another process: every field is checked
(:func:`check_entry`), then every entry against where its bytes must lie and against
the job's other entries (:func:`check_job`), before the Evictor is asked to admit
anything or a tier holds anything. One bad entry refuses its whole job: a job's entries
come from one plan and one pool take, so one that is wrong says the rest of the job
cannot be trusted either, and the worker counts and reports a store per job (vLLM has
no partial store). Other jobs of the same call are not affected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from tierstore.errors import TierStoreError
from tierstore.fields import (
    MAX_SHARD_BYTES,
    MAX_SLOTS,
    MalformedField,
    chunk_key,
    integer,
    items,
    namespace,
    parent_key,
    rank_in,
    row,
)
from tierstore.keys import ChunkKey, Namespace

MAX_ENTRIES = 1 << 20  # shards of one call (a 32k-token prefill of 16-token blocks: 2048)
_FIELDS = len(("key", "offset", "nbytes", "digest", "slot_mask", "parent"))


class ShardEntry(NamedTuple):
    """Where one shard sits in a job buffer or in the arena, as the worker packed it."""

    key: ChunkKey
    offset: int
    nbytes: int
    digest: int
    slot_mask: int
    parent: bytes | None = None


class RefusedCommit(TierStoreError, ValueError):
    """A store job its NodeStore refused, a field of it malformed (the message says
    which): nothing was kept or changed for it; the worker counts a failed store."""


def check_entry(value: object, field: str = "entry") -> ShardEntry:
    """``value`` (a ShardEntry, or the tuple msgpack made of one) with every field's type
    and range checked, rebuilt of plain ints and bytes. Raises MalformedField."""
    fields = row(field, value, _FIELDS - 1, _FIELDS)
    key = chunk_key(f"{field}.key", fields[0])
    return ShardEntry(
        key,
        integer(f"{field}.offset", fields[1], 0, MAX_SHARD_BYTES),
        integer(f"{field}.nbytes", fields[2], 1, MAX_SHARD_BYTES),
        integer(f"{field}.digest", fields[3], 0, 1 << 64),
        integer(f"{field}.slot_mask", fields[4], 0, 1 << MAX_SLOTS),
        parent_key(f"{field}.parent", fields[5] if len(fields) == _FIELDS else None, key),
    )


def check_job(
    values: Sequence[object], room_at: Callable[[int], int | None], field: str = "job"
) -> list[ShardEntry]:
    """One job's entries, each checked (:func:`check_entry`) and lying where it must:
    ``room_at(offset)`` is the bytes the worker may have written from ``offset`` on (the
    rest of its job buffer, or the extent granted to it there), None if none. No two
    entries of the job share a key or an offset. Raises MalformedField."""
    entries = [
        check_entry(v, f"{field}[{i}]") for i, v in enumerate(items(field, values, MAX_ENTRIES))
    ]
    offsets: set[int] = set()
    keys: set[bytes] = set()
    for i, entry in enumerate(entries):
        room = room_at(entry.offset)
        if room is None:
            raise MalformedField(f"{field}[{i}].offset", entry.offset, "not the caller's to fill")
        if entry.nbytes > room:
            raise MalformedField(f"{field}[{i}].nbytes", entry.nbytes, f"past the {room} there")
        if entry.offset in offsets:
            raise MalformedField(f"{field}[{i}].offset", entry.offset, "twice in one job")
        if entry.key in keys:
            raise MalformedField(f"{field}[{i}].key", entry.key, "twice in one job")
        offsets.add(entry.offset)
        keys.add(entry.key)
    return entries


def job_lists(value: object) -> list[list[object]]:
    """A commit's jobs: a list of lists of entries, :data:`MAX_ENTRIES` in all at most
    (each entry is checked with its job, :func:`check_job`)."""
    jobs = [
        items(f"jobs[{i}]", j, MAX_ENTRIES) for i, j in enumerate(items("jobs", value, MAX_ENTRIES))
    ]
    if sum(map(len, jobs)) > MAX_ENTRIES:
        raise MalformedField("jobs", f"{sum(map(len, jobs))} entries", f"more than {MAX_ENTRIES}")
    return jobs


def check_origin(
    namespace_: object, rank: object, world_size: object
) -> tuple[Namespace, int, int]:
    """A store call's namespace, rank and world size (those of all of its entries)."""
    return (namespace("namespace", namespace_), *rank_in("worker", rank, world_size))


def buffer_room(buffer: object) -> Callable[[int], int | None]:
    """``room_at`` of a job buffer (the object path): one contiguous 1-D uint8 array."""
    if not (
        isinstance(buffer, np.ndarray)
        and buffer.dtype == np.uint8
        and buffer.ndim == 1
        and buffer.flags.c_contiguous
    ):
        shape = getattr(buffer, "shape", None)
        raise MalformedField("buffer", f"{type(buffer).__name__} {shape}", "not 1-D uint8 bytes")
    nbytes = buffer.nbytes
    return lambda offset: nbytes - offset if offset < nbytes else None
