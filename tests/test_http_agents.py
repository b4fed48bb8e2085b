"""What agent frameworks ask of the head's HTTP API (issue 21): ``response_format``, ``tools`` /
``tool_choice`` / ``parallel_tool_calls`` and the sampler's controls (``logit_bias`` and the
penalties) on chat and completions, driven with the official ``openai`` package over real TCP.

Mock-engine nodes built with the tiny test vocabulary stand behind the head, so they honour
constraints (docs/protocol.md section 12.3) with the same matcher as the transformers engine;
each answer is compared with the engine's own run of the same constrained request (its raw
text read back whole with the head's call splitter, ``tests.test_head_tools.read_calls``, whose
own tests pin it on literal outputs), so a test pins exactly what the API shows.  The bundled
model's targets are in tests/test_agents_http_smollm2.py.  No sleeps: every wait is a Deferred.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Sequence
from typing import Any, Literal

import jsonschema
from twisted.internet import defer, reactor, threads

from sfnode.decoding.constraint import (
    CALL_OPEN,
    response_format_grammar,
    sampler_controls,
    tools_grammar,
)
from sfnode.engines.mock import MockEngine
from sfnode.generation import GenerationRequest
from sfnode.head.models.chat import ChatMessage, ChatToolCall
from sfnode.head.models.text import Renderer
from sfnode.linkf.wire import Constraint, GenParams, Grammar, SamplerControls
from tests.clients import openai_client
from tests.test_constraint import NESTED, vocabulary
from tests.test_head_tools import read_calls
from tests.test_http import MODEL, Head, HttpTestCase, expected_tokens, tokenizer
from tests.tinymodel import TINY_VOCAB

Gen = Generator[defer.Deferred[Any], Any, None]
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "jump",
            "description": "Jump over something.",
            "parameters": {
                "type": "object",
                "properties": {"over": {"enum": ["fox", "dog"]}},
                "required": ["over"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "count",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def constrained_engine(**kwargs: Any) -> MockEngine:
    """A mock engine over the tiny test vocabulary that honours constraints."""
    return MockEngine(reactor, vocab_size=TINY_VOCAB, vocabulary=vocabulary(), **kwargs)


class AgentsTestCase(HttpTestCase):
    @defer.inlineCallbacks
    def agents_head(self, **api: Any) -> Generator[defer.Deferred[Any], Any, tuple[Head, Any]]:
        """A head over one constraint-honouring mock node (``self.node``), and an ``openai``
        client for it."""
        node = yield self.start_vocab_node(engine=constrained_engine())
        head = yield self.start_head([node], **api)
        client = openai_client(self, head.base + "/v1")
        self.node = node
        return head, client

    def in_thread(self, call: Callable[[], Any]) -> defer.Deferred[Any]:
        """The openai client is blocking: run it off the reactor."""
        return threads.deferToThread(call)

    @defer.inlineCallbacks
    def reference(
        self,
        prompt: Sequence[int],
        grammar: Grammar | None,
        controls: SamplerControls | None = None,
        max_new: int = 200,
    ) -> Generator[defer.Deferred[Any], Any, str]:
        """The text of the engine's own greedy run of ``prompt`` under the constraint (what
        the node must generate for the head)."""
        request = GenerationRequest(
            list(prompt),
            GenParams(temperature=0.0, seed=7),
            max_new,
            constraint=Constraint(len(prompt), grammar, controls),
        )
        engine = constrained_engine()
        engine.start()
        result = yield engine.submit(request, lambda *_: None).result
        return str(tokenizer().decode(list(result.tokens), skip_special_tokens=True))

    def chat_prompt(self, messages: Sequence[dict[str, Any]], tools: Any = ()) -> list[int]:
        return Renderer(tokenizer()).chat(
            [ChatMessage(m["role"], m["content"]) for m in messages], tools=tools
        )


class ResponseFormatTests(AgentsTestCase):
    @defer.inlineCallbacks
    def test_json_object_and_json_schema_answers_parse_and_validate(self) -> Gen:
        """``json_object`` and ``json_schema`` answers are exactly the engine's constrained
        runs (the mock's ``json_object`` run is one long string: it starts an object and is
        cut by max_tokens; the schema's run ends and validates), on chat and on
        completions."""
        _, client = yield self.agents_head()
        prompt = self.chat_prompt(MESSAGES)
        for response_format in (
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "n", "schema": NESTED, "strict": True}},
        ):
            answer = yield self.in_thread(
                lambda rf=response_format: client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                    response_format=rf,
                )
            )  # fmt: skip
            text = answer.choices[0].message.content
            expected = yield self.reference(prompt, response_format_grammar(response_format))
            self.assertEqual(text, expected)
            self.assertTrue(text.startswith('{"'))
            if response_format["type"] == "json_schema":
                self.assertEqual(answer.choices[0].finish_reason, "stop")
                jsonschema.validate(json.loads(text), NESTED)
        completion = yield self.in_thread(
            lambda: client.completions.create(
                model=MODEL, prompt="the fox", max_tokens=200, temperature=0,
                extra_body={"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "n", "schema": NESTED}}},
            )
        )  # fmt: skip
        jsonschema.validate(json.loads(completion.choices[0].text), NESTED)

    @defer.inlineCallbacks
    def test_the_openai_packages_parse_gets_a_typed_answer(self) -> Gen:
        """``client.beta.chat.completions.parse`` with a pydantic model: the answer parses
        into the model (the schema openai derives from it is enforced)."""
        import pydantic

        class Pick(pydantic.BaseModel):
            animal: Literal["fox", "dog"]
            legs: int = pydantic.Field(ge=0, le=9)

        _, client = yield self.agents_head()

        def parse() -> Any:
            return client.chat.completions.parse(
                model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                response_format=Pick,
            )  # fmt: skip

        answer = yield self.in_thread(parse)
        self.assertIsInstance(answer.choices[0].message.parsed, Pick)

    @defer.inlineCallbacks
    def test_a_schema_that_cannot_be_enforced_is_a_json_400_before_any_node_is_asked(
        self,
    ) -> Gen:
        """A ``json_schema`` without a schema, one with a look-around pattern the grammar
        library cannot enforce, and ``response_format`` with tools that may be called are
        each a 400 in OpenAI's JSON shape naming ``response_format``; no node generated."""
        head, _ = yield self.agents_head()
        bad = [
            ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
            (
                {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}},
                },
                "cannot be enforced",
            ),
            ({"type": "yaml"}, "response_format.type"),
        ]
        for response_format, reason in bad:
            code, content = yield self.call(
                head,
                b"POST",
                "/v1/chat/completions",
                {"model": MODEL, "messages": MESSAGES, "response_format": response_format},
            )
            self.assertEqual(code, 400)
            error = json.loads(content)["error"]
            self.assertEqual(
                (error["type"], error["param"]), ("invalid_request_error", "response_format")
            )
            self.assertIn(reason, error["message"])
        code, content = yield self.call(
            head,
            b"POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
             "response_format": {"type": "json_object"}},
        )  # fmt: skip
        self.assertEqual((code, json.loads(content)["error"]["param"]), (400, "response_format"))
        self.assertEqual(self.node.engine.statistics().decoded_tokens, 0)

    @defer.inlineCallbacks
    def test_no_node_with_constraints_is_a_400_at_once(self) -> Gen:
        """Every node serving the model handshook without constraints: ``response_format`` is
        answered 400 ``unsupported_parameter`` at once; the same request without it is served."""
        node = yield self.start_vocab_node()
        head = yield self.start_head([node])
        body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3}
        code, content = yield self.call(
            head, b"POST", "/v1/chat/completions",
            {**body, "response_format": {"type": "json_object"}},
        )  # fmt: skip
        self.assertEqual(code, 400)
        error = json.loads(content)["error"]
        self.assertEqual(error["code"], "unsupported_parameter")
        self.assertIn("honours constraints", error["message"])
        code, _ = yield self.call(head, b"POST", "/v1/chat/completions", body)
        self.assertEqual(code, 200)


