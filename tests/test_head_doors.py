"""The head's closed doors, round two (issue 30), on the memory head (tests/memoryhead.py): what
one API key's requests leave behind belongs to that key, client input is parsed within bounds
and refused in OpenAI's shape, a chat template from a node is bounded in what it builds, models
leave with their last node, and the response store counts what it holds.

Each test is one finding of the issue, tried as the attacker tried it, on a head with mock nodes
in memory (no socket, no thread, no sleep).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.api.gate import GateLimits
from sfnode.head.api.grammars import GrammarChecks
from sfnode.head.api.workers import Workers
from sfnode.linkf.wire import JsonSchemaGrammar
from sfnode.runtime.http_guard import HttpError
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


# --- item 4: a chat template from a node is bounded in what it builds and writes -----------------

DOUBLING = (
    '{% set s = namespace(v="x") %}{% for i in range(27) %}{% set s.v = s.v ~ s.v %}'
    "{% endfor %}{{ s.v | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
)
"""The issue's template: a string doubled 27 times (134 million characters)."""
WRITING = '{% for i in range(3000) %}{{ "y" * 1000 }}{% endfor %}'
"""The issue's other template: 3 MB of output for every chat."""
TOJSON_OF_A_FUNCTION = (
    "{{ raise_exception | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
)


class TemplateBoundsTests(DoorsTestCase):
    def template_head(self, template: str) -> tuple[MemoryHead, int]:
        """A head serving ``tiny`` with ``template``, sent by its node; and the render's cap
        (the characters the node's window can hold)."""
        from sfnode.engines.mock import MockEngine
        from sfnode.head.api.http import OpenAIApi
        from sfnode.head.fleet.model_admission import ModelAdmission
        from sfnode.head.models.registry import ModelRegistry
        from tests.memoryhead import InlineWorkers
        from tests.test_fleet_models import bundle_of
        from tests.tinymodel import TINY_VOCAB

        engine = MockEngine(self.reactor, vocab_size=TINY_VOCAB)
        node = self.start_mock_node(
            "n", engine=engine, model_name="tiny", model_files=bundle_of(self.mktemp(), template)
        )
        registry = ModelRegistry()
        fleet = self.fleet_of([node], models=ModelAdmission(registry))
        api = OpenAIApi(
            self.reactor, fleet, None, "tiny", models=registry, seed_source=lambda: 7,
            workers=InlineWorkers(),  # type: ignore[arg-type]
        )  # fmt: skip
        self.addCleanup(api.stop)
        self.until(lambda: registry.get("tiny") is not None)
        served = registry.get("tiny")
        assert served is not None
        window = api.status("tiny").context_limit
        assert window is not None
        return MemoryHead(fleet, api), served.renderer.character_bound(window)

    def chat(self, head: MemoryHead) -> tuple[int, dict[str, Any]]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return self.post(head, "/v1/chat/completions", body)

    def test_a_string_doubled_27_times_is_refused_at_the_cap(self) -> None:
        """The doubling template is stopped when its string passes the render's cap (what the
        window holds, thousands of characters, not the 134 million it asks for): a 400
        ``template_limit`` naming that cap, never a 500."""
        head, cap = self.template_head(DOUBLING)
        status, answer = self.chat(head)
        self.assertEqual((status, answer["error"]["code"]), (400, "template_limit"), answer)
        self.assertIn(f"more than {cap} characters", answer["error"]["message"])
        self.assertLess(cap, 1 << 22)

    def test_a_template_writing_megabytes_is_stopped_while_it_renders(self) -> None:
        """The template writing 3 MB per chat is stopped once its output passes the cap: a
        400 ``template_limit`` saying so."""
        head, cap = self.template_head(WRITING)
        status, answer = self.chat(head)
        self.assertEqual((status, answer["error"]["code"]), (400, "template_limit"), answer)
        self.assertIn(f"rendered more than {cap} characters", answer["error"]["message"])

    def test_tojson_of_a_function_is_the_templates_refusal_not_a_500(self) -> None:
        """``tojson`` on a function: a 400 saying the template refused the messages."""
        head, _ = self.template_head(TOJSON_OF_A_FUNCTION)
        status, answer = self.chat(head)
        self.assertEqual((status, answer["error"]["param"]), (400, "messages"), answer)
        self.assertIn("tojson", answer["error"]["message"])


