"""Heads that share a node, or a head that restarts, never touch each other's sessions (issue 19,
item 2; docs/protocol.md decision D13 and section 12.4), and no generation hangs its request
when its Finish never comes (``--max-generation-time``).

Every head (a ``HeadIds``) names itself in its HELLO with a random 64-bit identity, and the node
keeps each identity's sessions in a table of their own.  Here two heads number their sessions,
epochs and commands from 1 on one node in memory (tests/memoryhead.py); a scripted head
(``RawHead``) sends another head's ids in REVOKE, RECONCILE and WATERMARK_ACK; and ``twistd
sfhead``'s service tree answers a generation that outlived its wall budget with 504 to the
``openai`` package and to a stream, over real TCP.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

from twisted.internet import defer, reactor, threads
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.trial.unittest import SynchronousTestCase, TestCase

from sfnode.engines.mock import MockEngine
from sfnode.generation import EngineStop
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.fleet import FleetSettings, GenerationTimedOut
from sfnode.head.fleet.pipeline import PipelineFleet
from sfnode.head.link import HeadIds, connect_node
from sfnode.linkf.wire import (
    FEATURE_HEAD_IDENTITY,
    FINISH_LENGTH,
    GenerationWatermark,
    Hello,
    LeaseStateMsg,
    LinkRole,
    ReconcileAckMsg,
    ReconcileMsg,
    SessionReconcileState,
    SessionRevokeMsg,
    StageForwardReqMsg,
    WatermarkAckMsg,
    decode_message,
    message_frame,
)
from tests.memoryhead import MemoryHeadTestCase, stop_at_end
from tests.nodefixture import expected_tokens
from tests.test_head_link import FakeNodeFactory
from tests.test_head_security import HeadServiceTestCase
from tests.test_http import MESSAGES, MODEL, record_ends
from tests.test_http_hostile import RawClient, request_bytes
from tests.test_node_link import LONG_LEASE

PROMPT_A = list(range(100, 112))
PROMPT_B = list(range(300, 309))
Gen = Generator[defer.Deferred[Any], Any, None]


class HelloTests(SynchronousTestCase):
    def test_the_head_id_is_an_optional_fourth_element(self) -> None:
        """docs/protocol.md section 12.4's example: HELLO{(2, 2), HeadDaemon, empty auth,
        head_id 5} is byte for byte the document's frame; the three-element HELLO of 2.5 is
        unchanged and reads as a head without identity."""
        frame = message_frame(Hello((2, 2), LinkRole.HEAD_DAEMON, b"", 5), 1)
        self.assertEqual(
            frame.hex(),
            "1e000000" "0200" "0100" "0100000000000000" "0000000000000000" "00"
            "949202029102c40005",
        )  # fmt: skip
        self.assertEqual(decode_message(1, frame[25:]).head_id, 5)  # type: ignore[attr-defined]
        old = message_frame(Hello((2, 2), LinkRole.HEAD_DAEMON, b""), 1)
        self.assertEqual(old[25:].hex(), "939202029102c400")
        self.assertIsNone(decode_message(1, old[25:]).head_id)  # type: ignore[attr-defined]


class SharedNodeTests(MemoryHeadTestCase):
    """Several heads on one node, in memory (tests/memoryhead.py)."""

    def test_two_heads_stream_the_same_session_id_at_once(self) -> None:
        """Two heads, each numbering sessions, epochs and command ids from 1, stream their
        session 1 on one node at the same time: both finish with the tokens of a local run of
        their own prompt, and the node holds each one's session under its own identity."""
        node = self.start_mock_node(token_delay_s=0.005)
        first_ids, second_ids = HeadIds(), HeadIds()
        self.assertNotEqual(first_ids.head_id, second_ids.head_id)
        links = []
        for ids in (first_ids, second_ids):
            link = self.wait(connect_node(self.reactor, node.endpoint, ids=ids))
            stop_at_end(self, link.close)
            self.assertTrue((link.features or 0) & FEATURE_HEAD_IDENTITY)
            links.append(link)
        streamed: list[list[int]] = [[], []]
        calls = []
        for link, prompt, seen in zip(links, (PROMPT_A, PROMPT_B), streamed, strict=True):
            self.assertEqual(link.assign(1), 1)
            link.append(1, prompt)
            calls.append(link.generate(1, HeadRequest((), 40), on_tokens=seen.extend))
        outcomes = self.wait(defer.gatherResults([c.result for c in calls]))
        for outcome, prompt, seen in zip(outcomes, (PROMPT_A, PROMPT_B), streamed, strict=True):
            self.assertEqual(
                (outcome.tokens, outcome.finish), (expected_tokens(prompt, 40), FINISH_LENGTH)
            )
            self.assertEqual(seen, outcome.tokens)
        for ids, prompt in ((first_ids, PROMPT_A), (second_ids, PROMPT_B)):
            self.assertEqual(list(node.agent.contexts_of(ids.head_id)[1]), prompt)

    def test_another_heads_revoke_reconcile_and_ack_touch_nothing(self) -> None:
        """While a head streams session 1, another head sends that session's ids in a
        WATERMARK_ACK (everything acknowledged), a RECONCILE (which on one table would move
        the stream to it) and two REVOKEs: it is told it holds nothing, it receives none of the
        stream, and the first head's stream finishes whole, its session still held."""
        node = self.start_mock_node(token_delay_s=0.01)
        link = self.dial()
        epoch = link.assign(1)
        link.append(1, PROMPT_A)
        streamed: list[int] = []
        started: defer.Deferred[None] = defer.Deferred()

        def seen(tokens: Any) -> None:
            streamed.extend(tokens)
            if not started.called:
                started.callback(None)

        call = link.generate(1, HeadRequest((), 60), on_tokens=seen)
        self.wait(started)
        other = HeadIds()
        intruder = self.raw_head()
        self.wait(intruder.hello(head_id=other.head_id))
        generation = call.generation_id
        intruder.send(WatermarkAckMsg(1, epoch, generation, 1 << 40))
        intruder.send(
            ReconcileMsg(
                (
                    SessionReconcileState(
                        1, epoch, LeaseStateMsg(LONG_LEASE, 0), 1,
                        (GenerationWatermark(generation, None),),
                    ),
                )
            )
        )  # fmt: skip
        ack = self.wait(intruder.wait_for(lambda m: isinstance(m, ReconcileAckMsg)))
        ((entry,),) = [ack.sessions]
        self.assertEqual((entry.session_id, entry.held, entry.retry_ranges), (1, False, ()))
        intruder.send(SessionRevokeMsg(1 << 40, 1, epoch))
        intruder.send(SessionRevokeMsg((1 << 40) + 1, 1, epoch + 1000))
        outcome = self.wait(call.result)
        self.assertEqual(
            (outcome.tokens, outcome.finish), (expected_tokens(PROMPT_A, 60), FINISH_LENGTH)
        )
        self.assertEqual(streamed, outcome.tokens)
        self.assertEqual(intruder.events(1, generation), [])
        table = node.agent.sessions_of(self.ids.head_id)
        self.assertTrue(table.has_session(1))
        self.assertFalse(table.is_fenced(1))
        self.assertFalse(node.agent.sessions_of(other.head_id).has_session(1))

    def test_a_replayed_revoke_deletes_nothing(self) -> None:
        """A REVOKE from the session's own head whose command id was already applied (the
        ASSIGN's) is a replay and deletes nothing; one with a fresh id deletes the session."""
        node = self.start_mock_node()
        link = self.dial()
        epoch = link.assign(1)
        link.append(1, PROMPT_A)
        self.wait(link.generate(1, HeadRequest((), 2)).result)
        assign_command = 1  # the first command id of this head's first link: its ASSIGN
        same = self.raw_head()
        self.wait(same.hello(head_id=self.ids.head_id))
        # Each REVOKE is followed by a RECONCILE (watermark 0: it forgets no command id),
        # whose answer says whether the session is still held.
        barrier = ReconcileMsg(
            (SessionReconcileState(1, epoch, LeaseStateMsg(LONG_LEASE, 0), 0, ()),)
        )
        same.send(SessionRevokeMsg(assign_command, 1, epoch))
        same.send(barrier)
        ack = self.wait(same.wait_for(lambda m: isinstance(m, ReconcileAckMsg)))
        self.assertTrue(ack.sessions[0].held)
        self.assertTrue(node.agent.sessions_of(self.ids.head_id).has_session(1))
        same.send(SessionRevokeMsg(1 << 41, 1, epoch))
        same.send(barrier)
        self.wait(
            same.wait_for(lambda m: isinstance(m, ReconcileAckMsg) and not m.sessions[0].held)
        )
        self.assertFalse(node.agent.sessions_of(self.ids.head_id).has_session(1))


