"""The head's OpenAI-compatible HTTP API, health check and metrics, on twisted.web.

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: streaming (server-sent events in
  OpenAI's chunk format, ending with ``data: [DONE]``) and not, ``n`` choices each generated on
  its own with its own seed; ``GET /v1/models`` and ``GET /v1/models/{id}``.
- ``GET /healthz``: ``{"status", "nodes", "lanes_active", "lanes_total", "queued",
  "requests"}``; ``status`` is ``ok``, ``busy`` (every lane taken or generations waiting; still
  200), ``unavailable`` or ``draining`` (503).  ``GET /healthz?probe=live`` is a liveness probe:
  200 ``{"status": "alive"}`` whenever the head answers HTTP at all (a head with no node is
  alive, only not ready).
- ``GET /metrics``: Prometheus text (:mod:`sfnode.head.metrics`).

Each completion is interactive or batch (docs/protocol.md section 12.2): the ``X-Request-Class``
header says which, else the head's rule (:mod:`sfnode.head.classes`); the answer carries the class
chosen in the same header.

A completion that no live node can take now waits in the fleet's bounded queue (docs/protocol.md
section 8.5): a full queue answers 503 ``queue_full`` at once, a request that waited the queue
timeout in vain 503 ``no_node_available``.  The per-client and per-key limits of the front door
are taken before a request can enter that queue.

Every answer, errors on every route included (unknown path 404, wrong method 405), is JSON in
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.  The front door
(:mod:`sfnode.head.gate`) screens each request from its headers before any body is read: Host,
the API key (``Authorization: Bearer KEY``, constant time; ``/healthz`` and ``/metrics`` stay
open), the body limit, ``Content-Type: application/json``, and the per-client and per-key
limits.  The body is then checked (:mod:`sfnode.head.schema`), and rendered and tokenized
(:mod:`sfnode.head.text`) on a small worker pool when it is large, after a cheap character
bound from the window, so that a huge prompt never stalls the reactor.

:meth:`OpenAIApi.drain` is the head's SIGTERM path: new completions get 503 (code
``draining``), running ones may finish until the drain timeout, then they are cancelled
(GENERATE_CANCEL) and end with ``stop``.  A client that disconnects mid-stream, or stops reading
for ``--stall-timeout`` seconds, cancels its generations.

This module must never load model weights (only a tokenizer), never block the reactor, never use
the global reactor or prometheus_client's global registry, never read the fleet's internals (only
:class:`~sfnode.head.backend.Backend`), and never answer in any shape but OpenAI's.
"""

from __future__ import annotations

import hmac
import json
import random
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorThreads, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from sfnode.generation import StreamTooLong, TokenBatch, TokenSink
from sfnode.head.backend import (
    Backend,
    BackendStatus,
    ClientQueueFull,
    FleetError,
    FleetOutcome,
    GenerationHandle,
    GenerationTimedOut,
    LogprobsUnavailable,
    NodeDeclined,
    QueueFull,
    Requester,
)
from sfnode.head.classes import HEADER as CLASS_HEADER
from sfnode.head.classes import ClassRule, class_name, parse_header
from sfnode.head.gate import (
    ConcurrencyLimits,
    GateLimits,
    GuardedRequest,
    GuardedSite,
    Route,
    body_too_large,
    client_address,
    host_allowed,
    method_not_allowed,
    no_body_here,
    unknown_url,
)
from sfnode.head.link import LinkError
from sfnode.head.logprobs import ChoiceLogprobs
from sfnode.head.metrics import EXPOSITION_CONTENT_TYPE, HeadMetrics
from sfnode.head.models_registry import ModelRegistry, ServedModel
from sfnode.head.schema import (
    ApiError,
    CompletionRequest,
    clip,
    parse_body,
    parse_request,
)
from sfnode.head.text import (
    DEFAULT_TEMPLATE_TIMEOUT_S,
    Detokenizer,
    RenderBudget,
    Renderer,
    StopText,
)
from sfnode.wire import FINISH_CANCELLED, FINISH_EOS, RequestClass

DEFAULT_MAX_TOKENS = 512
"""max_tokens when a request gives none (capped by the window left after the prompt)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for the legacy /v1/completions."""
DRAIN_CANCEL_GRACE_S = 5.0
"""After the drain timeout cancels what still runs: how long the drain waits for those
generations to end before it gives up on them (the fleet's links are closed next)."""
INLINE_BODY_BYTES = 16 * 1024
"""Completion bodies up to this size are checked and tokenized on the reactor (a fraction of a
millisecond); larger ones go to the worker pool, and so does every chat request (its template
is code from a model file, run under ``--template-timeout``)."""
WORKER_THREADS = 2

_log = Logger(namespace="sfnode.head.http")
_T = TypeVar("_T")

__all__ = [
    "DRAIN_CANCEL_GRACE_S",
    "ApiError",
    "Backend",
    "CompletionRequest",
    "Detokenizer",
    "GenerationHandle",
    "HeadMetrics",
    "OpenAIApi",
    "Renderer",
    "StopText",
    "Workers",
]


