"""The compact index makes ChunkIndex's decisions: a differential property test.

``ChunkIndex`` is the reference model. Under random sequences of stores, shard by shard
and by unit (room, demotions, drops, write-through, watermarks, a store's last-resort
demotion), lookups (leases,
promotions, PENDING restored copies), releases, promotions reported done, failed or
refused, corruption, disk write failures, restores, lost nodes and replicas of hot
chunks (loads recorded with ``replicate_after_loads`` 0, 1 and 2, replica shards landed
or failed, lookups served by a replica, ``locate``, a lost holder's chunk adopted by its
replica), both indexes must return the same answers and actions (each node's lists in
the same order) and end every step in the same state: stats, byte accounts, the unit
tree, every node's copies and complete replicas.

The covered subset is what the compact index ports: the LRU policy. The one order
allowed to differ is ``forget_node``'s drops, which the reference takes from a set:
those are compared as multisets.
"""

from __future__ import annotations

import inspect
import os
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from tierstore.control import compact_index
from tierstore.control.compact_index import CompactChunkIndex, make_index
from tierstore.control.index import ChunkIndex, LookupState, NodeActions, ShardOffer, Watermarks
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.wire import units_of

pytestmark = pytest.mark.skipif(
    not compact_index.available(), reason="the compact index's C extension is not built"
)

NAMESPACES = [Namespace("4ef"), Namespace("b0b")]
NODES = [NodeId("n0"), NodeId("n1"), NodeId("n2")]
CHAIN = 4  # boundary b's parent is b - 1 unless b starts a chain
WIDE = 100  # boundaries from here on are chunks of two ranks, on two nodes
CPU_BYTES = 200


def cpu_bytes(node: NodeId) -> int:
    """n2's CPU tier is larger: room for replicas below its low watermark."""
    return 3 * CPU_BYTES if node == NODES[2] else CPU_BYTES


def key(boundary: int, group: int, length: int) -> ChunkKey:
    """``length`` bytes: short test keys, vLLM's 36, and keys past the inline 40."""
    return ChunkKey(boundary.to_bytes(length - 4, "big") + group.to_bytes(4, "big"))


class Workload:
    def __init__(self, groups: int, key_len: int) -> None:
        self.groups, self.key_len = groups, key_len

    def offers(self, ns: Namespace, boundary: int, nbytes: int, rank: int) -> list[ShardOffer]:
        """A request's store: every chunk of its chain up to ``boundary``."""
        world = 2 if boundary >= WIDE else 1
        offers = []
        for b in range(boundary - boundary % CHAIN, boundary + 1):
            for g in range(self.groups):
                parent = key(b - 1, g, self.key_len) if b % CHAIN else None
                offers.append(ShardOffer(ns, key(b, g, self.key_len), rank, world, nbytes, parent))
        return offers

    def keys(self, boundary: int) -> list[ChunkKey]:
        return [o.key for o in self.offers(NAMESPACES[0], boundary, 1, 0)]


def _multiset(actions: dict[NodeId, NodeActions]) -> dict[NodeId, Counter[tuple[str, ShardId]]]:
    return {
        node: Counter(
            [("drop", s) for s in a.drop]
            + [("demote", s) for s in a.demote]
            + [("promote", s) for s in a.promote]
            + [("persist", s) for s in a.persist]
            + [("push", s) for s in a.push]
        )
        for node, a in actions.items()
    }


class Pair:
    """Runs every call on both indexes and checks that they agree."""

    def __init__(self, disk_bytes: int, marks: Watermarks, replicate: int = 0) -> None:
        self.compact = CompactChunkIndex("lru", marks, replicate)
        self.ref = ChunkIndex("lru", marks, replicate)
        for node in NODES:
            self.call("register_node", node, cpu_bytes(node), disk_bytes)

    def call(self, method: str, *args: object) -> object:
        want = getattr(self.ref, method)(*args)
        got = getattr(self.compact, method)(*args)
        if method == "forget_node":
            assert _multiset(got) == _multiset(want), (method, args)  # type: ignore[arg-type]
        else:
            assert got == want, (method, args)
        return got

    def same_state(self, probe: list[tuple[Namespace, ChunkKey]]) -> None:
        assert self.compact.stats == self.ref.stats
        assert self.compact.nodes() == self.ref.nodes()
        assert self.compact.units() == self.ref.units()
        assert len(self.compact) == len(self.ref)
        for node in NODES:
            assert self.compact.shards_on(node) == self.ref.shards_on(node)
            assert self.compact.replicas_on(node) == self.ref.replicas_on(node)
        for cid in probe:
            assert (cid in self.compact) == (cid in self.ref)


