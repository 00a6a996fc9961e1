"""The compact key table under the cluster view: same answers as a dict of masks, on
random workloads (adds, bit changes, removals, rebuilds), its bytes per key, and what a
fingerprint collision (a false positive) looks like to its owner."""

from __future__ import annotations

import random

import pytest

from tierstore.vllm.key_table import KeyTable


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


@pytest.mark.parametrize("seed", range(5))
def test_the_table_answers_as_a_dict_of_masks_on_random_workloads(seed: int) -> None:
    rnd = random.Random(seed)
    table, model = KeyTable(), {}
    universe = [_key(i) for i in range(3000)]
    for _ in range(300):
        keys = rnd.sample(universe, rnd.randrange(1, 60))
        set_bits = rnd.choice([0, 1, 2, 1 << 15, 0b101])
        clear_bits = rnd.choice([0, 0, 1, 2, 0xFFFF])
        table.update(keys, set_bits=set_bits, clear_bits=clear_bits)
        for k in keys:
            mask = (model.get(k, 0) & ~clear_bits) | set_bits
            if mask:
                model[k] = mask
            else:
                model.pop(k, None)
        assert len(table) == len(model)
    assert all(table.mask(k) == model.get(k, 0) for k in universe)


def test_a_table_of_a_million_keys_costs_at_most_16_bytes_each() -> None:
    table = KeyTable()
    keys = [i.to_bytes(12, "little") for i in range(1_000_000)]
    for start in range(0, len(keys), 50_000):
        table.update(keys[start : start + 50_000], set_bits=1)
        assert table.nbytes / len(table) <= 16 or len(table) < 1000
    assert len(table) == 1_000_000 and table.nbytes / len(table) <= 16
    table.update(keys[::2], clear_bits=1)  # tombstones, then a rebuild on the next add
    table.update([b"one more"], set_bits=1)
    assert len(table) == 500_001 and table.nbytes / len(table) <= 16
    assert keys[1] in table and keys[0] not in table


def test_a_false_positive_reads_as_present_with_the_other_keys_mask() -> None:
    """Keys are known by fingerprint: with 4 bits, 17 keys must share one. The owner
    (the cluster view) treats presence as a claim to check, never as the bytes."""
    table = KeyTable(fingerprint_bits=4)
    table.update([_key(1)], set_bits=0b10)
    twins = [
        k for k in map(_key, range(2, 200)) if table.fingerprint(k) == table.fingerprint(_key(1))
    ]
    assert twins, "some key shares the 4-bit fingerprint"
    assert table.mask(twins[0]) == 0b10  # never added, reads present
    table.update([twins[0]], clear_bits=0b10)  # its removal is the other key's too
    assert _key(1) not in table


def test_fingerprint_bits_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="fingerprint_bits"):
        KeyTable(fingerprint_bits=49)
