"""The head's OpenAI-compatible HTTP API (sfnode.head.api.http) over real TCP.

Mock-engine nodes with the tiny test tokenizer's vocabulary (tests/tinymodel.py) stand behind the
head for the protocol behaviours: response shapes, SSE streaming, errors, health, metrics, stop
strings, and a client disconnect that must cancel the node's generation.  One test drives the
API with the official ``openai`` package against a real transformers node on a tiny Llama.
No sleeps: every wait is a Deferred.

Why real TCP here: these tests pin the whole path a client's request takes (twisted.web's
parser on real bytes, the fleet, Link F to a node, the node's engine, and back), and the
clients are the ones users bring (the ``openai`` package, twisted.web's ``Agent``).  The
exchange's own life (its phases, back-pressure, error mapping, labels) is pinned without a
socket on the memory reactor in tests/test_head_exchange.py.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer, reactor, threads
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers

from sfnode.engines.config import EngineConfig
from sfnode.engines.mock import MockEngine, mock_next_token
from sfnode.generation import EngineStop
from sfnode.head.api.http import Detokenizer, OpenAIApi, Renderer, StopText
from sfnode.head.fleet.fleet import Fleet, FleetSettings
from sfnode.head.models.chat import ChatMessage
from tests.clients import openai_client
from tests.memoryhead import MemoryHeadTestCase
from tests.nodefixture import NodeTestCase, RunningNode, mock_node
from tests.test_fleet import next_status
from tests.tinymodel import TINY_VOCAB, tiny_tokenizer

MODEL = "mock"
_TOKENIZER: Any = None


def tokenizer() -> Any:
    """The tiny test tokenizer (built once per test run: it is trained on the spot)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = tiny_tokenizer()
    return _TOKENIZER


@dataclass
class Head:
    """A fleet and its HTTP API listening on 127.0.0.1."""

    fleet: Fleet
    api: OpenAIApi
    port: Any

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port.getHost().port}"


