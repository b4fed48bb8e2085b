"""The head's HTTP API key, its loopback admission, and its drain on stop (SIGTERM).

Heads here are the real service tree of ``twistd sfhead`` (``sfnode.head.tap.makeService`` on the
tiny test tokenizer) listening on loopback TCP, with mock-engine nodes of tests/test_http.py
behind them; requests go through ``twisted.web.client.Agent``, raw sockets and the official
``openai`` package.  Two tests run ``twistd sfhead`` as a real process: the admission refusal,
and SIGTERM during a stream.  No sleeps: every wait is a Deferred.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Generator, Sequence
from io import BytesIO
from pathlib import Path
from typing import Any

from twisted.application.service import MultiService
from twisted.internet import defer, reactor, threads
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionRefusedError, ProcessDone
from twisted.internet.protocol import Protocol
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, FileBodyProducer, readBody
from twisted.web.http_headers import Headers

from sfnode.engines.mock import MockEngine
from sfnode.generation import EngineStop
from sfnode.head.api.gate import GateLimits
from sfnode.head.api.http import OpenAIApi
from sfnode.head.tap import Options, makeService
from tests.clients import openai_client
from tests.nodefixture import RunningNode
from tests.processes import LOOPBACK, TWISTD, Child, child_env, mock_node_and_head, spawn_twistd
from tests.test_http import (
    MESSAGES,
    MODEL,
    HttpTestCase,
    StreamingClient,
    record_ends,
    sse_events,
    tokenizer,
)
from tests.tinymodel import TINY_VOCAB

KEY = "sk-test-0123456789abcdef"


def parse(*args: str) -> Options:
    options = Options()
    options.parseOptions(list(args))
    return options


class RunningHead:
    """A started ``sfhead`` service tree and the address of its HTTP API."""

    def __init__(self, service: MultiService, port: int) -> None:
        self.service = service
        self.port = port

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> OpenAIApi:
        api: OpenAIApi = self.service.getServiceNamed("http").api  # type: ignore[no-untyped-call]
        return api


class HeadServiceTestCase(HttpTestCase):
    @defer.inlineCallbacks
    def start_sfhead(
        self, nodes: Sequence[RunningNode], *args: str
    ) -> Generator[defer.Deferred[Any], Any, RunningHead]:
        """makeService on the tiny tokenizer with ``args``, started, with ``nodes`` added."""
        folder = self.mktemp()
        tokenizer().save_pretrained(folder)
        options = parse(
            "--model", folder, "--model-name", MODEL, "--http", LOOPBACK,
            "--fleet-listen", LOOPBACK, *args,
        )  # fmt: skip
        head = makeService(options, reactor)
        head.startService()  # type: ignore[no-untyped-call]

        def stop() -> Any:
            return head.stopService() if head.running else None  # type: ignore[no-untyped-call]

        self.addCleanup(stop)
        port = yield head.getServiceNamed("http").bound  # type: ignore[no-untyped-call]
        fleet = head.getServiceNamed("fleet").fleet  # type: ignore[no-untyped-call]
        for node in nodes:
            yield fleet.add_node(node.endpoint)
        return RunningHead(head, port.getHost().port)

    @defer.inlineCallbacks
    def request(
        self,
        head: RunningHead,
        method: bytes,
        path: str,
        body: Any = None,
        *,
        authorization: str | None = None,
    ) -> Generator[defer.Deferred[Any], Any, tuple[int, Headers, bytes]]:
        headers = Headers({b"content-type": [b"application/json"]})
        if authorization is not None:
            headers.addRawHeader(b"authorization", authorization.encode())
        producer = None if body is None else FileBodyProducer(BytesIO(json.dumps(body).encode()))
        response = yield Agent(reactor).request(
            method, (head.base + path).encode(), headers, producer
        )
        content = yield readBody(response)
        return response.code, response.headers, content


CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}


class ApiKeyTests(HeadServiceTestCase):
    @defer.inlineCallbacks
    def test_v1_needs_the_bearer_key_and_health_and_metrics_do_not(
        self,
    ) -> Generator[Any, Any, None]:
        """With --api-key, every /v1 path (known or not) and /metrics answer 401 in OpenAI's
        error shape (code invalid_api_key, a WWW-Authenticate: Bearer header) to a missing
        key, a wrong key, a key of another length and the right key under another scheme; the
        right bearer key is served; /healthz answers without any key, and /metrics with the
        key counts the refusals."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--api-key", KEY)
        refused = [
            (b"POST", "/v1/chat/completions", CHAT, None),
            (b"POST", "/v1/chat/completions", CHAT, "Bearer " + KEY[:-1] + "0"),
            (b"POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}, "Bearer x"),
            (b"POST", "/v1/chat/completions", CHAT, "Basic " + KEY),
            (b"POST", "/v1/chat/completions", CHAT, KEY),
            (b"GET", "/v1/models", None, "Bearer " + KEY + "0"),
            (b"GET", "/v1/nothing/here", None, None),
            (b"GET", "/v1", None, None),
            (b"GET", "/metrics", None, None),
            (b"GET", "/metrics", None, "Bearer x"),
        ]
        for method, path, body, authorization in refused:
            code, headers, content = yield self.request(
                head, method, path, body, authorization=authorization
            )
            self.assertEqual(code, 401, (path, authorization))
            error = json.loads(content)["error"]
            self.assertEqual(set(error), {"message", "type", "param", "code"})
            self.assertEqual(
                (error["type"], error["param"], error["code"]),
                ("invalid_request_error", None, "invalid_api_key"),
            )
            self.assertEqual(headers.getRawHeaders(b"www-authenticate"), [b"Bearer"])
        code, _, content = yield self.request(
            head, b"POST", "/v1/chat/completions", CHAT, authorization="Bearer " + KEY
        )
        self.assertEqual(code, 200, content)
        self.assertEqual(json.loads(content)["usage"]["completion_tokens"], 5)
        code, _, content = yield self.request(
            head, b"GET", "/v1/models", authorization="bearer " + KEY
        )
        self.assertEqual((code, json.loads(content)["data"][0]["id"]), (200, MODEL))
        code, _, content = yield self.request(head, b"GET", "/healthz")
        self.assertEqual((code, json.loads(content)["status"]), (200, "ok"))
        code, _, content = yield self.request(
            head, b"GET", "/metrics", authorization="Bearer " + KEY
        )
        self.assertEqual(code, 200)
        self.assertIn(
            f'sfhead_requests_total{{outcome="unauthorized"}} {float(len(refused))}',
            content.decode(),
        )

    @defer.inlineCallbacks
    def test_the_openai_package_with_a_wrong_and_the_right_key(
        self,
    ) -> Generator[Any, Any, None]:
        """The openai package raises AuthenticationError (HTTP 401) with a wrong key, and with
        the right key gets plain and streamed chat completions."""
        import openai

        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--api-key", KEY)

        wrong = openai_client(self, head.base + "/v1", api_key="sk-wrong")
        right = openai_client(self, head.base + "/v1", api_key=KEY)

        def chat(with_client: Any, **extra: Any) -> Any:
            return with_client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, **extra
            )

        with self.assertRaises(openai.AuthenticationError) as raised:
            yield threads.deferToThread(chat, wrong)
        self.assertEqual(raised.exception.status_code, 401)
        self.assertEqual(raised.exception.code, "invalid_api_key")
        completion = yield threads.deferToThread(chat, right)
        self.assertEqual(completion.usage.completion_tokens, 5)
        chunks = yield threads.deferToThread(lambda: list(chat(right, stream=True)))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, completion.choices[0].message.content)


