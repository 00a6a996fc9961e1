"""A NIXL pull's loan as it crosses from the holder: checked field by field, a bad one
refused naming the field (tierstore.wire_nixl)."""

from __future__ import annotations

import pytest

from tierstore.fields import MalformedField
from tierstore.wire_nixl import NixlLoan, nixl_loan_of

GOOD = NixlLoan(7, "tierstore-ab-12", b"agent metadata", b"descriptors")


def test_a_loan_arrives_as_sent_and_as_msgpack_flattens_it() -> None:
    assert nixl_loan_of(GOOD) == GOOD
    assert nixl_loan_of(list(GOOD)) == GOOD


@pytest.mark.parametrize(
    ("index", "value", "field"),
    [
        (0, -1, "loan.loan_id"),
        (0, True, "loan.loan_id"),
        (0, "7", "loan.loan_id"),
        (1, "", "loan.agent"),
        (1, b"name", "loan.agent"),
        (2, "metadata", "loan.agent_meta"),
        (2, b"", "loan.agent_meta"),
        (3, None, "loan.descs"),
    ],
)
def test_a_bad_field_is_refused_by_name(index: int, value: object, field: str) -> None:
    sent = list(GOOD)
    sent[index] = value
    with pytest.raises(MalformedField) as refused:
        nixl_loan_of(sent)
    assert refused.value.field == field


@pytest.mark.parametrize("value", [None, (), GOOD[:3], (*GOOD, b"more")])
def test_a_loan_of_the_wrong_shape_is_refused(value: object) -> None:
    with pytest.raises(MalformedField):
        nixl_loan_of(value)