def play(pair: Pair, load: Workload, ops: list[tuple[str, int, int, int]], disk_bytes: int) -> None:
    """Run ``ops`` on both indexes, checking answers, actions and state at each step."""
    now = 0.0
    promoting: dict[NodeId, list[ShardId]] = {n: [] for n in NODES}
    pushed: dict[NodeId, list[tuple[ShardId, NodeId]]] = {n: [] for n in NODES}  # (shard, from)
    last_hits: tuple[Namespace, list[ChunkKey]] = (NAMESPACES[0], [])
    probe: list[tuple[Namespace, ChunkKey]] = []
    for op, a, b, c in ops:
        ns = NAMESPACES[b // 3 % 2] if op not in ("release_holder", "forget_node") else None
        keys = load.keys(a) if op not in ("tick", "promoted") else []
        holder = f"h{b % 3}"
        if op == "store":
            wide = [(0, NODES[b % 3]), (1, NODES[(b + 1) % 3])]
            for rank, node in wide if a >= WIDE else [(0, NODES[b % 3])]:
                if node in pair.ref.nodes():
                    pair.call("admit", node, load.offers(ns, a, c, rank), now)
        elif op == "store_units":  # a TP group's NodeStore: every rank of a boundary at once
            ranks = (0, 1) if a >= WIDE else (0,)
            offers = [o for rank in ranks for o in load.offers(ns, a, c, rank)]
            if NODES[b % 3] in pair.ref.nodes():
                pair.call("admit_units", NODES[b % 3], units_of(offers), now)
        elif op == "lookup":  # b >= 3: an engine on node b%3 asks (a replica there serves)
            asking = NODES[b % 3] if b >= 3 else None
            answers, actions = pair.call("lookup", ns, keys, holder, now, float(c), asking)  # type: ignore[misc]
            hit = [k for k, ans in zip(keys, answers, strict=True) if ans.state is LookupState.HIT]
            last_hits = (ns, hit) if hit else last_hits
            for node, node_actions in actions.items():
                promoting[node] += [s for s in node_actions.promote if s not in promoting[node]]
        elif op == "loads":  # node b%3 loaded the last lookup's HITs
            actions = pair.call("record_loads", *last_hits, NODES[b % 3])
            for source, node_actions in actions.items():  # type: ignore[attr-defined]
                for shard_id, target in node_actions.push:
                    pushed[target].append((shard_id, source))
        elif op == "replicated":  # every node's pushes: all landed (a=0), failed (1), or half
            for node in NODES:
                arrived, pushed[node] = pushed[node], []
                cut = {0: len(arrived), 1: 0, 2: len(arrived) // 2}[a]
                shards = [shard_id for shard_id, _ in arrived]
                pair.call("replicated", node, shards[:cut], shards[cut:])
                for shard_id, source in arrived[:cut]:  # a load from the holder failed
                    pair.call("locate", shard_id.namespace, [shard_id.key], shard_id.rank, source)
                if arrived[:cut] and b >= 3:  # an engine on the replica's node asks
                    sid = arrived[0][0]
                    pair.call("lookup", sid.namespace, [sid.key], "reader", now, 5.0, node)
        elif op == "release":
            pair.call("release", ns, keys, holder)
        elif op == "release_holder":
            pair.call("release_holder", holder)
        elif op == "extend":
            pair.call("extend_leases", ns, keys, holder, now, float(c))
        elif op == "promoted":
            node = NODES[b % 3]
            outcomes: list[list[ShardId]] = [[], [], []]
            outcomes[a], promoting[node] = promoting[node], []
            pair.call("promoted", node, *outcomes)
        elif op == "corrupt":
            method = "forget_shards" if c == 0 else "report_corrupt_after_hit"
            pair.call(method, [ShardId(ns, k, 0) for k in keys])
        elif op == "forget_node":
            before = pair.ref.stats.replicated_chunks and len(pair.ref)
            pair.call("forget_node", NODES[b % 3])
            replicas_left = any(pair.ref.replicas_on(n) for n in NODES)
            if before and replicas_left and currently_in_test_context():
                event("forget_node beside replicas")
            pair.call("register_node", NODES[b % 3], cpu_bytes(NODES[b % 3]), disk_bytes)
            promoting[NODES[b % 3]] = []
            pushed[NODES[b % 3]] = []
        elif op == "restore":
            tier = TierName.DISK if disk_bytes and c % 2 else TierName.CPU
            held = [(o, tier) for o in load.offers(ns, a, c, 0)]
            pair.call("restore", NODES[b % 3], held, now, 5.0 if c % 3 else 0.0)
        elif op == "disk_writes":
            unwritten = [ShardId(ns, k, 0) for k in keys]
            pair.call("disk_writes", NODES[b % 3], unwritten, len(unwritten), bool(c))
        elif op == "probe":
            for k in keys:
                pair.call("is_leased", ns, k, now)
            pair.call("locate", ns, keys, c, NODES[b % 3])
            probe += [(ns, k) for k in keys]
        else:
            now += a
        pair.same_state(probe)


boundaries = st.one_of(st.integers(0, 15), st.integers(WIDE, WIDE + 7))
store = st.tuples(
    st.sampled_from(["store", "store_units"]), boundaries, st.integers(0, 5), st.integers(5, 40)
)
lookup = st.tuples(st.just("lookup"), boundaries, st.integers(0, 5), st.sampled_from([5, 100]))
promoted = st.tuples(st.just("promoted"), st.integers(0, 2), st.integers(0, 2), st.just(0))
loads = st.tuples(st.just("loads"), boundaries, st.integers(0, 5), st.just(0))
replicated = st.tuples(st.just("replicated"), st.integers(0, 2), st.integers(0, 2), st.just(0))
ops = st.lists(
    st.one_of(
        store,  # stores weigh four times the rest: the point is pressure
        store,
        store,
        store,
        lookup,  # and lookups twice, with the promotions they start reported
        lookup,
        st.tuples(st.just("release"), boundaries, st.integers(0, 5), st.just(0)),
        st.tuples(st.just("release_holder"), st.just(0), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("extend"), boundaries, st.integers(0, 5), st.integers(1, 30)),
        # a: every promotion under way on node b is done (0), failed (1) or refused (2)
        promoted,
        promoted,
        loads,  # replicas: loads recorded, and the pushes they start reported
        loads,
        loads,
        replicated,
        replicated,
        # before a hit (forget_shards, c=0) or after (report_corrupt_after_hit, c=1)
        st.tuples(st.just("corrupt"), boundaries, st.integers(0, 5), st.integers(0, 1)),
        st.tuples(st.just("forget_node"), st.just(0), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("restore"), boundaries, st.integers(0, 5), st.integers(10, 90)),
        # the disk writes of chain a on node b%3 failed; the disk is writable unless c=0
        st.tuples(st.just("disk_writes"), boundaries, st.integers(0, 5), st.integers(0, 3)),
        st.tuples(st.just("probe"), boundaries, st.integers(0, 5), st.integers(0, 1)),
        st.tuples(st.just("tick"), st.integers(1, 20), st.just(0), st.just(0)),
    ),
    min_size=30,
    max_size=150,
)


@settings(
    max_examples=int(os.environ.get("TIERSTORE_HYPOTHESIS_EXAMPLES", "80")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    ops=ops,
    groups=st.integers(1, 2),
    key_len=st.sampled_from([12, 36, 68]),
    disk_bytes=st.sampled_from([0, 300, 1000]),
    marks=st.sampled_from([Watermarks(0.9, 0.7), Watermarks()]),
    replicate=st.sampled_from([0, 1, 2]),
)
def test_compact_index_decides_as_the_reference(  # type: ignore[no-untyped-def]
    ops, groups, key_len, disk_bytes, marks, replicate
) -> None:
    pair = Pair(disk_bytes, marks, replicate)
    play(pair, Workload(groups, key_len), ops, disk_bytes)
    for name, n in vars(pair.ref.stats).items():  # what the workload reached
        if n:
            event(name)


OP_WEIGHTS = {  # a long random workload: pressure, hits on disk, promotions reported
    "store": 5,
    "store_units": 3,
    "lookup": 6,
    "promoted": 3,
    "release": 2,
    "extend": 1,
    "release_holder": 1,
    "corrupt": 1,
    "forget_node": 0.2,
    "restore": 1,
    "disk_writes": 0.5,
    "probe": 1,
    "tick": 2,
    "loads": 3,
    "replicated": 2,
}


@pytest.mark.parametrize("seed", range(12))
def test_long_random_workloads_decide_as_the_reference(seed: int) -> None:
    """Thousands of steps, deeper than hypothesis's examples reach: long-lived leases,
    parked units, promotions reported late, nodes lost and back."""
    rng = random.Random(seed)
    disk_bytes = [0, 300, 1000][seed % 3]
    pair = Pair(disk_bytes, [Watermarks(0.9, 0.7), Watermarks()][seed % 2], seed % 3)
    names = list(OP_WEIGHTS)
    ops = []
    for _ in range(2_000):
        op = rng.choices(names, [OP_WEIGHTS[n] for n in names])[0]
        a = rng.choice([rng.randrange(16), WIDE + rng.randrange(8)])
        if op in ("promoted", "replicated", "tick"):
            a = rng.randrange(1, 20) if op == "tick" else rng.randrange(3)
        c = rng.randrange(4) if op in ("corrupt", "disk_writes", "probe") else rng.randrange(5, 45)
        ops.append((op, a, rng.randrange(6), c))
    play(pair, Workload(1 + seed % 2, [12, 36, 68][seed % 3]), ops, disk_bytes)
    assert pair.ref.stats.hits and pair.ref.stats.evicted_chunks
    assert pair.ref.stats.replicated_chunks or not seed % 3  # replicas made and used


def test_long_prompt_chains_evict_the_same_tails_at_depth() -> None:
    """Ten thousand units in chains of eight under a full CPU tier and a small disk:
    every store's demotions and drops match the reference's, in order."""
    pair = Pair(disk_bytes=6_000, marks=Watermarks())
    load = Workload(groups=1, key_len=36)
    ns = NAMESPACES[0]
    for node in NODES:
        pair.call("register_node", node, 4_000, 6_000)
    for b in range(0, 10_000, 8):
        offers = [
            ShardOffer(ns, key(i, 0, 36), 0, 1, 10, key(i - 1, 0, 36) if i % 8 else None)
            for i in range(b, b + 8)
        ]
        pair.call("admit", NODES[0], offers, float(b))
        if b % 64 == 0:
            pair.call("lookup", ns, load.keys(b // 2), "h", float(b), 1.0)
    pair.same_state([])
    assert pair.ref.stats.evicted_chunks > 0 and pair.ref.stats.demoted_shards > 0


def test_holders_of_finished_requests_are_forgotten() -> None:
    """A holder is one request: its id goes with its last lease (released, or expired and
    seen), so a long-running index does not grow with the requests it has served, and a
    reused id leases as the reference does."""
    pair = Pair(disk_bytes=300, marks=Watermarks())
    load = Workload(groups=1, key_len=36)
    ns = NAMESPACES[0]
    for b in range(0, 16, 4):
        pair.call("admit", NODES[0], load.offers(ns, b + 3, 5, 0), 0.0)
    for request in range(2_000):
        keys = load.keys(request % 16)
        pair.call("lookup", ns, keys, f"engine/{request}", float(request), 5.0)
        if request % 3:
            pair.call("release", ns, keys, f"engine/{request}")
        pair.call("is_leased", ns, keys[0], float(request))
    pair.call("release_holder", "engine/1999")
    pair.same_state([])
    assert pair.compact.holders() <= 16  # at most one per chunk still leased


def test_unsupported_settings_fall_back_to_the_reference() -> None:
    assert isinstance(make_index(), CompactChunkIndex)
    assert type(make_index("arc")) is ChunkIndex
    assert isinstance(make_index(replicate_after_loads=2), CompactChunkIndex)
    with pytest.raises(ValueError, match="lru"):
        CompactChunkIndex("arc")


def test_compact_index_has_chunk_index_public_api() -> None:
    """Every public method of ChunkIndex, with the same parameters, so the Evictor can
    hold either."""

    def public(cls: type) -> dict[str, list[str]]:
        return {
            name: list(inspect.signature(getattr(cls, name)).parameters)
            for name in dir(cls)
            if (not name.startswith("_") or name in ("__len__", "__contains__"))
            and callable(getattr(cls, name))
        }

    reference = public(ChunkIndex)
    compact = public(CompactChunkIndex)
    assert {n: reference[n] for n in reference} == {n: compact.get(n) for n in reference}
    assert hasattr(CompactChunkIndex(), "stats")


def test_a_lost_holders_chunks_live_on_in_their_first_complete_replica() -> None:
    """A chunk replicated on two nodes outlives its holder: the first replica made is
    adopted (held, written through), the other stays a replica, and lookups still HIT."""
    pair = Pair(disk_bytes=1000, marks=Watermarks(), replicate=1)
    load = Workload(groups=1, key_len=36)
    ns = NAMESPACES[0]
    pair.call("admit", NODES[0], load.offers(ns, 1, 10, 0), 0.0)
    keys = load.keys(1)
    for reader in (NODES[2], NODES[1]):  # n2's replica is made first
        actions = pair.call("record_loads", ns, keys, reader)
        pushed = [sid for sid, _ in actions[NODES[0]].push]  # type: ignore[index]
        assert len(pushed) == len(keys)
        pair.call("replicated", reader, pushed, [])
    pair.call("forget_node", NODES[0])
    pair.same_state([(ns, k) for k in keys])
    answers, _ = pair.call("lookup", ns, keys, "h", 1.0, 5.0)  # type: ignore[misc]
    assert [a.where for a in answers] == [{0: NODES[2]}] * len(keys)
    assert pair.ref.replicas_on(NODES[1]) == {(ns, k) for k in keys}


def test_a_lost_node_drops_the_units_without_replica_and_rescues_the_others() -> None:
    """A lost node's chain, two of its four units replicated elsewhere: the compact index
    sorts only the replicated units, and ends in the reference's state (those two adopted
    and written through, the others dropped everywhere, their children's edges gone)."""
    pair = Pair(disk_bytes=1000, marks=Watermarks(), replicate=1)
    load = Workload(groups=2, key_len=36)
    ns = NAMESPACES[0]
    pair.call("admit", NODES[0], load.offers(ns, 3, 10, 0), 0.0)  # boundaries 0-3, one chain
    pair.call("admit", NODES[1], load.offers(ns, 7, 10, 0), 0.0)  # 4-7 on another node
    keys = load.keys(3)
    rescued = [k for k in keys if int.from_bytes(k[:-4], "big") in (1, 3)]
    actions = pair.call("record_loads", ns, rescued, NODES[2])
    pushed = [sid for sid, _ in actions[NODES[0]].push]  # type: ignore[index]
    assert len(pushed) == len(rescued)
    pair.call("replicated", NODES[2], pushed, [])
    pair.call("forget_node", NODES[0])
    pair.same_state([(ns, k) for k in keys + load.keys(7)])
    assert len(pair.compact) == len(rescued) + len(load.keys(7))
    answers, _ = pair.call("lookup", ns, keys, "h", 1.0, 5.0)  # type: ignore[misc]
    hits = [k for k, a in zip(keys, answers, strict=True) if a.state is LookupState.HIT]  # type: ignore[attr-defined]
    assert hits == rescued


def test_a_world_past_the_limit_is_refused_not_allocated() -> None:
    """A chunk of more than 2**24 - 1 ranks is refused as an invalid offer (the compact
    index's one limit the reference lacks): nothing is held, no shard run is made."""
    index = CompactChunkIndex("lru")
    index.register_node(NODES[0], CPU_BYTES, 0)
    offers = [ShardOffer(NAMESPACES[0], key(1, 0, 12), 0, 1 << 24, 1)]
    result = index.admit(NODES[0], offers, 0.0)
    assert result.accepted == [False]
    assert len(index) == 0
    assert index.memory_bytes() < 1 << 20