class HttpTestCase(NodeTestCase):
    """A node and a head with its HTTP API, over real loopback TCP: these tests speak HTTP as
    clients do (twisted.web's Agent, raw sockets, the openai package), through the head's real
    listener and its guards."""

    @defer.inlineCallbacks
    def start_vocab_node(
        self, *, identity: str = "node", model_name: str = MODEL, **options: Any
    ) -> Generator[defer.Deferred[Any], Any, RunningNode]:
        """A mock node whose tokens are ids of the tiny tokenizer (vocabulary 512);
        ``options`` are :func:`tests.nodefixture.mock_node`'s (an engine, the mock's)."""
        agent, engine = mock_node(
            reactor, reactor, identity=identity, model_name=model_name, vocab_size=TINY_VOCAB,
            **options,
        )  # fmt: skip
        return (yield self.serve(agent, engine))

    @defer.inlineCallbacks
    def start_head(
        self,
        nodes: Sequence[RunningNode],
        *,
        model: str = MODEL,
        tok: Any = None,
        fleet_options: dict[str, Any] | None = None,
        **api: Any,
    ) -> Generator[defer.Deferred[Any], Any, Head]:
        """A fleet with ``nodes`` and its API on 127.0.0.1 (``fleet_options``: more Fleet
        keywords, such as the queue's bounds; ``api``: more OpenAIApi keywords)."""
        fleet = yield self.fleet_with(nodes, **(fleet_options or {}))
        api = OpenAIApi(reactor, fleet, tok or tokenizer(), model, seed_source=lambda: 7, **api)
        return (yield self.listening(fleet, api))

    @defer.inlineCallbacks
    def fleet_with(
        self, nodes: Sequence[RunningNode], **settings: Any
    ) -> Generator[defer.Deferred[Any], Any, Fleet]:
        """A fleet (``settings``: :class:`FleetSettings` fields) with ``nodes`` added; stopped
        at the end."""
        fleet = Fleet(reactor, FleetSettings(**settings), ids=self.ids)
        self.addCleanup(fleet.stop)
        for node in nodes:
            yield fleet.add_node(node.endpoint)
        return fleet

    @defer.inlineCallbacks
    def listening(self, fleet: Fleet, api: OpenAIApi) -> Generator[defer.Deferred[Any], Any, Head]:
        """``api`` (over ``fleet``) listening on 127.0.0.1; both stopped at the end."""
        self.addCleanup(api.stop)
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(api.site())
        self.addCleanup(port.stopListening)
        return Head(fleet, api, port)

    @defer.inlineCallbacks
    def call(
        self, head: Head, method: bytes, path: str, body: Any = None, raw: bytes | None = None
    ) -> Generator[defer.Deferred[Any], Any, tuple[int, bytes]]:
        from io import BytesIO

        from twisted.web.client import FileBodyProducer

        agent = Agent(reactor)
        producer = None
        if raw is not None or body is not None:
            data = raw if raw is not None else json.dumps(body).encode()
            producer = FileBodyProducer(BytesIO(data))
        response = yield agent.request(
            method,
            (head.base + path).encode(),
            Headers({b"content-type": [b"application/json"]}),
            producer,
        )
        content = yield readBody(response)
        return response.code, content

    @defer.inlineCallbacks
    def tiny_head(
        self, max_lanes: int = 4
    ) -> Generator[defer.Deferred[Any], Any, tuple[Head, Any, Any, Any]]:
        """A head on ``tiny`` served by a node running the tiny transformers model: (head,
        model, tokenizer, an ``openai`` client for the head)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from sfnode.engines.transformers_engine import TransformersEngine
        from tests.tinymodel import save_tiny_model

        folder = save_tiny_model(self.mktemp())
        model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
        model.eval()
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        engine = TransformersEngine(model, reactor, EngineConfig(max_lanes=max_lanes))
        node = yield self.start_vocab_node(engine=engine, model_name="tiny")
        head = yield self.start_head([node], model="tiny", tok=tok)
        client = openai_client(self, head.base + "/v1")
        return head, model, tok, client

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return prompt_ids(messages)

    def text_of(self, tokens: Sequence[int]) -> str:
        return text_of(tokens)


def prompt_ids(messages: list[dict[str, str]]) -> list[int]:
    """The tiny tokenizer's chat prompt of ``messages``."""
    return Renderer(tokenizer()).chat([ChatMessage(m["role"], m["content"]) for m in messages])


def text_of(tokens: Sequence[int]) -> str:
    """The text of ``tokens`` (special tokens left out)."""
    return str(tokenizer().decode(list(tokens), skip_special_tokens=True))


MESSAGES = [{"role": "user", "content": "hello world"}]


def expected_tokens(context: Sequence[int], count: int) -> list[int]:
    """The mock's greedy run over the tiny tokenizer's vocabulary."""
    context = list(context)
    for _ in range(count):
        context.append(mock_next_token(context, TINY_VOCAB))
    return context[len(context) - count :]


def record_ends(engine: MockEngine) -> list[defer.Deferred[Any]]:
    """Wraps ``engine.submit``: the list gets, for each generation the engine starts, a
    Deferred that fires with how it ended (its result or its failure)."""
    ended: list[defer.Deferred[Any]] = []
    submit = engine.submit

    def recording_submit(request: Any, on_tokens: Any) -> Any:
        generation = submit(request, on_tokens)
        seen: defer.Deferred[Any] = defer.Deferred()
        ended.append(seen)

        def record(result: Any) -> Any:
            seen.callback(result)
            return result

        generation.result.addBoth(record)
        return generation

    engine.submit = recording_submit  # type: ignore[method-assign]
    return ended


def sse_events(content: bytes) -> list[Any]:
    """The data of every server-sent event (after its ``id:`` line, docs/api.md "Streams
    that resume"); ``[DONE]`` stays a string."""
    events = []
    for block in content.decode().split("\n\n"):
        if block.startswith("id: "):
            block = block.partition("\n")[2]
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


