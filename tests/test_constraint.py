"""Constraints (issue 21; docs/protocol.md section 12.3, docs/engine.md section 2.4): building
them from what clients send, the matcher's masks, the sampler's controls, and both engines.

The masks are checked against an oracle that does not ask the grammar library: for grammars
whose language is a handful of strings, a token is allowed exactly when the text so far plus
the token's text is the start of one of them, and an EOS id exactly when the text so far is
one of them.  Every token of the tiny test vocabulary is checked at every position.  The mock
engine and the transformers engine on the tiny Llama then run the same stages.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema
import torch
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial import unittest

from sfnode.decoding.constraint import (
    ConstraintError,
    LaneStage,
    MaskFiller,
    Matcher,
    Vocabulary,
    check_grammar,
    response_format_grammar,
    sampler_controls,
    tools_grammar,
    tools_system_text,
)
from sfnode.decoding.sampler import apply_controls
from sfnode.engines.config import EngineConfig
from sfnode.engines.mock import MockEngine, mock_logits, mock_next_token, mock_staged_logits
from sfnode.engines.transformers_engine import TransformersEngine
from sfnode.generation import EngineRefusal, EngineStop, GenerationRequest, GenerationResult
from sfnode.linkf.wire import (
    Constraint,
    GenParams,
    JsonObjectGrammar,
    JsonSchemaGrammar,
    SamplerControls,
    ToolChoice,
    ToolsGrammar,
)
from tests.agents import TOOLS
from tests.tinymodel import TINY_EOS, TINY_VOCAB, tiny_llama, tiny_tokenizer

torch.set_num_threads(1)

_CACHE: dict[str, Any] = {}


def vocabulary() -> Vocabulary:
    """The tiny test tokenizer's vocabulary (512 tokens, EOS 2), built once."""
    if "vocabulary" not in _CACHE:
        _CACHE["tokenizer"] = tiny_tokenizer()
        _CACHE["vocabulary"] = Vocabulary.of_tokenizer(
            _CACHE["tokenizer"], size=TINY_VOCAB, eos_ids=[TINY_EOS]
        )
    vocab: Vocabulary = _CACHE["vocabulary"]
    return vocab


def tiny_model() -> Any:
    if "model" not in _CACHE:
        _CACHE["model"] = tiny_llama()
    return _CACHE["model"]


def schema_grammar(schema: Any) -> JsonSchemaGrammar:
    grammar = response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    )
    assert isinstance(grammar, JsonSchemaGrammar)
    return grammar


ENUM_SCHEMA = {"enum": ["fox", "dog", 12, "the lazy dog"]}
ENUM_LANGUAGE = ['"fox"', '"dog"', "12", '"the lazy dog"']

ONE_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "jump",
            "parameters": {
                "type": "object",
                "properties": {"over": {"enum": ["fox", "dog"]}},
                "required": ["over"],
                "additionalProperties": False,
            },
        },
    }
]
ONE_TOOL_LANGUAGE = [
    '<tool_call>{"name": "jump", "arguments": {"over": "fox"}}</tool_call>',
    '<tool_call>{"name": "jump", "arguments": {"over": "dog"}}</tool_call>',
]

NESTED = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"enum": ["fox", "dog"]},
        "c": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


# --------------------------------------------------------------------------------------------
# From a request to a constraint


