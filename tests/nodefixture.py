"""Nodes for tests: a NodeAgent with a mock engine, and heads that talk to it.

:class:`NodeTestCase` runs the node on real loopback TCP and the real reactor.
:class:`MemoryNodeTestCase` runs the same node and the same heads on a ``MemoryReactorClock``
joined by ``twisted.test.iosim``: no socket, no sleep, time moves only when the test advances
the clock, so lease, idle and handshake timeouts are tested exactly and at once.

Used by the node conformance tests (the upstream behaviours of docs/protocol.md section 10) and
anything else that needs a live node.  Everything either starts is stopped by the test's
cleanups, so the reactor is left clean.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IReactorTime
from twisted.internet.protocol import ClientFactory
from twisted.internet.testing import MemoryReactorClock
from twisted.test.iosim import ConnectionCompleter, IOPump
from twisted.trial.unittest import SynchronousTestCase, TestCase

from sfnode.generation import MOCK_VOCAB_SIZE, MockEngine, mock_next_token
from sfnode.head.link import HeadIds, LinkSettings, NodeLink, connect_node
from sfnode.node.agent import NodeAgent
from sfnode.node.config import NodeConfig
from sfnode.node.protocol import NodeFactory
from sfnode.node.tap import node_factory


def expected_tokens(context: Sequence[int], count: int) -> list[int]:
    """What the mock engine generates greedily from ``context``: the local reference run."""
    context = list(context)
    out = []
    for _ in range(count):
        token = mock_next_token(context)
        context.append(token)
        out.append(token)
    return out


class RunningNode:
    """A node listening on 127.0.0.1 with a free port."""

    def __init__(
        self,
        agent: NodeAgent,
        engine: MockEngine,
        port: IListeningPort,
        factory: IProtocolFactory | None = None,
    ) -> None:
        self.agent = agent
        self.engine = engine
        self.port = port
        self.factory = factory
        """The factory it listens with (``sfnode.node.tap.node_factory``), Noise wrapper
        included."""

    @property
    def node_factory(self) -> NodeFactory:
        """The node's own factory inside any Noise wrapper (its connections, its limits)."""
        factory = getattr(self.factory, "wrappedFactory", self.factory)
        assert isinstance(factory, NodeFactory)
        return factory

    @property
    def endpoint(self) -> str:
        return f"tcp:127.0.0.1:{self.port.getHost().port}"  # type: ignore[attr-defined]

    @property
    def port_number(self) -> int:
        return int(self.port.getHost().port)  # type: ignore[attr-defined]


class NodeTestCase(TestCase):
    """A trial TestCase that can start nodes and dial them with head links."""

    def setUp(self) -> None:
        self.ids = HeadIds()

    @defer.inlineCallbacks
    def start_node(
        self,
        *,
        identity: str = "node-1",
        model_name: str = "mock",
        context_window: int = 4096,
        max_lanes: int = 8,
        token_delay_s: float = 0.0,
        poison_token: int | None = None,
        eos_token_id: int | None = None,
        supports_logprobs: bool = True,
        vocab_size: int = MOCK_VOCAB_SIZE,
        engine: Any = None,
        clock: IReactorTime | None = None,
        port: int = 0,
        **config: Any,
    ) -> Generator[defer.Deferred[Any], Any, RunningNode]:
        """A node on a loopback port (``port``, else a free one); ``engine`` replaces its mock
        engine.

        With ``clock`` (a ``Clock``) the node's own timers (handshake, idle, lease, status,
        coalescing) run on it, so a test moves them when it decides; its sockets and the mock
        engine stay on the reactor.
        """
        if engine is None:
            engine = MockEngine(
                reactor,
                context_window=context_window,
                max_lanes=max_lanes,
                token_delay_s=token_delay_s,
                poison_token=poison_token,
                eos_token_id=eos_token_id,
                supports_logprobs=supports_logprobs,
                vocab_size=vocab_size,
            )
        agent = NodeAgent(
            reactor if clock is None else clock,
            engine,
            NodeConfig(identity=identity, model_name=model_name, max_lanes=max_lanes, **config),
        )
        return (yield self.serve(agent, engine, port))

    @defer.inlineCallbacks
    def serve(
        self, agent: NodeAgent, engine: Any, port: int = 0
    ) -> Generator[defer.Deferred[Any], Any, RunningNode]:
        """Start ``agent`` and let heads dial it on loopback (``port``, else a free one); the
        port and the node stop when the test ends."""
        agent.start()
        factory = node_factory(agent)
        listening = yield TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(factory)
        # Cleanups run last-in first-out: links close, then the port, then the node.
        self.addCleanup(agent.stop)
        self.addCleanup(listening.stopListening)
        return RunningNode(agent, engine, listening, factory)

    @defer.inlineCallbacks
    def dial(
        self, node: RunningNode, token: bytes = b"", **settings: Any
    ) -> Generator[defer.Deferred[Any], Any, NodeLink]:
        """An open link to ``node``, with ``token`` and the other :class:`LinkSettings`
        given (closed when the test ends)."""
        link = yield connect_node(
            reactor, node.endpoint, ids=self.ids, settings=LinkSettings(token=token, **settings)
        )
        self.addCleanup(link.close)
        return link


