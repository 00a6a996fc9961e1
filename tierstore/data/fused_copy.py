"""A job's copies between the KV cache and the arena, hashed in the same pass, in C.

Stores: the numpy path gathers the pages into the job's extents, and the commit thread
hashes them later, from memory. Loads: it hashes each shard from memory, then copies
it from memory into the KV pages. The C walk (``fused_copy.c``, built as
``tierstore.data._fused_copy``) copies piece by piece (at most 64 KiB) and hashes each
piece right after, while it is in cache: a store's digests are known when its gather
returns, and a load's bytes are verified as they are copied. It walks the job's plan
itself (spans of blocks, each block a slot of one page per layer), so no per-page table
is built in Python, whose small numpy calls were most of a small job's time. One pass
reads each piece once, while it is in cache (what that saves: docs/benchmarks.md,
"dataplane").

The catch is a load's order: a shard's bytes may land in the destination blocks before
its digest is known to be wrong. The caller then fails the load (or tries again,
pinned), and nothing reports those blocks loaded: vLLM recomputes them.

The module is optional (no C compiler at install: ``available()`` is False and jobs
take the numpy path). At import it is checked against the numpy path on a small
two-group layout, both ways, bytes and digests; where it disagrees it is not used. Its
one function takes the tables' addresses and lengths, checks every index it reads
against those lengths before it copies anything (a bad table raises ValueError), and
copies with the GIL released.

Thread: any; other Python threads run while a walk copies, and each thread has its own
hash state. The caller holds the tables, shards and KV tensors until the call returns.
"""

from __future__ import annotations

import array
import ctypes
import logging
import threading
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from tierstore.data.checksum import binding_library
from tierstore.data.copy_plan import CopyPlanner
from tierstore.data.host_copy import HostExecutor
from tierstore.data.layout import ChunkLayout, JobPlan

logger = logging.getLogger(__name__)

OK = -1

# Jobs of at least this many bytes take the C walk (tests move it to compare paths).
MIN_BYTES = 0
# Jobs of at least this many bytes write their destination with non-temporal stores
# (no read of cold lines before they are written; a load would only evict the arena
# bytes its hash reads next), and stores hash as they gather: the commit thread would
# read the extents back from memory. Smaller loads keep their pages in cache for the
# forward that reads them; smaller stores only copy, on the model-runner thread (which
# computes the next forward on the CPU platform), and leave the hash to the commit
# thread, which finds the extents still in cache. Hashing small stores at submit made
# them slower: the hash moved onto the model-runner thread.
STREAMING_MIN_BYTES = 4 << 20

_SPAN_WIDTH = 6  # first filled slot's job offset, blocks, ids start, slot bytes, refs lo, hi
_REF_WIDTH = 5  # tensor base address, row stride, rows, page bytes, offset in the slot
_MAX_CACHED_SPANS = 4096


class PlanTables:
    """A layout's pages as the C walk reads them: one row per page of a slot (a layer of
    a group), built once; one row per span of a job plan, cached per plan (a layout
    hands out the same plan object for every job of one shape)."""

    def __init__(self, layout: ChunkLayout) -> None:
        rows: list[tuple[int, ...]] = []
        self._ref_ranges: list[tuple[int, int]] = []
        for group in layout.groups:
            first = len(rows)
            for ref in group.refs:
                t = layout.tensors[ref.tensor_idx]
                stride = t.stride(0) * t.element_size()
                rows.append((t.data_ptr(), stride, t.shape[0], ref.page_bytes, ref.slot_offset))
            self._ref_ranges.append((first, len(rows)))
        # One row per ref at refs_address; a walk reads rows [0, len(refs)) only.
        self.refs = np.array(rows, dtype=np.int64).reshape(-1, _REF_WIDTH)
        self.refs_address = self.refs.ctypes.data
        self._layout = layout
        self._spans: dict[int, tuple[JobPlan, np.ndarray, int]] = {}

    def spans(self, plan: JobPlan) -> tuple[np.ndarray, int]:
        """The plan's span rows and their address. Any thread: hold the array for as long
        as the address is used (another thread may drop it from the cache meanwhile)."""
        cached = self._spans.get(id(plan))
        if cached is not None and cached[0] is plan:
            return cached[1], cached[2]
        rows = []
        for span in plan.spans:
            slot = self._layout.groups[span.group_pos].slot_bytes
            first, end = self._ref_ranges[span.group_pos]
            start = span.offset + span.skip * slot
            rows.append((start, span.n_blocks, span.ids_start, slot, first, end))
        table = np.array(rows, dtype=np.int64).reshape(-1, _SPAN_WIDTH)
        if len(self._spans) >= _MAX_CACHED_SPANS:
            self._spans.clear()
        address = table.ctypes.data
        self._spans[id(plan)] = (plan, table, address)
        return table, address


