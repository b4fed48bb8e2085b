"""The head's OpenAI-compatible HTTP API, health check and metrics, on twisted.web.

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: streaming (server-sent events in
  OpenAI's chunk format, ending with ``data: [DONE]``) and not; ``GET /v1/models``.
- ``GET /healthz``: ``{"status", "nodes", "queued"}``, 200 while at least one node is live,
  else 503.
- ``GET /metrics``: Prometheus text from a per-head ``CollectorRegistry``: per-node capacity,
  requests by outcome, tokens in and out, time to first token, failovers, reconnects, and the
  queue of requests waiting for a node (a full queue answers 503 ``queue_full`` at once; a
  request that waited the queue timeout in vain, 503 ``no_node_available``).

With an API key every ``/v1/*`` request must carry ``Authorization: Bearer KEY`` (compared in
constant time) or gets 401; ``/healthz`` and ``/metrics`` stay open.  :meth:`OpenAIApi.drain`
is the head's SIGTERM path: new completions get 503 (code ``draining``), running ones may finish
until the drain timeout, then they are cancelled (GENERATE_CANCEL) and end with ``stop``.

Text is rendered (the model's chat template) and detokenized here, at the head: nodes only see
token ids.  Streamed text never splits a multi-byte character (:class:`Detokenizer`) and never
shows a stop string (:class:`StopText`).  A client that disconnects mid-stream cancels its
generation, which sends GENERATE_CANCEL to the node.

This module must never load model weights (only a tokenizer), never block the reactor, never use
the global reactor or prometheus_client's global registry, and never answer an error in any
shape but OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import hmac
import json
import random
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from sfnode.head.fleet import (
    Fleet,
    FleetError,
    FleetOutcome,
    NodeDeclined,
    QueueFull,
    StreamTooLong,
)
from sfnode.head.link import LinkError
from sfnode.wire import FINISH_CANCELLED, FINISH_EOS, GenParams

DEFAULT_MAX_TOKENS = 512
"""max_tokens when a request gives none (capped by the window left after the prompt)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for the legacy /v1/completions."""
MAX_STOP_STRINGS = 4
DRAIN_CANCEL_GRACE_S = 5.0
"""After the drain timeout cancels what still runs: how long the drain waits for those
generations to end before it gives up on them (the fleet's links are closed next)."""
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_log = Logger(namespace="sfnode.head.http")


# --------------------------------------------------------------------------------------------
# What the API runs generations on


class GenerationHandle(Protocol):
    """One generation in flight (a :class:`~sfnode.head.fleet.FleetGeneration` or a
    pipeline's): its result, a cancel, and a Deferred for "placed, tokens will come"."""

    @property
    def result(self) -> Deferred[FleetOutcome]: ...

    def cancel(self) -> None: ...

    def when_placed(self) -> Deferred[None]: ...


class Backend(Protocol):
    """What the API needs to run a generation: the fleet, or the pipeline driver."""

    def generate(
        self,
        prompt: Sequence[int],
        max_new: int,
        *,
        model: str | None = None,
        params: GenParams = ...,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
        max_wall_ms: int = 0,
    ) -> GenerationHandle: ...


# --------------------------------------------------------------------------------------------
# Text: rendering, detokenizing, stop strings

_FALLBACK_TEMPLATE_ROLES = ("system", "user", "assistant", "tool", "developer")


class Renderer:
    """Turns chat messages and prompts into token ids, with the model's own chat template.

    A tokenizer without a chat template (test tokenizers) gets a plain one:
    ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
        else:
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            text += "<|assistant|>\n"
        return [int(t) for t in self.tokenizer.encode(str(text), add_special_tokens=False)]

    def completion(self, prompt: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(prompt)]

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.decode)


class Detokenizer:
    """Incremental detokenizing that never emits half a character.

    The text of the tokens since ``prefix`` is decoded again as tokens arrive; new text is
    released only when it does not end in U+FFFD (an incomplete UTF-8 sequence, most likely).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, tokens: Sequence[int]) -> str:
        self._ids.extend(tokens)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (at the end of the stream, even an incomplete character)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :] if len(text) > len(prefix_text) else ""


