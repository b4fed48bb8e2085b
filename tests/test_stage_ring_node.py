"""Stage rings on the node (docs/protocol.md section 12.10, D29): two mock nodes on real loopback
TCP, each the stage of a ring that a scripted head JOINed, hand a generation's steps to each other
over their own peer links and copy each token to the head.

The head is a :class:`~tests.nodefixture.RawHead` (behind Noise when the nodes hold a fleet
token); the context goes through the stages with STAGE_BATCH_REQ as 12.8 says, then one
STAGE_RING_ROWS starts the ring.  The mock's 24 layers are split at 12 (node A: 0..12, node B:
12..24), the test vector of section 12.8.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import SynchronousTestCase

from sfnode.linkf.noise import Role, secure_factory
from sfnode.linkf.wire import (
    FEATURE_STAGE_BATCH,
    FEATURE_STAGE_KV,
    FEATURE_STAGE_RING,
    MsgType,
    StageBatchReqMsg,
    StageBatchRespMsg,
    StageBatchRow,
    StageRingJoinMsg,
    StageRingRow,
    StageRingRowsMsg,
    StageRingToken,
    StageRingTokensMsg,
    encode_frame,
)
from sfnode.node.ring import RingTable, dial_refusal
from tests.nodefixture import Gen, NodeTestCase, RawHead, RunningNode, expected_tokens

CONTEXT = tuple(range(100, 112))
"""Session 5's context in the test vector of section 12.8 (its next token is 31198)."""
RING = 7
TOKEN = b"ab" * 32
"""A fleet token (64 hex characters)."""


@defer.inlineCallbacks
def until(condition: Callable[[], bool]) -> Gen:
    """Fires once ``condition()`` holds (looked at every 10 ms)."""
    while not condition():
        yield task.deferLater(reactor, 0.01, lambda: None)


class RingTableTests(SynchronousTestCase):
    def test_a_ring_belongs_to_the_connection_that_joined_it(self) -> None:
        """A JOIN records the ring's stage; the owner's next JOIN replaces it; another
        owner's is refused (the ring unchanged); dropping an owner forgets its rings only."""
        table = RingTable()
        a, b = object(), object()
        self.assertIsNone(table.join(a, 1, 0, 12, "tcp:127.0.0.1:1"))
        self.assertIsNone(table.join(a, 2, 0, 12, "tcp:127.0.0.1:1"))
        self.assertIsNone(table.join(a, 1, 0, 6, "tcp:127.0.0.1:2"))
        refusal = table.join(b, 1, 12, 24, "tcp:127.0.0.1:3")
        self.assertEqual(refusal, "ring 1 is held by another connection")
        stage = table.get(1)
        assert stage is not None
        self.assertEqual((stage.owner, stage.end_layer, stage.next), (a, 6, "tcp:127.0.0.1:2"))
        self.assertIsNone(table.join(b, 3, 12, 24, "tcp:127.0.0.1:3"))
        self.assertEqual(sorted(table.drop_owner(a)), [1, 2])
        self.assertEqual((table.get(1), len(table)), (None, 1))
        self.assertIsNone(table.join(b, 1, 12, 24, "tcp:127.0.0.1:3"))

    def test_only_tcp_and_without_a_token_only_loopback(self) -> None:
        """docs/protocol.md 12.10 and 5.3: a ring dials tcp: endpoints only, and off loopback
        only with a fleet token."""
        self.assertIsNone(dial_refusal("tcp:127.0.0.1:8454", b""))
        self.assertIsNone(dial_refusal("tcp:10.0.0.1:8454", TOKEN))
        self.assertIsNotNone(dial_refusal("tcp:10.0.0.1:8454", b""))
        self.assertIsNotNone(dial_refusal("unix:/tmp/node.sock", TOKEN))
        self.assertIsNotNone(dial_refusal("ssl:127.0.0.1:8454", TOKEN))
        self.assertIsNotNone(dial_refusal("tcp:10.1.2.3:8454:host=127.0.0.1", b""))
        self.assertIsNotNone(dial_refusal("tcp:127.0.0.1", TOKEN))


