"""A worker's loads through the object store: from another node, or whenever the local
arena cannot serve them (no arena, a shard on disk only, CUDA for now).

One copy on each side. The holder's NodeStore puts its shards' extent views into one
object (``ray.put`` copies them into the object store while no extent can be reused);
here the fetched object's arrays are read in place (a ``ray.get`` of numpy arrays maps
them, read-only), each shard's length and slot coverage is checked, and the job is
scattered into the KV cache from them, each piece hashed as it is copied (the host's C
walk: a shard that fails its xxh3 may have put bytes in its blocks, and the load fails;
elsewhere every shard is hashed before any byte is copied). Shards of one job may come
from several nodes: the calls go out at once, and every shard is checked before the
copy starts.

A holder that fails (its NodeStore died, its node is lost, its object's owner died
before the get, or it no longer holds the chunk: a view hit, answered from the
scheduler's cluster view, names a node before the Evictor leased the chunk there) is
retried once from other copies the Evictor knows of.

Thread: the worker's transfer threads; :meth:`ObjectLoads.load` blocks on the
NodeStores' answers (each within the transfer deadline).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from tierstore.data.checksum import digest
from tierstore.data.layout import JobPlan
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierStoreError
from tierstore.keys import NodeId
from tierstore.vllm.device_copy import Scatter
from tierstore.vllm.transfer_specs import LoadSpec
from tierstore.vllm.worker_ports import Loaded, WorkerPorts
from tierstore.wire import Reply, ShardMeta

logger = logging.getLogger(__name__)


class ObjectLoads:
    """Loads of one rank through the object store."""

    def __init__(self, ports: WorkerPorts, rank: int, timeout_s: float) -> None:
        self._ports = ports
        self._rank = rank
        self._timeout_s = timeout_s
        self.relocated = 0  # load jobs served (in part) by another copy

    def load(self, spec: LoadSpec, plan: JobPlan, scatter: Scatter) -> None:
        """Fetch, verify and scatter every shard of ``spec``; raises if any cannot be."""
        by_node = spec.keys_by_node(self._rank)
        calls = {node: self._call_load(spec, node, idx) for node, idx in by_node.items()}
        shards: list[tuple[np.ndarray, int]] = [(_EMPTY, 0)] * len(spec.keys)
        for node, call in calls.items():
            idx = by_node[node]
            part, metas = self._fetch_from(spec, node, idx, call)
            verify(spec, plan, idx, part, metas)
            for i, shard, meta in zip(idx, part, metas, strict=True):
                shards[i] = (shard, meta.digest)
        scatter_shards(scatter, spec, plan, shards)

    def _call_load(self, spec: LoadSpec, node: NodeId, idx: list[int]) -> Reply[Loaded] | Exception:
        """The NodeStore call for ``idx`` (sent now, so the nodes work in parallel), or why
        it could not be sent."""
        try:
            return self._ports.node_store(node).load(
                spec.namespace, self._rank, [spec.keys[i] for i in idx]
            )
        except Exception as exc:  # e.g. no NodeStore on that node any more
            return exc

    def _fetch_from(
        self, spec: LoadSpec, node: NodeId, idx: list[int], call: Reply[Loaded] | Exception
    ) -> Loaded:
        """The shards of ``idx`` from ``node``; if that fails, from other copies, once."""
        try:
            if isinstance(call, Exception):
                raise call
            return call.result(self._timeout_s)
        except Exception as error:
            if not isinstance(error, ChunkNotFoundError):  # else the NodeStore is fine
                self._ports.forget_node_store(node)
            return self._fetch_elsewhere(spec, node, idx, error)

    def _fetch_elsewhere(
        self, spec: LoadSpec, failed: NodeId, idx: list[int], error: Exception
    ) -> Loaded:
        keys = [spec.keys[i] for i in idx]
        try:
            nodes = self._ports.locate(spec.namespace, keys, self._rank, failed, spec.root)
        except Exception:
            logger.warning("could not ask the Evictor for other copies", exc_info=True)
            nodes = [None]
        if len(nodes) != len(keys) or any(node is None for node in nodes):
            raise TierStoreError(
                f"load of {len(keys)} chunks from node {failed} failed and not every chunk "
                f"has another copy: {error}"
            ) from error
        positions: dict[NodeId, list[int]] = {}
        for position, node in enumerate(nodes):
            positions.setdefault(NodeId(node), []).append(position)  # type: ignore[arg-type]
        shards: list[np.ndarray] = [_EMPTY] * len(keys)
        metas: list[ShardMeta | None] = [None] * len(keys)
        for node, at in positions.items():
            part, part_metas = (
                self._ports.node_store(node)
                .load(spec.namespace, self._rank, [keys[p] for p in at])
                .result(self._timeout_s)
            )
            if len(part) != len(at) or len(part_metas) != len(at):
                raise ChunkCorruptError(f"node {node} answered {len(part)} of {len(at)} shards")
            for p, shard, meta in zip(at, part, part_metas, strict=True):
                shards[p], metas[p] = shard, meta
        logger.warning(
            "node %s failed a load (%s); %d chunks came from other copies on %s",
            failed,
            error,
            len(keys),
            sorted(positions),
        )
        self.relocated += 1
        return shards, [m for m in metas if m is not None]


_EMPTY = np.empty(0, dtype=np.uint8)


def verify(
    spec: LoadSpec,
    plan: JobPlan,
    indices: Sequence[int],
    shards: Sequence[np.ndarray],
    metas: Sequence[ShardMeta],
) -> None:
    """Check each shard before a byte of it reaches the KV cache: its count, its length
    against this engine's layout and the slots it covers (its xxh3 is checked as it is
    copied: :func:`scatter_shards`)."""
    if len(shards) != len(indices) or len(metas) != len(indices):
        raise ChunkCorruptError(
            f"load answered {len(shards)} shards and {len(metas)} metas for {len(indices)} keys"
        )
    for i, shard, meta in zip(indices, shards, metas, strict=True):
        chunk = plan.chunks[i]
        key = spec.keys[i].hex()
        if meta.nbytes != chunk.nbytes:
            raise ChunkCorruptError(
                f"chunk {key}: {meta.nbytes} bytes stored, this engine's layout needs "
                f"{chunk.nbytes}"
            )
        if chunk.slot_mask & ~meta.slot_mask:
            raise ChunkCorruptError(
                f"chunk {key}: load needs slots {chunk.slot_mask:#x}, only "
                f"{meta.slot_mask:#x} were stored"
            )
        if shard.dtype != np.uint8 or shard.ndim != 1 or shard.nbytes != meta.nbytes:
            raise ChunkCorruptError(
                f"chunk {key}: got {shard.nbytes} bytes ({shard.dtype}, {shard.ndim}-d), "
                f"its meta says {meta.nbytes}"
            )


def scatter_shards(
    scatter: Scatter, spec: LoadSpec, plan: JobPlan, fetched: Sequence[tuple[np.ndarray, int]]
) -> None:
    """Check each shard's xxh3 ``(bytes, digest)``, one per chunk in job order, and
    scatter them into the KV cache: each from where it lies when the copier can (the
    host executor, verifying as it copies), else hashed first, then from one job
    buffer. Raises ChunkCorruptError naming the first chunk that fails."""
    if scatter.pieces_in_place:
        if not scatter.from_verified_pieces(plan.chunks, fetched):
            bad = next((i for i, (s, d) in enumerate(fetched) if digest(s) != d), 0)
            raise ChunkCorruptError(
                f"chunk {spec.keys[bad].hex()}: checksum mismatch as it was loaded; the "
                "load fails (its blocks may hold some of its bytes: never reported loaded)"
            )
        return
    for key, (shard, want) in zip(spec.keys, fetched, strict=True):
        if digest(shard) != want:
            raise ChunkCorruptError(f"chunk {key.hex()}: checksum mismatch; not loading it")
    shards = [shard for shard, _ in fetched]
    if len(shards) == 1:
        scatter(shards[0])
        return
    data = np.empty(plan.nbytes, dtype=np.uint8)
    for chunk, shard in zip(plan.chunks, shards, strict=True):
        data[chunk.offset : chunk.offset + chunk.nbytes] = shard
    scatter(data)
