"""An actor's refusal of a malformed message (tierstore.fields.MalformedField) reaches
its caller as itself: Ray pickles the error, and one it cannot rebuild arrives as an
UnserializableException that names nothing."""

from __future__ import annotations

import pickle

import pytest

from tierstore.fields import MalformedField, integer


def test_a_malformed_field_pickles_as_itself() -> None:
    with pytest.raises(MalformedField) as refused:
        integer("offer.rank", -1, 0, 4)
    arrived = pickle.loads(pickle.dumps(refused.value))
    assert type(arrived) is MalformedField and isinstance(arrived, ValueError)
    assert (arrived.field, str(arrived)) == ("offer.rank", str(refused.value))
    assert "outside [0, 4)" in str(arrived)
