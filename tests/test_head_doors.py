"""The head's closed doors, round two (issue 30), on the memory head (tests/memoryhead.py): what
one API key's requests leave behind belongs to that key, client input is parsed within bounds
and refused in OpenAI's shape, a chat template from a node is bounded in what it builds, models
leave with their last node, and the response store counts what it holds.

Each test is one finding of the issue, tried as the attacker tried it, on a head with mock nodes
in memory (no socket, no thread, no sleep).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfnode.head.api.gate import GateLimits
from tests.memoryhead import MemoryHead, MemoryHeadTestCase
from tests.test_http import MODEL
from tests.test_http_fuzz import json_values, messages, plausible, texts, valid
from tests.test_http_hostile import request_bytes

KEY_A = b"sk-tenant-a-" + b"a" * 20
KEY_B = b"sk-tenant-b-" + b"b" * 20


class DoorsTestCase(MemoryHeadTestCase):
    def post(
        self, head: MemoryHead, path: str, body: Any, key: bytes | None = None
    ) -> tuple[int, dict[str, Any]]:
        """The status and JSON body of one POST (with ``key`` as the bearer token)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        extra = [f"Authorization: Bearer {key.decode()}"] if key is not None else []
        status, _, content = self.exchange(head, request_bytes(path, data, extra=extra))
        return status, json.loads(content)


class OwnedResponsesTests(DoorsTestCase):
    def test_another_key_gets_the_404_of_an_unknown_id(self) -> None:
        """A response stored by key A is continued by A; key B naming its id gets exactly the
        404 ``previous_response_not_found`` an id nobody stored gets (same body but for the
        id), and nothing of A's conversation reaches a node for B."""
        self.start_vocab_node()
        head = self.start_head(api_keys=[KEY_A, KEY_B])
        secret = "the launch code is 0000"
        body = {"model": MODEL, "input": secret, "max_output_tokens": 2}
        status, first = self.post(head, "/v1/responses", body, KEY_A)
        self.assertEqual(status, 200, first)
        again = {"model": MODEL, "input": "go on", "max_output_tokens": 2}
        status, _ = self.post(
            head, "/v1/responses", {**again, "previous_response_id": first["id"]}, KEY_A
        )
        self.assertEqual(status, 200)
        crossed = self.post(
            head, "/v1/responses", {**again, "previous_response_id": first["id"]}, KEY_B
        )
        unknown_id = "resp_" + "0" * 32
        unknown = self.post(
            head, "/v1/responses", {**again, "previous_response_id": unknown_id}, KEY_B
        )
        self.assertEqual(crossed[0], 404)
        self.assertEqual(
            json.dumps(crossed[1]).replace(first["id"], "ID"),
            json.dumps(unknown[1]).replace(unknown_id, "ID"),
        )
        self.assertEqual(crossed[1]["error"]["code"], "previous_response_not_found")

    def test_a_keyless_head_keeps_responses_for_its_one_owner(self) -> None:
        """On a head without keys (loopback) a stored response is continued as before: its
        owner is None, the same for every request."""
        self.start_vocab_node()
        head = self.start_head()
        body = {"model": MODEL, "input": "hello", "max_output_tokens": 2}
        status, first = self.post(head, "/v1/responses", body)
        self.assertEqual(status, 200, first)
        status, second = self.post(
            head, "/v1/responses", {**body, "previous_response_id": first["id"]}
        )
        self.assertEqual(status, 200, second)


# --- item 3: no client input answers 5xx -------------------------------------------------------

