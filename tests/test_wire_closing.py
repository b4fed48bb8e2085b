"""The closing extension on the wire and on the node (docs/protocol.md section 12.6, D23).

The Finish's optional ``detail`` against the byte example of the doc, both ways, with the
refusals a receiver must make and the bytes an old peer keeps seeing; the node's feature bit;
and a node, joined in memory to a scripted head, that closes a constrained answer within a
tight budget and says so in its Finish (the mock engine over the tiny test vocabulary).
"""

from __future__ import annotations

import json

import jsonschema
from twisted.trial.unittest import SynchronousTestCase

from sfnode.linkf.wire import (
    FEATURE_CLOSING,
    FINISH_DETAIL_CLOSED,
    FINISH_EOS,
    Constraint,
    Finish,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    MsgType,
    PayloadError,
    TokenEvent,
    TokenEventPayloadCodec,
    TokenEventsMsg,
    decode_message,
)
from tests.nodefixture import PROMPT, MemoryNodeTestCase, finish_of
from tests.test_constraint import NESTED, vocabulary
from tests.test_node_constraints import NESTED_GRAMMAR, assign, mock_engine

CLOSED_FINISH = bytes.fromhex("93 03 01 01")
"""docs/protocol.md section 12.6: Finish{EOS, closed}."""
PLAIN_FINISH = bytes.fromhex("92 03 01")
"""Finish{EOS} without a detail, as before the extension."""


def payload_bytes(payload: Finish) -> bytes:
    """The msgpack bytes of one TokenEventPayload."""
    message = TokenEventsMsg((TokenEvent(1, 2, 3, 4, payload),))
    body = message.payload()
    # TokenEventsMsg [[[1, 2, 3, 4, payload]]]: the payload is the event's last element.
    head = bytes.fromhex("91 91 95 01 02 03 04")
    assert body.startswith(head)
    return body[len(head) :]


class FinishDetailTests(SynchronousTestCase):
    def test_the_docs_example_both_ways(self) -> None:
        """Finish{EOS, closed} is 93 03 01 01, and decodes back to it."""
        self.assertEqual(payload_bytes(Finish(FINISH_EOS, FINISH_DETAIL_CLOSED)), CLOSED_FINISH)
        codec = TokenEventPayloadCodec()
        self.assertEqual(codec.decode([3, 1, 1]), Finish(FINISH_EOS, FINISH_DETAIL_CLOSED))

    def test_no_detail_writes_the_old_bytes_and_reads_as_zero(self) -> None:
        """A Finish with detail 0 is written as before (92 03 01); a Finish without a third
        element reads detail 0."""
        self.assertEqual(payload_bytes(Finish(FINISH_EOS)), PLAIN_FINISH)
        self.assertEqual(TokenEventPayloadCodec().decode([3, 1]), Finish(FINISH_EOS, 0))

    def test_a_detail_that_is_not_a_u32_is_malformed(self) -> None:
        """A detail that is negative, past u32, a string or nil is refused."""
        codec = TokenEventPayloadCodec()
        for bad in (-1, 1 << 32, "closed", None, True):
            self.assertRaises(PayloadError, codec.decode, [3, 1, bad])

    def test_unknown_bits_and_further_elements_are_kept_and_ignored(self) -> None:
        """Bits the receiver does not know survive decoding, and a fourth element is ignored
        (3.2)."""
        codec = TokenEventPayloadCodec()
        self.assertEqual(codec.decode([3, 2, 0x80000001, "later"]), Finish(2, 0x80000001))

    def test_the_whole_message_round_trips(self) -> None:
        """A TOKEN_EVENTS frame holding a closed Finish decodes to the same message."""
        message = TokenEventsMsg((TokenEvent(1, 5, 100, 7, Finish(FINISH_EOS, 1)),))
        self.assertEqual(decode_message(MsgType.TOKEN_EVENTS, message.payload()), message)

    def test_the_feature_bit(self) -> None:
        """FEATURE_CLOSING is bit 5 (0x20)."""
        self.assertEqual(FEATURE_CLOSING, 0x20)


class NodeClosingTests(MemoryNodeTestCase):
    """A node over the mock engine with the tiny vocabulary, a scripted head in memory."""

    def test_the_bit_comes_with_constraints(self) -> None:
        """HELLO_ACK_F sets FEATURE_CLOSING for an engine that honours constraints only."""
        with_them = self.start_node(engine=mock_engine(self.reactor))
        without = self.start_node()
        for node, expected in ((with_them, FEATURE_CLOSING), (without, 0)):
            ack = self.wait(self.raw_head(node).hello())
            self.assertEqual(ack.feature_flags & FEATURE_CLOSING, expected)

    def test_a_tight_budget_ends_in_a_closed_valid_answer(self) -> None:
        """The nested schema with a budget of 34 (its shortest answer is 29 tokens): the node
        streams a whole answer that validates, ended by an EOS, and its Finish is EOS with
        the closed bit; with a budget of 200 the same request ends without the bit."""
        node = self.start_node(engine=mock_engine(self.reactor))
        head = self.raw_head(node)
        self.wait(head.hello())
        assign(head, 1, 5)
        constraint = Constraint(len(PROMPT), NESTED_GRAMMAR)
        for generation, budget, detail in ((100, 34, FINISH_DETAIL_CLOSED), (101, 200, 0)):
            head.send(
                GenerateReqMsg(
                    3 + generation,
                    1,
                    5,
                    generation,
                    GenerationBudgetsMsg(budget),
                    0,
                    None,
                    constraint,
                )
            )
            self.wait(head.wait_for(finish_of(1, generation)))
            events = head.events(1, generation)
            tokens = [
                t for e in events if not isinstance(e.payload, Finish) for t in e.payload.tokens
            ]
            finishes = [e.payload for e in events if isinstance(e.payload, Finish)]
            self.assertEqual(finishes, [Finish(FINISH_EOS, detail)])
            self.assertLessEqual(len(tokens), budget)
            jsonschema.validate(json.loads(vocabulary().decode(tokens[:-1])), NESTED)
