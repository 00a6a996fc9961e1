"""Disk tier: chunks in slots of slab files, checksummed, rebuilt from headers on start.

Layout: ``<disk_path>/tierstore-disk-v<layout>/[node-<id>/]<namespace>/<payload
bytes>.slab``, one file per chunk size of a namespace (:mod:`tierstore.data.tiers.slab`:
why slots and not a file per chunk). Only that folder, which tierstore makes and marks,
is ever written; the rest of ``disk_path`` is the user's
(:mod:`tierstore.data.tiers.disk_folder`: the folder, the claim of it, the room check).
Every file in it is made 0600 (folders 0700) and opened ``O_NOFOLLOW``. A chunk write is
one ``pwritev`` of its header page and payload into a free slot; a delete zeroes the
slot's header. Paths come from hex digests and integers only, never from raw input.

Crash safety without a rename: a slot is published in memory only after its write
returned, and every read is checksum-verified, so a write torn by a crash reads back as
a checksum failure (the slot is then freed), never as a chunk. Start-up indexes the
headers alone; payloads are verified when read.

Room: the capacity bounds the payload bytes of the chunks held plus those of freed
slots kept for reuse (``held``). A write that would pass it punches held slots of
other sizes out first, so the files never hold much more than the capacity (a header
page per chunk and the page padding of each payload aside).
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
from typing_extensions import override

from tierstore.data.checksum import digest
from tierstore.data.tiers.base import ShardMeta, StoredShard, Tier
from tierstore.data.tiers.chunk_header import (
    UNREADABLE,
    check_namespace,
    decode_header,
    encode_header,
    parse_header,
)
from tierstore.data.tiers.disk_folder import (
    CLAIM_TIMEOUT_S,
    check_node_id,
    check_size,
    claim,
    open_file,
    open_folder,
    slab_files,
    store_dirs,
    warn_if_short,
)
from tierstore.data.tiers.slab import HEADER_ROOM, SlabFile, slab_name, slot_bytes_for
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierFullError
from tierstore.keys import ShardId
from tierstore.private_files import private_dir

logger = logging.getLogger(__name__)


class _Placed(NamedTuple):
    """Where a shard's bytes are (compared by identity: a newer placement is another)."""

    slab: SlabFile
    slot: int
    meta: ShardMeta


@dataclass(frozen=True)
class ChunkLocation:
    """A stored chunk's payload on disk (operators' tools and tests)."""

    path: Path
    payload_offset: int
    nbytes: int