class _Native:
    """The C walk with the xxhash binding's streaming XXH3 functions to call."""

    def __init__(self, xxh: ctypes.CDLL) -> None:
        """Raises ImportError where the module was not built."""
        from tierstore.data import _fused_copy

        self._walk = _fused_copy.walk
        update = getattr(xxh, "XXH3_64bits_update_dispatch", None) or xxh.XXH3_64bits_update
        fns = (xxh.XXH3_64bits_reset, update, xxh.XXH3_64bits_digest)
        self._hash_fns = [ctypes.cast(f, ctypes.c_void_p).value or 0 for f in fns]
        if not all(self._hash_fns):
            raise AttributeError("the xxhash binding's XXH3 functions have no address")
        xxh.XXH3_createState.restype = ctypes.c_void_p
        self._create_state = xxh.XXH3_createState
        self._local = threading.local()  # a thread's state lives as long as the thread

    def walk(  # noqa: PLR0913 - one C call's arguments
        self,
        shards: array.array,
        tables: PlanTables,
        plan: JobPlan,
        ids: np.ndarray,
        gather: bool,
        streaming: bool,
        hashing: bool = True,
    ) -> int:
        """``shards``: uint64 job offsets (n + 1, the job's end last), addresses (n),
        digests (n). A scatter always hashes. Returns ``OK`` or, for a scatter, the first
        shard whose digest differs; raises ValueError for a plan outside its tables, the
        KV cache or the job (nothing copied)."""
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = self._create_state()
            if not state:
                raise MemoryError("XXH3_createState failed")
        spans, spans_address = tables.spans(plan)  # held until the call returns
        n = (len(shards) - 1) // 3
        base = shards.buffer_info()[0]
        return int(
            self._walk(
                base,
                base + 8 * (n + 1),
                base + 8 * (2 * n + 1),
                n,
                spans_address,
                len(spans),
                tables.refs_address,
                len(tables.refs),
                ids.ctypes.data,
                len(ids),
                gather,
                streaming,
                hashing,
                state,
                *self._hash_fns,
            )
        )


def _shard_table(plan: JobPlan, addresses: Sequence[int], digests: Sequence[int]) -> array.array:
    """The C walk's shard rows: job offsets (and the job's end), addresses, digests."""
    return array.array("Q", [*(c.offset for c in plan.chunks), plan.nbytes, *addresses, *digests])


def _in_arena(arena: np.ndarray, plan: JobPlan, offsets: Sequence[int]) -> list[int]:
    """The addresses of the chunks' extents at ``offsets``, each checked to lie in the
    arena (the walk trusts them: a wrong one would be a wild write)."""
    _check_bytes(arena, "arena")
    chunks = plan.chunks
    if len(offsets) != len(chunks) or not chunks:
        raise ValueError(f"{len(offsets)} extents for a job of {len(chunks)} chunks")
    ends = [at + c.nbytes for at, c in zip(offsets, chunks, strict=True)]
    if min(offsets) < 0 or max(ends) > arena.nbytes:
        raise ValueError(f"an extent lies outside the {arena.nbytes}-byte arena")
    base = arena.ctypes.data
    return [base + at for at in offsets]


def _check_bytes(buffer: np.ndarray, what: str) -> None:
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous 1-D uint8, got {buffer.dtype} {buffer.shape}")


def _ids(block_ids: np.ndarray | Sequence[int]) -> np.ndarray:
    return np.ascontiguousarray(block_ids, dtype=np.int64).reshape(-1)


def scatter_verified(
    arena: np.ndarray,
    tables: PlanTables,
    plan: JobPlan,
    block_ids: np.ndarray | Sequence[int],
    extents: Sequence[tuple[int, int]],
) -> int:
    """Copy a job's pages out of its chunks' extents ``(arena offset, digest)`` into KV
    blocks ``block_ids``, checking each chunk's xxh3-64 as it goes.

    Returns ``OK``, or the index of the first chunk whose digest differs (bytes up to it
    may be in the destination). Raises ValueError for an extent outside the arena or a
    block id or a page outside the KV cache, its tables or the job (nothing copied);
    RuntimeError if the module is not available."""
    addresses = _in_arena(arena, plan, [at for at, _ in extents])
    return _scatter(tables, plan, block_ids, addresses, [d for _, d in extents])


def scatter_verified_pieces(
    tables: PlanTables,
    plan: JobPlan,
    block_ids: np.ndarray | Sequence[int],
    pieces: Sequence[tuple[np.ndarray, int]],
) -> int:
    """As :func:`scatter_verified`, from one buffer per chunk ``(bytes, digest)`` (a
    fetched object's shards, read in place), each exactly its chunk's size."""
    if len(pieces) != len(plan.chunks) or not pieces:
        raise ValueError(f"{len(pieces)} buffers for a job of {len(plan.chunks)} chunks")
    for (piece, _), chunk in zip(pieces, plan.chunks, strict=True):
        _check_bytes(piece, "a shard")
        if piece.nbytes != chunk.nbytes:
            raise ValueError(f"a shard of {piece.nbytes} bytes for a {chunk.nbytes}-byte chunk")
    addresses = [piece.ctypes.data for piece, _ in pieces]
    return _scatter(tables, plan, block_ids, addresses, [d for _, d in pieces])


