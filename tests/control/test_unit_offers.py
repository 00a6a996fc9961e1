"""A NodeStore's unit offers (tierstore.wire.UnitOffer) as the Evictor decodes them: a
well-formed one rebuilt from what msgpack delivers (or from columns), a malformed one
refused whole and named, the rest of the message going on."""

from __future__ import annotations

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
