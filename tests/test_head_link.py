"""Tests of the head's Link F connection (sfnode.head.link) against a scripted fake node.

Everything runs on a ``MemoryReactorClock``: ``twisted.test.iosim.ConnectionCompleter`` joins the
head's dial to the fake node's ``listenTCP`` and an ``IOPump`` moves the bytes, so handshake
timeouts are driven by the clock and nothing sleeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import LogEvent, formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.test.iosim import ConnectionCompleter, IOPump
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.fleet import Fleet, FleetSettings
from sfnode.head.link import (
    COMMAND_SPACE,
    DEFAULT_LEASE,
    ConnectError,
    GenerationOutcome,
    HandshakeError,
    HandshakeTimeoutError,
    HeadIds,
    HeadLinkFactory,
    LinkError,
    LinkLostError,
    LinkSettings,
    MalformedFrameError,
    NodeLink,
    NodeRefusedError,
    NodeSilentError,
    ReconcileError,
    SessionRevokedError,
    SupersededError,
    UnknownSessionError,
    connect_node,
    embed,
)
from sfnode.linkf.wire import (
    FINISH_CANCELLED,
    FINISH_DECLINED,
    FINISH_EOS,
    AppendContentMsg,
    CapacitySummary,
    EmbedReqMsg,
    EmbedRespMsg,
    Finish,
    FrameDecoder,
    GenerateCancelMsg,
    GenerateReqMsg,
    GenParams,
    Hello,
    HelloAckF,
    Keepalive,
    Lease,
    LeaseGrantMsg,
    LeaseRenewMsg,
    LeaseStateMsg,
    LinkFLimits,
    LinkRole,
    MemCountersMsg,
    Message,
    MsgType,
    NodeStatusMsg,
    ReconcileAckMsg,
    ReconcileMsg,
    RetryRange,
    SessionAssignMsg,
    SessionReconcileAck,
    SessionRevokeMsg,
    StageForwardReqMsg,
    StageForwardRespMsg,
    TokenEvent,
    TokenEventPayload,
    TokenEventsMsg,
    Tokens,
    WatermarkAckMsg,
    decode_frame,
    decode_params,
    decode_tokens,
    encode_frame,
    message_frame,
)

PORT = 8454
CAPACITY = CapacitySummary(max_context_tokens=4096, max_lanes=4)
HELLO_ACK = HelloAckF(2, "fake-node", CAPACITY, ("mock",), 0, LinkFLimits())
NO_LEASE_VIEW = LeaseStateMsg(Lease(0, 0), 0)


class FakeNode(Protocol):
    """A scripted node: records every message; answers HELLO as its factory's mode says."""

    def __init__(self, script: FakeNodeFactory) -> None:
        self.script = script
        self.received: list[Message] = []
        self.seqs: list[int] = []
        self.decoder = FrameDecoder()
        self.send_seq = 1
        self.lost = False

    def connectionMade(self) -> None:
        self.script.nodes.append(self)

    def dataReceived(self, data: bytes) -> None:
        for frame in self.decoder.feed(data):
            message = decode_frame(frame)
            self.received.append(message)
            self.seqs.append(frame.seq)
            if isinstance(message, Hello):
                mode = self.script.hello_mode
                if mode == "ack":
                    self.send(HELLO_ACK)
                elif mode == "close":
                    self.transport.loseConnection()  # type: ignore[union-attr]
                elif mode == "status":
                    self.send(NodeStatusMsg(CAPACITY, (), MemCountersMsg()))
            elif self.script.on_message is not None:
                self.script.on_message(self, message)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.lost = True

    def send(self, message: Message) -> None:
        self.transport.write(message_frame(message, self.send_seq))  # type: ignore[union-attr]
        self.send_seq += 1

    def events(self, *events: TokenEvent) -> None:
        self.send(TokenEventsMsg(tuple(events)))

    def of_type(self, cls: type[Message]) -> list[Any]:
        return [m for m in self.received if isinstance(m, cls)]


class FakeNodeFactory(Factory):
    def __init__(self) -> None:
        self.nodes: list[FakeNode] = []
        self.hello_mode = "ack"
        self.on_message: Callable[[FakeNode, Message], None] | None = None

    def buildProtocol(self, addr: Any) -> FakeNode:
        return FakeNode(self)


def ev(seq: int, payload: TokenEventPayload, *, s: int = 1, e: int = 1, g: int = 1) -> TokenEvent:
    return TokenEvent(s, e, g, seq, payload)


def reconcile_ack(held: bool, *retry: RetryRange) -> ReconcileAckMsg:
    """RECONCILE_ACK for session 1: ``held`` by the node or not, with ``retry``'s ranges."""
    return ReconcileAckMsg((SessionReconcileAck(1, held, retry, NO_LEASE_VIEW),))


