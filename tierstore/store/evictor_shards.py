"""A NodeStore's calls to S Evictor shards, routed by each chunk's prefix tree root.

The Evictor is split into S shards (``evictor_shards``), each indexing the prefix trees
whose root (:func:`tierstore.keys.root_of`) maps to it (:func:`tierstore.keys.shard_of`),
so every rule of the index that looks at a unit's neighbours stays on one shard
(docs/scaling.md, "Shard by chain root"). :class:`ShardedEvictorPort` is the
:class:`~tierstore.store.ports.EvictorPort` a NodeStore holds: it takes one port per
shard (the shards' clients) and sends each shard its own part of a call:

- ``admit_units``: the units whose root maps to it (a unit's root is its shards');
- ``restore``: the copies whose offer's root maps to it;
- the ShardId reports (``promoted``, ``forget_shards``, ``report_corrupt_after_hit``,
  ``replicated``, ``report_disk_writes``' unwritten ids): by the root of the node's held
  copy (``root_of``); an id whose root is not known (the copy is gone) goes to every
  shard, where a shard that does not index it ignores it;
- ``report_disk_writes``' ``writable`` to every shard (it says whether the node's disk
  takes writes, which each shard's room decisions need), its ``failures`` (a count, for
  stats) to shard 0 alone, so the shards' counts sum to the node's.

Each shard involved gets one call, all sent before any is waited on; a shard with
nothing to hear gets none. With one shard every call passes straight through (no copy,
no partition): a single Evictor behaves exactly as before sharding.

**Failures.** A merged answer (:class:`Merged`) waits on each shard's reply, the
deadline being for the whole call. If every shard involved failed it raises the first
shard's error, and :func:`failed_shards` of that error names the shards that failed
(such as an :class:`~tierstore.errors.UnknownNodeError` from a restarted shard: the
caller reregisters with those shards and retries, as it would with one Evictor, whose
failed call changed nothing). If only some failed, the answers that came are used, not
thrown away (those shards changed their indexes, and the room they made must be freed):
a failed shard's units are refused (no flags), its restored copies are neither accepted
nor dropped (kept unindexed until that shard hears the node again), and
``on_failure(shard, error)`` is called for each failed shard (default: a WARNING log),
from the thread that waits on the answer. A one-way report's reply is dropped, so a
shard it could not even be sent to goes to ``on_failure`` at once (the other shards
still get theirs). The caller passes an ``on_failure`` that reregisters the node with a
shard that does not know it (a restarted shard also asks the NodeStore to, see
``tierstore.actors.evictor``).

Any thread, as the NodeStore's own port; holds no lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from tierstore.control.shares import MOVE_PARTS, TierLoad, plan_shares, share_floor
from tierstore.keys import ShardId, TierName, shard_of
from tierstore.store.ports import Decision, EvictorPort, UnitDecision
from tierstore.wire import NodeActions, NodeLoad, Reply, ShardOffer, UnitOffer

__all__ = [
    "Merged",
    "ShardedEvictorPort",
    "ShareBalancer",
    "ShareBook",
    "SharePort",
    "failed_shards",
    "merge_actions",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# What a failed shard's error carries: the shards that failed, in order.
_FAILED_SHARDS = "evictor_shards"


def failed_shards(error: BaseException) -> list[int] | None:
    """The Evictor shards whose calls failed, for an error a :class:`Merged` answer
    raised (every shard it waited on failed); None for any other error (one Evictor, or
    an error not from a shard's call)."""
    shards = getattr(error, _FAILED_SHARDS, None)
    return list(shards) if isinstance(shards, list) else None


def merge_actions(actions: Sequence[NodeActions]) -> NodeActions:
    """The actions of several shards for one node, concatenated (shard order)."""
    merged = NodeActions()
    for a in actions:
        merged.drop += a.drop
        merged.demote += a.demote
        merged.promote += a.promote
        merged.persist += a.persist
        merged.push += a.push
    return merged


class Merged(Generic[T, R]):
    """The replies of the shards a call went to, waited on together: a
    :class:`~tierstore.wire.Reply`. ``merge`` builds the caller's answer from each
    shard's answer, None for a shard that failed (see the module docstring)."""

    def __init__(
        self,
        replies: dict[int, Reply[R] | BaseException | None],
        merge: Callable[[dict[int, R | None]], T],
        on_failure: Callable[[int, BaseException], None],
    ) -> None:
        self._replies = replies  # a send that raised is kept as its error; None: no reply
        self._merge = merge
        self._on_failure = on_failure

    def take_unsent(self) -> list[tuple[int, BaseException]]:
        """The shards the call could not be sent to, with why; :meth:`result` no longer
        counts them (the caller handled them)."""
        unsent = [(s, r) for s, r in self._replies.items() if isinstance(r, BaseException)]
        for shard, _ in unsent:
            self._replies[shard] = None
        return unsent

    def result(self, timeout_s: float | None = None) -> T:
        """Waits on every shard's reply (``timeout_s`` for all of them together; default:
        each reply's own deadline) and merges their answers. Raises when every shard
        failed (:func:`failed_shards` names them)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        answers: dict[int, R | None] = {}
        errors: dict[int, BaseException] = {}
        for shard, reply in self._replies.items():
            if isinstance(reply, BaseException):
                errors[shard] = reply
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                answers[shard] = None if reply is None else reply.result(left)
            except Exception as exc:
                errors[shard] = exc
        if errors and not answers:
            first = next(iter(errors.values()))
            setattr(first, _FAILED_SHARDS, list(errors))
            raise first
        for shard, error in errors.items():
            self._on_failure(shard, error)
            answers[shard] = None
        return self._merge(answers)


def _log_failure(shard: int, error: BaseException) -> None:
    logger.warning("Evictor shard %d did not answer (its part refused): %s", shard, error)


class ShardedEvictorPort:
    """An :class:`~tierstore.store.ports.EvictorPort` over one port per Evictor shard
    (``shards[i]``: shard i), routing each call by root (see the module docstring).

    ``root_of(shard_id)``: the root of the node's held copy of a shard, None if it holds
    none (``NodeStoreCore.root_of``; the core takes this port, so pass a function that
    reaches the core once it is built). ``on_failure(shard, error)``: a shard whose part
    of a call failed while others answered (default: logged)."""

    def __init__(
        self,
        shards: Sequence[EvictorPort],
        root_of: Callable[[ShardId], int | None],
        on_failure: Callable[[int, BaseException], None] = _log_failure,
    ) -> None:
        if not shards:
            raise ValueError("a ShardedEvictorPort needs at least one Evictor shard")
        self._shards = list(shards)
        self._root_of = root_of
        self._on_failure = on_failure

    @property
    def shards(self) -> int:
        """How many Evictor shards there are."""
        return len(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def shard_of(self, root: int) -> int:
        """The shard that indexes the prefix tree of ``root`` (0 for an unknown root)."""
        return shard_of(root, len(self._shards))

    # ---- calls waited on -----------------------------------------------------------------
    def admit_units(self, node_id: str, units: list[UnitOffer]) -> Reply[UnitDecision]:
        if len(self._shards) == 1:
            return self._shards[0].admit_units(node_id, units)
        parts = _partition([self.shard_of(unit.root) for unit in units])

        def merge(answers: dict[int, UnitDecision | None]) -> UnitDecision:
            flags: list[list[bool]] = [[] for _ in units]  # a failed shard's: refused
            for shard, answer in answers.items():
                if answer is not None:
                    for i, unit_flags in zip(parts[shard], answer[0], strict=True):
                        flags[i] = unit_flags
            return flags, _actions(answers)

        return self._send(
            parts, lambda port, s: port.admit_units(node_id, [units[i] for i in parts[s]]), merge
        )

    def restore(
        self, node_id: str, held: list[tuple[ShardOffer, TierName]], grace: bool = False
    ) -> Reply[Decision]:
        if len(self._shards) == 1:
            return self._shards[0].restore(node_id, held, grace)
        parts = _partition([self.shard_of(offer.root) for offer, _ in held])

        def merge(answers: dict[int, Decision | None]) -> Decision:
            accepted = [False] * len(held)  # a failed shard's: not accepted, not dropped
            for shard, answer in answers.items():
                if answer is not None:
                    for i, ok in zip(parts[shard], answer[0], strict=True):
                        accepted[i] = ok
            return accepted, _actions(answers)

        return self._send(
            parts, lambda port, s: port.restore(node_id, [held[i] for i in parts[s]], grace), merge
        )

    # ---- one-way reports -----------------------------------------------------------------
    def promoted(
        self, node_id: str, done: list[ShardId], failed: list[ShardId], refused: list[ShardId]
    ) -> Reply[None]:
        if len(self._shards) == 1:
            return self._shards[0].promoted(node_id, done, failed, refused)
        d, f, r = self._by_root(done), self._by_root(failed), self._by_root(refused)
        return self._report(
            d.keys() | f.keys() | r.keys(),
            lambda port, s: port.promoted(node_id, d.get(s, []), f.get(s, []), r.get(s, [])),
        )

    def forget_shards(self, node_id: str, shard_ids: list[ShardId]) -> Reply[None]:
        if len(self._shards) == 1:
            return self._shards[0].forget_shards(node_id, shard_ids)
        parts = self._by_root(shard_ids)
        return self._report(parts, lambda port, s: port.forget_shards(node_id, parts[s]))

    def report_corrupt_after_hit(self, node_id: str, shard_ids: list[ShardId]) -> Reply[None]:
        if len(self._shards) == 1:
            return self._shards[0].report_corrupt_after_hit(node_id, shard_ids)
        parts = self._by_root(shard_ids)
        return self._report(parts, lambda port, s: port.report_corrupt_after_hit(node_id, parts[s]))

    def report_disk_writes(
        self, node_id: str, unwritten: list[ShardId], failures: int, writable: bool
    ) -> Reply[None]:
        if len(self._shards) == 1:
            return self._shards[0].report_disk_writes(node_id, unwritten, failures, writable)
        parts = self._by_root(unwritten)
        return self._report(
            range(len(self._shards)),
            lambda port, s: port.report_disk_writes(
                node_id, parts.get(s, []), failures if s == 0 else 0, writable
            ),
        )

    def replicated(self, node_id: str, done: list[ShardId], failed: list[ShardId]) -> Reply[None]:
        if len(self._shards) == 1:
            return self._shards[0].replicated(node_id, done, failed)
        d, f = self._by_root(done), self._by_root(failed)
        return self._report(
            d.keys() | f.keys(),
            lambda port, s: port.replicated(node_id, d.get(s, []), f.get(s, [])),
        )

    # ---- routing -------------------------------------------------------------------------
    def _by_root(self, shard_ids: list[ShardId]) -> dict[int, list[ShardId]]:
        """``shard_ids`` by the Evictor shard of their held copy's root; one whose root
        is not known, to every shard."""
        parts: dict[int, list[ShardId]] = {}
        for shard_id in shard_ids:
            root = self._root_of(shard_id)
            if root is None:
                for s in range(len(self._shards)):
                    parts.setdefault(s, []).append(shard_id)
            else:
                parts.setdefault(self.shard_of(root), []).append(shard_id)
        return parts

    def _send(
        self,
        shards: Iterable[int],
        call: Callable[[EvictorPort, int], Reply[R]],
        merge: Callable[[dict[int, R | None]], T],
    ) -> Merged[T, R]:
        """``call`` of each of ``shards`` (its port and number), all sent before any is
        waited on."""
        replies: dict[int, Reply[R] | BaseException | None] = {}
        for shard in sorted(shards):
            try:
                replies[shard] = call(self._shards[shard], shard)
            except Exception as exc:  # not even sent (the shard's actor is gone)
                replies[shard] = exc
        return Merged(replies, merge, self._on_failure)

    def _report(
        self, shards: Iterable[int], call: Callable[[EvictorPort, int], Reply[None]]
    ) -> Merged[None, None]:
        """A one-way report to each of ``shards`` (its reply is usually dropped, so a
        shard it could not even be sent to is passed to ``on_failure`` now)."""
        merged = self._send(shards, call, _none)
        for shard, error in merged.take_unsent():
            self._on_failure(shard, error)
        return merged


def _partition(where: list[int]) -> dict[int, list[int]]:
    """Item indexes by shard (item i's is ``where[i]``), each shard's in order."""
    parts: dict[int, list[int]] = {}
    for i, shard in enumerate(where):
        parts.setdefault(shard, []).append(i)
    return parts


def _actions(answers: Mapping[int, tuple[object, NodeActions] | None]) -> NodeActions:
    return merge_actions([a[1] for _, a in sorted(answers.items()) if a is not None])


def _none(answers: dict[int, None]) -> None:
    return None


# ---- the shards' shares of this node's tiers ------------------------------------------------
class SharePort(Protocol):
    """What a :class:`ShareBalancer` asks of one Evictor shard (its client): its part of
    this node (``node_load``) and a new share (``resize_node``), both waited on with the
    client's deadline."""

    def node_load(self, node_id: str) -> Reply[NodeLoad | None]: ...

    def resize_node(
        self, node_id: str, cpu_bytes: int, disk_bytes: int
    ) -> Reply[tuple[NodeLoad | None, NodeActions]]: ...


class ShareBook:
    """Each Evictor shard's share of this node's CPU and disk tiers, as this node last
    registered or resized them: a shard that restarts registers again with its current
    share, not the static split. Change or read them, and send the call that tells the
    shard, under :attr:`lock` (so a shard never hears an older share after a newer one)."""

    def __init__(self, cpu: list[int], disk: list[int]) -> None:
        self.lock = threading.Lock()
        self.cpu = list(cpu)
        self.disk = list(disk)


class ShareBalancer:
    """Moves this node's tier bytes between Evictor shards by credit, one round at a time
    (:meth:`run_round`), off the store path: the NodeStore's rebalancer thread runs it.

    A round asks every shard for its part of the node (one call each, sent together), plans
    each tier's shares (:func:`~tierstore.control.shares.plan_shares`: pressure since the
    last round, floors), then shrinks the givers first: each evicts down to its new share
    as a store would (demoting before dropping) and answers what it still holds; its
    actions for this node are applied here (``apply``, waited on) before anything is
    granted. The takers then grow by at most what the tier has unclaimed, a shard's claim
    being its share or what it holds, if more (leased chunks it could not evict). So the
    shares never add up to more than the tier, at any instant. A shard that does not
    answer (restarting, stuck: its client's deadline) ends the round, or keeps its claim.

    One thread at a time; holds :attr:`ShareBook.lock` only to send a resize.
    """

    def __init__(
        self,
        node_id: str,
        shards: Sequence[SharePort],
        book: ShareBook,
        cpu_total: int,
        disk_total: int,
        apply: Callable[[NodeActions], None],
    ) -> None:
        self._node = node_id
        self._shards = list(shards)
        self._book = book
        self._totals = (cpu_total, disk_total)
        self._apply = apply
        self._seen: list[tuple[int, int] | None] = [None] * len(self._shards)  # pressure, asked
        self.rounds = 0  # rounds that moved bytes

    def run_round(self) -> bool:
        """One round; True when any share changed. Raises what a shard's ``node_load``
        raised (nothing changed then)."""
        loads = [s.node_load(self._node) for s in self._shards]
        answers = [reply.result() for reply in loads]
        if any(a is None for a in answers):
            return False  # a shard does not know the node yet: it registers first
        now = [a for a in answers if a is not None]
        cpu_plan, disk_plan = self._plan(now)
        cpu_claims = [max(a.cpu_capacity, a.cpu_used) for a in now]
        disk_claims = [max(a.disk_capacity, a.disk_used) for a in now]
        cpu_now = [a.cpu_capacity for a in now]  # each shard's shares as they stand
        disk_now = [a.disk_capacity for a in now]
        moved = False
        for i in range(len(now)):  # givers first (in either tier)
            cpu, disk = min(cpu_plan[i], cpu_now[i]), min(disk_plan[i], disk_now[i])
            if (cpu, disk) == (cpu_now[i], disk_now[i]):
                continue
            after = self._resize(i, cpu, disk)
            if after is None:
                return moved  # not confirmed: grant nothing this round
            cpu_now[i], disk_now[i] = cpu, disk
            cpu_claims[i] = max(after.cpu_capacity, after.cpu_used)
            disk_claims[i] = max(after.disk_capacity, after.disk_used)
            moved = True
        cpu_room = self._totals[0] - sum(cpu_claims)
        disk_room = self._totals[1] - sum(disk_claims)
        for i in range(len(now)):  # then the takers, from what the tier has unclaimed
            cpu_more = max(0, min(cpu_plan[i] - cpu_now[i], cpu_room))
            disk_more = max(0, min(disk_plan[i] - disk_now[i], disk_room))
            if not cpu_more and not disk_more:
                continue
            cpu_room -= cpu_more
            disk_room -= disk_more
            self._resize(i, cpu_now[i] + cpu_more, disk_now[i] + disk_more)
            moved = True
        self.rounds += moved
        return moved

    def _plan(self, loads: list[NodeLoad]) -> tuple[list[int], list[int]]:
        """Each tier's target shares from the pressure and calls since the last round."""
        grown = []
        for i, a in enumerate(loads):
            seen = self._seen[i]
            if seen is None or a.pressure < seen[0] or a.asked < seen[1]:
                seen = (0, 0)  # first round, or the shard restarted: counted from 0
            grown.append((a.pressure - seen[0], a.asked - seen[1]))
            self._seen[i] = (a.pressure, a.asked)
        plans = []
        for total, cap, used in (
            (self._totals[0], [a.cpu_capacity for a in loads], [a.cpu_used for a in loads]),
            (self._totals[1], [a.disk_capacity for a in loads], [a.disk_used for a in loads]),
        ):
            tier = [
                TierLoad(c, u, pressure, asked > 0)
                for c, u, (pressure, asked) in zip(cap, used, grown, strict=True)
            ]
            floor = share_floor(total, len(loads))
            plans.append(plan_shares(tier, total, floor, total // MOVE_PARTS) if total else cap)
        return plans[0], plans[1]

    def _resize(self, shard: int, cpu: int, disk: int) -> NodeLoad | None:
        """Shard ``shard``'s share set to ``cpu``/``disk`` bytes (recorded in the book as
        it is sent) and its actions for this node applied; what it holds after, or None
        (logged) if it or the apply did not answer."""
        with self._book.lock:
            self._book.cpu[shard], self._book.disk[shard] = cpu, disk
            reply = self._shards[shard].resize_node(self._node, cpu, disk)
        try:
            after, actions = reply.result()
            if actions:
                self._apply(actions)
        except Exception as exc:
            logger.warning(
                "Evictor shard %d: share of node %s not resized: %s", shard, self._node, exc
            )
            return None
        return after
