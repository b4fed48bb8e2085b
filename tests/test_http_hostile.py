"""The head under hostile input, over real TCP: bounded bodies, the key first, no blocking, no 500s,
no reach from browsers, limits per client and in total.

Heads are the real ``sfhead`` service tree (makeService on the tiny test tokenizer) or an
OpenAIApi on loopback, with mock-engine nodes behind them.  Clients are raw sockets, so that a
test can send exactly what an attacker sends: headers without a body, a body one byte at a
time, a stream it never reads.  Waits are Deferreds; where a deadline of the head must pass,
the deadline is short and the test waits for its effect (an answer, a closed connection), never
for a time.
"""

from __future__ import annotations

import json
import tempfile
import threading
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure

from sfnode.engines.config import EngineConfig
from sfnode.engines.mock import MockEngine
from sfnode.generation import EngineStop
from sfnode.head.api.gate import GateLimits
from sfnode.head.api.http import INLINE_BODY_BYTES
from sfnode.head.models.text import TransformersCodec
from tests.test_head_security import KEY, HeadServiceTestCase
from tests.test_http import MESSAGES, MODEL, Head, tokenizer
from tests.tinymodel import TINY_VOCAB

CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0}


class RawClient(Protocol):
    """One raw HTTP/1.1 connection: ``answered`` fires at the first bytes back, ``ended``
    with everything received when the connection closes."""

    def __init__(self) -> None:
        self.data = b""
        self.answered: defer.Deferred[None] = defer.Deferred()
        self.ended: defer.Deferred[bytes] = defer.Deferred()
        self.closed = False

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        if not self.answered.called:
            self.answered.callback(None)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.closed = True
        if not self.answered.called:
            self.answered.callback(None)
        self.ended.callback(self.data)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def drip(self, data: bytes, every_s: float) -> defer.Deferred[int]:
        """Send ``data`` one byte every ``every_s`` seconds until it is all sent or the
        connection closes; fires with the bytes sent when the connection closes."""
        sent = 0

        def one() -> None:
            nonlocal sent
            if not self.closed and sent < len(data):
                self.send(data[sent : sent + 1])
                sent += 1

        dripping = LoopingCall(one)
        dripping.start(every_s)

        done: defer.Deferred[int] = defer.Deferred()

        def ended(data: bytes) -> bytes:
            dripping.stop()
            done.callback(sent)
            return data

        self.ended.addCallback(ended)
        return done


