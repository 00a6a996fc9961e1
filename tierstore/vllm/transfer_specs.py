"""What travels from the scheduler to the workers inside vLLM's TransferJobs.

Workers never see keys, so the specs carry them, in the order of the job's chunks. They
are pickled into every SchedulerOutput: keep them small (node ids are interned).

``root``: the root of the request's prefix tree (:func:`tierstore.keys.root_of`), which
names the Evictor shard that indexes its chunks; 0 when not known (shard 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_offload.base import LoadStoreSpec

from tierstore.keys import ChunkKey, Namespace, NodeId


@dataclass(frozen=True)
class StoreSpec(LoadStoreSpec):
    namespace: Namespace
    keys: tuple[ChunkKey, ...]
    # Previous chunk key of the same group in the request's prefix chain, when known:
    # the Evictor evicts chains tail first.
    parents: tuple[ChunkKey | None, ...] = ()
    root: int = 0  # every stored shard's ShardEntry carries it to the NodeStore


@dataclass(frozen=True)
class LoadSpec(LoadStoreSpec):
    namespace: Namespace
    keys: tuple[ChunkKey, ...]
    nodes: tuple[NodeId, ...]  # interned node ids
    # locations[i][rank] indexes ``nodes``: where rank's shard of keys[i] lives.
    locations: tuple[tuple[int, ...], ...]
    root: int = 0  # a failed load asks this root's Evictor shard for other copies

    @classmethod
    def build(
        cls,
        namespace: Namespace,
        keys: list[ChunkKey],
        where: list[dict[int, NodeId]],
        root: int = 0,
    ) -> LoadSpec:
        nodes: dict[NodeId, int] = {}
        locations = []
        for ranks in where:
            locations.append(
                tuple(nodes.setdefault(ranks[r], len(nodes)) for r in range(len(ranks)))
            )
        return cls(namespace, tuple(keys), tuple(nodes), tuple(locations), root)

    def keys_by_node(self, rank: int) -> dict[NodeId, list[int]]:
        """Indices of this rank's shards, grouped by the node that holds them."""
        grouped: dict[NodeId, list[int]] = {}
        for i, per_rank in enumerate(self.locations):
            grouped.setdefault(self.nodes[per_rank[rank]], []).append(i)
        return grouped