class ApiKeyOptionTests(TestCase):
    """How ``--api-key`` and ``--api-key-file`` are read."""

    def test_the_key_is_bytes_and_a_key_file_is_trimmed(self) -> None:
        """--api-key gives the key as bytes; --api-key-file reads it trimmed of whitespace;
        without either there is no key."""
        self.assertEqual(parse("--api-key", KEY)["api-key"], KEY.encode())
        path = Path(self.mktemp())
        path.write_text(f"  {KEY}\n\n")
        self.assertEqual(parse("--api-key-file", str(path))["api-key"], KEY.encode())
        self.assertIsNone(parse()["api-key"])

    def test_unusable_keys_are_usage_errors(self) -> None:
        """Both options at once, an empty or blank key file, a missing file, and a key that
        cannot travel in a bearer header (spaces, non-ASCII) are refused."""
        blank = Path(self.mktemp())
        blank.write_text(" \n")
        good = Path(self.mktemp())
        good.write_text(KEY)
        for args in (
            ["--api-key", KEY, "--api-key-file", str(good)],
            ["--api-key-file", str(blank)],
            ["--api-key-file", str(Path(self.mktemp()) / "missing")],
            ["--api-key", ""],
            ["--api-key", "two words"],
            ["--api-key", "clé"],
        ):
            self.assertRaises(usage.UsageError, parse, *args)


