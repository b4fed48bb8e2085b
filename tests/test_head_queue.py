"""The head's queue seen over HTTP (sfnode.head.fleet.fleet and sfnode.head.api.http) on real TCP.

A completion that no live node can take waits for one; a full queue answers 503 ``queue_full``
at once; a client that disconnects while its request waits takes it out of the queue; a node
that dials in serves what waited; ``/healthz`` and ``/metrics`` show the queue.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from typing import Any

from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.internet.protocol import Protocol

from sfnode.generation import MockEngine
from sfnode.node.agent import NodeAgent
from sfnode.node.config import NodeConfig
from sfnode.node.tap import node_factory
from tests.test_http import MESSAGES, MODEL, HttpTestCase, expected_tokens, post_bytes
from tests.tinymodel import TINY_VOCAB


@defer.inlineCallbacks
def until(predicate: Callable[[], bool], what: str) -> Generator[Any, Any, None]:
    """Wait (polling every 10 ms, for at most 30 s) until ``predicate()`` holds."""
    for _ in range(3000):
        if predicate():
            return
        yield task.deferLater(reactor, 0.01, lambda: None)
    raise AssertionError(f"timed out waiting until {what}")


class _Silent(Protocol):
    """A raw HTTP client that sends one request and reads nothing in particular."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.received = b""

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(post_bytes(self.body))

    def dataReceived(self, data: bytes) -> None:
        self.received += data


class QueueOverHttpTests(HttpTestCase):
    @defer.inlineCallbacks
    def test_a_full_queue_answers_503_at_once_and_a_gone_client_leaves_it(
        self,
    ) -> Generator[Any, Any, None]:
        """With no node and room for one waiting request: the first waits (healthz and metrics
        show it queued), the second gets 503 queue_full at once, and when the first client
        disconnects its request leaves the queue."""
        head = yield self.start_head([], fleet_options={"max_queued": 1, "queue_timeout_s": 600})
        waiting = _Silent({"model": MODEL, "messages": MESSAGES, "stream": True})
        yield connectProtocol(
            TCP4ClientEndpoint(reactor, "127.0.0.1", head.port.getHost().port), waiting
        )
        yield until(lambda: head.fleet.queued == 1, "the first request waits")
        code, content = yield self.call(
            head, b"POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}
        )
        self.assertEqual(code, 503)
        error = json.loads(content)["error"]
        self.assertEqual((error["code"], error["type"]), ("queue_full", "service_unavailable"))
        code, content = yield self.call(head, b"GET", "/healthz")
        self.assertEqual(
            json.loads(content),
            {"status": "unavailable", "nodes": 0, "lanes_active": 0, "lanes_total": 0,
             "queued": 1, "requests": 1},
        )  # fmt: skip
        _, metrics = yield self.call(head, b"GET", "/metrics")
        for line in ("sfhead_queued_requests 1.0", "sfhead_queue_rejected_total 1.0"):
            self.assertIn(line, metrics.decode())
        self.assertEqual(waiting.received, b"")
        assert waiting.transport is not None
        waiting.transport.abortConnection()
        yield until(lambda: head.fleet.queued == 0, "the gone client's request left")
        self.assertEqual(head.fleet.queue.timeouts, 0)

    @defer.inlineCallbacks
    def test_a_queued_request_is_served_when_a_node_joins(self) -> Generator[Any, Any, None]:
        """A (greedy) completion sent while no node is there waits; a node dials in and the
        answer is the one an uninterrupted run gives, with status 200."""
        head = yield self.start_head([])
        fleet_port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            head.fleet.listen_factory()
        )
        self.addCleanup(fleet_port.stopListening)
        answer = self.call(
            head,
            b"POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0},
        )
        yield until(lambda: head.fleet.queued == 1, "the request waits")
        engine = MockEngine(reactor, vocab_size=TINY_VOCAB)
        agent = NodeAgent(reactor, engine, NodeConfig(identity="late", model_name=MODEL))
        agent.start()
        self.addCleanup(agent.stop)
        yield TCP4ClientEndpoint(reactor, "127.0.0.1", fleet_port.getHost().port).connect(
            node_factory(agent)
        )
        code, content = yield answer
        self.assertEqual(code, 200)
        text = json.loads(content)["choices"][0]["message"]["content"]
        self.assertEqual(text, self.text_of(expected_tokens(self.prompt_ids(MESSAGES), 6)))
        self.assertEqual(head.fleet.queued, 0)
