"""Decoding bounded by the frame, before the handshake (issue 19, item 5; docs/protocol.md section
2.3 and decision D14), and handshake slots bounded per address (section 5.3).

A frame whose payload is larger than its message type can need is refused from its 25-byte
header: the node never buffers, let alone unpacks, the 4 MiB HELLO of a peer that has not shaken
hands, and the head applies the same limits to what nodes send.  A few silent connections from
one address cannot take every handshake slot of a node's listener or of the head's fleet
listener.  Peers are raw sockets on real loopback TCP next to real heads and nodes.
"""

from __future__ import annotations

import struct
from collections.abc import Generator
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import provider

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import (
    DEFAULT_JOIN_ADDRESS_HANDSHAKES,
    HeadIds,
    HeadLinkFactory,
    LinkError,
    LinkSettings,
    NodeLink,
    connect_node,
)
from sfnode.linkf.wire import (
    HANDSHAKE_PAYLOAD,
    MAX_PAYLOAD,
    PAYLOAD_LIMITS,
    PROTO_VERSION,
    SMALL_PAYLOAD,
    STATUS_PAYLOAD,
    CapacitySummary,
    FrameDecoder,
    Hello,
    HelloAckF,
    LinkFLimits,
    LinkRole,
    MsgType,
    PayloadTooLarge,
    encode_frame,
    message_frame,
)
from sfnode.node.tap import node_factory
from tests.nodefixture import PROMPT, Gen, NodeTestCase, expected_tokens, serves


def header(msg_type: int, payload_size: int, frame_cls: int = 0) -> bytes:
    """The 25 bytes before a payload of ``payload_size`` bytes (the payload itself not sent)."""
    return struct.pack("<IHHQQB", 21 + payload_size, PROTO_VERSION, msg_type, 1, 0, frame_cls)


class Peer(Protocol):
    """A raw connection: ``closed`` fires when the other side closes it."""

    def __init__(self) -> None:
        self.closed: defer.Deferred[None] = defer.Deferred()
        self.received = b""

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed.callback(None)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


def log_line(test: Any, fragment: str) -> defer.Deferred[str]:
    """Fires with the first log line that contains ``fragment``."""
    d: defer.Deferred[str] = defer.Deferred()

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        text = formatEvent(event)
        if fragment in text and not d.called:
            d.callback(text)

    globalLogPublisher.addObserver(observe)
    test.addCleanup(globalLogPublisher.removeObserver, observe)
    return d


class DecoderTests(SynchronousTestCase):
    def test_every_type_has_a_limit_and_the_small_ones_are_small(self) -> None:
        """Every catalog type has a limit; HELLO's is 4 KiB, HELLO_ACK_F's and NODE_STATUS's
        8 KiB, the messages of a few integers 1 KiB, and contexts and token events keep the
        whole frame."""
        self.assertEqual(set(PAYLOAD_LIMITS), {int(t) for t in MsgType})
        self.assertEqual(PAYLOAD_LIMITS[MsgType.HELLO], HANDSHAKE_PAYLOAD)
        self.assertEqual(HANDSHAKE_PAYLOAD, 4096)
        self.assertEqual(PAYLOAD_LIMITS[MsgType.HELLO_ACK_F], STATUS_PAYLOAD)
        self.assertEqual(PAYLOAD_LIMITS[MsgType.NODE_STATUS], 8192)
        for small in (MsgType.LEASE_GRANT, MsgType.WATERMARK_ACK, MsgType.SESSION_REVOKE):
            self.assertEqual(PAYLOAD_LIMITS[small], SMALL_PAYLOAD)
        for whole in (MsgType.APPEND_CONTENT, MsgType.TOKEN_EVENTS, MsgType.RECONCILE):
            self.assertEqual(PAYLOAD_LIMITS[whole], MAX_PAYLOAD)

    def test_an_oversized_payload_is_refused_from_its_header(self) -> None:
        """A LEASE_GRANT declaring 1 KiB + 1 is refused as soon as its 25 header bytes are in
        (nothing of its body is needed); one of exactly 1 KiB waits for its body."""
        with self.assertRaises(PayloadTooLarge) as raised:
            FrameDecoder().feed(header(MsgType.LEASE_GRANT, SMALL_PAYLOAD + 1))
        self.assertIn(
            "LEASE_GRANT payload of 1025 bytes exceeds its limit of 1024", str(raised.exception)
        )
        self.assertEqual(FrameDecoder().feed(header(MsgType.LEASE_GRANT, SMALL_PAYLOAD)), [])

    def test_before_the_handshake_frame_every_frame_is_held_to_its_limit(self) -> None:
        """A decoder that waits for a HELLO refuses any frame above HELLO's 4 KiB before it
        (an APPEND_CONTENT of 5 KiB, byte by byte), and takes a 5 KiB APPEND once a HELLO
        came, even in the same read."""
        append = encode_frame(MsgType.APPEND_CONTENT, 2, b"\xc4" + bytes(5 * 1024))
        decoder = FrameDecoder(handshake=MsgType.HELLO)
        with self.assertRaises(PayloadTooLarge) as raised:
            for at in range(len(append)):
                decoder.feed(append[at : at + 1])
        self.assertIn("before the HELLO", str(raised.exception))
        hello = message_frame(Hello((2, 2), LinkRole.HEAD_DAEMON, b""), 1)
        frames = FrameDecoder(handshake=MsgType.HELLO).feed(hello + append)
        self.assertEqual([f.msg_type for f in frames], [MsgType.HELLO, MsgType.APPEND_CONTENT])

    def test_a_sender_never_writes_what_a_receiver_refuses(self) -> None:
        """A HELLO whose auth would make it larger than 4 KiB is refused at the sender."""
        with self.assertRaises(PayloadTooLarge):
            message_frame(Hello((2, 2), LinkRole.HEAD_DAEMON, bytes(5000)), 1)


