"""Budget-aware constraints (issue 33; docs/engine.md section 2.4, docs/protocol.md section 12.6):
a constrained lane closes its output within its budget.

The pieces first, on the tiny test vocabulary (512 tokens, EOS 2): where output bytes leave a
JSON text, the fewest tokens that spell a text (against a brute-force oracle), the closing
walk (known closings; the walk goes on the same way from every state it passes through; every
closing ends a valid answer) and the masks a budget gives (the grammar's far from it; at the
edge only the first tokens of the closing's shortest spellings; every token a closing lane may
draw leaves room to close, checked by walking again; the same masks however the state was
reached: drawn, replayed after a failover, or rolled back after a draft).  Then both engines,
constrained by a JSON Schema with nested required properties, by ``json_object`` and by tools
(``tool_choice`` required and named), at budgets from the shortest answer up, greedy and
seeded: every answer parses, validates and ends with EOS within its budget, the early close is
reported, alone equals batched, a failed-over generation continues with the same tokens, and
the mock's masks are the transformers engine's.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

import jsonschema
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial import unittest

from sfnode.decoding.closing import CLOSING_GUARD, JSON_START, Closing, closing_of
from sfnode.decoding.constraint import (
    LaneStage,
    MaskFiller,
    Matcher,
    Vocabulary,
    response_format_grammar,
    shortest_answer,
    tools_grammar,
)
from sfnode.engines.config import EngineConfig
from sfnode.engines.mock import MockEngine
from sfnode.engines.runners.masks import MaskWorker
from sfnode.engines.transformers_engine import TransformersEngine
from sfnode.generation import EngineStop, GenerationRequest, GenerationResult
from sfnode.linkf.wire import Constraint, GenParams, Grammar
from tests.agents import NESTED_SCHEMA, TOOLS
from tests.test_constraint import ONE_TOOL, _tokenizer, tiny_model, vocabulary
from tests.test_head_tools import read_calls
from tests.tinymodel import TINY_EOS, TINY_VOCAB

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
GRAMMARS: dict[str, Grammar] = {
    "json_schema": response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "city", "schema": NESTED_SCHEMA}}
    ),
    "json_object": response_format_grammar({"type": "json_object"}),
    "required": tools_grammar(TOOLS, "required"),
    "named": tools_grammar(TOOLS, {"type": "function", "function": {"name": "send_email"}}),
}
"""What agents constrain with: the nested schema of the targets (a nested object of required
properties, an enum, bounds, an array), any JSON object, and tool calls, required and named."""
PARALLEL_ONE = tools_grammar(ONE_TOOL, "required", True)
PARAMS = (GenParams(), GenParams(temperature=1.0, seed=7), GenParams(temperature=0.8, seed=21))
"""Greedy and two seeds."""
PROMPT = [100 + i for i in range(8)]


def assert_valid(test: unittest.SynchronousTestCase, kind: str, text: str) -> None:
    """``text`` is a whole answer of the grammar ``kind`` names."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), NESTED_SCHEMA)
    elif kind == "json_object":
        test.assertIsInstance(json.loads(text), dict)
    else:
        content, calls = read_calls(text)
        test.assertEqual(content, "", text)
        test.assertTrue(calls, text)
        for name, arguments in calls:
            if kind == "named":
                test.assertEqual(name, "send_email")
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def answer_text(result: GenerationResult) -> str:
    """The text of an answer that ended with its EOS."""
    assert result.tokens and result.tokens[-1] == TINY_EOS, result
    return vocabulary().decode(list(result.tokens[:-1]))


def matcher_at(grammar: Grammar, text: str = "", limit: int | None = None) -> Matcher:
    """A matcher that consumed ``text`` (as the tokenizer splits it), with a budget of
    ``limit`` tokens in all."""
    matcher = Matcher(vocabulary(), grammar)
    matcher.budget.limit = limit
    for token in vocabulary().encode(text):
        matcher.consume(token)
    return matcher


def closing(matcher: Matcher) -> Closing:
    """The closing of the matcher's state, walked afresh."""
    found = closing_of(matcher._matcher, matcher.budget._contexts[-1], vocabulary().table)
    assert found is not None
    return found


