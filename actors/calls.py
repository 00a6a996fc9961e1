"""One actor call in flight, and the one place Ray's errors are mapped to tierstore's.

What Ray's msgpack flattens in the call's answer is rebuilt by the decoder the client
passes (:mod:`tierstore.wire`'s ``*_of`` functions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from tierstore.errors import (
    ActorUnavailableError,
    RemoteCallError,
    RemoteCallTimeout,
    TierStoreError,
)

T = TypeVar("T")


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
    """An actor call sent (a :class:`~tierstore.wire.Reply`): ``result`` waits for it,
    at most its deadline, and returns its answer rebuilt (``convert``) or raises
    tierstore's error for it. Any thread. ``keep_alive``: what must outlive the call (the
    ObjectRef of a buffer it reads), released with this object."""

    def __init__(
        self,
        what: str,
        ref: ray.ObjectRef,
        timeout_s: float,
        convert: Callable[[Any], T] = lambda value: value,
        keep_alive: object = None,
    ) -> None:
        self.what = what
        self.ref = ref
        self._keep_alive = keep_alive
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