class NodeLimitTests(NodeTestCase):
    timeout = 30
    """On main the node waits for the body of a 4 MiB HELLO (up to its handshake timeout, a
    minute here): these tests time out."""

    @defer.inlineCallbacks
    def test_a_4_mib_hello_is_refused_before_its_body_while_a_head_is_served(self) -> Gen:
        """A node without a token, a head streaming from it: a peer that sends the 25-byte
        header of a 4 MiB HELLO and nothing more is closed at once with the reason logged
        (its body is never waited for); the head's stream finishes whole."""
        node = yield self.start_node(token_delay_s=0.005, handshake_timeout_ms=60_000)
        link = yield self.dial(node)
        link.assign(1)
        link.append(1, PROMPT)
        call = link.generate(1, HeadRequest((), 40))
        logged = log_line(self, "HELLO payload of 4194304 bytes exceeds its limit of 4096")
        peer = Peer()
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", node.port_number), peer)
        peer.send(header(MsgType.HELLO, 4 * 1024 * 1024))
        yield peer.closed
        yield logged
        outcome = yield call.result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 40))

    @defer.inlineCallbacks
    def test_after_the_handshake_each_type_keeps_its_limit(self) -> Gen:
        """Past the handshake a 2 KiB LEASE_GRANT closes that connection ("exceeds its limit
        of 1024"), while a 1 MiB context in APPEND_CONTENT is served on another."""
        node = yield self.start_node(context_window=300_000)
        logged = log_line(self, "LEASE_GRANT payload of 2048 bytes exceeds its limit of 1024")
        peer = Peer()
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", node.port_number), peer)
        peer.send(message_frame(Hello((2, 2), LinkRole.HEAD_DAEMON, b""), 1))
        peer.send(header(MsgType.LEASE_GRANT, 2048))
        yield peer.closed
        yield logged
        link = yield self.dial(node)
        big = [7] * 250_000
        link.assign(1)
        link.append(1, big)
        outcome = yield link.generate(1, HeadRequest((), 3)).result
        self.assertEqual(outcome.tokens, expected_tokens(big, 3))


