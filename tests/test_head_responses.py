"""The rest of OpenAI's Responses API on the head (issue 33 item 4; docs/api.md "/v1/responses"):
stored responses read back and deleted per API key, ``previous_response_id`` chains several
deep, function-call items and their streamed events in the documented order, and a budget
refusal that names ``max_output_tokens``.

A constraint-honouring mock node stands behind the whole head in memory
(tests/memoryhead.py): no socket, no thread, no sleep.  The ``openai`` client's view of the
same routes is in tests/test_http_responses.py.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from twisted.trial.unittest import SynchronousTestCase

from sfnode.engines.mock import MockEngine
from sfnode.head.api.responses import ResponseBuilder, ResponsesRequest
from sfnode.head.models.tools import ArgumentsDelta, CallDone, CallOpened, Content
from tests.memoryhead import MemoryHead, MemoryHeadTestCase
from tests.test_constraint import vocabulary
from tests.test_http import MODEL
from tests.test_http_agents import SCHEMAS, TOOLS
from tests.test_http_budget import REQUIRED, shortest
from tests.test_http_hostile import request_bytes
from tests.tinymodel import TINY_VOCAB

KEY_A = b"sk-owner-a-" + b"a" * 20
KEY_B = b"sk-owner-b-" + b"b" * 20
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
INPUT = "the quick brown fox"


def stream_events(content: bytes) -> list[dict[str, Any]]:
    """The data of every event of a Responses stream (each block's ``data:`` line)."""
    events = []
    for block in content.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    return events


class StoredTestCase(MemoryHeadTestCase):
    def head(self, **api: Any) -> MemoryHead:
        """A head (``api``: more OpenAIApi keywords) over one constraint-honouring mock node."""
        engine = MockEngine(self.reactor, vocab_size=TINY_VOCAB, vocabulary=vocabulary())
        node = self.start_vocab_node(engine=engine)
        return self.start_head([node], **api)

    def send(
        self,
        head: MemoryHead,
        method: str,
        path: str,
        body: Any = None,
        key: bytes | None = None,
        extra: tuple[str, ...] = (),
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        """One request (``key`` as the bearer token): its status, headers and body."""
        data = b"" if body is None else json.dumps(body).encode()
        headers = [f"Authorization: Bearer {key.decode()}"] if key is not None else []
        request = request_bytes(path, data, method=method, extra=[*headers, *extra])
        return self.exchange(head, request)

    def json(self, head: MemoryHead, method: str, path: str, body: Any = None,
             key: bytes | None = None) -> tuple[int, Any]:  # fmt: skip
        status, _, content = self.send(head, method, path, body, key)
        return status, json.loads(content)


class StoredResponseTests(StoredTestCase):
    def test_a_stored_response_is_read_and_deleted_by_its_key_only(self) -> None:
        """``GET /v1/responses/{id}`` answers the ``Response`` object the POST answered, to the
        key that made it; another key's GET and DELETE get exactly the 404 an unknown id
        gets and leave it be; its own DELETE answers ``{"id", "object": "response",
        "deleted": true}``, after which GET, DELETE and ``previous_response_id`` are 404s;
        a response made with ``store: false`` is never found."""
        head = self.head(api_keys=[KEY_A, KEY_B])
        body = {"model": MODEL, "input": INPUT, "max_output_tokens": 3, "temperature": 0}
        status, made = self.json(head, "POST", "/v1/responses", body, KEY_A)
        self.assertEqual(status, 200, made)
        path = "/v1/responses/" + made["id"]
        self.assertEqual(self.json(head, "GET", path, key=KEY_A), (200, made))
        unknown = "resp_" + "0" * 32
        for method in ("GET", "DELETE"):
            crossed = self.json(head, method, path, key=KEY_B)
            nobody = self.json(head, method, "/v1/responses/" + unknown, key=KEY_B)
            self.assertEqual(crossed[0], 404)
            self.assertEqual(crossed[1]["error"]["code"], "response_not_found")
            self.assertEqual(
                json.dumps(crossed[1]).replace(made["id"], "ID"),
                json.dumps(nobody[1]).replace(unknown, "ID"),
            )
        self.assertEqual(self.json(head, "GET", path, key=KEY_A), (200, made))
        self.assertEqual(
            self.json(head, "DELETE", path, key=KEY_A),
            (200, {"id": made["id"], "object": "response", "deleted": True}),
        )
        self.assertEqual(self.json(head, "GET", path, key=KEY_A)[0], 404)
        self.assertEqual(self.json(head, "DELETE", path, key=KEY_A)[0], 404)
        again = {**body, "previous_response_id": made["id"]}
        status, answer = self.json(head, "POST", "/v1/responses", again, KEY_A)
        self.assertEqual((status, answer["error"]["code"]), (404, "previous_response_not_found"))
        status, unstored = self.json(
            head, "POST", "/v1/responses", {**body, "store": False}, KEY_A
        )
        self.assertEqual(status, 200)
        self.assertEqual(self.json(head, "GET", "/v1/responses/" + unstored["id"], key=KEY_A)[0],
                         404)  # fmt: skip

    def test_the_routes_under_a_response_are_what_they_serve(self) -> None:
        """A streamed response is read back as its ``response.completed`` event's
        ``Response``; HEAD is answered as GET without a body; POST on a response's id is a
        405, a path beyond it a 404, and without the key a 401."""
        head = self.head(api_keys=[KEY_A])
        body = {"model": MODEL, "input": INPUT, "max_output_tokens": 3, "temperature": 0,
                "stream": True}  # fmt: skip
        status, _, content = self.send(head, "POST", "/v1/responses", body, KEY_A)
        self.assertEqual(status, 200)
        last = stream_events(content)[-1]
        self.assertEqual(last["type"], "response.incomplete")
        path = "/v1/responses/" + last["response"]["id"]
        self.assertEqual(self.json(head, "GET", path, key=KEY_A), (200, last["response"]))
        status, headers, content = self.send(head, "HEAD", path, key=KEY_A)
        self.assertEqual((status, content), (200, b""))
        self.assertEqual(headers[b"content-type"], b"application/json")
        self.assertEqual(self.json(head, "POST", path, {}, KEY_A)[0], 405)
        self.assertEqual(self.json(head, "GET", path + "/more", key=KEY_A)[0], 404)
        self.assertEqual(self.json(head, "GET", path)[0], 401)

    def test_previous_response_id_chains_four_deep(self) -> None:
        """Each response continues the one before it: the fourth's prompt is the whole
        conversation (every input and every answer, in order), exactly the chat completion of
        that history (the same ``input_tokens`` and the same answer)."""
        head = self.head()
        history: list[dict[str, Any]] = []
        previous, text = None, ""
        for turn in ("the quick", "brown fox", "jumps over", "the lazy dog"):
            if previous is not None:
                history.append({"role": "assistant", "content": text})
            body = {"model": MODEL, "input": turn, "max_output_tokens": 3, "temperature": 0,
                    "previous_response_id": previous}  # fmt: skip
            status, answer = self.json(head, "POST", "/v1/responses", body)
            self.assertEqual(status, 200, answer)
            self.assertEqual(answer["previous_response_id"], previous)
            (item,) = answer["output"]
            text = item["content"][0]["text"]
            self.assertTrue(text)
            history.append({"role": "user", "content": turn})
            previous = answer["id"]
        chat = {"model": MODEL, "messages": history, "max_tokens": 3, "temperature": 0}
        status, expected = self.json(head, "POST", "/v1/chat/completions", chat)
        self.assertEqual(status, 200)
        self.assertEqual(answer["usage"]["input_tokens"], expected["usage"]["prompt_tokens"])
        self.assertEqual(text, expected["choices"][0]["message"]["content"])

    def test_a_budget_too_small_names_max_output_tokens(self) -> None:
        """A forced call with ``max_output_tokens`` below its shortest answer is the 400
        ``max_tokens_too_small`` naming ``max_output_tokens`` (the request's own field, not
        the chat field it is translated to), and so is ``max_output_tokens: 0``."""
        head = self.head()
        floor = shortest(REQUIRED)
        body = {"model": MODEL, "input": INPUT, "tools": RESPONSE_TOOLS,
                "tool_choice": "required", "max_output_tokens": floor - 1}  # fmt: skip
        status, answer = self.json(head, "POST", "/v1/responses", body)
        error = answer["error"]
        self.assertEqual((status, error["param"], error["code"]),
                         (400, "max_output_tokens", "max_tokens_too_small"))  # fmt: skip
        self.assertIn(f"set max_output_tokens to at least {floor}", error["message"])
        self.assertNotIn("max_completion_tokens", error["message"])
        status, answer = self.json(
            head, "POST", "/v1/responses", {**body, "max_output_tokens": 0}
        )
        self.assertEqual((status, answer["error"]["param"]), (400, "max_output_tokens"))
        self.assertNotIn("max_completion_tokens", answer["error"]["message"])


class FunctionCallTests(StoredTestCase):
    def test_a_streamed_call_then_its_output_on_the_next_turn(self) -> None:
        """A forced call streams as ``output_item.added`` (a ``function_call`` item with
        ``call_id``, ``name`` and empty ``arguments``), argument deltas that make the
        arguments (which validate), ``function_call_arguments.done``, ``output_item.done``,
        then ``response.completed`` with the item and usage; its ``function_call_output``
        on the next turn (``previous_response_id``) is answered from the stored call plus
        the output, as chat answers that history."""
        head = self.head()
        body = {"model": MODEL, "input": INPUT, "tools": RESPONSE_TOOLS, "temperature": 0,
                "tool_choice": "required", "max_output_tokens": 200, "stream": True}  # fmt: skip
        status, _, content = self.send(head, "POST", "/v1/responses", body)
        self.assertEqual(status, 200)
        events = stream_events(content)
        kinds = [e["type"] for e in events]
        first_call = kinds.index("response.output_item.added")
        self.assertEqual(kinds[:2], ["response.created", "response.in_progress"])
        self.assertEqual(events[first_call]["item"]["type"], "function_call")
        self.assertEqual(events[first_call]["item"]["arguments"], "")
        self.assertEqual(kinds[-1], "response.completed")
        done = events[-1]["response"]
        self.assertEqual(done["status"], "completed")
        self.assertGreater(done["usage"]["output_tokens"], 0)
        calls = [item for item in done["output"] if item["type"] == "function_call"]
        self.assertTrue(calls)
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
            own = [e for e in events if e.get("item_id") == call["id"]]
            self.assertEqual(
                "".join(e["delta"] for e in own if "delta" in e), call["arguments"]
            )
            self.assertEqual(own[-1]["type"], "response.function_call_arguments.done")
        self.assertEqual([e["sequence_number"] for e in events], list(range(len(events))))

        outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": "landed"}
                   for c in calls]  # fmt: skip
        follow = {"model": MODEL, "input": outputs, "previous_response_id": done["id"],
                  "tools": RESPONSE_TOOLS, "temperature": 0, "max_output_tokens": 4}  # fmt: skip
        status, second = self.json(head, "POST", "/v1/responses", follow)
        self.assertEqual(status, 200, second)
        history = [
            {"role": "user", "content": INPUT},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": c["call_id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]},
            *({"role": "tool", "tool_call_id": c["call_id"], "content": "landed"} for c in calls),
        ]  # fmt: skip
        chat = {"model": MODEL, "messages": history, "tools": TOOLS, "temperature": 0,
                "max_tokens": 4}  # fmt: skip
        status, expected = self.json(head, "POST", "/v1/chat/completions", chat)
        self.assertEqual(second["usage"]["input_tokens"], expected["usage"]["prompt_tokens"])


