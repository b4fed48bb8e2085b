"""Streams that survive their client's own drop (docs/api.md "Streams that resume"), over HTTP
in memory (tests/memoryhead.py): a client cut at a random byte of its stream reconnects with
``Last-Event-ID`` and gets exactly the rest, nothing repeated or lost; a stream nobody resumes
is cancelled after the grace; a resume must name a stream of its own key.
"""

from __future__ import annotations

import json
import random
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure

from sfnode.head.api.gate import GateLimits
from tests.memoryhead import MemoryHead, MemoryHeadTestCase
from tests.test_http import MESSAGES, MODEL, HttpTestCase
from tests.test_http_hostile import request_bytes

STEP_S = 0.01
SAMPLED = {"temperature": 0.9, "seed": 11}


def _body(max_tokens: int = 30, **more: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "stream": True,
        **SAMPLED,
        **more,
    }


def _post(
    body: dict[str, Any],
    last: str | None = None,
    key: str | None = None,
    path: str = "/v1/chat/completions",
) -> bytes:
    extra = [] if last is None else [f"Last-Event-ID: {last}"]
    if key is not None:
        extra.append(f"Authorization: Bearer {key}")
    return request_bytes(path, json.dumps(body).encode(), extra=extra)


def _dechunk(data: bytes) -> bytes:
    """The bytes of a chunked body that arrived, whole chunks and the start of a cut one."""
    out = b""
    while True:
        size_line, crlf, rest = data.partition(b"\r\n")
        if not crlf:
            return out
        size = int(size_line, 16)
        if size == 0:
            return out
        out += rest[:size]
        if len(rest) < size + 2:
            return out
        data = rest[size + 2 :]


def _events(body: bytes) -> list[tuple[str, str]]:
    """(id, data) of every complete server-sent event of ``body`` (a cut one is left out)."""
    blocks = body.decode("utf-8", "replace").split("\n\n")[:-1]
    found = []
    for block in blocks:
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        found.append((fields["id"], fields["data"]))
    return found


def _text(events: list[tuple[str, str]]) -> str:
    """The text of a chat stream's deltas, a Responses stream's ``output_text.delta`` events
    or a Messages stream's ``content_block_delta`` events."""
    text = ""
    for _, data in events:
        if data == "[DONE]":
            continue
        event = json.loads(data)
        for choice in event.get("choices", ()):
            text += choice["delta"].get("content") or ""
        if event.get("type") == "response.output_text.delta":
            text += event["delta"]
        if event.get("type") == "content_block_delta":
            text += event["delta"].get("text", "")
    return text


class _CuttingClient(Protocol):
    """Reads a response until ``cut_at`` bytes have come, then drops the connection (what
    it got stays as it got it)."""

    def __init__(self, cut_at: int) -> None:
        self.cut_at = cut_at
        self.data = b""
        self.closed = False
        self.ended: defer.Deferred[bytes] = defer.Deferred()

    def dataReceived(self, data: bytes) -> None:
        if self.closed:
            return
        self.data += data
        if len(self.data) >= self.cut_at:
            self.data = self.data[: self.cut_at]
            self.closed = True
            assert self.transport is not None
            self.transport.abortConnection()

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.closed = True
        self.ended.callback(self.data)