def random_states(grammar: Grammar, walks: int, seed: int) -> Iterator[Matcher]:
    """Matchers at the states of ``walks`` random walks (each token drawn uniformly among the
    grammar's allowed ones, EOS aside), each yielded at every step."""
    rng = random.Random(seed)
    for _ in range(walks):
        matcher = Matcher(vocabulary(), grammar)
        for _ in range(40):
            yield matcher
            allowed = [int(t) for t in matcher.allowed() if t != TINY_EOS]
            if not allowed or matcher.stopped:
                break
            matcher.consume(rng.choice(allowed))


@cache
def fewest_oracle(text: bytes) -> int:
    """The fewest tokens spelling ``text``, trying every token of the vocabulary."""
    if not text:
        return 0
    spellings = vocabulary().table.bytes_of
    best = 1 << 30
    for data in spellings:
        if data and text.startswith(data):
            best = min(best, 1 + fewest_oracle(text[len(data) :]))
    return best


def shortest_spelling(vocab: Vocabulary, text: bytes) -> list[int]:
    """One spelling of ``text`` in the fewest tokens."""
    table, tokens = vocab.table, []
    while text:
        token, length = next(
            (t, n)
            for t, n in table.starts(text)
            if table.fewest(text[n:]) + 1 == table.fewest(text)
        )
        tokens.append(token)
        text = text[length:]
    return tokens


# --------------------------------------------------------------------------------------------
# The pieces


class ContextTests(unittest.SynchronousTestCase):
    """Where output bytes leave a JSON text, and the bytes a closing walk tries first there."""

    def test_where_the_output_stands(self) -> None:
        """A string (escapes included), a number, a literal, the first item of an array, the
        first key of an object, before a colon, after a value, and text outside JSON."""
        cases = {
            b'{"a": "x\\"y': b'"',
            b'{"a": 12': b"},0123456789",
            b'{"a": [12': b"],0123456789",
            b'{"a": tru': b"},",
            b'{"a": [1, ': b'0"[{ntf-123456789',
            b'{"a": [': b']0"[{ntf-123456789',
            b'{"a": {': b'}"',
            b'{"a": {"b": 1}, ': b'"',
            b'{"a"': b":",
            b'{"a": "b"': b"},",
            b'<tool_call>{"a": [1]}': b"",
        }
        for text, preferred in cases.items():
            self.assertEqual(JSON_START.feed(text).preferred(), preferred, text)
        self.assertTrue(JSON_START.feed(b'{"a": "x\\"y').in_string)
        self.assertFalse(JSON_START.feed(b'{"a": "x\\\\"').in_string)

    def test_feeding_in_pieces_is_feeding_at_once(self) -> None:
        """A text fed a byte at a time ends where it ends fed whole."""
        text = b'<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "c\\"}"}], "d": null}}'
        context = JSON_START
        for i in range(len(text)):
            context = context.feed(text[i : i + 1])
            self.assertEqual(context, JSON_START.feed(text[: i + 1]))


class TokenTableTests(unittest.SynchronousTestCase):
    """A vocabulary's tokens as bytes."""

    def test_the_fewest_tokens_of_a_text(self) -> None:
        """fewest() equals a brute-force search over every token, for closings and for pieces
        of answers (asked twice, so remembered answers are checked too)."""
        table = vocabulary().table
        texts = [b"", b"}", b'"}]}', b'ue, "": 0}', b', "country": "France", "population_']
        texts += [b'<tool_call>{"name": "add_numbers"}</tool_call>', b"the quick brown fox"]
        texts += [t[i:] for t in texts for i in (1, 3)]
        for _ in range(2):
            for text in texts:
                self.assertEqual(table.fewest(text), fewest_oracle(text), text)

    def test_a_full_memo_is_replaced_and_stays_right(self) -> None:
        """With a memo that fills after a few texts, fewest() still equals the oracle, for
        texts whose suffixes were remembered in a memo since replaced."""
        from sfnode.decoding import closing as module

        self.patch(module, "_MEMO_LIMIT", 8)
        table = module.TokenTable(vocabulary().tokenizer, TINY_VOCAB, TINY_EOS)
        words = b"the lazy dog"
        texts = [words[len(words) - k :] + b'"}]}' for k in range(len(words) + 1)]
        for text in texts * 2:
            self.assertEqual(table.fewest(text), fewest_oracle(text), text)

    def test_the_tokens_that_begin_a_text(self) -> None:
        """starts() lists exactly the tokens whose bytes begin the text, with their length."""
        table = vocabulary().table
        for text in (b'"}]}', b"the lazy dog", b"<tool_call>"):
            expected = {
                (t, len(data))
                for t, data in enumerate(table.bytes_of)
                if data and text.startswith(data)
            }
            self.assertEqual(set(table.starts(text)), expected, text)

    def test_a_strings_content(self) -> None:
        """The content bits mark the tokens that are whole UTF-8 characters without a quote,
        a backslash or a control character, and only those."""
        table = vocabulary().table
        for token, data in enumerate(table.bytes_of):
            bit = bool(table.content[token >> 5] >> (token & 31) & 1)
            try:
                text = data.decode()
            except UnicodeDecodeError:
                text = '"'
            expected = bool(data) and not any(c in '"\\' or ord(c) < 32 for c in text)
            self.assertEqual(bit, expected, data)