class BuildingTests(unittest.SynchronousTestCase):
    """What clients send becomes a wire grammar, or a ConstraintError naming the field."""

    def test_response_formats(self) -> None:
        """text is no constraint, json_object is JsonObjectGrammar, json_schema carries the
        schema's JSON text."""
        self.assertIsNone(response_format_grammar({"type": "text"}))
        self.assertIsNone(response_format_grammar(None))
        self.assertEqual(response_format_grammar({"type": "json_object"}), JsonObjectGrammar())
        grammar = schema_grammar(NESTED)
        self.assertEqual(json.loads(grammar.schema), NESTED)

    def test_refused_formats_name_the_field_and_the_reason(self) -> None:
        """A json_schema without a schema, an unknown type, a look-around pattern and an
        unknown string format are refused with param response_format and what is wrong."""
        cases = [
            ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
            ({"type": "xml"}, "must be text, json_object or json_schema"),
            (
                {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "string", "pattern": "(?=a)b"}},
                },
                "look-around",
            ),
            (
                {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "string", "format": "uri-reference"}},
                },
                "uri-reference",
            ),
            ({"type": "json_schema", "json_schema": {"schema": "object"}}, "JSON Schema object"),
        ]
        for request, reason in cases:
            with self.assertRaises(ConstraintError) as caught:
                response_format_grammar(request)
            self.assertEqual(caught.exception.param, "response_format")
            self.assertIn(reason, str(caught.exception))

    def test_tool_choices(self) -> None:
        """tool_choice none, auto (the default), required and a named function; no tools and
        no choice is no constraint; parallel_tool_calls is kept."""
        self.assertIsNone(tools_grammar(None))
        self.assertIsNone(tools_grammar([], "none"))
        auto = tools_grammar(TOOLS)
        assert auto is not None
        self.assertEqual((auto.choice, auto.parallel), (ToolChoice.AUTO, True))
        self.assertEqual(
            [f["name"] for f in json.loads(auto.tools)],
            ["get_weather", "add_numbers", "send_email"],
        )
        for choice, expected in (("none", ToolChoice.NONE), ("required", ToolChoice.REQUIRED)):
            grammar = tools_grammar(TOOLS, choice, False)
            assert grammar is not None
            self.assertEqual((grammar.choice, grammar.parallel), (expected, False))
        named = tools_grammar(TOOLS, {"type": "function", "function": {"name": "add_numbers"}})
        assert named is not None
        self.assertEqual((named.choice, named.function), (ToolChoice.FUNCTION, "add_numbers"))

    def test_refused_tools_name_the_field(self) -> None:
        """An undeclared function name is a tool_choice error; bad tools, duplicate names and
        unenforceable parameters are tools errors; a non-boolean parallel_tool_calls too."""
        cases = [
            (
                (TOOLS, {"type": "function", "function": {"name": "fly"}}),
                "tool_choice",
                "not among the declared tools",
            ),
            ((TOOLS, "sometimes"), "tool_choice", "tool_choice must be"),
            ((None, "required"), "tool_choice", "needs tools"),
            (([{"type": "retrieval"}],), "tools", "must be a function tool"),
            (([{"type": "function", "function": {"name": "a b"}}],), "tools", "letters"),
            ((TOOLS + TOOLS[:1],), "tools", "declared twice"),
            (
                (
                    [
                        {
                            "type": "function",
                            "function": {
                                "name": "f",
                                "parameters": {"type": "string", "pattern": "(?<=x)"},
                            },
                        }
                    ],
                ),
                "tools",
                "look-around",
            ),
            ((TOOLS, "auto", "yes"), "parallel_tool_calls", "boolean"),
        ]
        for args, param, reason in cases:
            with self.assertRaises(ConstraintError) as caught:
                tools_grammar(*args)
            self.assertEqual(caught.exception.param, param, args)
            self.assertIn(reason, str(caught.exception))

    def test_sampler_controls(self) -> None:
        """logit_bias keys may be strings or integers; zero biases and all-zero controls are
        dropped; each out-of-range value names its field."""
        self.assertIsNone(sampler_controls())
        self.assertIsNone(sampler_controls(logit_bias={"5": 0}, repetition_penalty=1.0))
        controls = sampler_controls(
            logit_bias={"7": -100, 3: 2.5}, presence_penalty=0.5, frequency_penalty=-1
        )
        assert controls is not None
        self.assertEqual(controls.logit_bias, ((3, 2.5), (7, -100.0)))
        self.assertEqual((controls.presence_penalty, controls.frequency_penalty), (0.5, -1.0))
        cases = [
            ({"logit_bias": {"x": 1}}, "logit_bias"),
            ({"logit_bias": {"5": 101}}, "logit_bias"),
            ({"logit_bias": {"600": 1}, "vocab_size": 512}, "logit_bias"),
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"frequency_penalty": "1"}, "frequency_penalty"),
            ({"repetition_penalty": -1}, "repetition_penalty"),
            ({"repetition_penalty": 1.1, "repetition_window": -2}, "repetition_window"),
        ]
        for kwargs, param in cases:
            with self.assertRaises(ConstraintError) as caught:
                sampler_controls(**kwargs)
            self.assertEqual(caught.exception.param, param)

    def test_check_needs_no_tokenizer(self) -> None:
        """check_grammar compiles without a vocabulary: the head answers 400s with it."""
        check_grammar(JsonObjectGrammar())
        with self.assertRaises(ConstraintError):
            check_grammar(JsonSchemaGrammar("not json"))
        with self.assertRaises(ConstraintError):
            check_grammar(ToolsGrammar('[{"name": "f"}]', ToolChoice.FUNCTION, "g"))