class CompletionTests(MemoryHeadTestCase):
    def test_non_streaming_chat(self) -> None:
        """A chat completion renders the messages, generates on the node and answers the
        detokenized text, finish_reason length, and usage in OpenAI's shape."""
        node = self.start_vocab_node()
        head = self.start_head([node])
        code, content = self.call(
            head,
            b"POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0},
        )
        self.assertEqual(code, 200)
        body = json.loads(content)
        prompt = prompt_ids(MESSAGES)
        self.assertEqual(body["object"], "chat.completion")
        self.assertEqual(body["model"], MODEL)
        choice = body["choices"][0]
        self.assertEqual(choice["message"]["role"], "assistant")
        self.assertEqual(choice["message"]["content"], text_of(expected_tokens(prompt, 12)))
        self.assertEqual(choice["finish_reason"], "length")
        self.assertEqual(
            body["usage"],
            {
                "prompt_tokens": len(prompt),
                "completion_tokens": 12,
                "total_tokens": len(prompt) + 12,
            },
        )

    def test_streaming_chat_equals_non_streaming(self) -> None:
        """Streaming chat sends a role chunk, content chunks whose text equals the
        non-streaming answer, a finish chunk, a usage chunk on request, then [DONE]."""
        node = self.start_vocab_node(token_delay_s=0.001)
        head = self.start_head([node])
        request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "temperature": 0}
        _, plain = self.call(head, b"POST", "/v1/chat/completions", request)
        code, content = self.call(
            head,
            b"POST",
            "/v1/chat/completions",
            {**request, "stream": True, "stream_options": {"include_usage": True}},
        )
        self.assertEqual(code, 200)
        events = sse_events(content)
        self.assertEqual(events[-1], "[DONE]")
        chunks = events[:-1]
        self.assertTrue(all(c["object"] == "chat.completion.chunk" for c in chunks))
        self.assertEqual(chunks[0]["choices"][0]["delta"], {"role": "assistant", "content": ""})
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        self.assertEqual(text, json.loads(plain)["choices"][0]["message"]["content"])
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        self.assertEqual(finishes[-1], "length")
        self.assertEqual(set(finishes[:-1]), {None})
        self.assertEqual(chunks[-1]["choices"], [])
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 20)

    def test_completions_with_a_prompt_string(self) -> None:
        """/v1/completions takes a prompt string; streamed and plain text agree."""
        node = self.start_vocab_node()
        head = self.start_head([node])
        request = {
            "model": MODEL, "prompt": "the quick brown fox", "max_tokens": 10, "temperature": 0,
        }  # fmt: skip
        code, plain = self.call(head, b"POST", "/v1/completions", request)
        self.assertEqual(code, 200)
        body = json.loads(plain)
        self.assertEqual(body["object"], "text_completion")
        prompt = [int(t) for t in tokenizer().encode("the quick brown fox")]
        self.assertEqual(body["choices"][0]["text"], text_of(expected_tokens(prompt, 10)))
        _, streamed = self.call(head, b"POST", "/v1/completions", {**request, "stream": True})
        events = sse_events(streamed)
        self.assertEqual(events[-1], "[DONE]")
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        self.assertEqual(text, body["choices"][0]["text"])

    def test_a_stop_string_ends_the_text_before_it(self) -> None:
        """A stop string cuts the answer just before it, finish_reason stop, and the node's
        generation is cancelled instead of running to max_tokens."""
        node = self.start_vocab_node(token_delay_s=0.001)
        head = self.start_head([node])
        prompt = prompt_ids(MESSAGES)
        full = text_of(expected_tokens(prompt, 40))
        cut = len(full) // 2
        stop = full[cut : cut + 3]
        expected = full[: full.find(stop)]
        for stream in (False, True):
            _, content = self.call(
                head,
                b"POST",
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": MESSAGES,
                    "max_tokens": 400,
                    "temperature": 0,
                    "stop": [stop],
                    "stream": stream,
                },
            )
            if stream:
                chunks = sse_events(content)[:-1]
                text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
                finish = chunks[-1]["choices"][0]["finish_reason"]
            else:
                body = json.loads(content)
                text = body["choices"][0]["message"]["content"]
                finish = body["choices"][0]["finish_reason"]
                self.assertLess(body["usage"]["completion_tokens"], 400)
            self.assertEqual((text, finish), (expected, "stop"))

    def test_a_client_that_disconnects_mid_stream_cancels_the_node(
        self,
    ) -> None:
        """Closing the connection during a stream sends GENERATE_CANCEL: the node's engine
        ends the generation CANCELLED long before its budget."""
        engine = MockEngine(self.reactor, token_delay_s=0.01, vocab_size=TINY_VOCAB)
        ended = record_ends(engine)
        node = self.start_vocab_node(engine=engine)
        head = self.start_head([node])
        client = self.http(head, client=StreamingClient())
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100000, "stream": True}
        client.transport.write(post_bytes(body))
        self.until(lambda: client.content_seen.called)
        client.transport.abortConnection()
        result = self.wait(ended[0])
        self.assertEqual(result.stop, EngineStop.CANCELLED)
        self.assertLess(len(result.tokens), 100000)