class HttpLimitOptionTests(TestCase):
    """The front door's options (sfnode.head.api.gate.GateLimits)."""

    def test_defaults_are_the_gate_defaults(self) -> None:
        """Without options the limits are GateLimits' defaults: a 4 MiB body, 10 s for the
        headers, 60 s for the body, 30 s of stall, 1024 connections, 64 requests per client
        address, none per key, no extra host, no CORS."""
        self.assertEqual(parse()["limits"], GateLimits())
        self.assertEqual(
            (GateLimits.max_body, GateLimits.max_connections, GateLimits.max_client_requests),
            (4 * 1024 * 1024, 1024, 64),
        )

    def test_values_are_typed(self) -> None:
        """Sizes take k, M and G suffixes; timeouts take fractions; limits take 0 (none);
        --allowed-host and --cors-origin repeat."""
        limits = parse(
            "--max-body", "64k", "--header-timeout", "2.5", "--body-timeout", "7",
            "--stall-timeout", "0.5", "--max-connections", "9", "--max-client-requests", "0",
            "--max-key-requests", "3", "--allowed-host", "Head.Example",
            "--allowed-host", "other", "--cors-origin", "https://app.example",
        )["limits"]  # fmt: skip
        self.assertEqual(
            limits,
            GateLimits(
                max_body=65536, header_timeout_s=2.5, body_timeout_s=7.0, stall_timeout_s=0.5,
                max_connections=9, max_client_requests=0, max_key_requests=3,
                allowed_hosts=frozenset({"head.example", "other"}),
                cors_origins=frozenset({"https://app.example"}),
            ),
        )  # fmt: skip
        self.assertEqual(parse("--max-body", "2M")["limits"].max_body, 2 * 1024 * 1024)
        self.assertEqual(parse("--max-body", "1g")["limits"].max_body, 1024**3)
        self.assertEqual(parse("--max-body", "1000")["limits"].max_body, 1000)

    def test_the_fair_share_options(self) -> None:
        """--max-client-connections (64), --max-client-queued (a quarter of --max-queued,
        at least 1; 0 turns it off), --template-timeout (5 s), --metrics-public and
        --allow-special-tokens (off) are read and typed."""
        options = parse()
        self.assertEqual(
            (options["limits"].max_client_connections, options["max-client-queued"],
             options["template-timeout"], options["limits"].metrics_public,
             options["allow-special-tokens"]),
            (64, 64, 5.0, False, 0),
        )  # fmt: skip
        self.assertEqual(parse("--max-queued", "10")["max-client-queued"], 2)
        self.assertEqual(parse("--max-queued", "2")["max-client-queued"], 1)
        self.assertEqual(parse("--max-queued", "0")["max-client-queued"], 0)
        self.assertEqual(parse("--max-client-queued", "0")["max-client-queued"], 0)
        options = parse(
            "--max-client-connections", "0", "--template-timeout", "0.25", "--metrics-public",
            "--allow-special-tokens", "--max-client-queued", "7",
        )  # fmt: skip
        self.assertEqual(
            (options["limits"].max_client_connections, options["template-timeout"],
             options["limits"].metrics_public, options["allow-special-tokens"],
             options["max-client-queued"]),
            (0, 0.25, True, 1, 7),
        )  # fmt: skip

    def test_bad_values_are_usage_errors(self) -> None:
        """A size of 0 or in words, a timeout of 0 or less, a negative limit and no
        connection at all are refused, naming the option."""
        for args in (
            ["--max-body", "0"],
            ["--max-body", "lots"],
            ["--max-body", "-4M"],
            ["--header-timeout", "0"],
            ["--body-timeout", "-1"],
            ["--stall-timeout", "never"],
            ["--max-connections", "0"],
            ["--max-client-requests", "-1"],
            ["--max-key-requests", "x"],
            ["--max-client-connections", "-1"],
            ["--max-client-queued", "many"],
            ["--template-timeout", "0"],
        ):
            with self.assertRaises(usage.UsageError) as raised:
                parse(*args)
            self.assertIn(args[0], str(raised.exception))

    def test_a_key_file_may_hold_several_keys(self) -> None:
        """--api-key-file reads one key per line, skipping blank lines and # comments; a line
        that cannot be a bearer token is refused."""
        path = Path(self.mktemp())
        path.write_text(f"# team a\n{KEY}\n\n  sk-b  \n")
        options = parse("--api-key-file", str(path))
        self.assertEqual(options["api-keys"], (KEY.encode(), b"sk-b"))
        path.write_text(f"{KEY}\nnot a key\n")
        self.assertRaises(usage.UsageError, parse, "--api-key-file", str(path))
        path.write_text("# only a comment\n")
        self.assertRaises(usage.UsageError, parse, "--api-key-file", str(path))