def response_of(data: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """(status, lower-cased headers, body) of one HTTP/1.1 response (a chunked body is
    put back together)."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding") == b"chunked":
        chunks, rest = [], body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            chunks.append(rest[:size])
            rest = rest[size + 2 :]
        body = b"".join(chunks)
    return status, headers, body


def request_bytes(
    path: str,
    body: bytes = b"",
    *,
    method: str = "POST",
    host: str = "127.0.0.1",
    content_type: str | None = "application/json",
    extra: Sequence[str] = (),
    length: int | None = None,
    chunked: bool = False,
) -> bytes:
    """A request's bytes (its body, if any, after the headers)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif method == "POST":
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    lines.extend(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class HostileTestCase(HeadServiceTestCase):
    @defer.inlineCallbacks
    def connect(
        self, port: int, bind: str | None = None
    ) -> Generator[defer.Deferred[Any], Any, RawClient]:
        """A raw connection to the head (from ``bind``, another loopback address, if given)."""
        client = RawClient()
        endpoint = TCP4ClientEndpoint(
            reactor, "127.0.0.1", port, bindAddress=(bind, 0) if bind else None
        )
        yield connectProtocol(endpoint, client)

        def close() -> Any:
            if client.closed:
                return None
            assert client.transport is not None
            client.transport.abortConnection()
            return client.ended

        self.addCleanup(close)
        return client

    @defer.inlineCallbacks
    def exchange(
        self, port: int, data: bytes, bind: str | None = None
    ) -> Generator[defer.Deferred[Any], Any, tuple[int, dict[bytes, bytes], bytes]]:
        """Send ``data`` on a new connection and read the answer until the head closes it."""
        client = yield self.connect(port, bind)
        client.send(data)
        answer = yield client.ended
        return response_of(answer)

    def assert_json_error(
        self, answer: tuple[int, dict[bytes, bytes], bytes], status: int, code: str | None
    ) -> dict[str, Any]:
        got, headers, body = answer
        self.assertEqual(got, status, body)
        self.assertEqual(headers[b"content-type"], b"application/json")
        self.assertEqual(headers[b"server"], b"sfhead")
        error: dict[str, Any] = json.loads(body)["error"]
        self.assertEqual(set(error), {"message", "type", "param", "code"})
        self.assertEqual(error["code"], code)
        return error


class BodyLimitTests(HostileTestCase):
    @defer.inlineCallbacks
    def test_a_keyless_100_mb_body_is_refused_before_1_mb_is_read(
        self,
    ) -> Generator[Any, Any, None]:
        """A keyed head answers a POST of 100 MB without Authorization with 401 after its
        headers: the client, which sends one 64 KiB chunk per reactor turn until an answer
        arrives, has sent less than 1 MB by then, and no temporary file is ever created."""
        opened: list[Any] = []
        self.patch(tempfile, "TemporaryFile", lambda *a, **k: opened.append(a) or 1 / 0)
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--api-key", KEY)
        client = yield self.connect(head.port)
        client.send(request_bytes("/v1/chat/completions", length=100_000_000))
        sent = 0
        while not client.answered.called and sent < 100_000_000:
            client.send(b"x" * 65536)
            sent += 65536
            yield deferLater(reactor, 0, lambda: None)
        self.assertLess(sent, 1_000_000)
        error = self.assert_json_error(response_of((yield client.ended)), 401, "invalid_api_key")
        self.assertIn("didn't provide an API key", error["message"])
        self.assertEqual(opened, [])

    @defer.inlineCallbacks
    def test_bodies_over_max_body_are_413_declared_or_streamed(
        self,
    ) -> Generator[Any, Any, None]:
        """With --max-body 64k: a Content-Length over it is 413 from the headers; a chunked
        body is 413 as soon as it passes the limit; a body at the limit is read (in memory,
        never a temporary file) and answered."""
        opened: list[Any] = []
        self.patch(tempfile, "TemporaryFile", lambda *a, **k: opened.append(a) or 1 / 0)
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--max-body", "64k")
        answer = yield self.exchange(head.port, request_bytes("/v1/completions", length=65537))
        self.assert_json_error(answer, 413, "request_too_large")
        client = yield self.connect(head.port)
        client.send(request_bytes("/v1/completions", chunked=True))
        chunks = 0
        while not client.answered.called and chunks < 1000:
            client.send(b"1000\r\n" + b" " * 0x1000 + b"\r\n")
            chunks += 1
            yield deferLater(reactor, 0, lambda: None)
        self.assertLess(chunks * 0x1000, 200_000)
        self.assert_json_error(response_of((yield client.ended)), 413, "request_too_large")
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 2}
        padded = json.dumps(body).encode()
        padded += b" " * (65536 - len(padded))
        status, _, content = yield self.exchange(
            head.port, request_bytes("/v1/completions", padded)
        )
        self.assertEqual(status, 200, content)
        self.assertEqual(opened, [])
        self.assertEqual(
            head.api.metrics.registry.get_sample_value(
                "sfhead_requests_total", {"outcome": "too_large"}
            ),
            2.0,
        )


class _BlockingCodec(TransformersCodec):
    """The tiny tokenizer, whose encode waits for the test's go (on whatever thread calls
    it) and says which thread that was."""

    def __init__(self) -> None:
        super().__init__(tokenizer())
        self.started: defer.Deferred[threading.Thread] = defer.Deferred()
        self.go = threading.Event()
        self.encoded = 0

    def encode(self, text: str, *, special: bool, parse_special: bool = False) -> list[int]:
        self.encoded += 1
        if len(text) > INLINE_BODY_BYTES:
            reactor.callFromThread(self.started.callback, threading.current_thread())
            self.go.wait(60)
        return super().encode(text, special=special, parse_special=parse_special)


class OffTheReactorTests(HostileTestCase):
    @defer.inlineCallbacks
    def start_api_head(
        self, codec: Any, window: int, **limits: Any
    ) -> Generator[defer.Deferred[Any], Any, Head]:
        node = yield self.start_vocab_node(context_window=window)
        head = yield self.start_head([node], tok=codec, limits=GateLimits(**limits))
        return head

    @defer.inlineCallbacks
    def test_a_5_mb_prompt_is_tokenized_on_a_worker_while_health_is_answered(
        self,
    ) -> Generator[Any, Any, None]:
        """A 5 MB prompt is tokenized on a worker thread, not the reactor's: while its
        tokenizing is held, /healthz and a small completion are answered; released, the
        prompt is counted in tokens (longer than the window: 400 context_length_exceeded)."""
        codec = _BlockingCodec()
        head = yield self.start_api_head(codec, 500_000, max_body=8 * 1024 * 1024)
        prompt = "the quick brown fox " * (5_000_000 // 20)
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
        big = self.call(head, b"POST", "/v1/completions", raw=body)
        worker = yield codec.started
        self.assertIsNot(worker, threading.main_thread())
        code, content = yield self.call(head, b"GET", "/healthz")
        self.assertEqual((code, json.loads(content)["status"]), (200, "ok"))
        code, content = yield self.call(head, b"POST", "/v1/chat/completions", CHAT)
        self.assertEqual(code, 200, content)
        self.assertFalse(big.called)
        codec.go.set()
        code, content = yield big
        self.assertEqual(code, 400, content)
        error = json.loads(content)["error"]
        self.assertEqual((error["code"], error["param"]), ("context_length_exceeded", "prompt"))
        self.assertIn("maximum context length is 500000 tokens", error["message"])

    @defer.inlineCallbacks
    def test_more_characters_than_the_window_can_hold_are_never_tokenized(
        self,
    ) -> Generator[Any, Any, None]:
        """A prompt with more characters than the window times the longest token is a 400
        context_length_exceeded that names the field, and the tokenizer never sees it."""
        codec = _BlockingCodec()
        head = yield self.start_api_head(codec, 16)
        longest = codec.longest_token
        for path, body, param in [
            ("/v1/completions", {"model": MODEL, "prompt": "x" * (16 * longest + 1)}, "prompt"),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "x" * 200}]},
                "messages",
            ),
        ]:
            code, content = yield self.call(head, b"POST", path, body)
            self.assertEqual(code, 400, content)
            error = json.loads(content)["error"]
            self.assertEqual((error["code"], error["param"]), ("context_length_exceeded", param))
        self.assertEqual(codec.encoded, 0)


