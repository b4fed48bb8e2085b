"""Anthropic's Messages API on the head (``POST /v1/messages``, issue 33 item 2; docs/api.md
"/v1/messages"), driven with the official ``anthropic`` package over real TCP.

A constraint-honouring mock node (the tiny test vocabulary) stands behind the head.  Each
answer is pinned against the chat completions endpoint answering the same conversation (the
Messages API is a translation onto it): the same prompt tokens (``usage.input_tokens`` =
``prompt_tokens``), the same text, the same calls; then what only the Messages API says:
its content blocks, ``stop_reason`` / ``stop_sequence``, the documented stream of events, its
error shape and its keys.  No sleeps: every wait is a Deferred.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import jsonschema
from twisted.internet import defer
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.api.messages import MessageBuilder, anthropic_error, event_bytes, translate
from sfnode.head.models.tools import ArgumentsDelta, CallDone, CallOpened, Content
from sfnode.runtime.http_guard import HttpError
from tests.clients import anthropic_client
from tests.test_http import MODEL
from tests.test_http_agents import SCHEMAS, TOOLS, AgentsTestCase

Gen = Generator[defer.Deferred[Any], Any, None]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        **({"description": t["function"]["description"]} if "description" in t["function"]
           else {}),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]  # fmt: skip
SYSTEM = "You answer briefly."
GREEDY = {"temperature": 0}
"""Sampling settings go in the body: the ``anthropic`` client has no parameter for them."""
TURNS = [
    {"role": "user", "content": "the quick brown fox"},
    {"role": "assistant", "content": [{"type": "text", "text": "jumps"}]},
    {"role": "user", "content": [{"type": "text", "text": "over the lazy dog"}]},
]
CHAT_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "the quick brown fox"},
    {"role": "assistant", "content": "jumps"},
    {"role": "user", "content": "over the lazy dog"},
]


class MessagesTestCase(AgentsTestCase):
    @defer.inlineCallbacks
    def messages_head(self, **api: Any) -> Generator[defer.Deferred[Any], Any, tuple[Any, Any]]:
        """A head over one constraint-honouring mock node, an ``anthropic`` client (its key
        sent as X-Api-Key) and an ``openai`` client for it."""
        head, openai_client = yield self.agents_head(**api)
        key = api["api_keys"][0].decode() if "api_keys" in api else "unused"
        client = anthropic_client(self, head.base, api_key=key)
        self.head = head
        return client, openai_client

    @staticmethod
    def texts(message: Any) -> str:
        return "".join(b.text for b in message.content if b.type == "text")


class ConversationTests(MessagesTestCase):
    @defer.inlineCallbacks
    def test_system_and_turns_answer_as_chat_does(self) -> Gen:
        """A system prompt and three turns (string and text-block contents) are the chat
        conversation they translate to: the same prompt tokens and the same text (greedy);
        the message has Anthropic's shape (``msg_`` id, one text block, ``end_turn``)."""
        client, openai_client = yield self.messages_head()
        message = yield self.in_thread(
            lambda: client.messages.create(
                model=MODEL, max_tokens=12, system=SYSTEM, messages=TURNS, extra_body=GREEDY
            )
        )
        chat = yield self.in_thread(
            lambda: openai_client.chat.completions.create(
                model=MODEL, max_tokens=12, messages=CHAT_TURNS, temperature=0
            )
        )
        self.assertTrue(message.id.startswith("msg_"))
        self.assertEqual((message.type, message.role, message.model),
                         ("message", "assistant", MODEL))  # fmt: skip
        self.assertEqual(self.texts(message), chat.choices[0].message.content)
        self.assertEqual(message.usage.input_tokens, chat.usage.prompt_tokens)
        self.assertEqual(message.usage.output_tokens, chat.usage.completion_tokens)
        expected = "end_turn" if chat.choices[0].finish_reason == "stop" else "max_tokens"
        self.assertEqual(message.stop_reason, expected)

    @defer.inlineCallbacks
    def test_max_tokens_and_stop_sequences(self) -> Gen:
        """A free answer cut by ``max_tokens`` stops with ``max_tokens``; a stop sequence met
        in the text stops it there with ``stop_sequence`` naming the one met, the text
        before it shown."""
        client, _ = yield self.messages_head()

        def ask(**extra: Any) -> Any:
            return client.messages.create(
                model=MODEL, max_tokens=20, messages=TURNS[:1], extra_body=GREEDY, **extra
            )

        free = yield self.in_thread(ask)
        self.assertEqual((free.stop_reason, free.stop_sequence), ("max_tokens", None))
        text = self.texts(free)
        stop = text[5:8]
        self.assertEqual(len(stop), 3)
        stopped = yield self.in_thread(lambda: ask(stop_sequences=["\x00never", stop]))
        self.assertEqual((stopped.stop_reason, stopped.stop_sequence), ("stop_sequence", stop))
        self.assertEqual(self.texts(stopped), text[: text.index(stop)])

    @defer.inlineCallbacks
    def test_a_stream_is_the_documented_event_sequence(self) -> Gen:
        """Streamed, the events are ``message_start``, one text block's
        ``content_block_start``, its ``text_delta``\\ s, ``content_block_stop``,
        ``message_delta`` (``stop_reason``, ``usage.output_tokens``) and ``message_stop``;
        the deltas spell the non-streamed text, and the SDK's own stream helper assembles the
        same message."""
        client, _ = yield self.messages_head()
        kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "messages": TURNS,
                                  "system": SYSTEM, "extra_body": GREEDY}  # fmt: skip
        whole = yield self.in_thread(lambda: client.messages.create(**kwargs))
        events = yield self.in_thread(lambda: list(client.messages.create(stream=True, **kwargs)))
        kinds = [e.type for e in events]
        deltas = kinds.count("content_block_delta")
        self.assertGreater(deltas, 0)
        self.assertEqual(
            kinds,
            ["message_start", "content_block_start", *["content_block_delta"] * deltas,
             "content_block_stop", "message_delta", "message_stop"],
        )  # fmt: skip
        self.assertEqual(events[0].message.usage.input_tokens, whole.usage.input_tokens)
        self.assertEqual(events[1].content_block.type, "text")
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        self.assertEqual(text, self.texts(whole))
        self.assertEqual(events[-2].delta.stop_reason, whole.stop_reason)
        self.assertEqual(events[-2].usage.output_tokens, whole.usage.output_tokens)

        def helper() -> Any:
            with client.messages.stream(**kwargs) as stream:
                return stream.get_final_message()

        assembled = yield self.in_thread(helper)
        self.assertEqual([(b.type, b.text) for b in assembled.content],
                         [(b.type, b.text) for b in whole.content])  # fmt: skip
        self.assertEqual(assembled.stop_reason, whole.stop_reason)


