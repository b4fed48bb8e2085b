"""Constraints on the wire, on the node and in the head library (docs/protocol.md section 12.3).

GENERATE_REQ's eighth element and its checks; a node's FEATURE_CONSTRAINTS bit and what it
does with a constraint (a scripted head joined to it in memory, the mock engine with the tiny
test vocabulary);
and the head library, which sends a constraint only to nodes that offer the bit and continues a
constrained stream on another node exactly when its node dies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Generator, Sequence
from typing import Any

import jsonschema
from twisted.internet import defer, reactor
from twisted.trial.unittest import SynchronousTestCase

from sfnode.decoding.constraint import response_format_grammar, tools_grammar
from sfnode.engines.mock import MockEngine
from sfnode.generation import GenerationRequest
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.fleet import ConstraintRefused, ConstraintsUnavailable, Policy
from sfnode.head.link import ConstraintsUnsupportedError
from sfnode.linkf import wire
from sfnode.linkf.wire import (
    FEATURE_CONSTRAINTS,
    FEATURE_LOGPROBS,
    FEATURE_REQUEST_CLASS,
    FINISH_EOS,
    FINISH_REFUSED,
    AppendContentMsg,
    Constraint,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    GenParams,
    JsonObjectGrammar,
    JsonSchemaGrammar,
    MsgType,
    PayloadError,
    SamplerControls,
    SessionAssignMsg,
    ToolChoice,
    ToolsGrammar,
    decode_message,
    encode_tokens,
)
from tests.nodefixture import (
    LONG_LEASE,
    PROMPT,
    Gen,
    MemoryNodeTestCase,
    RawHead,
    finish_of,
    stream_of,
)
from tests.test_constraint import NESTED, ONE_TOOL, ONE_TOOL_LANGUAGE, vocabulary
from tests.test_fleet import FleetTestCase

EXAMPLE = GenerateReqMsg(
    3,
    1,
    5,
    100,
    GenerationBudgetsMsg(20),
    0,
    None,
    Constraint(7, JsonSchemaGrammar('{"type": "object"}'), SamplerControls(((5, -100.0),), 0.5)),
)
"""The example of docs/protocol.md section 12.3."""
EXAMPLE_HEX = (
    "98 03 01 05 64 92 14 00 00 c0 93 07 92 01 b2 7b 22 74 79 70 65 22 3a 20 22 6f 62 6a 65 63 "
    "74 22 7d 95 91 92 05 ca c2 c8 00 00 ca 3f 00 00 00 ca 00 00 00 00 ca 00 00 00 00 40"
)


def decode(payload: bytes) -> GenerateReqMsg:
    message = decode_message(MsgType.GENERATE_REQ, payload)
    assert isinstance(message, GenerateReqMsg)
    return message


class WireTests(SynchronousTestCase):
    """GENERATE_REQ's constraint element (section 12.3)."""

    def test_the_feature_bit_is_bit_2(self) -> None:
        """FEATURE_CONSTRAINTS is 0x4, distinct from the logprobs and request-class bits."""
        self.assertEqual(FEATURE_CONSTRAINTS, 0x4)
        self.assertEqual(FEATURE_CONSTRAINTS & (FEATURE_LOGPROBS | FEATURE_REQUEST_CLASS), 0)

    def test_the_example_is_these_bytes(self) -> None:
        """The example's payload is the bytes section 12.3 shows, and decodes back to it; with
        a constraint the seventh element is written as nil when there is no class."""
        self.assertEqual(EXAMPLE.payload().hex(" "), EXAMPLE_HEX)
        self.assertEqual(decode(bytes.fromhex(EXAMPLE_HEX)), EXAMPLE)

    def test_every_variant_round_trips(self) -> None:
        """json_object, json_schema and each tool choice, with and without controls."""
        grammars: list[Any] = [
            JsonObjectGrammar(),
            JsonSchemaGrammar("{}"),
            *(ToolsGrammar("[]", choice, "f", bool(choice % 2)) for choice in ToolChoice),
        ]
        for grammar in grammars:
            for controls in (None, SamplerControls((), 0.0, 1.5, 1.25, 128)):
                message = GenerateReqMsg(
                    1, 2, 3, 4, GenerationBudgetsMsg(9), 0, 1, Constraint(40, grammar, controls)
                )
                self.assertEqual(decode(message.payload()), message)

    def test_older_shapes_read_as_no_constraint(self) -> None:
        """Six or seven elements, or a nil eighth, mean no constraint; a message without one
        is written as before (six or seven elements)."""
        for obj in (
            [3, 1, 5, 100, [20, 0], 0],
            [3, 1, 5, 100, [20, 0], 0, 1],
            [3, 1, 5, 100, [20, 0], 0, None, None],
        ):
            self.assertIsNone(decode(wire.pack(obj)).constraint)
        plain = GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(20), 0, 1)
        self.assertEqual(len(wire.unpack(plain.payload())), 7)

    def test_malformed_constraints_are_payload_errors(self) -> None:
        """Out-of-range or NaN values, unknown variants, too many biases, too long a text or
        window, and wrong shapes are refused as a malformed payload (section 7.4)."""
        base = [3, 1, 5, 100, [20, 0], 0, None]
        controls = [[[5, 1.0]], 0.0, 0.0, 0.0, 64]
        bad = [
            [7, [1, 12], None],
            [7, [9], None],
            [7, [2, "[]", 7, "", True], None],
            [7, [2, "[]", 1, "", 1], None],
            [7, [1, "x" * (wire.MAX_GRAMMAR_BYTES + 1)], None],
            [7, None, [[[5, 101.0]], 0.0, 0.0, 0.0, 64]],
            [7, None, [[[5, math.nan]], 0.0, 0.0, 0.0, 64]],
            [7, None, [[[5, 1.0]] * (wire.MAX_LOGIT_BIAS + 1), 0.0, 0.0, 0.0, 64]],
            [7, None, [[], 2.5, 0.0, 0.0, 64]],
            [7, None, [[], 0.0, 0.0, 11.0, 64]],
            [7, None, [[], 0.0, 0.0, 1.1, wire.MAX_REPETITION_WINDOW + 1]],
            [-1, None, controls],
            [7, None, [[5, 1.0], 0.0, 0.0, 0.0, 64]],
            "constraint",
        ]
        for constraint in bad:
            with self.assertRaises(PayloadError, msg=repr(constraint)[:80]):
                decode(wire.pack([*base, constraint]))


