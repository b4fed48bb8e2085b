"""Request classes at the head (docs/protocol.md section 12.2): the header, the default and its
options, the link that carries the class only to nodes that read it, and placement.

The rule and placement are pure functions, tested alone; the fleet runs in memory
(tests/memoryhead.py); the link and the HTTP API run over real loopback TCP against mock-engine
nodes whose engine records what it was asked (the class included), with the head built by
``sfnode.head.tap.makeService`` from its command line.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from io import BytesIO
from typing import Any

from twisted.internet import defer, reactor
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import Agent, FileBodyProducer, readBody
from twisted.web.http_headers import Headers

from sfnode.head.api.request_class import (
    DEFAULT_INTERACTIVE_PROMPT_TOKENS,
    ClassRule,
    DefaultClass,
    class_name,
    parse_header,
)
from sfnode.head.fleet import placement
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.placement import NodeView, Place, Policy, Request, Wait, decide
from sfnode.head.link import GenerationCall
from sfnode.head.tap import Options
from sfnode.linkf.wire import (
    FEATURE_REQUEST_CLASS,
    FINISH_LENGTH,
    CapacitySummary,
    Finish,
    GenerateReqMsg,
    HelloAckF,
    LinkFLimits,
    RequestClass,
)
from sfnode.runtime.http_guard import HttpError
from tests import test_head_link
from tests.memoryhead import MemoryHeadTestCase
from tests.nodefixture import expected_tokens
from tests.test_head_link import LinkTestCase, ev
from tests.test_head_security import HeadServiceTestCase, RunningHead
from tests.test_http import MESSAGES, MODEL
from tests.test_wire_classes import RecordingEngine
from tests.tinymodel import TINY_VOCAB

Gen = Generator[defer.Deferred[Any], Any, None]
INTERACTIVE = RequestClass.INTERACTIVE
BATCH = RequestClass.BATCH


# --------------------------------------------------------------------------------------------
# The rule


class RuleTests(SynchronousTestCase):
    def test_the_header_names_a_class(self) -> None:
        """``interactive`` and ``batch``, in any case and with spaces around, name the class;
        no header names none."""
        self.assertEqual(parse_header(b"interactive"), INTERACTIVE)
        self.assertEqual(parse_header(b" Batch "), BATCH)
        self.assertIsNone(parse_header(None))

    def test_any_other_header_value_is_a_400(self) -> None:
        """Any other value is a 400 invalid_request_class that quotes it."""
        for bad in (b"", b"chat", b"auto", b"interactive,batch", b"\xff"):
            with self.assertRaises(HttpError, msg=repr(bad)) as caught:
                parse_header(bad)
            self.assertEqual(
                (caught.exception.status, caught.exception.code), (400, "invalid_request_class")
            )

    def test_auto_takes_short_prompts_for_interactive(self) -> None:
        """By default a prompt of at most 1024 tokens is interactive and a longer one batch;
        a header overrides the rule both ways."""
        rule = ClassRule()
        self.assertEqual(DEFAULT_INTERACTIVE_PROMPT_TOKENS, 1024)
        self.assertEqual(rule.classify(None, 1024), INTERACTIVE)
        self.assertEqual(rule.classify(None, 1025), BATCH)
        self.assertEqual(rule.classify(BATCH, 5), BATCH)
        self.assertEqual(rule.classify(INTERACTIVE, 5000), INTERACTIVE)

    def test_a_fixed_default_ignores_the_length(self) -> None:
        """``interactive`` and ``batch`` defaults give every request without a header that
        class, whatever its length; the threshold is an option."""
        self.assertEqual(ClassRule(DefaultClass.BATCH).classify(None, 1), BATCH)
        self.assertEqual(ClassRule(DefaultClass.INTERACTIVE).classify(None, 10**6), INTERACTIVE)
        self.assertEqual(ClassRule(DefaultClass.AUTO, 10).classify(None, 11), BATCH)
        self.assertEqual(class_name(BATCH), "batch")

    def test_the_head_options(self) -> None:
        """--default-request-class (auto by default) and --interactive-prompt-tokens (1024 by
        default) become the head's ClassRule; other values are usage errors."""

        def parse(*args: str) -> Options:
            options = Options()
            options.parseOptions(list(args))
            return options

        self.assertEqual(parse()["class-rule"], ClassRule(DefaultClass.AUTO, 1024))
        self.assertEqual(
            parse("--default-request-class", "Batch", "--interactive-prompt-tokens", "64")[
                "class-rule"
            ],
            ClassRule(DefaultClass.BATCH, 64),
        )
        for args in (
            ("--default-request-class", "chat"),
            ("--interactive-prompt-tokens", "-1"),
            ("--interactive-prompt-tokens", "many"),
        ):
            with self.assertRaises(usage.UsageError, msg=repr(args)):
                parse(*args)


# --------------------------------------------------------------------------------------------
# Placement


