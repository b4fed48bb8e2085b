"""Ollama's API on the head (issue 33 item 5; docs/api.md "Ollama's API"): ``/api/chat`` and
``/api/generate`` answer what the chat completion they translate to answers, streamed as NDJSON
(the default) or as one body; tool calls and ``format`` carry over; ``/api/tags``,
``/api/show`` and ``/api/version`` list what is served; every error is ``{"error": message}``.

Plain HTTP against a head with a constraint-honouring mock node in memory
(tests/memoryhead.py), then the ``ollama`` package over real TCP.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import jsonschema
import numpy as np
from twisted.internet import defer, threads
from twisted.trial.unittest import SynchronousTestCase

from sfnode.decoding.constraint import response_format_grammar
from sfnode.head.api.ollama import OllamaBuilder
from sfnode.head.models.tools import ArgumentsDelta, CallDone, CallOpened, Content
from tests.embedders import hash_vector
from tests.test_constraint import NESTED
from tests.test_head_responses import KEY_A, StoredTestCase
from tests.test_http import MODEL
from tests.test_http_agents import TOOLS, AgentsTestCase
from tests.test_http_budget import shortest
from tests.test_http_embeddings import EmbeddingFleetTestCase

Gen = Generator[defer.Deferred[Any], Any, None]
ASK = [{"role": "user", "content": "the quick brown fox"}]


def lines(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.decode().splitlines() if line]


class OllamaHttpTests(StoredTestCase):
    def chat_completion(self, head: Any, messages: Any, **extra: Any) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "temperature": 0, **extra}
        status, answer = self.json(head, "POST", "/v1/chat/completions", body)
        self.assertEqual(status, 200, answer)
        return answer  # type: ignore[no-any-return]

    def test_chat_streams_ndjson_by_default_and_answers_as_chat_does(self) -> None:
        """``/api/chat`` without ``stream`` streams NDJSON (``application/x-ndjson``): lines
        whose ``message.content`` pieces make the chat completion's text, ``done: false``,
        then a ``done: true`` line with ``done_reason`` (``length`` when ``num_predict`` cut
        it) and the counts (``prompt_eval_count``, ``eval_count``) chat counts; with
        ``stream: false``, one body with the whole message."""
        head = self.head()
        body = {"model": MODEL, "messages": ASK, "options": {"temperature": 0, "num_predict": 6}}
        expected = self.chat_completion(head, ASK, max_tokens=6)
        status, headers, content = self.send(head, "POST", "/api/chat", body)
        self.assertEqual(status, 200)
        self.assertEqual(headers[b"content-type"], b"application/x-ndjson")
        streamed = lines(content)
        *pieces, last = streamed
        self.assertGreater(len(pieces), 1)
        self.assertTrue(all(not p["done"] and p["model"] == MODEL for p in pieces))
        text = "".join(p["message"]["content"] for p in pieces)
        self.assertEqual(text, expected["choices"][0]["message"]["content"])
        self.assertEqual((last["done"], last["done_reason"]), (True, "length"))
        usage = expected["usage"]
        self.assertEqual((last["prompt_eval_count"], last["eval_count"]),
                         (usage["prompt_tokens"], usage["completion_tokens"]))  # fmt: skip
        self.assertTrue(last["created_at"].endswith("Z"))
        status, whole = self.json(head, "POST", "/api/chat", {**body, "stream": False})
        self.assertEqual(status, 200)
        self.assertEqual(whole["message"], {"role": "assistant", "content": text})
        self.assertEqual((whole["done"], whole["done_reason"]), (True, "length"))

    def test_generate_is_a_system_and_a_user_turn(self) -> None:
        """``/api/generate`` with ``system`` and ``prompt`` answers (``response``) what chat
        answers to those two turns, streamed or not."""
        head = self.head()
        body = {"model": MODEL, "prompt": "the quick brown fox", "system": "Be brief.",
                "options": {"temperature": 0, "num_predict": 5}}  # fmt: skip
        expected = self.chat_completion(
            head, [{"role": "system", "content": "Be brief."}, *ASK], max_tokens=5
        )
        status, _, content = self.send(head, "POST", "/api/generate", body)
        self.assertEqual(status, 200)
        *pieces, last = lines(content)
        text = expected["choices"][0]["message"]["content"]
        self.assertEqual("".join(p["response"] for p in pieces), text)
        self.assertEqual(last["prompt_eval_count"], expected["usage"]["prompt_tokens"])
        status, whole = self.json(head, "POST", "/api/generate", {**body, "stream": False})
        self.assertEqual((status, whole["response"], whole["done"]), (200, text, True))

    def test_format_and_a_tool_round_trip_carry_over(self) -> None:
        """``format`` as a JSON Schema gives an answer that validates; a conversation with an
        assistant's ``tool_calls`` (no ids, arguments as an object) and ``tool`` turns is
        the chat conversation whose calls got ids and whose tool turns answer them in order
        (the same prompt, the same answer)."""
        head = self.head()
        body = {"model": MODEL, "messages": ASK, "format": NESTED, "stream": False,
                "options": {"temperature": 0, "num_predict": 200}}  # fmt: skip
        status, answer = self.json(head, "POST", "/api/chat", body)
        self.assertEqual((status, answer["done_reason"]), (200, "stop"))
        jsonschema.validate(json.loads(answer["message"]["content"]), NESTED)
        calls = [{"function": {"name": "jump", "arguments": {"over": "fox"}}},
                 {"function": {"name": "count", "arguments": {"n": 3}}}]  # fmt: skip
        turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": calls},
                 {"role": "tool", "content": "jumped"}, {"role": "tool", "content": "3"}]
        chat_turns = [
            *ASK,
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_1_{j}", "type": "function",
                 "function": {"name": c["function"]["name"],
                              "arguments": json.dumps(c["function"]["arguments"])}}
                for j, c in enumerate(calls)]},
            {"role": "tool", "tool_call_id": "call_1_0", "content": "jumped"},
            {"role": "tool", "tool_call_id": "call_1_1", "content": "3"},
        ]  # fmt: skip
        expected = self.chat_completion(head, chat_turns, tools=TOOLS, max_tokens=4)
        body = {"model": MODEL, "messages": turns, "tools": TOOLS, "stream": False,
                "options": {"temperature": 0, "num_predict": 4}}  # fmt: skip
        status, answer = self.json(head, "POST", "/api/chat", body)
        self.assertEqual(status, 200, answer)
        self.assertEqual(answer["prompt_eval_count"], expected["usage"]["prompt_tokens"])
        self.assertEqual(answer["message"]["content"],
                         expected["choices"][0]["message"]["content"] or "")  # fmt: skip

    def test_the_listings_and_the_errors(self) -> None:
        """``/api/tags`` lists the served model, ``/api/show`` shows it (its window, its
        capabilities) and is a 404 ``{"error"}`` for another, ``/api/version`` answers a
        version; an unknown field, a missing model and a missing key are ``{"error":
        message}`` with their statuses."""
        head = self.head(api_keys=[KEY_A])
        status, listed = self.json(head, "GET", "/api/tags", key=KEY_A)
        self.assertEqual(status, 200)
        self.assertEqual([m["name"] for m in listed["models"]], [MODEL])
        status, shown = self.json(head, "POST", "/api/show", {"model": MODEL}, KEY_A)
        self.assertEqual(status, 200)
        self.assertEqual(shown["capabilities"], ["completion", "tools"])
        self.assertGreater(shown["model_info"]["general.context_length"], 0)
        self.assertEqual(
            self.json(head, "POST", "/api/show", {"model": "nope"}, KEY_A),
            (404, {"error": "model 'nope' not found"}),
        )
        status, version = self.json(head, "GET", "/api/version", key=KEY_A)
        self.assertEqual((status, set(version)), (200, {"version"}))
        for body, code in (({"model": MODEL, "messages": ASK, "frobnicate": 1}, 400),
                           ({"messages": ASK}, 400)):  # fmt: skip
            status, answer = self.json(head, "POST", "/api/chat", body, KEY_A)
            self.assertEqual((status, list(answer)), (code, ["error"]), answer)
        status, answer = self.json(head, "GET", "/api/tags")
        self.assertEqual((status, list(answer)), (401, ["error"]))


    def test_a_budget_error_names_num_predict(self) -> None:
        """``options.num_predict`` below the shortest answer a ``format`` allows is the 400
        of a budget too small, naming ``options.num_predict`` (not the chat field it is
        translated to), and so is ``num_predict: 0``; a top-level ``max_tokens`` is an
        unknown field, named as sent."""
        head = self.head()
        grammar = response_format_grammar(
            {"type": "json_schema", "json_schema": {"name": "format", "schema": NESTED}}
        )
        floor = shortest(grammar)
        body = {"model": MODEL, "messages": ASK, "format": NESTED, "stream": False,
                "options": {"num_predict": floor - 1}}  # fmt: skip
        status, answer = self.json(head, "POST", "/api/chat", body)
        self.assertEqual(status, 400)
        self.assertIn(f"set options.num_predict to at least {floor}", answer["error"])
        self.assertNotIn("max_tokens", answer["error"])
        status, answer = self.json(
            head, "POST", "/api/chat", {**body, "options": {"num_predict": 0}}
        )
        self.assertEqual(status, 400)
        self.assertIn("options.num_predict", answer["error"])
        status, answer = self.json(head, "POST", "/api/chat", {**body, "max_tokens": 3})
        self.assertEqual((status, answer), (400, {"error": "unknown field: max_tokens"}))


class OllamaEmbedTests(EmbeddingFleetTestCase):
    def test_embed_answers_the_vectors_and_lists_the_model_as_embedding(self) -> None:
        """``/api/embed`` (a string or strings) answers ``embeddings`` in input order, the
        vectors ``/v1/embeddings`` gives, and ``prompt_eval_count`` its tokens; an unknown
        model is a 404 ``{"error"}``; ``/api/show`` says the model embeds."""
        head, _, _ = self.fleet()
        texts = ["the fox", "jumps", "over the lazy dog"]
        status, answer = self.post(head, "/api/embed", {"model": MODEL, "input": texts})
        self.assertEqual(status, 200, answer)
        self.assertEqual(answer["model"], MODEL)
        np.testing.assert_array_equal(answer["embeddings"], [hash_vector(t) for t in texts])
        self.assertEqual(answer["prompt_eval_count"], 7)
        status, one = self.post(head, "/api/embed", {"model": MODEL, "input": "the fox",
                                                     "truncate": True})  # fmt: skip
        self.assertEqual((status, one["embeddings"]), (200, [hash_vector("the fox")]))
        status, missing = self.post(head, "/api/embed", {"model": "nope", "input": "x"})
        self.assertEqual((status, list(missing)), (404, ["error"]))
        status, shown = self.post(head, "/api/show", {"model": MODEL})
        self.assertEqual((status, shown["capabilities"]), (200, ["embedding"]))


class OllamaBuilderTests(SynchronousTestCase):
    def test_a_call_is_one_line_when_it_is_whole(self) -> None:
        """A call's fragments make no line until the call is whole; then one line carries
        it with its arguments as an object (Ollama's shape); the whole body holds the text
        and the call."""
        builder = OllamaBuilder(MODEL, "2026-01-01T00:00:00Z", chat=True)
        out = builder.add([Content("ok "), CallOpened(0, "call_a", "jump")])
        out += builder.add([ArgumentsDelta(0, '{"over":'), ArgumentsDelta(0, ' "fox"}')])
        self.assertEqual([line["message"]["content"] for line in out], ["ok "])
        (line,) = builder.add([CallDone(0)])
        call = {"function": {"name": "jump", "arguments": {"over": "fox"}}}
        self.assertEqual(
            line["message"], {"role": "assistant", "content": "", "tool_calls": [call]}
        )
        whole = builder.whole("stop", {"eval_count": 9})
        self.assertEqual(whole["message"]["tool_calls"], [call])
        self.assertEqual((whole["message"]["content"], whole["eval_count"]), ("ok ", 9))


class OllamaClientTests(AgentsTestCase):
    @defer.inlineCallbacks
    def test_the_ollama_package_chats_generates_and_lists(self) -> Gen:
        """The ``ollama`` package: ``chat`` (plain and streamed: the pieces make the plain
        answer), ``generate``, ``list`` and ``show`` parse what the head answers."""
        import ollama

        head, _ = yield self.agents_head()
        client = ollama.Client(host=head.base)
        self.addCleanup(client.close)
        options = {"temperature": 0, "num_predict": 6}
        plain = yield threads.deferToThread(
            lambda: client.chat(model=MODEL, messages=ASK, options=options)
        )
        pieces = yield threads.deferToThread(
            lambda: [c.message.content for c in
                     client.chat(model=MODEL, messages=ASK, options=options, stream=True)]
        )  # fmt: skip
        self.assertTrue(plain.message.content)
        self.assertEqual("".join(pieces), plain.message.content)
        self.assertEqual(plain.done_reason, "length")
        generated = yield threads.deferToThread(
            lambda: client.generate(model=MODEL, prompt="the quick brown fox", options=options)
        )
        self.assertEqual(generated.response, plain.message.content)
        listed = yield threads.deferToThread(client.list)
        self.assertEqual([m.model for m in listed.models], [MODEL])
        shown = yield threads.deferToThread(lambda: client.show(MODEL))
        self.assertIn("tools", shown.capabilities)