class LinkTestCase(SynchronousTestCase):
    """A memory reactor with a fake node listening on it."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.factory = FakeNodeFactory()
        self.reactor.listenTCP(PORT, self.factory, interface="127.0.0.1")
        self.completer = ConnectionCompleter(self.reactor)
        self.ids = HeadIds()
        self.pumps: list[IOPump] = []
        self.links: list[NodeLink] = []

    def tearDown(self) -> None:
        """Closing every link leaves no timer behind (handshake, reconcile, keepalive, silence
        and redial timers are all cancelled)."""
        for link in self.links:
            link.close()
        self.flush()
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def flush(self) -> None:
        for pump in self.pumps:
            pump.flush()

    def complete(self) -> None:
        pump = self.completer.succeedOnce()
        assert pump is not None
        self.pumps.append(pump)
        self.flush()

    def dial(self, **settings: Any) -> Deferred[NodeLink]:
        """Dial the fake node with the :class:`LinkSettings` given."""
        d = connect_node(
            self.reactor,
            f"tcp:127.0.0.1:{PORT}",
            ids=self.ids,
            settings=LinkSettings(**settings),
        )
        self.complete()
        return d.addCallback(self.keep)

    def keep(self, link: NodeLink) -> NodeLink:
        """Close ``link`` at the end of the test."""
        self.links.append(link)
        return link

    def open_link(self, **kwargs: Any) -> tuple[NodeLink, FakeNode]:
        link = self.successResultOf(self.dial(**kwargs))
        return link, self.factory.nodes[-1]

    def answer_reconcile(self, answer: Callable[[FakeNode], object]) -> None:
        """Each node the link connects to from now on answers its RECONCILE with
        ``answer(node)``."""

        def reconcile(new: FakeNode, message: Message) -> None:
            if isinstance(message, ReconcileMsg):
                answer(new)

        self.factory.on_message = reconcile

    def reconnected(self, link: NodeLink) -> Deferred[None]:
        """``link.reconnect()``, its new connection made."""
        done = link.reconnect()
        self.complete()
        return done

    def placed(self, context: Sequence[int] = (5, 6, 7)) -> tuple[NodeLink, FakeNode]:
        """An open link with session 1 assigned (epoch 1) and its context appended."""
        link, node = self.open_link()
        link.assign(1)
        link.append(1, context)
        self.flush()
        return link, node


class HandshakeTests(LinkTestCase):
    def test_the_head_says_hello_first_and_keeps_the_ack(self) -> None:
        """HELLO{(2,2), HeadDaemon, auth, the head's identity} is frame seq 1; HELLO_ACK_F fills
        identity/capacity.

        (With a token the same HELLO carries it inside Noise: tests/test_noise.py.)"""
        link, node = self.open_link()
        self.assertEqual(
            node.received, [Hello((2, 2), LinkRole.HEAD_DAEMON, b"", link.ids.head_id)]
        )
        self.assertEqual(node.seqs, [1])
        self.assertEqual(link.hello_ack, HELLO_ACK)
        self.assertEqual(link.node_identity, "fake-node")
        self.assertEqual(link.capacity, CAPACITY)
        self.assertEqual(link.models, ("mock",))
        self.assertTrue(link.connected)

    def test_a_silent_node_times_out_the_handshake(self) -> None:
        """No HELLO_ACK_F within the timeout fails with an error naming the handshake."""
        self.factory.hello_mode = "silent"
        d = self.dial(handshake_timeout_s=10.0)
        self.reactor.advance(9.9)
        self.assertNoResult(d)
        self.reactor.advance(0.1)
        failure = self.failureResultOf(d, HandshakeTimeoutError)
        self.assertIn("handshake", str(failure.value))
        self.flush()
        self.assertTrue(self.factory.nodes[0].lost)

    def test_a_node_closing_at_the_handshake_is_a_refusal(self) -> None:
        """A connection closed before HELLO_ACK_F fails with NodeRefusedError saying so, and
        with the real reason; a plaintext link does not guess at a token.  connect_node then
        closes the link: nothing redials."""
        self.factory.hello_mode = "close"
        failure = self.failureResultOf(self.dial(), NodeRefusedError)
        self.assertEqual(
            str(failure.value),
            "the node closed the connection during the handshake (the connection was closed)",
        )
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_refused_connection_says_refused(self) -> None:
        """Nobody listening: connect_node fails with ConnectError "connection refused"."""
        d = connect_node(self.reactor, "tcp:127.0.0.1:9", ids=self.ids)
        self.completer.failOnce(Failure(ConnectionRefusedError()))
        failure = self.failureResultOf(d, ConnectError)
        self.assertEqual(str(failure.value), "could not connect: connection refused")
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_first_frame_other_than_hello_ack_fails_the_handshake(self) -> None:
        """Any other first message is a handshake error ("expected HELLO_ACK_F")."""
        self.factory.hello_mode = "status"
        failure = self.failureResultOf(self.dial(), HandshakeError)
        self.assertIn("expected HELLO_ACK_F", str(failure.value))
        self.flush()
        self.assertTrue(self.factory.nodes[0].lost)

    def test_command_bases_and_epochs_are_process_wide(self) -> None:
        """Links share HeadIds: epochs count 1, 2, ...; link n's commands start at n*2^32+1."""
        first, node1 = self.open_link()
        second, node2 = self.open_link()
        self.assertEqual(first.assign(1), 1)
        self.assertEqual(second.assign(1), 2)
        self.flush()
        (assign1,) = node1.of_type(SessionAssignMsg)
        (assign2,) = node2.of_type(SessionAssignMsg)
        self.assertEqual((assign1.command_id, assign1.epoch), (1, 1))
        self.assertEqual((assign2.command_id, assign2.epoch), (COMMAND_SPACE + 1, 2))

    def test_a_node_that_dials_in_is_greeted_and_adopted(self) -> None:
        """HeadLinkFactory says HELLO first to a dialing node and hands over the open link."""
        adopted: list[NodeLink] = []
        head_factory = HeadLinkFactory(adopted.append, reactor=self.reactor, ids=self.ids)
        self.reactor.listenTCP(9000, head_factory)
        node_factory = FakeNodeFactory()
        client_factory = ClientFactory.forProtocol(lambda: FakeNode(node_factory))
        self.reactor.connectTCP("127.0.0.1", 9000, client_factory)
        self.complete()
        (link,) = adopted
        self.keep(link)
        self.assertEqual(link.node_identity, "fake-node")
        self.assertFalse(link.dialable)
        self.assertEqual(node_factory.nodes[0].received[0].MSG_TYPE, Hello.MSG_TYPE)


class SessionMessageTests(LinkTestCase):
    def test_assign_append_and_revoke_are_sent_in_order(self) -> None:
        """assign/append/revoke send ASSIGN, APPEND (full context) and REVOKE with new ids."""
        link, node = self.open_link()
        epoch = link.assign(1, lease=Lease(1000, 600), params=GenParams(temperature=0.5))
        link.append(1, [1, 2, 3])
        link.revoke(1)
        self.flush()
        assign, append, revoke = node.received[1:]
        assert isinstance(assign, SessionAssignMsg)
        assert isinstance(append, AppendContentMsg)
        self.assertEqual(
            (assign.command_id, assign.epoch, assign.lease), (1, epoch, Lease(1000, 600))
        )
        self.assertEqual(decode_params(assign.params), GenParams(temperature=0.5))
        self.assertEqual((append.command_id, decode_tokens(append.blocks)), (2, (1, 2, 3)))
        self.assertEqual(revoke, SessionRevokeMsg(3, 1, epoch))
        self.assertEqual(node.seqs, [1, 2, 3, 4])

    def test_append_to_an_unknown_session_raises(self) -> None:
        """Appending to a session this link never assigned is a programming error."""
        link, _ = self.open_link()
        self.assertRaises(UnknownSessionError, link.append, 9, [1])

    def test_lease_renew_is_granted_for_an_idle_session(self) -> None:
        """LEASE_RENEW at the current epoch is granted even with no generate running (D4)."""
        _, node = self.placed()
        node.send(LeaseRenewMsg(1, 1))
        node.send(LeaseRenewMsg(1, 0))
        node.send(LeaseRenewMsg(7, 1))
        self.flush()
        self.assertEqual(
            node.of_type(LeaseGrantMsg),
            [LeaseGrantMsg(1, 1, DEFAULT_LEASE.duration_ms, DEFAULT_LEASE.renew_by_ms)],
        )

    def test_node_status_updates_capacity_and_models(self) -> None:
        """NODE_STATUS replaces the capacity; an empty model list keeps the known models."""
        link, node = self.open_link()
        busy = CapacitySummary(lanes_active=2, max_lanes=4)
        node.send(NodeStatusMsg(busy, (), MemCountersMsg()))
        self.flush()
        self.assertEqual((link.capacity, link.models), (busy, ("mock",)))
        node.send(NodeStatusMsg(CAPACITY, ("other",), MemCountersMsg()))
        self.flush()
        self.assertEqual((link.capacity, link.models), (CAPACITY, ("other",)))

    def test_keepalive_sends_one_frame(self) -> None:
        """keepalive() sends a KEEPALIVE frame."""
        link, node = self.open_link()
        link.keepalive()
        self.flush()
        self.assertEqual(node.received[-1], Keepalive())


class GenerateTests(LinkTestCase):
    def test_generate_collects_streamed_tokens_and_acks_each_batch(self) -> None:
        """Tokens stream to on_tokens, every batch is acked with its watermark, Finish ends it."""
        link, node = self.placed()
        streamed: list[list[int]] = []
        call = link.generate(
            1,
            HeadRequest((), 16, max_wall_ms=500),
            on_tokens=lambda t: streamed.append(list(t)),
        )
        self.flush()
        request = node.received[-1]
        assert isinstance(request, GenerateReqMsg)
        self.assertEqual(
            (request.command_id, request.session_id, request.epoch, request.generation_id),
            (3, 1, 1, call.generation_id),
        )
        self.assertEqual((request.budgets.max_new_tokens, request.budgets.max_wall_ms), (16, 500))
        node.events(ev(0, Tokens((1, 2))))
        node.events(ev(1, Tokens((3,))))
        self.flush()
        self.assertNoResult(call.result)
        node.events(ev(2, Finish(FINISH_EOS)))
        self.flush()
        self.assertEqual(streamed, [[1, 2], [3]])
        outcome = self.successResultOf(call.result)
        self.assertEqual(outcome, GenerationOutcome([1, 2, 3], FINISH_EOS))
        self.assertEqual(
            node.of_type(WatermarkAckMsg),
            [WatermarkAckMsg(1, 1, 1, 0), WatermarkAckMsg(1, 1, 1, 1), WatermarkAckMsg(1, 1, 1, 2)],
        )
        self.assertEqual(link.calls.pending(), [])

    def test_retransmitted_events_are_not_delivered_twice(self) -> None:
        """A duplicate batch is re-acked but its tokens reach neither the stream nor the outcome."""
        link, node = self.placed()
        streamed: list[list[int]] = []
        call = link.generate(1, HeadRequest((), 16), on_tokens=lambda t: streamed.append(list(t)))
        node.events(ev(0, Tokens((1,))))
        node.events(ev(0, Tokens((1,))), ev(1, Tokens((2,))))
        node.events(ev(1, Tokens((2,))), ev(2, Finish(FINISH_EOS)))
        self.flush()
        self.assertEqual(streamed, [[1], [2]])
        self.assertEqual(self.successResultOf(call.result).tokens, [1, 2])
        self.assertEqual([a.watermark for a in node.of_type(WatermarkAckMsg)], [0, 1, 2])

    def test_a_declined_finish_is_seen(self) -> None:
        """FINISH_DECLINED at seq 0 ends the generation with no tokens."""
        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 16))
        node.events(ev(0, Finish(FINISH_DECLINED)))
        self.flush()
        self.assertEqual(self.successResultOf(call.result), GenerationOutcome([], FINISH_DECLINED))

    def test_a_declined_finish_is_seen_even_when_dedup_calls_it_a_duplicate(self) -> None:
        """A seq-0 DECLINED after a committed seq 0 still ends the call (taken from the batch)."""
        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 16))
        node.events(ev(0, Tokens((4,))))
        node.events(ev(0, Finish(FINISH_DECLINED)))
        self.flush()
        self.assertEqual(self.successResultOf(call.result), GenerationOutcome([4], FINISH_DECLINED))
        self.assertEqual([a.watermark for a in node.of_type(WatermarkAckMsg)], [0, 0])

    def test_stale_epoch_and_gap_events_are_neither_delivered_nor_acked(self) -> None:
        """Events of an older epoch and events past a gap deliver nothing and get no ack."""
        link, node = self.placed()
        link.assign(1)
        link.append(1, [5])
        self.flush()
        call = link.generate(1, HeadRequest((), 16))
        node.events(ev(0, Tokens((9,)), e=1, g=call.generation_id))
        node.events(ev(1, Tokens((9,)), e=2, g=call.generation_id))
        self.flush()
        self.assertEqual(node.of_type(WatermarkAckMsg), [])
        self.assertEqual(call.tokens, [])
        link.close()
        self.failureResultOf(call.result, LinkLostError)

    def test_concurrent_generations_on_one_link_stay_apart(self) -> None:
        """Two generations on two sessions receive only their own events."""
        link, node = self.placed()
        link.assign(2)
        link.append(2, [1])
        first = link.generate(1, HeadRequest((), 4))
        second = link.generate(2, HeadRequest((), 4))
        self.flush()
        node.events(
            ev(0, Tokens((10,)), s=1, e=1, g=first.generation_id),
            ev(0, Tokens((20,)), s=2, e=2, g=second.generation_id),
            ev(1, Finish(FINISH_EOS), s=2, e=2, g=second.generation_id),
        )
        self.flush()
        self.assertEqual(self.successResultOf(second.result).tokens, [20])
        self.assertNoResult(first.result)
        node.events(ev(1, Finish(FINISH_EOS), s=1, e=1, g=first.generation_id))
        self.flush()
        self.assertEqual(self.successResultOf(first.result).tokens, [10])

    def test_cancel_sends_generate_cancel_once(self) -> None:
        """cancel() sends one GENERATE_CANCEL; the CANCELLED finish still ends the call."""
        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 1_000_000))
        call.cancel()
        call.cancel()
        self.flush()
        cancels = node.of_type(GenerateCancelMsg)
        self.assertEqual(cancels, [GenerateCancelMsg(1, call.generation_id)])
        node.events(ev(0, Finish(FINISH_CANCELLED)))
        self.flush()
        self.assertEqual(self.successResultOf(call.result).finish, FINISH_CANCELLED)

    def test_generate_on_an_unknown_session_fails(self) -> None:
        """generate for a session never assigned on this link fails with UnknownSessionError."""
        link, node = self.open_link()
        self.failureResultOf(link.generate(5, HeadRequest((), 4)).result, UnknownSessionError)
        self.flush()
        self.assertEqual(node.of_type(GenerateReqMsg), [])

    def test_a_reassign_fails_the_sessions_pending_generation(self) -> None:
        """A new epoch supersedes the session's pending generation (the node drops it)."""
        link, _ = self.placed()
        call = link.generate(1, HeadRequest((), 4))
        other = link.generate(1, HeadRequest((), 4))
        link.assign(1)
        self.failureResultOf(call.result, SupersededError)
        self.failureResultOf(other.result, SupersededError)
        self.assertEqual(link.calls.pending(), [])

    def test_revoke_fails_the_sessions_pending_generation(self) -> None:
        """Revoking a session with a pending generation fails it with SessionRevokedError."""
        link, _ = self.placed()
        call = link.generate(1, HeadRequest((), 4))
        link.revoke(1)
        self.failureResultOf(call.result, SessionRevokedError)