class GenericRenderingTests(unittest.SynchronousTestCase):
    """The generic rendering: tools in the system turn, calls read back."""

    def test_the_system_text_lists_every_tool_and_the_call_syntax(self) -> None:
        """Each tool is one line of JSON with its name, description and parameters, after
        the line that shows what a call looks like."""
        text = tools_system_text(TOOLS)
        self.assertIn('<tool_call>{"name": <function name>, "arguments":', text)
        lines = text.splitlines()[3:]
        self.assertEqual(
            [json.loads(line)["name"] for line in lines],
            ["get_weather", "add_numbers", "send_email"],
        )
        self.assertEqual(json.loads(lines[0])["parameters"], TOOLS[0]["function"]["parameters"])


# --------------------------------------------------------------------------------------------
# The matcher


class MaskOracleTests(unittest.SynchronousTestCase):
    """The matcher masks exactly the tokens the grammar forbids (checked for every token of
    the tiny vocabulary at every position, against the language itself)."""

    def assert_masks_follow(self, grammar: Any, language: Sequence[str]) -> None:
        vocab = vocabulary()
        texts = [vocab.decode([t]) for t in range(TINY_VOCAB)]
        special = {t for t in range(TINY_VOCAB) if texts[t] in ("<pad>", "<s>", "</s>")}
        for answer in language:
            matcher = Matcher(vocab, grammar)
            tokens = vocab.encode(answer)
            for index in range(len(tokens) + 1):
                so_far = vocab.decode(tokens[:index])
                expected = {
                    t
                    for t in range(TINY_VOCAB)
                    if t not in special
                    and texts[t]
                    and any(s.startswith(so_far + texts[t]) for s in language)
                }
                if so_far in language:
                    expected.add(TINY_EOS)
                allowed = set(matcher.allowed().tolist())
                self.assertEqual(allowed, expected, (answer, so_far))
                if index < len(tokens):
                    matcher.consume(tokens[index])
            self.assertTrue(matcher.accepting)

    def test_an_enum_schema(self) -> None:
        """A JSON Schema enum of strings and a number: exactly the tokens that keep to one of
        the four answers, EOS only after a whole one."""
        self.assert_masks_follow(schema_grammar(ENUM_SCHEMA), ENUM_LANGUAGE)

    def test_a_required_call(self) -> None:
        """tool_choice required with one tool whose argument is an enum: exactly the tokens of
        the two possible calls, EOS only after a whole call (parallel calls off)."""
        grammar = tools_grammar(ONE_TOOL, "required", False)
        self.assert_masks_follow(grammar, ONE_TOOL_LANGUAGE)

    def test_auto_writes_text_until_a_call_opens(self) -> None:
        """tool_choice auto: text may be anything and end anywhere; once the opening tag is
        written only the call may follow, and it must close before the output ends."""
        vocab = vocabulary()
        grammar = tools_grammar(ONE_TOOL, "auto", False)
        matcher = Matcher(vocab, grammar)
        for token in vocab.encode("the fox "):
            matcher.consume(token)
        allowed = set(matcher.allowed().tolist())
        self.assertIn(TINY_EOS, allowed)
        printable = {
            t
            for t in range(TINY_VOCAB)
            if not vocab.tokenizer.is_special_token(t)
            and vocab.decode([t]).isascii()
            and vocab.decode([t]).isprintable()
        }
        self.assertGreater(len(printable), 200)
        self.assertLessEqual(printable, allowed)
        for token in vocab.encode("<tool_call>"):
            matcher.consume(token)
        self.assertEqual(vocab.decode(matcher.allowed().tolist()), "{")
        self.assertFalse(matcher.accepting)
        with self.assertRaises(ConstraintError):
            for token in vocab.encode('{"name": "fly"'):
                matcher.consume(token)

    def test_none_never_opens_a_call(self) -> None:
        """tool_choice none: plain text, but the opening tag cannot be completed."""
        vocab = vocabulary()
        matcher = Matcher(vocab, tools_grammar(ONE_TOOL, "none"))
        tokens = vocab.encode("a <tool_call>")
        with self.assertRaises(ConstraintError):
            for token in tokens:
                matcher.consume(token)

    def test_rollback_and_replay_give_the_same_masks(self) -> None:
        """Rolling back k tokens gives the masks seen k tokens earlier; a stage prepared from a
        context whose tail was generated (a failover) is where one that drew them is."""
        vocab = vocabulary()
        grammar = schema_grammar(NESTED)
        answer = vocab.encode('{"a": 42, "b": "dog", "c": [1, 2]}')
        matcher = Matcher(vocab, grammar)
        masks = []
        for token in answer:
            masks.append(matcher.allowed().tolist())
            matcher.consume(token)
        matcher.rollback(5)
        self.assertEqual(matcher.allowed().tolist(), masks[-5])
        prompt = [100, 101, 102]
        drawn = LaneStage.prepare(vocab, Constraint(len(prompt), grammar), prompt)
        for token in answer[:7]:
            drawn.advance(token)
        replayed = LaneStage.prepare(vocab, Constraint(len(prompt), grammar), prompt + answer[:7])
        assert drawn.matcher is not None and replayed.matcher is not None
        self.assertEqual(replayed.matcher.allowed().tolist(), drawn.matcher.allowed().tolist())
        self.assertEqual(replayed.matcher.allowed().tolist(), masks[7])

    def test_a_replayed_token_the_grammar_refuses_is_a_constraint_error(self) -> None:
        """Delivered tokens that break the grammar, and a generated_from past the context,
        refuse the stage."""
        vocab = vocabulary()
        prompt = [100, 101]
        with self.assertRaises(ConstraintError):
            LaneStage.prepare(
                vocab, Constraint(2, schema_grammar(NESTED)), prompt + vocab.encode("hello")
            )
        with self.assertRaises(ConstraintError):
            LaneStage.prepare(vocab, Constraint(3, JsonObjectGrammar()), prompt)

    def test_many_masks_at_once_equal_one_at_a_time(self) -> None:
        """MaskFiller computes several lanes' masks in one call, each equal to its own."""
        vocab = vocabulary()
        matchers = [Matcher(vocab, schema_grammar(NESTED)) for _ in range(3)]
        for matcher, text in zip(matchers, ['{"a": 4', '{"a": 4, "b": "d', ""], strict=True):
            for token in vocab.encode(text):
                matcher.consume(token)
        masks = MaskFiller(vocab, threads=2).fill([(m, i + 1) for i, m in enumerate(matchers)], 5)
        for i, matcher in enumerate(matchers):
            self.assertEqual(vocab.allowed(masks, i + 1).tolist(), matcher.allowed().tolist())
        self.assertEqual(len(vocab.allowed(masks, 0)), TINY_VOCAB)


