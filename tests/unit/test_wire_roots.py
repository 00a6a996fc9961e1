"""A prefix tree's root on the wire (tierstore.wire): a ShardEntry, ShardOffer and
UnitOffer carry it as their last field, decoded from what msgpack delivers (a plain
list); a sender that leaves it out is read as root 0; a root out of range is refused
naming the field; a unit offer with mixed roots is refused whole."""

from __future__ import annotations

import pytest

from tierstore.fields import MalformedField
from tierstore.keys import ChunkKey, Namespace, TierName, root_of
from tierstore.wire import (
    ShardEntry,
    ShardMeta,
    ShardOffer,
    UnitOffer,
    check_entry,
    check_held,
    check_offer,
    check_unit_offer,
    held_shard,
    metas_of,
    units_of,
)

NS = Namespace("0ff3")
KEY = ChunkKey(bytes(range(8)) + (1).to_bytes(4, "big"))
PARENT = ChunkKey(bytes(range(1, 9)) + (1).to_bytes(4, "big"))
ROOT = root_of(NS, KEY)


def key(boundary: int, group: int) -> ChunkKey:
    return ChunkKey(boundary.to_bytes(8, "big") + group.to_bytes(4, "big"))


def test_an_entry_keeps_its_root_through_msgpack() -> None:
    entry = ShardEntry(KEY, 64, 100, 7, 0b11, PARENT, ROOT)
    assert check_entry(list(entry)) == entry
    assert check_entry(list(entry)).root == ROOT


@pytest.mark.parametrize("fields", [5, 6])
def test_an_entry_without_a_root_is_root_0(fields: int) -> None:
    values = [KEY, 64, 100, 7, 0b11, PARENT][:fields]
    entry = check_entry(values)
    assert entry.root == 0
    assert entry.parent == (PARENT if fields == 6 else None)


@pytest.mark.parametrize("root", [-1, 1 << 64, 1.0, True, "1", None])
def test_an_entry_with_a_bad_root_is_refused_naming_it(root: object) -> None:
    with pytest.raises(MalformedField, match=r"entry\.root"):
        check_entry([KEY, 64, 100, 7, 0b11, None, root])


def test_an_entry_of_eight_fields_is_refused() -> None:
    with pytest.raises(MalformedField, match="8 fields"):
        check_entry([KEY, 64, 100, 7, 0b11, None, 1, 2])


def test_an_offer_keeps_its_root_and_one_without_is_root_0() -> None:
    offer = ShardOffer(NS, KEY, 1, 2, 100, PARENT, (1 << 64) - 1)
    assert check_offer(list(offer)) == offer
    assert check_offer([NS, KEY, 1, 2, 100]).root == 0
    assert check_offer([NS, KEY, 1, 2, 100, None]) == ShardOffer(NS, KEY, 1, 2, 100)
    with pytest.raises(MalformedField, match=r"offer\.root"):
        check_offer([NS, KEY, 1, 2, 100, None, -5])


def test_a_held_copy_keeps_its_root_and_a_bad_one_still_names_its_shard() -> None:
    offer = ShardOffer(NS, KEY, 0, 1, 100, None, ROOT)
    assert check_held([list(offer), "disk"]) == (offer, TierName.DISK)
    bad = [[NS, KEY, 0, 1, 100, None, 1 << 70], "cpu"]
    with pytest.raises(MalformedField, match=r"held\.offer\.root"):
        check_held(bad)
    assert held_shard(bad) == (NS, KEY, 0)  # the node is told to drop its copy


def test_a_unit_has_its_shards_root_and_mixed_roots_are_refused() -> None:
    shards = [ShardOffer(NS, key(1, g), 0, 1, 100, None, ROOT) for g in range(2)]
    (unit,) = units_of(shards)
    assert unit.root == ROOT
    assert check_unit_offer([[list(o) for o in unit.shards]]).root == ROOT
    mixed = UnitOffer([shards[0], shards[1]._replace(root=ROOT + 1)])
    with pytest.raises(MalformedField, match=r"unit\.shards\[1\]\.root"):
        check_unit_offer([[list(o) for o in mixed.shards]])


def test_a_meta_keeps_its_root_and_an_older_senders_is_root_0() -> None:
    meta = ShardMeta(100, 7, 1, 2, bytes(PARENT), ROOT)
    assert metas_of([meta, [100, 7, 1, 2, None]]) == [meta, ShardMeta(100, 7, 1, 2, None, 0)]
