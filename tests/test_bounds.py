"""Tests of the node's bounds against a misbehaving head (issue 5, point 4): those about the
transport's buffers over real loopback TCP, the others with the head joined in memory.

Each bound has a default (``sfnode.node.config``), an option (``twistd sfnode --max-...``) and a
test here that reaches it and shows it holding:

- ``max_unacked_events``: a head that never acknowledges; past the cap the generation stops
  with no Finish, its session is fenced (logged), and the events stay for a RECONCILE;
- back-pressure and ``max_held_tokens``: a head that stops reading pauses its connection (the
  node stops reading from it too), its generations hold their tokens, and past the cap they
  stop; the transport's buffer stays bounded; once the head reads again everything sent is
  contiguous;
- a flood of small frames from a head that does not read stops being read, so the node's
  buffered output stays bounded however much the head sends;

every buffered figure is sampled while the misbehaviour goes on (:class:`BufferSampler`) and
its maximum is asserted;
- ``max_sessions``: an ASSIGN beyond it is refused and that session's GENERATE gets
  FINISH_REFUSED (an unknown session still gets FINISH_DECLINED);
- ``max_generations``: beyond it a GENERATE is declined at once;
- a huge APPEND: a frame longer than MAX_FRAME closes the connection as soon as its length
  arrives, and the node serves other connections as before.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from twisted.internet import defer
from twisted.internet.task import LoopingCall
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import provider

from sfnode.head.fleet.backend import HeadRequest
from sfnode.linkf.wire import (
    FINISH_DECLINED,
    FINISH_LENGTH,
    MAX_FRAME,
    AppendContentMsg,
    Finish,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    HelloAckF,
    Lease,
    SessionAssignMsg,
    SessionRevokeMsg,
    TelemetryMsg,
    Tokens,
    encode_tokens,
)
from sfnode.node.config import (
    DEFAULT_MAX_GENERATIONS,
    DEFAULT_MAX_HELD_TOKENS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_UNACKED_EVENTS,
)
from sfnode.node.protocol import NodeProtocol
from tests.nodefixture import (
    PROMPT,
    Gen,
    MemoryNodeTestCase,
    NodeTestCase,
    RawHead,
    expected_tokens,
    finish_of,
    serves,
)

LEASE = Lease(600_000, 450_000)


class Bounds:
    """What every bounds test does: place sessions and ask for generations with fresh command
    ids, and wait for log lines."""

    def setUp(self) -> None:
        super().setUp()  # type: ignore[misc]
        self.command = 0

    def next_command(self) -> int:
        self.command += 1
        return self.command

    def place(self, head: RawHead, session: int, epoch: int = 1) -> None:
        head.send(SessionAssignMsg(self.next_command(), session, epoch, LEASE, "", b"", 0, 0))
        head.send(AppendContentMsg(self.next_command(), session, epoch, encode_tokens(PROMPT)))

    def generate(
        self, head: RawHead, session: int, generation: int, max_new: int, epoch: int = 1
    ) -> None:
        head.send(
            GenerateReqMsg(
                self.next_command(), session, epoch, generation, GenerationBudgetsMsg(max_new)
            )
        )

    def log_lines(self, fragment: str, count: int = 1) -> defer.Deferred[list[str]]:
        """Fires with the log lines once ``count`` of them contained ``fragment``."""
        seen: list[str] = []
        d: defer.Deferred[list[str]] = defer.Deferred()

        @provider(ILogObserver)
        def observe(event: dict[str, Any]) -> None:
            text = formatEvent(event)
            if fragment in text and not d.called:
                seen.append(text)
                if len(seen) >= count:
                    d.callback(seen)

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)  # type: ignore[attr-defined]
        return d


class BoundsTestCase(Bounds, NodeTestCase):
    """Bounds over real loopback TCP: those that are about the transport's buffers."""


class MemoryBoundsTestCase(Bounds, MemoryNodeTestCase):
    """Bounds of the node's logic, the head joined in memory."""


def node_protocol(node: Any, head: RawHead) -> NodeProtocol:
    """The node's end of ``head``'s connection (found by the head's local port)."""
    port = head.protocol.transport.getHost().port
    (protocol,) = [p for p in node.agent.protocols if p.transport.getPeer().port == port]
    assert isinstance(protocol, NodeProtocol)
    return protocol


