"""OpenAI's Responses API on the head (``POST /v1/responses``, sfnode.head.api.responses), driven
with the official ``openai`` package over real TCP: plain and streamed answers (the documented
event sequence), a function call round trip through ``previous_response_id``, ``text.format``
and the store's bounds.

A mock node with the tiny test vocabulary (it honours constraints) stands behind the head;
each answer is compared with the chat completion the request translates to, which
tests/test_http_agents.py pins against the engine.  No sleeps: every wait is a Deferred.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Generator
from typing import Any

import jsonschema
from twisted.internet import defer
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.api.responses import ENTRY_BYTES, ResponseStore, pack
from tests.test_constraint import NESTED
from tests.test_http import MODEL
from tests.test_http_agents import TOOLS, AgentsTestCase

Gen = Generator[defer.Deferred[Any], Any, None]
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
INPUT = "the quick brown fox"


class ResponsesTests(AgentsTestCase):
    @defer.inlineCallbacks
    def test_a_plain_response_is_the_chat_completions_answer(self) -> Gen:
        """``input`` and ``instructions`` answer what the same chat completion answers, as a
        ``Response`` with one message item, usage in Responses' names and ``incomplete``
        with reason ``max_output_tokens`` when the limit cut it."""
        _, client = yield self.agents_head()
        response = yield self.in_thread(
            lambda: client.responses.create(
                model=MODEL, input=INPUT, instructions="Be brief.", max_output_tokens=6,
                temperature=0,
            )
        )  # fmt: skip
        chat = yield self.in_thread(
            lambda: client.chat.completions.create(
                model=MODEL, max_tokens=6, temperature=0,
                messages=[{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": INPUT}],
            )
        )  # fmt: skip
        self.assertTrue(response.id.startswith("resp_"))
        self.assertEqual(response.output_text, chat.choices[0].message.content)
        self.assertEqual([item.type for item in response.output], ["message"])
        self.assertEqual(response.status, "incomplete")
        self.assertEqual(response.incomplete_details.reason, "max_output_tokens")
        self.assertEqual(
            (response.usage.input_tokens, response.usage.output_tokens),
            (chat.usage.prompt_tokens, chat.usage.completion_tokens),
        )

    @defer.inlineCallbacks
    def test_a_streamed_response_follows_the_documented_event_sequence(self) -> Gen:
        """Streamed: created, in_progress, output_item.added, content_part.added, text
        deltas, output_text.done, content_part.done, output_item.done, then completed (here
        incomplete: cut by max_output_tokens), numbered in order; the deltas make the
        non-streamed text."""
        _, client = yield self.agents_head()

        def streamed() -> list[Any]:
            return list(
                client.responses.create(
                    model=MODEL, input=INPUT, max_output_tokens=8, temperature=0, stream=True
                )
            )

        events = yield self.in_thread(streamed)
        plain = yield self.in_thread(
            lambda: client.responses.create(
                model=MODEL, input=INPUT, max_output_tokens=8, temperature=0
            )
        )
        kinds = [e.type for e in events]
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        self.assertGreater(len(deltas), 1)
        self.assertEqual(
            [k for k in kinds if k != "response.output_text.delta"],
            [
                "response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.done",
                "response.content_part.done", "response.output_item.done",
                "response.incomplete",
            ],
        )  # fmt: skip
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        self.assertEqual("".join(d.delta for d in deltas), plain.output_text)
        self.assertEqual(events[-1].response.output_text, plain.output_text)

    @defer.inlineCallbacks
    def test_a_function_call_round_trip(self) -> Gen:
        """``tool_choice: required``: the output is function_call items (``call_id``, name,
        arguments that validate); streamed, the call's ``function_call_arguments.delta``
        fragments make its arguments; the call's output sent back with
        ``previous_response_id`` is answered from the stored conversation plus the result,
        and a response made with ``store: false`` cannot be continued."""
        _, client = yield self.agents_head()
        first = yield self.in_thread(
            lambda: client.responses.create(
                model=MODEL, input=INPUT, tools=RESPONSE_TOOLS, tool_choice="required",
                temperature=0, max_output_tokens=200,
            )
        )  # fmt: skip
        calls = [item for item in first.output if item.type == "function_call"]
        self.assertTrue(calls)
        self.assertEqual(first.status, "completed")
        schemas = {t["name"]: t["parameters"] for t in RESPONSE_TOOLS}
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])

        def streamed() -> list[Any]:
            return list(
                client.responses.create(
                    model=MODEL, input=INPUT, tools=RESPONSE_TOOLS, tool_choice="required",
                    temperature=0, max_output_tokens=200, stream=True,
                )
            )  # fmt: skip

        events = yield self.in_thread(streamed)
        fragments = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        self.assertEqual(fragments, "".join(c.arguments for c in calls))
        self.assertIn("response.function_call_arguments.done", [e.type for e in events])
        self.assertEqual(events[-1].type, "response.completed")

        outputs = [
            {"type": "function_call_output", "call_id": c.call_id, "output": "landed"}
            for c in calls
        ]
        second = yield self.in_thread(
            lambda: client.responses.create(
                model=MODEL, input=outputs, previous_response_id=first.id, tools=RESPONSE_TOOLS,
                temperature=0, max_output_tokens=4,
            )
        )  # fmt: skip
        self.assertEqual(second.previous_response_id, first.id)
        history = [
            {"role": "user", "content": INPUT},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": c.call_id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
            *({"role": "tool", "tool_call_id": c.call_id, "content": "landed"} for c in calls),
        ]  # fmt: skip
        chat = yield self.in_thread(
            lambda: client.chat.completions.create(
                model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=4
            )
        )
        self.assertEqual(second.usage.input_tokens, chat.usage.prompt_tokens)
        self.assertEqual(second.output_text, chat.choices[0].message.content or "")

        import openai

        unstored = yield self.in_thread(
            lambda: client.responses.create(
                model=MODEL, input=INPUT, store=False, max_output_tokens=2
            )
        )
        with self.assertRaises(openai.NotFoundError) as caught:
            yield self.in_thread(
                lambda: client.responses.create(
                    model=MODEL, input="more", previous_response_id=unstored.id
                )
            )
        self.assertEqual(caught.exception.code, "previous_response_not_found")

    @defer.inlineCallbacks
    def test_text_format_json_schema_is_enforced(self) -> Gen:
        """``text.format`` json_schema: the output text validates against the schema."""
        _, client = yield self.agents_head()
        response = yield self.in_thread(
            lambda: client.responses.create(
                model=MODEL, input=INPUT, temperature=0, max_output_tokens=200,
                text={"format": {"type": "json_schema", "name": "n", "schema": NESTED,
                                 "strict": True}},
            )
        )  # fmt: skip
        self.assertEqual(response.status, "completed")
        jsonschema.validate(json.loads(response.output_text), NESTED)

    @defer.inlineCallbacks
    def test_what_it_does_not_serve_is_a_400(self) -> Gen:
        """A tool that is not a function, an input item of an unknown type, an unknown field
        and background mode are 400s in OpenAI's shape naming the field."""
        head, _ = yield self.agents_head()
        cases = [
            ({"tools": [{"type": "web_search"}]}, "tools"),
            ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
            ({"frobnicate": 1}, "frobnicate"),
            ({"background": True}, "background"),
        ]
        for extra, param in cases:
            body = {"model": MODEL, "input": INPUT, **extra}
            code, content = yield self.call(head, b"POST", "/v1/responses", body)
            self.assertEqual((code, json.loads(content)["error"]["param"]), (400, param), extra)


class StoreTests(SynchronousTestCase):
    def test_the_store_is_bounded_by_count_and_size(self) -> None:
        """At most max_responses conversations and max_bytes of memory held: the least
        recently stored or used go first; one conversation above the size is not kept."""
        entry = ENTRY_BYTES + sys.getsizeof("a")
        turn = ({"role": "user", "content": "x" * 40},)
        small = sys.getsizeof(pack(turn, {})) + entry
        store = ResponseStore(max_responses=2, max_bytes=2 * small + 50)
        store.put(None, "a", pack(turn, {}))
        store.put(None, "b", pack(turn, {}))
        self.assertIsNotNone(store.get(None, "a"))  # a is now the most recent
        store.put(None, "c", pack(turn, {}))
        self.assertEqual((store.get(None, "a"), store.get(None, "b")), (pack(turn, {}), None))
        noise = bytes(random.Random(1).randrange(256) for _ in range(3 * small))
        store.put(None, "d", noise)
        self.assertIsNone(store.get(None, "d"))
        store.put(None, "e", noise[: small + 40])
        self.assertEqual(len(store), 1)
        self.assertLessEqual(store.held, 2 * small + 50)
