"""Token logprobs on the node (docs/protocol.md section 12.1): the mock engine's values, the
node's FEATURE_LOGPROBS bit, and TokensLogprobs events over real loopback TCP.

The mock engine's logits are sparse (:func:`sfnode.generation.mock_logits`: eight candidates
half a nat apart), so the expected values are computed here from first principles: a
log-softmax over those logits (greedy), or over the candidates the sampler keeps,
renormalised (sampled).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import SynchronousTestCase

from sfnode.generation import (
    GenerationRequest,
    MockEngine,
    TokenBatch,
    TokenLogprob,
    mock_logits,
    mock_next_token,
    mock_token,
    sparse_logprob,
)
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import LinkLostError
from sfnode.linkf.wire import (
    F32_MAX,
    FEATURE_LOGPROBS,
    FINISH_LENGTH,
    AppendContentMsg,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    GenerationWatermark,
    GenParams,
    Lease,
    LeaseStateMsg,
    ReconcileAckMsg,
    ReconcileMsg,
    SessionAssignMsg,
    SessionReconcileState,
    TokenEventsMsg,
    Tokens,
    TokensLogprobs,
    WatermarkAckMsg,
    decode_params,
    encode_params,
    encode_tokens,
    to_f32,
)
from sfnode.node.agent import checked_logprobs
from tests.nodefixture import NodeTestCase, RawHead, expected_tokens, finish_of, stream_of

PROMPT = list(range(100, 112))
LONG_LEASE = Lease(60_000, 45_000)
Gen = Generator[defer.Deferred[Any], Any, None]


def log_softmax(logits: Sequence[tuple[int, float]], temperature: float = 1.0) -> dict[int, float]:
    """log softmax(logits / temperature) of sparse logits, by token id."""
    scaled = {t: v / temperature for t, v in logits}
    top = max(scaled.values())
    norm = top + math.log(sum(math.exp(v - top) for v in scaled.values()))
    return {t: v - norm for t, v in scaled.items()}


def greedy_logprobs(context: Sequence[int], count: int, asked: int) -> list[TokenLogprob]:
    """What the mock engine reports for its greedy run from ``context`` with GenParams
    ``logprobs`` = ``asked`` (the values themselves are pinned by :class:`MockLogprobTests`)."""
    context = list(context)
    out = []
    for _ in range(count):
        token = mock_next_token(context)
        out.append(sparse_logprob(mock_logits(context), GenParams(logprobs=asked), token))
        context.append(token)
    return out


def as_wire(entries: Sequence[TokenLogprob]) -> list[TokenLogprob]:
    """``entries`` as they read after travelling as f32."""
    return [
        TokenLogprob(to_f32(e.logprob), tuple((t, to_f32(v)) for t, v in e.top)) for e in entries
    ]


def logprobs_of(events: Sequence[Any]) -> list[TokenLogprob]:
    """The TokenLogprobs of a generation's TokensLogprobs events, in event order."""
    out = []
    for event in events:
        payload = event.payload
        if isinstance(payload, TokensLogprobs):
            tops = payload.top or tuple(() for _ in payload.tokens)
            out.extend(TokenLogprob(v, top) for v, top in zip(payload.logprobs, tops, strict=True))
    return out