class DiskTier(Tier):
    """Every read is checksum-verified. Thread-safe: a lock guards the index, the slot
    lists and the byte counts, never a payload read or write, so loads on the
    NodeStore's data threads read slots while its control thread writes and deletes
    others. A slot freed and written over under a read fails that read's checksum
    (ChunkNotFoundError: the shard is gone), never serves the new bytes.

    Opening one checks ``disk_path``'s filesystem first (a capacity larger than it is a
    ConfigError, less free room than the capacity a warning), takes tierstore's folder in
    it (:func:`~tierstore.data.tiers.disk_folder.open_folder`) and claims a directory
    there for ``node_id`` (:func:`~tierstore.data.tiers.disk_folder.claim`), held until
    :meth:`close`. ``folder`` is tierstore's folder, ``root`` the directory claimed."""

    name = "disk"
    copies_on_put = True  # to a file

    def __init__(
        self,
        disk_path: Path,
        capacity_bytes: int,
        fsync: bool = False,
        node_id: str = "local",
        claim_timeout_s: float = CLAIM_TIMEOUT_S,
    ) -> None:
        self._claim_fd = -1
        super().__init__(capacity_bytes)
        self.disk_path = Path(disk_path)
        check_node_id(node_id)  # before anything is made
        check_size(self.disk_path, capacity_bytes)
        self.folder = open_folder(self.disk_path)
        self.root, self._claim_fd = claim(self.folder, node_id, claim_timeout_s)
        self.fsync = fsync
        self._index: dict[ShardId, _Placed] = {}
        self._slabs: dict[tuple[str, int], SlabFile] = {}
        self._held_bytes = 0  # payload bytes of freed slots kept for reuse
        self._lock = threading.Lock()
        self.corrupt_chunks_removed = 0
        self.slots_reused = 0  # writes into a freed slot's blocks instead of new ones
        try:
            self._rebuild()
        except BaseException:
            self.close()
            raise
        warn_if_short(self.disk_path, capacity_bytes, self.file_bytes())

    # ---- Tier ------------------------------------------------------------------------------
    @override
    def put(self, shard_id: ShardId, shard: StoredShard) -> None:
        nbytes = shard.meta.nbytes
        header = encode_header(shard_id, shard.meta)  # raises ValueError on a bad namespace
        with self._lock:  # the room and the slot are reserved until published or failed
            if shard_id in self._index:
                return
            self._check_room(nbytes)
            try:
                slab = self._slab(shard_id.namespace, nbytes)
            except OSError as exc:
                raise TierFullError(f"disk tier cannot open its file: {exc}") from exc
            self._used_bytes += nbytes
            slot, held = slab.take()
            if held:
                self._held_bytes -= nbytes
                self.slots_reused += 1
            spilled = self._spill()
        self._punch(spilled)
        try:
            slab.write(slot, header, np.ascontiguousarray(shard.data), self.fsync)
        except OSError as exc:
            with self._lock:
                self._used_bytes -= nbytes
                self._free(slab, slot)
            raise TierFullError(f"disk tier write failed at {slab.path}: {exc}") from exc
        with self._lock:
            if shard_id in self._index:  # written twice at once: one slot is freed
                self._used_bytes -= nbytes
                self._free(slab, slot)
            else:
                self._index[shard_id] = _Placed(slab, slot, shard.meta)

    def _slab(self, namespace: str, nbytes: int) -> SlabFile:
        """The slab file of that size (lock held; opened, and made, on first use)."""
        slab = self._slabs.get((namespace, nbytes))
        if slab is None:
            folder = private_dir(self.root / check_namespace(namespace))  # never a symlink
            slab = self._slabs[(namespace, nbytes)] = SlabFile(folder / slab_name(nbytes), nbytes)
        return slab

    def _free(self, slab: SlabFile, slot: int) -> None:
        """A slot no shard uses any more is cleared and kept for reuse (lock held). Its
        bytes count as held: used + held stays what it was, within the capacity."""
        slab.clear(slot)
        slab.hold(slot)
        self._held_bytes += slab.nbytes

    def _spill(self) -> list[tuple[SlabFile, int]]:
        """Held slots to punch out until used + held fits the capacity (lock held). They
        leave the lists now and come back as holes once punched, so no write can land
        in one before its punch."""
        spilled = []
        for slab in self._slabs.values():
            while slab.held and self._used_bytes + self._held_bytes > self.capacity_bytes:
                spilled.append((slab, slab.take()[0]))
                self._held_bytes -= slab.nbytes
        return spilled

    def _punch(self, spilled: list[tuple[SlabFile, int]]) -> None:
        for slab, slot in spilled:
            slab.punch(slot)
        if spilled:
            with self._lock:
                for slab, slot in spilled:
                    slab.add_hole(slot)

    @override
    def get(self, shard_id: ShardId) -> StoredShard:
        meta = self.meta(shard_id)
        payload = np.empty(meta.nbytes, dtype=np.uint8)
        return StoredShard(self.read_into(shard_id, payload), payload)

    def meta(self, shard_id: ShardId) -> ShardMeta:
        return self._placed(shard_id).meta

    def _placed(self, shard_id: ShardId) -> _Placed:
        placed = self._index.get(shard_id)
        if placed is None:
            raise ChunkNotFoundError(f"shard not on disk: {shard_id!r}")
        return placed

    def read_into(self, shard_id: ShardId, out: np.ndarray) -> ShardMeta:
        """Read the shard's payload straight into ``out`` (uint8, its length; e.g. an arena
        extent), then verify its checksum there. A bad slot is freed and raises
        ChunkCorruptError; ``out`` then holds garbage, which the caller must not keep."""
        placed = self._placed(shard_id)
        where = f"slot {placed.slot} of {placed.slab.path}"
        if out.nbytes != placed.meta.nbytes:
            raise ValueError(f"{out.nbytes}-byte buffer for a {placed.meta.nbytes}-byte {where}")
        try:
            got = placed.slab.read_payload(placed.slot, out)
        except OSError as exc:
            self._discard(shard_id, placed)
            raise ChunkCorruptError(f"unreadable chunk at {where}: {exc}") from exc
        if got != out.nbytes:
            self._discard(shard_id, placed)
            raise ChunkCorruptError(f"chunk at {where}: {got} of {out.nbytes} bytes on disk")
        if digest(out) != placed.meta.digest:
            self._discard(shard_id, placed)
            raise ChunkCorruptError(f"chunk at {where}: checksum mismatch")
        return placed.meta

    @override
    def delete(self, shard_id: ShardId) -> int:
        with self._lock:
            return self._delete(shard_id, self._index.get(shard_id))

    def _delete(self, shard_id: ShardId, placed: _Placed | None) -> int:
        """Free ``placed`` if it is still the shard's (lock held): a read that failed on
        a slot dropped, or re-written, meanwhile takes nothing newer with it."""
        if placed is None or self._index.get(shard_id) is not placed:
            return 0
        del self._index[shard_id]
        self._used_bytes -= placed.meta.nbytes
        self._free(placed.slab, placed.slot)  # one 8-byte write; never a payload
        return placed.meta.nbytes

    def _discard(self, shard_id: ShardId, placed: _Placed) -> None:
        """A corrupt chunk is freed so it can never be served, now or after a restart.
        Raises ChunkNotFoundError instead if the shard was dropped during the read (its
        slot may hold another shard's bytes by now)."""
        with self._lock:
            if self._index.get(shard_id) is not placed:
                raise ChunkNotFoundError(f"shard dropped from disk while read: {shard_id!r}")
            self._delete(shard_id, placed)
            self.corrupt_chunks_removed += 1

    @override
    def __contains__(self, shard_id: object) -> bool:
        return shard_id in self._index

    @override
    def items(self) -> Iterator[tuple[ShardId, ShardMeta]]:
        with self._lock:  # a snapshot: the index may change while the caller iterates
            held = [(shard_id, placed.meta) for shard_id, placed in self._index.items()]
        yield from held

    @override
    def __len__(self) -> int:
        return len(self._index)

    def location_of(self, shard_id: ShardId) -> ChunkLocation:
        placed = self._placed(shard_id)
        offset = placed.slab.offset(placed.slot) + HEADER_ROOM
        return ChunkLocation(placed.slab.path, offset, placed.meta.nbytes)

    def file_bytes(self) -> int:
        """Bytes the tier's slab files take on disk (holes excluded)."""
        with self._lock:
            return sum(os.fstat(slab.fd).st_blocks * 512 for slab in self._slabs.values())

    def close(self) -> None:
        """Close the slab files and give up the claim of the directory (tests and tools
        that reopen it in process; a NodeStore's claim goes with its process)."""
        with self._lock:
            for slab in self._slabs.values():
                slab.close()
            self._slabs.clear()
            self._index.clear()
        self._release()

    def _release(self) -> None:
        fd, self._claim_fd = self._claim_fd, -1
        if fd >= 0:
            os.close(fd)

    __del__ = _release  # a tier dropped unclosed frees its claim with it

    # ---- start-up --------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Inventory from the headers of tierstore's own slab files alone (a symlink or
        a file of another user's planted among them is skipped with a warning naming
        it); payloads are verified when read."""
        for namespace, path, nbytes in slab_files(self.root):
            try:
                slab = SlabFile(path, nbytes)
            except OSError as exc:
                logger.warning("disk tier: skipping %s: %s", path, exc)
                continue
            self._recover(namespace, slab)
        self._punch(self._spill())
        if self._index:
            logger.info(
                "disk tier %s: %d chunks, %d bytes recovered",
                self.root,
                len(self._index),
                self._used_bytes,
            )

    def _recover(self, namespace: str, slab: SlabFile) -> None:
        """Index one slab file's chunks; a slot whose header is not a well-formed chunk of
        this namespace and size is counted and freed, a torn or free tail cut off."""
        path, nbytes = slab.path, slab.nbytes
        self._slabs[(namespace, nbytes)] = slab
        in_use = [False] * slab.n_slots
        for slot in range(slab.n_slots):
            raw = slab.read_header(slot)
            if not any(raw[:8]):
                continue  # free
            try:
                shard_id, meta = parse_header(decode_header(raw))
                if shard_id.namespace != namespace or meta.nbytes != nbytes:
                    raise ValueError("header does not match the slab file it is in")
            except UNREADABLE as exc:
                logger.warning("removing unreadable chunk in slot %d of %s: %s", slot, path, exc)
                self.corrupt_chunks_removed += 1
                slab.clear(slot)
                continue
            if shard_id in self._index:  # a copy whose delete was lost in a crash
                slab.clear(slot)
                continue
            in_use[slot] = True
            self._index[shard_id] = _Placed(slab, slot, meta)
            self._used_bytes += nbytes
        end = max((slot + 1 for slot, used in enumerate(in_use) if used), default=0)
        if end * slab.slot_bytes != os.fstat(slab.fd).st_size:
            slab.truncate_to(end)
        for slot in range(end):
            if not in_use[slot]:
                slab.hold(slot)  # perhaps allocated: counted until punched or reused
                self._held_bytes += nbytes


@dataclass(frozen=True)
class ChunkRecord:
    """One slot of a slab file whose header decodes (operators' tools and tests)."""

    location: ChunkLocation
    header: dict[str, Any]

    def payload_ok(self) -> bool:
        """Whether the payload on disk now matches the header's digest."""
        data = np.empty(self.location.nbytes, dtype=np.uint8)
        with _open(self.location.path) as f:
            f.seek(self.location.payload_offset)
            got = f.readinto(memoryview(data).cast("B"))
        return got == data.nbytes and digest(data) == self.header.get("digest")


def _open(path: Path) -> io.BufferedReader:
    """A slab file for reading, never through a symlink."""
    return os.fdopen(open_file(path), "rb")


def read_record(location: ChunkLocation) -> ChunkRecord | None:
    """The record whose payload is at ``location``, or None if its header does not decode."""
    with _open(location.path) as f:
        return _record_at(f, location)


def _record_at(f: BinaryIO, location: ChunkLocation) -> ChunkRecord | None:
    f.seek(location.payload_offset - HEADER_ROOM)
    try:
        return ChunkRecord(location, decode_header(f.read(HEADER_ROOM)))
    except UNREADABLE:
        return None


def chunk_records(disk_path: Path) -> Iterator[ChunkRecord]:
    """Every slot of the slab files in tierstore's folder in ``disk_path`` (its
    ``node-<id>/`` folders too) whose header decodes: which chunk is where. Payloads are
    not verified here (:meth:`ChunkRecord.payload_ok` does). Nothing else in
    ``disk_path`` is read, and no symlink followed."""
    for root in store_dirs(disk_path):
        yield from _records_in(root)


def _records_in(root: Path) -> Iterator[ChunkRecord]:
    for _, path, nbytes in slab_files(root):
        slot_bytes = slot_bytes_for(nbytes)
        with _open(path) as f:  # one open per file, not per slot
            for slot in range(os.fstat(f.fileno()).st_size // slot_bytes):
                where = ChunkLocation(path, slot * slot_bytes + HEADER_ROOM, nbytes)
                record = _record_at(f, where)
                if record is not None:
                    yield record