class EventOrderTests(SynchronousTestCase):
    def test_each_item_is_done_before_the_next_is_added(self) -> None:
        """Text, then two calls: the text's item closes (text done, part done, item done)
        when the first call opens, and each call's ``function_call_arguments.done`` and
        ``output_item.done`` come when its arguments are whole, before the next call's
        ``output_item.added``; the response's events close the stream with usage."""
        request = ResponsesRequest({}, (), {})
        builder = ResponseBuilder("resp_x", 0, MODEL, request)
        events = builder.started()
        events += builder.add([Content("Let me."), CallOpened(0, "call_a", "jump")])
        events += builder.add([ArgumentsDelta(0, '{"over":'), ArgumentsDelta(0, ' "fox"}')])
        events += builder.add([CallDone(0), CallOpened(1, "call_b", "count")])
        events += builder.add([ArgumentsDelta(1, '{"n": 3}'), CallDone(1)])
        usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
        events += builder.finished(usage)
        self.assertEqual(
            [(e["type"], e.get("output_index")) for e in events],
            [
                ("response.created", None), ("response.in_progress", None),
                ("response.output_item.added", 0), ("response.content_part.added", 0),
                ("response.output_text.delta", 0), ("response.output_text.done", 0),
                ("response.content_part.done", 0), ("response.output_item.done", 0),
                ("response.output_item.added", 1),
                ("response.function_call_arguments.delta", 1),
                ("response.function_call_arguments.delta", 1),
                ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
                ("response.output_item.added", 2),
                ("response.function_call_arguments.delta", 2),
                ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
                ("response.completed", None),
            ],
        )  # fmt: skip
        self.assertEqual([e["sequence_number"] for e in events], list(range(len(events))))
        self.assertEqual(events[11]["arguments"], '{"over": "fox"}')
        self.assertEqual(events[12]["item"]["status"], "completed")
        final = events[-1]["response"]
        self.assertEqual(
            [(i["type"], i.get("call_id")) for i in final["output"]],
            [("message", None), ("function_call", "call_a"), ("function_call", "call_b")],
        )
        self.assertEqual(
            (final["usage"]["input_tokens"], final["usage"]["output_tokens"]), (5, 9)
        )

    def test_a_call_cut_by_the_limit_closes_incomplete(self) -> None:
        """A call whose arguments never became whole is closed by the response's end:
        its ``.done`` events carry status ``incomplete`` and the response is
        ``response.incomplete``; the non-streamed answer leaves the cut call out."""
        request = ResponsesRequest({}, (), {})
        builder = ResponseBuilder("resp_x", 0, MODEL, request)
        builder.add([CallOpened(0, "call_a", "jump"), ArgumentsDelta(0, '{"ov')])
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        events = builder.finished(usage, "max_output_tokens")
        self.assertEqual(
            [e["type"] for e in events],
            ["response.function_call_arguments.done", "response.output_item.done",
             "response.incomplete"],
        )  # fmt: skip
        self.assertEqual(events[1]["item"]["status"], "incomplete")
        whole = ResponseBuilder("resp_y", 0, MODEL, request)
        whole.add([CallOpened(0, "call_a", "jump"), ArgumentsDelta(0, '{"ov')])
        self.assertEqual(whole.whole(usage, "max_output_tokens")["output"], [])


