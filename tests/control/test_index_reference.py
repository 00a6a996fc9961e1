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

from tierstore.control.index import (
    ChunkIndex,
    LookupState,
    ShardOffer,
    UnitId,
    UnitOffer,
    Watermarks,
)
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.wire import per_shard, units_of

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


# Room for any one store (4 boundaries x 3 groups x 2 ranks x 60 bytes) and not many
# more: stores evict other requests' units, never need to demote their own (where one
# by one, a unit half in the tree blocks its parent's demotion, and the two would pick
# different, equally valid, victims).
BATCH_CPU_BYTES = 1500


class UnitPair(Pair):
    """``units`` takes each store as unit offers (one decision per token boundary:
    every rank and group together), ``shards`` the same offers shard by shard."""

    def __init__(self, policy: str, groups: int, disk_bytes: int) -> None:
        super().__init__(policy, groups, disk_bytes)
        self.fast = ChunkIndex(policy, Watermarks(0.9, 0.7))  # admit_units
        self.ref = ChunkIndex(policy, Watermarks(0.9, 0.7))  # admit, shard by shard
        for node in NODES:
            self.call("register_node", node, BATCH_CPU_BYTES, disk_bytes)

    def admit(self, node: NodeId, offers: list[ShardOffer], now: float) -> bool:
        """Both admit ``offers``; False once shard by shard kept part of a unit (room
        for some of its shards only): the unit is kept or refused whole instead (room
        made for all of it at once, before any of it is in the tree; a boundary missing
        a group or rank is never a HIT), and the two part ways."""
        units = units_of(offers)
        decisions = self.fast.stats.admitted_units
        got = self.fast.admit_units(node, units, now)
        assert self.fast.stats.admitted_units - decisions == len(units)  # one per unit
        offers = [o for unit in units for o in unit.shards]  # shard by shard, same order
        want = self.ref.admit(node, offers, now)
        flag = {(o.key, o.rank): ok for o, ok in zip(offers, want.accepted, strict=True)}
        split = False
        for unit, answer in zip(units, got.accepted, strict=True):
            ref = [flag[(o.key, o.rank)] for o in unit.shards]
            if ref != answer:  # only where shard by shard kept part of the unit...
                assert any(ref) and not all(ref), (answer, ref)
                # ...and the unit keeps all of those shards or none
                assert len({a for a, r in zip(answer, ref, strict=True) if r}) == 1
                split = True
        if split:
            return False
        assert per_shard(offers, units, got.accepted) == want.accepted
        assert got.actions == want.actions
        return True

    def same_state(self) -> None:
        units, shards = vars(self.fast.stats), vars(self.ref.stats)
        assert units["admitted_units"] <= shards["admitted_units"]
        assert {**units, "admitted_units": 0} == {**shards, "admitted_units": 0}
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
    ops=st.lists(
        st.one_of(
            store,
            store,
            st.tuples(st.just("lookup"), boundaries, st.integers(0, 2), st.sampled_from([5, 100])),
            st.tuples(st.just("release"), boundaries, st.integers(0, 2), st.just(0)),
            st.tuples(st.just("corrupt"), boundaries, st.just(0), st.just(0)),
            st.tuples(st.just("tick"), st.integers(1, 20), st.just(0), st.just(0)),
        ),
        min_size=10,
        max_size=60,
    ),
    policy=st.sampled_from(["lru", "arc"]),
    groups=st.integers(1, 3),
    disk_bytes=st.sampled_from([0, 2000, 6000]),
    together=st.booleans(),
)
def test_a_units_ranks_and_groups_admitted_together_decide_as_shard_by_shard(  # type: ignore[no-untyped-def]
    ops, policy, groups, disk_bytes, together
) -> None:
    """A store's shards at one boundary (its KV cache groups; with ``together`` both TP
    ranks of a wide chunk, on one node, in one call) are one admission decision, and the
    answers, evictions, actions and state are those of admitting them one by one."""
    pair = UnitPair(policy, groups, disk_bytes)
    now = 0.0
    for op, a, b, c in ops:
        keys = [o.key for o in offers_for(a, groups, 0, 0)]
        if op == "store":
            ranks = [0, 1] if a >= WIDE else [0]
            batches = [ranks] if together else [[r] for r in ranks]
            for batch in batches:
                offers = [o for r in batch for o in offers_for(a, groups, c, r)]
                if not pair.admit(NODES[b], offers, now):
                    return
        elif op == "lookup":
            pair.call("lookup", NS, keys, f"h{b}", now, float(c))
        elif op == "release":
            pair.call("release", NS, keys, f"h{b}")
        elif op == "corrupt":
            pair.call("forget_shards", [ShardId(NS, k, 0) for k in keys])
        else:
            now += a
        pair.same_state()


def test_a_tp_group_at_one_boundary_is_one_decision_and_a_hit_only_when_whole() -> None:
    """Eight ranks of three groups' chunks at one boundary: one admission decision; a
    unit whose last rank comes in a later offer is completed there, a MISS until then."""
    index = ChunkIndex()
    index.register_node(NODES[0], 10_000)
    whole = [ShardOffer(NS, key(1, g), r, 8, 10) for g in range(3) for r in range(8)]
    got = index.admit_units(NODES[0], [UnitOffer(whole)], 0.0)
    assert got.accepted == [[True] * 24] and index.stats.admitted_units == 1
    assert index.stats.stored_chunks == 3
    first = [ShardOffer(NS, key(2, 0), r, 8, 10) for r in range(7)]
    index.admit_units(NODES[0], [UnitOffer(first)], 0.0)
    answers, _ = index.lookup(NS, [key(1, 0), key(2, 0)], "h", 0.0, 5.0)
    assert [a.state for a in answers] == [LookupState.HIT, LookupState.MISS]
    last = [ShardOffer(NS, key(2, 0), 7, 8, 10), first[0]]  # rank 0 again: refused alone
    assert index.admit_units(NODES[0], [UnitOffer(last)], 0.0).accepted == [[True, False]]
    answers, _ = index.lookup(NS, [key(2, 0)], "h", 0.0, 5.0)
    assert answers[0].state is LookupState.HIT and set(answers[0].where or {}) == set(range(8))
