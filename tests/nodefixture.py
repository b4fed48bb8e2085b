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
from typing import Any, TypeVar

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IReactorTime
from twisted.internet.protocol import ClientFactory
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.test.iosim import ConnectionCompleter, IOPump
from twisted.trial.unittest import SynchronousTestCase, TestCase

from sfnode.engines.config import EngineConfig
from sfnode.engines.mock import MOCK_VOCAB_SIZE, MockEngine, mock_next_token
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import GenerationOutcome, HeadIds, LinkSettings, NodeLink, connect_node
from sfnode.linkf.model_files import Bundle
from sfnode.linkf.wire import FINISH_CANCELLED, Lease
from sfnode.node.agent import NodeAgent
from sfnode.node.config import NodeConfig
from sfnode.node.protocol import NodeFactory
from sfnode.node.tap import node_factory

PROMPT = list(range(100, 112))
"""The context most node tests generate from."""
LONG_LEASE = Lease(60_000, 45_000)
"""A lease no test outlives."""
Gen = Generator[defer.Deferred[Any], Any, None]
"""What an ``inlineCallbacks`` test method returns."""


def expected_tokens(
    context: Sequence[int], count: int, vocab_size: int = MOCK_VOCAB_SIZE
) -> list[int]:
    """What the mock engine (of ``vocab_size`` ids) generates greedily from ``context``: the
    local reference run."""
    context = list(context)
    out = []
    for _ in range(count):
        token = mock_next_token(context, vocab_size)
        context.append(token)
        out.append(token)
    return out


def mock_node(
    reactor: IReactorTime,
    clock: IReactorTime,
    *,
    identity: str = "node-1",
    model_name: str = "mock",
    engine: Any = None,
    context_window: int = 4096,
    max_lanes: int = 8,
    token_delay_s: float = 0.0,
    poison_token: int | None = None,
    eos_token_id: int | None = None,
    supports_logprobs: bool = True,
    vocab_size: int = MOCK_VOCAB_SIZE,
    model_files: Bundle | None = None,
    **config: Any,
) -> tuple[NodeAgent, Any]:
    """A started node agent, its timers on ``clock``, offering ``model_files``, and its engine:
    ``engine``, or a MockEngine on ``reactor`` with the mock options given; ``config`` are
    further :class:`NodeConfig` fields."""
    if engine is None:
        engine = MockEngine(
            reactor,
            EngineConfig(context_window=context_window, max_lanes=max_lanes),
            token_delay_s=token_delay_s,
            poison_token=poison_token,
            eos_token_id=eos_token_id,
            supports_logprobs=supports_logprobs,
            vocab_size=vocab_size,
        )
    agent = NodeAgent(
        clock,
        engine,
        NodeConfig(identity=identity, model_name=model_name, max_lanes=max_lanes, **config),
        model_files=model_files,
    )
    agent.start()
    return agent, engine


def opened(link: NodeLink, session: int = 1, context: Sequence[int] = PROMPT) -> NodeLink:
    """``link`` with session ``session`` assigned and ``context`` (:data:`PROMPT`) appended."""
    link.assign(session)
    link.append(session, context)
    return link


@defer.inlineCallbacks
def serves(
    test: SynchronousTestCase, link: NodeLink, session: int, count: int
) -> Generator[defer.Deferred[Any], Any, None]:
    """Fails ``test`` unless ``link`` generates, in a new session ``session`` over
    :data:`PROMPT`, the ``count`` greedy tokens of the local run."""
    link.assign(session)
    link.append(session, PROMPT)
    outcome = yield link.generate(session, HeadRequest((), count)).result
    test.assertEqual(outcome.tokens, expected_tokens(PROMPT, count))


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
        self, *, clock: IReactorTime | None = None, port: int = 0, **options: Any
    ) -> Generator[defer.Deferred[Any], Any, RunningNode]:
        """A node (:func:`mock_node` with ``options``) on a loopback port (``port``, else a
        free one).

        With ``clock`` (a ``Clock``) the node's own timers (handshake, idle, lease, status,
        coalescing) run on it, so a test moves them when it decides; its sockets and the mock
        engine stay on the reactor.
        """
        agent, engine = mock_node(reactor, reactor if clock is None else clock, **options)
        return (yield self.serve(agent, engine, port))

    @defer.inlineCallbacks
    def serve(
        self, agent: NodeAgent, engine: Any, port: int = 0
    ) -> Generator[defer.Deferred[Any], Any, RunningNode]:
        """Start ``agent`` (starting is idempotent) and let heads dial it on loopback (``port``,
        else a free one); the port and the node stop when the test ends."""
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
    port: int = MEMORY_PORT
    """The memory port it listens on."""

    @property
    def endpoint(self) -> str:
        return f"tcp:127.0.0.1:{self.port}"


