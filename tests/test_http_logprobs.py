"""Logprobs through the head (docs/protocol.md section 12.1): the link hands them over with
their tokens, the fleet keeps sessions that ask on nodes that offer them (failover included),
and the HTTP API answers them in OpenAI's shapes, streamed and not.

Mock-engine nodes stand behind the head; their logprobs are those of
:func:`sfnode.generation.sparse_logprob` over the mock's logits (pinned on their own in
tests/test_node_logprobs.py).  The rules run in memory (tests/memoryhead.py); what kills,
restarts or lies about a node runs over real loopback TCP.  No sleeps: every wait is a
Deferred or the memory clock.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ServerEndpoint

from sfnode.decoding.sparse_sampler import sparse_logprob
from sfnode.engines.mock import MockEngine, mock_logits, mock_next_token
from sfnode.generation import TokenBatch, TokenLogprob
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.fleet import LogprobsUnavailable
from sfnode.head.fleet.placement import Policy
from sfnode.head.link import MalformedFrameError
from sfnode.linkf.wire import FEATURE_LOGPROBS, FINISH_LENGTH, GenParams, HelloAckF, to_f32
from sfnode.node.agent import NodeAgent
from sfnode.node.config import NodeConfig
from sfnode.node.tap import node_factory
from tests.memoryhead import MemoryHead, MemoryHeadTestCase
from tests.nodefixture import RunningNode, expected_tokens
from tests.test_fleet import FleetTestCase, next_open
from tests.test_http import MESSAGES, MODEL, prompt_ids, sse_events, text_of
from tests.tinymodel import TINY_VOCAB

PROMPT = list(range(100, 112))
Gen = Generator[defer.Deferred[Any], Any, None]


def greedy_logprobs(
    context: Sequence[int], count: int, asked: int, vocab: int = 32000
) -> list[TokenLogprob]:
    """The mock's logprobs for its greedy run from ``context``, as they read after the wire."""
    context = list(context)
    out = []
    for _ in range(count):
        token = mock_next_token(context, vocab)
        entry = sparse_logprob(mock_logits(context, vocab), GenParams(logprobs=asked), token)
        out.append(TokenLogprob(to_f32(entry.logprob), tuple((t, to_f32(v)) for t, v in entry.top)))
        context.append(token)
    return out


class Recorder:
    """An ``on_tokens`` sink that records the batches it got."""

    def __init__(self) -> None:
        self.batches: list[TokenBatch] = []

    def __call__(self, batch: TokenBatch) -> None:
        self.batches.append(batch)

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return [lp for batch in self.batches for lp in batch.logprobs or ()]


class _ClaimingNode(NodeAgent):
    """A node that sets FEATURE_LOGPROBS although its engine has no logprobs: it answers a
    session that asks with plain Tokens (a node that breaks docs/protocol.md 12.1)."""

    def hello_ack(self) -> HelloAckF:
        ack = super().hello_ack()
        return HelloAckF(
            ack.chosen_version,
            ack.node_identity,
            ack.capacity,
            ack.loadable_models,
            FEATURE_LOGPROBS,
            ack.limits,
        )