class BrowserTests(HostileTestCase):
    @defer.inlineCallbacks
    def test_other_hosts_are_refused_on_an_open_api(self) -> Generator[Any, Any, None]:
        """Without an API key, Host: evil.example (with or without a port, any path) is 403
        host_not_allowed; IP addresses, localhost and names given with --allowed-host are
        served."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--allowed-host", "head.example")
        body = json.dumps(CHAT).encode()
        for host in ("evil.example", f"evil.example:{head.port}", "127.0.0.1.evil.example"):
            for path, method in (("/v1/chat/completions", "POST"), ("/healthz", "GET")):
                answer = yield self.exchange(
                    head.port, request_bytes(path, body, method=method, host=host)
                )
                self.assert_json_error(answer, 403, "host_not_allowed")
        for host in (
            f"127.0.0.1:{head.port}", "localhost", f"LOCALHOST:{head.port}", "[::1]:8453",
            "head.example", f"head.example:{head.port}", "10.0.0.7",
        ):  # fmt: skip
            status, _, content = yield self.exchange(
                head.port, request_bytes("/v1/chat/completions", body, host=host)
            )
            self.assertEqual(status, 200, (host, content))

    @defer.inlineCallbacks
    def test_a_keyed_api_answers_any_host(self) -> Generator[Any, Any, None]:
        """With an API key (which a browser page cannot send) any Host is answered."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--api-key", KEY)
        status, _, content = yield self.exchange(
            head.port,
            request_bytes(
                "/v1/chat/completions",
                json.dumps(CHAT).encode(),
                host="head.example",
                extra=[f"Authorization: Bearer {KEY}"],
            ),
        )
        self.assertEqual(status, 200, content)

    @defer.inlineCallbacks
    def test_only_json_bodies_are_taken(self) -> Generator[Any, Any, None]:
        """text/plain, a form post, multipart and no Content-Type are 415 before the body is
        read; application/json with a charset is taken."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node])
        body = json.dumps(CHAT).encode()
        for content_type in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            None,
        ):
            answer = yield self.exchange(
                head.port,
                request_bytes("/v1/chat/completions", body, content_type=content_type),
            )
            self.assert_json_error(answer, 415, "unsupported_media_type")
        status, _, _ = yield self.exchange(
            head.port,
            request_bytes(
                "/v1/chat/completions", body, content_type="Application/JSON; charset=utf-8"
            ),
        )
        self.assertEqual(status, 200)

    @defer.inlineCallbacks
    def test_no_cors_unless_an_origin_is_configured(self) -> Generator[Any, Any, None]:
        """By default a request with an Origin gets no Access-Control-* header and a preflight
        gets 405; with --cors-origin, that origin's preflight gets 204 with the allowed
        methods and headers, its requests get Access-Control-Allow-Origin, other origins
        still get nothing."""
        node = yield self.start_vocab_node()
        body = json.dumps(CHAT).encode()
        origin = "Origin: https://app.example"
        preflight = request_bytes(
            "/v1/chat/completions",
            method="OPTIONS",
            content_type=None,
            extra=[origin, "Access-Control-Request-Method: POST"],
        )
        plain = yield self.start_sfhead([node])
        status, headers, _ = yield self.exchange(
            plain.port, request_bytes("/v1/chat/completions", body, extra=[origin])
        )
        self.assertEqual(status, 200)
        self.assertFalse([h for h in headers if h.startswith(b"access-control")])
        answer = yield self.exchange(plain.port, preflight)
        self.assert_json_error(answer, 405, "method_not_allowed")

        cors = yield self.start_sfhead([node], "--cors-origin", "https://app.example")
        status, headers, _ = yield self.exchange(cors.port, preflight)
        self.assertEqual(status, 204)
        self.assertEqual(headers[b"access-control-allow-origin"], b"https://app.example")
        self.assertIn(b"POST", headers[b"access-control-allow-methods"])
        self.assertIn(b"Content-Type", headers[b"access-control-allow-headers"])
        status, headers, _ = yield self.exchange(
            cors.port, request_bytes("/v1/chat/completions", body, extra=[origin])
        )
        self.assertEqual(
            (status, headers[b"access-control-allow-origin"]), (200, b"https://app.example")
        )
        status, headers, _ = yield self.exchange(
            cors.port,
            request_bytes("/v1/chat/completions", body, extra=["Origin: https://evil.example"]),
        )
        self.assertEqual(status, 200)
        self.assertNotIn(b"access-control-allow-origin", headers)


class LimitTests(HostileTestCase):
    @defer.inlineCallbacks
    def test_one_clients_300_unread_streams_leave_another_client_served(
        self,
    ) -> Generator[Any, Any, None]:
        """A client at 127.0.0.1 opens 300 streams and reads none: 4 run
        (--max-client-requests 4), 296 get 429 rate_limit_exceeded at once; a client at
        127.0.0.2 is served meanwhile, and /healthz counts the 4 running requests on their
        lanes (no per-address connection cap here: --max-client-connections 0)."""
        node = yield self.start_vocab_node(token_delay_s=0.01)
        head = yield self.start_sfhead(
            [node], "--max-client-requests", "4", "--max-client-connections", "0"
        )
        screened: list[Any] = []
        all_screened: defer.Deferred[None] = defer.Deferred()
        site = head.api.site()
        screen = site.hooks.screen

        def counting(request: Any, length: Any) -> Any:
            refusal = screen(request, length)
            screened.append(refusal)
            if len(screened) == 300:
                all_screened.callback(None)
            return refusal

        site.hooks.screen = counting
        stream = json.dumps({**CHAT, "max_tokens": 4000, "stream": True}).encode()
        hogs = []
        for _ in range(300):
            client = yield self.connect(head.port)
            assert client.transport is not None
            client.transport.pauseProducing()  # reads nothing
            client.send(request_bytes("/v1/chat/completions", stream))
            hogs.append(client)
        yield all_screened
        refused = [r for r in screened if r is not None]
        self.assertEqual(len(refused), 296)
        self.assertEqual({(r.status, r.code) for r in refused}, {(429, "rate_limit_exceeded")})

        status, _, content = yield self.exchange(
            head.port, request_bytes("/v1/chat/completions", json.dumps(CHAT).encode()), "127.0.0.2"
        )
        self.assertEqual(status, 200, content)
        self.assertEqual(json.loads(content)["usage"]["completion_tokens"], 5)
        status, _, content = yield self.exchange(
            head.port, request_bytes("/healthz", method="GET"), "127.0.0.2"
        )
        health = json.loads(content)
        self.assertEqual((health["requests"], health["lanes_total"]), (4, 8))
        self.assertGreaterEqual(health["lanes_active"], 4)

    @defer.inlineCallbacks
    def test_each_api_key_has_its_own_limit(self) -> Generator[Any, Any, None]:
        """--api-key-file with two keys and --max-key-requests 1: while key A has a stream
        open, A's next request is 429 with Retry-After and B's is served."""
        keys = Path(self.mktemp())
        keys.write_text(f"# two clients\n{KEY}\n\nsk-other-key\n")
        node = yield self.start_vocab_node(token_delay_s=0.01)
        head = yield self.start_sfhead(
            [node], "--api-key-file", str(keys), "--max-key-requests", "1"
        )
        stream = json.dumps({**CHAT, "max_tokens": 2000, "stream": True}).encode()
        first = yield self.connect(head.port)
        first.send(
            request_bytes("/v1/chat/completions", stream, extra=[f"Authorization: Bearer {KEY}"])
        )
        yield first.answered
        body = json.dumps(CHAT).encode()
        answer = yield self.exchange(
            head.port,
            request_bytes("/v1/chat/completions", body, extra=[f"Authorization: Bearer {KEY}"]),
        )
        self.assert_json_error(answer, 429, "rate_limit_exceeded")
        self.assertEqual(answer[1][b"retry-after"], b"1")
        status, _, content = yield self.exchange(
            head.port,
            request_bytes(
                "/v1/chat/completions", body, extra=["Authorization: Bearer sk-other-key"]
            ),
        )
        self.assertEqual(status, 200, content)

    @defer.inlineCallbacks
    def test_connections_beyond_the_cap_get_503(self) -> Generator[Any, Any, None]:
        """With --max-connections 2 and two connections open, a third is answered 503
        too_many_connections and closed; once one closes, a new one is served."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--max-connections", "2")
        idle = []
        for _ in range(2):
            idle.append((yield self.connect(head.port)))
        third = yield self.connect(head.port)
        self.assert_json_error(response_of((yield third.ended)), 503, "too_many_connections")
        assert idle[0].transport is not None
        idle[0].transport.loseConnection()
        yield idle[0].ended
        status, _, _ = yield self.exchange(head.port, request_bytes("/healthz", method="GET"))
        self.assertEqual(status, 200)

    @defer.inlineCallbacks
    def test_slow_headers_and_bodies_are_cut_off(self) -> Generator[Any, Any, None]:
        """With --header-timeout and --body-timeout 0.5: headers sent one byte every 50 ms
        (each byte would reset an idle timer) and a body that stops halfway both get 408
        request_timeout and a closed connection, long before they would have been
        complete."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--header-timeout", "0.5", "--body-timeout", "0.5")
        slow = yield self.connect(head.port)
        data = request_bytes("/v1/chat/completions", json.dumps(CHAT).encode())
        sent = yield slow.drip(data, 0.05)
        self.assertLess(sent, data.index(b"\r\n\r\n"))
        self.assert_json_error(response_of(slow.data), 408, "request_timeout")

        halfway = yield self.connect(head.port)
        halfway.send(data[: len(data) - 10])
        answer = yield halfway.ended
        error = self.assert_json_error(response_of(answer), 408, "request_timeout")
        self.assertIn("body", error["message"])

    @defer.inlineCallbacks
    def test_a_stream_nobody_reads_is_cut_off_and_cancelled(self) -> Generator[Any, Any, None]:
        """With --stall-timeout 0.5, a streaming client that stops reading a long stream
        (90,000 tokens, megabytes of events: the socket buffers fill) is disconnected and its
        generation is cancelled on the node.

        Both sockets' buffers are made small before any byte flows, so the head's writes back
        up after a bounded amount of data whatever the load: the send buffer on the head's
        listening socket (an accepted socket inherits it, so there is no race with the head's
        accept) and the client's receive buffer.  Left to the kernel's autotuning they grow to
        megabytes, and under load the mock engine took over 120 s to fill them."""
        import socket

        engine = MockEngine(reactor, EngineConfig(context_window=100_000), vocab_size=TINY_VOCAB)
        ended: defer.Deferred[Any] = defer.Deferred()
        submit = engine.submit

        def recording_submit(request: Any, on_tokens: Any) -> Any:
            generation = submit(request, on_tokens)
            generation.result.addBoth(lambda r: ended.callback(r) if not ended.called else None)
            return generation

        engine.submit = recording_submit  # type: ignore[method-assign]
        node = yield self.start_vocab_node(engine=engine)
        head = yield self.start_sfhead([node], "--stall-timeout", "0.5")
        listening = head.service.getServiceNamed("http").port  # type: ignore[no-untyped-call]
        listening.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client = yield self.connect(head.port)
        assert client.transport is not None
        client.transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.transport.pauseProducing()
        client.send(
            request_bytes(
                "/v1/chat/completions",
                json.dumps({**CHAT, "max_tokens": 90_000, "stream": True}).encode(),
            )
        )
        result = yield ended
        self.assertEqual(result.stop, EngineStop.CANCELLED)
        self.assertLess(len(result.tokens), 90_000)
        client.transport.resumeProducing()
        yield client.ended


class _LogWatch:
    """Every log event while it watches: a test asserts none carries a traceback."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def failures(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("log_failure") is not None or e.get("isError")]


