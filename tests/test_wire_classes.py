"""The request-class extension (docs/protocol.md section 12.2) on the wire and at the node.

GENERATE_REQ's optional seventh element, checked against the byte examples of the doc both
ways, with the refusals a receiver must make and against a peer that knows nothing of it; the
HELLO_ACK_F feature bit; the node handing the class to its engine; and the mock engine's
admission order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.engines.config import EngineConfig
from sfnode.engines.mock import MockEngine
from sfnode.generation import EngineStop, Generation, GenerationRequest, GenerationResult, TokenSink
from sfnode.head.link.session import HeadSession
from sfnode.linkf import wire
from sfnode.linkf.wire import (
    FEATURE_LOGPROBS,
    FEATURE_REQUEST_CLASS,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    GenParams,
    HelloAckF,
    Lease,
    MsgType,
    PayloadError,
    RequestClass,
    SessionAssignMsg,
    Struct,
    decode_message,
    encode_tokens,
)
from tests.nodefixture import MemoryNodeTestCase, expected_tokens, finish_of

BATCH_EXAMPLE = bytes.fromhex("97 03 01 05 64 92 14 00 00 01")
NO_CLASS_EXAMPLE = bytes.fromhex("96 03 01 05 64 92 14 00 00")


def request(request_class: int | None = None) -> GenerateReqMsg:
    """The GENERATE_REQ of the doc's example."""
    return GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(20, 0), 0, request_class)


def decode(payload: bytes) -> Any:
    return decode_message(MsgType.GENERATE_REQ, payload)


@dataclass(frozen=True, slots=True)
class OldGenerateReqMsg(Struct):
    """GENERATE_REQ as a node without the extension declares it (section 4.3): six fields."""

    command_id: int
    session_id: int
    epoch: int
    generation_id: int
    budgets: GenerationBudgetsMsg
    policy_ref: int
    FIELDS = (
        wire.U64,
        wire.U64,
        wire.U64,
        wire.U64,
        GenerationBudgetsMsg.as_codec(),
        wire.U64,
    )


class CodecTests(SynchronousTestCase):
    def test_the_doc_examples_both_ways(self) -> None:
        """A batch GENERATE_REQ is the seven-element example of section 12.2; one without a
        class is the six-element message of section 4.3; both decode to what was encoded."""
        self.assertEqual(request(RequestClass.BATCH).payload(), BATCH_EXAMPLE)
        self.assertEqual(request().payload(), NO_CLASS_EXAMPLE)
        self.assertEqual(decode(BATCH_EXAMPLE), request(1))
        self.assertEqual(decode(NO_CLASS_EXAMPLE), request(None))

    def test_what_each_value_means(self) -> None:
        """No element and nil read as interactive (with no class recorded); 0 is interactive;
        1 is batch; the reserved values 2 to 255 read as batch."""
        cases: list[tuple[list[Any], int | None, bool]] = [
            ([], None, True),
            ([None], None, True),
            ([0], 0, True),
            ([1], 1, False),
            ([2], 2, False),
            ([255], 255, False),
        ]
        for tail, recorded, interactive in cases:
            message = decode(wire.pack([3, 1, 5, 100, [20, 0], 0, *tail]))
            self.assertEqual(message.request_class, recorded, tail)
            self.assertEqual(message.interactive, interactive, tail)

    def test_a_class_that_is_no_u8_is_malformed(self) -> None:
        """A seventh element that is neither nil nor a u8 makes the GENERATE_REQ a payload
        error (section 7.4), and an encoder refuses such a value too."""
        for bad in (256, -1, "batch", True, 1.0, [1], b"\x01"):
            with self.assertRaises(PayloadError, msg=repr(bad)):
                decode(wire.pack([3, 1, 5, 100, [20, 0], 0, bad]))
        with self.assertRaises(PayloadError):
            request(256).payload()

    def test_elements_after_the_class_are_ignored(self) -> None:
        """Elements past the ones this edition knows (a later extension after section 12.3's
        eighth) are ignored, the class kept (section 3.2)."""
        later = [3, 1, 5, 100, [20, 0], 0, 1, None, "later"]
        self.assertEqual(decode(wire.pack(later)), request(1))

    def test_an_old_node_reads_a_classed_request_as_before(self) -> None:
        """A decoder that declares the six fields of section 4.3 reads the seven-element
        example as the same request: a head may send the element to any node."""
        old = OldGenerateReqMsg.from_wire(wire.unpack(BATCH_EXAMPLE))
        self.assertEqual(old, OldGenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(20, 0), 0))

    def test_the_enum_is_written_as_its_number(self) -> None:
        """A RequestClass given to the message is kept and compared as the plain u8."""
        self.assertEqual(request(RequestClass.BATCH), request(1))
        self.assertIs(type(request(RequestClass.INTERACTIVE).request_class), int)

    def test_the_feature_bit_is_bit_1_and_travels_in_hello_ack_f(self) -> None:
        """FEATURE_REQUEST_CLASS is 0x2, distinct from the logprobs bit, and round-trips in
        HELLO_ACK_F's feature_flags."""
        self.assertEqual(FEATURE_REQUEST_CLASS, 0x2)
        self.assertEqual(FEATURE_REQUEST_CLASS & FEATURE_LOGPROBS, 0)
        ack = HelloAckF(
            2, "n", wire.CapacitySummary(), ("m",), FEATURE_REQUEST_CLASS, wire.LinkFLimits()
        )
        decoded = decode_message(MsgType.HELLO_ACK_F, ack.payload())
        assert isinstance(decoded, HelloAckF)
        self.assertTrue(decoded.feature_flags & FEATURE_REQUEST_CLASS)

    def test_a_retried_generate_carries_the_class_it_first_had(self) -> None:
        """HeadSession.generate returns the same message, class included, for a retry; a
        request without a class has no seventh element."""
        session = HeadSession()
        session.assign_session(1, 1, Lease(1000, 750))
        budgets = GenerationBudgetsMsg(8)
        first = session.generate(1, 1, budgets, int(RequestClass.BATCH))
        self.assertIs(session.generate(1, 1, budgets, None), first)
        assert first is not None
        self.assertEqual(first.request_class, 1)
        plain = session.generate(1, 2, budgets)
        assert plain is not None
        self.assertEqual(len(wire.unpack(plain.payload())), 6)