# --------------------------------------------------------------------------------------------
# Work off the reactor


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``; nothing
    elsewhere).  Tokenizing a prompt of megabytes allocates hundreds of megabytes in the
    tokenizer's native code; freed, glibc keeps them in the worker thread's arena for good."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


class Workers:
    """A small thread pool of its own for rendering and tokenizing (never the reactor's shared
    one, so a burst of big prompts cannot starve other thread users).  Started on first use;
    :meth:`stop` joins its threads."""

    def __init__(self, reactor: IReactorThreads, size: int = WORKER_THREADS) -> None:
        self._reactor = reactor
        self._size = size
        self._pool: ThreadPool | None = None

    def run(self, work: Callable[[], _T]) -> Deferred[_T]:
        """``work()`` on a worker thread; the C heap is trimmed after it (see
        :func:`trim_heap`)."""
        from twisted.internet.threads import deferToThreadPool

        if self._pool is None:
            self._pool = ThreadPool(minthreads=0, maxthreads=self._size, name="sfhead-text")
            self._pool.start()

        def run_then_trim() -> _T:
            try:
                return work()
            finally:
                trim_heap()

        return deferToThreadPool(self._reactor, self._pool, run_then_trim)

    def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()


# --------------------------------------------------------------------------------------------
# Checked and rendered requests


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request, its prompt's token ids, and the model it asks for."""

    request: CompletionRequest
    prompt: list[int]
    model: ServedModel


def too_long(length: int, window: int, param: str) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {window} tokens; the prompt has {length} tokens.",
        param=param,
        code="context_length_exceeded",
        outcome="too_long",
    )


def _unavailable(message: str, code: str = "no_node_available") -> ApiError:
    return ApiError(503, message, kind="service_unavailable", code=code, outcome="unavailable")


def _draining() -> ApiError:
    return _unavailable("the head is shutting down and takes no new requests", "draining")


def _random_seed() -> int:
    return random.SystemRandom().getrandbits(63)


# --------------------------------------------------------------------------------------------
# The API


