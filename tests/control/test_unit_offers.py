"""A NodeStore's unit offers (tierstore.wire.UnitOffer) as the Evictor decodes them: a
well-formed one rebuilt from what msgpack delivers (or from columns), a malformed one
refused whole and named, the rest of the message going on."""

from __future__ import annotations

import random

import pytest

from tierstore.fields import MalformedField
from tierstore.keys import ChunkKey, Namespace
from tierstore.wire import (
    ShardOffer,
    UnitOffer,
    check_unit_offer,
    offer_columns,
    per_shard,
    unit_offers_of,
    units_of,
)

NS = Namespace("0ff3")


def key(boundary: int, group: int) -> ChunkKey:
    return ChunkKey(boundary.to_bytes(8, "big") + group.to_bytes(4, "big"))


def offer(boundary: int, group: int, rank: int, world: int = 2) -> ShardOffer:
    return ShardOffer(NS, key(boundary, group), rank, world, 100)


def _flat(unit: UnitOffer) -> list[object]:
    """What msgpack makes of a unit offer: lists of lists, bytes and ints."""
    return [[list(o) for o in unit.shards]]


def test_a_units_ranks_and_groups_decode_as_sent() -> None:
    unit = UnitOffer([offer(1, g, r) for g in range(3) for r in range(2)])
    assert check_unit_offer(_flat(unit)) == unit


@pytest.mark.parametrize(
    ("shards", "field"),
    [
        ([], "unit.shards"),
        ([offer(1, 0, 0), offer(2, 0, 1)], "unit.shards[1].key"),  # another boundary
        ([offer(1, 0, 0), offer(1, 0, 0)], "unit.shards[1].rank"),  # a rank twice
        ([offer(1, 0, 0), offer(1, 0, 1, world=4)], "unit.shards[1].world_size"),
        ([offer(1, 0, 0), ShardOffer(Namespace("other"), key(1, 0), 1, 2, 1)], "namespace"),
        ([offer(1, 0, 0), offer(1, 0, 2)], "unit.shards[1].rank"),  # outside its world
    ],
)
def test_a_malformed_unit_is_refused_whole_naming_the_field(
    shards: list[ShardOffer], field: str
) -> None:
    with pytest.raises(MalformedField, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_unit_offer(_flat(UnitOffer(shards)))


def test_a_malformed_unit_leaves_the_others_and_its_shards_are_refused() -> None:
    offers = [offer(1, 0, 0), offer(1, 1, 0), offer(2, 0, 0)]
    units = units_of(offers)
    assert [len(u.shards) for u in units] == [2, 1]  # one per boundary, groups together
    sent = [*units[0].shards, offer(2, 0, 0)._replace(nbytes=0)]  # the second: empty
    decoded = unit_offers_of(offer_columns(sent, [2, 1]))
    assert decoded == [units[0], None]
    # The Evictor answers no flag for a refused unit: its shards are refused.
    assert per_shard(offers, units, [[True, False], []]) == [True, False, False]


def _reference(units: list[UnitOffer]) -> list[UnitOffer | None]:
    """Each unit as :func:`check_unit_offer` decodes it alone (None: refused)."""
    decoded: list[UnitOffer | None] = []
    for unit in units:
        try:
            decoded.append(check_unit_offer(_flat(unit)))
        except MalformedField:
            decoded.append(None)
    return decoded


def _spoiled(rng: random.Random, unit: list[ShardOffer], long_keys: bool) -> list[ShardOffer]:
    """``unit`` with one fault a malformed or careless sender could make (or none; a key
    of another length only if ``long_keys``: its message is then checked unit by unit)."""
    i = rng.randrange(len(unit))
    o = unit[i]
    fault = rng.choice(
        ["none", "boundary", "root", "namespace", "twice", "world", "nbytes", "rank", "empty"]
        + ["group", "parent", "same key other group"]
        + (["long key"] if long_keys else [])
    )
    spoiled = list(unit)
    if fault == "boundary":
        spoiled[i] = o._replace(key=key(10**6 + i, 0))
    elif fault == "root":
        spoiled[i] = o._replace(root=o.root + 1)
    elif fault == "namespace":
        spoiled[i] = o._replace(namespace=Namespace("other"))
    elif fault == "twice":
        spoiled.append(o)
    elif fault == "world":
        spoiled.append(o._replace(rank=0, world_size=o.world_size + 1))
    elif fault == "nbytes":
        spoiled[i] = o._replace(nbytes=0)
    elif fault == "rank":
        spoiled[i] = o._replace(rank=o.world_size)
    elif fault == "empty":
        spoiled = []
    elif fault == "long key":  # a key of another length, at no boundary of the unit's
        spoiled[i] = o._replace(key=ChunkKey(bytes(32) + o.key), parent=None)
    elif fault == "group":  # a group index out of range
        spoiled[i] = o._replace(key=ChunkKey(o.key[:-4] + b"\xff\xff\xff\xff"))
    elif fault == "parent":
        spoiled[i] = o._replace(parent=ChunkKey(o.key[:-4] + b"\xff\xff\xff\xff"))
    elif fault == "same key other group":  # fine: another group of the boundary
        spoiled[i] = o._replace(key=key(int.from_bytes(o.key[:8], "big"), 7))
    return spoiled


@pytest.mark.parametrize("long_keys", [False, True])
@pytest.mark.parametrize("seed", range(100))
def test_units_checked_as_columns_decode_as_each_alone(seed: int, long_keys: bool) -> None:
    """A message past the row-by-row size is checked column by column: each unit, well
    formed or spoiled, is decoded (or refused whole) as check_unit_offer does alone."""
    rng = random.Random(seed)
    units: list[UnitOffer] = []
    for b in range(rng.randrange(3, 12)):
        ranks, groups = rng.choice([(1, 1), (2, 1), (8, 3), (4, 2), (1, 3)])
        root = rng.randrange(2**64)
        shards = [
            ShardOffer(NS, key(b, g), r, ranks, 1 + r, key(b - 1, g) if b else None, root)
            for g in range(groups)
            for r in range(ranks)
        ]
        rng.shuffle(shards)
        units.append(UnitOffer(_spoiled(rng, shards, long_keys) if rng.random() < 0.5 else shards))
    sent = [o for unit in units for o in unit.shards]
    decoded = unit_offers_of(offer_columns(sent, [len(u.shards) for u in units]))
    assert decoded == _reference(units)


def test_a_large_message_of_whole_units_decodes_as_sent() -> None:
    """A TP=8 3-group batch (42 units of 24 shards): every unit decoded, as sent."""
    units = units_of(
        ShardOffer(NS, key(b, g), r, 8, 100, key(b - 1, g) if b else None, 5)
        for b in range(42)
        for g in range(3)
        for r in range(8)
    )
    sent = [o for unit in units for o in unit.shards]
    assert unit_offers_of(offer_columns(sent, [24] * 42)) == units