def post_bytes(body: Any, path: str = "/v1/chat/completions", *, close: bool = False) -> bytes:
    """A raw HTTP/1.1 POST of ``body`` as JSON (``Connection: close`` with ``close``)."""
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + (b"Connection: close\r\n" if close else b"")
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )


class StreamingClient(Protocol):
    """A streamed answer read raw: ``content_seen`` fires at the first chunk whose ``field``
    (chat's ``content``, completions' ``text``) is not empty, ``ended`` with everything
    received when the connection closes."""

    def __init__(self, field: bytes = b"content") -> None:
        self.data = b""
        self.marker = b'"' + field + b'": "'
        self.content_seen: defer.Deferred[None] = defer.Deferred()
        self.ended: defer.Deferred[bytes] = defer.Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        with_text = self.data.replace(self.marker + b'"', b"")
        if self.marker in with_text and not self.content_seen.called:
            self.content_seen.callback(None)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        if not self.content_seen.called:
            self.content_seen.errback(reason)
        self.ended.callback(self.data)


class ErrorTests(MemoryHeadTestCase):
    def test_errors_have_openai_shape_and_status(self) -> None:
        """Bad JSON, bad fields and image content are 400; an unknown model is 404 with
        model_not_found; every body is {"error": {message, type, param, code}}."""
        node = self.start_vocab_node()
        head = self.start_head([node])
        cases: list[tuple[Any, bytes | None, int, str | None]] = [
            (None, b"{not json", 400, None),
            ({"model": MODEL}, None, 400, None),
            ({"model": MODEL, "messages": MESSAGES, "temperature": 5}, None, 400, None),
            ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, None, 400, None),
            ({"model": MODEL, "messages": MESSAGES, "stop": 3}, None, 400, None),
            (
                {
                    "model": MODEL,
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                        }
                    ],
                },
                None,
                400,
                None,
            ),
            ({"model": "nope", "messages": MESSAGES}, None, 404, "model_not_found"),
        ]
        for body, raw, status, code in cases:
            got, content = self.call(head, b"POST", "/v1/chat/completions", body, raw)
            self.assertEqual(got, status, (body, raw))
            error = json.loads(content)["error"]
            self.assertEqual(set(error), {"message", "type", "param", "code"})
            self.assertEqual(error["code"], code)

    def test_a_model_without_a_chat_template_refuses_chat_and_serves_completions(
        self,
    ) -> None:
        """A model whose tokenizer carries no chat template: chat is a 400 naming the model
        and saying so (``no_chat_template``, ``param: "model"``) on /v1/chat/completions,
        /v1/responses and /v1/messages (there in Anthropic's shape), streamed or not, and no
        node generates for it; /v1/completions still answers, its tokens the mock's greedy
        run of the prompt."""
        bare = tiny_tokenizer()
        bare.chat_template = None
        node = self.start_vocab_node()
        head = self.start_head([node], tok=bare)
        said = f"The model {MODEL} has no chat template"
        chats = [
            ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}),
            ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True}),
            ("/v1/responses", {"model": MODEL, "input": "hello world"}),
            ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": MESSAGES}),
        ]
        for path, body in chats:
            code, content = self.call(head, b"POST", path, body)
            self.assertEqual(code, 400, (path, content))
            answer = json.loads(content)
            if path == "/v1/messages":
                self.assertEqual(answer["type"], "error")
                self.assertEqual(answer["error"]["type"], "invalid_request_error")
            else:
                error = answer["error"]
                self.assertEqual((error["code"], error["param"]), ("no_chat_template", "model"))
                self.assertEqual(error["type"], "invalid_request_error")
            self.assertIn(said, answer["error"]["message"])
            self.assertIn("/v1/completions", answer["error"]["message"])
        self.assertEqual(node.engine.statistics().decoded_tokens, 0)
        code, content = self.call(
            head,
            b"POST",
            "/v1/completions",
            {"model": MODEL, "prompt": "hello world", "max_tokens": 6, "temperature": 0},
        )
        self.assertEqual(code, 200, content)
        prompt = Renderer(bare).completion("hello world")
        self.assertEqual(
            json.loads(content)["choices"][0]["text"], text_of(expected_tokens(prompt, 6))
        )

    def test_a_prompt_too_long_is_context_length_exceeded(self) -> None:
        """A prompt longer than every node's window: 400 with code context_length_exceeded,
        streaming or not; the model list quotes the window."""
        node = self.start_vocab_node(context_window=16)
        head = self.start_head([node])
        long_messages = [{"role": "user", "content": "the quick brown fox " * 10}]
        for stream in (False, True):
            code, content = self.call(
                head,
                b"POST",
                "/v1/chat/completions",
                {"model": MODEL, "messages": long_messages, "stream": stream},
            )
            self.assertEqual(code, 400)
            self.assertEqual(json.loads(content)["error"]["code"], "context_length_exceeded")
        _, models = self.call(head, b"GET", "/v1/models")
        self.assertEqual(json.loads(models)["data"][0]["context_length"], 16)

    def test_no_node_is_503_and_unhealthy(self) -> None:
        """Without nodes: a completion waits the queue timeout (0.1 s here) for one, then
        answers 503 no_node_available; /healthz says 503 (unavailable) with no node, no lane
        and nothing queued."""
        head = self.start_head([], fleet_options={"queue_timeout_s": 0.1})
        code, content = self.call(
            head, b"POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}
        )
        self.assertEqual(code, 503)
        self.assertEqual(json.loads(content)["error"]["code"], "no_node_available")
        code, content = self.call(head, b"GET", "/healthz")
        self.assertEqual(
            (code, json.loads(content)),
            (503, {"status": "unavailable", "nodes": 0, "lanes_active": 0, "lanes_total": 0,
                   "queued": 0, "requests": 0}),
        )  # fmt: skip

    def test_liveness_probe_is_200_without_nodes(self) -> None:
        """/healthz?probe=live (a Kubernetes liveness probe) answers 200 "alive" while the
        head has no node (it is not ready, but restarting it would not help); any other query
        is the readiness answer."""
        head = self.start_head([])
        code, content = self.call(head, b"GET", "/healthz?probe=live")
        self.assertEqual((code, json.loads(content)), (200, {"status": "alive"}))
        code, content = self.call(head, b"GET", "/healthz?probe=ready")
        self.assertEqual((code, json.loads(content)["status"]), (503, "unavailable"))


