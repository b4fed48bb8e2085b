"""Orphaned sessions do not fill a node, and a full node makes the head go elsewhere (issue 19,
item 3; docs/protocol.md sections 6.4 and 7.7).

A session whose lease ran out is fenced; after ``--fenced-grace-ms`` it is deleted with its
unacknowledged events, unless its head came back and assigned it again.  ``--max-sessions``
counts live sessions: a fenced one gives its place to a new one.  A node at its bound declines
the generations of a session it refused, and the head fails over, or waits for room and then
answers 503: never 400 ``context_length_exceeded``.

Nodes and heads are joined in memory (``twisted.test.iosim`` on a ``MemoryReactorClock``) where
leases must run out, so the test moves time exactly; the head that fails over runs over real
loopback TCP.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

from twisted.internet import defer, reactor

from sfnode.engines.mock import MockEngine
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import HeadIds, connect_node
from sfnode.linkf.wire import (
    FINISH_DECLINED,
    FINISH_LENGTH,
    AppendContentMsg,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    Lease,
    LeaseStateMsg,
    ReconcileAckMsg,
    ReconcileMsg,
    SessionAssignMsg,
    SessionReconcileState,
    encode_tokens,
)
from tests.nodefixture import (
    PROMPT,
    Gen,
    MemoryNodeTestCase,
    RawHead,
    expected_tokens,
    finish_of,
    stream_of,
)
from tests.test_http import MESSAGES, MODEL, HttpTestCase
from tests.test_http import expected_tokens as vocab_tokens
from tests.tinymodel import TINY_VOCAB

SHORT = Lease(1000, 800)


def place(head: RawHead, command: int, session: int, lease: Lease = SHORT) -> None:
    """ASSIGN (epoch 1) and APPEND ``PROMPT`` with commands ``command`` and ``command + 1``."""
    head.send(SessionAssignMsg(command, session, 1, lease, "", b"", 0, 0))
    head.send(AppendContentMsg(command + 1, session, 1, encode_tokens(PROMPT)))


def reconcile(head: RawHead, *sessions: int) -> defer.Deferred[Any]:
    """A RECONCILE of ``sessions`` (epoch 1); fires with its RECONCILE_ACK.  Also a barrier:
    everything sent before it on this connection has been handled when it answers."""
    states = tuple(SessionReconcileState(s, 1, LeaseStateMsg(SHORT, 0), 0, ()) for s in sessions)
    before = len(head.received)
    head.send(ReconcileMsg(states))
    return head.wait_for(
        lambda m: isinstance(m, ReconcileAckMsg) and any(m is x for x in head.received[before:])
    )


class GraceTests(MemoryNodeTestCase):
    def test_a_fenced_session_is_deleted_after_its_grace_period(self) -> None:
        """Lease 1 s, grace 5 s: a session whose head never renews is fenced at 1 s (record
        and unacknowledged events kept), and deleted at 6 s with its events; another whose
        head comes back 3 s after its fence and assigns it again is un-fenced, served, and
        outlives the first one's deletion."""
        node = self.start_node(fenced_grace_ms=5000)
        head = self.raw_head(node)
        self.wait(head.hello())
        place(head, 1, 1)
        place(head, 3, 2)
        head.send(GenerateReqMsg(5, 1, 1, 7, GenerationBudgetsMsg(3)))
        self.wait(head.wait_for(finish_of(1, 7)))
        self.wait(reconcile(head))
        table = node.agent.session
        self.assertEqual(table.unacked_events(1, 7), len(head.events(1, 7)))
        self.reactor.advance(1.0)
        self.assertEqual((table.is_fenced(1), table.is_fenced(2)), (True, True))
        self.assertEqual(table.unacked_events(1, 7), len(head.events(1, 7)))
        self.reactor.advance(3.0)
        ack = self.wait(reconcile(head, 1, 2))
        self.assertEqual([e.held for e in ack.sessions], [False, False])
        head.send(SessionAssignMsg(6, 2, 1, Lease(600_000, 450_000), "", b"", 0, 0))
        head.send(AppendContentMsg(7, 2, 1, encode_tokens(PROMPT)))
        self.wait(reconcile(head))
        self.assertFalse(table.is_fenced(2))
        self.reactor.advance(1.999)
        self.assertTrue(table.has_session(1))
        self.reactor.advance(0.002)
        self.assertEqual(table.session_ids(), [2])
        self.assertEqual(table.unacked_events(1, 7), 0)
        self.reactor.advance(10.0)
        head.send(GenerateReqMsg(8, 2, 1, 1, GenerationBudgetsMsg(4)))
        self.wait(head.wait_for(finish_of(2, 1)))
        self.assertEqual(
            stream_of(head.events(2, 1)), (expected_tokens(PROMPT, 4), [FINISH_LENGTH])
        )