class ToolTests(MessagesTestCase):
    def ask(self, client: Any, tool_choice: Any, max_tokens: int = 120, **extra: Any) -> Any:
        kwargs = {"tools": ANTHROPIC_TOOLS, "tool_choice": tool_choice} if tool_choice else {}
        return self.in_thread(
            lambda: client.messages.create(
                model=MODEL, max_tokens=max_tokens, messages=TURNS[:1], extra_body=GREEDY,
                **kwargs, **extra,
            )
        )  # fmt: skip

    @defer.inlineCallbacks
    def test_tool_choice_any_and_tool_give_tool_use_blocks_that_validate(self) -> Gen:
        """``tool_choice`` ``any`` and ``tool`` (a named tool) answer ``tool_use`` blocks
        (``toolu_`` ids, inputs that validate against the tool's ``input_schema``, the named
        tool when named) with ``stop_reason`` ``tool_use``, the same calls chat's
        ``required`` and named function give; streamed, the ``input_json_delta``\\ s spell
        the same inputs."""
        client, openai_client = yield self.messages_head()
        for choice, chat_choice in (
            ({"type": "any"}, "required"),
            (
                {"type": "tool", "name": "count"},
                {"type": "function", "function": {"name": "count"}},
            ),
        ):
            message = yield self.ask(client, choice)
            self.assertEqual(message.stop_reason, "tool_use")
            uses = [b for b in message.content if b.type == "tool_use"]
            self.assertTrue(uses)
            for use in uses:
                self.assertTrue(use.id.startswith("toolu_"))
                jsonschema.validate(use.input, SCHEMAS[use.name])
                if choice["type"] == "tool":
                    self.assertEqual(use.name, "count")
            chat = yield self.in_thread(
                lambda c=chat_choice: openai_client.chat.completions.create(
                    model=MODEL, max_tokens=120, messages=TURNS[:1], temperature=0,
                    tools=TOOLS, tool_choice=c,
                )
            )  # fmt: skip
            self.assertEqual(
                [(u.name, u.input) for u in uses],
                [(c.function.name, json.loads(c.function.arguments))
                 for c in chat.choices[0].message.tool_calls],
            )  # fmt: skip
            events = yield self.ask(client, choice, stream=True)
            events = yield self.in_thread(lambda e=events: list(e))
            starts = [e for e in events if e.type == "content_block_start"]
            self.assertEqual([s.content_block.name for s in starts], [u.name for u in uses])
            for start, use in zip(starts, uses, strict=True):
                spelled = "".join(
                    e.delta.partial_json for e in events
                    if e.type == "content_block_delta" and e.index == start.index
                )  # fmt: skip
                self.assertEqual(json.loads(spelled), use.input)
            self.assertEqual(events[-2].delta.stop_reason, "tool_use")

    @defer.inlineCallbacks
    def test_tool_choice_none_answers_text(self) -> Gen:
        """``tool_choice`` ``none`` answers text only, never a ``tool_use`` block."""
        client, _ = yield self.messages_head()
        message = yield self.ask(client, {"type": "none"})
        self.assertEqual([b.type for b in message.content], ["text"])
        self.assertNotEqual(message.stop_reason, "tool_use")

    @defer.inlineCallbacks
    def test_a_tool_result_turn_continues_the_conversation_as_chat_does(self) -> Gen:
        """A history with an assistant ``tool_use`` block and a user ``tool_result`` block
        (an error result among them) renders as chat's ``tool_calls`` and ``tool`` turns do:
        the same prompt tokens and the same answer."""
        client, openai_client = yield self.messages_head()
        history = [
            {"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "let me count"},
                {"type": "tool_use", "id": "toolu_1", "name": "count", "input": {"n": 3}},
                {"type": "tool_use", "id": "toolu_2", "name": "jump", "input": {"over": "dog"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 foxes"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "too high"}]},
                {"type": "text", "text": "and now?"},
            ]},
        ]  # fmt: skip
        chat_history = [
            {"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": "let me count", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "count", "arguments": '{"n": 3}'}},
                {"id": "toolu_2", "type": "function",
                 "function": {"name": "jump", "arguments": '{"over": "dog"}'}},
            ]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "3 foxes"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: too high"},
            {"role": "user", "content": "and now?"},
        ]  # fmt: skip
        message = yield self.in_thread(
            lambda: client.messages.create(
                model=MODEL, max_tokens=10, messages=history, extra_body=GREEDY,
                tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
            )
        )  # fmt: skip
        chat = yield self.in_thread(
            lambda: openai_client.chat.completions.create(
                model=MODEL, max_tokens=10, messages=chat_history, temperature=0,
                tools=TOOLS,  # type: ignore[arg-type]
            )
        )  # fmt: skip
        self.assertEqual(message.usage.input_tokens, chat.usage.prompt_tokens)
        self.assertEqual(self.texts(message), chat.choices[0].message.content or "")

    @defer.inlineCallbacks
    def test_a_budget_below_the_shortest_call_is_an_anthropic_400(self) -> Gen:
        """``max_tokens`` below the shortest call ``any`` allows is a 400 in Anthropic's error
        shape naming max_tokens and the minimum."""
        import anthropic

        client, _ = yield self.messages_head()
        with self.assertRaises(anthropic.BadRequestError) as caught:
            yield self.ask(client, {"type": "any"}, max_tokens=4)
        body = caught.exception.body
        assert isinstance(body, dict)
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertIn("max_tokens", body["error"]["message"])
        self.assertIn("at least", body["error"]["message"])


