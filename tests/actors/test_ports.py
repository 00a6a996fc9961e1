"""Ports and clients carry the names and parameters of the actor methods behind them
(STYLE.md point 9), so neither can drift from the actors: compared with ``inspect``."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from tierstore.actors.evictor import Evictor
from tierstore.actors.node_store_actor import NodeStore, RayEvictorPort, RayPeers
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
    ("port", "actor", "implementation"),
    [
        (EvictorPort, Evictor, RayEvictorPort),
        (EvictorCalls, Evictor, EvictorClient),
        (WorkerPorts, Evictor, RayWorkerPorts),
    ],
)
def test_a_port_names_its_actor_methods_with_their_parameters(
    port: type, actor: type, implementation: type
) -> None:
    assert _methods(port) <= _methods(actor), _methods(port) - _methods(actor)
    for name in _methods(port):
        assert _params(port, name) == _params(actor, name), name
        assert _params(implementation, name) == _params(port, name), name
    assert _methods(port) <= _methods(implementation) | _LOCAL


def test_node_store_ports_match_the_node_store_actor() -> None:
    """The worker's NodeStore calls are the client's (which sends the buffer as a ref);
    a peer push is the actor's ``accept_replicas``, addressed to a node."""
    for name in _methods(NodeStoreCalls):
        assert _params(NodeStoreCalls, name) == _params(NodeStoreClient, name), name
        assert _params(NodeStoreCalls, name, _client_renames(name)) == _params(NodeStore, name)
    assert _methods(PeerPort) == {"accept_replicas"}
    node, *rest = _params(PeerPort, "accept_replicas", _client_renames("accept_replicas"))
    assert node[0] == "node" and rest == _params(NodeStore, "accept_replicas")
    assert _params(RayPeers, "accept_replicas") == _params(PeerPort, "accept_replicas")
