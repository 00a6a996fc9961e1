"""Disk tier: one file per shard, checksummed, published atomically, rebuilt on start.

Why one file per shard rather than an append-only segment log: shards are evicted one
by one and far more often than they are read, and a log would need compaction to give
that space back (vLLM's own disk tier never deletes at all). A file per shard frees
space with one metadata call, needs no compaction, and a crash can at worst leave a
``.tmp`` file, which start-up deletes. The cost, one inode per shard, is spread over 256
sub-directories, and paid once: a deleted shard's file is written over by a later one
instead of a new file being created (:mod:`tierstore.data.tiers.free_files`).

File format::

    b"TSC1" | u32 big-endian header length | msgpack header | payload

The header holds namespace, key, group, rank, payload length, slot mask, checksum
algorithm and digest, plus what the Evictor needs to re-index the chunk after a restart
(the world size and the chunk's parent in its prefix chain). Paths come from hex
digests only, never from raw input.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from typing_extensions import override

from tierstore.data.checksum import CHECKSUM_ALGORITHM, digest
from tierstore.data.tiers.base import ShardMeta, StoredShard, Tier
from tierstore.data.tiers.free_files import FreeFiles, remove
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierFullError
from tierstore.keys import ChunkKey, Namespace, ShardId, group_of

logger = logging.getLogger(__name__)

MAGIC = b"TSC1"
_PREFIX = struct.Struct(">4sI")
_MAX_HEADER_BYTES = 64 * 1024  # a header is ~150 bytes; anything bigger is corruption
_HEX = re.compile(r"^[0-9a-f]{1,64}$")
_FILE_MODE = 0o600
# What reading a damaged or crafted file may raise (msgpack's errors are ValueErrors;
# its depth limit, StackError, too): such a file is removed, never served.
_UNREADABLE = (OSError, ValueError, msgpack.UnpackException)
_DIR_MODE = 0o700


def _shard_file_name(shard_id: ShardId) -> str:
    material = shard_id.namespace.encode() + b"\0" + shard_id.key + shard_id.rank.to_bytes(4, "big")
    return hashlib.sha256(material).hexdigest()


class DiskTier(Tier):
    """Every read is checksum-verified. Thread-safe: a lock guards the index and the byte
    count, never a payload read or write, so loads on the NodeStore's data threads read
    files while its control thread writes and deletes others. A file deleted under a
    read fails that read (ChunkNotFoundError); an open file is read whole (an unlinked
    inode stays readable), and a file is only ever replaced by the same shard's bytes."""

    name = "disk"
    copies_on_put = True  # to a file

    def __init__(self, root: Path, capacity_bytes: int, fsync: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.root = Path(root)
        self.fsync = fsync
        self._index: dict[ShardId, tuple[Path, ShardMeta]] = {}
        self._lock = threading.Lock()
        self.corrupt_files_removed = 0
        self.root.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
        os.chmod(self.root, _DIR_MODE)
        self._dirs: set[Path] = set()  # shard directories known to exist
        self._tmp_names = itertools.count()
        self._rebuild()
        self._free = FreeFiles(self.root, _DIR_MODE)  # after the shards: they come first
        for extra in self._free.trim(self.free_bytes):
            remove(extra)

    # ---- paths -----------------------------------------------------------------------------
    def _path(self, shard_id: ShardId) -> Path:
        if not _HEX.match(shard_id.namespace):
            raise ValueError(f"namespace must be a hex digest, got {shard_id.namespace!r}")
        name = _shard_file_name(shard_id)
        return self.root / shard_id.namespace / name[:2] / f"{name}.chunk"

    # ---- Tier ------------------------------------------------------------------------------
    @override
    def put(self, shard_id: ShardId, shard: StoredShard) -> None:
        path = self._path(shard_id)
        with self._lock:  # the room is reserved until the file is published or fails
            if shard_id in self._index:
                return
            self._check_room(shard.meta.nbytes)
            self._used_bytes += shard.meta.nbytes
            recycled = self._free.take()
            spilled = self._free.trim(self.free_bytes)
        for extra in spilled:  # the room the shard needs (a freed file held it)
            remove(extra)
        try:
            self._write(path, recycled, shard_id, shard)
        except OSError as exc:
            with self._lock:
                self._used_bytes -= shard.meta.nbytes
            raise TierFullError(f"disk tier write failed at {path}: {exc}") from exc
        with self._lock:
            if shard_id in self._index:  # written twice at once: one reservation is freed
                self._used_bytes -= shard.meta.nbytes
            else:
                self._index[shard_id] = (path, shard.meta)

    def _write(
        self, path: Path, recycled: Path | None, shard_id: ShardId, shard: StoredShard
    ) -> None:
        """Write the file under a private name (a recycled file, else a new ``.tmp``),
        then publish it with one atomic rename: readers see all of it or nothing. On
        failure the private file is removed and the error raised."""
        if path.parent not in self._dirs:
            path.parent.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
            self._dirs.add(path.parent)
        if recycled is not None:
            private, flags = recycled, os.O_WRONLY
        else:
            # Unique in this process (the only writer of this directory; start-up
            # removes a previous run's): a counter, not uuid4's urandom call.
            private = path.with_name(f".{path.name}.{os.getpid()}-{next(self._tmp_names)}.tmp")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(private, flags, _FILE_MODE)
            with os.fdopen(fd, "wb") as out:
                out.write(_header_bytes(shard_id, shard.meta))
                out.write(memoryview(np.ascontiguousarray(shard.data)).cast("B"))
                out.truncate()  # a recycled file may have been longer
                if self.fsync:
                    out.flush()
                    os.fsync(out.fileno())
            os.replace(private, path)
        except OSError:
            remove(private)
            self._dirs.discard(path.parent)  # made again next time, had it been removed
            raise

    @override
    def get(self, shard_id: ShardId) -> StoredShard:
        meta = self.meta(shard_id)
        payload = np.empty(meta.nbytes, dtype=np.uint8)
        return StoredShard(self.read_into(shard_id, payload), payload)

    def meta(self, shard_id: ShardId) -> ShardMeta:
        entry = self._index.get(shard_id)
        if entry is None:
            raise ChunkNotFoundError(f"shard not on disk: {shard_id!r}")
        return entry[1]

    def read_into(self, shard_id: ShardId, out: np.ndarray) -> ShardMeta:
        """Read the shard's payload straight into ``out`` (uint8, its length; e.g. an arena
        extent), then verify length and checksum there. A bad file is removed and raises
        ChunkCorruptError; ``out`` then holds garbage, which the caller must not keep."""
        entry = self._index.get(shard_id)
        if entry is None:
            raise ChunkNotFoundError(f"shard not on disk: {shard_id!r}")
        path, meta = entry
        if out.nbytes != meta.nbytes:
            raise ValueError(f"{out.nbytes}-byte buffer for a {meta.nbytes}-byte shard {path}")
        try:
            header = _read_file_into(path, out)
        except (OSError, ValueError) as exc:
            self._discard(shard_id, entry)
            raise ChunkCorruptError(f"unreadable chunk file {path}: {exc}") from exc
        if header.get("length") != meta.nbytes:
            self._discard(shard_id, entry)
            raise ChunkCorruptError(f"chunk file {path}: header changed since it was written")
        if digest(out) != meta.digest:
            self._discard(shard_id, entry)
            raise ChunkCorruptError(f"chunk file {path}: checksum mismatch")
        return meta

    @override
    def delete(self, shard_id: ShardId) -> int:
        with self._lock:
            return self._delete(shard_id, self._index.get(shard_id))

    def _delete(self, shard_id: ShardId, entry: tuple[Path, ShardMeta] | None) -> int:
        """Remove ``entry`` if it is still the shard's (lock held): a read that failed
        on a file dropped, or re-written, meanwhile takes nothing newer with it."""
        if entry is None or self._index.get(shard_id) is not entry:
            return 0
        del self._index[shard_id]
        path, meta = entry
        self._used_bytes -= meta.nbytes
        # One metadata syscall (a rename into .free/, else an unlink); never a payload.
        self._free.keep(path, meta.nbytes, self.free_bytes)
        return meta.nbytes

    @override
    def __contains__(self, shard_id: object) -> bool:
        return shard_id in self._index

    @override
    def items(self) -> Iterator[tuple[ShardId, ShardMeta]]:
        with self._lock:  # a snapshot: the index may change while the caller iterates
            held = [(shard_id, meta) for shard_id, (_, meta) in self._index.items()]
        yield from held

    @override
    def __len__(self) -> int:
        return len(self._index)

    @property
    def files_reused(self) -> int:
        """Writes that went into a deleted shard's file instead of a new one."""
        return self._free.reused

    def path_of(self, shard_id: ShardId) -> Path:
        return self._index[shard_id][0]

    # ---- start-up --------------------------------------------------------------------------
    def _discard(self, shard_id: ShardId, entry: tuple[Path, ShardMeta]) -> None:
        """A corrupt file is deleted so it can never be served, now or after a restart.
        Raises ChunkNotFoundError instead if the shard was dropped during the read."""
        with self._lock:
            if self._index.get(shard_id) is not entry:
                raise ChunkNotFoundError(f"shard dropped from disk while read: {shard_id!r}")
            self._delete(shard_id, entry)
            self.corrupt_files_removed += 1

    def _recover(self, path: Path) -> tuple[ShardId, ShardMeta]:
        """One file's shard, from its header; raises one of ``_UNREADABLE`` if the file is
        not a well-formed chunk of the shard its name says (e.g. another namespace's
        header under this name) or its size disagrees with its header."""
        header, payload_offset = _read_header(path)
        shard_id, meta = parse_header(header)
        if self._path(shard_id) != path:
            raise ValueError("file name does not match its header")
        size = path.stat().st_size
        if size != payload_offset + meta.nbytes:
            raise ValueError(f"{size} bytes on disk, header says payload {meta.nbytes}")
        return shard_id, meta

    def _rebuild(self) -> None:
        """Inventory from the headers alone; payloads are verified when read."""
        for path in self.root.glob("*/*/*"):
            if path.name.endswith(".tmp"):
                remove(path)  # a write that never published
                continue
            if not path.name.endswith(".chunk"):
                continue
            try:
                shard_id, meta = self._recover(path)
            except _UNREADABLE as exc:
                logger.warning("removing unreadable chunk file %s: %s", path, exc)
                remove(path)
                self.corrupt_files_removed += 1
                continue
            self._index[shard_id] = (path, meta)
            self._used_bytes += meta.nbytes
        if self._index:
            logger.info(
                "disk tier %s: %d chunks, %d bytes recovered",
                self.root,
                len(self._index),
                self._used_bytes,
            )


def _header_bytes(shard_id: ShardId, meta: ShardMeta) -> bytes:
    """The file's prefix and header (see the module docstring)."""
    header = msgpack.packb(
        {
            "namespace": shard_id.namespace,
            "key": bytes(shard_id.key),
            "group": group_of(shard_id.key),
            "rank": shard_id.rank,
            "length": meta.nbytes,
            "slot_mask": meta.slot_mask,
            "checksum": CHECKSUM_ALGORITHM,
            "digest": meta.digest,
            "world_size": meta.world_size,
            "parent": meta.parent,
        }
    )
    return _PREFIX.pack(MAGIC, len(header)) + header


def _field(header: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"header field {name!r} is {type(value).__name__}, not {kind}")
    return value


def _bounded(header: dict[str, Any], name: str, low: int, high: int) -> int:
    value = _field(header, name, int)
    if not low <= value < high:
        raise ValueError(f"header field {name!r} = {value} is outside [{low}, {high})")
    return value  # type: ignore[no-any-return]


def parse_header(header: dict[str, Any]) -> tuple[ShardId, ShardMeta]:
    """A decoded header's shard id and metadata; every field type- and range-checked, so
    a crafted header raises ValueError and nothing else (``int(inf)`` raises
    OverflowError, ``bytes(10**12)`` allocates a terabyte: never call them on it)."""
    if _field(header, "checksum", str) != CHECKSUM_ALGORITHM:
        raise ValueError(f"unknown checksum {header['checksum']!r}")
    namespace = _field(header, "namespace", str)
    if not _HEX.match(namespace):
        raise ValueError("header namespace is not a hex digest")
    parent = header.get("parent")
    if parent is not None and not isinstance(parent, bytes):
        raise ValueError(f"header field 'parent' is {type(parent).__name__}, not bytes")
    world_size = _bounded(header, "world_size", 1, 1 << 31)
    shard_id = ShardId(
        Namespace(namespace),
        ChunkKey(_field(header, "key", bytes)),
        _bounded(header, "rank", 0, world_size),
    )
    meta = ShardMeta(
        _bounded(header, "length", 0, 1 << 62),
        _bounded(header, "digest", 0, 1 << 64),
        _bounded(header, "slot_mask", 0, 1 << 64),
        world_size,
        parent,
    )
    return shard_id, meta


def _read_header_from(f: Any) -> tuple[dict[str, Any], int]:
    """The header of an open chunk file, and the offset where its payload starts."""
    prefix = f.read(_PREFIX.size)
    if len(prefix) != _PREFIX.size:
        raise ValueError("file shorter than its prefix")
    magic, length = _PREFIX.unpack(prefix)
    if magic != MAGIC or length > _MAX_HEADER_BYTES:
        raise ValueError("not a tierstore chunk file")
    header = msgpack.unpackb(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("header is not a map")
    return header, _PREFIX.size + length


def read_chunk_header(path: Path) -> dict[str, Any]:
    """A chunk file's header (operators' tools and tests); raises ValueError if it is not one."""
    return _read_header(path)[0]


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        return _read_header_from(f)


def _read_file_into(path: Path, out: np.ndarray) -> dict[str, Any]:
    """The header; the payload is read straight into ``out`` (no intermediate buffer)."""
    nbytes = out.nbytes
    with open(path, "rb") as f:
        header, _ = _read_header_from(f)
        got = f.readinto(memoryview(out).cast("B"))
        if got != nbytes or f.read(1):
            raise ValueError(
                f"payload is {got if got != nbytes else 'more than'} of {nbytes} bytes"
            )
    return header
