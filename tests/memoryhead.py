"""A head and its nodes in memory, for the tests whose subject is the head's logic.

:class:`MemoryHeadTestCase` runs mock nodes, the fleet and the HTTP API on one
``MemoryReactorClock`` (tests/nodefixture.py ``MemoryNodeTestCase``): the fleet's links and the
nodes are joined by ``twisted.test.iosim`` pumps, and an HTTP client speaks to the API's real
``Site`` and ``GuardedChannel`` over an in-memory transport (:meth:`MemoryHeadTestCase.http`),
so the whole path from the request's bytes to the node and back runs with no socket, no thread
and no sleep; time moves only when a test advances the clock.  The chat template is rendered on
the spot instead of on the API's worker threads (:class:`InlineWorkers`).

What is about sockets (back-pressure of unread streams, connection caps, TLS, real processes)
stays on real loopback TCP (tests/test_http.py ``HttpTestCase``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.test.iosim import ConnectionCompleter, FakeTransport, connect

from sfnode.head.api.http import OpenAIApi
from sfnode.head.fleet.fleet import Fleet, FleetNode, FleetSettings
from sfnode.head.fleet.model_admission import ModelAdmission
from sfnode.node.agent import NodeAgent
from tests.nodefixture import MemoryNode, MemoryNodeTestCase
from tests.tinymodel import TINY_VOCAB

# tests.test_http and tests.test_http_hostile (the tiny tokenizer, the raw client) are imported
# where they are used: their own tests import this module.

_T = TypeVar("_T")

FLEET_PORT = 8453
"""The port a memory head's fleet listens on for nodes that dial in (:meth:`dial_in`)."""


def stop_at_end(test: MemoryNodeTestCase, stop: Callable[[], Deferred[Any]]) -> None:
    """When ``test`` ends: ``stop()``, the bytes it sends moved, and its Deferred fired."""

    def stopped() -> None:
        done = stop()
        test.flush()
        test.successResultOf(done)

    test.addCleanup(stopped)