class StageForwardTests(LinkTestCase):
    def test_responses_are_matched_by_request_id(self) -> None:
        """Each STAGE_FORWARD_RESP fires the call with its request_id; unknown ids are ignored."""
        link, node = self.open_link()
        first = link.stage_forward([1, 2], 0, 12)
        second = link.stage_forward([], 12, 24, b"hidden")
        self.flush()
        req1, req2 = node.of_type(StageForwardReqMsg)
        self.assertEqual(req1, StageForwardReqMsg(req1.request_id, (1, 2), 0, 12, None))
        self.assertEqual((req2.tokens, req2.hidden_in), ((), b"hidden"))
        self.assertNotEqual(req1.request_id, req2.request_id)
        node.send(StageForwardRespMsg(999, None, None))
        node.send(StageForwardRespMsg(req2.request_id, None, 42))
        self.flush()
        self.assertNoResult(first)
        self.assertEqual(self.successResultOf(second).token, 42)
        node.send(StageForwardRespMsg(req1.request_id, b"h", None))
        self.flush()
        self.assertEqual(self.successResultOf(first).hidden, b"h")


class EmbeddingCallTests(LinkTestCase):
    def test_answers_are_matched_by_request_id_and_a_lost_link_fails_them(self) -> None:
        """Each EMBED_RESP fires the embedding of its request_id (docs/protocol.md section
        12.7); an unknown id, or a STAGE_FORWARD_RESP with an embedding's id, is ignored; a
        broken connection fails the embeddings still waiting, and a down link fails at once."""
        link, node = self.open_link()
        first = embed(link, ["a", "b"])
        second = embed(link, ["c"])
        self.flush()
        req1, req2 = node.of_type(EmbedReqMsg)
        self.assertEqual((req1.texts, req2.texts), (("a", "b"), ("c",)))
        node.send(EmbedRespMsg(999, None, 0, 0))
        node.send(StageForwardRespMsg(req2.request_id, None, 1))
        node.send(EmbedRespMsg(req2.request_id, b"\x00" * 8, 2, 3))
        self.flush()
        self.assertNoResult(first)
        self.assertEqual(self.successResultOf(second), EmbedRespMsg(req2.request_id, b"\x00" * 8,
                                                                   2, 3))  # fmt: skip
        node.transport.write(b"\x05\x00\x00\x00" + b"\x00" * 5)  # type: ignore[union-attr]
        self.flush()
        self.failureResultOf(first, MalformedFrameError)
        self.failureResultOf(embed(link, ["d"]), LinkError)


