"""One declaration per actor method, checked: each client carries the names and
parameters of its actor's methods (STYLE.md point 9), and each port the Ray-free code
declares (the part of a client it calls, so a test can hand it an in-process double) is
a subset of its client, with the client's parameters and answer types. Compared with
``inspect`` and ``typing``, so none can drift from the actor."""

from __future__ import annotations

import inspect
from typing import Any, get_args, get_type_hints

import pytest
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from tierstore.actors.evictor import Evictor
from tierstore.actors.node_store_actor import NodeStore, RayPeers
from tierstore.actors.worker_ports import RayWorkerPorts

from tierstore.store.ports import EvictorPort, PeerPort
from tierstore.vllm.evictor_channel import EvictorCalls
from tierstore.vllm.worker import NodeStoreCalls, WorkerPorts

# Where a client takes what the actor gets in another form: (method, client's, actor's).
_CLIENT_CONVERTS = {
    ("store", "buffer"): "buffer_ref",  # the client puts the array; the actor gets [ref]
    ("accept_replicas", "views"): "buffer_ref",  # the client puts the arrays in one object
}
# Port methods with no actor behind them (local bookkeeping of the adapter).
_LOCAL = {"node_store", "forget_node_store"}


def _methods(cls: type) -> set[str]:
    """Public methods a class defines, its Protocol bases' included (NodeStoreCalls
    extends ArenaCalls)."""
    return {
        name
        for klass in cls.__mro__
        if klass is not object
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_") and name not in _LOCAL
    }


def _params(cls: type, name: str, rename: dict[str, str] | None = None) -> list[tuple[Any, ...]]:
    """(name, kind, default) of each parameter but ``self``; annotations may differ
    (a port says NodeId where the actor takes the str Ray hands it)."""
    params = list(inspect.signature(getattr(cls, name)).parameters.values())[1:]
    rename = rename or {}
    return [
        (rename.get(p.name, p.name), p.kind, p.default)
        for p in params
        if p.name != "_ray_trace_ctx"  # added by Ray to a class it made an actor of
    ]


def _answer(cls: type, name: str) -> Any:
    """What a call's reply holds: ``T`` of its ``Reply[T]`` (a port) or ``Pending[T]``
    (a client), resolved."""
    (answer,) = get_args(get_type_hints(getattr(cls, name))["return"])
    return answer


def _client_renames(method: str) -> dict[str, str]:
    return {c: a for (m, c), a in _CLIENT_CONVERTS.items() if m == method}


@pytest.mark.parametrize(
    ("client", "actor"), [(EvictorClient, Evictor), (NodeStoreClient, NodeStore)]
)
def test_a_client_has_every_method_of_its_actor_with_its_parameters(
    client: type, actor: type
) -> None:
    assert _methods(client) == _methods(actor)
    for name in _methods(actor):
        assert _params(client, name, _client_renames(name)) == _params(actor, name), name


@pytest.mark.parametrize(
    ("port", "client"),
    [
        (EvictorPort, EvictorClient),  # a NodeStore's Evictor
        (EvictorCalls, EvictorClient),  # the scheduler's Evictor
        (NodeStoreCalls, NodeStoreClient),  # a worker's NodeStores (their arena calls too)
    ],
)
def test_a_port_is_a_part_of_its_client_with_its_parameters_and_answers(
    port: type, client: type
) -> None:
    assert _methods(port) <= _methods(client), _methods(port) - _methods(client)
    for name in _methods(port):
        assert _params(port, name) == _params(client, name), name
        assert _answer(port, name) == _answer(client, name), name


# Port parameters that say which Evictor shard a call goes to (not sent to it).
_ROUTING = {("locate", "root")}


def test_the_workers_evictor_calls_are_the_actors() -> None:
    """A worker's ports forward two calls to the Evictor (the rest are local); ``locate``
    also takes the root whose Evictor shard it asks."""
    assert _methods(WorkerPorts) <= _methods(Evictor)
    for name in _methods(WorkerPorts):
        sent = [p for p in _params(WorkerPorts, name) if (name, p[0]) not in _ROUTING]
        assert sent == _params(Evictor, name), name
        assert _params(RayWorkerPorts, name) == _params(WorkerPorts, name), name


def test_a_peer_push_is_the_node_stores_accept_replicas_addressed_to_a_node() -> None:
    assert _methods(PeerPort) == {"accept_replicas"}
    node, *rest = _params(PeerPort, "accept_replicas", _client_renames("accept_replicas"))
    assert node[0] == "node" and rest == _params(NodeStore, "accept_replicas")
    assert _params(RayPeers, "accept_replicas") == _params(PeerPort, "accept_replicas")