class OpenAIApi:
    """Everything the HTTP resources share: backend, renderer, model names, keys, limits,
    metrics, and the requests in flight."""

    def __init__(
        self,
        reactor: Any,
        backend: Backend,
        tokenizer: Any,
        model_name: str,
        *,
        models: ModelRegistry | None = None,
        seed_source: Callable[[], int] | None = None,
        metrics: HeadMetrics | None = None,
        api_keys: Iterable[bytes] = (),
        limits: GateLimits | None = None,
        vocab_size: int | None = None,
        workers: Workers | None = None,
        class_rule: ClassRule | None = None,
        allow_special_tokens: bool = False,
        template_timeout_s: float = DEFAULT_TEMPLATE_TIMEOUT_S,
    ) -> None:
        self.reactor: IReactorTime = reactor
        self.backend = backend
        self.models = (
            models
            if models is not None
            else ModelRegistry(allow_special_tokens=allow_special_tokens)
        )
        """The models served, by name (sfnode.head.models_registry): what a request's
        ``model`` picks, and what nodes offer in HELLO_ACK_F."""
        if tokenizer is not None:
            self.models.serve(
                model_name,
                tokenizer,
                origin="the head's tokenizer",
                vocab_size=vocab_size,
                override=True,
            )
        self.template_timeout_s = template_timeout_s
        """How long one chat-template render may take before it is stopped (500)."""
        self.model_name = model_name
        """The model of a request that names none."""
        self.new_seed: Callable[[], int] = seed_source or _random_seed
        """The seed of a request that gives none (sampling is counter-based: a fixed seed
        would give every such request the same draws)."""
        self.api_keys = tuple(k for k in api_keys if k)
        """The bearer tokens a /v1 request may carry; none: the API is open."""
        limits = limits if limits is not None else GateLimits()
        hosts = limits.allowed_hosts
        if self.api_keys and not hosts:
            # A page in a browser cannot send the key, so a rebinding attack gains nothing.
            hosts = frozenset({"*"})
        self.limits = limits
        self.allowed_hosts = hosts
        self.concurrency = ConcurrencyLimits(limits.max_client_requests, limits.max_key_requests)
        self.workers = workers if workers is not None else Workers(reactor)
        self.class_rule = class_rule if class_rule is not None else ClassRule()
        """How a request that names no class (X-Request-Class) gets one (sfnode.head.classes)."""
        self.exchanges: set[_Exchange] = set()
        """Completion requests in flight (what a drain waits for)."""
        self.draining = False
        """True once :meth:`drain` started: new completion requests get 503."""
        self._site: GuardedSite | None = None
        self.metrics = (
            metrics
            if metrics is not None
            else HeadMetrics(
                self.status,
                open_requests=lambda: len(self.exchanges),
                open_connections=lambda: len(self._site.connections) if self._site else 0,
                statuses=self.statuses,
            )
        )
        self._drain_waiters: list[Deferred[None]] = []
        self._drain_timer: IDelayedCall | None = None

    @property
    def renderer(self) -> Renderer:
        """The renderer of the model a request that names none gets."""
        return self.default_model().renderer

    def default_model(self) -> ServedModel:
        """The model of a request that names none: ``model_name``, else the first served."""
        model = self.models.get(self.model_name)
        if model is None:
            names = self.models.names()
            if not names:
                raise ApiError(
                    503,
                    "no model is served yet: no node has joined with one",
                    kind="server_error",
                    code="no_model",
                    outcome="unavailable",
                )
            model = self.models.get(names[0])
            assert model is not None
        return model

    def status(self, model: str | None = None) -> BackendStatus:
        """The backend's status for ``model`` (default: :attr:`model_name`)."""
        return self.backend.status(model if model is not None else self.model_name)

    def statuses(self) -> dict[str, BackendStatus]:
        """The backend's status for every model served (a snapshot a worker may read)."""
        return {name: self.backend.status(name) for name in self.models.names()}

    def stop(self) -> None:
        """Stop the worker threads (the HTTP service does this when it stops)."""
        self.workers.stop()

    # The front door

    def authorized(self, request: Any) -> bytes | None:
        """The API key ``request`` carries (``b""`` when the API is open), or None."""
        if not self.api_keys:
            return b""
        header = request.getHeader(b"authorization") or b""
        scheme, _, given = header.partition(b" ")
        given = given.strip() if scheme.lower() == b"bearer" else b""
        # compare_digest's time never depends on where the given bytes first differ from a
        # key (at most on their lengths); every key is compared, whichever matches.
        found = None
        for key in self.api_keys:
            if hmac.compare_digest(given, key):
                found = key
        return found

    def screen(self, request: GuardedRequest, length: int | None) -> ApiError | None:
        """The refusal of a request whose headers are in, or None (see :mod:`gate`).

        It reads the route the front door resolved (``request.resolved``, what will serve the
        request), never the raw path: Host, then the API key for keyed routes, then the body
        rules (only a POST to a completion route reads one; any other request that declares
        a body is answered now), then for completions the JSON media type and the limits."""
        if not host_allowed(request.getHeader(b"host"), self.allowed_hosts):
            return ApiError(
                403,
                "this server does not answer to the host named in the Host header (an "
                "operator can allow it with --allowed-host)",
                code="host_not_allowed",
                outcome="forbidden",
            )
        resolved = request.resolved
        assert resolved is not None
        method = request.method
        preflight = method == b"OPTIONS" and request.site.cors_allows(request)
        key = b""
        if resolved.keyed and not preflight:
            found = self.authorized(request)
            if found is None:
                return _unauthorized(request)
            key = found
        route = resolved.route
        completion = route.completion and method == b"POST"
        if length != 0 and not completion:
            # Answered from the headers: a body this route never reads is never read.
            if not resolved.found:
                return unknown_url(method, request.path)
            if method not in _allowed(route) and not preflight:
                return method_not_allowed(method, request.path, route)
            return no_body_here(method, request.path)
        if length is not None and length > self.limits.max_body:
            return body_too_large(self.limits.max_body)
        if completion:
            media = (request.getHeader(b"content-type") or b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                return ApiError(
                    415,
                    "the request body must be JSON, sent with 'Content-Type: application/json'",
                    code="unsupported_media_type",
                    outcome="unsupported_media_type",
                )
            if self.draining:
                return _draining()
            client = client_address(request.getClientAddress())  # type: ignore[no-untyped-call]
            try:
                permit = self.concurrency.acquire(client, key or None)
            except ApiError as e:
                return e
            request.permit = permit
            request.notifyFinish().addBoth(lambda _: permit.release())
        return None

    def unexpected(self, failure: Failure, request: Any = None) -> ApiError:
        """An exception nobody expected: logged once, counted, answered as a JSON 500."""
        _log.failure(
            "answering {method} {path} failed unexpectedly",
            failure,
            method=getattr(request, "method", b"?").decode("latin-1"),
            path=getattr(request, "path", b"?")[:200].decode("latin-1"),
        )
        self.metrics.requests.labels("error").inc()
        return ApiError(
            500,
            "internal error: the head failed to answer this request (its log says why)",
            kind="server_error",
            outcome="error",
        )

    # Drain

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

    # Requests

    def prepare(
        self,
        data: bytes,
        chat: bool,
        statuses: Mapping[str, BackendStatus],
        budget: RenderBudget | None = None,
    ) -> Prepared:
        """Check a body and render its prompt for the model it names (on the reactor or a
        worker thread: it reads only ``statuses``, a snapshot per model, and the renderers);
        ``budget`` bounds the chat template's render.

        :raises ApiError: anything wrong with the request, an unknown model (404
            ``model_not_found``) and a prompt that cannot fit included.
        """
        body = parse_body(data)
        named = body.get("model")
        served = self.models.get(named) if isinstance(named, str) else None
        if served is None and "model" not in body:
            served = self.default_model()
        request = parse_request(
            body,
            chat=chat,
            models=self.models.names() or [self.model_name],
            vocab_size=served.vocab_size if served is not None else 0,
            seed_source=self.new_seed,
        )
        model = self.models.get(request.model)
        assert model is not None  # parse_request refused any other name
        renderer = model.renderer
        status = statuses.get(model.name)
        limit = status.context_limit if status is not None else None
        if limit is not None and request.characters > renderer.character_bound(limit):
            # Not tokenized at all: no window can hold this many characters.
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{request.characters} characters, more than that many tokens can hold.",
                param=request.prompt_param,
                code="context_length_exceeded",
                outcome="too_long",
            )
        if request.chat:
            prompt = renderer.chat(request.messages, budget)
        elif request.prompt_text is not None:
            prompt = renderer.completion(request.prompt_text)
        else:
            prompt = list(request.prompt_ids)
        if not prompt:
            raise ApiError(400, "the prompt has no tokens", param=request.prompt_param)
        if limit is not None and len(prompt) > limit:
            raise too_long(len(prompt), limit, request.prompt_param)
        return Prepared(request, prompt, model)

    def site(self) -> GuardedSite:
        """The twisted.web site that serves this API (with its front door)."""
        if self._site is None:
            self._site = GuardedSite(
                self._resource(),
                reactor=self.reactor,
                limits=self.limits,
                screen=self.screen,
                count=lambda outcome: self.metrics.requests.labels(outcome).inc(),
                unexpected=self.unexpected,
                not_found=_NotFound(),  # type: ignore[no-untyped-call]
            )
        return self._site

    def _resource(self) -> Resource:
        """The resource tree: every route the API serves (each resource declares its
        :class:`~sfnode.head.gate.Route`; everything under ``/v1`` needs the API key, and
        ``/metrics`` too unless ``--metrics-public``)."""
        root = _Branch()
        v1 = _Branch(keyed=True)
        chat = _Branch()
        root.putChild(b"v1", v1)
        v1.putChild(b"chat", chat)
        chat.putChild(b"completions", _Completions(self, chat=True))
        v1.putChild(b"completions", _Completions(self, chat=False))
        v1.putChild(b"models", _Models(self))
        root.putChild(b"healthz", _Health(self))
        root.putChild(b"metrics", _Metrics(self, keyed=not self.limits.metrics_public))
        return root