def buffered(transport: Any) -> int:
    """Bytes a Twisted TCP transport holds but has not written to the socket yet."""
    return len(transport.dataBuffer) - transport.offset + transport._tempDataLen


class BufferSampler:
    """Samples a node connection's unsent bytes while a test runs: every 5 ms (on a loaded
    machine, less often) and whenever the test calls :meth:`sample`.  The bound is asserted on
    every sample, so a test fails as soon as it is passed instead of waiting for its end."""

    def __init__(self, transport: Any, limit: int) -> None:
        self._transport = transport
        self.limit = limit
        self.samples: list[int] = []
        self._loop = LoopingCall(self.sample)
        self._watching: list[defer.Deferred[Any]] = []

    def sample(self, *_: object) -> None:
        value = buffered(self._transport)
        self.samples.append(value)
        if value >= self.limit:
            self.stop()
            watching, self._watching = self._watching, []
            for d in watching:
                d.errback(AssertionError(f"{value} bytes unsent, the bound is {self.limit}"))

    def start(self, test: BoundsTestCase) -> BufferSampler:
        self._loop.start(0.005, now=True)
        test.addCleanup(self.stop)
        return self

    def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()

    def watch(self, d: defer.Deferred[Any]) -> defer.Deferred[Any]:
        """``d``'s result, or a failure as soon as a sample reaches the limit."""
        watched: defer.Deferred[Any] = defer.Deferred()
        self._watching.append(watched)

        def done(result: Any) -> None:
            if watched in self._watching:
                self._watching.remove(watched)
                watched.callback(result)

        d.addBoth(done)
        return watched

    @property
    def maximum(self) -> int:
        return max(self.samples)


class UnackedTests(MemoryBoundsTestCase):
    def test_a_head_that_never_acks_fences_the_session(self) -> None:
        """max_unacked_events=4 (default 4096): the 5th event of a generation nobody acks is
        not sent; the generation stops (no Finish, engine idle), the session is fenced with a
        log line, the 4 events stay buffered, and a new GENERATE there is DECLINED."""
        self.assertEqual(DEFAULT_MAX_UNACKED_EVENTS, 4096)
        node = self.start_node(max_unacked_events=4)
        fenced = self.log_lines("fenced session 1")
        head = self.raw_head(node)
        self.wait(head.hello())
        self.place(head, 1)
        self.generate(head, 1, 1, 100_000)
        (line,) = self.wait(fenced)
        self.assertIn("max_unacked_events 4", line)
        self.assertTrue(node.agent.session.is_fenced(1))
        self.assertEqual(node.agent.session.unacked_events(1, 1), 4)
        self.generate(head, 1, 2, 5)
        self.wait(head.wait_for(finish_of(1, 2, FINISH_DECLINED)))
        events = head.events(1, 1)
        self.assertEqual([e.event_seq for e in events], [0, 1, 2, 3])
        self.assertFalse(any(isinstance(e.payload, Finish) for e in events))
        tokens = [t for e in events for t in e.payload.tokens]
        self.assertEqual(tokens, expected_tokens(PROMPT, len(tokens)))
        self.assertEqual(node.agent.running_generations, 0)
        self.assertEqual(node.engine.statistics().lanes_active, 0)