class BrokenLinkTests(LinkTestCase):
    def test_a_malformed_frame_closes_the_link_and_fails_pending_calls(self) -> None:
        """Bad bytes: the reason is logged, the connection closes, pending calls fail clearly."""
        logged: list[LogEvent] = []
        globalLogPublisher.addObserver(logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, logged.append)
        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 4))
        forward = link.stage_forward([1], 0, 1)
        closed = link.when_closed()
        self.flush()
        node.transport.write(b"\x05\x00\x00\x00" + b"\x00" * 5)  # type: ignore[union-attr]
        self.flush()
        failure = self.failureResultOf(call.result, MalformedFrameError)
        self.assertIn("below the header length", str(failure.value))
        self.failureResultOf(forward, MalformedFrameError)
        self.assertIsInstance(self.successResultOf(closed), MalformedFrameError)
        self.assertTrue(node.lost)
        self.assertFalse(link.connected)
        messages = [formatEvent(e) for e in logged]
        self.assertTrue(any("below the header length" in m for m in messages), messages)

    def test_a_malformed_payload_is_a_malformed_frame_too(self) -> None:
        """A well-framed TOKEN_EVENTS whose payload is not msgpack of the right shape."""
        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 4))
        nil_payload = encode_frame(MsgType.TOKEN_EVENTS, 9, b"\xc0")
        node.transport.write(nil_payload)  # type: ignore[union-attr]
        self.flush()
        failure = self.failureResultOf(call.result, MalformedFrameError)
        self.assertIn("TokenEventsMsg", str(failure.value))
        self.assertTrue(node.lost)

    def test_a_dropped_link_redials_at_once_and_a_failed_redial_fails_pending_calls(
        self,
    ) -> None:
        """A lost connection tells the owner and is redialled at once; the pending generation
        waits for that attempt, and fails with LinkLostError naming the real reason when the
        node refuses it.  New calls fail at once while the link is down."""
        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 4))
        closed = link.when_closed()
        self.flush()
        node.transport.loseConnection()  # type: ignore[union-attr]
        self.flush()
        self.assertIsInstance(self.successResultOf(closed), LinkLostError)
        self.assertNoResult(call.result)
        self.assertEqual(link.status, "connecting")
        self.completer.failOnce(Failure(ConnectionRefusedError()))
        failure = self.failureResultOf(call.result, LinkLostError)
        self.assertIn("connection refused", str(failure.value))
        self.assertEqual(link.status, "down")
        self.failureResultOf(link.generate(1, HeadRequest((), 4)).result, LinkLostError)

    def test_close_fails_pending_calls_and_fires_when_gone(self) -> None:
        """close() closes the connection; pending calls fail with LinkLostError."""
        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 4))
        d = link.close()
        self.flush()
        self.successResultOf(d)
        self.failureResultOf(call.result, LinkLostError)
        self.assertTrue(node.lost)