def mock_engine(clock: Any = reactor, **kwargs: Any) -> MockEngine:
    """A mock engine over the tiny test vocabulary (512 ids), so it honours constraints."""
    return MockEngine(clock, vocab_size=512, vocabulary=vocabulary(), **kwargs)


def assign(head: RawHead, session: int, epoch: int, context: Sequence[int] = PROMPT) -> None:
    head.send(SessionAssignMsg(1, session, epoch, LONG_LEASE, "", b"", 0, 0))
    head.send(AppendContentMsg(2, session, epoch, encode_tokens(context)))


NESTED_GRAMMAR = response_format_grammar(
    {"type": "json_schema", "json_schema": {"name": "n", "schema": NESTED}}
)


class NodeTests(MemoryNodeTestCase):
    """A node with and without constraints, a scripted head joined to it in memory."""

    def test_the_bit_says_whether_the_engine_has_a_vocabulary(self) -> None:
        """HELLO_ACK_F sets FEATURE_CONSTRAINTS for an engine that honours constraints only."""
        with_them = self.start_node(engine=mock_engine(self.reactor))
        without = self.start_node()
        for node, expected in ((with_them, FEATURE_CONSTRAINTS), (without, 0)):
            head = self.raw_head(node)
            ack = self.wait(head.hello())
            self.assertEqual(ack.feature_flags & FEATURE_CONSTRAINTS, expected)

    def test_a_constrained_generation_follows_its_grammar(self) -> None:
        """A json_schema constraint: the node streams the mock's constrained run (equal to
        the engine's own run of the same request), which validates, then Finish EOS."""
        node = self.start_node(engine=mock_engine(self.reactor))
        head = self.raw_head(node)
        self.wait(head.hello())
        assign(head, 1, 5)
        constraint = Constraint(len(PROMPT), NESTED_GRAMMAR)
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(200), 0, None, constraint))
        self.wait(head.wait_for(finish_of(1, 100)))
        tokens, finishes = stream_of(head.events(1, 100))
        self.assertEqual(finishes, [FINISH_EOS])
        jsonschema.validate(json.loads(vocabulary().decode(tokens[:-1])), NESTED)
        request = GenerationRequest(PROMPT, GenParams(), 200, constraint=constraint)
        engine = mock_engine(self.reactor)
        engine.start()
        local = self.wait(engine.submit(request, lambda t, lp=None: None).result)
        self.assertEqual(list(local.tokens), tokens)

    def test_refusals_keep_the_connection(self) -> None:
        """A constraint for a node without the bit, and delivered tokens the grammar refuses,
        are answered FINISH_REFUSED; the connection stays and serves the next request."""
        without = self.start_node()
        head = self.raw_head(without)
        self.wait(head.hello())
        assign(head, 1, 5)
        constraint = Constraint(len(PROMPT), JsonObjectGrammar())
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(9), 0, None, constraint))
        self.wait(head.wait_for(finish_of(1, 100, FINISH_REFUSED)))

        node = self.start_node(engine=mock_engine(self.reactor))
        head = self.raw_head(node)
        self.wait(head.hello())
        assign(head, 1, 5)
        broken = Constraint(4, NESTED_GRAMMAR)  # PROMPT[4:] is no start of JSON
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(9), 0, None, broken))
        self.wait(head.wait_for(finish_of(1, 100, FINISH_REFUSED)))
        head.send(GenerateReqMsg(4, 1, 5, 101, GenerationBudgetsMsg(5)))
        self.wait(head.wait_for(finish_of(1, 101)))
        self.assertEqual(len(stream_of(head.events(1, 101))[0]), 5)

    def test_a_malformed_constraint_closes_only_its_connection(self) -> None:
        """A bias of 500 is a malformed GENERATE_REQ: that connection closes (section 7.4);
        another connection's generation completes."""
        node = self.start_node(engine=mock_engine(self.reactor))
        bad = self.raw_head(node)
        good = self.raw_head(node)
        self.wait(bad.hello())
        self.wait(good.hello())
        assign(bad, 1, 5)
        assign(good, 2, 6)
        payload = wire.pack(
            [3, 1, 5, 100, [9, 0], 0, None, [12, None, [[[5, 500.0]], 0.0, 0.0, 0.0, 64]]]
        )
        bad.send_bytes(wire.encode_frame(MsgType.GENERATE_REQ, 9, payload))
        self.wait(bad.lost)
        good.send(GenerateReqMsg(3, 2, 6, 200, GenerationBudgetsMsg(5)))
        self.wait(good.wait_for(finish_of(2, 200)))