class SlowReaderTests(BoundsTestCase):
    def shrink_buffers(self, head: RawHead, node: Any) -> NodeProtocol:
        """Small socket buffers on both ends, so a few hundred KB fill the path."""
        head.protocol.transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        protocol = node_protocol(node, head)
        protocol.transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return protocol

    @defer.inlineCallbacks
    def test_a_head_that_stops_reading_pauses_and_bounds_the_node(self) -> Gen:
        """A head that stops reading pauses its connection (back-pressure from the transport),
        each generation holds at most max_held_tokens=256 tokens (default 65536) and then
        stops with a log line; the node's unsent output, sampled all along, never reaches
        256 KiB; when the head reads
        again it gets contiguous events (no Finish for the stopped generations) and the
        connection serves a new generation correctly."""
        self.assertEqual(DEFAULT_MAX_HELD_TOKENS, 65_536)
        node = yield self.start_node(max_held_tokens=256, max_lanes=4, context_window=1 << 30)
        head = yield RawHead.connect(self, node)
        yield head.hello()
        protocol = self.shrink_buffers(head, node)
        stopped = self.log_lines("has not read for", count=4)
        sampler = BufferSampler(protocol.transport, 256 * 1024).start(self)
        head.protocol.transport.pauseProducing()
        for session in (1, 2, 3, 4):
            self.place(head, session)
            self.generate(head, session, 1, 10_000_000)
        yield sampler.watch(stopped)
        sampler.stop()
        self.assertTrue(protocol.paused)
        self.assertGreater(len(sampler.samples), 1)
        self.assertLess(sampler.maximum, 256 * 1024)
        print(f"\nslow reader: {len(sampler.samples)} samples, at most {sampler.maximum} B unsent")
        resumed: defer.Deferred[None] = defer.Deferred()
        original = node.agent.connection_writable

        def writable(connection: Any, value: bool) -> None:
            original(connection, value)
            if value and not resumed.called:
                resumed.callback(None)

        node.agent.connection_writable = writable  # type: ignore[method-assign]
        head.protocol.transport.resumeProducing()
        yield resumed
        self.place(head, 5)
        self.generate(head, 5, 1, 20)
        yield head.wait_for(finish_of(5, 1, FINISH_LENGTH))
        self.assertEqual(node.agent.running_generations, 0)
        self.assertEqual(node.engine.statistics().lanes_active, 0)
        for session in (1, 2, 3, 4):
            events = head.events(session, 1)
            self.assertEqual([e.event_seq for e in events], list(range(len(events))))
            self.assertFalse(any(isinstance(e.payload, Finish) for e in events))
            tokens = [t for e in events if isinstance(e.payload, Tokens) for t in e.payload.tokens]
            self.assertEqual(tokens, expected_tokens(PROMPT, len(tokens)))
        tokens5 = [t for e in head.events(5, 1) if isinstance(e.payload, Tokens)
                   for t in e.payload.tokens]  # fmt: skip
        self.assertEqual(tokens5, expected_tokens(PROMPT, 20))

    @defer.inlineCallbacks
    def test_a_flood_from_a_head_that_does_not_read_stays_bounded(self) -> Gen:
        """A head that sends 100 000 GENERATE_REQs for an unknown session (each answered by a
        DECLINED Finish) and reads nothing: the node pauses and stops reading from it.  Its
        unsent output, sampled while a second head runs 40 generations (each exact) beside
        the flood, never reaches 1 MiB, while 100 000 answers would take about 4 MB: a node
        that kept reading would have read the whole flood in those hundreds of reactor turns.
        """
        node = yield self.start_node()
        other = yield self.dial(node)
        head = yield RawHead.connect(self, node)
        yield head.hello()
        protocol = self.shrink_buffers(head, node)
        paused = self.log_lines("stopped reading: pausing this connection")
        head.protocol.transport.pauseProducing()
        request = GenerateReqMsg(0, 77, 1, 1, GenerationBudgetsMsg(1))
        from sfnode.linkf.wire import message_frame

        flood = b"".join(
            message_frame(GenerateReqMsg(i, 77, 1, i, request.budgets), i)
            for i in range(1, 100_001)
        )
        sampler = BufferSampler(protocol.transport, 1024 * 1024).start(self)
        head.send_bytes(flood)
        for session in range(1, 41):
            other.assign(session)
            other.append(session, [*PROMPT, session])
            call = other.generate(session, HeadRequest((), 6), on_tokens=sampler.sample)
            outcome = yield sampler.watch(call.result)
            self.assertEqual(outcome.tokens, expected_tokens([*PROMPT, session], 6))
            other.revoke(session)
        yield paused
        sampler.stop()
        self.assertTrue(protocol.paused)
        self.assertGreater(len(sampler.samples), 40)
        self.assertLess(sampler.maximum, 1024 * 1024)
        print(f"\nflood: {len(sampler.samples)} samples, at most {sampler.maximum} B unsent")
        # What the handshake brought (HELLO_ACK_F and the TELEMETRY of what the node runs on,
        # docs/protocol.md section 12.9) is no answer to the flood.
        answered = sum(1 for m in head.received if not isinstance(m, (HelloAckF, TelemetryMsg)))
        self.assertEqual(answered, 0)
        # Its 4 MB are still queued on the head's side: abort rather than wait for them.
        head.protocol.transport.abortConnection()
        yield head.lost