class GenerationBudgetTests(HeadServiceTestCase):
    timeout = 60

    def slow_engine(self) -> tuple[MockEngine, list[defer.Deferred[Any]]]:
        """A mock engine whose tokens come every 0.25 s, and how each of its generations
        ended (``record_ends``)."""
        from tests.tinymodel import TINY_VOCAB

        engine = MockEngine(reactor, token_delay_s=0.25, vocab_size=TINY_VOCAB)
        return engine, record_ends(engine)

    @defer.inlineCallbacks
    def test_a_generation_past_its_budget_is_a_504_and_frees_its_lane(self) -> Gen:
        """With --max-generation-time 1, a chat completion of 1,000 tokens at 4 a second gets
        HTTP 504 generation_timeout in OpenAI's shape (the openai package raises it), its
        generation is cancelled on the node and the head counts no generation running; a
        stream gets its first tokens, then an error event with the same code and [DONE]."""
        import openai

        engine, ended = self.slow_engine()
        node = yield self.start_vocab_node(engine=engine)
        head = yield self.start_sfhead([node], "--max-generation-time", "1")
        client = openai.OpenAI(base_url=head.base + "/v1", api_key="unused", max_retries=0)
        self.addCleanup(client.close)

        def chat() -> Any:
            return client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=1000, temperature=0
            )

        with self.assertRaises(openai.APIStatusError) as raised:
            yield threads.deferToThread(chat)
        self.assertEqual(raised.exception.status_code, 504)
        self.assertEqual(raised.exception.code, "generation_timeout")
        fleet = head.service.getServiceNamed("fleet").fleet  # type: ignore[no-untyped-call]
        self.assertEqual([n.inflight for n in fleet.nodes], [0])
        result = yield ended[0]
        self.assertEqual(result.stop, EngineStop.CANCELLED)

        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", head.port)
        raw = RawClient()
        yield connectProtocol(endpoint, raw)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1000, "stream": True}
        raw.send(request_bytes("/v1/chat/completions", json.dumps(body).encode()))
        answer = yield raw.ended
        self.assertTrue(answer.startswith(b"HTTP/1.1 200"), answer[:200])
        events = [
            line[6:] for line in answer.replace(b"\r\n", b"\n").split(b"\n")
            if line.startswith(b"data: ")
        ]  # fmt: skip
        self.assertEqual(events[-1], b"[DONE]")
        error = json.loads(events[-2])["error"]
        self.assertEqual(error["code"], "generation_timeout")
        contents = [
            c["delta"].get("content") for e in events[:-2] for c in json.loads(e)["choices"]
        ]
        self.assertTrue(any(contents), "the stream had tokens before its budget passed")
        self.assertEqual([n.inflight for n in fleet.nodes], [0])


class PipelineBudgetTests(TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def test_a_stage_that_never_answers_fails_the_generation_at_its_budget(self) -> Gen:
        """A pipeline stage that shakes hands and never answers a STAGE_FORWARD_REQ: the
        pipelined generation fails with GenerationTimedOut at the fleet's wall budget (0.5 s
        here), and the link waits for that stage forward no more."""
        factory = FakeNodeFactory()
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
        self.addCleanup(port.stopListening)
        pipeline = PipelineFleet(
            reactor,
            [f"tcp:127.0.0.1:{port.getHost().port}"],
            n_layers=24,
            ids=HeadIds(),
            settings=FleetSettings(max_generation_s=0.5),
        )
        self.addCleanup(pipeline.stop)
        yield pipeline.start()
        with self.assertRaises(GenerationTimedOut) as raised:
            yield pipeline.generate(HeadRequest(PROMPT_A, 4)).result
        self.assertIn("did not end within 0.5 s", str(raised.exception))
        (node,) = factory.nodes
        self.assertEqual(len(node.of_type(StageForwardReqMsg)), 1)
        self.assertEqual(pipeline.stages[0].link.calls.forwards, 0)