class ObservabilityTests(MemoryHeadTestCase):
    def test_health_models_and_metrics(self) -> None:
        """/healthz is 200 with the live node count, /v1/models lists the model, and
        /metrics has per-node capacity, requests by outcome, tokens, TTFT, failovers and
        reconnects, from the head's own registry."""
        node = self.start_vocab_node(identity="m1")
        head = self.start_head([node])
        code, content = self.call(head, b"GET", "/healthz")
        self.assertEqual(
            (code, json.loads(content)),
            (200, {"status": "ok", "nodes": 1, "lanes_active": 0, "lanes_total": 8, "queued": 0,
                  "requests": 0}),
        )  # fmt: skip
        code, content = self.call(head, b"GET", "/v1/models")
        self.assertEqual([m["id"] for m in json.loads(content)["data"]], [MODEL])
        self.call(
            head,
            b"POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "max_tokens": 5},
        )
        self.call(head, b"POST", "/v1/chat/completions", {"model": "x", "messages": []})
        code, content = self.call(head, b"GET", "/metrics")
        text = content.decode()
        self.assertEqual(code, 200)
        for line in (
            'sfhead_requests_total{outcome="ok"} 1.0',
            'sfhead_requests_total{outcome="not_found"} 1.0',
            "sfhead_completion_tokens_total 5.0",
            "sfhead_time_to_first_token_seconds_count 1.0",
            'sfhead_node_max_context_tokens{node="m1"} 4096.0',
            'sfhead_node_up{node="m1"} 1.0',
            "sfhead_failovers_total 0.0",
            "sfhead_reconnects_total 0.0",
        ):
            self.assertIn(line, text)
        self.assertIn('sfhead_node_lanes_active{node="m1"}', text)
        self.assertIn('sfhead_node_decode_tokens_per_s{node="m1"}', text)