class _Stages:
    """A scripted head's connections to node A (layers 0..12) and B (12..24)."""

    def __init__(self, test: RingNodeTests, a: RunningNode, b: RunningNode, token: bytes) -> None:
        self.test, self.a, self.b, self.token = test, a, b, token
        self.head_a: RawHead
        self.head_b: RawHead
        self._request = 0

    @defer.inlineCallbacks
    def connect(self) -> Gen:
        self.head_a = yield self.test.connect(self.a, self.token)
        self.head_b = yield self.test.connect(self.b, self.token)

    def join(self, ring: int = RING, next_a: str | None = None) -> None:
        """JOIN ``ring`` on both: A hands on to B (or ``next_a``), B to A."""
        self.head_a.send(StageRingJoinMsg(ring, 0, 12, next_a or self.b.endpoint))
        self.head_b.send(StageRingJoinMsg(ring, 12, 24, self.a.endpoint))

    @defer.inlineCallbacks
    def batch(
        self, head: RawHead, start: int, end: int, row: StageBatchRow
    ) -> Generator[defer.Deferred[Any], Any, Any]:
        """One row through ``head``'s node with STAGE_BATCH_REQ (section 12.8): its answer."""
        self._request += 1
        request = self._request
        head.send(StageBatchReqMsg(request, start, end, (row,)))
        answer = yield head.wait_for(
            lambda m: isinstance(m, StageBatchRespMsg) and m.request_id == request
        )
        return answer.answers[0]

    @defer.inlineCallbacks
    def step(
        self, session: int, position: int, tokens: tuple[int, ...]
    ) -> Generator[defer.Deferred[Any], Any, int]:
        """``tokens`` at ``position`` through A then B: the token after them."""
        row = StageBatchRow(session, position, tokens, None)
        hidden = yield self.batch(self.head_a, 0, 12, row)
        row = StageBatchRow(session, position, (), hidden.hidden)
        answer = yield self.batch(self.head_b, 12, 24, row)
        self.test.assertIsNotNone(answer.token)
        return int(answer.token)

    @defer.inlineCallbacks
    def step_a(self, session: int) -> Gen:
        """Session ``session``'s context (:data:`CONTEXT`) through A alone."""
        yield self.batch(self.head_a, 0, 12, StageBatchRow(session, 0, CONTEXT, None))

    def ring_tokens(self, head: RawHead, ring: int = RING) -> list[StageRingToken]:
        return [t for m in head.of_type(StageRingTokensMsg) if m.ring == ring for t in m.tokens]

    def tokens_until(self, head: RawHead, count: int, ring: int = RING) -> defer.Deferred[Any]:
        """Fires once ``head`` got ``count`` entries of ``ring``."""
        return head.wait_for(
            lambda m: (
                isinstance(m, StageRingTokensMsg)
                and m.ring == ring
                and len(self.ring_tokens(head, ring)) >= count
            )
        )