class LinkAndFleetTests(FleetTestCase):
    @defer.inlineCallbacks
    def test_a_node_with_the_bit_that_sends_plain_tokens_breaks_its_link(self) -> Gen:
        """A node that set FEATURE_LOGPROBS but answers a session that asks with plain Tokens
        sends a stream the head cannot render: the link closes as malformed and the
        generation fails with MalformedFrameError."""
        engine = MockEngine(reactor, supports_logprobs=False)
        agent = _ClaimingNode(reactor, engine, NodeConfig(identity="liar", model_name="mock"))
        agent.start()
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            node_factory(agent)
        )
        self.addCleanup(agent.stop)
        self.addCleanup(port.stopListening)
        link = yield self.dial(RunningNode(agent, engine, port))
        link.assign(1, params=GenParams(logprobs=2))
        link.append(1, PROMPT)
        call = link.generate(1, HeadRequest((), 10))
        yield self.assertFailure(call.result, MalformedFrameError)

    @defer.inlineCallbacks
    def test_failover_keeps_the_session_on_nodes_with_the_bit(self) -> Gen:
        """The node streaming a generation that asks dies after 7 tokens: the generation
        continues on the other node with the bit (never on the idle one without it), and the
        caller gets exactly the tokens and logprobs of an uninterrupted run."""
        first = yield self.start_node(identity="first", token_delay_s=0.005)
        plain = yield self.start_node(identity="plain", supports_logprobs=False)
        second = yield self.start_node(identity="second", token_delay_s=0.001)
        # Least-loaded breaks ties by registration order: without the feature check the
        # failover would land on "plain".
        fleet = yield self.fleet_of([first, plain, second], policy=Policy.LEAST_LOADED)
        recorder = Recorder()
        killed: list[bool] = []

        def seen(batch: TokenBatch) -> None:
            recorder(batch)
            if sum(len(b) for b in recorder.batches) >= 7 and not killed:
                killed.append(True)
                reactor.callLater(0, self.kill, first)

        outcome = yield fleet.generate(
            HeadRequest(PROMPT, 40, params=GenParams(logprobs=4)),
            on_tokens=seen,
        ).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 40))
        self.assertEqual(outcome.finish, FINISH_LENGTH)
        self.assertEqual((outcome.node, outcome.failovers), ("second", 1))
        self.assertEqual(recorder.logprobs, greedy_logprobs(PROMPT, 40, 4))
        self.assertEqual(plain.engine.statistics().decoded_tokens, 0)

    @defer.inlineCallbacks
    def test_a_node_back_without_the_bit_loses_the_session(self) -> Gen:
        """A session that asks sits on a node that dies and comes back (same name, same port)
        with an engine that has no logprobs: its next generation moves to the other node with
        the bit and returns the tokens and logprobs of a local run."""
        a = yield self.start_node(identity="a")
        b = yield self.start_node(identity="b")
        fleet = yield self.fleet_of([a, b], policy=Policy.LEAST_LOADED)
        session = yield fleet.open_session(PROMPT, params=GenParams(logprobs=2))
        self.assertEqual(session.node.name, "a")
        port = a.port_number
        yield self.kill(a)
        yield self.on(fleet, a).link.when_closed()
        back = next_open(self.on(fleet, a))
        engine = MockEngine(reactor, supports_logprobs=False)
        agent = NodeAgent(reactor, engine, NodeConfig(identity="a", model_name="mock"))
        agent.start()
        listening = yield TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(
            node_factory(agent)
        )
        self.addCleanup(agent.stop)
        self.addCleanup(listening.stopListening)
        yield back
        self.assertEqual((self.on(fleet, a).link.features or 0) & FEATURE_LOGPROBS, 0)
        recorder = Recorder()
        outcome = yield session.generate(6, on_tokens=recorder).result
        self.assertEqual((outcome.node, outcome.failovers), ("b", 1))
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 6))
        self.assertEqual(recorder.logprobs, greedy_logprobs(PROMPT, 6, 2))
        self.assertEqual(engine.statistics().decoded_tokens, 0)

    def test_a_pipeline_refuses_logprobs(self) -> None:
        """A pipeline (stage forwards return tokens, not distributions) fails a generation
        that asks for logprobs with LogprobsUnavailable before dialing anything."""
        from sfnode.head.fleet.pipeline import PipelineFleet

        pipeline = PipelineFleet(reactor, ["tcp:127.0.0.1:1"], n_layers=24, ids=self.ids)
        generation = pipeline.generate(HeadRequest(PROMPT, 4, params=GenParams(logprobs=2)))
        self.failureResultOf(generation.result, LogprobsUnavailable)
        self.assertEqual(pipeline.stages, [])


