"""The index's candidate heaps make the same decisions as the plain definition of them.

``ReferenceIndex`` picks each victim the slow, obviously right way: walk the policy's
whole order and take the first unit whose copies may go now, judged from scratch (its
shards, its children's shards, its leases). ``ChunkIndex`` answers the same question
from per-(node, tier) heaps, counters and parked units. Under any sequence of stores,
lookups, promotions, leases, corruption and lost nodes, both must return the same
decisions and end in the same state.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.control.index import ChunkIndex, ShardOffer, UnitId, Watermarks
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName

NS = Namespace("4ef")
NODES = [NodeId("n0"), NodeId("n1"), NodeId("n2")]
CHAIN = 4  # boundary b's parent is b - 1 unless b starts a chain
WIDE = 100  # boundaries from here on are chunks of two ranks, on two nodes
CPU_BYTES = 200


class ReferenceIndex(ChunkIndex):
    """Finds candidates by walking every unit in policy order (the old O(units) walk)."""

    def _next_candidate(self, node, tier, protected, now, aside):  # type: ignore[no-untyped-def]
        for uid in self._policy.candidates():
            if uid not in self._units or uid in aside or uid in protected:
                continue
            if self._may_go(uid, node, tier) and not self._pinned(uid, self._units[uid], now):
                return uid
        return None

    def _may_go(self, uid: UnitId, node: NodeId, tier: TierName) -> bool:
        unit = self._units[uid]
        children = unit.children or set()
        if tier is TierName.CPU and any(self._has_cpu(c) for c in children):
            return False
        if tier is TierName.DISK and (children or self._has_cpu(uid)):
            return False
        return any(s.node == node and s.has(tier) for _, _, s in unit.shards())

    def _has_cpu(self, uid: UnitId) -> bool:
        return any(s.cpu for _, _, s in self._units[uid].shards())


def key(boundary: int, group: int) -> ChunkKey:
    return ChunkKey(boundary.to_bytes(8, "big") + group.to_bytes(4, "big"))


def offers_for(boundary: int, groups: int, nbytes: int, rank: int) -> list[ShardOffer]:
    """A request's store: every chunk of its chain up to ``boundary``, as vLLM offers them."""
    world = 2 if boundary >= WIDE else 1
    offers = []
    for b in range(boundary - boundary % CHAIN, boundary + 1):
        for g in range(groups):
            parent = key(b - 1, g) if b % CHAIN else None
            offers.append(ShardOffer(NS, key(b, g), rank, world, nbytes, parent))
    return offers


boundaries = st.one_of(st.integers(0, 15), st.integers(WIDE, WIDE + 7))
store = st.tuples(st.just("store"), boundaries, st.integers(0, 2), st.integers(10, 60))
ops = st.lists(
    st.one_of(
        store,  # stores weigh four times the rest: the point is pressure
        store,
        store,
        store,
        st.tuples(st.just("lookup"), boundaries, st.integers(0, 2), st.sampled_from([5, 100])),
        st.tuples(st.just("release"), boundaries, st.integers(0, 2), st.just(0)),
        st.tuples(st.just("release_holder"), st.just(0), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("extend"), boundaries, st.integers(0, 2), st.integers(1, 30)),
        # a: every promotion under way on node b is done (0), failed (1) or refused (2)
        st.tuples(st.just("promoted"), st.integers(0, 2), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("corrupt"), boundaries, st.just(0), st.just(0)),
        st.tuples(st.just("forget_node"), st.just(0), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("restore"), boundaries, st.integers(0, 2), st.integers(10, 90)),
        st.tuples(st.just("tick"), st.integers(1, 20), st.just(0), st.just(0)),
    ),
    min_size=30,
    max_size=100,
)


CHAIN_OPS = ("lookup", "release", "extend", "corrupt", "restore")