class ResumeTests(MemoryHeadTestCase):
    def head(self, **limits: Any) -> MemoryHead:
        for name in ("a", "b"):
            self.start_vocab_node(name, max_lanes=4, token_delay_s=STEP_S)
        return self.start_head(limits=GateLimits(**limits))

    def whole(self, head: MemoryHead, data: bytes, address: str = "127.0.0.1") -> Any:
        status, headers, body = self.exchange(head, data, address)
        return status, headers, body

    def test_a_hundred_random_cuts_reassemble_exactly(self) -> None:
        """A sampled (seeded) stream cut by its client at 100 random bytes, each resumed with
        the id of the last whole event it got: the events before and after the cut carry
        consecutive ids, none twice or missing (how tokens batch into events varies from run
        to run, so their count may too), and their text is the uninterrupted stream's, ending
        with [DONE]; a cut after the end (the answer complete) is resumed from the streams
        the head keeps."""
        head = self.head()
        status, _, body = self.whole(head, _post(_body()))
        self.assertEqual(status, 200)
        reference = _events(body)
        expected = _text(reference)
        self.assertEqual(reference[-1][1], "[DONE]")
        raw = self.http_bytes(head)
        first = raw.index(b"\n\n", raw.index(b"\r\n\r\n")) + 16
        rng = random.Random(34)
        kept_ended = 0
        for _ in range(100):
            cutting = _CuttingClient(rng.randrange(first, len(raw) - 1))
            self.http(head, "10.0.0.7", cutting)
            assert cutting.transport is not None
            cutting.transport.write(_post(_body()))
            self.until(lambda: cutting.closed, within=10.0)  # noqa: B023
            rest = cutting.data.partition(b"\r\n\r\n")[2]
            before = _events(_dechunk(rest))
            self.assertTrue(before, "the cut came before the first whole event")
            last = before[-1][0]
            kept_ended += head.api.exchanges.ended.get(last.rpartition(".")[0]) is not None
            status, _, resumed = self.whole(head, _post(_body(), last=last), "10.0.0.7")
            self.assertEqual(status, 200)
            after = _events(resumed)
            ids = [int(i.rpartition(".")[2]) for i, _ in before + after]
            self.assertEqual(ids, list(range(1, len(ids) + 1)))
            self.assertEqual(len({i.rpartition(".")[0] for i, _ in before + after}), 1)
            self.assertEqual(_text(before + after), expected)
            self.assertEqual((before + after)[-1][1], "[DONE]")
        self.assertGreater(kept_ended, 0)
        self.assertLess(kept_ended, 100)

    def http_bytes(self, head: MemoryHead) -> bytes:
        """The raw bytes of one uninterrupted streamed response."""
        client = self.http(head, "10.0.0.8", _CuttingClient(1 << 30))
        assert client.transport is not None
        client.transport.write(_post(_body()))
        self.until(lambda: client.closed or b"0\r\n\r\n" in client.data)
        return client.data

    def test_a_stream_nobody_resumes_is_cancelled_after_the_grace(self) -> None:
        """A client cut mid-stream and never back: its generation parks (its lane is free at
        once), and when --resume-grace passes it is cancelled and its stream can no longer
        be resumed (404 stream_not_found)."""
        head = self.head(resume_grace_s=2.0)
        client = self.http(head, "10.0.0.7", _CuttingClient(600))
        assert client.transport is not None
        client.transport.write(_post(_body(max_tokens=400)))
        self.until(lambda: client.closed)
        _, _, rest = client.data.partition(b"\r\n\r\n")
        last = _events(_dechunk(rest))[-1][0]
        self.until(lambda: all(n.inflight == 0 for n in head.fleet.nodes), within=1.0)
        self.assertEqual(len(head.api.exchanges), 1)
        self.advance(2.1)
        self.until(lambda: not head.api.exchanges, within=1.0)
        status, _, body = self.whole(head, _post(_body(), last=last), "10.0.0.7")
        self.assertEqual(status, 404)
        self.assertEqual(json.loads(body)["error"]["code"], "stream_not_found")

    def test_a_draining_head_gives_up_the_streams_nobody_can_resume(self) -> None:
        """A draining head takes no request, so no client can come back: a stream whose client
        was away when the drain began, and one whose client drops during the drain, are
        cancelled at once (their lanes free) and the drain ends long before its timeout."""
        head = self.head(resume_grace_s=60.0)
        away = self.http(head, "10.0.0.7", _CuttingClient(600))
        assert away.transport is not None
        away.transport.write(_post(_body(max_tokens=400)))
        self.until(lambda: away.closed)
        reading = self.http(head, "10.0.0.8", _CuttingClient(1 << 30))
        assert reading.transport is not None
        reading.transport.write(_post(_body(max_tokens=400)))
        self.until(lambda: reading.data.count(b"\n\n") >= 5)
        self.assertEqual(len(head.api.exchanges), 2)
        drained = head.api.drain(30.0)
        self.until(lambda: len(head.api.exchanges) == 1, within=1.0)
        self.assertFalse(drained.called)
        reading.transport.abortConnection()
        self.until(lambda: drained.called, within=1.0)
        self.until(lambda: all(n.inflight == 0 for n in head.fleet.nodes), within=1.0)

    def test_a_resume_names_a_stream_of_its_own_key(self) -> None:
        """A Last-Event-ID of another key's stream, an unknown id, or no number, is a 404;
        the stream's own key resumes it."""
        for name in ("a",):
            self.start_vocab_node(name, max_lanes=4, token_delay_s=STEP_S)
        head = self.start_head(api_keys=[b"sk-a", b"sk-b"])
        client = self.http(head, "10.0.0.7", _CuttingClient(600))
        assert client.transport is not None
        client.transport.write(_post(_body(max_tokens=100), key="sk-a"))
        self.until(lambda: client.closed)
        _, _, rest = client.data.partition(b"\r\n\r\n")
        last = _events(_dechunk(rest))[-1][0]
        for other, key in ((last, "sk-b"), ("chatcmpl-nope.3", "sk-a"), (last + "x", "sk-a")):
            status, _, body = self.whole(head, _post(_body(), last=other, key=key))
            self.assertEqual(status, 404, other)
            self.assertEqual(json.loads(body)["error"]["code"], "stream_not_found")
        status, _, body = self.whole(head, _post(_body(), last=last, key="sk-a"))
        self.assertEqual(status, 200)
        self.assertEqual(_events(body)[-1][1], "[DONE]")

    def test_a_resume_takes_over_a_half_open_stream(self) -> None:
        """A client that resumes while the head still holds its old connection (half open):
        the new connection gets the rest, the old one is closed, nothing is written twice."""
        self.start_vocab_node("a", max_lanes=4, token_delay_s=STEP_S)
        head = self.start_head()
        old = self.http(head, "10.0.0.7", _CuttingClient(1 << 30))
        assert old.transport is not None
        old.transport.write(_post(_body(max_tokens=60)))
        self.until(lambda: old.data.count(b"\n\n") >= 5)
        _, _, rest = old.data.partition(b"\r\n\r\n")
        got = _events(_dechunk(rest))
        status, _, body = self.whole(head, _post(_body(), last=got[-1][0]), "10.0.0.7")
        self.assertEqual(status, 200)
        self.assertTrue(old.closed)
        reference = self.whole(head, _post(_body(max_tokens=60)))[2]
        self.assertEqual(_text(got + _events(body)), _text(_events(reference)))

    def test_responses_and_messages_streams_resume_too(self) -> None:
        """A /v1/responses and a /v1/messages stream, each cut mid-stream and resumed: ids
        consecutive, the text the uninterrupted stream's, the last event its API's end (the
        same as the uninterrupted stream's)."""
        head = self.head()
        cases = (
            (
                "/v1/responses",
                {"model": MODEL, "input": "hello world", "max_output_tokens": 30, **SAMPLED},
                ("response.completed", "response.incomplete"),
            ),
            (
                "/v1/messages",
                {"model": MODEL, "messages": MESSAGES, "max_tokens": 30, "temperature": 0},
                ("message_stop",),
            ),
        )
        for path, body, end in cases:
            body = {**body, "stream": True}
            status, _, whole = self.whole(head, _post(body, path=path))
            self.assertEqual(status, 200, path)
            expected = _text(_events(whole))
            cutting = _CuttingClient(900)
            self.http(head, "10.0.0.7", cutting)
            assert cutting.transport is not None
            cutting.transport.write(_post(body, path=path))
            self.until(lambda: cutting.closed)  # noqa: B023
            before = _events(_dechunk(cutting.data.partition(b"\r\n\r\n")[2]))
            status, _, resumed = self.whole(head, _post(body, last=before[-1][0], path=path))
            self.assertEqual(status, 200, path)
            events = before + _events(resumed)
            ids = [int(i.rpartition(".")[2]) for i, _ in events]
            self.assertEqual(ids, list(range(1, len(ids) + 1)), path)
            self.assertEqual(_text(events), expected, path)
            self.assertEqual(
                json.loads(events[-1][1])["type"], json.loads(_events(whole)[-1][1])["type"]
            )
            self.assertIn(json.loads(events[-1][1])["type"], end, path)