class LogprobsInMemoryTests(MemoryHeadTestCase):
    """The link and the fleet with logprobs, on the memory reactor."""

    def test_the_link_hands_logprobs_over_with_their_tokens(self) -> None:
        """A session whose GenParams ask (logprobs 3) gets batches with one TokenLogprob per
        token, the mock's greedy values and two alternatives; a session that does not ask gets
        batches without logprobs; the link reports the node's feature bit."""
        self.start_mock_node()
        link = self.dial()
        self.assertEqual((link.features or 0) & FEATURE_LOGPROBS, FEATURE_LOGPROBS)
        link.assign(1, params=GenParams(logprobs=3))
        link.append(1, PROMPT)
        link.assign(2)
        link.append(2, PROMPT)
        asked, plain = Recorder(), Recorder()
        first = self.wait(link.generate(1, HeadRequest((), 30), on_tokens=asked).result)
        second = self.wait(link.generate(2, HeadRequest((), 30), on_tokens=plain).result)
        self.assertEqual(first.tokens, expected_tokens(PROMPT, 30))
        self.assertEqual(second.tokens, first.tokens)
        self.assertEqual({batch.logprobs is None for batch in asked.batches}, {False})
        for batch in asked.batches:
            self.assertEqual(len(batch.tokens), len(batch.logprobs or ()))
        self.assertEqual(asked.logprobs, greedy_logprobs(PROMPT, 30, 3))
        self.assertEqual({batch.logprobs is None for batch in plain.batches}, {True})

    def test_sessions_that_ask_go_only_to_nodes_with_the_bit(self) -> None:
        """Round-robin over a node without logprobs and one with them: every generation that
        asks runs on the one with them, with its logprobs; plain ones still use both."""
        plain = self.start_mock_node("plain", supports_logprobs=False)
        able = self.start_mock_node("able")
        fleet = self.fleet_of([plain, able], policy=Policy.ROUND_ROBIN)
        for _ in range(3):
            recorder = Recorder()
            generation = fleet.generate(
                HeadRequest(PROMPT, 8, params=GenParams(logprobs=2)),
                on_tokens=recorder,
            )
            outcome = self.wait(generation.result)
            self.assertEqual(outcome.node, "able")
            self.assertEqual(recorder.logprobs, greedy_logprobs(PROMPT, 8, 2))
        nodes = set()
        for _ in range(2):
            outcome = self.wait(fleet.generate(HeadRequest(PROMPT, 4)).result)
            nodes.add(outcome.node)
        self.assertEqual(nodes, {"plain", "able"})

    def test_no_node_with_the_bit_fails_at_once(self) -> None:
        """When every node has handshaken without FEATURE_LOGPROBS, a generation that asks
        fails with LogprobsUnavailable at once (no wait in the queue); one that does not ask
        runs."""
        plain = self.start_mock_node("plain", supports_logprobs=False)
        fleet = self.fleet_of([plain], queue_timeout_s=60)
        generation = fleet.generate(HeadRequest(PROMPT, 8, params=GenParams(logprobs=1)))
        failure = self.wait_failure(generation.result, LogprobsUnavailable)
        self.assertIn("returns logprobs", str(failure.value))
        self.assertEqual(fleet.queued, 0)
        outcome = self.wait(fleet.generate(HeadRequest(PROMPT, 4)).result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 4))