class HeadLimitTests(NodeTestCase):
    timeout = 30

    @defer.inlineCallbacks
    def fake_node(self, answer: bytes) -> Generator[defer.Deferred[Any], Any, str]:
        """A listener that answers every connection with ``answer`` and keeps it open."""

        class Answer(Protocol):
            def connectionMade(self) -> None:
                assert self.transport is not None
                self.transport.write(answer)

        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            Factory.forProtocol(Answer)
        )
        self.addCleanup(port.stopListening)
        return f"tcp:127.0.0.1:{port.getHost().port}"

    @defer.inlineCallbacks
    def test_a_head_refuses_an_oversized_hello_ack_from_its_header(self) -> Gen:
        """A "node" whose first frame declares a 100 KiB HELLO_ACK_F fails the head's dial at
        once (its handshake timeout is a minute) with the limit named."""
        endpoint = yield self.fake_node(header(MsgType.HELLO_ACK_F, 100 * 1024))
        with self.assertRaises(LinkError) as raised:
            yield connect_node(
                reactor, endpoint, ids=HeadIds(), settings=LinkSettings(handshake_timeout_s=60)
            )
        self.assertIn(
            "HELLO_ACK_F payload of 102400 bytes exceeds its limit", str(raised.exception)
        )

    @defer.inlineCallbacks
    def test_a_head_refuses_an_oversized_node_status(self) -> Gen:
        """Past the handshake a NODE_STATUS declaring 64 KiB breaks the link as malformed."""
        ack = HelloAckF(PROTO_VERSION, "fake", CapacitySummary(), ("mock",), 0, LinkFLimits())
        endpoint = yield self.fake_node(
            message_frame(ack, 1) + header(MsgType.NODE_STATUS, 64 * 1024)
        )
        link: NodeLink = yield connect_node(reactor, endpoint, ids=HeadIds())
        self.addCleanup(link.close)
        reason = yield link.when_closed()
        self.assertIn("NODE_STATUS payload of 65536 bytes exceeds its limit", str(reason))


class Silent(Protocol):
    """Connects and says nothing; ``closed`` fires when the other side closes."""

    def __init__(self) -> None:
        self.closed: defer.Deferred[None] = defer.Deferred()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed.callback(None)


class AddressSlotTests(NodeTestCase):
    timeout = 30
    """On main a ninth silent connection from one address is admitted (only the total of 64
    counts), and the head's fleet listener admits a fifth (only the total of 8 counts)."""

    @defer.inlineCallbacks
    def silent_from(
        self, port: int, count: int
    ) -> Generator[defer.Deferred[Any], Any, list[Silent]]:
        """``count`` silent connections from 127.0.0.1 (closed by the test's cleanup)."""
        peers = [Silent() for _ in range(count)]
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
        yield defer.gatherResults([connectProtocol(endpoint, p) for p in peers])
        for peer in peers:
            self.addCleanup(self.hang_up, peer)
        return peers

    def hang_up(self, peer: Silent) -> defer.Deferred[None]:
        if not peer.closed.called and peer.transport is not None:
            peer.transport.loseConnection()
        return peer.closed

    @defer.inlineCallbacks
    def test_a_node_admits_8_handshakes_per_address(self) -> Gen:
        """Eight silent connections from 127.0.0.1 hold their slots; a ninth from there is
        closed at once; a head from 127.0.0.2 is admitted and served meanwhile."""
        node = yield self.start_node(handshake_timeout_ms=60_000)
        self.assertEqual(node.node_factory.max_address_handshakes, 8)
        held = yield self.silent_from(node.port_number, 8)
        logged = log_line(self, "8 handshakes from 127.0.0.1 already in progress")
        (ninth,) = yield self.silent_from(node.port_number, 1)
        yield ninth.closed
        yield logged
        self.assertEqual([p for p in held if p.closed.called], [])
        link = yield connect_node(
            reactor, f"tcp:127.0.0.1:{node.port_number}:bindAddress=127.0.0.2", ids=self.ids
        )
        self.addCleanup(link.close)
        yield serves(self, link, 1, 5)

    @defer.inlineCallbacks
    def test_the_fleet_listener_admits_4_handshakes_per_address(self) -> Gen:
        """Four silent connections from 127.0.0.1 on a head's fleet listener hold their slots;
        a fifth from there is closed at once; a node dialing from 127.0.0.2 joins."""
        self.assertEqual(DEFAULT_JOIN_ADDRESS_HANDSHAKES, 4)
        joined: defer.Deferred[NodeLink] = defer.Deferred()
        factory = HeadLinkFactory(
            joined.callback,
            reactor=reactor,
            ids=self.ids,
            settings=LinkSettings(handshake_timeout_s=60.0),
        )
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
        self.addCleanup(port.stopListening)
        number = port.getHost().port
        held = yield self.silent_from(number, 4)
        (fifth,) = yield self.silent_from(number, 1)
        yield fifth.closed
        self.assertEqual([p for p in held if p.closed.called], [])
        node = yield self.start_node(identity="joiner")
        dial = TCP4ClientEndpoint(reactor, "127.0.0.1", number, bindAddress=("127.0.0.2", 0))
        yield dial.connect(node_factory(node.agent))
        link = yield joined
        self.addCleanup(link.close)
        self.assertEqual(link.node_identity, "joiner")
        yield serves(self, link, 1, 5)
