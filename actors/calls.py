"""One actor call in flight, and the one place Ray's errors and flattened types are undone.

Ray serializes arguments and answers with msgpack first, so a NamedTuple nested in a
list arrives as a plain tuple, and an enum as its value. The ``*_of`` functions below
rebuild tierstore's types: clients apply them to answers, actors to arguments. What a
NodeStore sends the Evictor is checked as it is rebuilt (``checked_items``): a malformed
item is refused, the rest go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from tierstore.control.events import EventBatch, ResidencyEvent
from tierstore.control.index import LookupAnswer, LookupState, NodeActions, ShardOffer
from tierstore.control.index_model import check_held, check_offer
from tierstore.data.tiers.base import ShardMeta
from tierstore.errors import (
    ActorUnavailableError,
    RemoteCallError,
    RemoteCallTimeout,
    TierStoreError,
)
from tierstore.fields import MalformedField, check_shard_id, items
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName

T = TypeVar("T")

logger = logging.getLogger(__name__)


def mapped_error(exc: BaseException, what: str, timeout_s: float | None = None) -> BaseException:
    """tierstore's error for a failed actor call ``what``: the remote TierStoreError
    itself, or one that says whether the actor was gone, late or broken."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, TierStoreError):
            return cause
        return RemoteCallError(f"{what} raised {cause!r}")
    if isinstance(exc, RayActorError):
        return ActorUnavailableError(f"{what}: the actor is unavailable ({exc})")
    if isinstance(exc, GetTimeoutError):
        return RemoteCallTimeout(f"{what}: no answer within {timeout_s} s")
    return exc


class Pending(Generic[T]):
    """An actor call sent: ``result`` waits for it, at most its deadline, and returns its
    answer rebuilt (``convert``) or raises tierstore's error for it. Any thread."""

    def __init__(
        self,
        what: str,
        ref: ray.ObjectRef,
        timeout_s: float,
        convert: Callable[[Any], T] = lambda value: value,
        keep: object = None,
    ) -> None:
        self.what = what
        self.ref = ref
        self._keep = keep  # e.g. the ObjectRef of a buffer the call reads: alive until done
        self._timeout_s = timeout_s
        self._convert = convert

    def result(self, timeout_s: float | None = None) -> T:
        """Blocks the calling thread until the answer or ``timeout_s`` (default: the
        client's deadline for this call)."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        try:
            return self._convert(ray.get(self.ref, timeout=timeout_s))
        except Exception as exc:
            error = mapped_error(exc, self.what, timeout_s)
            if error is exc:
                raise
            raise error from exc


def send(what: str, method: Any, *args: Any, timeout_s: float, **kwargs: Any) -> Any:
    """``method.remote(*args)``, with a send failure mapped like an answer's."""
    try:
        return method.remote(*args, **kwargs)
    except Exception as exc:
        error = mapped_error(exc, what, timeout_s)
        if error is exc:
            raise
        raise error from exc


# ---- rebuilding what msgpack flattened ------------------------------------------------------
def shard_id_of(value: Iterable[Any]) -> ShardId:
    namespace, key, rank = value
    return ShardId(Namespace(namespace), ChunkKey(key), int(rank))


def shard_ids_of(values: Iterable[Iterable[Any]]) -> list[ShardId]:
    return [shard_id_of(v) for v in values]


# ---- checking what a NodeStore sends the Evictor ---------------------------------------------
MAX_ITEMS = 1 << 32  # of one message's list (a node's whole inventory, at restore)


def checked_items(values: object, check: Callable[[object], T], what: str) -> list[T | None]:
    """Each item of a message's list rebuilt by ``check`` (it raises MalformedField on a
    malformed one); None for each one refused, logged at WARNING with the field and
    value. Raises MalformedField if ``values`` is not a list."""
    checked: list[T | None] = []
    for i, value in enumerate(items(what, values, MAX_ITEMS)):
        try:
            checked.append(check(value))
        except MalformedField as exc:
            logger.warning("refused %s %d: %s", what, i, exc)
            checked.append(None)
    return checked


def offers_of(values: object) -> list[ShardOffer | None]:
    """``admit``'s offers, checked (:func:`~tierstore.control.index_model.check_offer`)."""
    return checked_items(values, check_offer, "offer")


def held_of(values: object) -> list[tuple[ShardOffer, TierName] | None]:
    """``restore``'s copies, checked (:func:`~tierstore.control.index_model.check_held`)."""
    return checked_items(values, check_held, "held copy")


def checked_shard_ids(values: object) -> list[ShardId | None]:
    """ShardIds a NodeStore reports, checked (:func:`tierstore.fields.check_shard_id`)."""
    return checked_items(values, check_shard_id, "shard id")


def node_actions_of(actions: NodeActions) -> NodeActions:
    """A dataclass survives Ray; the ShardIds in its lists do not."""
    return NodeActions(
        drop=shard_ids_of(actions.drop),
        demote=shard_ids_of(actions.demote),
        promote=shard_ids_of(actions.promote),
        persist=shard_ids_of(actions.persist),
        push=[(shard_id_of(s), NodeId(n)) for s, n in actions.push],
    )


def decision_of(value: Any) -> tuple[list[bool], NodeActions]:
    """``admit``/``restore``'s answer: one flag per offer, and the caller's own actions."""
    accepted, actions = value
    return [bool(a) for a in accepted], node_actions_of(actions)


def answers_of(values: Iterable[Any]) -> list[LookupAnswer]:
    return [
        LookupAnswer(
            LookupState(state),
            None if where is None else {int(r): NodeId(n) for r, n in where.items()},
            None if tier is None else TierName(tier),
        )
        for state, where, tier in values
    ]


def event_batch_of(value: Any) -> EventBatch:
    next_seq, lost, events, epoch = value
    return EventBatch(
        next_seq,
        lost,
        [
            ResidencyEvent(
                seq,
                Namespace(ns),
                NodeId(node),
                TierName(tier),
                removed,
                [ChunkKey(k) for k in keys],
            )
            for seq, ns, node, tier, removed, keys in events
        ],
        str(epoch),
    )


def nodes_of(values: Iterable[Any]) -> list[NodeId | None]:
    return [None if n is None else NodeId(n) for n in values]


def metas_of(values: Iterable[Any]) -> list[ShardMeta]:
    return [v if isinstance(v, ShardMeta) else ShardMeta(*v) for v in values]
