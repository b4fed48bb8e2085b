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

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.test.iosim import ConnectionCompleter, FakeTransport, connect

from sfnode.generation import MockEngine
from sfnode.head.api.http import OpenAIApi
from sfnode.head.fleet.fleet import Fleet, FleetSettings
from tests.nodefixture import MEMORY_PORT, MemoryNode, MemoryNodeTestCase
from tests.tinymodel import TINY_VOCAB

# tests.test_http and tests.test_http_hostile (the tiny tokenizer, the raw client) are imported
# where they are used: their own tests import this module.

_T = TypeVar("_T")


class ThreadlessReactor(MemoryReactorClock):
    """The memory reactor, where work handed back "from a thread" runs at once."""

    def callFromThread(self, f: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        f(*args, **kwargs)


class InlineWorkers:
    """The API's workers, run on the spot: rendering is not what these tests are about."""

    def run(self, work: Callable[[], _T]) -> Deferred[_T]:
        return defer.maybeDeferred(work)

    def stop(self) -> None:
        pass


class MemoryHeadTestCase(MemoryNodeTestCase):
    """Mock nodes (tokens of the tiny tokenizer), a fleet and its HTTP API, all in memory."""

    def setUp(self) -> None:
        super().setUp()
        self.reactor = ThreadlessReactor()
        self.completer = ConnectionCompleter(self.reactor)
        self._clients = 0

    def start_vocab_node(self, *, token_delay_s: float = 0.0, **options: Any) -> MemoryNode:
        """A mock node whose tokens are ids of the tiny tokenizer (vocabulary 512)."""
        engine = MockEngine(
            self.reactor,
            token_delay_s=token_delay_s,
            vocab_size=TINY_VOCAB,
            context_window=options.pop("context_window", 4096),
            max_lanes=options.get("max_lanes", 8),
        )
        return self.start_node(identity="node", engine=engine, **options)

    def start_head(
        self, nodes: int = 1, *, settings: FleetSettings | None = None, **api: Any
    ) -> OpenAIApi:
        """The API of a fleet that dialed the memory node (``nodes`` 0: none), with
        ``api``: more OpenAIApi keywords (``limits``, ``api_keys``, ...)."""
        from tests.test_http import MODEL, tokenizer

        fleet = Fleet(self.reactor, settings or FleetSettings(), ids=self.ids)
        for _ in range(nodes):
            added = fleet.add_node(f"tcp:127.0.0.1:{MEMORY_PORT}")
            self.connect()
            self.successResultOf(added)
        head = OpenAIApi(
            self.reactor,
            fleet,
            tokenizer(),
            MODEL,
            seed_source=lambda: 7,
            workers=InlineWorkers(),  # type: ignore[arg-type]
            **api,
        )

        def stop() -> None:
            head.stop()
            stopped = fleet.stop()
            self.flush()
            self.successResultOf(stopped)

        self.addCleanup(stop)
        return head

    def http(self, api: OpenAIApi, address: str = "127.0.0.1", client: Any = None) -> Any:
        """A client (``client``, else a raw one: ``tests.test_http_hostile.RawClient``)
        connected to ``api``'s site from ``address`` over an in-memory transport; what it
        sends moves as the test flushes or advances the clock."""
        from tests.test_http_hostile import RawClient

        self._clients += 1
        peer = IPv4Address("TCP", address, 40000 + self._clients)
        host = IPv4Address("TCP", "127.0.0.1", 8080)
        server = api.site().buildProtocol(peer)
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

    def exchange(
        self, api: OpenAIApi, data: bytes, address: str = "127.0.0.1", within: float = 10.0
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        """Send ``data`` (a ``Connection: close`` request) on a new connection and read the
        answer until the head closes it, letting at most ``within`` seconds pass."""
        from tests.test_http_hostile import response_of

        client = self.http(api, address)
        client.send(data)
        self.flush()
        self.until(lambda: client.closed, within, 0.05)
        return response_of(self.successResultOf(client.ended))


__all__ = ["InlineWorkers", "MemoryHeadTestCase", "ThreadlessReactor"]