MEMORY_PORT = 8454
"""The port a memory node listens on (nothing is bound: the reactor is a memory reactor)."""


@dataclass
class MemoryNode:
    """A node on a memory reactor (:class:`MemoryNodeTestCase`)."""

    agent: NodeAgent
    engine: MockEngine


class MemoryNodeTestCase(SynchronousTestCase):
    """A node and its heads on one ``MemoryReactorClock``, their bytes moved by iosim pumps.

    :meth:`advance` moves time in small steps and moves the bytes after each, as a real reactor
    would in that time; nothing else moves the clock.
    """

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.completer = ConnectionCompleter(self.reactor)
        self.pumps: list[IOPump] = []
        self.ids = HeadIds()

    def start_node(
        self,
        *,
        identity: str = "node-1",
        token_delay_s: float = 0.0,
        engine: MockEngine | None = None,
        **config: Any,
    ) -> MemoryNode:
        """A node listening on the memory reactor, on ``engine`` (default: a new MockEngine)."""
        if engine is None:
            engine = MockEngine(self.reactor, token_delay_s=token_delay_s)
        agent = NodeAgent(
            self.reactor, engine, NodeConfig(identity=identity, model_name="mock", **config)
        )
        agent.start()
        self.reactor.listenTCP(MEMORY_PORT, node_factory(agent), interface="127.0.0.1")

        def stop() -> None:
            stopped = agent.stop()
            self.flush()
            self.successResultOf(stopped)

        self.addCleanup(stop)
        return MemoryNode(agent, engine)

    def connect(self) -> None:
        """Join the oldest pending dial to the node's listener."""
        pump = self.completer.succeedOnce()
        assert pump is not None, "no connection was being dialled"
        self.pumps.append(pump)
        self.flush()

    def dial(self) -> NodeLink:
        """A head link (the head library) connected and past its handshake."""
        d = connect_node(self.reactor, f"tcp:127.0.0.1:{MEMORY_PORT}", ids=self.ids)
        self.connect()
        link = self.successResultOf(d)

        def close() -> None:
            closed = link.close()
            self.flush()
            self.successResultOf(closed)

        self.addCleanup(close)
        return link

    def raw_head(self) -> RawHead:
        """A scripted head (:class:`RawHead`) connected, before its HELLO."""
        head = RawHead()
        self.reactor.connectTCP(
            "127.0.0.1", MEMORY_PORT, ClientFactory.forProtocol(lambda: head.protocol)
        )
        self.connect()
        return head

    def flush(self) -> None:
        """Move every pending byte both ways until nothing moves (and run what is due now)."""
        moved = True
        while moved:
            moved = False
            for pump in self.pumps:
                moved = pump.pump() or moved

    def advance(self, seconds: float, step: float = 0.01) -> None:
        """Let ``seconds`` pass in steps of ``step``, moving the bytes after each."""
        steps = round(seconds / step)
        for _ in range(steps):
            self.reactor.advance(step)
            self.flush()


