"""Structured answers within their token budget, at the head (issue 33 item 1; docs/api.md
"Budgets"): a budget below the shortest answer is a 400 before any node is asked, an answer the
node closed early says so in ``finish_details``, ends with ``tool_calls`` / ``stop`` and parses,
and a non-streamed answer whose call the budget cut keeps the call's fragments.

The first tests drive the exchange with a recording backend (what the head writes for a given
outcome); the others run a constraint-honouring mock node behind the whole head in memory
(tests/memoryhead.py), so the Finish's ``detail`` travels the wire, the link and the fleet.
The bundled model's figures are in tests/test_agents_http_smollm2.py.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from twisted.internet.testing import StringTransport

from sfnode.decoding.constraint import response_format_grammar, tools_grammar
from sfnode.engines.mock import MockEngine
from sfnode.head.fleet.backend import FleetOutcome
from sfnode.head.models.floors import AnswerFloors
from sfnode.head.models.text import Renderer
from sfnode.linkf.wire import FINISH_DETAIL_CLOSED, FINISH_EOS, FINISH_LENGTH
from tests.memoryhead import MemoryHead, MemoryHeadTestCase
from tests.test_constraint import vocabulary
from tests.test_head_exchange import ExchangeTestCase
from tests.test_http import MODEL, record_ends, tokenizer
from tests.test_http_agents import SCHEMAS, TOOLS
from tests.tinymodel import TINY_VOCAB

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
REQUIRED = tools_grammar(TOOLS, "required", None)
JSON_OBJECT = response_format_grammar({"type": "json_object"})


def shortest(grammar: Any) -> int:
    """The shortest answer of ``grammar`` on the tiny tokenizer, as the head computes it."""
    length = AnswerFloors().shortest(Renderer(tokenizer()), TINY_VOCAB, grammar)
    assert length is not None
    return length


def whole_body(transport: StringTransport) -> Any:
    return json.loads(transport.value().split(b"\r\n\r\n", 1)[1])


class AnswerTests(ExchangeTestCase):
    """What the head writes for the outcomes a budget gives (recording backend)."""

    def tools_chat(self, **extra: Any) -> dict[str, Any]:
        return {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 100, **extra}

    def test_an_unstreamed_call_cut_by_the_budget_keeps_its_fragments(self) -> None:
        """A call the budget cut inside its arguments (a node without the closing, or free
        text that opened it too late) is listed in the non-streamed ``tool_calls`` with the
        arguments written so far, as the stream shows them, and ``finish_reason: length``."""
        _, transport = self.open("/v1/chat/completions", self.tools_chat())
        (generation,) = self.backend.generations
        generation.placed.callback(None)
        text = '<tool_call>{"name": "jump", "arguments": {"over": "fo'
        generation.tokens(*tokenizer().encode(text, add_special_tokens=False))
        generation.end(FINISH_LENGTH)
        choice = whole_body(transport)["choices"][0]
        self.assertEqual(choice["finish_reason"], "length")
        (call,) = choice["message"]["tool_calls"]
        self.assertEqual(call["function"], {"name": "jump", "arguments": '{"over": "fo'})
        self.assertIsNone(choice["message"]["content"])
        self.assertNotIn("finish_details", choice)

    def test_the_budget_check_runs_in_the_clients_turn(self) -> None:
        """A constrained request's shortest-answer check is a job of its own client on the
        API's fair workers (its address here), never of a turn every client shares."""
        self.open("/v1/chat/completions", self.tools_chat(tool_choice="required"))
        clients = self.api.workers.clients  # type: ignore[attr-defined]
        self.assertTrue(clients)
        self.assertEqual(set(clients), {("address", "127.0.0.1")}, clients)

    def end_closed(self, body: dict[str, Any]) -> StringTransport:
        """Send ``body``; its generation writes a whole call and ends closed."""
        _, transport = self.open("/v1/chat/completions", body)
        (generation,) = self.backend.generations
        generation.placed.callback(None)
        text = '<tool_call>{"name": "count", "arguments": {"n": 3}}</tool_call>'
        generation.tokens(*tokenizer().encode(text, add_special_tokens=False))
        outcome = FleetOutcome(list(generation.sent), FINISH_EOS, "node", 0, FINISH_DETAIL_CLOSED)
        generation.result.callback(outcome)
        return transport

    def test_a_closed_answer_says_so_unstreamed(self) -> None:
        """A choice whose node closed the output within its budget (Finish detail bit 0)
        ends with ``tool_calls`` and carries ``finish_details: {"closed": true}``."""
        choice = whole_body(self.end_closed(self.tools_chat()))["choices"][0]
        self.assertEqual(choice["finish_reason"], "tool_calls")
        self.assertEqual(choice["finish_details"], {"closed": True})
        self.assertEqual(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]),
                         {"n": 3})  # fmt: skip

    def test_a_closed_answer_says_so_streamed(self) -> None:
        """Streamed, the chunk that carries the choice's ``finish_reason`` carries its
        ``finish_details``; no other chunk does."""
        events = self.events(self.end_closed(self.tools_chat(stream=True)))
        finishing = [e for e in events[:-1] if e["choices"][0]["finish_reason"] is not None]
        (last,) = finishing
        self.assertEqual(last["choices"][0]["finish_reason"], "tool_calls")
        self.assertEqual(last["choices"][0]["finish_details"], {"closed": True})
        others = [e for e in events[:-1] if e is not last]
        self.assertTrue(others)
        self.assertFalse(any("finish_details" in e["choices"][0] for e in others))

    def test_an_eos_without_the_detail_has_no_finish_details(self) -> None:
        """An answer that ended on its own (no detail bit) has no ``finish_details``."""
        _, transport = self.open("/v1/chat/completions", self.tools_chat())
        (generation,) = self.backend.generations
        generation.placed.callback(None)
        generation.tokens(*tokenizer().encode("hello", add_special_tokens=False))
        generation.end(FINISH_EOS)
        choice = whole_body(transport)["choices"][0]
        self.assertEqual(choice["finish_reason"], "stop")
        self.assertNotIn("finish_details", choice)