class SaturationTests(MemoryHeadTestCase):
    def test_health_says_busy_while_every_lane_is_taken(self) -> None:
        """A node with 2 lanes running 3 of this head's streams: /healthz answers 200 with
        status busy, 2 of 2 lanes active, 1 generation queued and 3 requests open, and
        /metrics shows the same; once the streams have ended and the node has reported since,
        it says ok again."""
        from tests.test_http_hostile import request_bytes

        self.start_vocab_node(max_lanes=2, token_delay_s=0.01)
        head = self.start_head()
        streams = []
        for _ in range(3):
            client = self.http(head, client=StreamingClient())
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100, "stream": True}
            client.transport.write(post_bytes(body, close=True))
            streams.append(client)
        self.flush()
        self.until(lambda: streams[0].content_seen.called)
        self.assertEqual(len(head.api.exchanges), 3)
        status, _, content = self.exchange(head, request_bytes("/healthz", method="GET"))
        self.assertEqual(
            (status, json.loads(content)),
            (200, {"status": "busy", "nodes": 1, "lanes_active": 2, "lanes_total": 2,
                   "queued": 1, "requests": 3}),
        )  # fmt: skip
        _, _, metrics = self.exchange(head, request_bytes("/metrics", method="GET"))
        for line in ("sfhead_queued 1.0", "sfhead_lanes_active 2.0", "sfhead_requests_open 3.0"):
            self.assertIn(line, metrics.decode())
        self.until(lambda: all(client.ended.called for client in streams), step=0.1)
        # Until the node reports again, its last NODE_STATUS (sampled while the streams ran)
        # still counts both lanes busy.  A report that arrives now was sent after the streams'
        # Finish events (one connection keeps its order): it is the node's own word that its
        # lanes are free.
        reported = next_status(head.fleet.nodes[0])
        self.until(lambda: reported.called, step=0.1)
        status, _, content = self.exchange(head, request_bytes("/healthz", method="GET"))
        self.assertEqual((status, json.loads(content)["status"]), (200, "ok"))