class HttpAdmissionTests(TestCase):
    """Without an API key the HTTP API stays on loopback unless --insecure-http."""

    def test_an_open_api_off_loopback_is_refused(self) -> None:
        """--http on every interface or on a routable address, without a key, is a usage
        error that names --api-key and --insecure-http; --insecure-no-auth (the fleet-token
        override) does not open the API."""
        for http in ("tcp:8453", "tcp:8453:interface=0.0.0.0", "tcp:8453:interface=10.1.2.3"):
            for extra in ([], ["--insecure-no-auth"]):
                with self.assertRaises(usage.UsageError) as raised:
                    parse("--http", http, *extra)
                self.assertIn("without an API key", str(raised.exception))
                self.assertIn("--api-key", str(raised.exception))
                self.assertIn("--insecure-http", str(raised.exception))

    def test_a_key_loopback_or_insecure_http_is_allowed(self) -> None:
        """An API key, a loopback interface (IPv4, IPv6, a Unix socket) or --insecure-http
        lets the options parse."""
        allowed = [
            ["--http", "tcp:8453", "--api-key", KEY],
            ["--http", "tcp:8453:interface=0.0.0.0", "--insecure-http"],
            ["--http", "tcp:8453:interface=127.0.0.1"],
            ["--http", "tcp6:8453:interface=\\:\\:1"],
            ["--http", f"unix:{self.mktemp()}"],
        ]
        for args in allowed:
            self.assertEqual(parse(*args)["http"], args[1])

    def test_drain_timeout_is_seconds(self) -> None:
        """--drain-timeout defaults to 30 s, takes fractions and 0, and refuses negative or
        non-numeric values."""
        self.assertEqual(parse()["drain-timeout"], 30.0)
        self.assertEqual(parse("--drain-timeout", "0.5")["drain-timeout"], 0.5)
        self.assertEqual(parse("--drain-timeout", "0")["drain-timeout"], 0.0)
        for bad in ("-1", "soon", "inf"):
            self.assertRaises(usage.UsageError, parse, "--drain-timeout", bad)

    @defer.inlineCallbacks
    def test_twistd_refuses_an_open_api_before_loading_anything(
        self,
    ) -> Generator[Any, Any, None]:
        """A real ``twistd sfhead --http tcp:0`` without a key exits non-zero with the reason,
        before it loads a tokenizer or listens anywhere."""
        folder = Path(self.mktemp())
        folder.mkdir(parents=True)
        out, err, code = yield getProcessOutputAndValue(
            sys.executable,
            ["-c", TWISTD, "--pidfile=", "-n", "sfhead", "--http", "tcp:0"],
            env=child_env(),
            path=str(folder),
        )
        output = (out + err).decode(errors="replace")
        self.assertNotEqual(code, 0, output)
        self.assertIn("refusing to serve HTTP on tcp:0 without an API key", output)
        self.assertNotIn("serving HTTP on", output)


class _RawClient(Protocol):
    """A raw HTTP/1.1 connection; ``ended`` fires with everything received when it closes."""

    def __init__(self) -> None:
        self.data = b""
        self.ended: defer.Deferred[bytes] = defer.Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.ended.callback(self.data)


def raw_post(path: str, body: Any) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