class ReconnectTests(LinkTestCase):
    def test_reconnect_reconciles_and_completes_a_generation_by_retransmission(self) -> None:
        """RECONCILE reports the watermark; retransmitted events finish the pending generation."""
        link, node = self.placed(context=(5, 6, 7))
        call = link.generate(1, HeadRequest((), 16))
        self.flush()
        node.events(ev(0, Tokens((1,)), g=call.generation_id))
        self.flush()

        def answer(new: FakeNode) -> None:
            g = call.generation_id
            new.send(reconcile_ack(True, RetryRange(g, 1, 2)))
            new.events(ev(1, Tokens((2,)), g=g), ev(2, Finish(FINISH_EOS), g=g))

        self.answer_reconcile(answer)
        self.successResultOf(self.reconnected(link))
        self.assertEqual(self.successResultOf(call.result), GenerationOutcome([1, 2], FINISH_EOS))
        new = self.factory.nodes[-1]
        (reconcile_msg,) = new.of_type(ReconcileMsg)
        (state,) = reconcile_msg.sessions
        self.assertEqual((state.session_id, state.epoch, state.command_watermark), (1, 1, 3))
        self.assertEqual(
            [(w.generation_id, w.watermark) for w in state.generation_watermarks],
            [(call.generation_id, 0)],
        )
        self.assertEqual([a.watermark for a in new.of_type(WatermarkAckMsg)], [2])
        (append,) = new.of_type(AppendContentMsg)
        self.assertEqual((append.epoch, decode_tokens(append.blocks)), (1, (5, 6, 7)))
        self.assertEqual(new.of_type(SessionAssignMsg), [])
        self.assertTrue(node.lost)

    def test_reconnect_reassigns_a_session_the_node_lost(self) -> None:
        """Not held: same epoch re-assigned with a new command and re-appended; the lost
        generation fails with LinkLostError."""
        link, _ = self.placed(context=(5, 6))
        call = link.generate(1, HeadRequest((), 16))
        self.flush()

        self.answer_reconcile(lambda new: new.send(reconcile_ack(False)))
        self.successResultOf(self.reconnected(link))
        self.failureResultOf(call.result, LinkLostError)
        new = self.factory.nodes[-1]
        (assign,) = new.of_type(SessionAssignMsg)
        (append,) = new.of_type(AppendContentMsg)
        self.assertEqual((assign.epoch, assign.command_id), (1, 4))
        self.assertEqual((append.command_id, decode_tokens(append.blocks)), (5, (5, 6)))
        self.assertTrue(link.connected)

    def test_a_dropped_connection_is_redialled_and_the_generation_completes(self) -> None:
        """The node drops the connection mid-generation: the link redials at once by itself,
        reconciles, and the generation completes from the retransmission, once."""
        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 16))
        self.flush()
        reconnected = link.when_closed().addCallback(lambda _: link.when_open())

        def answer(new: FakeNode) -> None:
            g = call.generation_id
            new.send(reconcile_ack(True, RetryRange(g, 0, 0)))
            new.events(ev(0, Finish(FINISH_EOS), g=g))

        self.answer_reconcile(answer)
        node.transport.loseConnection()  # type: ignore[union-attr]
        self.flush()
        self.assertNoResult(call.result)
        self.complete()
        self.successResultOf(reconnected)
        self.assertEqual(self.successResultOf(call.result), GenerationOutcome([], FINISH_EOS))
        self.assertEqual(link.status, "open")

    def test_a_reconnect_that_cannot_handshake_fails_pending_generations(self) -> None:
        """If the node refuses the new connection, the reconnect and its generations fail."""
        link, _ = self.placed()
        call = link.generate(1, HeadRequest((), 16))
        self.factory.hello_mode = "close"
        done = link.reconnect()
        self.complete()
        self.failureResultOf(done, NodeRefusedError)
        self.failureResultOf(call.result, LinkLostError)

    def test_events_before_the_reconcile_ack_count_toward_its_retry_ranges(self) -> None:
        """Seqs that arrive before RECONCILE_ACK are not waited for again (docs/protocol.md
        section 8.4 step 3)."""
        link, _ = self.placed()
        call = link.generate(1, HeadRequest((), 16))

        def answer(new: FakeNode) -> None:
            g = call.generation_id
            new.events(ev(0, Tokens((3,)), g=g))
            new.send(reconcile_ack(True, RetryRange(g, 0, 1)))
            new.events(ev(1, Finish(FINISH_EOS), g=g))

        self.answer_reconcile(answer)
        self.successResultOf(self.reconnected(link))
        self.assertEqual(self.successResultOf(call.result), GenerationOutcome([3], FINISH_EOS))

    def test_a_reconcile_missing_its_retransmissions_times_out(self) -> None:
        """A retry range that never arrives fails the reconnect and its generations."""
        link, _ = self.placed()
        call = link.generate(1, HeadRequest((), 16))

        self.answer_reconcile(
            lambda new: new.send(reconcile_ack(True, RetryRange(call.generation_id, 0, 3)))
        )
        done = self.reconnected(link)
        self.assertNoResult(done)
        self.reactor.advance(link.settings.handshake_timeout_s)
        self.flush()
        failure = self.failureResultOf(done, ReconcileError)
        self.assertIn("timed out", str(failure.value))
        self.failureResultOf(call.result, LinkLostError)
        self.assertTrue(self.factory.nodes[-1].lost)
        self.assertFalse(link.connected)

    def test_frames_from_the_old_connection_are_ignored_after_a_reconnect(self) -> None:
        """Once reconnect() detached the old connection, nothing it delivers counts."""
        link, old = self.placed()
        call = link.generate(1, HeadRequest((), 16))
        self.flush()
        self.answer_reconcile(lambda new: new.send(reconcile_ack(True)))
        done = link.reconnect()
        old.events(ev(0, Finish(FINISH_EOS), g=call.generation_id))
        self.complete()
        self.successResultOf(done)
        self.failureResultOf(call.result, LinkLostError)
        self.assertEqual(old.of_type(WatermarkAckMsg), [])