class ToolTests(AgentsTestCase):
    @defer.inlineCallbacks
    def create(self, client: Any, **kwargs: Any) -> Generator[defer.Deferred[Any], Any, Any]:
        arguments = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0}
        arguments.update(kwargs)
        answer = yield self.in_thread(lambda: client.chat.completions.create(**arguments))
        return answer

    @defer.inlineCallbacks
    def expected(
        self, tool_choice: Any, parallel: bool | None = None, max_new: int = 200
    ) -> Generator[defer.Deferred[Any], Any, tuple[str, list[Any]]]:
        """The content and calls of the engine's run under the tools' grammar."""
        text = yield self.reference(
            self.chat_prompt(MESSAGES, TOOLS),
            tools_grammar(TOOLS, tool_choice, parallel),
            max_new=max_new,
        )
        return read_calls(text)

    def assert_calls(self, message: Any, expected: list[Any]) -> None:
        self.assertEqual(
            [(c.function.name, c.function.arguments) for c in message.tool_calls],
            expected,
        )
        for call in message.tool_calls:
            self.assertEqual(call.type, "function")
            self.assertTrue(call.id.startswith("call_"))
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        self.assertEqual(len({c.id for c in message.tool_calls}), len(message.tool_calls))

    @defer.inlineCallbacks
    def test_required_and_named_answer_tool_calls(self) -> Gen:
        """``tool_choice`` ``required`` and a named function: ``message.tool_calls`` holds the
        run's calls (declared functions, the named one when named, arguments as a JSON string
        that validates), ``content`` null and ``finish_reason`` ``tool_calls``."""
        _, client = yield self.agents_head()
        for choice in ("required", {"type": "function", "function": {"name": "count"}}):
            answer = yield self.create(client, tools=TOOLS, tool_choice=choice)
            _, calls = yield self.expected(choice)
            message = answer.choices[0].message
            self.assertTrue(calls)
            self.assert_calls(message, calls)
            self.assertIsNone(message.content)
            self.assertEqual(answer.choices[0].finish_reason, "tool_calls")
            if isinstance(choice, dict):
                self.assertEqual({c.function.name for c in message.tool_calls}, {"count"})

    @defer.inlineCallbacks
    def test_parallel_tool_calls_false_allows_one_call(self) -> Gen:
        """``parallel_tool_calls: false`` with ``required``: exactly one call (the grammar
        allows no second)."""
        _, client = yield self.agents_head()
        answer = yield self.create(
            client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
        )
        _, calls = yield self.expected("required", False)
        self.assertEqual(len(answer.choices[0].message.tool_calls), 1)
        self.assert_calls(answer.choices[0].message, calls)

    @defer.inlineCallbacks
    def test_none_and_auto_answer_what_the_run_wrote(self) -> Gen:
        """``none`` answers text that never opens a call; ``auto`` answers the run's text as
        content and its calls (if it made any) as tool_calls, the tags never shown."""
        _, client = yield self.agents_head()
        answer = yield self.create(client, tools=TOOLS, tool_choice="none", max_tokens=30)
        content, calls = yield self.expected("none", max_new=30)
        message = answer.choices[0].message
        self.assertEqual((message.content, message.tool_calls), (content, None))
        self.assertNotIn(CALL_OPEN, message.content)
        answer = yield self.create(client, tools=TOOLS, max_tokens=200)
        content, calls = yield self.expected("auto")
        message = answer.choices[0].message
        self.assertEqual(message.content or "", content)
        if calls:
            self.assert_calls(message, calls)
        self.assertNotIn(CALL_OPEN, message.content or "")

    @defer.inlineCallbacks
    def test_streamed_calls_open_then_carry_argument_fragments(self) -> Gen:
        """Streamed, each call opens with ``index``, ``id``, ``type`` and ``function.name``,
        then ``arguments`` fragments on the same index that concatenate to the non-streamed
        arguments; no content delta carries a tag; the last chunk says ``tool_calls``."""
        _, client = yield self.agents_head()
        plain = yield self.create(client, tools=TOOLS, tool_choice="required")

        def streamed() -> list[Any]:
            return list(
                client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                    tools=TOOLS, tool_choice="required", stream=True,  # type: ignore[arg-type]
                )
            )  # fmt: skip

        chunks = yield self.in_thread(streamed)
        calls: dict[int, dict[str, Any]] = {}
        fragments = 0
        for chunk in chunks:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            self.assertNotIn("<tool", delta.content or "")
            for entry in delta.tool_calls or []:
                if entry.id is not None:
                    self.assertNotIn(entry.index, calls)
                    self.assertEqual(entry.type, "function")
                    calls[entry.index] = {"id": entry.id, "name": entry.function.name, "args": ""}
                else:
                    self.assertIsNone(entry.function.name)
                    fragments += 1
                calls[entry.index]["args"] += entry.function.arguments or ""
        self.assertEqual(chunks[-1].choices[0].finish_reason, "tool_calls")
        expected = plain.choices[0].message.tool_calls
        self.assertEqual(
            [(calls[i]["name"], calls[i]["args"]) for i in sorted(calls)],
            [(c.function.name, c.function.arguments) for c in expected],
        )
        self.assertGreater(fragments, len(calls))

    @defer.inlineCallbacks
    def test_tool_choice_errors_are_400s(self) -> Gen:
        """An undeclared function named in ``tool_choice``, ``tool_choice`` without tools, and
        a tool that is not a function are 400s naming the field."""
        head, _ = yield self.agents_head()
        cases = [
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
             "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [{"type": "code_interpreter"}]}, "tools"),
        ]  # fmt: skip
        for extra, param in cases:
            body = {"model": MODEL, "messages": MESSAGES, **extra}
            code, content = yield self.call(head, b"POST", "/v1/chat/completions", body)
            self.assertEqual((code, json.loads(content)["error"]["param"]), (400, param), extra)

    @defer.inlineCallbacks
    def test_a_round_trip_with_tool_history(self) -> Gen:
        """The answer's call and a ``role: "tool"`` result sent back: the head renders the
        history (generic rendering: the call as the grammar writes it, the result as a
        tool_response turn) and answers; the prompt the node got is that rendering."""
        _, client = yield self.agents_head()
        first = yield self.create(client, tools=TOOLS, tool_choice="required")
        call = first.choices[0].message.tool_calls[0]
        history = [
            *MESSAGES,
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": call.id, "type": "function",
                             "function": {"name": call.function.name,
                                          "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "landed"},
        ]  # fmt: skip
        second = yield self.create(client, messages=history, tools=TOOLS, max_tokens=5)
        self.assertEqual(second.choices[0].finish_reason, "length")
        messages = [
            ChatMessage("user", MESSAGES[0]["content"]),
            ChatMessage(
                "assistant",
                "",
                (ChatToolCall(call.id, call.function.name, call.function.arguments),),
            ),
            ChatMessage("tool", "landed", (), call.id),
        ]
        prompt = Renderer(tokenizer()).chat(messages, tools=TOOLS)
        text = str(tokenizer().decode(prompt))
        self.assertIn(
            f'<tool_call>{{"name": "{call.function.name}", "arguments": '
            f"{call.function.arguments}}}</tool_call>",
            text,
        )
        self.assertIn("<tool_response>\nlanded\n</tool_response>", text)
        self.assertEqual(second.usage.prompt_tokens, len(prompt))


class SamplerControlTests(AgentsTestCase):
    @defer.inlineCallbacks
    def greedy(self, client: Any, **extra: Any) -> Generator[defer.Deferred[Any], Any, Any]:
        answer = yield self.in_thread(
            lambda: client.completions.create(
                model=MODEL, prompt=[5, 6, 7, 8], max_tokens=40, temperature=0, logprobs=0,
                **extra,
            )
        )  # fmt: skip
        return answer.choices[0]

    @defer.inlineCallbacks
    def test_a_bias_of_minus_100_removes_the_greedy_token(self) -> Gen:
        """The greedy first token, biased -100 through ``logit_bias``, is never drawn; the
        answer is then the engine's run with that bias."""
        _, client = yield self.agents_head()
        plain = yield self.greedy(client)
        first = expected_tokens([5, 6, 7, 8], 1)[0]
        self.assertTrue(plain.text.startswith(tokenizer().decode([first])))
        biased = yield self.greedy(client, logit_bias={str(first): -100})
        controls = sampler_controls(logit_bias={str(first): -100})
        expected = yield self.reference([5, 6, 7, 8], None, controls, max_new=40)
        self.assertEqual(biased.text, expected)
        self.assertNotEqual(biased.logprobs.tokens[0], plain.logprobs.tokens[0])

    @defer.inlineCallbacks
    def test_penalties_change_the_answer_as_the_engine_applies_them(self) -> Gen:
        """``presence_penalty``, ``frequency_penalty`` and ``repetition_penalty`` each give
        the engine's penalised run; the first two differ from the plain one (the mock's greedy
        run repeats a token at its 30th; its best logit is 0, which a repetition penalty,
        a factor, leaves alone)."""
        _, client = yield self.agents_head()
        plain = yield self.greedy(client)
        for name, value in (
            ("presence_penalty", 2.0),
            ("frequency_penalty", 2.0),
            ("repetition_penalty", 3.0),
        ):
            extra: dict[str, Any] = (
                {name: value} if name != "repetition_penalty" else {"extra_body": {name: value}}
            )
            answer = yield self.greedy(client, **extra)
            expected = yield self.reference(
                [5, 6, 7, 8], None, sampler_controls(**{name: value}), max_new=40
            )
            self.assertEqual(answer.text, expected, name)
            if name != "repetition_penalty":
                self.assertNotEqual(answer.text, plain.text, name)

    @defer.inlineCallbacks
    def test_out_of_range_controls_are_400s(self) -> Gen:
        """A bias outside -100..100, a token id past the vocabulary, a penalty outside -2..2
        and a repetition_penalty outside 0..10 are 400s naming the field."""
        head, _ = yield self.agents_head()
        cases = [
            ({"logit_bias": {"5": 101}}, "logit_bias"),
            ({"logit_bias": {str(TINY_VOCAB): 1}}, "logit_bias"),
            ({"logit_bias": {"fox": 1}}, "logit_bias"),
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"frequency_penalty": "high"}, "frequency_penalty"),
            ({"repetition_penalty": 11}, "repetition_penalty"),
        ]
        for extra, param in cases:
            code, content = yield self.call(
                head, b"POST", "/v1/completions", {"model": MODEL, "prompt": "a", **extra}
            )
            self.assertEqual((code, json.loads(content)["error"]["param"]), (400, param), extra)