class ErrorTests(MessagesTestCase):
    @defer.inlineCallbacks
    def test_request_errors_are_in_anthropics_shape(self) -> Gen:
        """A missing ``max_tokens``, an unknown field, an image block, a prefill, an unknown
        model, a server tool and a GET are answered in Anthropic's shape (``{"type":
        "error", "error": {"type", "message"}}``) with their status; no node generated."""
        head, _ = yield self.agents_head()
        base = {"model": MODEL, "max_tokens": 5, "messages": TURNS[:1]}
        cases = [
            ({"model": MODEL, "messages": TURNS[:1]}, 400, "max_tokens"),
            ({**base, "frobnicate": 1}, 400, "frobnicate"),
            ({**base, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "data": ""}}]}]}, 400, "image"),
            ({**base, "messages": TURNS[:2]}, 400, "prefill"),
            ({**base, "model": "nope"}, 404, "nope"),
            ({**base, "tools": [{"type": "web_search_20250305", "name": "w"}]}, 400, "server"),
        ]  # fmt: skip
        expected_type = {400: "invalid_request_error", 404: "not_found_error",
                         405: "invalid_request_error"}  # fmt: skip
        for body, status, said in [*cases, (None, 405, "GET")]:
            method = b"POST" if body is not None else b"GET"
            code, content = yield self.call(head, method, "/v1/messages", body)
            answer = json.loads(content)
            self.assertEqual(code, status, answer)
            self.assertEqual(answer["type"], "error")
            self.assertEqual(answer["error"]["type"], expected_type[status])
            self.assertIn(said, answer["error"]["message"])
        self.assertEqual(self.node.engine.statistics().decoded_tokens, 0)

    @defer.inlineCallbacks
    def test_keys_as_x_api_key_or_bearer(self) -> Gen:
        """With an API key set, the ``anthropic`` client is served with the key as X-Api-Key
        and as a bearer token (``auth_token``); a wrong key is a 401 in Anthropic's shape
        (``authentication_error``), raised by the client as AuthenticationError."""
        import anthropic

        client, _ = yield self.messages_head(api_keys=[b"sk-right"])
        kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "messages": TURNS[:1]}
        answered = yield self.in_thread(lambda: client.messages.create(**kwargs))
        self.assertEqual(answered.type, "message")
        bearer = anthropic_client(self, self.head.base, auth_token="sk-right")
        answered = yield self.in_thread(lambda: bearer.messages.create(**kwargs))
        self.assertEqual(answered.type, "message")
        wrong = anthropic_client(self, self.head.base, api_key="sk-wrong")
        with self.assertRaises(anthropic.AuthenticationError) as caught:
            yield self.in_thread(lambda: wrong.messages.create(**kwargs))
        body = caught.exception.body
        assert isinstance(body, dict)
        self.assertEqual(body["error"]["type"], "authentication_error")