class HttpLogprobsTests(MemoryHeadTestCase):
    """The HTTP API's logprobs (OpenAI's shapes) from a mock node on the tiny vocabulary."""

    def head(self, *, supports_logprobs: bool = True) -> MemoryHead:
        engine = MockEngine(
            self.reactor, vocab_size=TINY_VOCAB, supports_logprobs=supports_logprobs
        )
        node = self.start_vocab_node(engine=engine)
        return self.start_head([node])

    def expected(self, count: int, asked: int) -> tuple[list[int], list[TokenLogprob]]:
        prompt = prompt_ids(MESSAGES)
        return (
            expected_tokens_vocab(prompt, count),
            greedy_logprobs(prompt, count, asked, TINY_VOCAB),
        )

    def test_chat_logprobs_plain_and_streamed(self) -> None:
        """logprobs true with top_logprobs 3 under greedy: one content entry per completion
        token, each the mock's value for that token with its bytes, whose logprob equals the
        first of its three top_logprobs; streamed with include_usage, the chunks' entries
        put together are the same list and every chunk with text carries its entries."""
        head = self.head()
        request = {
            "model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 3,
        }  # fmt: skip
        code, content = self.call(head, b"POST", "/v1/chat/completions", request)
        self.assertEqual(code, 200, content)
        body = json.loads(content)
        entries = body["choices"][0]["logprobs"]["content"]
        self.assertEqual(len(entries), body["usage"]["completion_tokens"])
        tokens, logprobs = self.expected(12, 4)
        renderer = head.api.renderer
        for entry, token, expected in zip(entries, tokens, logprobs, strict=True):
            self.assertEqual(entry["bytes"], list(renderer.token_bytes(token)))
            self.assertEqual(entry["logprob"], expected.logprob)
            self.assertEqual(len(entry["top_logprobs"]), 3)
            self.assertEqual(entry["top_logprobs"][0]["logprob"], entry["logprob"])
            self.assertEqual(entry["top_logprobs"][0]["token"], entry["token"])
            self.assertEqual(
                [t["logprob"] for t in entry["top_logprobs"]], [v for _, v in expected.top]
            )
        streamed_request = {**request, "stream": True, "stream_options": {"include_usage": True}}
        code, streamed = self.call(head, b"POST", "/v1/chat/completions", streamed_request)
        chunks = [e for e in sse_events(streamed)[:-1] if e["choices"]]
        together = []
        for chunk in chunks:
            (choice,) = chunk["choices"]
            if choice["delta"].get("content"):
                self.assertIsNotNone(choice["logprobs"])
            if choice["logprobs"] is not None:
                together.extend(choice["logprobs"]["content"])
        self.assertEqual(together, entries)
        self.assertEqual(sse_events(streamed)[-2]["usage"]["completion_tokens"], 12)

    def test_completion_logprobs_with_two_choices(self) -> None:
        """/v1/completions with logprobs 2 and n 2: each choice has tokens, token_logprobs,
        top_logprobs (the chosen token among at most three) and text_offset, one per
        completion token, offsets from 0 and never decreasing; streamed, each choice's
        chunks put together give the same lists."""
        head = self.head()
        request = {
            "model": MODEL, "prompt": "hello world", "max_tokens": 9, "temperature": 0,
            "logprobs": 2, "n": 2,
        }  # fmt: skip
        code, content = self.call(head, b"POST", "/v1/completions", request)
        self.assertEqual(code, 200, content)
        body = json.loads(content)
        self.assertEqual([c["index"] for c in body["choices"]], [0, 1])
        for choice in body["choices"]:
            logprobs = choice["logprobs"]
            self.assertEqual(len(logprobs["tokens"]), 9)
            for name in ("token_logprobs", "top_logprobs", "text_offset"):
                self.assertEqual(len(logprobs[name]), 9, name)
            self.assertEqual(logprobs["text_offset"][0], 0)
            self.assertEqual(logprobs["text_offset"], sorted(logprobs["text_offset"]))
            for token, value, top in zip(
                logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                strict=True,
            ):  # fmt: skip
                self.assertLessEqual(len(top), 3)
                self.assertEqual(top[token], value)
                self.assertEqual(max(top.values()), value)  # greedy: the chosen is the best
        self.assertEqual(body["choices"][0]["logprobs"], body["choices"][1]["logprobs"])
        _, streamed = self.call(head, b"POST", "/v1/completions", {**request, "stream": True})
        merged: dict[int, dict[str, list[Any]]] = {0: {}, 1: {}}
        for chunk in sse_events(streamed)[:-1]:
            (choice,) = chunk["choices"]
            for name, values in (choice["logprobs"] or {}).items():
                merged[choice["index"]].setdefault(name, []).extend(values)
        self.assertEqual(merged[0], body["choices"][0]["logprobs"])
        self.assertEqual(merged[1], body["choices"][1]["logprobs"])

    def test_without_a_node_that_returns_them_logprobs_are_a_400(self) -> None:
        """With only a node that has no logprobs, a request that asks is answered 400
        unsupported_parameter naming logprobs, at once; the same request without logprobs
        is served."""
        head = self.head(supports_logprobs=False)
        request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
        code, content = self.call(
            head, b"POST", "/v1/chat/completions", {**request, "logprobs": True}
        )
        self.assertEqual(code, 400)
        error = json.loads(content)["error"]
        self.assertEqual((error["param"], error["code"]), ("logprobs", "unsupported_parameter"))
        self.assertIn("logprobs", error["message"])
        code, _ = self.call(head, b"POST", "/v1/chat/completions", request)
        self.assertEqual(code, 200)

    def test_a_stop_string_ends_the_entries_with_the_text(self) -> None:
        """With a stop string, the entries end with the token that completed it: their bytes
        joined start with the answer's text, and no entry follows that token."""
        head = self.head()
        tokens, _ = self.expected(16, 1)
        text = text_of(tokens)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        self.assertTrue(stop.strip())
        request = {
            "model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
            "logprobs": True, "stop": stop,
        }  # fmt: skip
        code, content = self.call(head, b"POST", "/v1/chat/completions", request)
        self.assertEqual(code, 200, content)
        choice = json.loads(content)["choices"][0]
        shown = choice["message"]["content"]
        self.assertEqual(shown, text[: text.index(stop)])
        entries = choice["logprobs"]["content"]
        joined = b"".join(bytes(e["bytes"]) for e in entries).decode(errors="replace")
        before = b"".join(bytes(e["bytes"]) for e in entries[:-1]).decode(errors="replace")
        self.assertIn(stop, joined)
        self.assertNotIn(stop, before)


def expected_tokens_vocab(context: Sequence[int], count: int) -> list[int]:
    """The mock's greedy run over the tiny tokenizer's vocabulary."""
    context = list(context)
    for _ in range(count):
        context.append(mock_next_token(context, TINY_VOCAB))
    return context[len(context) - count :]