digits = st.text("0123456789", min_size=1, max_size=6000)
"""Token ids as strings, of any length (Python refuses to convert more than 4300 digits)."""
deep = st.integers(1, 80).map(lambda depth: json.loads("[" * depth + "]" * depth))
many = st.integers(0, 3000).map(lambda count: [{"type": "text", "text": "x"}] * count)
hostile = st.one_of(json_values, digits, deep, many, st.integers(-(10**400), 10**400))
"""Values an attacker tries: long digit strings, deep nesting, long arrays, huge numbers."""
chat_fields: dict[str, Any] = {
    **plausible,
    "logit_bias": st.dictionaries(digits | texts, st.floats(-200, 200) | hostile, max_size=3),
    "messages": messages | many | deep,
}
responses_fields: dict[str, Any] = {
    "model": st.just(MODEL) | texts,
    "input": texts
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["message", "function_call", "function_call_output", "x"])},
            optional={
                "role": st.sampled_from(["user", "assistant", "system", "tool"]),
                "content": texts | hostile,
                "call_id": texts | hostile,
                "name": texts,
                "arguments": texts | hostile,
                "output": texts | hostile,
            },
        ),
        max_size=4,
    )
    | hostile,
    "instructions": texts | hostile,
    "tools": st.lists(
        st.fixed_dictionaries(
            {"type": st.just("function"), "name": st.just("f") | texts},
            optional={"parameters": json_values},
        ),
        max_size=2,
    )
    | hostile,
    "text": st.fixed_dictionaries(
        {},
        optional={
            "format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema"])},
                optional={"schema": json_values, "name": texts},
            )
            | hostile
        },
    )
    | hostile,
    "max_output_tokens": st.integers(-2, 6) | hostile,
    "previous_response_id": texts | hostile,
    "store": st.booleans() | hostile,
    "logit_bias": chat_fields["logit_bias"],
    "tool_choice": plausible["tool_choice"] | hostile,
    "metadata": hostile,
    "temperature": hostile,
}


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """(path, body): a valid request of one of the three routes with a few fields set to
    drawn values, plausible or hostile."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]))
    if path == "/v1/responses":
        fields, body = responses_fields, {"model": MODEL, "input": "hi", "max_output_tokens": 3}
    else:
        fields, body = chat_fields, valid(path == "/v1/chat/completions")
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3)):
        body[name] = draw(st.one_of(fields[name], hostile))
    return path, body


class NoServerErrorTests(DoorsTestCase):
    def test_a_logit_bias_key_of_5000_digits_is_a_400_on_every_route(self) -> None:
        """``logit_bias`` with a key of 5,000 digits (more than Python converts) is a 400
        naming ``logit_bias`` in OpenAI's shape on chat, completions and responses, never a
        500."""
        self.start_vocab_node()
        head = self.start_head()
        bias = {"9" * 5000: 1}
        for path, body in [
            ("/v1/chat/completions", {**valid(True), "logit_bias": bias}),
            ("/v1/completions", {**valid(False), "logit_bias": bias}),
            ("/v1/responses", {"model": MODEL, "input": "hi", "logit_bias": bias}),
        ]:
            status, answer = self.post(head, path, body)
            self.assertEqual((status, answer["error"]["param"]), (400, "logit_bias"), path)

    def test_an_array_of_more_items_than_the_bound_is_a_400_naming_its_field(self) -> None:
        """A Responses ``input`` of 118k items (the issue's 3.9 MB body) and chat
        ``messages`` one past the bound are refused before any item is converted: 400
        ``too_many_items`` naming the field; at the bound the messages are read (what refuses
        them then is the model's window)."""
        from sfnode.head.api.schema import MAX_JSON_ITEMS

        self.start_vocab_node()
        head = self.start_head(limits=GateLimits(max_body=8 << 20))
        item = {"type": "message", "role": "user", "content": "x"}
        status, answer = self.post(
            head, "/v1/responses", {"model": MODEL, "input": [item] * 118_000}
        )
        self.assertEqual((status, answer["error"]["param"]), (400, "input"))
        self.assertEqual(answer["error"]["code"], "too_many_items")
        turn = {"role": "user", "content": "x"}
        body = {**valid(True), "messages": [turn] * (MAX_JSON_ITEMS + 1)}
        status, answer = self.post(head, "/v1/chat/completions", body)
        self.assertEqual((status, answer["error"]["param"]), (400, "messages"))
        status, answer = self.post(
            head, "/v1/chat/completions", {**body, "messages": [turn] * MAX_JSON_ITEMS}
        )
        self.assertEqual((status, answer["error"]["code"]), (400, "context_length_exceeded"))

    def test_no_request_of_the_schema_answers_5xx(self) -> None:
        """Property: any body built over the request schema of chat, completions and
        responses, its fields plausible or hostile (long digit strings, deep nesting, long
        arrays, huge numbers), is answered below 500, and every error in OpenAI's shape."""
        self.start_vocab_node(context_window=64)
        head = self.start_head()

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(hostile_requests())
        def check(request: tuple[str, dict[str, Any]]) -> None:
            path, body = request
            status, _, content = self.exchange(head, request_bytes(path, json.dumps(body).encode()))
            assert status < 500, (status, path, body, content[:300])
            if status != 200:
                error = json.loads(content)["error"]
                assert set(error) == {"message", "type", "param", "code"}, error

        check()