def _allowed(route: Route) -> tuple[bytes, ...]:
    """The methods a route answers: its own, and HEAD where it serves GET."""
    return (*route.methods, b"HEAD") if b"GET" in route.methods else route.methods


def _unauthorized(request: Any) -> ApiError:
    missing = not request.getHeader(b"authorization")
    return ApiError(
        401,
        "You didn't provide an API key: send it as 'Authorization: Bearer KEY'."
        if missing
        else "Incorrect API key provided.",
        code="invalid_api_key",
        outcome="unauthorized",
        headers={b"www-authenticate": b"Bearer"},
    )


def answer(
    request: Any, status: int, body: Any, headers: dict[bytes, bytes] | None = None
) -> bytes:
    data = json.dumps(body).encode()
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"content-length", b"%d" % len(data))
    for name, value in (headers or {}).items():
        request.setHeader(name, value)
    return data


def answer_error(request: Any, error: ApiError) -> bytes:
    return answer(request, error.status, error.body(), error.headers)


# --------------------------------------------------------------------------------------------
# Resources


class _Leaf(Resource):
    """A resource that answers every method it does not serve with a JSON 405 (and CORS
    preflights with 204, when the origin is allowed)."""

    isLeaf = True
    route = Route(methods=(b"GET",))

    def render_GET(self, request: Any) -> bytes:
        raise NotImplementedError

    def render(self, request: Any) -> bytes | int:
        method = request.method
        methods = self.route.methods
        if method == b"HEAD" and b"GET" in methods:
            # Answered here rather than by twisted.web, which logs a warning per HEAD request
            # whose resource returns a body.
            body = self.render_GET(request)
            request.setHeader(b"content-length", b"%d" % len(body))
            return b""
        if method == b"OPTIONS" and request.site.cors_allows(request):
            request.setResponseCode(204)
            return b""
        handler = getattr(self, "render_" + method.decode("latin-1"), None)
        if method not in methods or handler is None:
            error = method_not_allowed(method, request.path, self.route)
            request.site.count(error.outcome)
            return answer_error(request, error)
        result: bytes | int = handler(request)
        return result


class _NotFound(_Leaf):
    route = Route()

    def render(self, request: Any) -> bytes:
        error = unknown_url(request.method, request.path)
        request.site.count(error.outcome)
        return answer_error(request, error)


