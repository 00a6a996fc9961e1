"""Every message that crosses a process boundary, each with its one decode step.

Who sends what (each arrow a Ray call, or for the arena a word in shared memory):

- a worker -> its NodeStore: :class:`ShardEntry` records of a store job (checked whole,
  :func:`check_job`, before anything changes); the NodeStore answers with
  :class:`ShardMeta` (loads, pins) and :class:`RegionInfo` (the arena to map);
- a NodeStore -> the Evictor: :class:`UnitOffer` (admit: the shards of one token
  boundary, every rank's and group's its batch holds), sent as :class:`OfferColumns`,
  :class:`ShardOffer` (restore) and ShardIds (reports), each item checked as it is
  decoded: a malformed one is refused, the rest go on; the Evictor answers with
  :class:`NodeActions` (and one-way sends a NodeStore its share of a decision);
- a NodeStore -> another NodeStore: replica shards, ``(ShardId, ShardMeta)`` each;
- the scheduler -> the Evictor: lookups, answered with :class:`LookupAnswer` (sent as
  :class:`AnswerColumns`), and residency events (:class:`EventBatch`).

Ray serializes with msgpack first: a NamedTuple nested in a list arrives as a plain
list, an enum as its value, a dataclass as itself (pickled). The Evictor's batches of
offers and answers cross as columns (a few byte strings each, one object): pickling,
checking and rebuilding a tuple per item was most of a 1,000-key call. The ``*_of`` functions
rebuild tierstore's types; the ``check_*`` ones also check every field of a message
from a process that is trusted with nothing (:mod:`tierstore.fields`), raising
:class:`~tierstore.fields.MalformedField`. Clients apply them to answers, actors to
arguments: nothing else converts. Ray-free, vLLM-free, and light: a process that only
talks to the actors (the engine's scheduler and workers) loads no tier or index code.

Each chunk carries its prefix tree's ``root`` (:func:`tierstore.keys.root_of`, 0 when
not known): the scheduler computes it per request, a worker sends it in each
:class:`ShardEntry`, the NodeStore keeps it in the shard's :class:`ShardMeta` (and its
disk header) and offers it in each :class:`ShardOffer`. It says which Evictor shard
indexes the chunk (:func:`tierstore.keys.shard_of`); the index itself ignores it. Each
``root`` is a new LAST field with a default, so a sender that leaves it out (an older
one) is read as root 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import accumulate, repeat
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from tierstore import fields
from tierstore.config import TierStoreConfig
from tierstore.errors import TierStoreError
from tierstore.fields import (
    MAX_SHARD_BYTES,
    MAX_SLOTS,
    MalformedField,
    check_shard_id,
    chunk_key,
    column,
    column_width,
    int_column,
    integer,
    items,
    parent_key,
    rank_in,
    row,
)
from tierstore.fields import root as check_root
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName, boundary_of

logger = logging.getLogger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

MAX_ENTRIES = 1 << 20  # shards of one call (a 32k-token prefill of 16-token blocks: 2048)
MAX_ITEMS = 1 << 32  # of one list a NodeStore sends the Evictor (its inventory, at restore)
_ENTRY_FIELDS = len(("key", "offset", "nbytes", "digest", "slot_mask", "parent", "root"))
_OFFER_FIELDS = len(("namespace", "key", "rank", "world_size", "nbytes", "parent", "root"))


class Reply(Protocol[T_co]):
    """A remote call in flight: ``result`` blocks the calling thread until its answer,
    decoded, or its deadline (default: the caller's deadline for the call), and raises
    tierstore's error for a failed call. A one-way caller drops it."""

    def result(self, timeout_s: float | None = None) -> T_co: ...


# ---- shards -------------------------------------------------------------------------------
def shard_id_of(value: Iterable[Any]) -> ShardId:
    """A ShardId Ray flattened (a list), rebuilt; not checked (it came from an actor)."""
    namespace, key, rank = value
    return ShardId(Namespace(namespace), ChunkKey(key), int(rank))


def shard_ids_of(values: Iterable[Iterable[Any]]) -> list[ShardId]:
    return [shard_id_of(v) for v in values]


@dataclass(frozen=True)
class ShardMeta:
    """What is known of a shard's bytes besides the bytes themselves."""

    nbytes: int
    digest: int  # xxh3-64 of the bytes, computed by the producing worker
    slot_mask: int  # bit i set = sub-slot i of the chunk holds data that was written
    world_size: int = 1  # ranks that make the chunk whole (kept for restart recovery)
    parent: bytes | None = None  # previous chunk key of the same group in its prefix chain
    root: int = 0  # its prefix tree's root (which Evictor shard indexes it); 0: not known


def metas_of(values: Iterable[Any]) -> list[ShardMeta]:
    return [v if isinstance(v, ShardMeta) else ShardMeta(*v) for v in values]


def replicas_of(values: Iterable[Any]) -> list[tuple[ShardId, ShardMeta]]:
    """``accept_replicas``' shards: ``(ShardId, ShardMeta)`` each, from another NodeStore."""
    pairs = list(values)
    return list(zip(shard_ids_of(s for s, _ in pairs), metas_of(m for _, m in pairs), strict=True))


def pins_of(values: Iterable[Any]) -> list[tuple[int, ShardMeta]]:
    """``arena_pin``'s answer: ``(offset, meta)`` per key."""
    pins = list(values)
    return list(zip([int(at) for at, _ in pins], metas_of(m for _, m in pins), strict=True))


# ---- a worker's store job -----------------------------------------------------------------
class ShardEntry(NamedTuple):
    """Where one shard sits in a job buffer or in the arena, as the worker packed it."""

    key: ChunkKey
    offset: int
    nbytes: int
    digest: int
    slot_mask: int
    parent: ChunkKey | None = None
    root: int = 0  # the request's prefix tree (tierstore.keys.root_of); 0: not known


class RefusedCommit(TierStoreError, ValueError):
    """A store job its NodeStore refused, a field of it malformed (the message says
    which): nothing was kept or changed for it; the worker counts a failed store."""


def check_entry(value: object, field: str = "entry") -> ShardEntry:
    """``value`` (a ShardEntry, or the list msgpack made of one) with every field's type
    and range checked, rebuilt of plain ints and bytes. Raises MalformedField."""
    key_, offset, nbytes, digest, slot_mask, *rest = row(
        field, value, _ENTRY_FIELDS - 2, _ENTRY_FIELDS
    )
    key = chunk_key(f"{field}.key", key_)
    return ShardEntry(
        key,
        integer(f"{field}.offset", offset, 0, MAX_SHARD_BYTES),
        integer(f"{field}.nbytes", nbytes, 1, MAX_SHARD_BYTES),
        integer(f"{field}.digest", digest, 0, 1 << 64),
        integer(f"{field}.slot_mask", slot_mask, 0, 1 << MAX_SLOTS),
        parent_key(f"{field}.parent", rest[0] if rest else None, key),
        check_root(f"{field}.root", rest[1]) if len(rest) > 1 else 0,
    )


def check_job(
    values: Sequence[object], room_at: Callable[[int], int | None], field: str = "job"
) -> list[ShardEntry]:
    """One job's entries, each checked (:func:`check_entry`) and lying where it must:
    ``room_at(offset)`` is the bytes the worker may have written from ``offset`` on (the
    rest of its job buffer, or the extent granted to it there), None if none. No two
    entries of the job share a key or an offset. Raises MalformedField.

    One bad entry refuses its whole job: a job's entries come from one plan and one pool
    take, so one that is wrong says the rest of the job cannot be trusted either."""
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
    return (fields.namespace("namespace", namespace_), *rank_in("worker", rank, world_size))


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


# ---- the arena ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RegionInfo:
    """What a worker needs to map the arena (sent to it by the NodeStore)."""

    path: str
    nbytes: int
    epoch: str  # fresh per creation: a replaced file is never mistaken for this one
    dev: int  # the file the NodeStore created: a worker maps only this one
    inode: int


def arena_info_of(value: Any) -> tuple[RegionInfo | None, int]:
    """``arena_info``'s answer: the region (None: this node has no arena) and its room."""
    region, room = value
    if region is not None and not isinstance(region, RegionInfo):
        region = RegionInfo(*region)
    return region, int(room)


# ---- a NodeStore's offers -----------------------------------------------------------------
class ShardOffer(NamedTuple):
    """A shard a NodeStore wants to hold (or already holds, when re-registering)."""

    namespace: Namespace
    key: ChunkKey
    rank: int
    world_size: int
    nbytes: int
    parent: ChunkKey | None = None  # the previous chunk of its prefix chain, if known
    root: int = 0  # its prefix tree's root (tierstore.keys.root_of); 0: not known


def check_offer(value: object, field: str = "offer") -> ShardOffer:
    """An offer from a NodeStore (a ShardOffer, or the list msgpack made of one), every
    field's type and range checked, rebuilt. Raises MalformedField naming the field."""
    namespace, key, rank, world_size, nbytes, *rest = row(
        field, value, _OFFER_FIELDS - 2, _OFFER_FIELDS
    )
    checked_key = chunk_key(f"{field}.key", key)
    rank, world_size = rank_in(field, rank, world_size)
    return ShardOffer(
        fields.namespace(f"{field}.namespace", namespace),
        checked_key,
        rank,
        world_size,
        integer(f"{field}.nbytes", nbytes, 1, MAX_SHARD_BYTES),
        parent_key(f"{field}.parent", rest[0] if rest else None, checked_key),
        check_root(f"{field}.root", rest[1]) if len(rest) > 1 else 0,
    )


class UnitOffer(NamedTuple):
    """The shards of one token boundary a NodeStore's batch offers together: every
    rank's and every KV cache group's that arrived in it, admitted as one (one room
    decision for the whole unit). A unit's later ranks may come in a later offer.

    Its shards share one root (a boundary names its whole prefix, so every shard there
    has its tree's root): the unit's :attr:`root`, which says the Evictor shard that
    admits it."""

    shards: list[ShardOffer]  # one namespace, boundary and root; each (key, rank) once

    @property
    def root(self) -> int:
        """The unit's prefix tree root: its shards' (0: not known)."""
        return self.shards[0].root if self.shards else 0


def check_unit_offer(value: object, field: str = "unit") -> UnitOffer:
    """A unit offer from a NodeStore, each shard checked (:func:`check_offer`), all of
    one namespace, token boundary and root, no (key, rank) twice, one world size per
    key. Raises MalformedField naming the field: a unit is refused whole (a NodeStore
    never mixes roots in a unit: its shards' roots came from requests that share the
    boundary, hence its whole prefix; mixed ones would put it in two Evictor shards)."""
    (shard_values,) = row(field, value, 1, 1)
    shards = [
        check_offer(v, f"{field}.shards[{i}]")
        for i, v in enumerate(items(f"{field}.shards", shard_values, MAX_ENTRIES))
    ]
    return unit_of_checked(shards, field)


def unit_of_checked(shards: list[ShardOffer], field: str = "unit") -> UnitOffer:
    """A unit of shards each already checked (:func:`check_offer`), checked as one: at
    least one shard, one namespace, token boundary and root, one world size per key, no
    (key, rank) twice. Raises MalformedField naming the field."""
    if not shards:
        raise MalformedField(f"{field}.shards", shards, "no shard")
    first = shards[0]
    worlds: dict[bytes, int] = {}
    seen: set[tuple[bytes, int]] = set()
    for i, offer in enumerate(shards):
        where = f"{field}.shards[{i}]"
        if offer.namespace != first.namespace:
            raise MalformedField(f"{where}.namespace", offer.namespace, "not the unit's")
        if boundary_of(offer.key) != boundary_of(first.key):
            raise MalformedField(f"{where}.key", offer.key, "not at the unit's boundary")
        if offer.root != first.root:
            raise MalformedField(f"{where}.root", offer.root, "not the unit's")
        if worlds.setdefault(offer.key, offer.world_size) != offer.world_size:
            raise MalformedField(f"{where}.world_size", offer.world_size, "not its key's")
        if (offer.key, offer.rank) in seen:
            raise MalformedField(f"{where}.rank", offer.rank, "twice for one key")
        seen.add((offer.key, offer.rank))
    return UnitOffer(shards)


def units_of(offers: Iterable[ShardOffer]) -> list[UnitOffer]:
    """``offers`` grouped into unit offers, one per (namespace, boundary), in order of
    first appearance; each shard's place is kept (see :func:`per_shard`). A unit takes
    its shards' root as they come (mixed roots, which correct workers never send, are
    refused by the Evictor with the unit: :func:`check_unit_offer`)."""
    units: dict[tuple[str, bytes], list[ShardOffer]] = {}
    for offer in offers:
        units.setdefault((offer.namespace, boundary_of(offer.key)), []).append(offer)
    return [UnitOffer(shards) for shards in units.values()]


def per_shard(
    offers: Sequence[ShardOffer], units: Sequence[UnitOffer], answers: Sequence[Sequence[bool]]
) -> list[bool]:
    """The answers of ``units`` (made by :func:`units_of` from ``offers``), one flag per
    offer in the order of ``offers``; a shard with no flag (its unit refused whole as
    malformed) is refused."""
    flag = {
        (o.namespace, o.key, o.rank): ok
        for unit, unit_answers in zip(units, answers, strict=True)
        for o, ok in zip(unit.shards, unit_answers, strict=False)
    }
    return [flag.get((o.namespace, o.key, o.rank), False) for o in offers]


def check_held(value: object, field: str = "held") -> tuple[ShardOffer, TierName]:
    """A copy a NodeStore offers at restore: ``(offer, tier)``, checked."""
    offer, tier = row(field, value, 2, 2)
    if not isinstance(tier, str) or tier not in {t.value for t in TierName}:
        raise MalformedField(f"{field}.tier", tier, "not a tier")
    return check_offer(offer, f"{field}.offer"), TierName(tier)


def held_shard(value: object) -> ShardId | None:
    """The shard a malformed held copy names, if that much of it is readable (the node
    is told to drop its copy: the index will not count it), else None."""
    try:
        offer = row("held", value, 2, 2)[0]
        return check_shard_id(row("held.offer", offer, _OFFER_FIELDS - 2, _OFFER_FIELDS)[:3])
    except MalformedField:
        return None


def checked_items(values: object, check: Callable[[object], T], what: str) -> list[T | None]:
    """Each item of a message's list rebuilt by ``check`` (it raises MalformedField on a
    malformed one); None for each one refused, logged at WARNING with the field and
    value. Raises MalformedField if ``values`` is not a list."""
    checked: list[T | None] = []
    for i, value in enumerate(items(what, values, MAX_ITEMS)):
        try:
            checked.append(check(value))
        except MalformedField as exc:
            logger.warning("refused %s %d: %s", what, i, exc)
            checked.append(None)
    return checked


def held_of(values: object) -> list[tuple[ShardOffer, TierName] | None]:
    """``restore``'s copies, checked (:func:`check_held`); None for each one refused."""
    return checked_items(values, check_held, "held copy")


def checked_shard_ids(values: object) -> list[ShardId | None]:
    """ShardIds a NodeStore reports, checked (:func:`tierstore.fields.check_shard_id`)."""
    return checked_items(values, check_shard_id, "shard id")


# ---- offers as columns (admit, admit_units) ----------------------------------------------
_U8 = np.dtype("u1")
_U32 = np.dtype("<u4")
_I64 = np.dtype("<i8")
_U64 = np.dtype("<u8")


class OfferColumns(NamedTuple):
    """A NodeStore's batch of offers as columns: what ``admit`` and ``admit_units``
    carry (one object of a few byte strings, not one tuple per offer to pickle, check
    and rebuild). Made by :func:`offer_columns` only; read by :func:`offers_of` and
    :func:`unit_offers_of`.

    Per offer, in order: its namespace (an index into ``namespaces``), its key's length
    (the key is the next bytes of ``keys``), whether it has a parent (then the next bytes
    of ``parents``, as many as its key's), rank, world size, nbytes and root. Numbers are
    little-endian. ``unit_sizes``: how many of the offers, in order, each unit offer has
    (``admit_units``); empty for ``admit``."""

    namespaces: list[str]
    namespace_of: bytes  # uint32 per offer
    keys: bytes  # every key, concatenated
    key_lengths: bytes  # uint8 per offer
    parents: bytes  # the parents there are, concatenated
    has_parent: bytes  # uint8 per offer: 1 when it has a parent, else 0
    ranks: bytes  # uint32 per offer
    world_sizes: bytes  # uint32 per offer
    nbytes: bytes  # int64 per offer
    roots: bytes  # uint64 per offer
    unit_sizes: bytes = b""  # uint32 per unit offer


def offer_columns(offers: Sequence[ShardOffer], unit_sizes: Sequence[int] = ()) -> OfferColumns:
    """``offers`` (and, for ``admit_units``, the sizes of the units they make, in order)
    as one message. The caller's own offers: raises ValueError for one no column can
    carry (a parent of another length than its key, a number out of its column's range:
    the Evictor would refuse it anyway)."""
    columns: tuple[Sequence[Any], ...] = tuple(zip(*offers, strict=True)) if offers else ((),) * 7
    namespaces, keys, ranks, worlds, sizes, parents, roots = columns
    table = {ns: i for i, ns in enumerate(dict.fromkeys(namespaces))}
    key_lengths = bytes(map(len, keys))
    has_parent = bytes([p is not None for p in parents])
    present = [p for p in parents if p is not None]
    if present:  # each parent as long as its key
        own = np.frombuffer(key_lengths, _U8)[np.frombuffer(has_parent, _U8) == 1]
        if not np.array_equal(own, np.fromiter(map(len, present), np.int64, len(present))):
            raise ValueError("an offer's parent is not as long as its key")
    try:
        return OfferColumns(
            list(table),
            bytes(_U32.itemsize * len(namespaces))  # every offer's the first (0)
            if len(table) <= 1
            else np.array([table[ns] for ns in namespaces], _U32).tobytes(),
            b"".join(keys),
            key_lengths,
            b"".join(present),
            has_parent,
            np.array(ranks, _U32).tobytes(),
            np.array(worlds, _U32).tobytes(),
            np.array(sizes, _I64).tobytes(),
            np.array(roots, _U64).tobytes(),
            np.array(unit_sizes, _U32).tobytes(),
        )
    except OverflowError as exc:
        raise ValueError(f"an offer's field is outside its column's range: {exc}") from exc


def _slices(blob: bytes, lengths: np.ndarray) -> list[bytes]:
    """``blob`` cut into byte strings of ``lengths`` (summing to its length: checked)."""
    if len(lengths) and lengths[0] > 0 and np.all(lengths == lengths[0]):  # as one: faster
        same: list[bytes] = np.frombuffer(blob, f"V{lengths[0]}").tolist()
        return same
    ends = np.cumsum(lengths)
    return [blob[a:b] for a, b in zip((ends - lengths).tolist(), ends.tolist(), strict=True)]


def _groups(blob: bytes, lengths: np.ndarray) -> np.ndarray:
    """Per key of ``blob`` (lengths ``lengths``, each at least GROUP_BYTES long where it
    matters): its KV cache group index (its last GROUP_BYTES, big-endian)."""
    if not len(lengths):
        return np.zeros(0, np.uint32)
    data = np.frombuffer(blob + bytes(fields.GROUP_BYTES), _U8)
    first = np.maximum(np.cumsum(lengths) - fields.GROUP_BYTES, 0)
    suffixes = data[first[:, None] + np.arange(fields.GROUP_BYTES)]  # one row per key
    groups: np.ndarray = suffixes.view(f">u{fields.GROUP_BYTES}")[:, 0]
    return groups


class _Rows(NamedTuple):
    """A message's offer columns as arrays, each of its length checked."""

    lengths: np.ndarray  # key lengths, int64
    namespace_of: np.ndarray
    has_parent: np.ndarray  # bool
    ranks: np.ndarray
    worlds: np.ndarray
    sizes: np.ndarray
    roots: np.ndarray


class _Checked(NamedTuple):
    """A message's offers checked column by column (:func:`_offer_rows`): its arrays,
    each key's KV cache group (uint32) and which offers are malformed (bool)."""

    rows: _Rows
    groups: np.ndarray
    bad: np.ndarray


def _arrays(cols: OfferColumns) -> _Rows:
    """``cols``' columns as arrays, each of the message's length and its blobs of their
    lengths' sums. Raises MalformedField (its offers cannot be told apart)."""
    lengths = column("offers.key_lengths", cols.key_lengths, _U8).astype(np.int64)
    n = len(lengths)
    flags = column("offers.has_parent", cols.has_parent, _U8, n)
    if np.any(flags > 1):
        raise MalformedField("offers.has_parent", cols.has_parent[:8], "not 0 or 1")
    arrays = _Rows(
        lengths,
        column("offers.namespace_of", cols.namespace_of, _U32, n),
        flags == 1,
        column("offers.ranks", cols.ranks, _U32, n),
        column("offers.world_sizes", cols.world_sizes, _U32, n),
        column("offers.nbytes", cols.nbytes, _I64, n),
        column("offers.roots", cols.roots, _U64, n),
    )
    _check_blobs(cols, int(lengths.sum()), int(lengths[arrays.has_parent].sum()))
    return arrays


def _check_blobs(cols: OfferColumns, key_bytes: int, parent_bytes: int) -> None:
    """``cols``' keys and parents are bytes of the sums their lengths make. Raises
    MalformedField."""
    if not isinstance(cols.keys, bytes) or len(cols.keys) != key_bytes:
        raise MalformedField("offers.keys", _size_of(cols.keys), "not its key lengths' sum")
    if not isinstance(cols.parents, bytes) or len(cols.parents) != parent_bytes:
        raise MalformedField("offers.parents", _size_of(cols.parents), "not its parents' sum")


# Offers up to which a message is checked row by row (check_offer itself) rather than
# column by column: numpy's fixed cost per call, paid some 30 times, is more than a few
# rows' checks (an Evictor's single-offer admit took 3x as long through the columns).
_SMALL = 16


def _small_rows(cols: OfferColumns) -> list[tuple[object, ...]]:
    """A small message's offers as raw rows for :func:`check_offer` (a namespace index
    out of range left as the index: not a namespace). Raises MalformedField as
    :func:`_arrays` does."""
    lengths = list(cols.key_lengths)
    n = len(lengths)
    ns_of = int_column("offers.namespace_of", cols.namespace_of, "I", n)
    flags = int_column("offers.has_parent", cols.has_parent, "B", n)
    if any(flag > 1 for flag in flags):
        raise MalformedField("offers.has_parent", cols.has_parent[:8], "not 0 or 1")
    numbers = zip(
        int_column("offers.ranks", cols.ranks, "I", n),
        int_column("offers.world_sizes", cols.world_sizes, "I", n),
        int_column("offers.nbytes", cols.nbytes, "q", n),
        int_column("offers.roots", cols.roots, "Q", n),
        strict=True,
    )
    parent_bytes = sum(length for length, flag in zip(lengths, flags, strict=True) if flag)
    _check_blobs(cols, sum(lengths), parent_bytes)
    namespaces = items("offers.namespaces", cols.namespaces, MAX_ITEMS)
    rows: list[tuple[object, ...]] = []
    at = parent_at = 0
    for i, (rank, world, size, root) in enumerate(numbers):
        length = lengths[i]
        key, at = cols.keys[at : at + length], at + length
        parent = cols.parents[parent_at : parent_at + length] if flags[i] else None
        parent_at += length if flags[i] else 0
        namespace = namespaces[ns_of[i]] if ns_of[i] < len(namespaces) else ns_of[i]
        rows.append((namespace, key, rank, world, size, parent, root))
    return rows


def _checked_offers(
    value: object, what: str
) -> tuple[list[ShardOffer | None], OfferColumns, _Checked | None]:
    """A message's offers, each checked as :func:`check_offer` does (row by row when the
    message is small, else column by column); None for each one refused, logged (how
    many, and the first one's field and value); and, when checked column by column, what
    that check found (:class:`_Checked`, else None). Raises MalformedField for a message
    that is not OfferColumns or whose columns do not fit together."""
    if not isinstance(value, OfferColumns):
        raise MalformedField("offers", type(value).__name__, "not OfferColumns")
    checked: list[ShardOffer | None] = []
    columns = None
    if isinstance(value.key_lengths, bytes) and len(value.key_lengths) <= _SMALL:
        rows = _small_rows(value)
        first_refusal = None
        for i, row_ in enumerate(rows):
            try:
                checked.append(check_offer(row_))
            except MalformedField as exc:
                checked.append(None)
                first_refusal = first_refusal or (i, str(exc))
    else:
        offers, columns = _offer_rows(value)
        refused = np.flatnonzero(columns.bad).tolist()
        checked = list(offers)
        for i in refused:
            checked[i] = None
        first_refusal = (refused[0], _why(offers[refused[0]])) if refused else None
    if first_refusal is not None:
        count = checked.count(None)
        first, why = first_refusal
        logger.warning(
            "refused %d of %d %s(s); the first, %d: %s", count, len(checked), what, first, why
        )
    return checked, value, columns


def _why(offer: ShardOffer) -> str:
    """What :func:`check_offer` says of a refused offer (the column checks found it)."""
    try:
        check_offer(offer)
    except MalformedField as exc:
        return str(exc)
    return "its namespace is not one of the message's"


def _offer_rows(value: OfferColumns) -> tuple[list[ShardOffer], _Checked]:
    """The offers of a message as rows, and its columns as arrays with each key's group
    and which offers are malformed (a field out of range: that offer is refused, the
    rest go on), checked column by column. Raises MalformedField for a message whose
    columns do not fit together."""
    a = _arrays(value)
    namespaces = items("offers.namespaces", value.namespaces, MAX_ITEMS)
    ns_of = np.minimum(a.namespace_of, len(namespaces))  # len: not one of them
    known = np.array([_is_namespace(ns) for ns in namespaces] + [False])
    parent_lengths = a.lengths[a.has_parent]
    bad = ~known[ns_of]
    bad |= (a.lengths < fields.MIN_KEY_BYTES) | (a.lengths > fields.MAX_KEY_BYTES)
    groups = _groups(value.keys, a.lengths)
    bad |= groups >= fields.MAX_GROUPS
    if len(parent_lengths):
        bad[a.has_parent] |= _groups(value.parents, parent_lengths) >= fields.MAX_GROUPS
    bad |= (a.worlds < 1) | (a.worlds >= fields.MAX_WORLD_SIZE) | (a.ranks >= a.worlds)
    bad |= (a.sizes < 1) | (a.sizes >= MAX_SHARD_BYTES)
    parents: list[bytes | None] = [None] * len(a.lengths)
    with_parent = np.flatnonzero(a.has_parent).tolist()
    for i, parent in zip(with_parent, _slices(value.parents, parent_lengths), strict=True):
        parents[i] = parent
    names = [*namespaces, ""]
    rows = zip(
        [names[i] for i in ns_of.tolist()],
        _slices(value.keys, a.lengths),
        a.ranks.tolist(),
        a.worlds.tolist(),
        a.sizes.tolist(),
        parents,
        a.roots.tolist(),
        strict=True,
    )
    offers = list(map(tuple.__new__, repeat(ShardOffer), rows))  # checked: no __new__ to run
    return offers, _Checked(a, groups, bad)


def _size_of(value: object) -> str:
    return f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__


def _is_namespace(value: object) -> bool:
    try:
        fields.namespace("namespace", value)
    except MalformedField:
        return False
    return True


def offers_of(value: object) -> list[ShardOffer | None]:
    """``admit``'s offers (:class:`OfferColumns`, no units), every field checked as
    :func:`check_offer` does; None for each one refused (logged). Raises MalformedField
    for a malformed message: not OfferColumns, columns that do not fit together."""
    checked, cols, _ = _checked_offers(value, "offer")
    if cols.unit_sizes:
        raise MalformedField("offers.unit_sizes", _size_of(cols.unit_sizes), "admit takes no units")
    return checked


def unit_offers_of(value: object) -> list[UnitOffer | None]:
    """``admit_units``' unit offers (:class:`OfferColumns`, ``unit_sizes`` splitting its
    offers), each checked as :func:`check_unit_offer` does; None for each unit refused
    whole (a shard of it malformed, or the unit inconsistent; logged). Raises
    MalformedField for a malformed message (as :func:`offers_of`, or unit sizes that do
    not add up to its offers)."""
    shards, cols, columns = _checked_offers(value, "unit offer shard")
    n_units = column_width("units.unit_sizes", cols.unit_sizes, _U32.itemsize, None)
    sizes = int_column("units.unit_sizes", cols.unit_sizes, "I", n_units)
    if sum(sizes) != len(shards):
        raise MalformedField("units.unit_sizes", f"{sum(sizes)} shards", f"not {len(shards)}")
    # Units known whole (checked column by column); the rest are checked one by one.
    whole = [False] * n_units if columns is None else _whole_units(cols, columns, sizes)
    ends = list(accumulate(sizes))
    units: list[UnitOffer | None] = [
        tuple.__new__(UnitOffer, (shards[end - size : end],))  # checked below if not whole
        for size, end in zip(sizes, ends, strict=True)
    ]
    for i in (i for i, ok in enumerate(whole) if not ok):
        unit = shards[ends[i] - sizes[i] : ends[i]]
        if len(unit) == 1 and unit[0] is not None:
            continue  # one well-formed shard: a unit
        try:
            if None in unit:
                raise MalformedField(f"unit[{i}].shards", "a malformed shard", "refused above")
            units[i] = unit_of_checked(unit, f"unit[{i}]")  # type: ignore[arg-type]
        except MalformedField as exc:
            logger.warning("refused unit offer %d: %s", i, exc)
            units[i] = None
    return units


def _whole_units(cols: OfferColumns, checked: _Checked, sizes: Sequence[int]) -> list[bool]:
    """Per unit of a message checked column by column (``checked``, :func:`_offer_rows`):
    True where it certainly passes :func:`unit_of_checked` (a shard or more, none
    malformed, one namespace index, boundary and root, no (group, rank) twice, one world
    size per group: within one boundary a key is its group); False where it may not
    (that check then says). Namespaces are compared by their index in the message, and
    boundaries as bytes only when every key is as long: else False, never a wrong True."""
    a, groups = checked.rows, checked.groups
    n = len(a.lengths)
    counts = np.array(sizes, np.int64)
    unit = np.repeat(np.arange(len(counts)), counts)  # each shard's unit
    first = (np.cumsum(counts) - counts)[unit]  # each shard's unit's first shard
    off = checked.bad.copy()
    off |= a.namespace_of != a.namespace_of[first]
    off |= a.roots != a.roots[first]
    length = int(a.lengths[0]) if n else 0
    if n and np.all(a.lengths == length):
        keys = np.frombuffer(cols.keys, _U8).reshape(n, length)[:, : length - fields.GROUP_BYTES]
        off |= np.any(keys != keys[first], axis=1)
    else:
        off[:] = True  # keys of several lengths: checked one by one
    order = np.lexsort((a.ranks, groups, unit))
    same_key = (unit[order][1:] == unit[order][:-1]) & (groups[order][1:] == groups[order][:-1])
    ranks, worlds = a.ranks[order], a.worlds[order]
    twice = same_key & ((ranks[1:] == ranks[:-1]) | (worlds[1:] != worlds[:-1]))
    off[order[1:][twice]] = True
    faulty = np.zeros(len(counts), bool)
    faulty[unit[off]] = True
    whole: list[bool] = (~faulty & (counts > 0)).tolist()
    return whole


# ---- the Evictor's decisions --------------------------------------------------------------
@dataclass
class NodeActions:
    """What one node must do to honour the Evictor's decisions."""

    drop: list[ShardId] = field(default_factory=list)  # delete every copy
    demote: list[ShardId] = field(default_factory=list)  # to disk (write if needed), free memory
    promote: list[ShardId] = field(default_factory=list)  # read the disk copy into memory
    persist: list[ShardId] = field(default_factory=list)  # write-through: copy memory to disk
    # Send a copy of a held shard to another node's CPU tier (a replica of a hot chunk).
    push: list[tuple[ShardId, NodeId]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.drop or self.demote or self.promote or self.persist or self.push)


def node_actions_of(actions: NodeActions) -> NodeActions:
    """A NodeActions as Ray delivers it (the dataclass survives; the ShardIds in its
    lists may not), rebuilt."""
    return NodeActions(
        drop=shard_ids_of(actions.drop),
        demote=shard_ids_of(actions.demote),
        promote=shard_ids_of(actions.promote),
        persist=shard_ids_of(actions.persist),
        push=[(shard_id_of(s), NodeId(n)) for s, n in actions.push],
    )


def decision_of(value: Any) -> tuple[list[bool], NodeActions]:
    """``admit``/``restore``'s answer: one flag per offer, and the caller's own actions."""
    accepted, actions = value
    return [bool(a) for a in accepted], node_actions_of(actions)


def unit_decision_of(value: Any) -> tuple[list[list[bool]], NodeActions]:
    """``admit_units``' answer: per unit, one flag per shard; the caller's own actions."""
    accepted, actions = value
    return [[bool(a) for a in unit] for unit in accepted], node_actions_of(actions)


# ---- Evictor shards' shares of a node ------------------------------------------------------
class NodeLoad(NamedTuple):
    """An Evictor shard's ``node_load`` answer (and ``resize_node``'s, after): its share
    of a node's tiers and the bytes it counts there, the node's pressure on it (shards
    its stores had evicted, demoted or refused) and the calls it was asked (lookups,
    admits), both counted since the shard started: a reader takes their growth."""

    cpu_capacity: int
    cpu_used: int
    disk_capacity: int
    disk_used: int
    pressure: int
    asked: int


def node_load_of(value: Any) -> NodeLoad | None:
    """A ``node_load`` answer as sent (six counts, or None: the node is not registered
    there). Raises ValueError for anything else."""
    if value is None:
        return None
    if not isinstance(value, tuple | list) or len(value) != len(NodeLoad._fields):
        raise ValueError(f"node_load: expected six counts, got {value!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"node_load: expected counts >= 0, got {value!r}")
    return NodeLoad(*value)


def resized_of(value: Any) -> tuple[NodeLoad | None, NodeActions]:
    """``resize_node``'s answer: the shard's part of the node after, the node's actions."""
    load, actions = value
    return node_load_of(load), node_actions_of(actions)


# ---- lookups ------------------------------------------------------------------------------
class LookupState(str, Enum):
    HIT = "hit"
    MISS = "miss"
    PENDING = "pending"  # present, being verified by its promotion from disk: ask again


class LookupAnswer(NamedTuple):
    state: LookupState
    where: dict[int, NodeId] | None = None  # rank -> node, for a HIT
    # Where a HIT's bytes are read from: DISK when any rank may be loaded from its disk
    # copy (not in memory, or its promotion still under way). None unless a HIT.
    tier: TierName | None = None


# A lookup answer's state and tier as AnswerColumns codes (their index here).
_STATES = (LookupState.MISS, LookupState.HIT, LookupState.PENDING)
_TIERS = (None, TierName.CPU, TierName.DISK)
_STATE_CODES = {state: code for code, state in enumerate(_STATES)}
_TIER_CODES = {tier: code for code, tier in enumerate(_TIERS)}
# The answers without a ``where`` (immutable, so one object each serves every key).
_WHEREVER = [[LookupAnswer(state, None, tier) for tier in _TIERS] for state in _STATES]


class AnswerColumns(NamedTuple):
    """A lookup's answers as columns, what ``lookup`` returns (one object of a few byte
    strings, not a tuple, dict and two enums per key to pickle and rebuild). Made by
    :func:`answer_columns`; read by :func:`answers_of`.

    Per key, in order: its state and tier (codes: their place in ``_STATES``,
    ``_TIERS``) and how many ranks its ``where`` names (-1: no ``where``); per rank
    named, in order: the rank and its node (an index into ``nodes``). Numbers are
    little-endian."""

    states: bytes  # uint8 per key
    tiers: bytes  # uint8 per key
    where_sizes: bytes  # int32 per key
    ranks: bytes  # uint32 per rank named
    holders: bytes  # uint32 per rank named
    nodes: list[str]

    def count(self, state: LookupState) -> int:
        """How many keys were answered ``state``."""
        return self.states.count(_STATE_CODES[state])


def answer_columns(answers: Sequence[LookupAnswer]) -> AnswerColumns:
    """``answers`` (the index's, one per key) as one message (the Evictor's thread)."""
    states, wheres, tiers = tuple(zip(*answers, strict=True)) if answers else ((), (), ())
    nodes: dict[str, int] = {}
    ranks: list[int] = []
    holders: list[int] = []
    for where in wheres:
        if where:
            ranks.extend(where)
            holders.extend([nodes.setdefault(n, len(nodes)) for n in where.values()])
    return AnswerColumns(
        bytes(map(_STATE_CODES.__getitem__, states)),
        bytes(map(_TIER_CODES.__getitem__, tiers)),
        np.array([-1 if w is None else len(w) for w in wheres], "<i4").tobytes(),
        np.array(ranks, _U32).tobytes(),
        np.array(holders, _U32).tobytes(),
        list(nodes),
    )


def answers_of(value: Any) -> list[LookupAnswer]:
    """``lookup``'s answer (:class:`AnswerColumns`) as one LookupAnswer per key, each
    ``where`` a dict of its own (the caller's thread: the scheduler's channel). Raises
    ValueError (MalformedField) for columns that do not fit together or a code out of
    range: never a wrong answer."""
    if not isinstance(value, AnswerColumns):
        raise MalformedField("answers", type(value).__name__, "not AnswerColumns")
    n = len(column("answers.states", value.states, _U8))
    sizes = column("answers.where_sizes", value.where_sizes, np.dtype("<i4"), n)
    if np.any(sizes < -1):
        raise MalformedField("answers.where_sizes", value.where_sizes[:32], "a size below -1")
    named = int(sizes[sizes > 0].sum())
    ranks = column("answers.ranks", value.ranks, _U32, named).tolist()
    holders = column("answers.holders", value.holders, _U32, named)
    nodes = items("answers.nodes", value.nodes, MAX_ITEMS)
    if not all(isinstance(node, str) for node in nodes):
        raise MalformedField("answers.nodes", nodes[:4], "not node ids")
    codes = column("answers.tiers", value.tiers, _U8, n)
    if max(value.states, default=0) >= len(_STATES) or np.any(codes >= len(_TIERS)):
        raise MalformedField("answers", value.states[:8], "a state or tier code out of range")
    if np.any(holders >= len(nodes)):
        raise MalformedField("answers.holders", value.holders[:32], "a node out of range")
    where_of = [NodeId(nodes[h]) for h in holders.tolist()]
    answers: list[LookupAnswer] = []
    at = 0
    for state, tier, size in zip(value.states, value.tiers, sizes.tolist(), strict=True):
        if size < 0:
            answers.append(_WHEREVER[state][tier])
            continue
        end = at + size
        where = dict(zip(ranks[at:end], where_of[at:end], strict=True))
        at = end
        answers.append(tuple.__new__(LookupAnswer, (_STATES[state], where, _TIERS[tier])))
    return answers


def nodes_of(values: Iterable[Any]) -> list[NodeId | None]:
    """``locate``'s answer: per key, a node holding it, or None."""
    return [None if n is None else NodeId(n) for n in values]


def holders_of(values: Iterable[Any]) -> list[frozenset[NodeId]]:
    """``holders``' answer: per key, the nodes whose own tiers hold every rank of it."""
    return [frozenset(NodeId(n) for n in nodes) for nodes in values]


# ---- residency events (KV-cache events) ---------------------------------------------------
class ResidencyEvent(NamedTuple):
    seq: int
    namespace: Namespace
    node: NodeId
    tier: TierName
    removed: bool
    keys: list[ChunkKey]


class EventBatch(NamedTuple):
    next_seq: int  # pass back as ``after`` next time
    lost: int  # events this reader missed because the log wrapped
    events: list[ResidencyEvent]
    epoch: str = ""  # the log's incarnation: a new one means the Evictor restarted


def event_batch_of(value: Any) -> EventBatch:
    next_seq, lost, events, epoch = value
    return EventBatch(
        next_seq,
        lost,
        [
            ResidencyEvent(
                seq,
                Namespace(ns),
                NodeId(node),
                TierName(tier),
                removed,
                [ChunkKey(k) for k in keys],
            )
            for seq, ns, node, tier, removed, keys in events
        ],
        str(epoch),
    )


# ---- configs ------------------------------------------------------------------------------
def config_of(value: Any) -> TierStoreConfig:
    """An actor's ``config`` answer (a dict: msgpack flattens the dataclass) rebuilt."""
    return value if isinstance(value, TierStoreConfig) else TierStoreConfig(**value)


# ---- lookup-time pulls (issue 30) ---------------------------------------------------------
class PullState(str, Enum):
    """What a load's join (``NodeStore.wait_pulls``) finds of one shard on its node."""

    HELD = "held"  # in the node's CPU tier (pulled, or already there)
    FAILED = "failed"  # its pull failed, or was still running at the deadline
    NONE = "none"  # not there and no pull of it: the load pulls it itself


def pulls_of(values: Iterable[Any]) -> list[tuple[ShardId, NodeId]]:
    """``NodeStore.pull``'s shards, each with the node to pull it from (the Evictor's)."""
    return [(shard_id_of(shard), NodeId(str(node))) for shard, node in values]


def pull_states_of(values: Iterable[Any]) -> list[PullState]:
    """``NodeStore.wait_pulls``' answer: one state per shard asked for."""
    return [PullState(v) for v in values]