class WalkTests(unittest.SynchronousTestCase):
    """The closing walk (docs/protocol.md section 12.6)."""

    def test_known_closings(self) -> None:
        """Forced bytes as they are; at a choice the byte that closes soonest: a value is 0,
        an enum's first value in the fallback order, an array is closed, a literal finished;
        and the length is the fewest tokens of the text and the EOS."""
        cases = [
            ("json_object", "", b"{}"),
            ("json_object", '{"k": [1, {"x": "ab', b'"}]}'),
            ("json_object", '{"k": tr', b"ue}"),
            (
                "json_schema",
                '{"city": "Par',
                b'", "country": "France", "population_millions": 0, "landmarks": [], '
                b'"weather": {"season": "autumn", "celsius": 0}}',
            ),
            (
                "required",
                "",
                b'<tool_call>{"name": "add_numbers", "arguments": {"a": 0, "b": 0}}</tool_call>',
            ),
            (
                "named",
                "",
                b'<tool_call>{"name": "send_email", "arguments": {"to": "", "subject": "", '
                b'"urgent": true}}</tool_call>',
            ),
            (
                "required",
                '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
                b'", "unit": "celsius"}}</tool_call>',
            ),
        ]
        for kind, prefix, text in cases:
            found = closing(matcher_at(GRAMMARS[kind], prefix))
            self.assertEqual(found.text, text, (kind, prefix))
            self.assertEqual(found.length, fewest_oracle(text) + 1, (kind, prefix))

    def test_a_walk_leaves_the_matcher_as_it_was(self) -> None:
        """The mask after a walk is the mask before it, and the output can go on."""
        matcher = matcher_at(GRAMMARS["json_schema"], '{"city": "Pa')
        before = matcher.allowed().tolist()
        closing(matcher)
        self.assertEqual(matcher.allowed().tolist(), before)
        for token in vocabulary().encode('ris", "country": "Fr'):
            matcher.consume(token)

    def test_the_walk_goes_on_the_same_way(self) -> None:
        """From random states of every grammar: after each token that spells the start of the
        closing, the closing walked afresh is the rest of its text (what lets a closing lane
        stay closing, and a replayed lane find the same closing)."""
        table = vocabulary().table
        checked = 0
        for index, grammar in enumerate(GRAMMARS.values()):
            for matcher in random_states(grammar, 3, index):
                found = closing(matcher)
                for token, length in table.starts(found.text):
                    matcher.consume(token)
                    after = closing(matcher)
                    matcher.rollback(1)
                    self.assertEqual(after.text, found.text[length:])
                    self.assertEqual(after.length, table.fewest(after.text) + 1)
                    checked += 1
        self.assertGreater(checked, 200)

    def test_every_closing_ends_a_valid_answer(self) -> None:
        """From random states, the output and its closing, spelled in the fewest tokens and
        ended by the EOS, is accepted by the grammar and is a valid answer."""
        vocab = vocabulary()
        for index, (kind, grammar) in enumerate(GRAMMARS.items()):
            for matcher in random_states(grammar, 2, 10 + index):
                if matcher.stopped:
                    continue
                found = closing(matcher)
                spelled = shortest_spelling(vocab, found.text)
                self.assertEqual(len(spelled) + 1, found.length)
                output = list(matcher.budget._tokens)
                for token in spelled:
                    matcher.consume(token)
                self.assertTrue(matcher.accepting, vocab.decode(output + spelled))
                assert_valid(self, kind, vocab.decode(output + spelled))
                matcher.rollback(len(spelled))

    def test_the_shortest_answer(self) -> None:
        """shortest_answer is the closing at the start of the output: the fewest tokens of a
        whole answer and its EOS."""
        for kind, grammar in GRAMMARS.items():
            length = shortest_answer(vocabulary(), grammar)
            self.assertEqual(length, closing(matcher_at(grammar)).length, kind)
        self.assertEqual(shortest_answer(vocabulary(), GRAMMARS["json_object"]), 3)