class MockLogprobTests(SynchronousTestCase):
    """The mock engine's logprobs come from its own sparse logits under the sampler's rules."""

    def test_greedy_is_the_log_softmax_and_the_first_alternative(self) -> None:
        """Greedy: the chosen token's logprob is the log-softmax of the unfiltered logits, it
        equals the first alternative's, and the alternatives are the best tokens in order."""
        context = [5, 6, 7]
        logits = mock_logits(context)
        token = mock_next_token(context)
        got = sparse_logprob(logits, GenParams(logprobs=4), token)
        values = log_softmax(logits)
        self.assertAlmostEqual(got.logprob, values[token], places=12)
        self.assertEqual(got.top[0], (token, got.logprob))
        best = sorted(values, key=lambda t: -values[t])[:3]
        self.assertEqual([t for t, _ in got.top], best)
        self.assertLess(got.logprob, 0.0)

    def test_sampled_values_are_renormalised_over_the_kept_candidates(self) -> None:
        """Sampled with top_k 3 (top_p 1) at temperature 0.7: the chosen token is one of the
        three kept, its logprob is log(p / mass of the three) under softmax(logits / 0.7), and
        only those three are ever listed even when 20 alternatives are asked."""
        context = [9, 10]
        logits = mock_logits(context)
        params = GenParams(temperature=0.7, top_p=1.0, top_k=3, seed=11, logprobs=21)
        scaled = log_softmax(logits, 0.7)
        kept = sorted(scaled, key=lambda t: -scaled[t])[:3]
        mass = sum(math.exp(scaled[t]) for t in kept)
        drawn = set()
        for position in range(40):
            token = mock_token(context, params, position)
            got = sparse_logprob(logits, params, token)
            self.assertIn(token, kept)
            self.assertAlmostEqual(got.logprob, scaled[token] - math.log(mass), places=12)
            self.assertEqual([t for t, _ in got.top], kept)
            self.assertAlmostEqual(sum(math.exp(v) for _, v in got.top), 1.0, places=12)
            drawn.add(token)
        self.assertGreater(len(drawn), 1)

    def test_one_asks_for_the_chosen_token_only(self) -> None:
        """logprobs 1 gives the chosen token's logprob and no alternatives."""
        context = [1]
        token = mock_next_token(context)
        got = sparse_logprob(mock_logits(context), GenParams(logprobs=1), token)
        self.assertEqual(got.top, ())

    def test_the_engine_calls_the_sink_with_logprobs_only_when_asked(self) -> None:
        """A generation asking for logprobs gets batches with one TokenLogprob per token (those
        of a greedy run); one that does not, or one on a mock built without logprobs, gets
        batches without logprobs; the tokens are the same in every case."""
        from twisted.internet.task import Clock

        def run(engine: MockEngine, logprobs: int) -> list[TokenBatch]:
            batches: list[TokenBatch] = []
            engine.submit(
                GenerationRequest(PROMPT, GenParams(logprobs=logprobs), 5), batches.append
            )
            clock.advance(0)
            for _ in range(6):
                clock.advance(0)
            return batches

        clock = Clock()
        asked = run(MockEngine(clock), 3)
        self.assertEqual([b.logprobs is not None for b in asked], [True] * 5)
        self.assertEqual([t for b in asked for t in b.tokens], expected_tokens(PROMPT, 5))
        context = list(PROMPT)
        for batch in asked:
            ((token,), (entry,)) = batch.tokens, batch.logprobs or ()
            values = log_softmax(mock_logits(context))
            self.assertAlmostEqual(entry.logprob, values[token], places=12)
            self.assertEqual(len(entry.top), 2)
            context.append(token)
        plain = run(MockEngine(clock), 0)
        self.assertEqual([b.logprobs is None for b in plain], [True] * 5)
        self.assertEqual([t for b in plain for t in b.tokens], expected_tokens(PROMPT, 5))
        without = MockEngine(clock, supports_logprobs=False)
        self.assertFalse(without.supports_logprobs)
        self.assertEqual([b.logprobs is None for b in run(without, 3)], [True] * 5)


class CheckedLogprobsTests(SynchronousTestCase):
    """What the node does with an engine's values before they go on the wire."""

    def test_values_are_clamped_and_alternatives_cut(self) -> None:
        """Values above 0 become 0, -inf becomes the most negative f32, and no more than
        ``asked - 1`` alternatives are kept (none for 1)."""
        entry = TokenLogprob(1e-9, ((1, 2e-9), (2, -math.inf), (3, -1.0)))
        (checked,) = checked_logprobs(TokenBatch((1,), (entry,)), 3).logprobs or ()
        self.assertEqual(checked, TokenLogprob(0.0, ((1, 0.0), (2, -F32_MAX))))
        (alone,) = checked_logprobs(TokenBatch((1,), (entry,)), 1).logprobs or ()
        self.assertEqual(alone.top, ())

    def test_an_engine_fault_is_a_clear_error(self) -> None:
        """No logprobs, a count that differs from the tokens' (refused by the batch itself),
        or a NaN is a ValueError that says which."""
        with self.assertRaisesRegex(ValueError, "without their logprobs"):
            checked_logprobs(TokenBatch((1,)), 2)
        with self.assertRaisesRegex(ValueError, "2 logprobs for 1 tokens"):
            checked_logprobs(TokenBatch((1,), (TokenLogprob(-1.0),) * 2), 2)
        with self.assertRaisesRegex(ValueError, "NaN"):
            checked_logprobs(TokenBatch((1,), (TokenLogprob(math.nan),)), 2)


def assign(head: RawHead, session: int, epoch: int, params: GenParams | None) -> None:
    blob = b"" if params is None else encode_params(params)
    head.send(SessionAssignMsg(1, session, epoch, LONG_LEASE, "", blob, 0, 0))
    head.send(AppendContentMsg(2, session, epoch, encode_tokens(PROMPT)))


