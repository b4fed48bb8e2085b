"""The head's reactor under the issue 30 attacks, as real processes: ``twistd sfhead`` with a
mock-engine ``twistd sfnode`` (tests/processes.py).

Two requests whose ``response_format`` schemas take seconds of native code to compile, a
``/v1/responses`` input of 9,000 items and a bystander's requests arrive at once.  The head's
own probe of its reactor (``sfhead_reactor_stalls_total`` in /metrics: a 20 ms timer that ran
more than 50 ms late) must count no stall while they are answered, the slow grammars get a 400
naming ``--grammar-timeout``, and the node's link is never dropped.  No sleeps: every wait is
on a line a process logs or on an HTTP answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator
from io import BytesIO
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, FileBodyProducer, readBody
from twisted.web.http_headers import Headers

from tests.processes import LOOPBACK, Child, loopback_head, node_endpoint, spawn_twistd, spawner

Gen = Generator[defer.Deferred[Any], Any, None]


def slow_schema(prefix: str, count: int = 220) -> dict[str, Any]:
    """A JSON Schema of ``count`` ``patternProperties``: about a second of compiling at 220
    (the issue's 400 took 12 s), different for each ``prefix`` (no cache answers it)."""
    patterns = {f"^{prefix}{i}[a-z]+$": {"type": "string"} for i in range(count)}
    return {"type": "object", "patternProperties": patterns}


def metric(text: bytes, name: str) -> float:
    found = re.search(rb"^" + re.escape(name.encode()) + rb" (\S+)$", text, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


class ReactorStallTests(TestCase):
    timeout = 180

    @defer.inlineCallbacks
    def start(self) -> Generator[defer.Deferred[Any], Any, str]:
        """A mock node and a head (``--grammar-timeout 0.5``) that dialed it; the base URL."""
        node = spawn_twistd(
            self,
            Child("node"),
            ["sfnode", "--listen", LOOPBACK, "--engine", "mock", "--identity", "proc0"],
        )
        endpoint = yield node_endpoint(node)
        head, base = yield loopback_head(
            spawner(self), "--model-name", "mock", "--grammar-timeout", "0.5", nodes=[endpoint]
        )
        yield head.wait_for(rb"node proc0 joined")
        self.head = head
        return base

    @defer.inlineCallbacks
    def send(
        self, base: str, path: str, body: dict[str, Any] | None = None
    ) -> Generator[defer.Deferred[Any], Any, tuple[int, bytes]]:
        agent = Agent(reactor)
        if body is None:
            response = yield agent.request(b"GET", (base + path).encode())
        else:
            response = yield agent.request(
                b"POST",
                (base + path).encode(),
                Headers({b"content-type": [b"application/json"]}),
                FileBodyProducer(BytesIO(json.dumps(body).encode())),
            )
        content = yield readBody(response)
        return response.code, content

    @defer.inlineCallbacks
    def test_slow_grammars_and_a_long_input_never_stall_the_reactor(self) -> Gen:
        """While two schemas that take a second each to compile and a Responses input of
        9,000 items are answered, the head's reactor never runs 50 ms late (its probe counts
        no such stall), the bystander's completions and /healthz are answered, both slow
        schemas get 400 ``grammar_timeout`` naming the limit, and the node's link stays up
        with no reconnect."""
        base = yield self.start()
        completion = {"model": "mock", "prompt": [5, 6, 7], "max_tokens": 4}
        code, _ = yield self.send(base, "/v1/completions", completion)
        self.assertEqual(code, 200)
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
        code, content = yield self.send(
            base, "/v1/completions", {**completion, "response_format": fmt}
        )
        # The grammar compiled (on a worker); the mock node enforces none: the fleet says so.
        self.assertEqual(
            (code, json.loads(content)["error"]["code"]), (400, "unsupported_parameter")
        )
        _, before = yield self.send(base, "/metrics")

        def slow(prefix: str) -> defer.Deferred[tuple[int, bytes]]:
            schema = {"name": "n", "schema": slow_schema(prefix)}
            fmt = {"type": "json_schema", "json_schema": schema}
            return self.send(base, "/v1/completions", {**completion, "response_format": fmt})

        items = [{"type": "message", "role": "user", "content": "x"}] * 9000
        attacks = [
            slow("a"),
            slow("b"),
            self.send(base, "/v1/responses", {"model": "mock", "input": items}),
        ]
        bystander = []
        for _ in range(5):
            bystander.append((yield self.send(base, "/v1/completions", completion))[0])
            bystander.append((yield self.send(base, "/healthz"))[0])
        answers = yield defer.gatherResults(attacks)
        _, after = yield self.send(base, "/metrics")
        self.assertEqual(set(bystander), {200})
        for code, content in answers[:2]:
            error = json.loads(content)["error"]
            self.assertEqual((code, error["code"]), (400, "grammar_timeout"), content)
            self.assertIn("--grammar-timeout", error["message"])
        self.assertLess(answers[2][0], 500, answers[2][1])
        self.assertEqual(
            metric(after, "sfhead_reactor_stalls_total"),
            metric(before, "sfhead_reactor_stalls_total"),
            after.decode(),
        )
        self.assertEqual(metric(after, "sfhead_reconnects_total"), 0.0)
        self.assertEqual(metric(after, 'sfhead_node_up{node="proc0"}'), 1.0)