class MoreGenerateTests(LinkTestCase):
    def test_cancelling_the_result_sends_generate_cancel_and_forgets_the_call(self) -> None:
        """result.cancel() sends GENERATE_CANCEL; a late Finish for it is still acked."""
        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 100))
        call.result.cancel()
        self.failureResultOf(call.result)
        self.assertEqual(link.calls.pending(), [])
        node.events(ev(0, Finish(FINISH_CANCELLED), g=call.generation_id))
        self.flush()
        cancels = node.of_type(GenerateCancelMsg)
        self.assertEqual(cancels, [GenerateCancelMsg(1, call.generation_id)])
        self.assertEqual([a.watermark for a in node.of_type(WatermarkAckMsg)], [0])

    def test_a_failing_on_tokens_callback_does_not_break_the_link(self) -> None:
        """An exception in on_tokens is logged; the generation and the link carry on."""

        def explode(tokens: Sequence[int]) -> None:
            raise RuntimeError("caller bug")

        link, node = self.placed()
        call = link.generate(1, HeadRequest((), 4), on_tokens=explode)
        node.events(ev(0, Tokens((1,)), g=call.generation_id))
        node.events(ev(1, Finish(FINISH_EOS), g=call.generation_id))
        self.flush()
        self.assertEqual(self.successResultOf(call.result).tokens, [1])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertTrue(link.connected)

    def test_a_dialing_node_that_never_acks_is_not_adopted(self) -> None:
        """HeadLinkFactory drops a node that does not answer HELLO within the timeout."""
        adopted: list[NodeLink] = []
        head_factory = HeadLinkFactory(
            adopted.append,
            reactor=self.reactor,
            ids=self.ids,
            settings=LinkSettings(handshake_timeout_s=2.0),
        )
        self.reactor.listenTCP(9000, head_factory)
        node_factory = FakeNodeFactory()
        node_factory.hello_mode = "silent"
        client_factory = ClientFactory.forProtocol(lambda: FakeNode(node_factory))
        self.reactor.connectTCP("127.0.0.1", 9000, client_factory)
        self.complete()
        self.reactor.advance(2.0)
        self.flush()
        self.assertEqual(adopted, [])
        self.assertTrue(node_factory.nodes[0].lost)

    def test_a_generation_the_node_still_runs_continues_after_a_reconnect(self) -> None:
        """Held, with events committed before the drop: the rest streams on the new link (D2)."""
        link, _ = self.placed()
        call = link.generate(1, HeadRequest((), 16))
        self.flush()
        self.factory.nodes[-1].events(ev(0, Tokens((1,)), g=call.generation_id))
        self.flush()

        self.answer_reconcile(lambda new: new.send(reconcile_ack(True)))
        self.successResultOf(self.reconnected(link))
        self.assertNoResult(call.result)
        new = self.factory.nodes[-1]
        new.events(ev(1, Tokens((2,)), g=call.generation_id))
        new.events(ev(2, Finish(FINISH_EOS), g=call.generation_id))
        self.flush()
        self.assertEqual(self.successResultOf(call.result), GenerationOutcome([1, 2], FINISH_EOS))

    def test_the_wal_keeps_committed_events_unless_told_not_to(self) -> None:
        """By default the WAL keeps a finished generation's events; keep_wal=False drops them."""
        for keep_wal, expected in ((True, [0, 1]), (False, [])):
            link, node = self.open_link(keep_wal=keep_wal)
            link.assign(1)
            link.append(1, [1])
            call = link.generate(1, HeadRequest((), 4))
            node.events(ev(0, Tokens((7,)), e=call.epoch, g=call.generation_id))
            node.events(ev(1, Finish(FINISH_EOS), e=call.epoch, g=call.generation_id))
            self.flush()
            self.successResultOf(call.result)
            wal = link.head_session.wal.events(1, call.epoch, call.generation_id)
            self.assertEqual([e.event_seq for e in wal], expected)


