"""The head's queue seen over HTTP (sfnode.head.fleet.fleet and sfnode.head.api.http), in memory
(tests/memoryhead.py: the real site and guards, the fleet, a node that dials in).

A completion that no live node can take waits for one; a full queue answers 503 ``queue_full``
at once; a client that disconnects while its request waits takes it out of the queue; a node
that dials in serves what waited; ``/healthz`` and ``/metrics`` show the queue.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Protocol

from sfnode.engines.mock import MockEngine
from sfnode.node.agent import NodeAgent
from sfnode.node.config import NodeConfig
from sfnode.node.tap import node_factory
from tests.memoryhead import MemoryHeadTestCase, stop_at_end
from tests.test_http import MESSAGES, MODEL, expected_tokens, post_bytes, prompt_ids, text_of
from tests.test_http_hostile import request_bytes, response_of
from tests.tinymodel import TINY_VOCAB

FLEET_PORT = 8453
"""Where the head takes nodes that dial in (nothing is bound: the reactor is a memory reactor)."""


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


class QueueOverHttpTests(MemoryHeadTestCase):
    def test_a_full_queue_answers_503_at_once_and_a_gone_client_leaves_it(self) -> None:
        """With no node and room for one waiting request: the first waits (healthz and metrics
        show it queued), the second gets 503 queue_full at once, and when the first client
        disconnects its request leaves the queue."""
        head = self.start_head([], fleet_options={"max_queued": 1, "queue_timeout_s": 600})
        waiting = self.http(
            head, client=_Silent({"model": MODEL, "messages": MESSAGES, "stream": True})
        )
        self.until(lambda: head.fleet.queued == 1)
        code, content = self.call(
            head, b"POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}
        )
        self.assertEqual(code, 503)
        error = json.loads(content)["error"]
        self.assertEqual((error["code"], error["type"]), ("queue_full", "service_unavailable"))
        code, content = self.call(head, b"GET", "/healthz")
        self.assertEqual(
            json.loads(content),
            {"status": "unavailable", "nodes": 0, "lanes_active": 0, "lanes_total": 0,
             "queued": 1, "requests": 1},
        )  # fmt: skip
        _, metrics = self.call(head, b"GET", "/metrics")
        for line in ("sfhead_queued_requests 1.0", "sfhead_queue_rejected_total 1.0"):
            self.assertIn(line, metrics.decode())
        self.assertEqual(waiting.received, b"")
        assert waiting.transport is not None
        waiting.transport.abortConnection()
        self.until(lambda: head.fleet.queued == 0)
        self.assertEqual(head.fleet.queue.timeouts, 0)

    def test_a_queued_request_is_served_when_a_node_joins(self) -> None:
        """A (greedy) completion sent while no node is there waits; a node dials in and the
        answer is the one an uninterrupted run gives, with status 200."""
        head = self.start_head([])
        self.reactor.listenTCP(FLEET_PORT, head.fleet.listen_factory(), interface="127.0.0.1")
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        client = self.http(head)
        client.send(request_bytes("/v1/chat/completions", json.dumps(body).encode()))
        self.until(lambda: head.fleet.queued == 1)
        engine = MockEngine(self.reactor, vocab_size=TINY_VOCAB)
        agent = NodeAgent(self.reactor, engine, NodeConfig(identity="late", model_name=MODEL))
        agent.start()
        stop_at_end(self, agent.stop)
        TCP4ClientEndpoint(self.reactor, "127.0.0.1", FLEET_PORT).connect(node_factory(agent))
        self.until(lambda: client.closed)
        code, _, content = response_of(client.data)
        self.assertEqual(code, 200)
        text = json.loads(content)["choices"][0]["message"]["content"]
        self.assertEqual(text, text_of(expected_tokens(prompt_ids(MESSAGES), 6)))
        self.assertEqual(head.fleet.queued, 0)