class ThreadlessReactor(MemoryReactorClock):
    """The memory reactor, where work handed back "from a thread" runs at once."""

    def callFromThread(self, f: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        f(*args, **kwargs)


class InlineWorkers:
    """The API's workers, run on the spot: rendering is not what these tests are about.
    ``clients`` are the turns the jobs were asked to run in, in order."""

    def __init__(self) -> None:
        self.clients: list[object] = []

    def run(self, work: Callable[[], _T], client: object = "", **budget: Any) -> Deferred[_T]:
        self.clients.append(client)
        return defer.maybeDeferred(work)

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class MemoryHead:
    """A fleet and its HTTP API on the memory reactor."""

    fleet: Fleet
    api: OpenAIApi


class MemoryHeadTestCase(MemoryNodeTestCase):
    """Mock nodes, fleets and their HTTP API, all in memory.  Every node listens on a port of
    its own; a dial (a fleet adding a node, or redialling one) is joined to its node's
    listener whenever time passes (:meth:`advance`)."""

    def setUp(self) -> None:
        super().setUp()
        self.reactor = ThreadlessReactor()
        self.completer = ConnectionCompleter(self.reactor)
        self._clients = 0
        self.started: list[MemoryNode] = []

    def start_mock_node(self, identity: str = "node", **options: Any) -> MemoryNode:
        """A mock node (:func:`~tests.nodefixture.mock_node`'s ``options``: the mock's,
        ``model_files``, more NodeConfig fields) on a port of its own."""
        return self.start_node(identity=identity, **options)

    def serve(self, agent: NodeAgent, engine: Any) -> MemoryNode:
        """:meth:`MemoryNodeTestCase.serve`, the node counted among :attr:`started`."""
        node = super().serve(agent, engine)
        self.started.append(node)
        return node

    def start_vocab_node(self, identity: str = "node", **options: Any) -> MemoryNode:
        """A mock node whose tokens are ids of the tiny tokenizer (vocabulary 512)."""
        return self.start_mock_node(identity, vocab_size=TINY_VOCAB, **options)

    def fleet_of(
        self,
        nodes: Sequence[MemoryNode],
        *,
        retry: Callable[[int], float] = lambda failures: 0.05,
        models: ModelAdmission | None = None,
        **settings: Any,
    ) -> Fleet:
        """A fleet (``settings``: :class:`FleetSettings` fields; ``models``: its model
        admission) that dialed ``nodes``; its links redial every 50 ms."""
        settings_value = FleetSettings(**settings)
        fleet = Fleet(self.reactor, settings_value, ids=self.ids, retry=retry, models=models)
        for node in nodes:
            self.wait(fleet.add_node(node.endpoint))
        stop_at_end(self, fleet.stop)
        return fleet

    def on(self, fleet: Fleet, node: MemoryNode) -> FleetNode:
        """``node`` as ``fleet`` knows it."""
        found = fleet.node_named(node.agent.config.identity)
        assert found is not None
        return found

    def start_head(
        self,
        nodes: Sequence[MemoryNode] | None = None,
        *,
        fleet_options: dict[str, Any] | None = None,
        tok: Any = None,
        **api: Any,
    ) -> MemoryHead:
        """A fleet that dialed ``nodes`` (default: every node started), with
        ``fleet_options`` (:class:`FleetSettings` fields), the tokenizer ``tok`` (default: the
        tiny one) and ``api``: more OpenAIApi keywords (``limits``, ``api_keys``, ...)."""
        from tests.test_http import MODEL, tokenizer

        nodes = self.started if nodes is None else nodes
        fleet = self.fleet_of(nodes, **(fleet_options or {}))
        head = OpenAIApi(
            self.reactor,
            fleet,
            tok if tok is not None else tokenizer(),
            MODEL,
            seed_source=lambda: 7,
            workers=InlineWorkers(),  # type: ignore[arg-type]
            **api,
        )
        self.addCleanup(head.stop)
        return MemoryHead(fleet, head)

    def dial_in(
        self, head: MemoryHead, identity: str, model_name: str, bundle: Any, vocab: int
    ) -> NodeAgent:
        """A mock node with the model files ``bundle`` that dials the head's fleet port (opened
        on first use) and has joined; it leaves the fleet when it closes."""
        from twisted.internet.endpoints import TCP4ClientEndpoint

        from sfnode.engines.mock import MockEngine
        from sfnode.node.config import NodeConfig
        from sfnode.node.tap import node_factory

        if FLEET_PORT not in [server[0] for server in self.reactor.tcpServers]:
            self.reactor.listenTCP(FLEET_PORT, head.fleet.listen_factory(), interface="127.0.0.1")
        engine = MockEngine(self.reactor, vocab_size=vocab)
        config = NodeConfig(identity=identity, model_name=model_name)
        agent = NodeAgent(self.reactor, engine, config, model_files=bundle)
        agent.start()
        stop_at_end(self, agent.stop)
        joined = head.fleet.next_join()
        TCP4ClientEndpoint(self.reactor, "127.0.0.1", FLEET_PORT).connect(node_factory(agent))
        self.wait(joined)
        return agent

    def advance(self, seconds: float, step: float = 0.01) -> None:
        """Let ``seconds`` pass in steps of ``step``, joining pending dials and moving the
        bytes after each."""
        for _ in range(round(seconds / step)):
            self.reactor.advance(step)
            self.accept_dials()

    def http(self, head: MemoryHead, address: str = "127.0.0.1", client: Any = None) -> Any:
        """A client (``client``, else a raw one: ``tests.test_http_hostile.RawClient``)
        connected to the head's site from ``address`` over an in-memory transport; what it
        sends moves as the test flushes or advances the clock."""
        from tests.test_http_hostile import RawClient

        self._clients += 1
        peer = IPv4Address("TCP", address, 40000 + self._clients)
        host = IPv4Address("TCP", "127.0.0.1", 8080)
        server = head.api.site().buildProtocol(peer)
        client = client if client is not None else RawClient()
        pump = connect(
            server,
            FakeTransport(server, isServer=True, hostAddress=host, peerAddress=peer),
            client,
            FakeTransport(client, isServer=False, hostAddress=peer, peerAddress=host),
            greet=False,
        )
        self.pumps.append(pump)
        self.flush()
        return client

    def until(self, done: Callable[[], bool], within: float = 30.0, step: float = 0.01) -> None:
        """Let time pass until ``done()``, looking every ``step`` seconds (the clock itself
        moves in the 10 ms steps of :meth:`advance`, as a real reactor's turns would); the
        test fails if ``within`` seconds pass first."""
        waited = 0.0
        while not done():
            if waited >= within:
                self.fail(f"not done within {within:g} s of the memory clock")
            self.advance(step)
            waited += step

    def call(
        self, head: MemoryHead, method: bytes, path: str, body: Any = None, raw: bytes | None = None
    ) -> tuple[int, bytes]:
        """The status and body of one request: ``body`` as JSON, or ``raw`` bytes."""
        from tests.test_http_hostile import request_bytes

        data = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
        request = request_bytes(path, data, method=method.decode())
        status, _, content = self.exchange(head, request)
        return status, content

    def exchange(
        self, head: MemoryHead, data: bytes, address: str = "127.0.0.1", within: float = 10.0
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        """Send ``data`` (a ``Connection: close`` request) on a new connection and read the
        answer until the head closes it, letting at most ``within`` seconds pass."""
        from tests.test_http_hostile import response_of

        client = self.http(head, address)
        client.send(data)
        self.flush()
        self.until(lambda: client.closed, within, 0.05)
        return response_of(self.successResultOf(client.ended))


__all__ = [
    "InlineWorkers",
    "MemoryHead",
    "MemoryHeadTestCase",
    "ThreadlessReactor",
    "stop_at_end",
]