class LivenessTests(LinkTestCase):
    def test_an_open_link_sends_a_keepalive_every_15_s(self) -> None:
        """KEEPALIVE goes out every 15 s on an open link (section 8), from the link itself."""
        _, node = self.open_link(silence_timeout_s=0)
        self.reactor.advance(15)
        self.flush()
        self.reactor.advance(15)
        self.flush()
        self.assertEqual(node.of_type(Keepalive), [Keepalive(), Keepalive()])

    def test_a_hung_node_fails_its_generations_within_the_keepalive_window(self) -> None:
        """A node that sends nothing for the keepalive window (2 s here) is given up: its
        pending generation fails with NodeSilentError at once, whatever a redial might do,
        and the link redials.  Every frame from the node pushes the deadline back."""
        link, node = self.open_link(silence_timeout_s=2.0)
        link.assign(1)
        link.append(1, [1, 2])
        call = link.generate(1, HeadRequest((), 16))
        self.flush()
        self.reactor.advance(1.5)
        node.events(ev(0, Tokens((7,)), e=call.epoch, g=call.generation_id))
        self.flush()
        self.reactor.advance(1.9)
        self.assertNoResult(call.result)
        self.reactor.advance(0.1)
        failure = self.failureResultOf(call.result, NodeSilentError)
        self.assertIn("sent nothing for 2.0 s", str(failure.value))
        self.assertEqual(call.tokens, [7])
        self.assertEqual(link.status, "connecting")
        self.flush()
        self.assertTrue(node.lost)

    def test_a_revoke_made_while_down_is_sent_after_the_reconnect(self) -> None:
        """A session revoked while its node was unreachable is revoked on the node once the
        link is back (so a node that was only hung frees what it still runs for it)."""
        link, node = self.placed()
        epoch = link.head_session.epoch_of(1)
        node.transport.loseConnection()  # type: ignore[union-attr]
        self.flush()
        link.revoke(1)
        self.complete()
        self.assertEqual(link.status, "open")
        new = self.factory.nodes[-1]
        (revoke,) = new.of_type(SessionRevokeMsg)
        self.assertEqual((revoke.session_id, revoke.epoch), (1, epoch))
        self.assertEqual(new.of_type(ReconcileMsg), [])