class SandboxTests(SynchronousTestCase):
    """The bounded sandbox alone (sfnode.head.models.sandbox): every way of building a value
    in one C call is checked before the call."""

    def refused(self, source: str, cap: int = 1000) -> str:
        from jinja2 import TemplateError

        from sfnode.head.models.sandbox import is_limit, render_bounded, template_environment

        template = template_environment().from_string(source)
        with self.assertRaises(TemplateError) as caught:
            render_bounded(template, cap)
        self.assertTrue(is_limit(caught.exception), caught.exception)
        return str(caught.exception)

    def test_every_builder_of_a_large_value_is_refused(self) -> None:
        """``~``, ``+``, ``*``, ``%`` with a width, ``.format`` with a width, ``center``,
        ``join`` of a long list, ``replace`` that grows and ``tojson`` with a huge indent: each
        refused past a cap of 1000, before the call that would build it."""
        for source in [
            '{% set s = "x" * 600 %}{{ s ~ s }}',
            '{% set s = "x" * 600 %}{{ s + s }}',
            '{{ "x" * 1001 }}',
            '{{ "%99999999s" % "x" }}',
            '{{ "{:>99999999}".format("x") }}',
            '{{ "x" | center(5000) }}',
            '{{ "x".center(5000) }}',
            '{% set s = "x" * 100 %}{{ [s, s, s, s, s, s, s, s, s, s, s] | join }}',
            '{% set s = "x" * 100 %}{{ ",".join([s, s, s, s, s, s, s, s, s, s, s]) }}',
            '{% set s = "a" * 100 %}{{ s.replace("a", "bbbbbbbbbbbb") }}',
            '{% set s = "a" * 100 %}{{ s | replace("a", "bbbbbbbbbbbb") }}',
            '{{ [1, [2, [3]]] | tojson(indent=99999999) }}',
        ]:
            self.refused(source)

    def test_a_template_within_the_cap_renders_as_jinja_does(self) -> None:
        """What stays within the cap renders unchanged (``~`` included)."""
        from sfnode.head.models.sandbox import render_bounded, template_environment

        source = '{% for m in messages %}{{ m.role ~ ": " ~ m.content | tojson }}\n{% endfor %}'
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        template = template_environment().from_string(source)
        self.assertEqual(
            render_bounded(template, 1000, messages=messages), 'user: "hi"\nassistant: "yo"\n'
        )


# --- item 6: the store's bound counts the memory it holds ----------------------------------------


def held_by(root: Any) -> int:
    """The bytes of every object reachable from ``root`` through containers (each counted
    once): what keeping ``root`` costs."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return total


class StoreMemoryTests(DoorsTestCase):
    def test_the_bound_holds_the_memory_the_store_keeps_and_metrics_show_it(self) -> None:
        """Twenty stored responses of 300 input items each, in a store bounded to 64 KiB: the
        memory every entry of the store reaches stays within the bound (on JSON characters
        it was about 7 times the bound), and ``sfhead_responses_stored_bytes`` in /metrics
        is the figure the store counts, covering what it holds."""
        from sfnode.head.api.responses import ResponseStore

        bound = 64 * 1024
        self.start_vocab_node(context_window=100_000)
        store = ResponseStore(1024, bound)
        head = self.start_head(responses=store)
        items = [{"role": "user", "content": f"hello {i}"} for i in range(300)]
        for _ in range(20):
            status, answer = self.post(
                head, "/v1/responses", {"model": MODEL, "input": items, "max_output_tokens": 2}
            )
            self.assertEqual(status, 200, answer)
        entries = store._entries  # what the store keeps, to measure it
        self.assertGreater(len(entries), 0)
        reached = held_by(entries)
        self.assertLessEqual(reached, bound)
        status, content = self.call(head, b"GET", "/metrics")
        line = [
            row
            for row in content.decode().splitlines()
            if row.startswith("sfhead_responses_stored_bytes ")
        ]
        self.assertEqual(len(line), 1, content[:2000])
        shown = float(line[0].split()[1])
        self.assertEqual(shown, store.held)
        self.assertLessEqual(reached - sys.getsizeof(entries), shown)


# --- item 2: work off the reactor, shared fairly, within budgets ---------------------------------


class HeldStarts:
    """The workers' threads, held: each job runs only when the test finishes it."""

    def __init__(self) -> None:
        self.started: list[tuple[Callable[[], Any], Deferred[Any]]] = []

    def __call__(self, work: Callable[[], Any]) -> Deferred[Any]:
        done: Deferred[Any] = Deferred()
        self.started.append((work, done))
        return done

    def finish(self, index: int) -> None:
        work, done = self.started[index]
        done.callback(work())