class NodeWireTests(NodeTestCase):
    """TokensLogprobs events from a real node over loopback TCP (docs/protocol.md 12.1)."""

    @defer.inlineCallbacks
    def test_the_feature_bit_says_whether_the_engine_has_logprobs(self) -> Gen:
        """HELLO_ACK_F sets FEATURE_LOGPROBS for an engine with logprobs, and not otherwise."""
        with_them = yield self.start_node()
        without = yield self.start_node(supports_logprobs=False)
        head = yield RawHead.connect(self, with_them)
        ack = yield head.hello()
        self.assertEqual(ack.feature_flags & FEATURE_LOGPROBS, FEATURE_LOGPROBS)
        head = yield RawHead.connect(self, without)
        ack = yield head.hello()
        self.assertEqual(ack.feature_flags & FEATURE_LOGPROBS, 0)

    @defer.inlineCallbacks
    def test_a_session_that_asks_gets_tokens_logprobs_events(self) -> Gen:
        """GenParams.logprobs 3: every token event is a TokensLogprobs, coalesced exactly as
        plain Tokens are (the same event seqs and token counts), carrying each token's greedy
        logprob and the best two tokens, as f32; the tokens are those of a plain run."""
        node = yield self.start_node()
        head = yield RawHead.connect(self, node)
        yield head.hello()
        assign(head, 1, 5, GenParams(logprobs=3))
        assign(head, 2, 6, None)
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(40)))
        head.send(GenerateReqMsg(3, 2, 6, 200, GenerationBudgetsMsg(40)))
        yield head.wait_for(finish_of(1, 100, FINISH_LENGTH))
        yield head.wait_for(finish_of(2, 200, FINISH_LENGTH))
        asked, plain = head.events(1, 100), head.events(2, 200)
        token_events = [e for e in asked if isinstance(e.payload, Tokens)]
        self.assertEqual({type(e.payload) for e in token_events}, {TokensLogprobs})
        self.assertEqual(
            {type(e.payload) for e in plain if isinstance(e.payload, Tokens)}, {Tokens}
        )
        self.assertEqual(
            [(e.event_seq, len(e.payload.tokens)) for e in token_events],
            [(e.event_seq, len(e.payload.tokens)) for e in plain if isinstance(e.payload, Tokens)],
        )
        tokens, _ = stream_of(asked)
        self.assertEqual(tokens, expected_tokens(PROMPT, 40))
        self.assertEqual(stream_of(plain)[0], tokens)
        got = logprobs_of(asked)
        self.assertEqual(got, as_wire(greedy_logprobs(PROMPT, 40, 3)))
        for entry in got:
            self.assertEqual(entry.logprob, entry.top[0][1])

    @defer.inlineCallbacks
    def test_one_sends_no_alternatives_and_large_values_read_as_the_largest(self) -> Gen:
        """logprobs 1 sends the chosen tokens' logprobs with an empty top; 200 reads as 21
        (every one of the mock's eight candidates listed, nothing refused)."""
        node = yield self.start_node()
        head = yield RawHead.connect(self, node)
        yield head.hello()
        assign(head, 1, 5, GenParams(logprobs=1))
        assign(head, 2, 6, GenParams(logprobs=200))
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(5)))
        head.send(GenerateReqMsg(3, 2, 6, 200, GenerationBudgetsMsg(5)))
        yield head.wait_for(finish_of(1, 100))
        yield head.wait_for(finish_of(2, 200))
        one = [e.payload for e in head.events(1, 100) if isinstance(e.payload, TokensLogprobs)]
        self.assertEqual({p.top for p in one}, {()})
        self.assertEqual(
            [lp.logprob for lp in logprobs_of(head.events(1, 100))],
            [lp.logprob for lp in as_wire(greedy_logprobs(PROMPT, 5, 1))],
        )
        many = logprobs_of(head.events(2, 200))
        self.assertEqual(many, as_wire(greedy_logprobs(PROMPT, 5, 21)))
        self.assertEqual({len(lp.top) for lp in many}, {8})

    @defer.inlineCallbacks
    def test_sampled_logprobs_follow_the_seeded_draws(self) -> Gen:
        """Sampled (temperature 0.8, top_p 1, top_k 4, seed 3): the tokens are the seeded
        draws, each token's logprob is its entry among the alternatives, and only the four
        kept candidates are listed."""
        node = yield self.start_node()
        head = yield RawHead.connect(self, node)
        yield head.hello()
        params = GenParams(temperature=0.8, top_p=1.0, top_k=4, seed=3, logprobs=21)
        assign(head, 1, 5, params)
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(30)))
        yield head.wait_for(finish_of(1, 100))
        tokens, _ = stream_of(head.events(1, 100))
        got = logprobs_of(head.events(1, 100))
        context = list(PROMPT)
        as_read = decode_params(encode_params(params))  # temperature 0.8 as an f32
        for k, (token, entry) in enumerate(zip(tokens, got, strict=True)):
            self.assertEqual(token, mock_token(context, as_read, 3 + len(PROMPT) + k))
            expected = sparse_logprob(mock_logits(context), as_read, token)
            self.assertEqual(entry, as_wire([expected])[0])
            self.assertEqual(len(entry.top), 4)
            self.assertIn((token, entry.logprob), entry.top)
            context.append(token)

    @defer.inlineCallbacks
    def test_a_reconcile_retransmits_the_same_values(self) -> Gen:
        """Events not acknowledged stay in the retry buffer with their logprobs: a RECONCILE
        with watermark 1 retransmits seqs 2 to 4 equal to the first transmission, values
        and alternatives included."""
        node = yield self.start_node()
        head = yield RawHead.connect(self, node)
        yield head.hello()
        assign(head, 1, 5, GenParams(logprobs=6))
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(40)))
        yield head.wait_for(finish_of(1, 100))
        sent = head.events(1, 100)
        self.assertEqual([e.event_seq for e in sent], [0, 1, 2, 3, 4])
        head.send(WatermarkAckMsg(1, 5, 100, 0))
        head.send(
            ReconcileMsg(
                (
                    SessionReconcileState(
                        1, 5, LeaseStateMsg(LONG_LEASE, 0), 3, (GenerationWatermark(100, 1),)
                    ),
                )
            )
        )
        ack = yield head.wait_for(lambda m: isinstance(m, ReconcileAckMsg))
        count = len(head.received)
        yield head.wait_for(
            lambda m: isinstance(m, TokenEventsMsg) and head.received.index(m) >= count
        )
        retransmission = head.received[head.received.index(ack) + 1]
        self.assertEqual(retransmission.events, tuple(sent[2:]))
        self.assertEqual([type(e.payload) for e in retransmission.events[:2]], [TokensLogprobs] * 2)

    @defer.inlineCallbacks
    def test_a_node_without_logprobs_sends_plain_tokens(self) -> Gen:
        """A node whose engine has no logprobs (no FEATURE_LOGPROBS) answers a session that
        asks anyway with plain Tokens, as a node that predates the extension would."""
        node = yield self.start_node(supports_logprobs=False)
        head = yield RawHead.connect(self, node)
        yield head.hello()
        assign(head, 1, 5, GenParams(logprobs=3))
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(20)))
        yield head.wait_for(finish_of(1, 100))
        events = head.events(1, 100)
        self.assertEqual(
            {type(e.payload) for e in events if isinstance(e.payload, Tokens)}, {Tokens}
        )
        self.assertEqual(stream_of(events)[0], expected_tokens(PROMPT, 20))

    @defer.inlineCallbacks
    def test_unusable_engine_logprobs_fail_only_that_generation(self) -> Gen:
        """An engine that hands over a NaN logprob fails that generation as an engine error
        (its connection closes, docs/protocol.md section 7.4); another connection's
        generation with logprobs completes."""
        engine = _NaNAfter(MockEngine(reactor), poison=666)
        node = yield self.start_node(engine=engine)
        healthy = yield self.dial(node)
        doomed = yield self.dial(node)
        healthy.assign(1, params=GenParams(logprobs=2))
        healthy.append(1, PROMPT)
        doomed.assign(2, params=GenParams(logprobs=2))
        doomed.append(2, [1, 666])
        closed = doomed.when_closed()
        failed = doomed.generate(2, HeadRequest((), 5))
        yield closed
        yield self.assertFailure(failed.result, LinkLostError)
        outcome = yield healthy.generate(1, HeadRequest((), 8)).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 8))


class _NaNAfter:
    """A mock engine whose logprobs are NaN for contexts that hold ``poison``."""

    def __init__(self, engine: MockEngine, poison: int) -> None:
        self._engine = engine
        self._poison = poison

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, request: GenerationRequest, on_tokens: Any) -> Any:
        if self._poison not in request.context:
            return self._engine.submit(request, on_tokens)

        def spoiled(batch: TokenBatch) -> None:
            on_tokens(TokenBatch(batch.tokens, (TokenLogprob(math.nan),) * len(batch)))

        return self._engine.submit(request, spoiled)
