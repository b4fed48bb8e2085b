"""Tests of the encrypted transport (sfnode.linkf.noise, docs/protocol.md section 5.1, D10) alone
and under Link F.

They pin the Noise pattern and framing (48-byte handshake messages behind ``00 30``), that a
responder with another token refuses message 1 and reports the peer, that a plaintext peer is told
apart from a wrong key, items 13 and 14 of docs/protocol.md section 10 over real loopback TCP (5
bytes and 200 000 bytes and a reply cross; the ciphertext never holds the plaintext and is longer),
and items 20 and 27 in both dial directions: a keyed node serves a generation over Noise and refuses
another key, whether the head dials the node or the node dials the head.
"""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import HeadLinkFactory, LinkSettings, NodeLink, NodeRefusedError
from sfnode.linkf.noise import (
    HANDSHAKE_MESSAGE_LEN,
    MAX_CHUNK,
    NoiseError,
    NoiseFactory,
    NoiseProtocol,
    NoiseSession,
    NoiseUnauthorized,
    Role,
    psk_of,
)
from sfnode.linkf.wire import FINISH_LENGTH
from sfnode.node.tap import node_factory
from tests.nodefixture import PROMPT, Gen, NodeTestCase, expected_tokens, serves

TOKEN = b"4f" * 32
OTHER = b"9a" * 32


def handshake(token_i: bytes = TOKEN, token_r: bytes = TOKEN) -> tuple[NoiseSession, NoiseSession]:
    initiator = NoiseSession(Role.INITIATOR, token_i)
    responder = NoiseSession(Role.RESPONDER, token_r)
    responder.start()
    reply, _ = responder.receive(initiator.start())
    initiator.receive(reply)
    return initiator, responder


class SessionTests(SynchronousTestCase):
    """The pure Noise session: pattern, framing, chunking, refusals."""

    def test_psk_is_sha256_of_the_token_text(self) -> None:
        """PSK = SHA-256 of the trimmed token text itself, not of its decoded hex (4.2)."""
        self.assertEqual(psk_of(TOKEN), hashlib.sha256(TOKEN).digest())

    def test_handshake_messages_are_48_bytes_behind_a_length(self) -> None:
        """Both handshake messages are 48 bytes behind a big-endian u16 (prefix 00 30); the
        responder sends nothing first; both sides are ready after two messages."""
        initiator = NoiseSession(Role.INITIATOR, TOKEN)
        responder = NoiseSession(Role.RESPONDER, TOKEN)
        self.assertEqual(responder.start(), b"")
        first = initiator.start()
        self.assertEqual((len(first), first[:2]), (2 + HANDSHAKE_MESSAGE_LEN, b"\x00\x30"))
        reply, plaintext = responder.receive(first[:7])
        self.assertEqual((reply, plaintext, responder.ready), (b"", b"", False))
        reply, plaintext = responder.receive(first[7:])
        self.assertEqual((len(reply), reply[:2], plaintext), (50, b"\x00\x30", b""))
        self.assertTrue(responder.ready)
        self.assertEqual(initiator.receive(reply), (b"", b""))
        self.assertTrue(initiator.ready)

    def test_writes_are_cut_into_chunks_of_65519_bytes(self) -> None:
        """A write becomes messages of at most 65 519 plaintext bytes (+16 tag) each, which
        the peer reassembles whatever the slicing of the bytes it receives."""
        initiator, responder = handshake()
        data = bytes(range(256)) * 800  # 204 800 bytes: 4 chunks
        wire = initiator.encrypt(data)
        lengths = []
        at = 0
        while at < len(wire):
            n = int.from_bytes(wire[at : at + 2], "big")
            lengths.append(n)
            at += 2 + n
        self.assertEqual(lengths, [MAX_CHUNK + 16] * 3 + [len(data) - 3 * MAX_CHUNK + 16])
        received = b"".join(
            responder.receive(wire[i : i + 1000])[1] for i in range(0, len(wire), 1000)
        )
        self.assertEqual(received, data)

    def test_another_token_is_unauthorized_at_the_responder(self) -> None:
        """Item 14: a responder with another token cannot read message 1: Unauthorized."""
        initiator = NoiseSession(Role.INITIATOR, OTHER)
        responder = NoiseSession(Role.RESPONDER, TOKEN)
        responder.start()
        self.assertRaises(NoiseUnauthorized, responder.receive, initiator.start())

    def test_a_plaintext_peer_is_not_a_wrong_key(self) -> None:
        """A plaintext Link F HELLO is not a Noise message: a NoiseError, not Unauthorized."""
        from sfnode.linkf.wire import Hello, LinkRole, message_frame

        responder = NoiseSession(Role.RESPONDER, TOKEN)
        responder.start()
        with self.assertRaises(NoiseError) as caught:
            responder.receive(message_frame(Hello((2, 2), LinkRole.HEAD_DAEMON, TOKEN), 1))
        self.assertNotIsInstance(caught.exception, NoiseUnauthorized)

    def test_tampered_transport_message_is_fatal(self) -> None:
        """A transport message that fails to decrypt is a NoiseError (fatal, 4.2)."""
        initiator, responder = handshake()
        wire = bytearray(initiator.encrypt(b"hello"))
        wire[5] ^= 1
        self.assertRaises(NoiseError, responder.receive, bytes(wire))

    def test_no_token_no_noise(self) -> None:
        """A Noise session needs a token: an empty one is a programming error."""
        self.assertRaises(ValueError, NoiseSession, Role.INITIATOR, b"")