class FairWorkersTests(SynchronousTestCase):
    """sfnode.head.api.workers.Workers with held threads and a Clock."""

    def test_one_clients_queue_cannot_starve_another(self) -> None:
        """A client with two jobs running and ten waiting (both threads of the pool) does
        not delay another client's job: it starts at once, on a thread of its own; the first
        client never runs more than two at once, and the queues are served round robin."""
        clock, starts = Clock(), HeldStarts()
        workers = Workers(clock, 2, max_threads=8, start=starts)
        order: list[str] = []
        for i in range(12):
            workers.run(lambda i=i: order.append(f"a{i}"), "attacker")
        self.assertEqual((len(starts.started), workers.queued()), (2, 10))
        victim = workers.run(lambda: order.append("v"), "victim")
        self.assertEqual(len(starts.started), 3)
        starts.finish(2)
        self.assertEqual(self.successResultOf(victim), None)
        workers.run(lambda: order.append("w"), "other")
        starts.finish(0)
        self.assertLessEqual(workers.running["attacker"], 2)
        self.assertEqual(order, ["v", "a0"])

    def test_a_job_past_its_budget_is_refused_at_once_and_counted_until_it_ends(self) -> None:
        """A job with a budget of 2 s is refused with its refusal at 2 s (a 400 naming the
        limit), its late result dropped; until its thread ends it still counts against its
        client, whose next job waits while other clients' jobs start."""
        clock, starts = Clock(), HeldStarts()
        workers = Workers(clock, 2, max_threads=8, start=starts)
        refusal = HttpError(400, "over 2 s (--grammar-timeout)", code="grammar_timeout")
        slow = [
            workers.run(lambda: "late", "a", budget_s=2.0, refusal=lambda: refusal)
            for _ in range(3)
        ]
        clock.advance(1.99)
        self.assertNoResult(slow[0])
        clock.advance(0.01)
        self.assertIs(self.failureResultOf(slow[0], HttpError).value, refusal)
        self.assertIs(self.failureResultOf(slow[1], HttpError).value, refusal)
        self.assertEqual(len(starts.started), 2)  # "a" still runs two (past their budget)
        other = workers.run(lambda: "served", "b")
        self.assertEqual(len(starts.started), 3)
        starts.finish(2)
        self.assertEqual(self.successResultOf(other), "served")
        starts.finish(0)
        self.assertEqual(len(starts.started), 4)  # now a's third job starts
        self.assertNoResult(slow[2])


class GrammarCacheTests(SynchronousTestCase):
    """sfnode.head.api.grammars.GrammarChecks on held workers."""

    def test_each_grammar_is_compiled_once_and_its_verdict_kept(self) -> None:
        """Two requests with the same schema while it compiles: one compile, both answered;
        the same schema later: no compile.  A schema the library refuses: a 400 naming
        response_format, the same again from the cache.  One whose compile passes the
        time limit: 400 grammar_timeout at the limit, and at once on a repeat."""
        clock, starts = Clock(), HeldStarts()
        checks = GrammarChecks(Workers(clock, 2, start=starts), timeout_s=2.0)
        good = JsonSchemaGrammar(json.dumps({"type": "object"}))
        first, second = checks.check(good, "a"), checks.check(good, "b")
        self.assertEqual(len(starts.started), 1)
        starts.finish(0)
        self.successResultOf(first)
        self.successResultOf(second)
        self.successResultOf(checks.check(good, "c"))
        bad = JsonSchemaGrammar(json.dumps({"type": "string", "pattern": "(?=a)"}))
        refused = checks.check(bad, "a")
        starts.finish(1)
        error = self.failureResultOf(refused, HttpError).value
        self.assertEqual((error.status, error.param), (400, "response_format"))
        again = self.failureResultOf(checks.check(bad, "a"), HttpError).value
        self.assertEqual(again.message, error.message)
        slow = JsonSchemaGrammar(json.dumps({"type": "integer"}))
        timed = checks.check(slow, "a")
        clock.advance(2.0)
        self.assertEqual(self.failureResultOf(timed, HttpError).value.code, "grammar_timeout")
        self.assertEqual(
            self.failureResultOf(checks.check(slow, "b"), HttpError).value.code,
            "grammar_timeout",
        )
        self.assertEqual(checks.compiles, 3)


# --- item 5: models leave with their last node; caps on what nodes bring ------------------------