class RawHead:
    """A scripted head that sends exactly what a test says and records every message.

    Unlike :class:`~sfnode.head.link.NodeLink` it acknowledges nothing and grants nothing on
    its own, so a test can hold back acks and grants, replay commands and send bad bytes.
    """

    def __init__(self) -> None:
        from twisted.internet.protocol import Protocol

        from sfnode.linkf.wire import FrameDecoder, decode_frame

        head = self
        self.received: list[Any] = []
        self.lost: defer.Deferred[None] = defer.Deferred()
        self._waiters: list[tuple[Any, defer.Deferred[Any]]] = []
        self._seq = 0

        class _Protocol(Protocol):
            def __init__(self) -> None:
                self.decoder = FrameDecoder()

            def dataReceived(self, data: bytes) -> None:
                for frame in self.decoder.feed(data):
                    head._deliver(decode_frame(frame))

            def connectionLost(self, reason: Any = None) -> None:
                head.lost.callback(None)

        self.protocol = _Protocol()

    @classmethod
    @defer.inlineCallbacks
    def connect(
        cls, test: TestCase, node: RunningNode
    ) -> Generator[defer.Deferred[Any], Any, RawHead]:
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        head = cls()
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", node.port_number)
        yield connectProtocol(endpoint, head.protocol)

        def close() -> defer.Deferred[None]:
            if not head.lost.called:
                head.protocol.transport.loseConnection()
            return head.lost

        test.addCleanup(close)
        return head

    def send(self, message: Any) -> None:
        from sfnode.linkf.wire import message_frame

        self._seq += 1
        self.protocol.transport.write(message_frame(message, self._seq))

    def send_bytes(self, data: bytes) -> None:
        self.protocol.transport.write(data)

    def hello(self, token: bytes = b"", head_id: int | None = None) -> defer.Deferred[Any]:
        """HELLO (naming ``head_id`` as its identity, when given); fires with the ack."""
        from sfnode.linkf.wire import Hello, HelloAckF, LinkRole

        self.send(Hello((2, 2), LinkRole.HEAD_DAEMON, token, head_id))
        return self.wait_for(lambda m: isinstance(m, HelloAckF))

    def wait_for(self, predicate: Any) -> defer.Deferred[Any]:
        """Fires with the first message (already received or still to come) that matches."""
        for message in self.received:
            if predicate(message):
                return defer.succeed(message)
        d: defer.Deferred[Any] = defer.Deferred()
        self._waiters.append((predicate, d))
        return d

    def of_type(self, cls: type[Any]) -> list[Any]:
        """Every message of class ``cls`` received so far, in order."""
        return [m for m in self.received if isinstance(m, cls)]

    def events(self, session_id: int, generation_id: int) -> list[Any]:
        from sfnode.linkf.wire import TokenEventsMsg

        return [
            e
            for m in self.received
            if isinstance(m, TokenEventsMsg)
            for e in m.events
            if (e.session_id, e.generation_id) == (session_id, generation_id)
        ]

    def _deliver(self, message: Any) -> None:
        self.received.append(message)
        for waiter in list(self._waiters):
            predicate, d = waiter
            if predicate(message):
                self._waiters.remove(waiter)
                d.callback(message)


def finish_of(session_id: int, generation_id: int, reason: int | None = None) -> Any:
    """A RawHead predicate: a TOKEN_EVENTS batch holding the Finish of this generation (with
    this reason, when one is given)."""
    from sfnode.linkf.wire import Finish, TokenEventsMsg

    def predicate(message: Any) -> bool:
        return isinstance(message, TokenEventsMsg) and any(
            (e.session_id, e.generation_id) == (session_id, generation_id)
            and isinstance(e.payload, Finish)
            and (reason is None or e.payload.reason == reason)
            for e in message.events
        )

    return predicate


def stream_of(events: Sequence[Any]) -> tuple[list[int], list[int]]:
    """The tokens and the Finish reasons of a generation's events, in event order."""
    from sfnode.linkf.wire import Finish, Tokens

    tokens = [t for e in events if isinstance(e.payload, Tokens) for t in e.payload.tokens]
    finishes = [e.payload.reason for e in events if isinstance(e.payload, Finish)]
    return tokens, finishes