class LinkSettingsTests(LinkTestCase):
    """The fleet's link settings reach every link, dialed or dialed in (docs/protocol.md
    section 8: the head sends KEEPALIVE on an open link)."""

    def keepalives_after(self, node: FakeNode, seconds: float) -> int:
        self.reactor.advance(seconds)
        self.flush()
        return len(node.of_type(Keepalive))

    def test_a_node_that_dials_in_gets_the_heads_keepalive(self) -> None:
        """A fleet told to send KEEPALIVE every 3 s does so on the link of a node that dialed
        in, as on one it dialed (not the 15 s default): both nodes get their first after 3 s,
        their second after 6 s."""
        fleet = Fleet(
            self.reactor,
            FleetSettings(keepalive_interval_s=3.0, silence_timeout_s=0),
            ids=self.ids,
        )
        self.reactor.listenTCP(9000, fleet.listen_factory())
        joined = fleet.next_join()
        node_factory = FakeNodeFactory()
        client_factory = ClientFactory.forProtocol(lambda: FakeNode(node_factory))
        self.reactor.connectTCP("127.0.0.1", 9000, client_factory)
        self.complete()
        self.successResultOf(joined)
        dialed = fleet.add_node(f"tcp:127.0.0.1:{PORT}")
        self.complete()
        self.successResultOf(dialed)
        dialing_in, dialed_node = node_factory.nodes[0], self.factory.nodes[-1]
        self.assertEqual(self.keepalives_after(dialing_in, 2.9), 0)
        self.assertEqual(self.keepalives_after(dialing_in, 0.1), 1)
        self.assertEqual(len(dialed_node.of_type(Keepalive)), 1)
        self.assertEqual(self.keepalives_after(dialing_in, 3.0), 2)
        self.assertEqual(len(dialed_node.of_type(Keepalive)), 2)
        stopped = fleet.stop()
        self.flush()
        self.successResultOf(stopped)