# --------------------------------------------------------------------------------------------
# The sampler's controls


class ControlsTests(unittest.SynchronousTestCase):
    """logit_bias, OpenAI's presence and frequency penalties over the generated tokens and
    llama.cpp's repetition penalty over the window (docs/engine.md section 2.4)."""

    def stage(self, controls: SamplerControls, context: Sequence[int], generated_from: int) -> Any:
        return LaneStage.prepare(None, Constraint(generated_from, None, controls), context)

    def test_the_formulas(self) -> None:
        """bias adds; a token in the window is divided by r when positive, multiplied when
        not; a token generated c times loses c * frequency + presence; the prompt's tokens
        count for the window but not for the generated counts."""
        controls = SamplerControls(((7, 1.5),), 0.25, 0.5, 2.0, 4)
        stage = self.stage(controls, [5, 9, 6, 6, 8, 9], generated_from=3)
        # window = the last 4: 6, 6, 8, 9; generated = 6, 8, 9 (6 once, from index 3)
        self.assertEqual(stage.adjusted(7, 1.0), 2.5)
        self.assertEqual(stage.adjusted(5, 3.0), 3.0)
        self.assertEqual(stage.adjusted(6, 3.0), 3.0 / 2 - (1 * 0.5 + 0.25))
        self.assertEqual(stage.adjusted(9, -1.0), -1.0 * 2 - (0.5 + 0.25))
        stage.advance(9)
        self.assertEqual(stage.adjusted(9, 4.0), 4.0 / 2 - (2 * 0.5 + 0.25))
        # 6 at index 2 slid out of the window; 6 at index 3 stays
        stage.advance(1)
        stage.advance(1)
        self.assertEqual(stage.adjusted(6, 3.0), 3.0 - 0.75)
        stage.rollback(2)
        self.assertEqual(stage.adjusted(6, 3.0), 3.0 / 2 - 0.75)

    def test_the_tensor_form_equals_the_pure_one(self) -> None:
        """apply_controls on float32 logits gives adjusted()'s values for every token."""
        controls = SamplerControls(((3, -100.0), (7, 2.0)), 0.5, 0.25, 1.3, 8)
        stage = self.stage(controls, [1, 3, 3, 7, 2, 9, 9, 9], generated_from=4)
        logits = torch.linspace(-3, 3, 12).reshape(1, 12)
        expected = [stage.adjusted(t, float(v)) for t, v in enumerate(logits[0].tolist())]
        apply_controls(logits, [stage])
        for got, want in zip(logits[0].tolist(), expected, strict=True):
            self.assertLess(abs(got - want), 1e-6 * max(1.0, abs(want)), (got, want))


