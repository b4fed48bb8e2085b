"""The logprobs extension of the wire (docs/protocol.md section 12.1): its codec, alone.

TokensLogprobs events (TokenEventPayload variant 4), GenParams' optional sixth element and the
HELLO_ACK_F feature bit, checked against the byte examples of the doc, both ways, with the
refusals a receiver must make, and against peers that know nothing of the extension.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.link.session import HeadSession
from sfnode.linkf import wire
from sfnode.linkf.wire import (
    FEATURE_LOGPROBS,
    LOGPROBS_MAX,
    MAX_TOP_LOGPROBS,
    CapacitySummary,
    Finish,
    GenParams,
    HelloAckF,
    LinkFLimits,
    PayloadError,
    TokenEvent,
    TokenEventPayloadCodec,
    TokenEventsMsg,
    Tokens,
    TokensLogprobs,
    decode_message,
    decode_params,
    encode_params,
    message_frame,
)

EXAMPLE = TokensLogprobs(
    (300, 301), (-0.5, -1.25), (((300, -0.5), (7, -1.0)), ((9, -0.25), (301, -1.25)))
)
EXAMPLE_BYTES = bytes.fromhex(
    "94 04 92 cd012c cd012d 92 cabf000000 cabfa00000 92 92 92 cd012c cabf000000 92 07 "
    "cabf800000 92 92 09 cabe800000 92 cd012d cabfa00000"
)
PARAMS_BYTES = bytes.fromhex("96 ca00000000 ca3f800000 ca00000000 00 2a 03")
FIVE_ELEMENT_PARAMS = bytes.fromhex("95 ca00000000 ca3f800000 ca00000000 00 2a")
CODEC = TokenEventPayloadCodec()


def decode_payload(obj: Any) -> Any:
    return CODEC.decode(obj)


class ExampleTests(SynchronousTestCase):
    def test_the_doc_example_both_ways(self) -> None:
        """The TokensLogprobs example of section 12.1 encodes to its bytes and back."""
        self.assertEqual(wire.pack(CODEC.encode(EXAMPLE)), EXAMPLE_BYTES)
        self.assertEqual(CODEC.decode(wire.unpack(EXAMPLE_BYTES)), EXAMPLE)

    def test_gen_params_carry_logprobs_only_when_asked(self) -> None:
        """GenParams with logprobs 3 are the six-element example blob; with 0 they are the
        five-element blob every node reads; five elements, or a sixth that is no u8, read as
        0 with the sampling fields kept; values up to 255 round-trip (a node reads those
        above LOGPROBS_MAX as LOGPROBS_MAX)."""
        self.assertEqual(encode_params(GenParams(0.0, 1.0, 0.0, 0, 42, 3)), PARAMS_BYTES)
        self.assertEqual(decode_params(PARAMS_BYTES).logprobs, 3)
        self.assertEqual(encode_params(GenParams(0.0, 1.0, 0.0, 0, 42)), FIVE_ELEMENT_PARAMS)
        self.assertEqual(decode_params(FIVE_ELEMENT_PARAMS), GenParams(0.0, 1.0, 0.0, 0, 42, 0))
        for sixth in ("later", -1, 256, 1.5, None):
            blob = wire.pack([0.0, 1.0, 0.0, 0, 42, sixth])
            self.assertEqual(decode_params(blob), GenParams(0.0, 1.0, 0.0, 0, 42, 0), sixth)
        self.assertEqual(decode_params(wire.pack([0.0, 1.0, 0.0, 0, 42, 9, "later"])).logprobs, 9)
        self.assertEqual(decode_params(encode_params(GenParams(logprobs=255))).logprobs, 255)
        self.assertEqual(LOGPROBS_MAX, MAX_TOP_LOGPROBS + 1)

    def test_the_feature_bit_travels_in_hello_ack_f(self) -> None:
        """A HELLO_ACK_F with FEATURE_LOGPROBS (bit 0) set decodes with the bit set."""
        ack = HelloAckF(2, "n", CapacitySummary(), ("m",), FEATURE_LOGPROBS, LinkFLimits())
        decoded = decode_message(wire.MsgType.HELLO_ACK_F, ack.payload())
        self.assertEqual(decoded.feature_flags & FEATURE_LOGPROBS, 1)


logprobs = st.floats(max_value=0.0, width=32, allow_nan=False, allow_infinity=False)
token_ids = st.integers(min_value=0, max_value=wire.U32_MAX)


@st.composite
def tokens_logprobs(draw: st.DrawFn) -> TokensLogprobs:
    tokens = draw(st.lists(token_ids, min_size=1, max_size=20))
    lps = draw(st.lists(logprobs, min_size=len(tokens), max_size=len(tokens)))
    alternatives = draw(st.integers(0, MAX_TOP_LOGPROBS))
    top = ()
    if alternatives:
        top = tuple(
            tuple(draw(st.lists(st.tuples(token_ids, logprobs), max_size=alternatives)))
            for _ in tokens
        )
    return TokensLogprobs(tuple(tokens), tuple(lps), top)


class RoundTripTests(SynchronousTestCase):
    @settings(max_examples=300, deadline=None)
    @given(payload=tokens_logprobs(), seq=st.integers(0, wire.U64_MAX))
    def test_token_events_with_logprobs_round_trip(self, payload: TokensLogprobs, seq: int) -> None:
        """Any TokensLogprobs inside a TOKEN_EVENTS frame, next to plain Tokens and a Finish,
        comes back equal (f32 values exactly) through the frame decoder's fast path."""
        events = (
            TokenEvent(1, 2, 3, seq, payload),
            TokenEvent(1, 2, 4, 0, Tokens((5, 6))),
            TokenEvent(1, 2, 3, 0, Finish(1)),
        )
        message = TokenEventsMsg(events)
        decoded = TokenEventsMsg.from_payload(message.payload())
        self.assertEqual(decoded, message)
        self.assertIs(type(decoded.events[0].payload), TokensLogprobs)
        frame = message_frame(message, 9)
        (body,) = list(wire.FrameDecoder().feed(frame))
        self.assertEqual(wire.decode_frame(body), message)


