"""The head's OpenAI request schema (sfnode.head.api.schema), alone: pure functions, no reactor.

Every case states what a client sends and what it must get back: a checked request, or an
HttpError whose status, message and ``param`` say what was wrong.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.api.schema import (
    MAX_JSON_DEPTH,
    MAX_N,
    UNSUPPORTED,
    choice_seed,
    parse_body,
    parse_request,
)
from sfnode.head.models.chat import ChatMessage
from sfnode.runtime.http_guard import ECHO_LIMIT, HttpError

MODEL = "m"
MESSAGES = [{"role": "user", "content": "hi"}]
VOCAB = 1000


def chat(**fields: Any) -> Any:
    return parse_request(
        {"model": MODEL, "messages": MESSAGES, **fields},
        chat=True,
        models=[MODEL],
        vocab_size=VOCAB,
        seed_source=lambda: 7,
    )


def completion(**fields: Any) -> Any:
    return parse_request(
        {"model": MODEL, **fields},
        chat=False,
        models=[MODEL],
        vocab_size=VOCAB,
        seed_source=lambda: 7,
    )


class SchemaTestCase(SynchronousTestCase):
    def refused(self, parse: Any, **fields: Any) -> HttpError:
        """The HttpError that parsing ``fields`` raises (the test fails if none is)."""
        with self.assertRaises(HttpError) as raised:
            parse(**fields)
        return raised.exception


class BodyTests(SchemaTestCase):
    def test_a_body_must_be_one_json_object(self) -> None:
        """Empty, non-JSON, non-UTF-8 and non-object bodies are 400s that say so."""
        for data, words in [
            (b"", "empty"),
            (b"   ", "empty"),
            (b"{not json", "not valid JSON"),
            (b'"text"', "JSON object"),
            (b"[1, 2]", "JSON object"),
            (b'{"a": "\xff"}', "not UTF-8"),
        ]:
            with self.assertRaises(HttpError) as raised:
                parse_body(data)
            self.assertEqual(raised.exception.status, 400, data)
            self.assertIn(words, raised.exception.message)

    def test_deep_nesting_is_a_400_not_a_recursion_error(self) -> None:
        """JSON nested a thousand (or a hundred thousand) levels deep, which makes Python's
        parser raise RecursionError, is a 400 about nesting; so is anything past the limit;
        the limit itself parses."""
        for depth in (1000, 100_000, MAX_JSON_DEPTH + 1):
            data = b'{"a": ' + b"[" * depth + b"]" * depth + b"}"
            with self.assertRaises(HttpError) as raised:
                parse_body(data)
            self.assertIn("nested", raised.exception.message)
        ok = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
        self.assertEqual(set(parse_body(ok)), {"a"})


class FieldTests(SchemaTestCase):
    def test_n_asks_for_that_many_choices(self) -> None:
        """n from 1 to MAX_N is taken; 0, MAX_N + 1, a string and a boolean are 400s that give
        the bounds and name n."""
        self.assertEqual(chat().n, 1)
        self.assertEqual(chat(n=3).n, 3)
        self.assertEqual(chat(n=MAX_N).n, MAX_N)
        for bad in (0, MAX_N + 1, "2", True):
            error = self.refused(chat, n=bad)
            self.assertEqual(error.param, "n")
        self.assertEqual(self.refused(chat, n=0).message, f"n must be between 1 and {MAX_N}")

    def test_each_choice_has_its_own_seed_derived_from_the_requests(self) -> None:
        """Choice 0 uses the request's seed; the others get distinct seeds that depend only on
        the request's seed and the index; negative seeds are taken modulo 2**64."""
        request = chat(n=4, seed=42, temperature=1)
        seeds = [request.choice_params(i).seed for i in range(4)]
        self.assertEqual(seeds[0], 42)
        self.assertEqual(len(set(seeds)), 4)
        self.assertEqual(seeds, [choice_seed(42, i) for i in range(4)])
        self.assertEqual(seeds, [chat(n=4, seed=42).choice_params(i).seed for i in range(4)])
        self.assertNotEqual(choice_seed(43, 1), seeds[1])
        self.assertEqual(chat(seed=-1).params.seed, (1 << 64) - 1)
        self.assertEqual(chat().params.seed, 7)  # from the seed source

    def test_unsupported_parameters_are_refused_by_name(self) -> None:
        """Every parameter the fleet does not honour, given a value that asks for something,
        is a 400 with code unsupported_parameter naming it."""
        asking: dict[str, Any] = {
            "functions": [{"name": "f"}],
            "function_call": "auto",
            "echo": True,
            "best_of": 3,
            "suffix": "end",
            "modalities": ["text", "audio"],
            "audio": {"voice": "x"},
            "prediction": {"type": "content", "content": "x"},
            "reasoning_effort": "high",
            "verbosity": "low",
            "web_search_options": {},
        }
        self.assertEqual(set(asking), set(UNSUPPORTED))
        for name, value in asking.items():
            parse = completion if name in ("echo", "suffix", "best_of") else chat
            extra = {"prompt": "hi"} if parse is completion else {}
            error = self.refused(parse, **extra, **{name: value})
            self.assertEqual(
                (error.status, error.param, error.code), (400, name, "unsupported_parameter")
            )
            self.assertIn(name, error.message)

    def test_neutral_values_of_unsupported_parameters_are_accepted(self) -> None:
        """A client that sends the neutral value (logprobs false, penalties 0, tool_choice
        none, response_format text, best_of 1 or n, ...) asks for nothing it would not get."""
        chat(
            logprobs=False, top_logprobs=0, logit_bias={}, tools=[], tool_choice="none",
            response_format={"type": "text"}, presence_penalty=0, frequency_penalty=0.0,
            modalities=["text"], audio=None, user="u", metadata={"a": "b"}, store=False,
            parallel_tool_calls=True, service_tier="auto",
        )  # fmt: skip
        completion(prompt="hi", echo=False, best_of=1, suffix="", logprobs=None)
        self.assertEqual(completion(prompt="hi", n=2, best_of=2).n, 2)
        self.assertEqual(self.refused(chat, logprobs=0).param, "logprobs")  # 0 is not false

    def test_logprobs_are_asked_within_openais_bounds(self) -> None:
        """Chat: logprobs true with top_logprobs from 0 to 20 asks for that many alternatives
        (GenParams.logprobs one more); logprobs false or absent asks for none; top_logprobs
        without logprobs true, past 20 or not an integer is a 400 naming it.  Completions:
        logprobs from 0 to 5 (as OpenAI), null or absent for none; 6, true or a string is a
        400 naming logprobs."""
        self.assertEqual((chat().logprobs, chat().params.logprobs), (None, 0))
        self.assertEqual((chat(logprobs=False).logprobs, chat(logprobs=False).params.logprobs),
                         (None, 0))  # fmt: skip
        asked = chat(logprobs=True)
        self.assertEqual((asked.logprobs, asked.params.logprobs), (0, 1))
        for top in (0, 3, 20):
            asked = chat(logprobs=True, top_logprobs=top)
            self.assertEqual((asked.logprobs, asked.params.logprobs), (top, top + 1))
            self.assertEqual(asked.choice_params(2).logprobs, top + 1)
        for bad in (21, -1, "3", 1.5):
            error = self.refused(chat, logprobs=True, top_logprobs=bad)
            self.assertEqual((error.status, error.param), (400, "top_logprobs"))
        error = self.refused(chat, top_logprobs=3)
        self.assertEqual(error.param, "top_logprobs")
        self.assertIn("logprobs: true", error.message)
        self.assertEqual(self.refused(chat, logprobs="yes").param, "logprobs")
        for count in (0, 5):
            asked = completion(prompt="hi", logprobs=count)
            self.assertEqual((asked.logprobs, asked.params.logprobs), (count, count + 1))
        self.assertIsNone(completion(prompt="hi").logprobs)
        for bad in (6, -1, True, "2"):
            error = self.refused(completion, prompt="hi", logprobs=bad)
            self.assertEqual((error.status, error.param), (400, "logprobs"))
            self.assertIn("from 0 to 5", error.message)
        self.assertEqual(self.refused(completion, prompt="hi", top_logprobs=2).param,
                         "top_logprobs")  # fmt: skip

    def test_unknown_fields_are_refused_as_openai_does(self) -> None:
        """An unknown field is a 400 "Unrecognized request argument supplied" naming it (cut
        to ECHO_LIMIT characters); messages belongs to chat and prompt to completions."""
        error = self.refused(chat, temprature=0.5)
        self.assertEqual((error.param, error.code), ("temprature", "unknown_parameter"))
        self.assertIn("Unrecognized request argument supplied: temprature", error.message)
        self.assertEqual(self.refused(chat, prompt="x").param, "prompt")
        long = "x" * 10_000
        error = self.refused(chat, **{long: 1})
        self.assertLess(len(error.message), 200)

    def test_messages_errors_name_the_message_and_field(self) -> None:
        """An unknown role says which roles exist; non-text content, tool calls and a missing
        content name the message; developer is rendered as system."""
        error = self.refused(chat, messages=[{"role": "wizard", "content": "x"}])
        self.assertEqual(error.param, "messages[0].role")
        self.assertEqual(
            error.message,
            "messages[0].role must be one of system, developer, user, assistant, tool, not wizard",
        )
        self.assertEqual(self.refused(chat, messages=[{"content": "x"}]).param, "messages[0].role")
        image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
        error = self.refused(chat, messages=[{"role": "user", "content": image}])
        self.assertIn("only text content", error.message)
        calls = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
        self.assertEqual(self.refused(chat, messages=calls).param, "messages[0].tool_calls[0]")
        self.assertEqual(
            self.refused(chat, messages=[{"role": "user"}]).param, "messages[0].content"
        )
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        request = chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": parts},
                {"role": "assistant", "content": None},
            ]
        )
        self.assertEqual(
            request.messages,
            (
                ChatMessage("system", "be brief"),
                ChatMessage("user", "ab"),
                ChatMessage("assistant", ""),
            ),
        )

    def test_prompts_of_completions(self) -> None:
        """A prompt is a non-empty string, a batch of one string, or token ids inside the
        vocabulary; an empty prompt is a 400 about the prompt; a batch of several is refused."""
        self.assertEqual(completion(prompt="hi").prompt_text, "hi")
        self.assertEqual(completion(prompt=["hi"]).prompt_text, "hi")
        self.assertEqual(completion(prompt=[1, 2, 999]).prompt_ids, (1, 2, 999))
        self.assertEqual(completion(prompt=[[1, 2]]).prompt_ids, (1, 2))
        for empty in ("", [], [""]):
            error = self.refused(completion, prompt=empty)
            self.assertEqual((error.param, error.message), ("prompt", "prompt must not be empty"))
        self.assertIn("batch", self.refused(completion, prompt=["a", "b"]).message)
        self.assertEqual(self.refused(completion).message, "prompt is required")
        self.assertEqual(self.refused(completion, prompt=[1.5]).param, "prompt")
        for ids in ([VOCAB], [-1], [1 << 40], [1 << 32], [True]):
            error = self.refused(completion, prompt=ids)
            self.assertEqual(error.param, "prompt", ids)
            self.assertIn(f"0 to {VOCAB - 1}", error.message)

    def test_lone_surrogates_are_invalid_unicode(self) -> None:
        """A lone surrogate (JSON "\\ud800") in a message, a prompt or a stop string is a 400
        that names the field, never an encoding error later."""
        body = json.loads('{"content": "a\\ud800b"}')
        error = self.refused(chat, messages=[{"role": "user", "content": body["content"]}])
        self.assertEqual(error.param, "messages[0].content")
        self.assertIn("lone surrogate at character 1", error.message)
        self.assertEqual(self.refused(completion, prompt=body["content"]).param, "prompt")
        self.assertEqual(self.refused(chat, stop=[body["content"]]).param, "stop")

    def test_numbers_have_plain_bounds(self) -> None:
        """max_tokens must be at least 1 (no made-up upper bound; huge values are clamped to
        the wire's u32); temperature, top_p and min_p give their ranges; NaN is no number."""
        self.assertEqual(self.refused(chat, max_tokens=0).message, "max_tokens must be at least 1")
        self.assertEqual(
            self.refused(chat, max_completion_tokens=-5).message,
            "max_completion_tokens must be at least 1",
        )
        self.assertEqual(chat(max_tokens=10**30).max_tokens, 0xFFFF_FFFF)
        self.assertEqual(chat(max_tokens=12.0).max_tokens, 12)
        self.assertEqual(
            self.refused(chat, temperature=5).message, "temperature must be between 0 and 2"
        )
        self.assertEqual(self.refused(chat, top_p=float("nan")).message, "top_p must be a number")
        self.assertEqual(chat(top_k=-1).params.top_k, 0)
        self.assertEqual(chat(top_k=1 << 40).params.top_k, 0xFFFF_FFFF)
        self.assertEqual(self.refused(chat, seed=1 << 70).param, "seed")

    def test_stream_options_only_with_stream(self) -> None:
        """stream_options needs stream true, takes include_usage, and refuses other keys."""
        self.assertTrue(chat(stream=True, stream_options={"include_usage": True}).include_usage)
        self.assertEqual(
            self.refused(chat, stream_options={"include_usage": True}).param, "stream_options"
        )
        self.assertEqual(
            self.refused(chat, stream=True, stream_options={"x": 1}).code, "unknown_parameter"
        )
        self.assertEqual(self.refused(chat, stream="yes").param, "stream")

    def test_unknown_models_are_404_without_echoing_much(self) -> None:
        """An unknown model is 404 model_not_found; a megabyte-long name is cut in the
        message."""
        error = self.refused(chat, model="nope")
        self.assertEqual((error.status, error.code), (404, "model_not_found"))
        error = self.refused(chat, model="y" * 1_000_000)
        self.assertLess(len(error.message), ECHO_LIMIT + 50)