class BadInputTests(HostileTestCase):
    def watch_log(self) -> _LogWatch:
        watch = _LogWatch()
        globalLogPublisher.addObserver(watch)
        self.addCleanup(globalLogPublisher.removeObserver, watch)
        return watch

    @defer.inlineCallbacks
    def test_input_errors_are_json_400s_with_no_traceback(self) -> Generator[Any, Any, None]:
        """JSON nested 1000 deep, a lone surrogate in a message and in a prompt, token ids
        of 2**40, 2**32 and just past the vocabulary, a huge integer and NaN each get a JSON
        400, and nothing is logged with a traceback."""
        watch = self.watch_log()
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node])
        deep = b'{"model": "mock", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
        vocab = head.api.vocab_size
        cases = [
            deep,
            b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
            b'{"prompt": "\\udfff"}',
            json.dumps({"prompt": [1, 1 << 40]}).encode(),
            json.dumps({"prompt": [1 << 32]}).encode(),
            json.dumps({"prompt": [vocab]}).encode(),
            b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
            b'{"prompt": "hi", "temperature": NaN}',
        ]
        for body in cases:
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            answer = yield self.exchange(head.port, request_bytes(path, body))
            self.assert_json_error(answer, 400, None)
        self.assertEqual(watch.failures(), [])
        self.assertEqual(
            head.api.metrics.registry.get_sample_value(
                "sfhead_requests_total", {"outcome": "bad_request"}
            ),
            float(len(cases)),
        )

    @defer.inlineCallbacks
    def test_malformed_http_and_huge_names_get_short_json_errors(
        self,
    ) -> Generator[Any, Any, None]:
        """A request line of 100 kB, a header line without a colon, and a bad chunk size
        get a JSON 400 bad_http_request (twisted.web alone would close the connection or send
        a bare 400); a model name of a megabyte, in the path or in the body, is a 404 whose
        answer stays under a kilobyte."""
        watch = self.watch_log()
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node])
        huge = "y" * 1_000_000
        for data in (
            f"GET /v1/models/{huge[:100_000]} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode(),
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
            request_bytes("/v1/completions", chunked=True) + b"zz\r\nabc\r\n",
        ):
            answer = yield self.exchange(head.port, data)
            self.assert_json_error(answer, 400, "bad_http_request")
        answer = yield self.exchange(
            head.port, request_bytes(f"/v1/models/{huge[:8000]}", method="GET")
        )
        self.assert_json_error(answer, 404, "model_not_found")
        self.assertLess(len(answer[2]), 1000)
        body = json.dumps({"model": huge, "prompt": "hi"}).encode()
        answer = yield self.exchange(head.port, request_bytes("/v1/completions", body))
        self.assert_json_error(answer, 404, "model_not_found")
        self.assertLess(len(answer[2]), 1000)
        self.assertEqual(watch.failures(), [])

    @defer.inlineCallbacks
    def test_an_unexpected_exception_is_a_json_500_counted_and_logged_once(
        self,
    ) -> Generator[Any, Any, None]:
        """A backend that raises while starting a generation, and one whose status raises
        while /healthz renders and while a completion starts: each is a JSON 500
        server_error (no HTML, no traceback in the answer), counted as error, logged once,
        and leaves no request behind for a drain to wait for."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node])
        api = head.api

        def broken_generate(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the backend broke")

        self.patch(api.backend, "generate", broken_generate)
        answer = yield self.exchange(
            head.port, request_bytes("/v1/chat/completions", json.dumps(CHAT).encode())
        )
        error = self.assert_json_error(answer, 500, None)
        self.assertEqual(error["type"], "server_error")
        self.assertNotIn("broke", error["message"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

        def broken_status(model: Any = None) -> Any:
            raise ValueError("no status")

        api.backend.status = broken_status  # type: ignore[method-assign]
        answer = yield self.exchange(head.port, request_bytes("/healthz", method="GET"))
        self.assert_json_error(answer, 500, None)
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)
        answer = yield self.exchange(
            head.port, request_bytes("/v1/chat/completions", json.dumps(CHAT).encode())
        )
        del api.backend.status
        self.assert_json_error(answer, 500, None)
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)
        self.assertEqual(api.exchanges, set())
        self.assertEqual(
            api.metrics.registry.get_sample_value("sfhead_requests_total", {"outcome": "error"}),
            3.0,
        )