class RecordingEngine(MockEngine):
    """The mock engine, remembering every request the node submits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[GenerationRequest] = []

    def submit(self, request: GenerationRequest, on_tokens: TokenSink) -> Generation:
        self.requests.append(request)
        return super().submit(request, on_tokens)


class NodeTests(MemoryNodeTestCase):
    def start_recording_node(self) -> RecordingEngine:
        engine = RecordingEngine(self.reactor)
        self.start_node(identity="n", engine=engine)
        return engine

    def test_the_node_announces_the_feature(self) -> None:
        """The node's HELLO_ACK_F sets FEATURE_REQUEST_CLASS: it reads the class."""
        self.start_recording_node()
        head = self.raw_head()
        hello = head.hello()
        self.flush()
        ack = self.successResultOf(hello)
        self.assertTrue(ack.feature_flags & FEATURE_REQUEST_CLASS)

    def test_the_node_hands_the_class_to_its_engine(self) -> None:
        """GENERATE_REQs of class batch, interactive, a reserved value, and none reach the
        engine as interactive False, True, False and True; each generation runs to the same
        greedy tokens whatever its class."""
        engine = self.start_recording_node()
        head = self.raw_head()
        hello = head.hello()
        self.flush()
        self.successResultOf(hello)
        prompt = [300, 301, 302]
        head.send(SessionAssignMsg(1, 7, 1, Lease(60_000, 45_000), "", b"", 0, 0))
        head.send(wire.AppendContentMsg(2, 7, 1, encode_tokens(prompt)))
        classes: Sequence[int | None] = (1, 0, 9, None)
        for generation, request_class in enumerate(classes, start=1):
            head.send(
                GenerateReqMsg(
                    2 + generation, 7, 1, generation, GenerationBudgetsMsg(4), 0, request_class
                )
            )
        self.advance(0.2)
        self.assertEqual([r.interactive for r in engine.requests], [False, True, False, True])
        for generation in range(1, 5):
            self.successResultOf(head.wait_for(finish_of(7, generation, wire.FINISH_LENGTH)))
            tokens = [
                t
                for e in head.events(7, generation)
                if isinstance(e.payload, wire.Tokens)
                for t in e.payload.tokens
            ]
            self.assertEqual(tokens, expected_tokens(prompt, 4))


class MockAdmissionTests(SynchronousTestCase):
    def run_engine(
        self, engine: MockEngine, clock: Clock, requests: Sequence[GenerationRequest]
    ) -> list[int]:
        """Submit ``requests`` in order, the first one step ahead of the others (so it holds
        a lane when they arrive), and run the clock until all end: the order they finished in
        (indices into ``requests``); every one must run to max_new."""
        finished: list[int] = []
        results: list[GenerationResult] = []

        def done(result: GenerationResult, index: int) -> None:
            finished.append(index)
            results.append(result)

        engine.start()
        for index, r in enumerate(requests):
            engine.submit(r, lambda tokens, logprobs=None: None).result.addCallback(done, index)
            if index == 0:
                clock.advance(0.01)
        for _ in range(200):
            clock.advance(0.01)
        self.assertEqual(sorted(finished), list(range(len(requests))))
        for result in results:
            self.assertEqual(result.stop, EngineStop.LENGTH)
        return finished

    def test_a_free_lane_takes_the_first_interactive_request(self) -> None:
        """With its one lane busy, the mock admits a queued interactive request before batch
        requests queued earlier, and the others in arrival order; tokens do not depend on the
        class."""
        clock = Clock()
        engine = MockEngine(clock, EngineConfig(max_lanes=1), token_delay_s=0.01)
        params = GenParams()
        requests = [
            GenerationRequest((1, 2), params, 5),
            GenerationRequest((3, 4), params, 5),
            GenerationRequest((5, 6), params, 5, interactive=True),
            GenerationRequest((7, 8), params, 5),
        ]
        self.assertEqual(self.run_engine(engine, clock, requests), [0, 2, 1, 3])

    def test_class_does_not_change_tokens(self) -> None:
        """The same context and params give the same greedy tokens in either class."""
        produced: dict[bool, list[int]] = {True: [], False: []}
        for interactive in (True, False):
            clock = Clock()
            engine = MockEngine(clock)
            engine.start()
            engine.submit(
                GenerationRequest((9, 10, 11), GenParams(), 6, interactive=interactive),
                lambda tokens, logprobs=None, i=interactive: produced[i].extend(tokens),
            )
            for _ in range(20):
                clock.advance(0)
        self.assertEqual(produced[True], expected_tokens([9, 10, 11], 6))
        self.assertEqual(produced[False], produced[True])