class Pair:
    """Runs every call on both indexes and checks that they agree."""

    def __init__(self, policy: str, groups: int, disk_bytes: int) -> None:
        self.fast = ChunkIndex(policy, Watermarks(0.9, 0.7))
        self.ref = ReferenceIndex(policy, Watermarks(0.9, 0.7))
        self.disk_bytes = disk_bytes
        self.groups = groups
        for node in NODES:
            self.call("register_node", node, CPU_BYTES, disk_bytes)

    def call(self, method: str, *args: object) -> object:
        got = getattr(self.fast, method)(*args)
        want = getattr(self.ref, method)(*args)
        assert got == want, (method, args)
        return got

    def same_state(self) -> None:
        assert self.fast.stats == self.ref.stats
        assert self.fast.nodes() == self.ref.nodes()
        assert self.fast.units() == self.ref.units()
        for node in NODES:
            assert self.fast.shards_on(node) == self.ref.shards_on(node)


@settings(
    max_examples=int(os.environ.get("TIERSTORE_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    ops=ops,
    policy=st.sampled_from(["lru", "arc"]),
    groups=st.integers(1, 2),
    disk_bytes=st.sampled_from([0, 300]),
)
def test_heaps_choose_what_a_full_walk_chooses(ops, policy, groups, disk_bytes) -> None:  # type: ignore[no-untyped-def]
    pair = Pair(policy, groups, disk_bytes)
    now = 0.0
    promoting: dict[NodeId, list[ShardId]] = {n: [] for n in NODES}
    for op, a, b, c in ops:
        keys = (
            [o.key for o in offers_for(a, groups, 0, 0)] if op not in ("tick", "promoted") else []
        )
        if op == "store":
            ranks = [(0, NODES[b]), (1, NODES[(b + 1) % 3])] if a >= WIDE else [(0, NODES[b])]
            for rank, node in ranks:
                if node in pair.fast.nodes():
                    pair.call("admit", node, offers_for(a, groups, c, rank), now)
        elif op == "lookup":
            _, actions = pair.call("lookup", NS, keys, f"h{b}", now, float(c))
            for node, node_actions in actions.items():  # type: ignore[attr-defined]
                promoting[node] += node_actions.promote
        elif op == "release":
            pair.call("release", NS, keys, f"h{b}")
        elif op == "release_holder":
            pair.call("release_holder", f"h{b}")
        elif op == "extend":
            pair.call("extend_leases", NS, keys, f"h{b}", now, float(c))
        elif op == "promoted":
            node = NODES[b]
            outcomes: list[list[ShardId]] = [[], [], []]
            outcomes[a], promoting[node] = promoting[node], []
            pair.call("promoted", node, *outcomes)
        elif op == "corrupt":
            pair.call("forget_shards", [ShardId(NS, k, 0) for k in keys])
        elif op == "forget_node":
            pair.call("forget_node", NODES[b])
            pair.call("register_node", NODES[b], CPU_BYTES, disk_bytes)
            promoting[NODES[b]] = []
        elif op == "restore":
            tier = TierName.DISK if disk_bytes and c % 2 else TierName.CPU
            held = [(o, tier) for o in offers_for(a, groups, c, 0)]
            pair.call("restore", NODES[b], held, now, 5.0)
        else:
            now += a
        pair.same_state()


def test_a_deep_index_evicts_the_oldest_chains_tails_first() -> None:
    """Ten thousand units in chains of eight: each store evicts the least recently used
    chain, tail first, whatever the size of the index."""
    index = ChunkIndex()
    index.register_node(NODES[0], 10_000 * 10)
    for b in range(10_000):
        parent = key(b - 1, 0) if b % 8 else None
        index.admit(NODES[0], [ShardOffer(NS, key(b, 0), 0, 1, 10, parent)], now=0)
    index.lookup(NS, [key(b, 0) for b in range(8)], "h", 0, 1)  # chain 0 is reused
    index.release(NS, [key(b, 0) for b in range(8)], "h")
    dropped = []
    for b in range(20_000, 20_016):
        dropped += (
            index.admit(NODES[0], [ShardOffer(NS, key(b, 0), 0, 1, 10)], 0).actions[NODES[0]].drop
        )
    assert dropped == [ShardId(NS, key(b, 0), 0) for b in [*range(15, 7, -1), *range(23, 15, -1)]]