def view(key: int, lanes: int = 2, age: float | None = 1.0, **fields: Any) -> NodeView:
    """A live node with ``lanes`` lanes and a report ``age`` seconds old."""
    active = fields.pop("lanes_active", 0)
    capacity = CapacitySummary(max_lanes=lanes, lanes_active=active)
    return NodeView(key=key, live=True, capacity=capacity, report_age_s=age, **fields)


class PlacementTests(SynchronousTestCase):
    def test_an_interactive_request_is_not_held_behind_batch_work(self) -> None:
        """On a node that keeps a lane for interactive work, whose lanes the head counts all
        busy with batch work, an interactive request is placed and a batch one waits; one
        more interactive request waits once the head runs one there."""
        full = view(0, inflight=2, features=FEATURE_REQUEST_CLASS)
        self.assertIsInstance(decide([full], Request(None, 10), Policy.LOAD_AWARE), Wait)
        chat = Request(None, 10, interactive=True)
        self.assertEqual(decide([full], chat, Policy.LOAD_AWARE), Place((0,)))
        again = view(0, inflight=3, interactive_inflight=1, features=FEATURE_REQUEST_CLASS)
        self.assertIsInstance(decide([again], chat, Policy.LOAD_AWARE), Wait)

    def test_a_node_that_keeps_no_lane_holds_everyone_alike(self) -> None:
        """A node without the request-class bit takes no generation beyond its lanes,
        interactive or not."""
        old = view(0, inflight=2)
        self.assertIsInstance(
            decide([old], Request(None, 10, interactive=True), Policy.LOAD_AWARE), Wait
        )

    def test_nodes_with_a_free_interactive_lane_come_first(self) -> None:
        """Round-robin tries node 0 first; an interactive request goes to node 1 first when
        node 0's fresh report shows every lane busy (another head's work), and keeps the
        policy's order among the nodes that have a free lane; a stale report is not
        believed; a batch request keeps the policy's order."""
        busy = view(0, lanes_active=2)
        free = view(1)
        chat = Request(None, 10, interactive=True)
        self.assertEqual(decide([busy, free], Request(None, 10), Policy.ROUND_ROBIN), Place((0, 1)))
        self.assertEqual(decide([busy, free], chat, Policy.ROUND_ROBIN), Place((1, 0)))
        self.assertEqual(decide([free, view(2)], chat, Policy.ROUND_ROBIN), Place((1, 2)))
        stale = view(0, lanes_active=2, age=60.0)
        self.assertEqual(decide([stale, free], chat, Policy.ROUND_ROBIN), Place((0, 1)))

    def test_a_kept_lane_counts_as_free(self) -> None:
        """A node that keeps a lane for interactive work has a free interactive lane while
        the head runs no interactive generation there, even with every other lane busy."""
        self.assertTrue(
            placement.free_interactive_lane(
                view(0, inflight=2, lanes_active=2, features=FEATURE_REQUEST_CLASS)
            )
        )
        self.assertFalse(placement.free_interactive_lane(view(0, inflight=2, lanes_active=2)))
        self.assertFalse(
            placement.free_interactive_lane(
                view(0, inflight=2, interactive_inflight=1, features=FEATURE_REQUEST_CLASS)
            )
        )


# --------------------------------------------------------------------------------------------
# The link


class LinkTests(LinkTestCase):
    def test_the_class_goes_only_to_nodes_that_read_it(self) -> None:
        """To a node without FEATURE_REQUEST_CLASS the link sends the six-element GENERATE_REQ
        whatever the class; to a node with it, the class of each request, interactive
        included."""
        link, node = self.placed()
        self.assertFalse(link.request_classes)
        calls = [link.generate(1, HeadRequest((), 4, request_class=BATCH))]
        self.flush()
        self.assertEqual([m.request_class for m in node.of_type(GenerateReqMsg)], [None])
        self.finish(node, calls)

    def finish(self, node: test_head_link.FakeNode, calls: list[GenerationCall]) -> None:
        """End each call with a Finish from the node."""
        for call in calls:
            node.events(ev(0, Finish(FINISH_LENGTH), g=call.generation_id))
        self.flush()
        for call in calls:
            self.assertEqual(self.successResultOf(call.result).finish, FINISH_LENGTH)

    def test_a_node_with_the_bit_gets_the_class(self) -> None:
        """With the bit set in HELLO_ACK_F, batch and interactive requests carry 1 and 0."""
        ack = HelloAckF(
            2, "fake-node", test_head_link.CAPACITY, ("mock",), FEATURE_REQUEST_CLASS, LinkFLimits()
        )
        self.patch(test_head_link, "HELLO_ACK", ack)
        link, node = self.placed()
        self.assertTrue(link.request_classes)
        calls = [
            link.generate(1, HeadRequest((), 4, request_class=BATCH)),
            link.generate(1, HeadRequest((), 4)),
        ]
        self.flush()
        self.assertEqual([m.request_class for m in node.of_type(GenerateReqMsg)], [1, 0])
        self.finish(node, calls)