class MaskTests(unittest.SynchronousTestCase):
    """The masks of a lane with a budget (docs/engine.md section 2.4)."""

    def test_far_from_the_budget_the_mask_is_the_grammars(self) -> None:
        """With room to spare beyond the guard, a lane's mask is its grammar's."""
        for index, grammar in enumerate(GRAMMARS.values()):
            for matcher in random_states(grammar, 1, 20 + index):
                if matcher.stopped:
                    continue
                free = matcher.allowed().tolist()
                matcher.budget.limit = (
                    matcher.consumed + closing(matcher).length + CLOSING_GUARD + 1
                )
                self.assertEqual(matcher.allowed().tolist(), free)
                matcher.budget.limit = None

    def test_at_the_edge_only_the_shortest_spellings_start(self) -> None:
        """With exactly the closing's length left, the tokens allowed are the first tokens
        of the closing text's shortest spellings (the EOS where the output may end)."""
        table = vocabulary().table
        for index, grammar in enumerate(GRAMMARS.values()):
            for matcher in random_states(grammar, 1, 30 + index):
                if matcher.stopped:
                    continue
                found = closing(matcher)
                matcher.budget.limit = matcher.consumed + found.length
                expected = {
                    t
                    for t, n in table.starts(found.text)
                    if table.fewest(found.text[n:]) + 2 == found.length
                }
                if not found.text:
                    expected = {TINY_EOS}
                self.assertEqual(set(matcher.allowed().tolist()), expected)
                matcher.budget.limit = None

    def test_every_token_a_closing_lane_may_draw_leaves_room(self) -> None:
        """With a slack from 1 to the guard: every token allowed leaves a closing that fits in
        what is left (walked afresh), the closing's own start is allowed, and where the
        grammar allows few tokens every one that leaves room is allowed."""
        vocab = vocabulary()
        checked = 0
        for index, grammar in enumerate(GRAMMARS.values()):
            for matcher in random_states(grammar, 1, 40 + index):
                if matcher.stopped:
                    continue
                found = closing(matcher)
                grammar_mask = set(matcher.allowed().tolist())
                for slack in (1, 3, CLOSING_GUARD):
                    left = found.length + slack
                    matcher.budget.limit = matcher.consumed + left
                    allowed = set(matcher.allowed().tolist())
                    fits = set()
                    for token in sorted(grammar_mask - {TINY_EOS}):
                        matcher.consume(token)
                        after = closing(matcher)
                        matcher.rollback(1)
                        if after.length <= left - 1:
                            fits.add(token)
                    self.assertTrue(
                        allowed - {TINY_EOS} <= fits, vocab.decode(matcher.budget._tokens)
                    )
                    self.assertTrue(
                        allowed & {t for t, _ in vocab.table.starts(found.text)} or not found.text
                    )
                    if len(grammar_mask) <= 128:
                        self.assertEqual(allowed - {TINY_EOS}, fits)
                    checked += 1
                matcher.budget.limit = None
        self.assertGreater(checked, 50)

    def test_a_second_call_that_cannot_be_finished_is_not_allowed(self) -> None:
        """After a whole call of a parallel tools grammar, far from the budget: the newline
        that would open another call is allowed only while that call's closing fits."""
        vocab = vocabulary()
        call = '<tool_call>{"name": "jump", "arguments": {"over": "fox"}}</tool_call>'
        matcher = matcher_at(PARALLEL_ONE, call)
        newline = vocab.encode("\n")[0]
        self.assertIn(newline, matcher.allowed().tolist())
        matcher.consume(newline)
        after = closing(matcher).length
        matcher.rollback(1)
        matcher.budget.limit = matcher.consumed + after + 1
        self.assertIn(newline, matcher.allowed().tolist())
        matcher.budget.limit = matcher.consumed + after
        self.assertEqual(matcher.allowed().tolist(), [TINY_EOS])

    def test_the_same_state_gives_the_same_mask_however_it_was_reached(self) -> None:
        """A closing lane's mask after k tokens is the same drawn token by token, prepared
        from the prompt and the k tokens with the budget less k (a failover), after drafted
        tokens were consumed and taken back, and computed with other lanes at once."""
        vocab = vocabulary()
        grammar = GRAMMARS["json_schema"]
        answer = vocab.encode('{"city": "Paris", "country": "France", "population_millions": 2')
        budget = len(answer) + 66
        drawn = LaneStage.prepare(vocab, Constraint(len(PROMPT), grammar), PROMPT, budget)
        assert drawn.matcher is not None
        for k, token in enumerate(answer):
            replayed = LaneStage.prepare(
                vocab, Constraint(len(PROMPT), grammar), PROMPT + answer[:k], budget - k
            )
            assert replayed.matcher is not None
            mask = drawn.matcher.allowed().tolist()
            self.assertEqual(replayed.matcher.allowed().tolist(), mask, k)
            for draft in answer[k : k + 3]:
                drawn.matcher.consume(draft)
            drawn.matcher.rollback(len(answer[k : k + 3]))
            self.assertEqual(drawn.matcher.allowed().tolist(), mask, k)
            other = matcher_at(GRAMMARS["json_object"], '{"a": "b', 20)
            masks = MaskFiller(vocab).fill([(other, 0), (drawn.matcher, 1)], 2)
            self.assertEqual(vocab.allowed(masks, 1).tolist(), mask, k)
            drawn.advance(token)

    def test_the_closed_flag_survives_a_replay(self) -> None:
        """A lane that drew through a mask its budget narrowed and ended is closed; so is the
        same lane prepared from its tokens after a failover; a lane that never came near its
        budget is not."""
        vocab = vocabulary()
        grammar = GRAMMARS["json_object"]
        for budget, closed in ((12, True), (200, False)):
            stage = LaneStage.prepare(vocab, Constraint(len(PROMPT), grammar), PROMPT, budget)
            assert stage.matcher is not None
            tokens: list[int] = []
            wanted = vocab.encode('{"a": "b", "c": [1, 2], "d": "eee"}')
            while not tokens or tokens[-1] != TINY_EOS:
                allowed = stage.matcher.allowed().tolist()
                # The answer's next token where the mask allows it, else the first allowed.
                token = wanted[len(tokens)] if len(tokens) < len(wanted) else TINY_EOS
                token = token if token in allowed else allowed[0]
                stage.advance(token)
                tokens.append(token)
            self.assertEqual(tokens[-1], TINY_EOS)
            self.assertEqual(stage.closed, closed)
            for k in (1, len(tokens) // 2, len(tokens) - 1):
                again = LaneStage.prepare(
                    vocab, Constraint(len(PROMPT), grammar), PROMPT + tokens[:k], budget - k
                )
                assert again.matcher is not None
                for token in tokens[k:]:
                    self.assertIn(token, again.matcher.allowed().tolist())  # a draw's mask
                    again.advance(token)
                self.assertEqual(again.closed, closed, k)


# --------------------------------------------------------------------------------------------
# The engines


FREE = 600
"""A budget the targets' answers do not need (the mock's ``json_object`` keys may run on)."""
BUDGET_STEPS = (0, 2, 9, 30)
"""Budgets tried: the shortest answer plus these."""


def budgets(kind: str) -> list[int]:
    shortest = shortest_answer(vocabulary(), GRAMMARS[kind])
    assert shortest is not None
    return [shortest + step for step in BUDGET_STEPS]


class MockClosingTests(unittest.SynchronousTestCase):
    """The mock engine over the tiny vocabulary."""

    def run_all(
        self, requests: Sequence[GenerationRequest], lanes: int = 8
    ) -> list[GenerationResult]:
        """The results of ``requests`` submitted at once to a mock engine, in their order."""
        clock = Clock()
        engine = MockEngine(
            clock,
            EngineConfig(max_lanes=lanes, interactive_lanes=0),
            vocab_size=TINY_VOCAB,
            vocabulary=vocabulary(),
        )
        engine.start()
        results: dict[int, Any] = {}
        for index, request in enumerate(requests):
            generation = engine.submit(request, lambda batch: None)
            generation.result.addBoth(lambda result, i=index: results.setdefault(i, result))
        for _ in range(10_000):
            if len(results) == len(requests):
                break
            clock.advance(0)
        self.assertEqual(len(results), len(requests))
        for result in results.values():
            self.assertIsInstance(result, GenerationResult)
        return [results[i] for i in range(len(requests))]

    def request(
        self, kind: str, params: GenParams, budget: int, context: Sequence[int] = PROMPT
    ) -> GenerationRequest:
        return GenerationRequest(
            list(context), params, budget, constraint=Constraint(len(PROMPT), GRAMMARS[kind])
        )

    def test_every_answer_closes_within_its_budget(self) -> None:
        """For every grammar, budget and draw: the answer ends with EOS within its budget and
        is valid; an answer that needed more than its budget says it was closed, and one
        that does not say so is the answer without a budget, token for token."""
        for kind in GRAMMARS:
            for params in PARAMS:
                (free,) = self.run_all([self.request(kind, params, FREE)])
                self.assertEqual(free.stop, EngineStop.EOS)
                assert_valid(self, kind, answer_text(free))
                for budget in budgets(kind):
                    (result,) = self.run_all([self.request(kind, params, budget)])
                    self.assertEqual(result.stop, EngineStop.EOS, (kind, budget))
                    self.assertLessEqual(len(result.tokens), budget)
                    assert_valid(self, kind, answer_text(result))
                    if len(free.tokens) > budget:
                        self.assertTrue(result.closed, (kind, budget))
                    if not result.closed and not free.closed:
                        self.assertEqual(result.tokens, free.tokens, (kind, budget))

    def test_below_the_shortest_answer_no_answer_fits(self) -> None:
        """One token less than the shortest answer: the output is cut (LENGTH), which is why
        a head refuses such a budget before placing it."""
        for kind in GRAMMARS:
            (result,) = self.run_all([self.request(kind, GenParams(), budgets(kind)[0] - 1)])
            self.assertEqual(result.stop, EngineStop.LENGTH, kind)

    def test_alone_equals_batched(self) -> None:
        """Eight lanes at once (every grammar at a tight budget, greedy and seeded, beside an
        unconstrained lane) give each lane its tokens and its closed flag alone."""
        requests = [
            self.request(kind, PARAMS[i % 3], budgets(kind)[1 + i % 2])
            for i, kind in enumerate(list(GRAMMARS) * 2)
        ]
        requests[-1] = GenerationRequest(PROMPT, PARAMS[1], 40)
        alone = [self.run_all([r])[0] for r in requests]
        batched = self.run_all(requests)
        self.assertEqual(
            [(list(r.tokens), r.closed) for r in batched],
            [(list(r.tokens), r.closed) for r in alone],
        )

    def test_a_failed_over_generation_continues_with_the_same_tokens(self) -> None:
        """Context = prompt + the first k tokens delivered, budget less k: the rest is the
        uninterrupted run's, inside the closing too, and so is the closed flag."""
        for kind in GRAMMARS:
            for params in PARAMS[:2]:
                budget = budgets(kind)[2]
                (whole,) = self.run_all([self.request(kind, params, budget)])
                tokens = list(whole.tokens)
                for k in (1, len(tokens) // 2, len(tokens) - 4, len(tokens) - 1):
                    (rest,) = self.run_all(
                        [self.request(kind, params, budget - k, PROMPT + tokens[:k])]
                    )
                    self.assertEqual(tokens[:k] + list(rest.tokens), tokens, (kind, k))
                    self.assertEqual(rest.closed, whole.closed, (kind, k))


class TransformersClosingTests(unittest.TestCase):
    """The transformers engine on the tiny Llama (float32), the same grammars and budgets."""

    timeout = 300

    def make_engine(self, **kwargs: Any) -> TransformersEngine:
        engine = TransformersEngine(
            tiny_model(),
            reactor,
            EngineConfig(
                prefix_cache=False, interactive_lanes=0, max_lanes=8, weights="float32", **kwargs
            ),
            tokenizer=_tokenizer(),
        )
        engine.start()
        self.addCleanup(engine.stop)
        return engine

    def request(
        self, kind: str, params: GenParams, budget: int, delivered: Sequence[int] = ()
    ) -> GenerationRequest:
        prompt = _tokenizer().encode("the quick brown fox")
        return GenerationRequest(
            prompt + list(delivered),
            params,
            budget,
            constraint=Constraint(len(prompt), GRAMMARS[kind]),
        )

    def run_one(self, engine: TransformersEngine, request: GenerationRequest) -> Any:
        return engine.submit(request, lambda batch: None).result

    @defer.inlineCallbacks
    def test_answers_close_within_their_budgets(self) -> Any:
        """Every grammar, greedy and seeded, at three budgets: EOS within the budget, a valid
        answer, and closed when the answer without a budget is longer."""
        engine = self.make_engine()
        for kind in GRAMMARS:
            for params in PARAMS[:2]:
                free = yield self.run_one(engine, self.request(kind, params, 200))
                for budget in budgets(kind)[:3]:
                    result = yield self.run_one(engine, self.request(kind, params, budget))
                    self.assertEqual(result.stop, EngineStop.EOS, (kind, budget))
                    self.assertLessEqual(len(result.tokens), budget)
                    assert_valid(self, kind, answer_text(result))
                    if len(free.tokens) > budget:
                        self.assertTrue(result.closed, (kind, budget))

    @defer.inlineCallbacks
    def test_alone_equals_batched_and_a_failover_continues(self) -> Any:
        """Eight lanes at once (every grammar at a tight budget, greedy and seeded) give each
        lane its tokens and flag alone; a lane handed its first k tokens and its budget less k
        goes on with the rest of them."""
        engine = self.make_engine()
        requests = [
            self.request(kind, PARAMS[i % 3], budgets(kind)[1 + i % 2])
            for i, kind in enumerate(list(GRAMMARS) * 2)
        ]
        alone = []
        for request in requests:
            alone.append((yield self.run_one(engine, request)))
        batched = yield defer.gatherResults([self.run_one(engine, r) for r in requests])
        self.assertEqual(
            [(list(r.tokens), r.closed) for r in batched],
            [(list(r.tokens), r.closed) for r in alone],
        )
        for i, kind in enumerate(GRAMMARS):
            tokens = list(alone[i].tokens)
            budget = budgets(kind)[1 + i % 2]
            for k in (len(tokens) // 2, len(tokens) - 3):
                rest = yield self.run_one(
                    engine, self.request(kind, PARAMS[i % 3], budget - k, tokens[:k])
                )
                self.assertEqual(tokens[:k] + list(rest.tokens), tokens, (kind, k))
                self.assertEqual(rest.closed, alone[i].closed, (kind, k))

    @defer.inlineCallbacks
    def test_the_mock_allows_the_tokens_the_engine_allows(self) -> Any:
        """Along the engine's closed answers: at every step the mask the engine's mask worker
        computes (the runners' path) equals the one the mock engine samples from
        (Matcher.allowed), the drawn token is in it, and the budget narrowed some of them."""
        engine = self.make_engine()
        vocab = vocabulary()
        worker = MaskWorker(vocab)
        self.addCleanup(worker.stop)
        narrowed = 0
        for kind in GRAMMARS:
            budget = budgets(kind)[1]
            request = self.request(kind, PARAMS[1], budget)
            result = yield self.run_one(engine, request)
            self.assertTrue(result.closed, kind)
            assert request.constraint is not None
            stages = [
                LaneStage.prepare(vocab, request.constraint, request.context, budget)
                for _ in range(2)
            ]
            for token in result.tokens:
                masks = worker.start([stages[0]]).wait()
                assert masks is not None
                runner_mask = vocab.allowed(masks, 0).tolist()
                assert stages[1].matcher is not None
                self.assertEqual(stages[1].matcher.allowed().tolist(), runner_mask, kind)
                self.assertIn(token, runner_mask)
                grammar_only = Matcher(vocab, GRAMMARS[kind])
                for earlier in stages[1].matcher.budget._tokens:
                    grammar_only.consume(earlier)
                narrowed += len(grammar_only.allowed()) > len(runner_mask)
                for stage in stages:
                    stage.advance(token)
        self.assertGreater(narrowed, 4)

    @defer.inlineCallbacks
    def test_drafts_change_nothing_at_the_close(self) -> Any:
        """With speculative decoding, the drafted rows' masks are the budget's too: tight
        budgets give the tokens of decoding without drafts."""
        from tests.test_engine import draft_from_answers

        plain = self.make_engine()
        drafting = self.make_engine(speculative="ngram")
        requests = [
            self.request(kind, PARAMS[i % 2], budgets(kind)[1]) for i, kind in enumerate(GRAMMARS)
        ]
        expected = []
        for request in requests:
            expected.append(list((yield self.run_one(plain, request)).tokens))
        draft_from_answers(
            drafting, {tuple(r.context): t for r, t in zip(requests, expected, strict=True)}
        )
        got = yield defer.gatherResults([self.run_one(drafting, r) for r in requests])
        self.assertEqual([list(r.tokens) for r in got], expected)
        self.assertGreater(drafting.statistics().steps.accepted, 0)