# --------------------------------------------------------------------------------------------
# The mock engine


class MockEngineTests(unittest.SynchronousTestCase):
    """The mock engine honours constraints through the same stage (protocol tests use it)."""

    def run_mock(self, request: GenerationRequest, vocab_size: int = TINY_VOCAB) -> Any:
        clock = Clock()
        engine = MockEngine(clock, vocab_size=vocab_size, vocabulary=vocabulary())
        engine.start()
        generation = engine.submit(request, lambda tokens, logprobs=None: None)
        results: list[Any] = []
        generation.result.addBoth(results.append)
        for _ in range(request.max_new + 2):
            clock.advance(0)
        self.assertEqual(len(results), 1)
        return results[0]

    def test_constrained_output_follows_its_grammar(self) -> None:
        """A json_schema and a required tool call: the mock's output parses and validates,
        and it ends with the vocabulary's EOS where the grammar ends."""
        prompt = [100 + i for i in range(8)]
        result = self.run_mock(
            GenerationRequest(prompt, GenParams(), 80, constraint=Constraint(8, NESTED_GRAMMAR))
        )
        self.assertEqual(result.stop, EngineStop.EOS)
        text = vocabulary().decode(list(result.tokens[:-1]))
        jsonschema.validate(json.loads(text), NESTED)
        grammar = tools_grammar(ONE_TOOL, "required", False)
        result = self.run_mock(
            GenerationRequest(prompt, GenParams(), 80, constraint=Constraint(8, grammar))
        )
        text = vocabulary().decode(list(result.tokens[:-1]))
        self.assertIn(text, ONE_TOOL_LANGUAGE)

    def test_a_bias_of_minus_100_removes_the_greedy_token(self) -> None:
        """With -100 on the mock's greedy token the first token is its second candidate."""
        prompt = [100 + i for i in range(8)]
        greedy = mock_next_token(prompt, TINY_VOCAB)
        controls = SamplerControls(((greedy, -100.0),))
        result = self.run_mock(
            GenerationRequest(prompt, GenParams(), 1, constraint=Constraint(8, None, controls))
        )
        self.assertEqual(result.tokens[0], mock_logits(prompt, TINY_VOCAB)[1][0])

    def test_a_refused_constraint_is_an_engine_refusal(self) -> None:
        """Delivered tokens the grammar refuses: the generation fails with EngineRefusal."""
        request = GenerationRequest(
            [100, 101, 102], GenParams(), 5, constraint=Constraint(1, NESTED_GRAMMAR)
        )
        failure = self.run_mock(request)
        self.assertIsInstance(failure.value, EngineRefusal)

    def test_staged_logits_keep_only_allowed_tokens(self) -> None:
        """mock_staged_logits lists only ids the grammar allows, the mock's own candidates
        first when any is allowed."""
        vocab = vocabulary()
        stage = LaneStage.prepare(vocab, Constraint(0, NESTED_GRAMMAR), [])
        assert stage.matcher is not None
        allowed = set(stage.matcher.allowed().tolist())
        logits = mock_staged_logits([5, 6, 7], stage, TINY_VOCAB)
        self.assertTrue(logits)
        self.assertTrue({t for t, _ in logits} <= allowed)