# --------------------------------------------------------------------------------------------
# The fleet, in memory


class FleetTests(MemoryHeadTestCase):
    def test_a_chat_is_placed_while_batch_work_waits_at_the_head(self) -> None:
        """A node of 2 lanes runs two batch generations; a third batch request waits at the
        head; a chat is placed at once on that node all the same, gets its lane when one
        frees, ahead of the waiting batch request, and ends with its exact tokens before that
        request is even placed; every batch request then finishes with its own tokens."""
        node = self.start_mock_node(max_lanes=2, token_delay_s=0.005)
        fleet = self.fleet_of([node])
        batch = [
            fleet.generate(
                HeadRequest([10 + i, 11], 60, model="mock", request_class=BATCH),
            ) for i in range(3)
        ]
        self.wait(defer.gatherResults([b.when_placed() for b in batch[:2]]))
        self.assertEqual(fleet.queued, 1)
        chat = fleet.generate(HeadRequest([5, 6, 7], 4, model="mock", request_class=INTERACTIVE))
        self.wait(chat.when_placed())
        self.assertEqual(fleet.queued, 1)
        outcome = self.wait(chat.result)
        self.assertEqual(
            (outcome.tokens, outcome.finish), (expected_tokens([5, 6, 7], 4), FINISH_LENGTH)
        )
        self.assertFalse(batch[2].result.called)
        outcomes = self.wait(defer.gatherResults([b.result for b in batch]))
        for i, done in enumerate(outcomes):
            self.assertEqual(done.tokens, expected_tokens([10 + i, 11], 60))
        self.assertEqual(fleet.nodes[0].interactive_inflight, 0)
        self.assertEqual(fleet.nodes[0].inflight, 0)


# --------------------------------------------------------------------------------------------
# The HTTP API


CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3}


class HttpTests(HeadServiceTestCase):
    @defer.inlineCallbacks
    def node_and_head(self, *args: str) -> Generator[Any, Any, tuple[RecordingEngine, RunningHead]]:
        engine = RecordingEngine(reactor, vocab_size=TINY_VOCAB)
        node = yield self.start_vocab_node(engine=engine)
        head = yield self.start_sfhead([node], *args)
        return engine, head

    @defer.inlineCallbacks
    def chat(
        self, head: RunningHead, request_class: bytes | None = None
    ) -> Generator[Any, Any, tuple[int, Headers, Any]]:
        headers = Headers({b"content-type": [b"application/json"]})
        if request_class is not None:
            headers.addRawHeader(b"x-request-class", request_class)
        response = yield Agent(reactor).request(
            b"POST",
            (head.base + "/v1/chat/completions").encode(),
            headers,
            FileBodyProducer(BytesIO(json.dumps(CHAT).encode())),
        )
        body = json.loads((yield readBody(response)))
        return response.code, response.headers, body

    @defer.inlineCallbacks
    def test_the_header_reaches_the_node(self) -> Gen:
        """X-Request-Class batch and interactive reach the node's engine as such; a short
        chat without the header is interactive (auto); each answer names its class in the
        same header."""
        engine, head = yield self.node_and_head()
        seen = []
        for named in (b"batch", b"Interactive", None):
            code, headers, _ = yield self.chat(head, named)
            self.assertEqual(code, 200)
            seen.append(headers.getRawHeaders(b"x-request-class"))
        self.assertEqual([r.interactive for r in engine.requests], [False, True, True])
        self.assertEqual(seen, [[b"batch"], [b"interactive"], [b"interactive"]])

    @defer.inlineCallbacks
    def test_the_default_class_is_an_option(self) -> Gen:
        """--default-request-class batch makes a chat without the header batch (a header
        still makes one interactive)."""
        engine, head = yield self.node_and_head("--default-request-class", "batch")
        yield self.chat(head)
        yield self.chat(head, b"interactive")
        self.assertEqual([r.interactive for r in engine.requests], [False, True])

    @defer.inlineCallbacks
    def test_auto_follows_the_prompt_length_option(self) -> Gen:
        """With --interactive-prompt-tokens 3, auto takes the (longer) chat prompt for batch."""
        engine, head = yield self.node_and_head("--interactive-prompt-tokens", "3")
        yield self.chat(head)
        self.assertEqual([r.interactive for r in engine.requests], [False])

    @defer.inlineCallbacks
    def test_a_bad_header_is_a_400(self) -> Gen:
        """X-Request-Class: urgent is answered 400 invalid_request_class in OpenAI's shape and
        nothing reaches the node."""
        engine, head = yield self.node_and_head()
        code, _, body = yield self.chat(head, b"urgent")
        self.assertEqual(code, 400)
        self.assertEqual(body["error"]["code"], "invalid_request_class")
        self.assertIn("urgent", body["error"]["message"])
        self.assertEqual(engine.requests, [])