class TextTests(SynchronousTestCase):
    def test_streamed_text_never_splits_a_multibyte_character(self) -> None:
        """Token by token, multi-byte characters split over byte tokens come out whole: no
        chunk holds U+FFFD and the chunks add up to the full decode."""
        tok = tokenizer()
        text = "héllo wörld 🙂 ok ☃"
        ids = [int(t) for t in tok.encode(text)]
        self.assertGreater(len(ids), len(text.split()))
        detok = Renderer(tok).detokenizer()
        chunks = [detok.push([t]) for t in ids]
        chunks.append(detok.flush())
        self.assertFalse(any("\ufffd" in c for c in chunks))
        self.assertEqual("".join(chunks), text)
        self.assertIn("", chunks)  # some tokens were held back: they ended mid-character

    def test_the_detokenizer_releases_text_as_soon_as_it_is_whole(self) -> None:
        """With a decode that only shows whole characters, each push releases its own text."""
        decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731
        detok = Detokenizer(decode)
        self.assertEqual([detok.push([1]), detok.push([2, 3]), detok.flush()], ["a", "bc", ""])

    def test_stop_strings_are_held_back_and_cut(self) -> None:
        """Text that may begin a stop string waits; the stop string and what follows never
        show; without stops everything passes at once."""
        stop = StopText(["END"])
        self.assertEqual(stop.feed("abcE"), "ab")
        self.assertEqual(stop.feed("N"), "c")
        self.assertEqual(stop.feed("Dxyz"), "")
        self.assertTrue(stop.stopped)
        self.assertEqual(stop.feed("more"), "")
        free = StopText([])
        self.assertEqual(free.feed("abc"), "abc")
        self.assertEqual(free.flush(), "")
        held = StopText(["xyz"])
        self.assertEqual(held.feed("axy"), "a")
        self.assertEqual(held.flush(), "xy")


class OpenAIClientTests(HttpTestCase):
    """The official ``openai`` package against a head over a real transformers node."""

    @defer.inlineCallbacks
    def test_the_openai_package_chats_streaming_and_not(self) -> Generator[Any, Any, None]:
        """openai's client gets greedy chat completions, plain and streamed, whose text is the
        detokenized greedy output of transformers' own generate() on the same prompt."""
        import openai

        from tests.tinymodel import reference_greedy

        _, model, tok, client = yield self.tiny_head(max_lanes=2)
        prompt = Renderer(tok).chat([ChatMessage("user", "hello world")])
        expected = reference_greedy(model, prompt, 10)
        expected_text = str(tok.decode(expected, skip_special_tokens=True))

        def plain() -> Any:
            return client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                max_tokens=10,
                temperature=0,  # type: ignore[arg-type]
            )

        def streamed() -> list[Any]:
            stream = client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                max_tokens=10,
                temperature=0,
                stream=True,  # type: ignore[arg-type]
            )
            return list(stream)

        completion = yield threads.deferToThread(plain)
        self.assertEqual(completion.choices[0].message.content, expected_text)
        self.assertEqual(completion.usage.completion_tokens, len(expected))
        self.assertEqual(completion.usage.prompt_tokens, len(prompt))
        finish = "stop" if len(expected) < 10 else "length"
        self.assertEqual(completion.choices[0].finish_reason, finish)
        chunks = yield threads.deferToThread(streamed)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, expected_text)
        self.assertEqual(chunks[-1].choices[0].finish_reason, finish)
        with self.assertRaises(openai.NotFoundError):
            yield threads.deferToThread(
                lambda: client.chat.completions.create(model="other", messages=MESSAGES)  # type: ignore[arg-type]
            )