T = TypeVar("T")


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

    def start_node(self, **options: Any) -> MemoryNode:
        """A node (:func:`mock_node` with ``options``) listening on the memory reactor, each
        on a port of its own."""
        return self.serve(*mock_node(self.reactor, self.reactor, **options))

    def serve(self, agent: NodeAgent, engine: Any) -> MemoryNode:
        """Start ``agent`` (starting is idempotent) listening on a memory port of its own; it
        stops when the test ends."""
        agent.start()
        port = MEMORY_PORT + len(self.reactor.tcpServers)
        self.reactor.listenTCP(port, node_factory(agent), interface="127.0.0.1")

        def stop() -> None:
            stopped = agent.stop()
            self.flush()
            self.successResultOf(stopped)

        self.addCleanup(stop)
        return MemoryNode(agent, engine, port)

    def connect(self) -> None:
        """Join the oldest pending dial to the node's listener."""
        pump = self.completer.succeedOnce()
        assert pump is not None, "no connection was being dialled"
        self.pumps.append(pump)
        self.flush()

    def dial(self, node: MemoryNode | None = None, token: bytes = b"", **settings: Any) -> NodeLink:
        """A head link (the head library) to ``node`` (default: the first one), with ``token``
        and the other :class:`LinkSettings` given, connected and past its handshake."""
        endpoint = f"tcp:127.0.0.1:{MEMORY_PORT}" if node is None else node.endpoint
        d = connect_node(
            self.reactor, endpoint, ids=self.ids, settings=LinkSettings(token=token, **settings)
        )
        self.connect()
        link = self.wait(d)

        def close() -> None:
            closed = link.close()
            self.flush()
            self.successResultOf(closed)

        self.addCleanup(close)
        return link

    def raw_head(self, node: MemoryNode | None = None) -> RawHead:
        """A scripted head (:class:`RawHead`) connected to ``node`` (default: the first one),
        before its HELLO."""
        head = RawHead()
        port = MEMORY_PORT if node is None else node.port
        self.reactor.connectTCP("127.0.0.1", port, ClientFactory.forProtocol(lambda: head.protocol))
        self.connect()
        return head

    def assert_cancelled_after_five(self, outcome: GenerationOutcome, node: MemoryNode) -> None:
        """``outcome`` is that of a generation of :data:`PROMPT` (asked for far more than 1000
        tokens) cancelled once 5 tokens had come: CANCELLED, with at least those 5 and fewer
        than 1000, each the local run's; and ``node`` runs no generation any more."""
        self.assertEqual(outcome.finish, FINISH_CANCELLED)
        self.assertGreaterEqual(len(outcome.tokens), 5)
        self.assertLess(len(outcome.tokens), 1000)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, len(outcome.tokens)))
        self.assertEqual(node.agent.running_generations, 0)

    def fault_closes_only_its_link(self, node: MemoryNode, **assign: Any) -> None:
        """Fails the test unless an engine fault on one link to ``node`` (a generation over a
        context holding the token 666) closes that link and loses its generation, while a
        generation of 8 tokens over :data:`PROMPT` on another link completes exactly
        (docs/protocol.md section 7.4); ``assign`` are both sessions' ASSIGN options."""
        from sfnode.head.link import LinkLostError

        healthy = self.dial(node)
        doomed = self.dial(node)
        healthy.assign(1, **assign)
        healthy.append(1, PROMPT)
        doomed.assign(2, **assign)
        doomed.append(2, [1, 666])
        closed = doomed.when_closed()
        failed = doomed.generate(2, HeadRequest((), 5))
        self.wait(closed)
        self.wait_failure(failed.result, LinkLostError)
        outcome = self.wait(healthy.generate(1, HeadRequest((), 8)).result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 8))

    def wait(self, d: defer.Deferred[T], timeout_s: float = 60.0, step: float = 0.01) -> T:
        """What ``d`` fires with, once memory time has passed (in steps of ``step``; pending
        dials joined and the bytes moved before the first and after each) until it fired; a
        failure is raised.  A Deferred that has not fired within ``timeout_s`` of memory time
        fails the test."""
        self.accept_dials()
        for _ in range(round(timeout_s / step)):
            if d.called:
                break
            self.reactor.advance(step)
            self.accept_dials()
        results: list[T] = []
        failures: list[Failure] = []
        d.addCallbacks(results.append, failures.append)
        if failures:
            failures[0].raiseException()
        if not results:
            self.fail(f"{d!r} did not fire within {timeout_s} s of memory time")
        return results[0]

    def wait_failure(
        self, d: defer.Deferred[Any], *expected: type[BaseException], timeout_s: float = 60.0
    ) -> Failure:
        """The failure ``d`` fires with (one of ``expected``), waited for as :meth:`wait`."""
        try:
            result = self.wait(d, timeout_s)
        except expected:
            return Failure()
        self.fail(f"{d!r} fired with {result!r}, not a failure of {expected}")

    def accept_dials(self) -> None:
        """Join every pending dial to its listener, then move the bytes (a head's reconnect
        reaches its node as it would on a real reactor)."""
        while (pump := self.completer.succeedOnce()) is not None:
            self.pumps.append(pump)
        self.flush()

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

    def reconcile(
        self, session_id: int, epoch: int, watermarks: Sequence[tuple[int, int | None]] = ()
    ) -> defer.Deferred[Any]:
        """A RECONCILE of one session (command watermark 3) naming each generation's
        (id, watermark); fires with the RECONCILE_ACK that answers it."""
        from sfnode.linkf.wire import (
            GenerationWatermark,
            LeaseStateMsg,
            ReconcileAckMsg,
            ReconcileMsg,
            SessionReconcileState,
        )

        before = len(self.received)
        marks = tuple(GenerationWatermark(g, w) for g, w in watermarks)
        state = SessionReconcileState(session_id, epoch, LeaseStateMsg(LONG_LEASE, 0), 3, marks)
        self.send(ReconcileMsg((state,)))
        return self.wait_for(
            lambda m: isinstance(m, ReconcileAckMsg) and any(m is x for x in self.received[before:])
        )

    def following(self, message: Any) -> defer.Deferred[Any]:
        """Fires with the message received right after ``message``."""
        return self.wait_for(
            lambda m: any(
                earlier is message and later is m
                for earlier, later in zip(self.received, self.received[1:], strict=False)
            )
        )

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