class NodeModelsTests(DoorsTestCase):
    """A head with no tokenizer of its own; nodes dial in with their own bundles and leave."""

    def model_head(self, registry: Any, grace_s: float = 5.0) -> MemoryHead:
        from sfnode.head.api.http import OpenAIApi
        from sfnode.head.fleet.model_admission import ModelAdmission
        from tests.memoryhead import FLEET_PORT, InlineWorkers

        admission = ModelAdmission(registry, clock=self.reactor, grace_s=grace_s)
        fleet = self.fleet_of([], models=admission)
        api = OpenAIApi(
            self.reactor, fleet, None, "none", models=registry, seed_source=lambda: 7,
            workers=InlineWorkers(),  # type: ignore[arg-type]
        )  # fmt: skip
        self.addCleanup(api.stop)
        self.reactor.listenTCP(FLEET_PORT, fleet.listen_factory(), interface="127.0.0.1")
        return MemoryHead(fleet, api)

    def dial_in_with(self, head: MemoryHead, identity: str, model: str, template: str) -> Any:
        """A mock node that dials the head with the tiny tokenizer and ``template`` as its
        files, once it is judged."""
        from tests.test_fleet_models import bundle_of
        from tests.tinymodel import TINY_VOCAB

        agent = self.dial_in(head, identity, model, bundle_of(self.root, template), TINY_VOCAB)
        admission = head.fleet.models
        assert admission is not None
        self.until(lambda: not admission.fetching())
        return agent

    def listed(self, head: MemoryHead) -> list[str]:
        status, content = self.call(head, b"GET", "/v1/models")
        self.assertEqual(status, 200)
        return [entry["id"] for entry in json.loads(content)["data"]]

    def test_models_leave_with_their_last_node_after_the_grace(self) -> None:
        """Three nodes join with distinct bundles and leave: their models stay listed, in
        /metrics and in memory for the grace (5 s), then are gone from all three; a model
        whose node comes back within the grace stays."""
        from sfnode.head.models.registry import ModelRegistry

        self.root = self.mktemp()
        registry = ModelRegistry()
        head = self.model_head(registry)
        agents = [
            self.dial_in_with(head, f"n{i}", f"m{i}", "{{ messages[0].content }}" + " " * i)
            for i in range(3)
        ]
        self.assertEqual(self.listed(head), ["m0", "m1", "m2"])
        self.assertEqual(registry.bundles, 3)
        for agent in agents:
            self.wait(agent.close_connections("leaving"))
        self.until(lambda: not head.fleet.nodes)
        self.advance(4.0)
        self.assertEqual(self.listed(head), ["m0", "m1", "m2"])
        back = self.dial_in_with(head, "n0b", "m0", "{{ messages[0].content }}")
        self.advance(1.5)
        self.assertEqual(self.listed(head), ["m0"])
        self.assertEqual(registry.bundles, 1)
        _, metrics = self.call(head, b"GET", "/metrics")
        self.assertIn(b'model_name="m0"', metrics)
        self.assertNotIn(b'model_name="m1"', metrics)
        self.assertNotIn(b'model_name="m2"', metrics)
        status, answer = self.post(
            head, "/v1/chat/completions",
            {"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        )  # fmt: skip
        self.assertEqual((status, answer["error"]["code"]), (404, "model_not_found"))
        self.assertTrue(back.connections)

    def test_a_node_past_the_model_cap_is_refused_with_the_reason(self) -> None:
        """With at most 2 models from nodes, a third model's node is refused (it stays
        connected, takes no requests) with a reason naming --max-node-models, and its files
        are never fetched (two bundles kept)."""
        from sfnode.head.models.registry import ModelRegistry

        self.root = self.mktemp()
        registry = ModelRegistry(max_models=2)
        head = self.model_head(registry)
        for i in range(3):
            self.dial_in_with(head, f"n{i}", f"m{i}", "{{ messages[0].content }}" + " " * i)
        self.assertEqual(self.listed(head), ["m0", "m1"])
        admission = head.fleet.models
        assert admission is not None
        third = head.fleet.node_named("n2")
        assert third is not None
        reason = admission.refusal(third.link)
        assert reason is not None
        self.assertIn("--max-node-models 2", reason)
        self.assertEqual(registry.bundles, 2)

    def test_a_node_whose_files_pass_the_byte_cap_is_refused_unfetched(self) -> None:
        """With a byte cap below a bundle, its node is refused naming --max-model-bytes and
        its files are never fetched (no model, no bundle kept)."""
        from sfnode.head.models.registry import ModelRegistry

        self.root = self.mktemp()
        small = ModelRegistry(max_bytes=1000)
        other = self.model_head(small)
        self.dial_in_with(other, "big", "m-big", "{{ messages[0].content }}")
        node = other.fleet.node_named("big")
        assert node is not None and other.fleet.models is not None
        reason = other.fleet.models.refusal(node.link)
        assert reason is not None
        self.assertIn("--max-model-bytes 1000", reason)
        self.assertEqual((small.bundles, small.names()), (0, ()))