class _Branch(Resource):
    """A path segment with children; the segment itself and unknown children are 404
    (``keyed``: it and everything under it need the API key)."""

    def __init__(self, *, keyed: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.route = Route(keyed=keyed)

    def getChild(self, path: bytes, request: Any) -> Resource:
        return _NotFound()  # type: ignore[no-untyped-call]

    def render(self, request: Any) -> bytes:
        return _NotFound().render(request)  # type: ignore[no-untyped-call]


class _Health(_Leaf):
    def __init__(self, api: OpenAIApi) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api

    def render_GET(self, request: Any) -> bytes:
        api = self.api
        if request.args.get(b"probe") == [b"live"]:
            return answer(request, 200, {"status": "alive"})
        status = api.status()
        if api.draining:
            state, code = "draining", 503
        elif not status.live_nodes:
            state, code = "unavailable", 503
        else:
            state, code = ("busy" if status.busy else "ok"), 200
        return answer(
            request,
            code,
            {
                "status": state,
                "nodes": status.live_nodes,
                "lanes_active": status.lanes_active,
                "lanes_total": status.lanes_total,
                "queued": status.queued,
                "requests": len(api.exchanges),
            },
        )


class _Metrics(_Leaf):
    def __init__(self, api: OpenAIApi, *, keyed: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api
        self.route = Route(methods=(b"GET",), keyed=keyed)

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", EXPOSITION_CONTENT_TYPE.encode())
        return self.api.metrics.exposition()


class _Models(_Leaf):
    """``/v1/models`` (the list) and ``/v1/models/{id}`` (one, or 404)."""

    route = Route(methods=(b"GET",), suffix=True)

    def __init__(self, api: OpenAIApi) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api

    def _entry(self, name: str) -> dict[str, Any]:
        status = self.api.status(name)
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "sfnode",
            "context_length": status.window or None,
            "nodes": status.serving_nodes,
            "capabilities": {"chat": True, "completions": True, "vision": False},
        }

    def render_GET(self, request: Any) -> bytes:
        wanted = b"/".join(request.postpath).strip(b"/").decode("utf-8", "replace")
        names = self.api.models.names()
        if not wanted:
            entries = [self._entry(name) for name in names]
            return answer(request, 200, {"object": "list", "data": entries})
        if wanted in names:
            return answer(request, 200, self._entry(wanted))
        error = ApiError(
            404,
            f"The model '{clip(wanted)}' does not exist",
            param="model",
            code="model_not_found",
            outcome="not_found",
        )
        request.site.count(error.outcome)
        return answer_error(request, error)


class _Completions(_Leaf):
    route = Route(methods=(b"POST",), completion=True)

    def __init__(self, api: OpenAIApi, *, chat: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api
        self.chat = chat

    def render_POST(self, request: Any) -> int:
        _Exchange(self.api, request, self.chat).start()
        return NOT_DONE_YET


# --------------------------------------------------------------------------------------------
# One completion request


def _fleet_error(failure: Failure, param: str) -> ApiError | None:
    """The answer to a generation that failed for a known reason (None: unexpected)."""
    error = failure.value
    if isinstance(error, StreamTooLong):
        return too_long(error.length, error.max, param)
    if isinstance(error, NodeDeclined):
        return ApiError(502, str(error), kind="server_error", outcome="error")
    if isinstance(error, ClientQueueFull):
        return ApiError(
            429,
            str(error),
            kind="requests",
            code="rate_limit_exceeded",
            outcome="rate_limited",
            headers={b"retry-after": b"1"},
        )
    if isinstance(error, QueueFull):
        return _unavailable(str(error), "queue_full")
    if isinstance(error, GenerationTimedOut):
        return ApiError(
            504, str(error), kind="timeout_error", code="generation_timeout", outcome="timeout"
        )
    if isinstance(error, LogprobsUnavailable):
        return ApiError(
            400,
            f"logprobs are not supported here: {error}",
            param="logprobs",
            code="unsupported_parameter",
        )
    if isinstance(error, (FleetError, LinkError)):
        return _unavailable(str(error))
    return None


class _Choice:
    """One of the ``n`` generations of a request: its text so far and how it ended."""

    def __init__(
        self,
        index: int,
        detok: Detokenizer,
        stops: Sequence[str],
        logprobs: ChoiceLogprobs | None = None,
    ) -> None:
        self.index = index
        self.detok = detok
        self.stop = StopText(stops)
        self.text: list[str] = []
        self.generation: GenerationHandle | None = None
        self.outcome: FleetOutcome | None = None
        self.finish: str | None = None
        self.logprobs = logprobs
        """The logprobs of the tokens shown so far, when the request asked for them."""
        self.decoded = 0
        """Characters the detokenizer released so far (where the next token's text starts)."""


class _Exchange:
    """One completion request: body in, ``n`` generations, text or SSE chunks out."""

    def __init__(self, api: OpenAIApi, request: Any, chat: bool) -> None:
        self.api = api
        self.request: Any = request
        self.chat = chat
        self.received = api.reactor.seconds()
        self.ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(self.received)
        self.parsed: CompletionRequest | None = None
        self.prompt: list[int] = []
        self.model: ServedModel | None = None
        """The model the request names (its renderer, the name asked of nodes)."""
        self.choices: list[_Choice] = []
        self.first_token_at: float | None = None
        self.named_class: RequestClass | None = None
        """The class the X-Request-Class header named (None: it named none)."""
        self.streaming_started = False
        self.answered = False
        """The answer is complete (or the client is gone): nothing more is written."""
        self.gone = False
        self.drained = False
        """Cancelled by the head's drain timeout (it ends with finish_reason stop)."""
        self.failure: ApiError | None = None
        self._pending = 0
        self._stall_timer: IDelayedCall | None = None
        self._producing = False

    # Life cycle

    def start(self) -> None:
        api = self.api
        self.request.notifyFinish().addErrback(self._client_gone)
        api.exchanges.add(self)
        try:
            if self.request.permit is None:
                # The front door admits every completion with a permit: one without is a
                # defect, and must never produce a completion.
                raise RuntimeError(f"a completion reached {self.request.path!r} unscreened")
            if api.draining:
                raise _draining()
            self.named_class = parse_header(self.request.getHeader(CLASS_HEADER))
            data = self.request.content.getvalue()
            if len(data) > api.limits.max_body:
                raise body_too_large(api.limits.max_body)
            statuses = api.statuses()
            if self.chat:
                prepared: Deferred[Prepared] = self._prepare_chat(data, statuses)
            elif len(data) <= INLINE_BODY_BYTES:
                prepared = defer.maybeDeferred(api.prepare, data, self.chat, statuses)
            else:
                prepared = api.workers.run(lambda: api.prepare(data, self.chat, statuses))
        except Exception:
            # An ApiError is answered as such; anything else as an unexpected failure.
            prepared = defer.fail()
        prepared.addCallback(self._prepared).addErrback(self._refused).addErrback(self._unexpected)

    def _prepare_chat(
        self, data: bytes, statuses: Mapping[str, BackendStatus]
    ) -> Deferred[Prepared]:
        """Check and render a chat body on a worker, its template's render stopped after
        ``--template-timeout`` seconds (timed from when the render starts)."""
        api = self.api
        timer: list[IDelayedCall] = []

        def arm() -> None:
            if not budget.stopped:
                timer.append(api.reactor.callLater(api.template_timeout_s, timed_out))

        def timed_out() -> None:
            _log.warn(
                "the chat template took more than {seconds:g} s to render the messages of "
                "{ident}; stopped it (--template-timeout)",
                seconds=api.template_timeout_s,
                ident=self.ident,
            )
            budget.stop()

        def disarm(result: object) -> object:
            for call in timer:
                if call.active():
                    call.cancel()
            return result

        budget = RenderBudget(lambda: api.reactor.callFromThread(arm))  # type: ignore[attr-defined]
        prepared = api.workers.run(lambda: api.prepare(data, True, statuses, budget))
        return prepared.addBoth(disarm)

    def _prepared(self, prepared: Prepared) -> None:
        api = self.api
        self.parsed, self.prompt, self.model = prepared.request, prepared.prompt, prepared.model
        if self.gone:
            self._maybe_ended()
            return
        if api.draining:
            raise _draining()
        # No "is a node live?" check here: a request no node can take now waits in the
        # fleet's queue (a node may come back or dial in) and fails from there when it is
        # full or the wait times out.
        parsed = self.parsed
        permit = self.request.permit
        assert permit is not None  # start() refused a request without one
        permit.widen(parsed.n - 1)
        max_tokens = parsed.max_tokens
        model = self.model
        assert model is not None
        if max_tokens is None:
            window = api.status(model.name).window
            default = DEFAULT_MAX_TOKENS if parsed.chat else COMPLETIONS_DEFAULT_MAX_TOKENS
            room = window - len(self.prompt) if window else default
            max_tokens = max(1, min(default, room))
        # Streamed chunks are small writes: without TCP_NODELAY, Nagle's algorithm holds each
        # one back until the client's delayed ACK of the previous one (about 40 ms).
        no_delay = getattr(self.request.transport, "setTcpNoDelay", None)
        if no_delay is not None:
            no_delay(True)
        request_class = api.class_rule.classify(self.named_class, len(self.prompt))
        self.request.setHeader(CLASS_HEADER, class_name(request_class).encode())
        self.request.registerProducer(self, True)
        self._producing = True
        requester = Requester(client_address(self.request.getClientAddress()), permit.key)
        placed = []
        for index in range(parsed.n):
            logprobs = None
            if parsed.logprobs is not None:
                logprobs = ChoiceLogprobs(self.chat, parsed.logprobs, model.renderer.token_bytes)
            choice = _Choice(index, model.renderer.detokenizer(), parsed.stop, logprobs)
            self.choices.append(choice)
            generation = api.backend.generate(
                self.prompt,
                max_tokens,
                model=model.name,
                params=parsed.choice_params(index),
                on_tokens=self._receiver(choice),
                request_class=request_class,
                requester=requester,
            )
            choice.generation = generation
            self._pending += 1
            if parsed.stream:
                placed.append(generation.when_placed())
            generation.result.addCallbacks(
                self._choice_done, self._choice_failed, callbackArgs=(choice,),
                errbackArgs=(choice,),
            ).addErrback(self._unexpected)  # fmt: skip
        if placed:
            defer.gatherResults(placed, consumeErrors=True).addCallbacks(
                self._begin_stream, lambda _: None
            )

    def _refused(self, failure: Failure) -> None:
        """A request that ends before any generation: its error answered and counted."""
        failure.trap(ApiError)  # type: ignore[no-untyped-call]
        error = failure.value
        assert isinstance(error, ApiError)
        self.api.metrics.requests.labels(error.outcome).inc()
        self._answer_error(error)
        self._maybe_ended()

    def _unexpected(self, failure: Failure) -> None:
        """Anything else that went wrong: one log line, one count, a JSON 500 if possible."""
        error = self.api.unexpected(failure, self.request)
        for choice in self.choices:
            if choice.generation is not None and choice.outcome is None:
                choice.generation.cancel()
        self._answer_error(error)
        self._pending = 0
        self._maybe_ended()

    def _maybe_ended(self) -> None:
        if self._pending == 0:
            self._stop_producing()
            self.api.exchange_ended(self)

    def drain_cancel(self) -> None:
        """The drain timeout: cancel the generations; the client still gets a clean end."""
        self.drained = True
        self._cancel_all()

    def _cancel_all(self) -> None:
        for choice in self.choices:
            if choice.generation is not None:
                choice.generation.cancel()

    # The client

    def _client_gone(self, failure: Failure) -> None:
        self.gone = True
        self.answered = True
        self._stop_producing()
        if self.choices:
            _log.info(
                "client of {ident} went away ({reason}); cancelling",
                ident=self.ident,
                reason=failure.getErrorMessage(),
            )
        self._cancel_all()

    def pauseProducing(self) -> None:
        """The client's connection is full (it is not reading): cut it off unless it reads
        again within the stall timeout."""
        if self._stall_timer is None and not self.answered:
            self._stall_timer = self.api.reactor.callLater(
                self.api.limits.stall_timeout_s, self._stalled
            )

    def resumeProducing(self) -> None:
        timer, self._stall_timer = self._stall_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def stopProducing(self) -> None:
        self.resumeProducing()

    def _stalled(self) -> None:
        self._stall_timer = None
        _log.info(
            "client of {ident} read nothing for {seconds} s; cutting it off",
            ident=self.ident,
            seconds=self.api.limits.stall_timeout_s,
        )
        self.gone = True
        self.answered = True
        self._cancel_all()
        transport = self.request.transport
        if transport is not None:
            transport.abortConnection()

    def _stop_producing(self) -> None:
        self.resumeProducing()
        if self._producing:
            self._producing = False
            if not self.gone:
                self.request.unregisterProducer()

    # Writing

    def _write_event(self, body: Any) -> None:
        if not self.answered:
            self.request.write(b"data: " + json.dumps(body).encode() + b"\n\n")

    def _begin_stream(self, _: object = None) -> None:
        if self.answered or self.streaming_started:
            return
        self.streaming_started = True
        request = self.request
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        if self.chat:
            for choice in self.choices:
                self._write_event(self._chunk(choice, {"role": "assistant", "content": ""}, None))
        else:
            request.write(b"")

    def _chunk(
        self,
        choice: _Choice,
        delta: dict[str, Any] | str,
        finish: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> Any:
        assert self.parsed is not None
        if self.chat:
            entry: dict[str, Any] = {
                "index": choice.index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            kind = "chat.completion.chunk"
        else:
            entry = {
                "index": choice.index,
                "text": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            kind = "text_completion"
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.parsed.model,
            "choices": [entry],
        }

    def _emit(self, choice: _Choice, text: str, *, last: bool = False) -> None:
        """Show ``text`` (a chunk when streaming), with the logprobs of the tokens shown since
        the last chunk; ``last``: the choice's final text, sent even when empty if logprobs
        are still pending (tokens whose text is empty, such as an EOS)."""
        pending = choice.logprobs is not None and choice.logprobs.pending
        if not text and not (last and pending):
            return
        choice.text.append(text)
        assert self.parsed is not None
        if self.parsed.stream:
            self._begin_stream()
            logprobs = choice.logprobs.take() if choice.logprobs is not None else None
            delta = {"content": text} if self.chat else text
            self._write_event(self._chunk(choice, delta, None, logprobs))

    def _answer_error(self, error: ApiError) -> None:
        if self.answered:
            return
        self.answered = True
        self._stop_producing()
        if self.streaming_started:
            self.request.write(b"data: " + error.encoded() + b"\n\n")
            self.request.write(b"data: [DONE]\n\n")
        else:
            self.request.write(answer_error(self.request, error))
        self.request.finish()

    # The generations

    def _receiver(self, choice: _Choice) -> TokenSink:
        def receive(batch: TokenBatch) -> None:
            self._tokens(choice, batch)

        return receive

    def _tokens(self, choice: _Choice, batch: TokenBatch) -> None:
        tokens, logprobs = batch.tokens, batch.logprobs
        if self.first_token_at is None and tokens:
            self.first_token_at = self.api.reactor.seconds()
            self.api.metrics.ttft.observe(self.first_token_at - self.received)
        if choice.stop.stopped or self.answered:
            return
        if choice.logprobs is None:
            self._emit(choice, choice.stop.feed(choice.detok.push(tokens)))
        elif logprobs is None:
            # The fleet places such requests only on nodes that return logprobs, and their
            # links refuse a stream without them: a defect, answered as one.
            self._give_up(
                ApiError(
                    502,
                    "a node returned tokens without the logprobs asked for",
                    kind="server_error",
                    outcome="error",
                )
            )
            return
        else:
            # One token at a time: each entry is shown with the text its token released, and
            # the tokens after a stop string are not listed.
            for token, logprob in zip(tokens, logprobs, strict=True):
                choice.logprobs.add(token, logprob, choice.decoded)
                piece = choice.detok.push((token,))
                choice.decoded += len(piece)
                self._emit(choice, choice.stop.feed(piece))
                if choice.stop.stopped:
                    break
        if choice.stop.stopped and choice.generation is not None:
            choice.generation.cancel()

    def _choice_done(self, outcome: FleetOutcome, choice: _Choice) -> None:
        choice.outcome = outcome
        self._pending -= 1
        self.api.metrics.completion_tokens.inc(len(outcome.tokens))
        if not self.answered:
            if not choice.stop.stopped:
                self._emit(choice, choice.stop.feed(choice.detok.flush()))
            self._emit(choice, choice.stop.flush(), last=True)
        if choice.stop.stopped or outcome.finish == FINISH_EOS:
            choice.finish = "stop"
        elif outcome.finish == FINISH_CANCELLED and self.drained and not self.gone:
            choice.finish = "stop"
        elif outcome.finish == FINISH_CANCELLED and self.gone:
            choice.finish = "cancelled"
        else:
            choice.finish = "length"
        assert self.parsed is not None
        if self.parsed.stream and not self.answered:
            self._begin_stream()
            self._write_event(self._chunk(choice, {} if self.chat else "", choice.finish))
        if self._pending == 0:
            self._all_done()

    def _choice_failed(self, failure: Failure, choice: _Choice) -> None:
        self._pending -= 1
        assert self.parsed is not None
        error = _fleet_error(failure, self.parsed.prompt_param)
        if error is None:
            failure.raiseException()
        self._give_up(error)
        self._maybe_ended()

    def _give_up(self, error: ApiError) -> None:
        """Answer ``error`` for the whole request (the first error wins) and cancel the
        generations still running."""
        if self.failure is None:
            self.failure = error
            self.api.metrics.requests.labels(error.outcome).inc()
            self._cancel_all()
            self._answer_error(error)

    def _all_done(self) -> None:
        api = self.api
        parsed = self.parsed
        assert parsed is not None
        if self.failure is not None:
            self._maybe_ended()
            return
        api.metrics.prompt_tokens.inc(len(self.prompt))
        finishes = [c.finish for c in self.choices]
        if self.drained and any(
            c.outcome is not None and c.outcome.finish == FINISH_CANCELLED for c in self.choices
        ):
            label = "drained"
        elif "cancelled" in finishes:
            label = "cancelled"
        else:
            label = "ok"
        api.metrics.requests.labels(label).inc()
        if self.answered:
            self._maybe_ended()
            return
        completion_tokens = sum(len(c.outcome.tokens) for c in self.choices if c.outcome)
        usage = {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": completion_tokens,
            "total_tokens": len(self.prompt) + completion_tokens,
        }
        self.answered = True
        self._stop_producing()
        if parsed.stream:
            self._begin_stream()
            if parsed.include_usage:
                last: dict[str, Any] = {
                    "id": self.ident,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created,
                    "model": parsed.model,
                    "choices": [],
                    "usage": usage,
                }
                self.request.write(b"data: " + json.dumps(last).encode() + b"\n\n")
            self.request.write(b"data: [DONE]\n\n")
            self.request.finish()
            self._maybe_ended()
            return
        entries = []
        for choice in self.choices:
            text = "".join(choice.text)
            logprobs = choice.logprobs.whole() if choice.logprobs is not None else None
            if self.chat:
                entries.append(
                    {
                        "index": choice.index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs,
                        "finish_reason": choice.finish,
                    }
                )
            else:
                entries.append(
                    {
                        "index": choice.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish,
                    }
                )
        body = {
            "id": self.ident,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": parsed.model,
            "choices": entries,
            "usage": usage,
        }
        self.request.write(answer(self.request, 200, body))
        self.request.finish()
        self._maybe_ended()
