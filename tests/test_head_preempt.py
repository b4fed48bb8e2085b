"""Exact preemption by class (docs/protocol.md sections 8.5 "Shares" and 12.2): a chat request
behind batch generations that hold every lane of a node gets its first token within a step
and its prefill; the batch generations give their lane back, resume, and end with the text of
an unpreempted run.  On mock nodes in memory (tests/memoryhead.py), and on the tiny real
engine (float32, seeded sampling) over loopback TCP.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import SynchronousTestCase

from sfnode.engines.config import EngineConfig
from sfnode.engines.mock import MockEngine
from sfnode.head.api.keys import parse_key_line
from sfnode.head.api.request_class import HeadClass, class_name, parse_header
from sfnode.head.fleet.backend import HeadRequest
from sfnode.linkf.wire import RequestClass
from tests.memoryhead import MemoryHeadTestCase
from tests.test_head_resume import _dechunk, _events, _text
from tests.test_http import MESSAGES, MODEL, HttpTestCase, StreamingClient, post_bytes
from tests.test_http_hostile import request_bytes
from tests.tinymodel import TINY_VOCAB

STEP_S = 0.02


def _chat(max_tokens: int, request_class: str, **more: Any) -> bytes:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, **more}  # fmt: skip
    return request_bytes(
        "/v1/chat/completions",
        json.dumps(body).encode(),
        extra=[f"X-Request-Class: {request_class}"],
    )


def _text_of(data: bytes) -> str:
    return _text(_events(_dechunk(data.partition(b"\r\n\r\n")[2])))


class PreemptionTests(MemoryHeadTestCase):
    def test_a_chat_behind_eight_batch_generations_starts_within_a_step(self) -> None:
        """Eight batch streams of 300 tokens hold the 8 lanes of a node that keeps none for
        interactive work (``--interactive-lanes 0``); a chat's first token comes
        within 0.2 s of the memory clock (one 20 ms step and its prefill, where a lane would
        free only after 6 s); every batch stream ends with the text of an unpreempted run,
        and one gave its lane back."""
        engine = MockEngine(
            self.reactor,
            EngineConfig(max_lanes=8, interactive_lanes=0),
            token_delay_s=STEP_S,
            vocab_size=TINY_VOCAB,
        )
        self.start_vocab_node("a", max_lanes=8, engine=engine)
        head = self.start_head()
        _, _, alone = self.exchange(head, _chat(300, "batch"), within=30.0)
        expected = _text(_events(alone))
        batch = []
        for _ in range(8):
            client = self.http(head, "10.0.0.1")
            client.send(_chat(300, "batch"))
            batch.append(client)
        self.until(lambda: sum(n.inflight for n in head.fleet.nodes) == 8)
        self.advance(0.5)
        chat = StreamingClient()
        self.http(head, "10.0.0.2", chat)
        started = self.reactor.seconds()
        assert chat.transport is not None
        chat.transport.write(post_bytes({"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                         "stream": True}, close=True))  # fmt: skip
        self.until(lambda: chat.content_seen.called, within=10.0)
        self.assertLess(self.reactor.seconds() - started, 0.2)
        self.until(lambda: all(client.closed for client in batch), within=60.0)
        self.assertGreaterEqual(head.fleet.shares.reclaimed, 1)
        for client in batch:
            self.assertEqual(_text_of(client.data), expected)


class RealEnginePreemptionTests(HttpTestCase):
    """The transformers engine on the tiny Llama (float32), two lanes and none kept for
    interactive work."""

    timeout = 300

    @defer.inlineCallbacks
    def test_preempted_batch_generations_end_as_unpreempted_ones(
        self,
    ) -> Generator[Any, Any, None]:
        """Two seeded, sampled batch streams of 80 tokens hold both lanes; a chat arrives,
        takes a lane back and ends; both batch streams end with the text each gives alone."""
        from sfnode.engines.transformers_engine import TransformersEngine
        from tests.test_constraint import tiny_model
        from tests.test_head_resume import fetch

        engine = TransformersEngine(
            tiny_model(),
            reactor,
            EngineConfig(max_lanes=2, interactive_lanes=0, weights="float32"),
        )
        engine.start()
        self.addCleanup(engine.stop)
        node = yield self.start_vocab_node(engine=engine, max_lanes=2)
        head = yield self.start_head([node])
        port = head.port.getHost().port
        sampled = {"temperature": 1.0}
        alone = []
        for seed in (1, 2):
            data = yield fetch(port, _chat(80, "batch", seed=seed, **sampled))
            alone.append(_text_of(data))
        running = [fetch(port, _chat(80, "batch", seed=seed, **sampled)) for seed in (1, 2)]
        while head.fleet.nodes[0].inflight < 2:
            yield _turn()
        chat = yield fetch(port, _chat(4, "interactive"))
        self.assertTrue(_text_of(chat))
        done = yield defer.gatherResults(running)
        self.assertEqual([_text_of(data) for data in done], alone)
        self.assertGreaterEqual(head.fleet.shares.reclaimed, 1)


def _turn() -> defer.Deferred[None]:
    d: defer.Deferred[None] = defer.Deferred()
    reactor.callLater(0.01, d.callback, None)  # type: ignore[attr-defined]
    return d


class BackgroundClassTests(SynchronousTestCase):
    """The head's own third class (sfnode.head.api.request_class)."""

    def test_background_is_named_and_goes_to_nodes_as_batch(self) -> None:
        """X-Request-Class: background names HeadClass.BACKGROUND (the answer's header says
        background), which GENERATE_REQ carries as batch, ranked after batch at the head; a
        key file's class=background is read the same."""
        self.assertEqual(parse_header(b" Background "), HeadClass.BACKGROUND)
        self.assertEqual(class_name(HeadClass.BACKGROUND), "background")
        self.assertEqual(HeadClass.BACKGROUND.wire, RequestClass.BATCH)
        self.assertEqual(HeadClass.INTERACTIVE.wire, RequestClass.INTERACTIVE)
        request = HeadRequest((1,), 1, request_class=RequestClass.BATCH, background=True)
        self.assertEqual((request.rank, HeadRequest((1,), 1).rank), (2, 0))
        _, policy = parse_key_line(b"sk-x class=background")
        self.assertEqual(policy.request_class, HeadClass.BACKGROUND)