class DrainTests(HeadServiceTestCase):
    @defer.inlineCallbacks
    def stream(
        self, head: RunningHead, max_tokens: int
    ) -> Generator[defer.Deferred[Any], Any, StreamingClient]:
        """A streamed completion, once its first text arrived."""
        body = {
            "model": MODEL, "prompt": list(range(100, 112)), "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        response = yield Agent(reactor).request(
            b"POST",
            (head.base + "/v1/completions").encode(),
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(json.dumps(body).encode())),
        )
        self.assertEqual(response.code, 200)
        received = StreamingClient(b"text")
        response.deliverBody(received)
        yield received.content_seen
        return received

    @defer.inlineCallbacks
    def test_stop_lets_a_running_stream_finish_and_refuses_new_requests(
        self,
    ) -> Generator[Any, Any, None]:
        """stopService while a stream runs: the port stops listening, a request on a
        connection that was already open gets 503 (code draining) and /healthz says draining,
        the stream still completes (all its tokens, finish_reason length, [DONE]) and only
        then does the service finish stopping, with the node's generation never cancelled."""
        node = yield self.start_vocab_node(token_delay_s=0.005)
        head = yield self.start_sfhead([node])
        idle = _RawClient()
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", head.port), idle)
        late = _RawClient()
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", head.port), late)
        running = yield self.stream(head, 200)
        stopped = head.service.stopService()  # type: ignore[no-untyped-call]
        self.assertEqual(len(head.api.exchanges), 1)
        self.assertFalse(stopped.called)

        assert idle.transport is not None and late.transport is not None
        idle.transport.write(raw_post("/v1/completions", {"model": MODEL, "prompt": "hi"}))
        answer = yield idle.ended
        head_part, _, content = answer.partition(b"\r\n\r\n")
        self.assertTrue(head_part.startswith(b"HTTP/1.1 503 "), answer)
        error = json.loads(content)["error"]
        self.assertEqual((error["type"], error["code"]), ("service_unavailable", "draining"))
        late.transport.write(
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        health = yield late.ended
        self.assertTrue(health.startswith(b"HTTP/1.1 503 "), health)
        self.assertEqual(json.loads(health.partition(b"\r\n\r\n")[2])["status"], "draining")

        events = sse_events((yield running.ended))
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(events[-2]["usage"]["completion_tokens"], 200)
        self.assertEqual(events[-3]["choices"][0]["finish_reason"], "length")
        yield stopped
        self.assertFalse(head.service.running)
        with self.assertRaises(ConnectionRefusedError):
            yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", head.port), _RawClient())
        metrics = head.api.metrics.registry
        self.assertEqual(metrics.get_sample_value("sfhead_requests_total", {"outcome": "ok"}), 1.0)
        self.assertIsNone(metrics.get_sample_value("sfhead_requests_total", {"outcome": "drained"}))

    @defer.inlineCallbacks
    def test_the_drain_timeout_cancels_what_still_runs(self) -> Generator[Any, Any, None]:
        """With --drain-timeout 0.1 a stream that would run for minutes is cancelled on the
        node (its engine ends the generation CANCELLED), the client still gets a clean end
        (finish_reason stop, then [DONE]), and the service finishes stopping."""
        engine = MockEngine(reactor, token_delay_s=0.005, vocab_size=TINY_VOCAB)
        ended = record_ends(engine)
        node = yield self.start_vocab_node(engine=engine)
        head = yield self.start_sfhead([node], "--drain-timeout", "0.1")
        running = yield self.stream(head, 100000)
        stopped = head.service.stopService()  # type: ignore[no-untyped-call]
        self.assertFalse(stopped.called)
        result = yield ended[0]
        self.assertEqual(result.stop, EngineStop.CANCELLED)
        events = sse_events((yield running.ended))
        self.assertEqual(events[-1], "[DONE]")
        self.assertLess(events[-2]["usage"]["completion_tokens"], 100000)
        self.assertEqual(events[-3]["choices"][0]["finish_reason"], "stop")
        yield stopped
        self.assertFalse(head.service.running)
        self.assertEqual(head.api.exchanges, set())
        self.assertEqual(
            head.api.metrics.registry.get_sample_value(
                "sfhead_requests_total", {"outcome": "drained"}
            ),
            1.0,
        )


class _Exit(Child):
    """A child that also keeps how it ended (ProcessDone or ProcessTerminated)."""

    how: BaseException | None = None

    def processEnded(self, reason: Failure) -> None:
        self.how = reason.value
        super().processEnded(reason)


class SigtermTests(TestCase):
    timeout = 120

    def spawn(self, name: str, args: list[str]) -> _Exit:
        spawn_twistd(self, child := _Exit(name), args)
        return child

    @defer.inlineCallbacks
    def test_sigterm_finishes_the_running_stream_then_exits_0(
        self,
    ) -> Generator[Any, Any, None]:
        """SIGTERM to a real twistd sfhead during a stream: the stream still ends with all its
        tokens and [DONE] (the last bytes are flushed before the reactor stops), the head logs
        its drain, and it exits 0 without a traceback."""
        _, head, base = yield mock_node_and_head(self.spawn, "proc", "--token-delay-ms", "10")
        body = {
            "model": "mock", "prompt": list(range(100, 112)), "max_tokens": 150, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        response = yield Agent(reactor).request(
            b"POST",
            (base + "/v1/completions").encode(),
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(json.dumps(body).encode())),
        )
        received = StreamingClient(b"text")
        response.deliverBody(received)
        yield received.content_seen
        head.transport.signalProcess("TERM")
        events = sse_events((yield received.ended))
        yield head.ended
        self.assertEqual(events[-1], "[DONE]", bytes(head.output).decode())
        self.assertEqual(events[-2]["usage"]["completion_tokens"], 150)
        output = bytes(head.output)
        self.assertIsInstance(head.how, ProcessDone, output)
        self.assertIn(b"draining HTTP", output)
        self.assertIn(b"sfhead stopped", output)
        self.assertNotIn(b"Traceback", output)