class TranslationTests(SynchronousTestCase):
    """:mod:`sfnode.head.api.messages` alone: the chat body a Messages body becomes, and the
    message built from the call splitter's events."""

    def test_tool_choice_and_parallel_calls(self) -> None:
        """Each ``tool_choice`` is chat's (``any`` is ``required``, ``tool`` a named function),
        ``disable_parallel_tool_use`` turns ``parallel_tool_calls`` off, and a ``tool_choice``
        without tools is dropped with them."""
        base = {"model": MODEL, "max_tokens": 5, "messages": TURNS[:1], "tools": ANTHROPIC_TOOLS}
        cases = [
            ({"type": "auto"}, {"tool_choice": "auto"}),
            ({"type": "any"}, {"tool_choice": "required"}),
            ({"type": "none"}, {"tool_choice": "none"}),
            ({"type": "tool", "name": "jump"},
             {"tool_choice": {"type": "function", "function": {"name": "jump"}}}),
            ({"type": "any", "disable_parallel_tool_use": True},
             {"tool_choice": "required", "parallel_tool_calls": False}),
        ]  # fmt: skip
        for choice, expected in cases:
            chat = translate({**base, "tool_choice": choice})
            self.assertEqual({k: chat[k] for k in expected}, expected)
            self.assertEqual(chat["tools"], TOOLS)
        bare = translate({**base, "tools": [], "tool_choice": {"type": "any"}})
        self.assertNotIn("tools", bare)
        self.assertNotIn("tool_choice", bare)
        with self.assertRaises(HttpError) as caught:
            translate({**base, "tool_choice": {"type": "tool"}})
        self.assertEqual(caught.exception.param, "tool_choice")

    def test_system_blocks_thinking_and_stop_sequences(self) -> None:
        """A system prompt of text blocks is one system turn; disabled thinking is accepted,
        enabled thinking refused; ``stop_sequences`` become ``stop``, more than four are
        refused naming the field; an assistant's thinking blocks are left out."""
        body = {"model": MODEL, "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                              {"type": "text", "text": "yo"}]},
            {"role": "user", "content": "again"},
        ], "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "thinking": {"type": "disabled"}, "stop_sequences": ["x"]}  # fmt: skip
        chat = translate(body)
        self.assertEqual(chat["messages"], [
            {"role": "system", "content": "ab"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
        ])  # fmt: skip
        self.assertEqual(chat["stop"], ["x"])
        for bad, param in (
            ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
            ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ):
            with self.assertRaises(HttpError) as caught:
                translate({**body, **bad})
            self.assertEqual(caught.exception.param, param)

    def test_a_call_cut_by_the_budget_is_left_out_of_the_whole_message(self) -> None:
        """The whole message lists text and whole calls as blocks; a call the budget cut (no
        CallDone) is streamed as far as it went but left out of the whole message, whose
        input must be an object."""
        builder = MessageBuilder("msg_1", MODEL)
        streamed = builder.add([
            Content("hi"), CallOpened(0, "call_a", "count"), ArgumentsDelta(0, '{"n": 1}'),
            CallDone(0), CallOpened(1, "call_b", "jump"), ArgumentsDelta(1, '{"ov'),
        ])  # fmt: skip
        self.assertEqual(
            [e["type"] for e in streamed],
            ["content_block_start", "content_block_delta", "content_block_stop",
             "content_block_start", "content_block_delta", "content_block_stop",
             "content_block_start", "content_block_delta"],
        )  # fmt: skip
        ended = builder.finished("max_tokens", None, 9)
        self.assertEqual([e["type"] for e in ended],
                         ["content_block_stop", "message_delta", "message_stop"])  # fmt: skip
        whole = builder.whole("max_tokens", None, {"input_tokens": 3, "output_tokens": 9})
        self.assertEqual(whole["content"], [
            {"type": "text", "text": "hi"},
            {"type": "tool_use", "id": "toolu_a", "name": "count", "input": {"n": 1}},
        ])  # fmt: skip

    def test_errors_in_anthropics_shape_and_stream(self) -> None:
        """Any error the head answers becomes Anthropic's shape, its type named by the
        status; in a stream it is an ``error`` event."""
        for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"),
                             (429, "rate_limit_error"), (503, "overloaded_error"),
                             (500, "api_error"), (415, "invalid_request_error")):  # fmt: skip
            error = anthropic_error(HttpError(status, "why", headers={b"retry-after": b"1"}))
            self.assertEqual(error.body(), {"type": "error", "error": {"type": kind,
                                                                        "message": "why"}})
            self.assertEqual((error.status, error.headers), (status, {b"retry-after": b"1"}))
        self.assertTrue(event_bytes(anthropic_error(HttpError(503, "x")).body()).startswith(
            b'event: error\ndata: {"type": "error"'))  # fmt: skip