@defer.inlineCallbacks
def fetch(port: int, data: bytes, cut_at: int = 1 << 30) -> Any:
    """What a loopback TCP client that sends ``data`` to ``port`` gets until it has ``cut_at``
    bytes (then it drops) or the head closes the connection."""
    client = _CuttingClient(cut_at)
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
    yield connectProtocol(endpoint, client)
    assert client.transport is not None
    client.transport.write(data)
    got = yield client.ended
    return got


class RealEngineResumeTests(HttpTestCase):
    """The transformers engine on the tiny Llama (float32) behind a real head, over loopback
    TCP: a sampled stream cut by its client and resumed is the uninterrupted one."""

    timeout = 300

    @defer.inlineCallbacks
    def test_cut_streams_resume_exactly_on_the_real_engine(self) -> None:
        """Three seeded, sampled streams of 40 tokens, each cut at a random byte and resumed
        with the last whole event's id, give the uninterrupted stream's text."""
        from sfnode.engines.config import EngineConfig
        from sfnode.engines.transformers_engine import TransformersEngine
        from tests.test_constraint import tiny_model

        engine = TransformersEngine(
            tiny_model(), reactor, EngineConfig(max_lanes=4, weights="float32")
        )
        engine.start()
        self.addCleanup(engine.stop)
        node = yield self.start_vocab_node(engine=engine)
        head = yield self.start_head([node])
        port = head.port.getHost().port
        body = _body(max_tokens=40)
        whole = yield fetch(port, _post(body))
        reference = _events(_dechunk(whole.partition(b"\r\n\r\n")[2]))
        self.assertEqual(reference[-1][1], "[DONE]")
        first = whole.index(b"\n\n", whole.index(b"\r\n\r\n")) + 16
        rng = random.Random(3)
        for _ in range(3):
            cut = yield fetch(port, _post(body), rng.randrange(first, len(whole) - 1))
            before = _events(_dechunk(cut.partition(b"\r\n\r\n")[2]))
            rest = yield fetch(port, _post(body, last=before[-1][0]))
            self.assertIn(b" 200 ", rest.split(b"\r\n", 1)[0])
            after = _events(_dechunk(rest.partition(b"\r\n\r\n")[2]))
            ids = [int(i.rpartition(".")[2]) for i, _ in before + after]
            self.assertEqual(ids, list(range(1, len(ids) + 1)))
            self.assertEqual(_text(before + after), _text(reference))
