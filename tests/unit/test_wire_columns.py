"""Columnar messages (tierstore.wire): a NodeStore's offers (OfferColumns) and a lookup's
answers (AnswerColumns) come back from a pickle round trip (what Ray does to them)
exactly as they were sent; a malformed item is refused alone, a malformed message
whole with a ValueError, never decoded into wrong offers or answers."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.control.compact_index import CompactChunkIndex, available
from tierstore.control.index import ChunkIndex
from tierstore.fields import MAX_KEY_BYTES, MIN_KEY_BYTES, MalformedField
from tierstore.keys import ChunkKey, Namespace, NodeId, TierName
from tierstore.wire import (
    AnswerColumns,
    LookupAnswer,
    LookupState,
    OfferColumns,
    ShardOffer,
    UnitOffer,
    answer_columns,
    answers_of,
    check_offer,
    offer_columns,
    offers_of,
    unit_offers_of,
    units_of,
)

NS = Namespace("c0lumns")
A, B = NodeId("node-a"), NodeId("node-b")


def key(boundary: int, group: int = 0, hash_bytes: int = 8) -> ChunkKey:
    return ChunkKey(boundary.to_bytes(hash_bytes, "big") + group.to_bytes(4, "big"))


def sent(value: Any) -> Any:
    """What the other process gets: Ray pickles a NamedTuple."""
    return pickle.loads(pickle.dumps(value))


# ---- offers ---------------------------------------------------------------------------------
@st.composite
def offer_lists(draw: st.DrawFn) -> list[ShardOffer]:
    namespaces = draw(
        st.lists(st.from_regex(r"[a-z0-9_.-]{1,12}", fullmatch=True), min_size=1, max_size=3)
    )
    offers = []
    for _ in range(draw(st.integers(0, 40))):
        hash_bytes = draw(st.integers(MIN_KEY_BYTES - 4, MAX_KEY_BYTES - 4))
        boundary = draw(st.integers(0, (1 << (8 * hash_bytes)) - 1))
        world = draw(st.integers(1, 1 << 20))
        k = key(boundary, draw(st.integers(0, (1 << 16) - 1)), hash_bytes)
        parent = draw(st.none() | st.just(key(boundary ^ 1, 0, hash_bytes)))
        offers.append(
            ShardOffer(
                Namespace(draw(st.sampled_from(namespaces))),
                k,
                draw(st.integers(0, world - 1)),
                world,
                draw(st.integers(1, (1 << 62) - 1)),
                parent,
                draw(st.integers(0, (1 << 64) - 1)),
            )
        )
    return offers


@settings(max_examples=200, deadline=None)
@given(offer_lists())
def test_offers_arrive_as_sent(offers: list[ShardOffer]) -> None:
    decoded = offers_of(sent(offer_columns(offers)))
    assert decoded == offers
    assert all(type(o) is ShardOffer for o in decoded)


@st.composite
def rough_offers(draw: st.DrawFn) -> ShardOffer:
    """An offer any of whose fields may be out of range (each still fits its column)."""
    length = draw(st.integers(1, 80))
    rough_key = draw(st.binary(min_size=length, max_size=length))
    parent = draw(st.none() | st.binary(min_size=length, max_size=length))
    return ShardOffer(
        Namespace(draw(st.sampled_from(["0ff3", "a.b-c_9", "", "not one!", "x" * 129]))),
        ChunkKey(rough_key),
        draw(st.integers(0, (1 << 32) - 1)),
        draw(st.integers(0, (1 << 32) - 1)),
        draw(st.integers(-(1 << 63), (1 << 63) - 1)),
        None if parent is None else ChunkKey(parent),
        draw(st.integers(0, (1 << 64) - 1)),
    )


def _reference(offer: ShardOffer) -> ShardOffer | None:
    try:
        return check_offer(offer)
    except MalformedField:
        return None


@settings(max_examples=300, deadline=None)
@given(st.lists(rough_offers(), max_size=8), st.integers(20, 40))
def test_offers_are_checked_as_check_offer_checks_each(
    offers: list[ShardOffer], padding: int
) -> None:
    """Column by column (a large message) and row by row (a small one) alike."""
    expected = [_reference(o) for o in offers]
    assert offers_of(sent(offer_columns(offers))) == expected
    good = ShardOffer(NS, key(1), 0, 1, 1)
    large = offers_of(sent(offer_columns([*offers, *[good] * padding])))
    assert large == [*expected, *[good] * padding]


def test_units_arrive_as_sent_each_of_its_shards() -> None:
    offers = [
        ShardOffer(NS, key(b, g), r, 2, 100, None, 7)
        for b in range(3)
        for g in range(2)
        for r in range(2)
    ]
    units = units_of(offers)
    shards = [o for u in units for o in u.shards]
    assert unit_offers_of(sent(offer_columns(shards, [len(u.shards) for u in units]))) == units


def test_a_malformed_offer_is_refused_alone() -> None:
    offers = [
        ShardOffer(NS, key(1), 0, 1, 256),
        ShardOffer(NS, key(2), 0, 1, -1),  # negative size
        ShardOffer(NS, key(3), 0, 1, 0),  # empty
        ShardOffer(NS, ChunkKey(b"\1" * 8 + (1 << 20).to_bytes(4, "big")), 0, 1, 256),  # group
        ShardOffer(NS, key(5), 3, 2, 256),  # a rank outside its world
        ShardOffer(NS, ChunkKey(b"abc"), 0, 1, 256),  # too short a key
        ShardOffer(Namespace("not a namespace!"), key(7), 0, 1, 256),
        ShardOffer(NS, key(8), 0, 1, 256, ChunkKey(b"\1" * 8 + (1 << 17).to_bytes(4, "big"))),
        ShardOffer(NS, key(9), 0, 1, 256, key(8), (1 << 64) - 1),
    ]
    decoded = offers_of(sent(offer_columns(offers)))
    assert decoded == [offers[0], None, None, None, None, None, None, None, offers[8]]


def _columns(n: int = 4, **changed: Any) -> OfferColumns:
    offers = [ShardOffer(NS, key(i), 0, 1, 256, key(i - 1) if i else None) for i in range(n)]
    return offer_columns(offers)._replace(**changed)


@pytest.mark.parametrize("n", [4, 40])  # checked row by row, and column by column
@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda c: {"ranks": c.ranks[:-4]}, "offers.ranks"),  # one rank short
        (lambda c: {"nbytes": c.nbytes + b"\0"}, "offers.nbytes"),
        (lambda c: {"keys": c.keys[:-1]}, "offers.keys"),  # one byte short of the sum
        (lambda c: {"parents": c.parents + b"\0" * 12}, "offers.parents"),
        (lambda c: {"has_parent": b"\2" + c.has_parent[1:]}, "offers.has_parent"),
        (lambda c: {"roots": "not bytes"}, "offers.roots"),
        (lambda c: {"namespaces": "0ff3"}, "offers.namespaces"),
        (lambda c: {"unit_sizes": (len(c.ranks) // 4).to_bytes(4, "little")}, "unit_sizes"),
    ],
)
def test_a_malformed_message_is_refused_whole(
    n: int, change: Callable[[OfferColumns], dict[str, Any]], field: str
) -> None:
    columns = _columns(n)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        offers_of(sent(columns._replace(**change(columns))))


def test_offers_not_in_columns_are_refused() -> None:
    with pytest.raises(MalformedField, match="not OfferColumns"):
        offers_of([tuple(ShardOffer(NS, key(1), 0, 1, 256))])


def test_a_malformed_unit_is_refused_whole_and_the_others_go_on() -> None:
    good = UnitOffer([ShardOffer(NS, key(1, g), 0, 1, 100) for g in range(2)])
    bad_shard = UnitOffer([ShardOffer(NS, key(2), 0, 1, 100), ShardOffer(NS, key(2, 1), 0, 1, 0)])
    two_boundaries = UnitOffer(
        [ShardOffer(NS, key(3), 0, 1, 100), ShardOffer(NS, key(4), 0, 1, 100)]
    )
    units = [good, bad_shard, two_boundaries, good]
    shards = [o for u in units for o in u.shards]
    decoded = unit_offers_of(sent(offer_columns(shards, [2, 2, 2, 2])))
    assert decoded == [good, None, None, good]
    # A unit of no shard is refused; sizes that do not add up refuse the message.
    assert unit_offers_of(sent(offer_columns(good.shards, [0, 2]))) == [None, good]
    with pytest.raises(ValueError, match=r"units\.unit_sizes"):
        unit_offers_of(sent(offer_columns(good.shards, [1])))


def test_an_offer_no_column_can_carry_is_a_value_error_at_the_sender() -> None:
    with pytest.raises(ValueError, match="parent"):
        offer_columns([ShardOffer(NS, key(1), 0, 1, 100, key(0, 0, 16))])
    with pytest.raises(ValueError, match="range"):
        offer_columns([ShardOffer(NS, key(1), -1, 1, 100)])


# ---- answers --------------------------------------------------------------------------------
nodes = st.sampled_from([A, B, NodeId("c" * 32)])
answer = st.one_of(
    st.just(LookupAnswer(LookupState.MISS)),
    st.just(LookupAnswer(LookupState.PENDING)),
    st.builds(
        LookupAnswer,
        st.just(LookupState.HIT),
        st.dictionaries(st.integers(0, (1 << 32) - 1), nodes, max_size=8),
        st.sampled_from([TierName.CPU, TierName.DISK]),
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(answer, max_size=50))
def test_answers_arrive_as_given(answers: list[LookupAnswer]) -> None:
    decoded = answers_of(sent(answer_columns(answers)))
    assert decoded == answers
    for got in decoded:
        assert type(got) is LookupAnswer and type(got.state) is LookupState
        assert got.tier is None or type(got.tier) is TierName
    hits = answer_columns(answers).count(LookupState.HIT)
    assert hits == sum(a.state is LookupState.HIT for a in answers)


def test_each_answer_has_a_where_of_its_own() -> None:
    answers = answers_of(
        sent(answer_columns([LookupAnswer(LookupState.HIT, {0: A}, TierName.CPU)] * 2))
    )
    assert answers[0].where is not answers[1].where


INDEXES = [ChunkIndex, *([CompactChunkIndex] if available() else [])]


@pytest.mark.parametrize("index_type", INDEXES)
def test_an_index_lookups_answers_arrive_as_the_index_gave_them(index_type: type) -> None:
    """Every state and tier an index answers, ranks on two nodes, a replica's node."""
    index = index_type("lru")
    index.register_node(A, cpu_bytes=600, disk_bytes=10_000)
    index.register_node(B, cpu_bytes=600, disk_bytes=10_000)
    for i in range(10):  # two ranks each, on A and B; the CPU tiers hold 6: 4 demoted
        index.admit(A, [ShardOffer(NS, key(i), 0, 2, 100)], float(i))
        index.admit(B, [ShardOffer(NS, key(i), 1, 2, 100)], float(i))
    index.restore(A, [(ShardOffer(NS, key(20), 0, 1, 100), TierName.DISK)])  # PENDING
    pending, _ = index.lookup(NS, [key(20)], "engine", 30.0, 60.0, A)  # room to promote
    answers, _ = index.lookup(NS, [key(i) for i in range(12)], "engine", 30.0, 60.0, A)
    answers += pending
    states = {(a.state, a.tier) for a in answers}
    assert {
        (LookupState.HIT, TierName.CPU),
        (LookupState.HIT, TierName.DISK),
        (LookupState.MISS, None),
        (LookupState.PENDING, None),
    } <= states
    assert answers_of(sent(answer_columns(answers))) == answers


@pytest.mark.parametrize(
    ("changed", "why"),
    [
        ({"states": b"\3"}, "code out of range"),
        ({"tiers": b"\7"}, "code out of range"),
        ({"holders": (5).to_bytes(4, "little")}, "node out of range"),
        ({"where_sizes": (2).to_bytes(4, "little")}, "answers.ranks"),  # one rank, two said
        ({"where_sizes": (-2).to_bytes(4, "little", signed=True)}, "a size below -1"),
        ({"tiers": b""}, "answers.tiers"),
        ({"nodes": [7]}, "not node ids"),
    ],
)
def test_malformed_answers_are_a_value_error(changed: dict[str, Any], why: str) -> None:
    columns = answer_columns([LookupAnswer(LookupState.HIT, {0: A}, TierName.CPU)])
    with pytest.raises(ValueError, match=why):
        answers_of(sent(columns._replace(**changed)))
    with pytest.raises(ValueError, match="not AnswerColumns"):
        answers_of(list(columns))
    assert isinstance(columns, AnswerColumns)