class LiveSessionBoundTests(MemoryNodeTestCase):
    def test_max_sessions_counts_live_sessions(self) -> None:
        """max_sessions=2 with sessions 1 and 2 held: session 1's lease runs out, so a third
        session is accepted and served, taking the fenced one's place (the node never holds
        more than two records); with two live sessions a fourth is refused and its GENERATE
        declined, which the capacity report shows as 2 of 2."""
        node = self.start_node(max_sessions=2, fenced_grace_ms=0)
        head = self.raw_head(node)
        self.wait(head.hello())
        place(head, 1, 1)
        place(head, 3, 2, Lease(600_000, 450_000))
        self.wait(reconcile(head))
        self.reactor.advance(1.0)
        table = node.agent.session
        self.assertTrue(table.is_fenced(1))
        place(head, 5, 3, Lease(600_000, 450_000))
        head.send(GenerateReqMsg(7, 3, 1, 1, GenerationBudgetsMsg(4)))
        self.wait(head.wait_for(finish_of(3, 1)))
        self.assertEqual(
            stream_of(head.events(3, 1)), (expected_tokens(PROMPT, 4), [FINISH_LENGTH])
        )
        self.assertEqual(table.session_ids(), [2, 3])
        place(head, 8, 4, Lease(600_000, 450_000))
        head.send(GenerateReqMsg(10, 4, 1, 1, GenerationBudgetsMsg(4)))
        self.wait(head.wait_for(finish_of(4, 1)))
        self.assertEqual(stream_of(head.events(4, 1)), ([], [FINISH_DECLINED]))
        capacity = node.agent.reports.capacity()
        self.assertEqual((capacity.active_sessions, capacity.max_sessions), (2, 2))


class FullNodeTests(HttpTestCase):
    timeout = 60

    @defer.inlineCallbacks
    def full_node(self, identity: str, **config: Any) -> Generator[defer.Deferred[Any], Any, Any]:
        """A node of the tiny vocabulary with max_sessions=1 whose one session another head
        holds; it reports its load once a minute, so the head learns that it is full only
        when it declines."""
        engine = MockEngine(reactor, vocab_size=TINY_VOCAB)
        node = yield self.start_node(
            identity=identity, engine=engine, max_sessions=1, status_interval_ms=60_000, **config
        )
        return node

    @defer.inlineCallbacks
    def fill(self, node: Any) -> Gen:
        """Another head takes the node's one session (an id this head does not use)."""
        other = yield connect_node(reactor, node.endpoint, ids=HeadIds())
        self.addCleanup(other.close)
        other.assign(99)
        other.append(99, [5, 6, 7])
        outcome = yield other.generate(99, HeadRequest((), 1)).result
        self.assertEqual(outcome.finish, FINISH_LENGTH)

    @defer.inlineCallbacks
    def test_a_full_node_declines_and_the_head_fails_over(self) -> Gen:
        """A request placed on a node whose one session another head holds is declined there,
        and the head answers it from the other node: 200 with that node's greedy tokens, one
        failover, never a 400."""
        full = yield self.full_node("full")
        spare = yield self.start_vocab_node(identity="spare")
        head = yield self.start_head([full, spare])
        yield self.fill(full)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        status, content = yield self.call(head, b"POST", "/v1/chat/completions", body)
        self.assertEqual(status, 200, content)
        text = self.text_of(vocab_tokens(self.prompt_ids(MESSAGES), 6))
        self.assertEqual(json.loads(content)["choices"][0]["message"]["content"], text)
        self.assertEqual(head.fleet.failovers, 1)
        self.assertIsNotNone(head.fleet.node_named("full").declined_at)

    @defer.inlineCallbacks
    def test_with_every_node_full_the_request_waits_then_gets_503(self) -> Gen:
        """The only node is full: the request is declined, waits in the head's queue for room
        (queue timeout 1 s), and gets 503 no_node_available saying the node is full, not 400
        context_length_exceeded."""
        full = yield self.full_node("full")
        head = yield self.start_head([full], fleet_options={"queue_timeout_s": 1.0})
        yield self.fill(full)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6}
        status, content = yield self.call(head, b"POST", "/v1/chat/completions", body)
        error = json.loads(content)["error"]
        self.assertEqual((status, error["code"]), (503, "no_node_available"), content)
        self.assertIn("full", error["message"])