class FleetBudgetTests(MemoryHeadTestCase):
    """A constraint-honouring mock node behind the whole head, in memory."""

    def head(self) -> tuple[MemoryHead, MockEngine]:
        engine = MockEngine(self.reactor, vocab_size=TINY_VOCAB, vocabulary=vocabulary())
        node = self.start_vocab_node(engine=engine)
        return self.start_head([node]), engine

    def post(self, head: MemoryHead, body: dict[str, Any]) -> tuple[int, Any]:
        status, content = self.call(head, b"POST", "/v1/chat/completions", body)
        if body.get("stream"):
            return status, content
        return status, json.loads(content)

    def test_a_budget_below_the_shortest_answer_is_refused_before_placing(self) -> None:
        """``max_tokens`` (or ``max_completion_tokens``) below the shortest answer the format
        allows is a 400 naming the field and the minimum, in OpenAI's error shape, and no
        generation reaches the node; the minimum itself is served."""
        head, engine = self.head()
        submitted = record_ends(engine)
        floor = shortest(REQUIRED)
        for field in ("max_tokens", "max_completion_tokens"):
            body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                    "tool_choice": "required", field: floor - 1}  # fmt: skip
            status, answer = self.post(head, body)
            self.assertEqual(status, 400)
            error = answer["error"]
            self.assertEqual(error["param"], field)
            self.assertEqual(error["code"], "max_tokens_too_small")
            self.assertEqual(error["type"], "invalid_request_error")
            self.assertIn(f"at least {floor}", error["message"])
        self.assertEqual(submitted, [])
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                "max_tokens": floor, "temperature": 0}  # fmt: skip
        status, answer = self.post(head, body)
        self.assertEqual(status, 200)
        self.assertEqual(answer["choices"][0]["finish_reason"], "tool_calls")

    def calls_of_stream(self, content: bytes) -> tuple[dict[int, dict[str, str]], Any]:
        """The calls a chat stream's deltas spell (by index) and its finishing choice."""
        calls: dict[int, dict[str, str]] = {}
        finishing = None
        for line in content.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            for delta in choice["delta"].get("tool_calls", ()):
                call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                call["name"] += delta.get("function", {}).get("name", "")
                call["arguments"] += delta["function"].get("arguments", "")
            if choice["finish_reason"] is not None:
                finishing = choice
        return calls, finishing

    def test_forced_calls_parse_and_validate_at_small_budgets(self) -> None:
        """With ``tool_choice`` required and budgets from the shortest answer up, every
        answer, streamed and not, ends with ``tool_calls`` and calls whose arguments parse
        and validate against their tool's schema; the answers the node had to close say so
        (some do: otherwise this would not test the closing)."""
        head, _ = self.head()
        floor = shortest(REQUIRED)
        closed = 0
        for budget in range(floor, floor + 16, 3):
            for seed in (1, 2):
                body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "seed": seed,
                        "tool_choice": "required", "max_tokens": budget}  # fmt: skip
                status, answer = self.post(head, body)
                self.assertEqual(status, 200)
                choice = answer["choices"][0]
                self.assertEqual(choice["finish_reason"], "tool_calls", (budget, seed))
                self.assertLessEqual(answer["usage"]["completion_tokens"], budget)
                for call in choice["message"]["tool_calls"]:
                    function = call["function"]
                    jsonschema.validate(
                        json.loads(function["arguments"]), SCHEMAS[function["name"]]
                    )
                closed += "finish_details" in choice
                status, content = self.post(head, {**body, "stream": True})
                calls, finishing = self.calls_of_stream(content)
                self.assertEqual(finishing["finish_reason"], "tool_calls")
                self.assertEqual(finishing.get("finish_details"), choice.get("finish_details"))
                self.assertEqual(
                    [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
                    [(c["function"]["name"], c["function"]["arguments"])
                     for c in choice["message"]["tool_calls"]],
                )  # fmt: skip
        self.assertGreater(closed, 0)

    def test_json_object_answers_parse_at_small_budgets(self) -> None:
        """``json_object`` answers at small budgets are one JSON object that parses, end with
        ``stop``, and say when they were closed early (some are)."""
        head, _ = self.head()
        floor = shortest(JSON_OBJECT)
        closed = 0
        for budget in (floor, floor + 1, floor + 4, 12, 24):
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": budget,
                    "response_format": {"type": "json_object"}}  # fmt: skip
            status, answer = self.post(head, body)
            self.assertEqual(status, 200)
            choice = answer["choices"][0]
            self.assertEqual(choice["finish_reason"], "stop", budget)
            self.assertIsInstance(json.loads(choice["message"]["content"]), dict)
            closed += choice.get("finish_details") == {"closed": True}
        self.assertGreater(closed, 0)
