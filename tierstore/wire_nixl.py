"""The message of a pull over NIXL (``pull_transport: "nixl"``), defined once and checked
field by field on receipt, beside :mod:`tierstore.wire` (the other messages).

The holder's ``lend_shards`` answers with a :class:`NixlLoan` and the shards' metas; the
puller reads the loan's extents (:mod:`tierstore.store.nixl_pulls`) and ends it
(``end_loan``)."""

from __future__ import annotations

from typing import NamedTuple

from tierstore import fields

__all__ = ["NixlLoan", "nixl_loan_of"]

_MAX_NAME = 256
_MAX_BLOB = 64 << 20  # an agent's metadata, a loan's descriptors: kilobytes in practice


class NixlLoan(NamedTuple):
    """Which loan to end, the holder's NIXL agent (name and metadata, for the puller to
    reach it) and the lent extents, as NIXL's serialized descriptor list."""

    loan_id: int
    agent: str
    agent_meta: bytes
    descs: bytes


def nixl_loan_of(value: object) -> NixlLoan:
    """A loan as it arrives from another process; MalformedField names a bad field."""
    loan_id, agent, agent_meta, descs = fields.row("loan", value, 4, 4)
    if not isinstance(agent, str) or not 0 < len(agent) <= _MAX_NAME:
        raise fields.MalformedField("loan.agent", agent, f"not a name of 1 to {_MAX_NAME} chars")
    return NixlLoan(
        fields.integer("loan.loan_id", loan_id, 0, 1 << 63),
        agent,
        fields.byte_string("loan.agent_meta", agent_meta, 1, _MAX_BLOB),
        fields.byte_string("loan.descs", descs, 1, _MAX_BLOB),
    )