class ChoicesAndRoutesTests(HttpTestCase):
    """Issue 11's API with the official ``openai`` package and raw HTTP, over real TCP, against
    a head whose node runs a real (tiny) transformers model."""

    @defer.inlineCallbacks
    def test_n_gives_that_many_choices_plain_and_streamed(self) -> Generator[Any, Any, None]:
        """n=3 returns three choices with indexes 0, 1, 2 (greedy: each is the greedy text);
        usage counts the prompt once and the tokens of all choices; streamed with
        include_usage, chunks carry their choice's index, each choice's text adds up to the
        same text and ends with its own finish_reason, and the last chunk holds the usage."""
        head, model, _, client = yield self.tiny_head()
        from tests.tinymodel import reference_greedy

        tok = head.api.renderer.codec
        prompt = head.api.renderer.chat([ChatMessage("user", "hello world")])
        expected = tok.decode(reference_greedy(model, prompt, 8))

        def plain() -> Any:
            return client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, n=3
            )

        def streamed() -> list[Any]:
            return list(
                client.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, n=2,
                    stream=True, stream_options={"include_usage": True},
                )
            )  # fmt: skip

        completion = yield threads.deferToThread(plain)
        self.assertEqual([c.index for c in completion.choices], [0, 1, 2])
        self.assertEqual([c.message.content for c in completion.choices], [expected] * 3)
        tokens = completion.usage.completion_tokens
        self.assertEqual(tokens % 3, 0)
        self.assertEqual(completion.usage.prompt_tokens, len(prompt))
        chunks = yield threads.deferToThread(streamed)
        texts = {0: "", 1: ""}
        finishes: dict[int, list[Any]] = {0: [], 1: []}
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index].append(choice.finish_reason)
        self.assertEqual(texts, {0: expected, 1: expected})
        for index in (0, 1):
            self.assertIn(finishes[index][-1], ("length", "stop"))
            self.assertEqual(set(finishes[index][:-1]), {None})
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, tokens * 2 // 3)

    @defer.inlineCallbacks
    def test_each_choice_samples_with_its_own_seed(self) -> Generator[Any, Any, None]:
        """Sampled at temperature 1 with seed 5, choice i of n=3 is exactly what a request of
        n=1 gets with seed choice_seed(5, i): choice 0 with the request's own seed."""
        from sfnode.head.api.schema import choice_seed

        _, _, _, client = yield self.tiny_head()

        def chat(n: int, seed: int) -> Any:
            return client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=12, temperature=1, seed=seed, n=n
            )

        together = yield threads.deferToThread(chat, 3, 5)
        for i in range(3):
            alone = yield threads.deferToThread(chat, 1, choice_seed(5, i))
            self.assertEqual(together.choices[i].message.content, alone.choices[0].message.content)

    @defer.inlineCallbacks
    def test_models_retrieve_finds_the_model_or_raises_not_found(
        self,
    ) -> Generator[Any, Any, None]:
        """models.retrieve gives the served model (with its context length) and raises
        NotFoundError (404, model_not_found) for another; models.list lists the one."""
        import openai

        _, _, _, client = yield self.tiny_head()
        model = yield threads.deferToThread(client.models.retrieve, "tiny")
        self.assertEqual((model.id, model.object), ("tiny", "model"))
        self.assertEqual(model.model_extra["context_length"], 256)
        with self.assertRaises(openai.NotFoundError) as raised:
            yield threads.deferToThread(client.models.retrieve, "no-such-model")
        self.assertEqual(raised.exception.code, "model_not_found")
        listed = yield threads.deferToThread(lambda: list(client.models.list()))
        self.assertEqual([m.id for m in listed], ["tiny"])

    @defer.inlineCallbacks
    def test_every_route_answers_errors_in_json(self) -> Generator[Any, Any, None]:
        """An unknown path is 404, a wrong method 405 with Allow, both in OpenAI's JSON shape
        from raw HTTP; the openai package raises NotFoundError for an unknown path and
        BadRequestError naming top_logprobs past OpenAI's bound of 20."""
        import openai

        head, _, _, client = yield self.tiny_head()
        for method, path, status, allow in [
            (b"GET", "/no/such/path", 404, None),
            (b"GET", "/", 404, None),
            (b"GET", "/v1", 404, None),
            (b"GET", "/v1/chat/completions", 405, [b"POST"]),
            (b"DELETE", "/v1/models", 405, [b"GET"]),
            (b"PUT", "/healthz", 405, [b"GET"]),
            (b"BREW", "/v1/completions", 405, [b"POST"]),
        ]:
            response = yield Agent(reactor).request(method, (head.base + path).encode())
            content = yield readBody(response)
            self.assertEqual(response.code, status, (method, path, content))
            self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
            self.assertEqual(response.headers.getRawHeaders(b"server"), [b"sfhead"])
            self.assertEqual(response.headers.getRawHeaders(b"allow"), allow)
            error = json.loads(content)["error"]
            self.assertEqual(set(error), {"message", "type", "param", "code"})
        with self.assertRaises(openai.NotFoundError):
            yield threads.deferToThread(client.get, "/no/such/path", cast_to=object)
        with self.assertRaises(openai.BadRequestError) as raised:
            yield threads.deferToThread(
                lambda: client.chat.completions.create(
                    model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=21
                )
            )
        self.assertEqual(raised.exception.body["param"], "top_logprobs")
