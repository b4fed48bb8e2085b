"""Hypothesis fuzzing of the head's request parser: random JSON shapes and values for every field.

Two levels: the pure parser (``sfnode.head.api.schema.parse_request``, thousands of bodies: it
returns a checked request or raises HttpError, nothing else), and the whole HTTP path in memory
(the API's real site and guards, the fleet and a mock node behind it on a memory reactor,
tests/memoryhead.py): every answer is JSON, no status is 500 or more, and nothing is logged
with a traceback (trial fails a test that logs an error).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.api.schema import (
    CONSTRAINT_FIELDS,
    IGNORED,
    MAX_N,
    TOOL_FIELDS,
    UNSUPPORTED,
    CompletionRequest,
    parse_request,
)
from sfnode.runtime.http_guard import HttpError
from tests.memoryhead import MemoryHeadTestCase
from tests.test_http import MODEL
from tests.test_http_hostile import request_bytes

FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "min_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "logprobs",
    "top_logprobs",
    *sorted(UNSUPPORTED), *sorted(IGNORED), *CONSTRAINT_FIELDS, *TOOL_FIELDS,
]  # fmt: skip

# Text with lone surrogates and other awkward characters mixed in.
texts = st.text(
    st.characters(codec=None, exclude_categories=()) | st.sampled_from("\ud800\udfff\x00é🙂"),
    max_size=40,
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"])},
        optional={
            "content": texts
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": texts}
                ),
                max_size=3,
            )
            | json_values,
            "name": texts,
            "tool_calls": json_values,
        },
    ),
    max_size=4,
)
plausible: dict[str, Any] = {
    "model": st.just(MODEL) | texts,
    "messages": messages,
    "prompt": st.lists(st.integers(min_value=-5, max_value=1 << 41), max_size=6)
    | texts
    | st.lists(texts, max_size=3),
    "max_tokens": st.integers(min_value=-2, max_value=6),
    "max_completion_tokens": st.integers(min_value=-2, max_value=6),
    "temperature": st.floats(min_value=-1, max_value=3),
    "n": st.integers(min_value=-1, max_value=MAX_N + 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}),
    "stop": texts | st.lists(texts, max_size=5),
    "logprobs": st.booleans() | st.integers(0, 6),
    "top_logprobs": st.integers(-1, 21),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": json_values})},
    ),
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": st.just("f") | texts}, optional={"parameters": json_values}
                ),
            }
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(["none", "auto", "required"])
    | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": texts})}
    ),
    "logit_bias": st.dictionaries(
        st.integers(-1, 600).map(str) | texts, st.floats(-200, 200), max_size=3
    ),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 11),
}


def valid(chat: bool) -> dict[str, Any]:
    """A request the head serves (three tokens)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    return body


def value_of(name: str) -> st.SearchStrategy[Any]:
    """A value for field ``name``: a plausible one (two times in three) or any JSON value."""
    strategy = plausible.get(name)
    if strategy is None:
        return json_values
    return st.one_of(strategy, strategy, json_values)


@st.composite
def requests(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """(body, chat): a few fields of random values, now and then an unknown one."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        body[name] = draw(value_of(name))
    if draw(st.integers(0, 9)) == 0:
        body[draw(texts)] = draw(json_values)
    return body, chat


@st.composite
def one_field_changed(draw: st.DrawFn, name: str) -> tuple[dict[str, Any], bool]:
    """(body, chat): a valid request with field ``name`` set to a drawn value, so that every
    field is reached past the others' checks."""
    chat = {"prompt": False, "messages": True, "max_completion_tokens": True}.get(name)
    if chat is None:
        chat = draw(st.booleans())
    body = valid(chat)
    body[name] = draw(value_of(name))
    return body, chat


class ParserFuzzTests(SynchronousTestCase):
    @settings(max_examples=1500, deadline=None, database=None)
    @given(request=requests())
    def test_any_body_is_a_checked_request_or_an_api_error(
        self, request: tuple[dict[str, Any], bool]
    ) -> None:
        """parse_request on any JSON object returns a CompletionRequest whose choices all
        have u64 seeds, or raises HttpError with a 4xx status; nothing else escapes."""
        body, chat = request
        try:
            checked = parse_request(
                body, chat=chat, models=[MODEL], vocab_size=512, seed_source=lambda: 7
            )
        except HttpError as e:
            self.assertIn(e.status, (400, 404))
            json.dumps(e.body())
            return
        self.assertIsInstance(checked, CompletionRequest)
        self.assertTrue(1 <= checked.n <= MAX_N)
        for i in range(checked.n):
            self.assertTrue(0 <= checked.choice_params(i).seed < 1 << 64)


class HttpFuzzTests(MemoryHeadTestCase):
    """The whole HTTP path, from a request's bytes through the real site, its guards, the
    exchange, the fleet and a mock node, in memory (tests/memoryhead.py)."""

    def test_no_body_makes_the_head_answer_500_or_log_a_traceback(self) -> None:
        """Random bodies to both completion endpoints of a head with a live mock node (window
        64), first a valid request with each field in turn set to random values, then bodies
        of random fields: every answer is JSON with a status below 500 (a 200 for what
        parses, 4xx in OpenAI's shape for the rest), streams included."""
        self.start_vocab_node(context_window=64)
        head = self.start_head()
        seen: set[int] = set()

        def check(request: tuple[dict[str, Any], bool]) -> None:
            body, chat = request
            path = "/v1/chat/completions" if chat else "/v1/completions"
            status, headers, content = self.exchange(
                head, request_bytes(path, json.dumps(body).encode())
            )
            seen.add(status)
            assert status < 500, (status, body, content)
            if headers.get(b"content-type") == b"text/event-stream":
                assert content.endswith(b"data: [DONE]\n\n"), content
                return
            answer = json.loads(content)
            if status != 200:
                assert set(answer["error"]) == {"message", "type", "param", "code"}, answer

        quick = settings(
            max_examples=5,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        for name in FIELDS:
            examples = 20 if name in plausible else 5
            settings(quick, max_examples=examples)(given(one_field_changed(name))(check))()
        settings(quick, max_examples=60)(given(requests())(check))()
        self.assertLessEqual({200, 400}, seen)
