"""The state every part of :class:`~tierstore.control.index.ChunkIndex` shares.

The index is one data structure with invariants that span its parts (a copy gained or
lost moves the byte accounts, the tree's CPU counters and the candidate heaps in the
same step), so its parts are mixins over this one state rather than objects that would
each hold a slice of it and call back into the others. This class owns the state and the
few primitives every part uses; see :mod:`tierstore.control.index` for the layout.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from itertools import count
from typing import TYPE_CHECKING

from tierstore.control.index_model import (
    Chunk,
    ChunkId,
    IndexStats,
    RemoteLoads,
    Shard,
    TierAccount,
    Unit,
    UnitId,
    Watermarks,
)
from tierstore.control.policies import POLICIES
from tierstore.keys import ChunkKey, Namespace, NodeId, TierName

if TYPE_CHECKING:  # the heaps' module builds on this one
    from collections.abc import Callable

    from tierstore.control.index_candidates import CandidateQueue
    from tierstore.control.index_model import Actions


class IndexState:
    """Single-threaded: the Evictor actor serialises every call (see ChunkIndex)."""

    def __init__(
        self,
        policy: str = "lru",
        watermarks: Watermarks | None = None,
        replicate_after_loads: int = 0,
    ) -> None:
        self._policy = POLICIES.get(policy)()
        self._watermarks = watermarks or Watermarks()
        self._replicate_after = replicate_after_loads
        self._replicas_on: dict[NodeId, OrderedDict[ChunkId, None]] = defaultdict(OrderedDict)
        self._remote_loads = RemoteLoads(replicate_after_loads)
        self._chunks: dict[ChunkId, Chunk] = {}
        self._units: dict[UnitId, Unit] = {}
        self._orphans: dict[UnitId, set[UnitId]] = defaultdict(set)  # absent parent -> children
        self._nodes: dict[NodeId, dict[TierName, TierAccount]] = {}
        self._node_units: dict[NodeId, set[UnitId]] = defaultdict(set)  # units with a shard there
        self._leases: dict[ChunkId, dict[str, float]] = defaultdict(dict)  # holder -> expiry
        self._queues: dict[tuple[NodeId, TierName, int], CandidateQueue] = {}
        self._parked: set[UnitId] = set()  # leased or promoting when last met as a candidate
        self._wakeups: list[tuple[float, int, UnitId]] = []  # (lease end, tie, parked unit)
        self._tie = count()
        self._dying: set[UnitId] = set()  # units forget_node is dropping right now
        self.stats = IndexStats()

    if TYPE_CHECKING:
        # What each part calls of another, declared once here for the type checker (each
        # is defined in the part named; ChunkIndex mixes them all in).
        def _push(self, uid: UnitId, node: NodeId, tier: TierName) -> None: ...  # candidates
        def _queue_tier(self, uid: UnitId, unit: Unit, tier: TierName) -> None: ...
        def _queue_everywhere(self, uid: UnitId) -> None: ...
        def _walk(
            self,
            node: NodeId,
            tier: TierName,
            protected: set[UnitId],
            now: float,
            done: Callable[[], bool],
            free_one: Callable[[UnitId], bool],
        ) -> bool: ...
        def _is_leased(self, cid: ChunkId, now: float) -> bool: ...  # leases
        def _pinned(self, uid: UnitId, unit: Unit, now: float) -> bool: ...
        def _park(self, uid: UnitId, unit: Unit) -> None: ...
        def _wake(self, now: float) -> None: ...
        def _gain(  # tree
            self, uid: UnitId, unit: Unit, shard: Shard, tier: TierName, queue: bool = True
        ) -> None: ...
        def _lose(self, uid: UnitId, unit: Unit, shard: Shard, tier: TierName) -> None: ...
        def _drop_unit(self, uid: UnitId, actions: Actions) -> None: ...
        def _drop_replica(  # replicas
            self, cid: ChunkId, chunk: Chunk, node: NodeId, actions: Actions
        ) -> None: ...
        def _evict_replicas(
            self, node: NodeId, done: Callable[[], bool], now: float, actions: Actions
        ) -> bool: ...

    def _shard(self, namespace: Namespace, key: ChunkKey, rank: int) -> Shard | None:
        chunk = self._chunks.get(ChunkId(namespace, key))
        if chunk is None or not 0 <= rank < len(chunk.shards):
            return None
        return chunk.shards[rank]

    def _account(self, node: NodeId, tier: TierName, nbytes: int, sign: int) -> None:
        account = self._nodes.get(node, {}).get(tier)
        if account is not None:
            account.used_bytes += sign * nbytes
            account.shards += sign

    def _fits(self, node: NodeId, tier: TierName, nbytes: int) -> bool:
        account = self._nodes[node][tier]
        return account.used_bytes + nbytes <= account.capacity_bytes