class HeadTests(FleetTestCase):
    """The head library: constraints only to nodes with the bit, exact across failover."""

    @defer.inlineCallbacks
    def start_constraint_node(
        self, identity: str, token_delay_s: float = 0.0
    ) -> Generator[defer.Deferred[Any], Any, Any]:
        node = yield self.start_node(
            identity=identity, engine=mock_engine(token_delay_s=token_delay_s)
        )
        return node

    @defer.inlineCallbacks
    def test_the_link_never_sends_a_constraint_to_a_node_without_the_bit(self) -> Gen:
        """NodeLink.generate with a constraint on a node without FEATURE_CONSTRAINTS fails at
        once with ConstraintsUnsupportedError, and the node never sees the request."""
        node = yield self.start_node()
        link = yield self.dial(node)
        link.assign(1)
        link.append(1, PROMPT)
        call = link.generate(1, HeadRequest((), 5, constraint=Constraint(0, JsonObjectGrammar())))
        yield self.assertFailure(call.result, ConstraintsUnsupportedError)
        outcome = yield link.generate(1, HeadRequest((), 3)).result
        self.assertEqual(len(outcome.tokens), 3)
        self.assertEqual(node.engine.statistics().decoded_tokens, 3)

    @defer.inlineCallbacks
    def test_constrained_generations_go_only_where_the_bit_is(self) -> Gen:
        """With one node of each kind, constrained generations all run on the one with the
        bit (under least-loaded placement, which would alternate); with only nodes without
        it, the fleet fails at once with ConstraintsUnavailable."""
        plain = yield self.start_node(identity="plain")
        able = yield self.start_constraint_node("able")
        fleet = yield self.fleet_of([plain, able], policy=Policy.LEAST_LOADED)
        constraint = Constraint(0, JsonObjectGrammar())
        outcomes = yield defer.gatherResults(
            [
                fleet.generate(HeadRequest(PROMPT, 30, constraint=constraint)).result
                for _ in range(3)
            ]
        )
        self.assertEqual({o.node for o in outcomes}, {"able"})
        lonely = yield self.fleet_of([plain])
        yield self.assertFailure(
            lonely.generate(HeadRequest(PROMPT, 5, constraint=constraint)).result,
            ConstraintsUnavailable,
        )

    @defer.inlineCallbacks
    def test_a_refused_constraint_fails_the_generation(self) -> Gen:
        """A grammar the node cannot compile comes back FINISH_REFUSED: ConstraintRefused
        (not a "too long" error)."""
        node = yield self.start_constraint_node("able")
        fleet = yield self.fleet_of([node])
        bad = Constraint(0, JsonSchemaGrammar('{"type": "string", "pattern": "(?=a)"}'))
        yield self.assertFailure(
            fleet.generate(HeadRequest(PROMPT, 5, constraint=bad)).result, ConstraintRefused
        )

    @defer.inlineCallbacks
    def test_a_constrained_stream_fails_over_exactly(self) -> Gen:
        """Sampled, with a grammar and penalties: the node dies after 6 streamed tokens, the
        survivor replays them through its grammar and the caller gets exactly the tokens of
        an uninterrupted run, which still validates (a json_schema, then a tool call)."""
        b = yield self.start_constraint_node("b", token_delay_s=0.001)
        outcome = yield self.fail_over(b, NESTED_GRAMMAR)
        jsonschema.validate(json.loads(vocabulary().decode(outcome.tokens[:-1])), NESTED)
        outcome = yield self.fail_over(b, tools_grammar(ONE_TOOL, "required", False))
        self.assertIn(vocabulary().decode(outcome.tokens[:-1]), ONE_TOOL_LANGUAGE)

    @defer.inlineCallbacks
    def fail_over(self, b: Any, grammar: Any) -> Generator[defer.Deferred[Any], Any, Any]:
        """A constrained run on a fresh node "a" killed after 6 tokens, and its reference."""
        a = yield self.start_constraint_node("a", token_delay_s=0.005)
        fleet = yield self.fleet_of([a, b], policy=Policy.LEAST_LOADED)
        params = GenParams(temperature=1.0, seed=99)
        constraint = Constraint(0, grammar, SamplerControls(presence_penalty=0.7))
        reference = yield fleet.generate(
            HeadRequest(PROMPT, 200, params=params, constraint=constraint)
        ).result
        self.assertEqual(reference.node, "a")
        streamed: list[int] = []

        def seen(tokens: Sequence[int], logprobs: Any = None) -> None:
            streamed.extend(tokens)
            if len(streamed) >= 6 and len(streamed) - len(tokens) < 6:
                reactor.callLater(0, self.kill, a)

        outcome = yield fleet.generate(
            HeadRequest(PROMPT, 200, params=params, constraint=constraint), on_tokens=seen
        ).result
        self.assertEqual((outcome.node, outcome.failovers), ("b", 1))
        self.assertEqual(outcome.tokens, reference.tokens)
        self.assertEqual(streamed, outcome.tokens)
        return outcome