class CorsTests(StoredTestCase):
    def test_a_browser_may_send_the_anthropic_headers_and_delete(self) -> None:
        """An allowed origin's preflight allows ``X-Api-Key`` and ``anthropic-version``
        (Anthropic's clients send both) beside ``Authorization``, and the ``DELETE`` of
        ``/v1/responses/{id}``; a preflight of ``/v1/messages`` is answered 204 without the
        key, and the request it allowed, keyed by ``X-Api-Key``, is served with the
        origin's header."""
        from sfnode.head.api.gate import GateLimits

        origin = "Origin: https://app.example"
        limits = GateLimits(cors_origins=frozenset({"https://app.example"}))
        head = self.head(api_keys=[KEY_A], limits=limits)
        for path, method in (("/v1/messages", "POST"), ("/v1/responses/resp_1", "DELETE")):
            asked = (origin, f"Access-Control-Request-Method: {method}",
                     "Access-Control-Request-Headers: x-api-key, anthropic-version")  # fmt: skip
            status, headers, _ = self.send(head, "OPTIONS", path, extra=asked)
            self.assertEqual(status, 204)
            allowed = {h.strip().lower() for h in
                       headers[b"access-control-allow-headers"].split(b",")}  # fmt: skip
            self.assertLessEqual(
                {b"authorization", b"content-type", b"x-api-key", b"anthropic-version"}, allowed
            )
            methods = {m.strip() for m in headers[b"access-control-allow-methods"].split(b",")}
            self.assertIn(method.encode(), methods)
        body = {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": INPUT}]}  # fmt: skip
        status, headers, content = self.send(
            head, "POST", "/v1/messages", body,
            extra=(origin, f"X-Api-Key: {KEY_A.decode()}", "anthropic-version: 2023-06-01"),
        )  # fmt: skip
        self.assertEqual(status, 200, content)
        self.assertEqual(json.loads(content)["type"], "message")
        self.assertEqual(headers[b"access-control-allow-origin"], b"https://app.example")


class PendingStoreTests(SynchronousTestCase):
    def test_a_response_still_being_packed_is_found_once_kept(self) -> None:
        """A response whose packing is under way (the answer already written) is found by
        its owner as soon as it is kept, never a 404 in between; another owner finds nothing
        at once; deleting it meanwhile answers its waiters with nothing and keeps nothing;
        a failed packing keeps nothing."""
        from twisted.internet.defer import Deferred

        from sfnode.head.api.responses import ResponseStore, pack

        store = ResponseStore()
        packing: Deferred[bytes] = Deferred()
        store.keep(b"a", "resp_1", packing)
        waiting = store.found(b"a", "resp_1")
        self.assertNoResult(waiting)
        self.assertIsNone(self.successResultOf(store.found(b"b", "resp_1")))
        data = pack([{"role": "user", "content": "hi"}], {"id": "resp_1"})
        packing.callback(data)
        self.assertEqual(self.successResultOf(waiting), data)
        self.assertEqual(self.successResultOf(store.found(b"a", "resp_1")), data)

        late: Deferred[bytes] = Deferred()
        store.keep(b"a", "resp_2", late)
        waiting = store.found(b"a", "resp_2")
        self.assertTrue(store.delete(b"a", "resp_2"))
        self.assertIsNone(self.successResultOf(waiting))
        late.callback(data)
        self.assertIsNone(store.get(b"a", "resp_2"))

        failing: Deferred[bytes] = Deferred()
        store.keep(b"a", "resp_3", failing)
        waiting = store.found(b"a", "resp_3")
        failing.errback(RuntimeError("packing failed"))
        self.failureResultOf(failing, RuntimeError)
        self.assertIsNone(self.successResultOf(waiting))
        self.assertEqual(len(store), 1)