NESTED_GRAMMAR = schema_grammar(NESTED)


# --------------------------------------------------------------------------------------------
# The transformers engine on the tiny Llama


class Collect:
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def __call__(self, tokens: Sequence[int], logprobs: Any = None) -> None:
        self.tokens.extend(tokens)


class TransformersEngineTests(unittest.TestCase):
    """The tiny Llama's engine honours constraints in every weights mode."""

    timeout = 300

    def make_engine(self, **kwargs: Any) -> TransformersEngine:
        kwargs.setdefault("interactive_lanes", 0)
        kwargs.setdefault("max_lanes", 4)
        engine = TransformersEngine(
            tiny_model(),
            reactor,
            EngineConfig(prefix_cache=False, **kwargs),
            tokenizer=_tokenizer(),
        )
        engine.start()
        self.addCleanup(engine.stop)
        return engine

    def submit(self, engine: TransformersEngine, request: GenerationRequest) -> Any:
        sink = Collect()
        generation = engine.submit(request, sink)
        return generation.result

    @defer.inlineCallbacks
    def test_every_weights_mode_writes_valid_json(self) -> Any:
        """float32, bfloat16, int8, int4 and the model's own forward: a json_schema answer
        parses and validates, greedy and sampled."""
        prompt = _tokenizer().encode("the quick brown fox")
        engines = [self.make_engine(weights=mode) for mode in ("float32", "bfloat16", "int8")]
        engines.append(self.make_engine(weights="int4"))
        engines.append(self.make_engine(lean_step=False, onednn=False))
        for engine in engines:
            self.assertTrue(engine.supports_constraints)
            for params in (GenParams(), GenParams(temperature=1.0, seed=5)):
                request = GenerationRequest(
                    prompt, params, 120, constraint=Constraint(len(prompt), NESTED_GRAMMAR)
                )
                result: GenerationResult = yield self.submit(engine, request)
                self.assertEqual(result.stop, EngineStop.EOS, engine.weights.mode)
                text = vocabulary().decode(list(result.tokens[:-1]))
                jsonschema.validate(json.loads(text), NESTED)

    @defer.inlineCallbacks
    def test_constrained_greedy_alone_equals_batched(self) -> Any:
        """Four constrained generations (greedy and seeded, two grammars) beside four
        unconstrained ones give each exactly its solo tokens."""
        engine = self.make_engine(weights="float32")
        prompts = [_tokenizer().encode(text) for text in _PROMPTS]
        grammars: list[Any] = [NESTED_GRAMMAR, tools_grammar(ONE_TOOL, "auto", True)]
        requests = []
        for i, prompt in enumerate(prompts):
            params = GenParams() if i % 2 == 0 else GenParams(temperature=0.8, seed=11 + i)
            constraint = Constraint(len(prompt), grammars[i % 2]) if i < 4 else None
            requests.append(GenerationRequest(prompt, params, 40, constraint=constraint))
        solo = []
        for request in requests:
            solo.append((yield self.submit(engine, request)).tokens)
        batched = yield defer.gatherResults([self.submit(engine, r) for r in requests])
        self.assertEqual([list(r.tokens) for r in batched], [list(t) for t in solo])

    @defer.inlineCallbacks
    def test_a_continuation_replays_the_delivered_tokens(self) -> Any:
        """Context = prompt + the first k tokens of a constrained run, generated_from = the
        prompt's end: the engine continues with exactly the rest of that run (what a node
        taking over a stream does)."""
        engine = self.make_engine(weights="float32")
        prompt = _tokenizer().encode(_PROMPTS[0])
        controls = SamplerControls(presence_penalty=0.5, repetition_penalty=1.2)
        constraint = Constraint(len(prompt), NESTED_GRAMMAR, controls)
        params = GenParams(temperature=0.9, seed=3)
        whole = yield self.submit(
            engine, GenerationRequest(prompt, params, 60, constraint=constraint)
        )
        tokens = list(whole.tokens)
        for k in (1, 5, len(tokens) // 2):
            rest = yield self.submit(
                engine,
                GenerationRequest(prompt + tokens[:k], params, 60 - k, constraint=constraint),
            )
            self.assertEqual(tokens[:k] + list(rest.tokens), tokens, k)

    @defer.inlineCallbacks
    def test_a_bias_of_minus_100_removes_the_greedy_token(self) -> Any:
        """The first greedy token with -100 on it is the model's second best token."""
        engine = self.make_engine(weights="float32")
        prompt = _tokenizer().encode(_PROMPTS[1])
        with torch.inference_mode():
            logits = tiny_model()(torch.tensor([prompt])).logits[0, -1]
        best, second = torch.topk(logits, 2).indices.tolist()
        plain = yield self.submit(engine, GenerationRequest(prompt, GenParams(), 1))
        self.assertEqual(plain.tokens[0], best)
        controls = SamplerControls(((best, -100.0),))
        biased = yield self.submit(
            engine,
            GenerationRequest(
                prompt, GenParams(), 1, constraint=Constraint(len(prompt), None, controls)
            ),
        )
        self.assertEqual(biased.tokens[0], second)

    @defer.inlineCallbacks
    def test_penalties_give_the_tokens_their_formulas_predict(self) -> Any:
        """Greedy with presence and frequency penalties, and with llama.cpp's repetition
        penalty: the tokens of a step-by-step reference that applies the formulas to the
        model's own logits (and not the plain greedy tokens)."""
        engine = self.make_engine(weights="float32")
        prompt = _tokenizer().encode(_PROMPTS[2])
        plain = yield self.submit(engine, GenerationRequest(prompt, GenParams(), 24))
        for controls in (
            SamplerControls(presence_penalty=1.5, frequency_penalty=0.5),
            SamplerControls(repetition_penalty=3.0, repetition_window=16),
        ):
            expected = _reference_penalised(prompt, controls, 24)
            got = yield self.submit(
                engine,
                GenerationRequest(
                    prompt, GenParams(), 24, constraint=Constraint(len(prompt), None, controls)
                ),
            )
            self.assertEqual(list(got.tokens), expected)
            self.assertNotEqual(expected, list(plain.tokens))

    @defer.inlineCallbacks
    def test_an_unusable_constraint_is_refused(self) -> Any:
        """A grammar that does not compile on the node, or delivered tokens it refuses, fail
        the generation with EngineRefusal before any token."""
        engine = self.make_engine(weights="float32")
        prompt = [10, 11, 12]
        for constraint in (
            Constraint(3, JsonSchemaGrammar('{"type": "string", "pattern": "(?=x)"}')),
            Constraint(1, NESTED_GRAMMAR),
        ):
            sink = Collect()
            generation = engine.submit(
                GenerationRequest(prompt, GenParams(), 5, constraint=constraint), sink
            )
            yield self.assertFailure(generation.result, EngineRefusal)
            self.assertEqual(sink.tokens, [])

    @defer.inlineCallbacks
    def test_drafts_through_the_masks_and_penalties_change_nothing(self) -> Any:
        """With speculative decoding (docs/engine.md section 3.1) constrained lanes verify
        their drafts through their grammar's masks and their penalties and biases: greedy and
        seeded, two grammars and sampler controls, alone and batched, the tokens are those of
        decoding without drafts, and drafted tokens were accepted and refused."""
        from tests.test_engine import draft_from_answers

        plain = self.make_engine(weights="float32")
        drafting = self.make_engine(weights="float32", speculative="ngram")
        prompts = [_tokenizer().encode(text) for text in _PROMPTS]
        grammars: list[Any] = [NESTED_GRAMMAR, tools_grammar(ONE_TOOL, "auto", True), None]
        controls = SamplerControls(
            ((5, 2.0), (7, -3.0)), presence_penalty=0.5, repetition_penalty=1.2
        )
        requests = []
        for i, prompt in enumerate(prompts):
            params = GenParams() if i % 2 == 0 else GenParams(temperature=0.8, seed=11 + i)
            constraint = Constraint(len(prompt), grammars[i % 3], controls if i % 4 < 2 else None)
            requests.append(GenerationRequest(prompt, params, 40, constraint=constraint))
        expected = []
        for request in requests:
            expected.append(list((yield self.submit(plain, request)).tokens))
        answers = {tuple(r.context): tokens for r, tokens in zip(requests, expected, strict=True)}
        del answers[tuple(requests[-1].context)]  # the last one drafts by lookup
        draft_from_answers(drafting, answers)
        solo = []
        for request in requests:
            solo.append(list((yield self.submit(drafting, request)).tokens))
        self.assertEqual(solo, expected)
        batched = yield defer.gatherResults([self.submit(drafting, r) for r in requests])
        self.assertEqual([list(r.tokens) for r in batched], expected)
        counts = drafting.statistics().steps
        self.assertGreater(counts.accepted, 0)
        self.assertGreater(counts.drafted, counts.accepted)

    def test_masks_are_counted(self) -> None:
        """An engine without a tokenizer does not support constraints; with one it counts the
        masks it computes."""
        engine = TransformersEngine(tiny_model(), reactor, EngineConfig(max_lanes=1))
        self.assertFalse(engine.supports_constraints)
        self.assertIsNone(engine.statistics().masks)


_PROMPTS = [
    "the quick brown fox",
    "a node agent serves",
    "tokens stream back in order",
    "hello world",
    "lanes decode together",
    "the lazy dog",
    "a fleet head",
    "kv cache blocks",
]


def _tokenizer() -> Any:
    vocabulary()
    return _CACHE["tokenizer"]


def _reference_penalised(prompt: list[int], controls: SamplerControls, count: int) -> list[int]:
    """Greedy decoding on the tiny model's full forward, with the penalties of docs/engine.md
    section 2.4 written out here."""
    context, out = list(prompt), []
    for _ in range(count):
        with torch.inference_mode():
            logits = tiny_model()(torch.tensor([context])).logits[0, -1].tolist()
        generated = context[len(prompt) :]
        window = (
            set(context[-controls.repetition_window :]) if controls.repetition_window else set()
        )
        r = controls.repetition_penalty
        for token in range(len(logits)):
            value = logits[token]
            if r not in (0.0, 1.0) and token in window:
                value = value * r if value <= 0 else value / r
            c = generated.count(token)
            if c:
                value -= c * controls.frequency_penalty + controls.presence_penalty
            logits[token] = value
        token = max(range(len(logits)), key=lambda t: (logits[t], -t))
        out.append(token)
        context.append(token)
        if token == TINY_EOS:
            break
    return out