class SessionAndGenerationCapTests(MemoryBoundsTestCase):
    def test_assign_beyond_max_sessions_is_refused(self) -> None:
        """max_sessions=2 (default 1024) is advertised; a third ASSIGN is refused (logged once)
        and that session's GENERATE gets FINISH_DECLINED, which a head fails over on, as a
        never-assigned one does; after a REVOKE frees a place the same session is accepted
        and served."""
        self.assertEqual(DEFAULT_MAX_SESSIONS, 1024)
        node = self.start_node(max_sessions=2)
        head = self.raw_head(node)
        ack = self.wait(head.hello())
        self.assertEqual(ack.capacity.max_sessions, 2)
        refused = self.log_lines("refusing new sessions (the first: session 3")
        for session in (1, 2, 3):
            self.place(head, session)
        self.wait(refused)
        self.generate(head, 3, 1, 4)
        self.generate(head, 9, 1, 4)
        self.wait(head.wait_for(finish_of(3, 1, FINISH_DECLINED)))
        self.wait(head.wait_for(finish_of(9, 1, FINISH_DECLINED)))
        self.assertEqual(node.agent.session.session_ids(), [1, 2])
        head.send(SessionRevokeMsg(self.next_command(), 1, 1))
        self.place(head, 3)
        self.generate(head, 3, 2, 4)
        self.wait(head.wait_for(finish_of(3, 2, FINISH_LENGTH)))
        tokens = [t for e in head.events(3, 2) if isinstance(e.payload, Tokens)
                  for t in e.payload.tokens]  # fmt: skip
        self.assertEqual(tokens, expected_tokens(PROMPT, 4))

    def test_generations_beyond_max_generations_are_declined(self) -> None:
        """max_generations=2 (default 256): a third concurrent GENERATE is DECLINED at once
        and the first two complete correctly."""
        self.assertEqual(DEFAULT_MAX_GENERATIONS, 256)
        node = self.start_node(max_generations=2, token_delay_s=0.005)
        link = self.dial(node)
        for session in (1, 2, 3):
            link.assign(session)
            link.append(session, PROMPT)
        calls = [link.generate(session, HeadRequest((), 10)) for session in (1, 2, 3)]
        third = self.wait(calls[2].result)
        self.assertEqual((third.tokens, third.finish), ([], FINISH_DECLINED))
        for call in calls[:2]:
            outcome = self.wait(call.result)
            self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 10))


class HugeAppendTests(MemoryBoundsTestCase):
    def test_a_frame_beyond_max_frame_closes_at_its_length(self) -> None:
        """An APPEND announced longer than MAX_FRAME (16 MiB) closes that connection as soon
        as its 4 length bytes arrive (nothing more is buffered); another head is served."""
        node = self.start_node()
        head = self.raw_head(node)
        self.wait(head.hello())
        head.send_bytes(struct.pack("<I", MAX_FRAME + 1))
        self.wait(head.lost)
        link = self.dial(node)
        self.wait(serves(self, link, 1, 3))


class OptionTests(SynchronousTestCase):
    """Every bound is a ``twistd sfnode`` option that reaches NodeConfig, with its default."""

    def test_bound_options_reach_the_config(self) -> None:
        """--max-handshakes, --max-sessions, --max-unacked-events, --max-held-tokens,
        --max-generations and --drain-timeout default to the config's values and are passed
        on as given."""
        from sfnode.node import tap
        from sfnode.node.config import NodeConfig

        def config(*extra: str) -> NodeConfig:
            options = tap.Options()
            options.parseOptions(["--listen", "tcp:0:interface=127.0.0.1", "--engine", "mock",
                                  *extra])  # fmt: skip
            return tap.node_config(options)

        defaults = config()
        reference = NodeConfig()
        for name in ("max_handshakes", "max_sessions", "max_unacked_events", "max_held_tokens",
                     "max_generations", "drain_timeout_ms"):  # fmt: skip
            self.assertEqual(getattr(defaults, name), getattr(reference, name), name)
        given = config(
            "--max-handshakes", "3", "--max-sessions", "4", "--max-unacked-events", "5",
            "--max-held-tokens", "6", "--max-generations", "7", "--drain-timeout", "8",
        )  # fmt: skip
        self.assertEqual(
            (given.max_handshakes, given.max_sessions, given.max_unacked_events,
             given.max_held_tokens, given.max_generations, given.drain_timeout_ms),
            (3, 4, 5, 6, 7, 8000),
        )  # fmt: skip