class Collect(Protocol):
    """Collects what it receives; ``got(n)`` fires once n bytes arrived."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed: defer.Deferred[None] = defer.Deferred()
        self._want: list[tuple[int, defer.Deferred[bytes]]] = []
        self.connected_d: defer.Deferred[None] = defer.Deferred()

    def connectionMade(self) -> None:
        self.connected_d.callback(None)

    def got(self, n: int) -> defer.Deferred[bytes]:
        d: defer.Deferred[bytes] = defer.Deferred()
        self._want.append((n, d))
        self._check()
        return d

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        self._check()

    def _check(self) -> None:
        for want in list(self._want):
            if len(self.data) >= want[0]:
                self._want.remove(want)
                want[1].callback(bytes(self.data))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed.callback(None)


class Recording(NoiseProtocol):
    """A Noise protocol that keeps every raw byte it receives, for the ciphertext checks."""

    raw: bytearray

    def dataReceived(self, data: bytes) -> None:
        if not hasattr(self, "raw"):
            self.raw = bytearray()
        self.raw += data
        super().dataReceived(data)


class TransportTests(NodeTestCase):
    """Item 14 over real loopback TCP."""

    @defer.inlineCallbacks
    def pair(self, server_token: bytes, client_token: bytes, refused: list[str]) -> Any:
        servers: list[Collect] = []
        self.first_server: defer.Deferred[Collect] = defer.Deferred()

        def server_protocol() -> Collect:
            servers.append(Collect())
            if not self.first_server.called:
                self.first_server.callback(servers[-1])
            return servers[-1]

        server_factory = NoiseFactory(
            Factory.forProtocol(server_protocol),
            token=server_token,
            role=Role.RESPONDER,
            clock=reactor,
            handshake_timeout_s=5.0,
            on_refused=refused.append,
        )
        server_factory.protocol = Recording
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(server_factory)
        self.addCleanup(port.stopListening)
        client = Collect()
        client_factory = NoiseFactory(
            Factory.forProtocol(lambda: client),
            token=client_token,
            role=Role.INITIATOR,
            clock=reactor,
            handshake_timeout_s=5.0,
        )
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        wrapper = yield endpoint.connect(client_factory)

        def close() -> defer.Deferred[None]:
            if not client.closed.called:
                wrapper.transport.loseConnection()
            return client.closed

        self.addCleanup(close)
        return client, servers, server_factory

    @defer.inlineCallbacks
    def test_small_and_large_writes_and_a_reply_cross(self) -> Gen:
        """Item 14: one token both ways carries 5 bytes, then 200 000 bytes, and a reply; the
        ciphertext on the wire never contains the plaintext and is longer than plaintext +
        2 + 16."""
        client, _, factory = yield self.pair(TOKEN, TOKEN, [])
        yield client.connected_d
        big = bytes((i * 7 + 3) % 251 for i in range(200_000))
        client.transport.write(b"hello")
        client.transport.write(big)
        server = yield self.first_server
        received = yield server.got(200_005)
        self.assertEqual(received, b"hello" + big)
        server.transport.write(b"reply!")
        answer = yield client.got(6)
        self.assertEqual(answer, b"reply!")
        raw = bytes(next(iter(factory.protocols)).raw)
        self.assertNotIn(b"hello", raw)
        self.assertNotIn(big[1000:1032], raw)
        self.assertGreater(len(raw), 200_005 + 2 + 16)

    @defer.inlineCallbacks
    def test_another_token_is_refused_at_the_responder(self) -> Gen:
        """Item 14: a responder with another token logs "refused PEER: its fleet token
        differs", reports the peer, closes, and never hands a byte to its protocol."""
        refused: list[str] = []
        with capturedLogs() as events:
            client, servers, _ = yield self.pair(TOKEN, OTHER, refused)
            client.transport.write(b"secret")
            yield client.closed
        lines = [formatEvent(e) for e in events]
        self.assertEqual(len(refused), 1)
        self.assertTrue(refused[0].startswith("127.0.0.1:"))
        self.assertIn(f"refused {refused[0]}: its fleet token differs", lines)
        self.assertEqual([bytes(s.data) for s in servers], [b""])