class RefusalTests(SynchronousTestCase):
    def refused(self, obj: Any) -> None:
        with self.assertRaises(PayloadError):
            decode_payload(obj)

    def test_a_receiver_refuses_malformed_logprobs(self) -> None:
        """Mismatched lengths, a top list per some tokens only, 21 alternatives, NaN,
        infinities, a positive logprob, a non-u32 id, a bool and missing arrays are payload
        errors; a logprob of exactly 0 and an int logprob are fine."""
        good_top = [[[1, -1.0]]]
        for bad in (
            [4, [1, 2], [-1.0], []],
            [4, [1], [-1.0], [[[1, -1.0]], [[2, -1.0]]]],
            [4, [1], [-1.0], [[[i, -1.0] for i in range(MAX_TOP_LOGPROBS + 1)]]],
            [4, [1], [math.nan], []],
            [4, [1], [-math.inf], []],
            [4, [1], [0.5], []],
            [4, [1], [-1.0], [[[1, math.inf]]]],
            [4, [1 << 32], [-1.0], []],
            [4, [1], [-1.0], [[[-1, -1.0]]]],
            [4, [True], [-1.0], []],
            [4, [1], [-1.0], [[[1]]]],
            [4, [1], [-1.0]],
            [4, [1], "x", good_top],
        ):
            self.refused(bad)
        self.assertEqual(decode_payload([4, [1], [0], good_top]).logprobs, (0.0,))

    def test_a_sender_refuses_what_a_receiver_would(self) -> None:
        """Encoding a TokensLogprobs that breaks the rules raises PayloadError instead of
        sending it."""
        for bad in (
            TokensLogprobs((1, 2), (-1.0,), ()),
            TokensLogprobs((1,), (0.25,), ()),
            TokensLogprobs((1,), (-1.0,), (tuple((i, -1.0) for i in range(21)),)),
            TokensLogprobs((-1,), (-1.0,), ()),
        ):
            with self.assertRaises(PayloadError):
                TokenEventsMsg((TokenEvent(1, 1, 1, 0, bad),)).payload()


class OldPeerTests(SynchronousTestCase):
    def test_a_head_that_knows_only_tokens_reads_their_tokens(self) -> None:
        """HeadSession, which commits Tokens, commits a TokensLogprobs event's tokens."""
        session = HeadSession()
        session.assign_session(7, 3, wire.Lease(10_000, 7_500))
        session.generate(7, 1, wire.GenerationBudgetsMsg(16, 0))
        acks = session.on_token_events(TokenEventsMsg((TokenEvent(7, 3, 1, 0, EXAMPLE),)))
        self.assertEqual([a.watermark for a in acks], [0])
        self.assertEqual(session.wal.tokens(7, 3, 1), [300, 301])
        self.assertIsInstance(EXAMPLE, Tokens)