class RingNodeTests(NodeTestCase):
    @defer.inlineCallbacks
    def connect(self, node: RunningNode, token: bytes = b"") -> Generator[Any, Any, RawHead]:
        """A raw head that said HELLO to ``node`` (behind Noise with ``token``)."""
        head = RawHead()
        factory = secure_factory(
            Factory.forProtocol(lambda: head.protocol),
            token,
            role=Role.INITIATOR,
            clock=reactor,
            handshake_timeout_s=10.0,
        )
        yield TCP4ClientEndpoint(reactor, "127.0.0.1", node.port_number).connect(factory)

        def close() -> defer.Deferred[None]:
            if not head.lost.called:
                head.protocol.transport.loseConnection()
            return head.lost

        self.addCleanup(close)
        yield head.hello(token)
        return head

    @defer.inlineCallbacks
    def stages(
        self, token: bytes = b"", token_b: bytes | None = None, **b_options: Any
    ) -> Generator[Any, Any, _Stages]:
        """Nodes A and B (with ``token``; B with ``token_b`` when given, and ``b_options``)
        and a head connected to both."""
        a = yield self.start_node(identity="a", listens=True, auth_token=token)
        b = yield self.start_node(
            identity="b", listens=True, auth_token=token if token_b is None else token_b,
            **b_options,
        )  # fmt: skip
        stages = _Stages(self, a, b, token)
        if token_b is None:
            yield stages.connect()
        return stages

    def record_peer_sends(self, node: RunningNode) -> list[StageRingRowsMsg]:
        """Every STAGE_RING_ROWS ``node`` hands to a peer link, from now on."""
        sent: list[StageRingRowsMsg] = []
        peers = node.agent.peers
        send = peers.send

        def recording(endpoint: str, message: StageRingRowsMsg) -> None:
            sent.append(message)
            send(endpoint, message)

        peers.send = recording  # type: ignore[method-assign]
        return sent

    @defer.inlineCallbacks
    def run_ring(self, token: bytes) -> Gen:
        stages = yield self.stages(token)
        stages.join()
        first = yield stages.step(5, 0, CONTEXT)
        self.assertEqual(first, 31198)
        sent_a, sent_b = self.record_peer_sends(stages.a), self.record_peer_sends(stages.b)
        stages.head_a.send(StageRingRowsMsg(RING, (StageRingRow(5, 12, (31198,), None, 3, ()),)))
        yield stages.tokens_until(stages.head_b, 3)
        got = stages.ring_tokens(stages.head_b)
        self.assertEqual([(t.stage_session, t.position) for t in got], [(5, 13), (5, 14), (5, 15)])
        self.assertEqual(got[0].token, 16521)
        # The same steps as 12.8's STAGE_BATCH_REQs on a second session.
        plain, context = [], [*CONTEXT, 31198]
        yield stages.step(6, 0, CONTEXT)
        for _ in range(3):
            token_ = yield stages.step(6, len(context) - 1, (context[-1],))
            plain.append(token_)
            context.append(token_)
        self.assertEqual([t.token for t in got], plain)
        self.assertEqual(plain, expected_tokens(CONTEXT, 4)[1:])
        # B handed on the steps of 13 and 14 only (left 3, 2), A the hidden rows of 12..14:
        # no fourth token is coming.
        self.assertEqual([m.rows[0].left for m in sent_b], [2, 1])
        self.assertEqual([m.rows[0].position for m in sent_a], [12, 13, 14])
        self.assertEqual(len(stages.ring_tokens(stages.head_b)), 3)
        self.assertEqual(stages.ring_tokens(stages.head_a), [])

    def test_a_ring_makes_the_tokens_of_kept_stages(self) -> None:
        """Section 12.10: after the context, STAGE_RING_ROWS `[5, 12, [31198], nil, 3, []]` to
        A gives the head, from B, the tokens at 13, 14 and 15 (16521 first, 12.8's test
        vector), the same as STAGE_BATCH_REQ steps give a second session, and no more."""
        return self.run_ring(b"")

    def test_a_ring_with_a_fleet_token(self) -> None:
        """With a fleet token the peer links speak Noise as a head's links do (5.1): the same
        tokens."""
        return self.run_ring(TOKEN)

    @defer.inlineCallbacks
    def test_a_stop_token_ends_the_ring(self) -> None:
        """A token in the row's ``stop`` is the ring's last, whatever ``left`` says."""
        stages = yield self.stages()
        stages.join()
        yield stages.step(5, 0, CONTEXT)
        sent_b = self.record_peer_sends(stages.b)
        stop = expected_tokens(CONTEXT, 3)[2]
        rows = (StageRingRow(5, 12, (31198,), None, 10, (2, stop)),)
        stages.head_a.send(StageRingRowsMsg(RING, rows))
        yield stages.tokens_until(stages.head_b, 2)
        got = stages.ring_tokens(stages.head_b)
        self.assertEqual([(t.position, t.token) for t in got], [(13, 16521), (14, stop)])
        self.assertEqual(len(sent_b), 1)

    @defer.inlineCallbacks
    def test_an_unknown_session_is_a_nil_entry(self) -> None:
        """A row the stage refuses (its session unknown at a position past 0) is reported to
        the ring's head as a nil token at the row's position; nothing is handed on."""
        stages = yield self.stages()
        stages.join()
        sent_a = self.record_peer_sends(stages.a)
        stages.head_a.send(StageRingRowsMsg(RING, (StageRingRow(9, 12, (1,), None, 3, ()),)))
        yield stages.tokens_until(stages.head_a, 1)
        self.assertEqual(stages.ring_tokens(stages.head_a), [StageRingToken(9, 12, None)])
        self.assertEqual(sent_a, [])

    @defer.inlineCallbacks
    def test_a_step_of_more_than_one_token_is_refused(self) -> None:
        """A ring runs decode steps, one position a row: a row of two tokens is refused
        before it runs (a nil entry, its session dropped), since the last stage could not
        count the rows of its hidden states; nothing is handed on."""
        stages = yield self.stages()
        stages.join()
        yield stages.step_a(5)
        sent_a = self.record_peer_sends(stages.a)
        rows = (StageRingRow(5, 12, (31198, 16521), None, 3, ()),)
        stages.head_a.send(StageRingRowsMsg(RING, rows))
        yield stages.tokens_until(stages.head_a, 1)
        self.assertEqual(stages.ring_tokens(stages.head_a), [StageRingToken(5, 12, None)])
        self.assertEqual(sent_a, [])
        gone = yield stages.batch(stages.head_a, 0, 12, StageBatchRow(5, 12, (31198,), None))
        self.assertEqual((gone.hidden, gone.token), (None, None))

    @defer.inlineCallbacks
    def test_rows_a_peer_link_cannot_deliver_are_nil_entries(self) -> None:
        """A ``next`` nobody listens on, one that is not tcp:, one off loopback without a
        token, and one Twisted cannot dial: the rows handed on come back to the ring's head
        as nil entries, and the next use dials again."""
        stages = yield self.stages()
        free = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Factory())
        nobody = f"tcp:127.0.0.1:{free.getHost().port}"
        yield free.stopListening()
        yield stages.step(5, 0, CONTEXT)
        yield stages.step(6, 0, CONTEXT)
        unreachable = (
            (1, nobody), (2, "unix:/nowhere"), (3, "tcp:10.0.0.1:8454"), (4, "tcp:127.0.0.1"),
        )  # fmt: skip
        for ring, next_a in unreachable:
            stages.join(ring, next_a)
            rows = (
                StageRingRow(5, 12, (31198,), None, 3, ()),
                StageRingRow(6, 12, (31198,), None, 3, ()),
            )
            stages.head_a.send(StageRingRowsMsg(ring, rows))
            yield stages.tokens_until(stages.head_a, 2, ring)
            self.assertEqual(
                stages.ring_tokens(stages.head_a, ring),
                [StageRingToken(5, 12, None), StageRingToken(6, 12, None)],
            )
            self.assertEqual(len(stages.a.agent.peers), 0)

    @defer.inlineCallbacks
    def test_bit_9_only_when_listening(self) -> None:
        """A node with kept stages sets bit 9 with ``--listen`` (its neighbour can dial it),
        and bits 7 and 8 either way."""
        listening = yield self.start_node(listens=True)
        dialling = yield self.start_node()
        both = FEATURE_STAGE_KV | FEATURE_STAGE_BATCH
        for node, bits in ((listening, both | FEATURE_STAGE_RING), (dialling, both)):
            head = yield RawHead.connect(self, node)
            ack = yield head.hello()
            self.assertEqual(ack.feature_flags & (both | FEATURE_STAGE_RING), bits)

    def test_the_tap_says_whether_the_node_listens(self) -> None:
        """``twistd sfnode --listen`` builds a listening node; ``--head`` does not."""
        from sfnode.node.tap import Options, makeService

        for args, listens in (
            (["--listen", "tcp:0:interface=127.0.0.1"], True),
            (["--head", "tcp:127.0.0.1:8454"], False),
        ):
            options = Options()
            options.parseOptions([*args, "--engine", "mock"])
            agent = makeService(options, reactor).getServiceNamed("agent").agent
            self.assertEqual(agent.config.listens, listens)

    @defer.inlineCallbacks
    def test_a_ring_is_its_joining_connections(self) -> None:
        """A JOIN of a ring another connection holds is refused: that ring's rows, from any
        connection, are reported to the holder; once the holder closes, the ring is
        forgotten and the other connection's JOIN takes it."""
        stages = yield self.stages()
        other = yield self.connect(stages.a)
        unknown = StageRingRowsMsg(RING, (StageRingRow(9, 12, (1,), None, 3, ()),))
        stages.head_a.send(StageRingJoinMsg(RING, 0, 12, stages.b.endpoint))
        stages.head_a.send(unknown)
        yield stages.tokens_until(stages.head_a, 1)
        other.send(StageRingJoinMsg(RING, 0, 12, stages.b.endpoint))
        other.send(unknown)
        yield stages.tokens_until(stages.head_a, 2)
        self.assertEqual(stages.ring_tokens(other), [])
        stages.head_a.protocol.transport.loseConnection()
        yield until(lambda: len(stages.a.agent.connections) == 1)
        other.send(StageRingJoinMsg(RING, 0, 12, stages.b.endpoint))
        other.send(unknown)
        yield stages.tokens_until(other, 1)
        self.assertEqual(stages.ring_tokens(other), [StageRingToken(9, 12, None)])

    @defer.inlineCallbacks
    def test_a_malformed_ring_frame_closes_only_its_connection(self) -> None:
        """A JOIN without a next endpoint, or ROWS without rows, closes that connection; the
        other connections of the node go on (section 12.10, Malformed)."""
        stages = yield self.stages()
        for payload, msg_type in (
            (bytes.fromhex("94070003a0"), MsgType.STAGE_RING_JOIN),
            (bytes.fromhex("920790"), MsgType.STAGE_RING_ROWS),
        ):
            bad = yield self.connect(stages.a)
            bad.send_bytes(encode_frame(int(msg_type), 9, payload))
            yield bad.lost
        first = yield stages.step(5, 0, CONTEXT)
        self.assertEqual(first, 31198)

    @defer.inlineCallbacks
    def test_a_peer_link_that_fails_its_handshake_loses_its_rows(self) -> None:
        """A peer that accepts and never answers (the handshake timeout passes), and a node
        of another fleet token (Noise fails): the rows handed on come back nil."""
        stages = yield self.stages(TOKEN, token_b=b"cd" * 32)
        stages.head_a = yield self.connect(stages.a, TOKEN)
        silent = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            Factory.forProtocol(Protocol)
        )
        self.addCleanup(silent.stopListening)
        clock = stages.a.agent.peers.clock = task.Clock()
        yield stages.step_a(5)
        for ring, next_a in ((1, f"tcp:127.0.0.1:{silent.getHost().port}"), (2, stages.b.endpoint)):
            stages.head_a.send(StageRingJoinMsg(ring, 0, 12, next_a))
            rows = (StageRingRow(5, 12, (31198,), None, 3, ()),)
            stages.head_a.send(StageRingRowsMsg(ring, rows))
            if ring == 1:
                yield until(lambda: len(stages.a.agent.peers) == 1)
                clock.advance(10)
            yield stages.tokens_until(stages.head_a, 1, ring)
            self.assertEqual(stages.ring_tokens(stages.head_a, ring), [StageRingToken(5, 12, None)])

    @defer.inlineCallbacks
    def test_a_peer_link_keeps_itself_open(self) -> None:
        """The accepting node drops connections idle for 120 s (section 7.1): a peer link
        sends KEEPALIVE every 15 s, as a head does, so B keeps it past its idle timeout."""
        clock_b = task.Clock()
        stages = yield self.stages(clock=clock_b)
        clock_a = stages.a.agent.peers.clock = task.Clock()
        stages.join()
        yield stages.step(5, 0, CONTEXT)
        stages.head_a.send(StageRingRowsMsg(RING, (StageRingRow(5, 12, (31198,), None, 1, ()),)))
        yield stages.tokens_until(stages.head_b, 1)
        (peer,) = [c for c in stages.b.agent.connections if c.head_id is not None]
        clock_b.advance(100)
        clock_a.advance(15)
        yield until(lambda: any(c.getTime() >= 219 for c in clock_b.getDelayedCalls()))
        clock_b.advance(100)
        self.assertTrue(peer.open)
        clock_b.advance(21)
        self.assertFalse(peer.open)