class StopText:
    """Cuts the text at the first stop string; holds back what could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._sent = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        """The text that may be shown now."""
        if self.stopped:
            return ""
        self._text += delta
        if self._stops:
            start = max(0, self._sent - self._hold)
            hits = [i for i in (self._text.find(s, start) for s in self._stops) if i >= 0]
            if hits:
                self.stopped = True
                return self._release(min(hits))
        return self._release(len(self._text) - self._hold)

    def flush(self) -> str:
        return "" if self.stopped else self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent : end], end
        return out


# --------------------------------------------------------------------------------------------
# Requests


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        outcome: str = "bad_request",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.outcome = outcome

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class CompletionRequest:
    """A checked request: what to generate, and how to answer."""

    chat: bool
    model: str
    prompt: list[int]
    max_tokens: int | None
    params: GenParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{name} must be a number", param=name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer", param=name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}", param=name)
    return value


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _FALLBACK_TEMPLATE_ROLES:
            raise ApiError(400, f"messages[{i}] needs a role", param=f"messages[{i}]")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ApiError(
                        400,
                        "only text content is supported (no images or audio)",
                        param=f"messages[{i}].content",
                    )
                parts.append(str(part.get("text", "")))
            text = "".join(parts)
        else:
            raise ApiError(400, f"messages[{i}].content must be text", param=f"messages[{i}]")
        out.append({"role": str(message["role"]), "content": text})
    return out


def parse_request(
    body: dict[str, Any],
    *,
    chat: bool,
    renderer: Renderer,
    models: Sequence[str],
    seed_source: Callable[[], int],
) -> CompletionRequest:
    """Check one request body; raises :class:`ApiError` (400 or 404)."""
    model = body.get("model", models[0] if models else "")
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    if model not in models:
        raise ApiError(
            404,
            f"The model '{model}' does not exist",
            param="model",
            code="model_not_found",
            outcome="not_found",
        )
    if chat:
        prompt = renderer.chat(_messages(body))
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if isinstance(raw, str):
            prompt = renderer.completion(raw)
        elif (
            isinstance(raw, list)
            and raw
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw)
        ):
            prompt = list(raw)
        else:
            raise ApiError(400, "prompt must be a string or an array of token ids", param="prompt")
    n = _integer(body, "n", 1, 1)
    del n
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 31)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 31)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    min_p = _number(body, "min_p", 0.0, 1.0)
    top_k = _integer(body, "top_k", -1, 1 << 31)
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    stop_field = body.get("stop")
    if stop_field is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_field, str):
        stop = (stop_field,)
    elif (
        isinstance(stop_field, list)
        and len(stop_field) <= MAX_STOP_STRINGS
        and all(isinstance(s, str) for s in stop_field)
    ):
        stop = tuple(stop_field)
    else:
        raise ApiError(400, "stop must be a string or up to 4 strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    params = GenParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        min_p=min_p or 0.0,
        top_k=max(top_k or 0, 0),
        seed=(seed_source() if seed is None else seed) & ((1 << 64) - 1),
    )
    return CompletionRequest(
        chat=chat,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        params=params,
        stop=stop,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


# --------------------------------------------------------------------------------------------
# Metrics


class HeadMetrics:
    """The head's Prometheus metrics, in a registry of its own."""

    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "sfhead_requests",
            "Completion requests by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "sfhead_prompt_tokens", "Prompt tokens sent to nodes.", registry=self.registry
        )
        self.completion_tokens = Counter(
            "sfhead_completion_tokens",
            "Tokens generated and delivered to clients.",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "sfhead_time_to_first_token_seconds",
            "From request received to first token at the head.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_FleetCollector(fleet))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


_CAPACITY_GAUGES = (
    ("lanes_active", "Lanes decoding now."),
    ("max_lanes", "Lanes the node decodes at once."),
    ("queue_depth", "Generations waiting for a lane."),
    ("kv_blocks_used", "KV cache blocks in use."),
    ("kv_blocks_total", "KV cache blocks in total."),
    ("max_context_tokens", "The node's context window."),
    ("decode_tokens_per_s", "Decode rate over busy time (tokens/s)."),
    ("prefill_tokens_per_s", "Prefill rate over busy time (tokens/s)."),
)


class _FleetCollector(Collector):
    """Reads the fleet's registry at scrape time: per-node capacity, failovers, reconnects."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        fleet = self._fleet
        up = GaugeMetricFamily("sfhead_node_up", "1 while the node is live.", labels=["node"])
        sessions = GaugeMetricFamily(
            "sfhead_node_sessions", "Sessions placed on the node.", labels=["node"]
        )
        gauges = {
            field: GaugeMetricFamily(f"sfhead_node_{field}", text, labels=["node"])
            for field, text in _CAPACITY_GAUGES
        }
        live = fleet.live_nodes()
        for node in fleet.nodes:
            up.add_metric([node.name], 1.0 if node in live else 0.0)
            sessions.add_metric([node.name], float(node.sessions))
            capacity = node.link.capacity
            if capacity is None:
                continue
            for field, gauge in gauges.items():
                gauge.add_metric([node.name], float(getattr(capacity, field)))
        yield up
        yield sessions
        yield from gauges.values()
        yield GaugeMetricFamily("sfhead_live_nodes", "Live nodes.", value=float(len(live)))
        yield CounterMetricFamily(
            "sfhead_failovers", "Generations moved to another node.", value=fleet.failovers
        )
        yield CounterMetricFamily(
            "sfhead_reconnects", "Links reconnected and reconciled.", value=fleet.reconnects
        )
        yield GaugeMetricFamily(
            "sfhead_queued_requests", "Requests waiting for a node.", value=float(fleet.queued)
        )
        yield CounterMetricFamily(
            "sfhead_queue_rejected",
            "Requests refused at once because the queue was full.",
            value=fleet.queue_rejected,
        )
        yield CounterMetricFamily(
            "sfhead_queue_timeouts",
            "Requests that waited the queue timeout for a node in vain.",
            value=fleet.queue_timeouts,
        )


# --------------------------------------------------------------------------------------------
# The API


class OpenAIApi:
    """Everything the HTTP resources share: backend, fleet, renderer, model names, metrics."""

    def __init__(
        self,
        reactor: IReactorTime,
        backend: Backend,
        fleet: Fleet,
        tokenizer: Any,
        model_name: str,
        *,
        node_model: str | None = None,
        seed_source: Callable[[], int] | None = None,
        metrics: HeadMetrics | None = None,
        api_key: bytes | None = None,
    ) -> None:
        self.reactor = reactor
        self.backend = backend
        self.fleet = fleet
        self.renderer = Renderer(tokenizer)
        self.model_name = model_name
        self.node_model = node_model if node_model is not None else model_name
        """The model name asked of nodes (the one they offer in HELLO_ACK_F)."""
        self.new_seed: Callable[[], int] = seed_source or _random_seed
        """The seed of a request that gives none (sampling is counter-based: a fixed seed
        would give every such request the same draws)."""
        self.metrics = metrics if metrics is not None else HeadMetrics(fleet)
        self.api_key = api_key or None
        """The bearer token every /v1 request must carry; None: the API is open."""
        self.exchanges: set[_Exchange] = set()
        """Completion requests in flight (what a drain waits for)."""
        self.draining = False
        """True once :meth:`drain` started: new completion requests get 503."""
        self._drain_waiters: list[Deferred[None]] = []
        self._drain_timer: IDelayedCall | None = None

    def authorized(self, request: Any) -> bool:
        """Whether ``request`` carries the API key (always, when there is none)."""
        if self.api_key is None:
            return True
        header = request.getHeader(b"authorization") or b""
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer":
            given = b""
        # compare_digest's time never depends on where the given bytes first differ from the
        # key (at most on their lengths).
        return hmac.compare_digest(given.strip(), self.api_key)

    def drain(self, timeout_s: float) -> Deferred[None]:
        """Stop taking completions (503 from now on), let the ones in flight finish for up to
        ``timeout_s`` seconds, then cancel the rest; fires once none is left, or
        :data:`DRAIN_CANCEL_GRACE_S` after the cancels.  Calling it again joins the same drain.
        """
        waiter: Deferred[None] = Deferred()
        self._drain_waiters.append(waiter)
        if not self.draining:
            self.draining = True
            _log.info(
                "draining HTTP: refusing new requests, letting {count} running ones finish "
                "for up to {timeout} s",
                count=len(self.exchanges),
                timeout=timeout_s,
            )
            self._drain_timer = self.reactor.callLater(timeout_s, self._drain_timed_out)
        self._check_drained()
        return waiter

    def _drain_timed_out(self) -> None:
        self._drain_timer = self.reactor.callLater(DRAIN_CANCEL_GRACE_S, self._drain_gave_up)
        _log.info(
            "drain timeout: cancelling {count} requests that are still running",
            count=len(self.exchanges),
        )
        for exchange in list(self.exchanges):
            exchange.drain_cancel()

    def _drain_gave_up(self) -> None:
        self._drain_timer = None
        _log.warn(
            "{count} cancelled requests did not end in time; stopping anyway",
            count=len(self.exchanges),
        )
        self._drain_done()

    def exchange_ended(self, exchange: _Exchange) -> None:
        self.exchanges.discard(exchange)
        self._check_drained()

    def _check_drained(self) -> None:
        if self.draining and not self.exchanges:
            self._drain_done()

    def _drain_done(self) -> None:
        if self._drain_timer is not None and self._drain_timer.active():
            self._drain_timer.cancel()
        self._drain_timer = None
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def resource(self) -> Resource:
        root = Resource()  # type: ignore[no-untyped-call]
        v1 = Resource()  # type: ignore[no-untyped-call]
        chat = Resource()  # type: ignore[no-untyped-call]
        root.putChild(b"v1", _Authorized(self, v1))
        v1.putChild(b"chat", chat)
        chat.putChild(b"completions", _Completions(self, chat=True))
        v1.putChild(b"completions", _Completions(self, chat=False))
        v1.putChild(b"models", _Models(self))
        root.putChild(b"healthz", _Health(self))
        root.putChild(b"metrics", _Metrics(self))
        return root

    def site(self) -> Site:
        site = Site(self.resource())  # type: ignore[no-untyped-call]
        site.displayTracebacks = False
        return site


def _random_seed() -> int:
    return random.SystemRandom().getrandbits(63)


def _json(request: Any, status: int, body: Any) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(body).encode()


def _unauthorized(request: Any) -> bytes:
    missing = not request.getHeader(b"authorization")
    error = ApiError(
        401,
        "You didn't provide an API key: send it as 'Authorization: Bearer KEY'."
        if missing
        else "Incorrect API key provided.",
        code="invalid_api_key",
        outcome="unauthorized",
    )
    request.setHeader(b"www-authenticate", b"Bearer")
    return _json(request, error.status, error.body())


class _Refusal(Resource):
    """A leaf that answers 401 to every method (what an unauthorized /v1 request reaches)."""

    isLeaf = True

    def render(self, request: Any) -> bytes:
        return _unauthorized(request)


class _Authorized(Resource):
    """``/v1`` behind the API key: without the right bearer token every path below is 401."""

    def __init__(self, api: OpenAIApi, inner: Resource) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api
        self.inner = inner

    def getChildWithDefault(self, path: bytes, request: Any) -> Resource:
        if not self.api.authorized(request):
            self.api.metrics.requests.labels("unauthorized").inc()
            return _Refusal()  # type: ignore[no-untyped-call]
        return self.inner.getChildWithDefault(path, request)  # type: ignore[no-untyped-call,no-any-return]

    def render(self, request: Any) -> bytes:
        if not self.api.authorized(request):
            self.api.metrics.requests.labels("unauthorized").inc()
            return _unauthorized(request)
        return self.inner.render(request)  # type: ignore[no-untyped-call,no-any-return]


class _Health(Resource):
    isLeaf = True

    def __init__(self, api: OpenAIApi) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api

    def render_GET(self, request: Any) -> bytes:
        live = len(self.api.fleet.live_nodes())
        queued = self.api.fleet.queued
        if self.api.draining:
            return _json(request, 503, {"status": "draining", "nodes": live, "queued": queued})
        status = "ok" if live else "unavailable"
        body = {"status": status, "nodes": live, "queued": queued}
        return _json(request, 200 if live else 503, body)


class _Metrics(Resource):
    isLeaf = True

    def __init__(self, api: OpenAIApi) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode())
        return self.api.metrics.exposition()


class _Models(Resource):
    isLeaf = True

    def __init__(self, api: OpenAIApi) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api

    def render_GET(self, request: Any) -> bytes:
        api = self.api
        window = api.fleet.max_window(api.node_model)
        entry = {
            "id": api.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "sfnode",
            "context_length": window or None,
            "capabilities": {"chat": True, "completions": True, "vision": False},
        }
        return _json(request, 200, {"object": "list", "data": [entry]})


class _Completions(Resource):
    isLeaf = True

    def __init__(self, api: OpenAIApi, *, chat: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api
        self.chat = chat

    def render_POST(self, request: Any) -> bytes | int:
        api = self.api
        received = api.reactor.seconds()
        try:
            if api.draining:
                raise ApiError(
                    503,
                    "the head is shutting down and takes no new requests",
                    kind="service_unavailable",
                    code="draining",
                    outcome="unavailable",
                )
            assert request.content is not None
            try:
                body = json.loads(request.content.read() or b"null")
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the body is not valid JSON: {e}") from e
            if not isinstance(body, dict):
                raise ApiError(400, "the body must be a JSON object")
            parsed = parse_request(
                body,
                chat=self.chat,
                renderer=api.renderer,
                models=[api.model_name],
                seed_source=api.new_seed,
            )
            try:
                api.fleet.check_fits(api.node_model, len(parsed.prompt))
            except StreamTooLong as e:
                raise _too_long(e) from e
        except ApiError as e:
            api.metrics.requests.labels(e.outcome).inc()
            return _json(request, e.status, e.body())
        _Exchange(api, request, parsed, received).start()
        return NOT_DONE_YET


def _too_long(error: StreamTooLong) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {error.max} tokens; the prompt has "
        f"{error.length} tokens.",
        param="messages",
        code="context_length_exceeded",
        outcome="too_long",
    )


def _fleet_error(failure: Failure) -> ApiError:
    error = failure.value
    if isinstance(error, StreamTooLong):
        return _too_long(error)
    if isinstance(error, NodeDeclined):
        return ApiError(502, str(error), kind="server_error", outcome="error")
    if isinstance(error, QueueFull):
        return ApiError(
            503, str(error), kind="service_unavailable", code="queue_full", outcome="unavailable"
        )
    if isinstance(error, (FleetError, LinkError)):
        return ApiError(
            503,
            str(error),
            kind="service_unavailable",
            code="no_node_available",
            outcome="unavailable",
        )
    _log.failure("a completion failed unexpectedly", failure)
    return ApiError(500, f"internal error: {error}", kind="server_error", outcome="error")


class _Exchange:
    """One completion request in flight: tokens in, text or SSE chunks out."""

    def __init__(
        self, api: OpenAIApi, request: Any, parsed: CompletionRequest, received: float
    ) -> None:
        self.api = api
        self.request: Any = request
        self.parsed = parsed
        self.received = received
        self.ident = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(received)
        self.detok = api.renderer.detokenizer()
        self.stop = StopText(parsed.stop)
        self.text: list[str] = []
        self.first_token_at: float | None = None
        self.streaming_started = False
        self.gone = False
        self.drained = False
        """Cancelled by the head's drain timeout (it ends with finish_reason stop)."""
        self.generation: GenerationHandle | None = None

    def start(self) -> None:
        api, parsed = self.api, self.parsed
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            window = api.fleet.max_window(api.node_model)
            default = DEFAULT_MAX_TOKENS if parsed.chat else COMPLETIONS_DEFAULT_MAX_TOKENS
            room = window - len(parsed.prompt) if window else default
            max_tokens = max(1, min(default, room))
        # Streamed chunks are small writes: without TCP_NODELAY, Nagle's algorithm holds each
        # one back until the client's delayed ACK of the previous one (about 40 ms).
        no_delay = getattr(self.request.transport, "setTcpNoDelay", None)
        if no_delay is not None:
            no_delay(True)
        self.request.notifyFinish().addErrback(self._client_gone)
        api.exchanges.add(self)
        try:
            generation = api.backend.generate(
                parsed.prompt,
                max_tokens,
                model=api.node_model,
                params=parsed.params,
                on_tokens=self._tokens,
            )
        except BaseException:
            api.exchange_ended(self)
            raise
        self.generation = generation
        if parsed.stream:
            generation.when_placed().addCallbacks(self._begin_stream, lambda _: None)
        generation.result.addCallbacks(self._done, self._failed).addBoth(self._ended)

    def _ended(self, result: Failure | None) -> None:
        if isinstance(result, Failure):
            _log.failure("answering {ident} failed", result, ident=self.ident)
        self.api.exchange_ended(self)

    def drain_cancel(self) -> None:
        """The drain timeout: cancel the generation; the client still gets a clean end."""
        self.drained = True
        if self.generation is not None:
            self.generation.cancel()

    # The client

    def _client_gone(self, failure: Failure) -> None:
        self.gone = True
        _log.info(
            "client of {ident} went away ({reason}); cancelling",
            ident=self.ident,
            reason=failure.getErrorMessage(),
        )
        if self.generation is not None:
            self.generation.cancel()

    def _write_event(self, body: Any) -> None:
        if not self.gone:
            self.request.write(b"data: " + json.dumps(body).encode() + b"\n\n")

    def _begin_stream(self, _: None) -> None:
        if self.gone or self.streaming_started:
            return
        self.streaming_started = True
        request = self.request
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        if self.parsed.chat:
            self._write_event(self._chunk({"role": "assistant", "content": ""}, None))
        else:
            request.write(b"")

    def _chunk(self, delta: dict[str, Any] | str, finish: str | None) -> dict[str, Any]:
        if self.parsed.chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.parsed.model,
            "choices": [choice],
        }

    def _emit(self, text: str) -> None:
        if not text:
            return
        self.text.append(text)
        if self.parsed.stream:
            self._begin_stream(None)
            self._write_event(self._chunk({"content": text} if self.parsed.chat else text, None))

    # The generation

    def _tokens(self, tokens: Sequence[int]) -> None:
        if self.first_token_at is None and tokens:
            self.first_token_at = self.api.reactor.seconds()
            self.api.metrics.ttft.observe(self.first_token_at - self.received)
        if self.stop.stopped:
            return
        self._emit(self.stop.feed(self.detok.push(tokens)))
        if self.stop.stopped and self.generation is not None:
            self.generation.cancel()

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.parsed.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def _done(self, outcome: FleetOutcome) -> None:
        api = self.api
        if not self.stop.stopped:
            self._emit(self.stop.feed(self.detok.flush()))
            self._emit(self.stop.flush())
        if self.stop.stopped or outcome.finish == FINISH_EOS:
            finish = "stop"
        elif outcome.finish == FINISH_CANCELLED and self.drained and not self.gone:
            finish = "stop"
        elif outcome.finish == FINISH_CANCELLED and self.gone:
            finish = "cancelled"
        else:
            finish = "length"
        api.metrics.prompt_tokens.inc(len(self.parsed.prompt))
        api.metrics.completion_tokens.inc(len(outcome.tokens))
        outcome_label = "cancelled" if finish == "cancelled" else "ok"
        if self.drained and outcome.finish == FINISH_CANCELLED:
            outcome_label = "drained"
        api.metrics.requests.labels(outcome_label).inc()
        if self.gone:
            return
        usage = self._usage(len(outcome.tokens))
        if self.parsed.stream:
            self._begin_stream(None)
            self._write_event(self._chunk({} if self.parsed.chat else "", finish))
            if self.parsed.include_usage:
                last = self._chunk({}, None)
                last["choices"] = []
                last["usage"] = usage
                self._write_event(last)
            self.request.write(b"data: [DONE]\n\n")
            self.request.finish()
            return
        text = "".join(self.text)
        if self.parsed.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        body = {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.parsed.model,
            "choices": [choice],
            "usage": usage,
        }
        self.request.write(_json(self.request, 200, body))
        self.request.finish()

    def _failed(self, failure: Failure) -> None:
        error = _fleet_error(failure)
        self.api.metrics.requests.labels(error.outcome).inc()
        if self.gone:
            return
        if self.streaming_started:
            self._write_event(error.body())
            self.request.write(b"data: [DONE]\n\n")
        else:
            self.request.write(_json(self.request, error.status, error.body()))
        self.request.finish()


__all__ = [
    "ApiError",
    "Backend",
    "CompletionRequest",
    "Detokenizer",
    "GenerationHandle",
    "HeadMetrics",
    "OpenAIApi",
    "Renderer",
    "StopText",
    "parse_request",
]