def _scatter(
    tables: PlanTables,
    plan: JobPlan,
    block_ids: np.ndarray | Sequence[int],
    addresses: Sequence[int],
    digests: Sequence[int],
) -> int:
    native = _require()
    shards = _shard_table(plan, addresses, digests)
    streaming = plan.nbytes >= STREAMING_MIN_BYTES
    return native.walk(shards, tables, plan, _ids(block_ids), False, streaming)


def gather(
    arena: np.ndarray,
    tables: PlanTables,
    plan: JobPlan,
    block_ids: np.ndarray | Sequence[int],
    offsets: Sequence[int],
) -> list[int] | None:
    """Copy a job's pages from KV blocks ``block_ids`` into its chunks' extents at
    ``offsets`` (slots no page fills are zeroed). A job of :data:`STREAMING_MIN_BYTES`
    or more is hashed as it is copied: returns each chunk's xxh3-64; a smaller one is
    only copied: returns None. Raises as :func:`scatter_verified`."""
    native = _require()
    shards = _shard_table(plan, _in_arena(arena, plan, offsets), [0] * len(offsets))
    large = plan.nbytes >= STREAMING_MIN_BYTES
    native.walk(shards, tables, plan, _ids(block_ids), True, large, large)
    return shards[2 * len(offsets) + 1 :].tolist() if large else None


def available() -> bool:
    return _native is not None


def _require() -> _Native:
    if _native is None:
        raise RuntimeError("tierstore.data._fused_copy is not available")
    return _native


def _agrees_with_numpy(native: _Native) -> bool:
    """The C walk against the numpy executor on a small layout: two groups (one of two
    layers), odd page sizes, a first chunk that starts part-way and a last one that
    ends early (zeroed slots), extents apart and in reverse order; a gather, a scatter
    into other blocks, then a corrupt digest."""
    rng = np.random.default_rng(7)
    rows = [rng.integers(-128, 128, (9, 256), dtype=np.int8) for _ in range(3)]

    def layout() -> ChunkLayout:
        tensors = [torch.from_numpy(r.copy()) for r in rows]
        return ChunkLayout(tensors, [[(0, 100), (1, 60)], [(2, 200)]], blocks_per_chunk=3)

    ours, theirs = layout(), layout()
    tables, planner, executor = PlanTables(ours), CopyPlanner(theirs), HostExecutor(theirs)
    plan = ours.plan([4, 2], [1, 0])
    gathered, scattered = [3, 1, 7, 5, 8, 0], [2, 4, 6, 0, 1, 3]
    arena = rng.integers(0, 256, 3 * plan.nbytes, dtype=np.uint8)
    offsets = [2 * plan.nbytes + 7 - c.offset - c.nbytes for c in plan.chunks]
    shards = _shard_table(plan, _in_arena(arena, plan, offsets), [0] * len(offsets))
    if native.walk(shards, tables, plan, _ids(gathered), True, True) != OK:
        return False
    job = np.empty(plan.nbytes, dtype=np.uint8)
    executor.gather(planner.build(plan, gathered), job)
    digests = shards[2 * len(offsets) + 1 :].tolist()
    for chunk, at, digest in zip(plan.chunks, offsets, digests, strict=True):
        part = job[chunk.offset : chunk.offset + chunk.nbytes]
        if digest != xxhash.xxh3_64_intdigest(part) or not np.array_equal(
            arena[at : at + chunk.nbytes], part
        ):
            return False
    if native.walk(shards, tables, plan, _ids(scattered), False, False) != OK:
        return False
    copied = np.zeros_like(arena)  # a copy-only gather leaves the same extents
    into = _shard_table(plan, _in_arena(copied, plan, offsets), [0] * len(offsets))
    if native.walk(into, tables, plan, _ids(gathered), True, False, False) != OK:
        return False
    for chunk, at in zip(plan.chunks, offsets, strict=True):
        if not np.array_equal(copied[at : at + chunk.nbytes], arena[at : at + chunk.nbytes]):
            return False
    executor.scatter(planner.build(plan, scattered), job)
    if not all(torch.equal(a, b) for a, b in zip(ours.tensors, theirs.tensors, strict=True)):
        return False
    shards[-2] ^= 1  # the second chunk's digest
    return native.walk(shards, tables, plan, _ids(scattered), False, True) == 1


def _load() -> _Native | None:
    try:
        native = _Native(binding_library())
    except (ImportError, OSError, AttributeError) as exc:
        logger.info("copies and hashes in numpy (the C module is not there: %s)", exc)
        return None
    try:
        agrees = _agrees_with_numpy(native)
    except ValueError as exc:  # it refused the probe's plan
        logger.warning("the C copy walk refused its probe (%s); not used", exc)
        return None
    if not agrees:
        logger.warning("the C copy walk disagrees with numpy on its probe; not used")
        return None
    return native


_native = _load()