class LinkTests(NodeTestCase):
    """Items 13, 20 and 27: Link F over Noise between a real node and a head link."""

    @defer.inlineCallbacks
    def test_keyed_node_serves_over_noise_and_refuses_another_key(self) -> Gen:
        """Items 13, 20, 27 (head dials node): the right token handshakes (identity "node")
        and a generation equals the local run; another token or none fails the handshake,
        and the node logs the other token as refused."""
        node = yield self.start_node(identity="node", auth_token=TOKEN)
        with capturedLogs() as events:
            yield self.assertFailure(self.dial(node, token=OTHER), NodeRefusedError)
        self.assertTrue(
            any("its fleet token differs" in formatEvent(e) for e in events),
            [formatEvent(e) for e in events],
        )
        yield self.assertFailure(self.dial(node, handshake_timeout_s=30.0), NodeRefusedError)
        link = yield self.dial(node, token=TOKEN)
        self.assertEqual(link.node_identity, "node")
        link.assign(1)
        link.append(1, PROMPT)
        outcome = yield link.generate(1, HeadRequest((), 8)).result
        self.assertEqual(
            (outcome.tokens, outcome.finish), (expected_tokens(PROMPT, 8), FINISH_LENGTH)
        )

    @defer.inlineCallbacks
    def test_node_dialing_a_head_is_the_responder(self) -> Gen:
        """Items 37 and 39 with a token (node dials head): the node is still the Noise
        responder and serves a generation; a head with another token is refused by the
        node, which reports it (so ``--head`` mode can stop), and nothing is adopted."""
        node = yield self.start_node(identity="joiner", auth_token=TOKEN)
        for head_token, should_adopt in ((OTHER, False), (TOKEN, True)):
            adopted: defer.Deferred[NodeLink] = defer.Deferred()
            refused: defer.Deferred[str] = defer.Deferred()
            factory = node_factory(
                node.agent,
                on_refused=lambda peer, d=refused: None if d.called else d.callback(peer),
            )
            head = HeadLinkFactory(
                lambda link, d=adopted: d.callback(link),
                reactor=reactor,
                ids=self.ids,
                settings=LinkSettings(token=head_token, handshake_timeout_s=5.0),
            )
            port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(head)
            self.addCleanup(port.stopListening)
            dial = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
            protocol = yield dial.connect(factory)
            if not should_adopt:
                peer = yield refused
                self.assertEqual(peer, f"127.0.0.1:{port.getHost().port}")
                self.assertFalse(adopted.called)
                continue
            link = yield adopted
            self.addCleanup(link.close)
            self.assertEqual(link.node_identity, "joiner")
            yield serves(self, link, 7, 5)
            self.assertFalse(refused.called)
            del protocol


class PlaintextMismatchTests(NodeTestCase):
    """D10: both sides must agree on encryption; a mismatch fails in the handshake."""

    @defer.inlineCallbacks
    def test_plaintext_node_refuses_a_keyed_head(self) -> Gen:
        """A keyed head (Noise) against a node without a token fails its handshake."""
        node = yield self.start_node()
        yield self.assertFailure(
            self.dial(node, token=TOKEN, handshake_timeout_s=30.0), NodeRefusedError
        )
        self.assertEqual(node.agent.connections, ())


class SessionFuzzTests(SynchronousTestCase):
    """Hypothesis: whatever bytes a peer sends, a Noise session raises only NoiseError."""

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(st.lists(st.binary(max_size=120), max_size=6), st.booleans())
    def test_random_bytes_raise_only_noise_errors(
        self, chunks: list[bytes], after_handshake: bool
    ) -> None:
        """Random bytes, before or after a completed handshake and in any slicing, either
        wait for more, decrypt to nothing, or raise NoiseError: no other exception, and the
        session never buffers more than one Noise message."""
        if after_handshake:
            _, responder = handshake()
        else:
            responder = NoiseSession(Role.RESPONDER, TOKEN)
            responder.start()
        try:
            for chunk in chunks:
                _, plaintext = responder.receive(chunk)
                self.assertEqual(plaintext, b"")
                self.assertLessEqual(len(responder._buffer), 2 + 65_535)
        except NoiseError:
            pass
