"""The head's OpenAI-compatible HTTP API, health check and metrics, on twisted.web.

- ``POST /v1/responses``: OpenAI's Responses API, translated onto a chat completion
  (:mod:`sfnode.head.api.responses`), streamed as its documented events or not; stored responses
  (bounded, in memory) continue with ``previous_response_id``.
- ``POST /v1/chat/completions`` and ``POST /v1/completions``: streaming (server-sent events in
  OpenAI's chunk format, ending with ``data: [DONE]``) and not, ``n`` choices each generated on
  its own with its own seed; ``GET /v1/models`` and ``GET /v1/models/{id}``.
- ``POST /v1/messages`` (Anthropic's Messages API, :mod:`sfnode.head.api.messages`) and
  Ollama's API under ``/api`` (:mod:`sfnode.head.api.ollama`), each translated onto a chat
  completion and answered in its own shapes, errors included.
- ``GET /healthz``: ``{"status", "nodes", "lanes_active", "lanes_total", "queued",
  "requests"}``; ``status`` is ``ok``, ``busy`` (every lane taken or generations waiting; still
  200), ``unavailable`` or ``draining`` (503).  ``GET /healthz?probe=live`` is a liveness probe:
  200 ``{"status": "alive"}`` whenever the head answers HTTP at all (a head with no node is
  alive, only not ready).
- ``GET /metrics``: Prometheus text (:mod:`sfnode.head.api.metrics`).

Each completion is interactive or batch (docs/protocol.md section 12.2): the ``X-Request-Class``
header says which, else the head's rule (:mod:`sfnode.head.api.request_class`); the answer carries
the class chosen in the same header.

A completion that no live node can take now waits in the fleet's bounded queue (docs/protocol.md
section 8.5): a full queue answers 503 ``queue_full`` at once, a request that waited the queue
timeout in vain 503 ``no_node_available``.  The per-client and per-key limits of the front door
are taken before a request can enter that queue.

Every answer, errors on every route included (unknown path 404, wrong method 405), is JSON in
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.  The front door
(:mod:`sfnode.head.api.gate`) screens each request from its headers before any body is read: Host,
the API key (``Authorization: Bearer KEY``, constant time; ``/healthz`` and ``/metrics`` stay
open), the body limit, ``Content-Type: application/json``, and the per-client and per-key
limits.  The body is then checked (:mod:`sfnode.head.api.schema`), and rendered and tokenized
(:mod:`sfnode.head.models.text`) on a small worker pool when it is large, after a cheap character
bound from the window, so that a huge prompt never stalls the reactor.

:meth:`OpenAIApi.drain` is the head's SIGTERM path: new completions get 503 (code
``draining``), running ones may finish until the drain timeout, then they are cancelled
(GENERATE_CANCEL) and end with ``stop``.  A client that disconnects mid-stream, or stops reading
for ``--stall-timeout`` seconds, cancels its generations.

This module holds the resources and what they share (:class:`OpenAIApi`); one completion's
life is an :class:`~sfnode.head.api.exchange.Exchange`, every body is built by
:mod:`sfnode.head.api.bodies`, and the error answers come from :mod:`sfnode.head.api.failures`.

This module must never load model weights (only a tokenizer), never block the reactor, never use
the global reactor or prometheus_client's global registry, never read the fleet's internals (only
:class:`~sfnode.head.fleet.backend.Backend`), and never answer in any shape but OpenAI's (or, on
their routes, Anthropic's and Ollama's).
"""

from __future__ import annotations

import hmac
import random
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from sfnode.head.api import bodies, failures
from sfnode.head.api.console import ConsoleTree
from sfnode.head.api.embeddings_exchange import EmbeddingsExchange
from sfnode.head.api.exchange import (
    INLINE_BODY_BYTES,
    Exchange,
    Prepared,
    answer,
    answer_error,
)
from sfnode.head.api.gate import (
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
from sfnode.head.api.grammars import DEFAULT_GRAMMAR_TIMEOUT_S, GrammarChecks
from sfnode.head.api.messages import anthropic_error
from sfnode.head.api.messages_exchange import MessagesExchange
from sfnode.head.api.metrics import EXPOSITION_CONTENT_TYPE, HeadMetrics
from sfnode.head.api.ollama import ollama_error
from sfnode.head.api.ollama_exchange import ROUTES as OLLAMA_ROUTES
from sfnode.head.api.ollama_exchange import Serve
from sfnode.head.api.request_class import ClassRule
from sfnode.head.api.responses import ResponseStore
from sfnode.head.api.responses_exchange import ResponsesExchange, answer_stored, delete_stored
from sfnode.head.api.resume import Exchanges
from sfnode.head.api.schema import CompletionRequest, model_not_found, parse_body, parse_request
from sfnode.head.api.workers import Workers
from sfnode.head.console.record import ConsoleRecord
from sfnode.head.console.state import Console
from sfnode.head.fleet.backend import Backend, BackendStatus, GenerationHandle
from sfnode.head.fleet.events import EventJournal
from sfnode.head.models.floors import AnswerFloors
from sfnode.head.models.registry import ModelRegistry, ServedModel
from sfnode.head.models.text import (
    DEFAULT_TEMPLATE_TIMEOUT_S,
    Detokenizer,
    RenderBudget,
    Renderer,
    StopText,
)
from sfnode.runtime.http_guard import HttpError

DRAIN_CANCEL_GRACE_S = 5.0
"""After the drain timeout cancels what still runs: how long the drain waits for those
generations to end before it gives up on them (the fleet's links are closed next)."""

_log = Logger(namespace="sfnode.head.api.http")

__all__ = [
    "DRAIN_CANCEL_GRACE_S",
    "INLINE_BODY_BYTES",
    "Backend",
    "CompletionRequest",
    "Detokenizer",
    "GenerationHandle",
    "HeadMetrics",
    "HttpError",
    "OpenAIApi",
    "Renderer",
    "StopText",
    "Workers",
]


# --------------------------------------------------------------------------------------------
# Checked and rendered requests


def _random_seed() -> int:
    return random.SystemRandom().getrandbits(63)


def answered_hosts(limits: GateLimits, api_keys: Sequence[bytes]) -> frozenset[str]:
    """The ``Host`` names a request may carry beyond loopback's: ``--allowed-host``'s, or any
    when the API has a key and none is given (a page in a browser cannot send the key, so a
    DNS rebinding attack gains nothing)."""
    if api_keys and not limits.allowed_hosts:
        return frozenset({"*"})
    return limits.allowed_hosts


# --------------------------------------------------------------------------------------------
# The API


class OpenAIApi:
    """Everything the HTTP resources share: backend, renderer, model names, keys, limits,
    metrics, and the requests in flight."""

    _console_tree: ConsoleTree | None = None
    """The console's resources and feed, once the site is built with a console."""

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
        grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
        responses: ResponseStore | None = None,
        console: Console | None = None,
    ) -> None:
        self.reactor: IReactorTime = reactor
        self.backend = backend
        self.models = _registry(models, allow_special_tokens, model_name, tokenizer, vocab_size)
        """The models served, by name (sfnode.head.models.registry): what a request's
        ``model`` picks, and what nodes offer in HELLO_ACK_F."""
        self.template_timeout_s = template_timeout_s
        """How long one chat-template render (or one Responses translation) may take."""
        self.model_name = model_name
        """The model of a request that names none."""
        self.new_seed: Callable[[], int] = seed_source or _random_seed
        """The seed of a request that gives none (a fixed one would repeat the draws)."""
        self.api_keys = tuple(k for k in api_keys if k)
        """The bearer tokens a /v1 request may carry; none: the API is open."""
        self.limits = limits = limits if limits is not None else GateLimits()
        self.allowed_hosts = answered_hosts(limits, self.api_keys)
        self.concurrency = ConcurrencyLimits.of(limits)
        self.workers = workers if workers is not None else Workers(reactor)
        self.grammars = GrammarChecks(self.workers, grammar_timeout_s)
        """Each grammar's verdict, compiled on the workers (sfnode.head.api.grammars)."""
        self.class_rule = class_rule if class_rule is not None else ClassRule()
        """How a request that names no class (X-Request-Class) gets one
        (sfnode.head.api.request_class)."""
        self.responses = responses if responses is not None else ResponseStore()
        """Stored responses, for ``previous_response_id`` (in memory only)."""
        self.floors = AnswerFloors()
        """The shortest answer of each grammar per tokenizer (a smaller budget is a 400)."""
        self.exchanges: Exchanges[Exchange] = Exchanges(reactor, limits.resume_grace_s)
        """Completion requests in flight (what a drain waits for), and ended streams."""
        self.draining = False
        """True once :meth:`drain` started: new completion requests get 503."""
        self._site: GuardedSite | None = None
        self.metrics = metrics if metrics is not None else self._own_metrics()
        self.metrics.watch(self.responses.families)
        self._drain_waiters: list[Deferred[None]] = []
        self._drain_timer: IDelayedCall | None = None
        self.console = console
        """The operator's console over the fleet (``/console``; None: not served)."""
        self.record = console.record if console is not None else _own_record(reactor)

    def _own_metrics(self) -> HeadMetrics:
        return HeadMetrics(
            self.status,
            open_requests=lambda: len(self.exchanges),
            open_connections=lambda: len(self._site.connections) if self._site else 0,
            statuses=self.statuses,
        )

    @property
    def renderer(self) -> Renderer:
        """The renderer of the model a request that names none gets."""
        return self.default_model().renderer

    @property
    def vocab_size(self) -> int:
        """Prompt token ids of a request that names no model must be below this."""
        return self.default_model().vocab_size

    def default_model(self) -> ServedModel:
        """The model of a request that names none: ``model_name``, else the first served."""
        model = self.models.get(self.model_name)
        if model is None:
            names = self.models.names()
            if not names:
                raise HttpError(
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
        """Stop the worker threads and give up the streams kept for a resume (the HTTP
        service does this when it stops)."""
        self.workers.stop()
        if self._console_tree is not None:
            self._console_tree.feed.stop()
        for exchange in list(self.exchanges):
            exchange.stream.expire()
        self.exchanges.clear_ended()

    # The front door

    def authorized(self, request: Any) -> bytes | None:
        """The API key ``request`` carries (``b""`` when the API is open), or None."""
        if not self.api_keys:
            return b""
        header = request.getHeader(b"authorization") or b""
        scheme, _, given = header.partition(b" ")
        given = given.strip() if scheme.lower() == b"bearer" else b""
        if not header:
            # Anthropic's clients send the key as X-Api-Key.
            given = (request.getHeader(b"x-api-key") or b"").strip()
        return self.matching_key(given)

    def matching_key(self, given: bytes) -> bytes | None:
        """The API key ``given`` is (None: none of the head's)."""
        # compare_digest's time never depends on where the given bytes first differ from a
        # key (at most on their lengths); every key is compared, whichever matches.
        found = None
        for key in self.api_keys:
            if hmac.compare_digest(given, key):
                found = key
        return found

    def screen(self, request: GuardedRequest, length: int | None) -> HttpError | None:
        """The refusal of a request whose headers are in, or None (:meth:`_screen`), in the
        error shape of the API the request's route serves."""
        error = self._screen(request, length)
        assert request.resolved is not None
        shape = getattr(request.resolved.resource, "error_shape", None)
        return shape(error) if error is not None and shape is not None else error

    def _screen(self, request: GuardedRequest, length: int | None) -> HttpError | None:
        """The refusal of a request whose headers are in, or None (see :mod:`gate`).

        It reads the route the front door resolved (``request.resolved``, what will serve the
        request), never the raw path: Host, then the API key for keyed routes, then the body
        rules (only a POST to a completion route reads one; any other request that declares
        a body is answered now), then for completions the JSON media type and the limits."""
        if not host_allowed(request.getHeader(b"host"), self.allowed_hosts):
            return HttpError(
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
                return HttpError(
                    415,
                    "the request body must be JSON, sent with 'Content-Type: application/json'",
                    code="unsupported_media_type",
                    outcome="unsupported_media_type",
                )
            if self.draining:
                return failures.draining()
            client = client_address(request.getClientAddress())  # type: ignore[no-untyped-call]
            try:
                permit = self.concurrency.acquire(client, key or None, now=self.reactor.seconds())
            except HttpError as e:
                if e.status == 429:
                    self.record.refused(("key", key) if key else ("address", client))
                return e
            request.permit = permit
            request.notifyFinish().addBoth(lambda _: permit.release())
        return None

    def unexpected(self, failure: Failure, request: Any = None) -> HttpError:
        """An exception nobody expected: logged once, counted, answered as a JSON 500."""
        _log.failure(
            "answering {method} {path} failed unexpectedly",
            failure,
            method=getattr(request, "method", b"?").decode("latin-1"),
            path=getattr(request, "path", b"?")[:200].decode("latin-1"),
        )
        self.metrics.requests.labels("error").inc()
        return failures.internal_error()

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
            # A draining head takes no request, so nobody can resume a stream whose client
            # is away: it is given up now rather than held until the timeout.
            for exchange in list(self.exchanges):
                exchange.stream.expire()
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

    def exchange_began(self, exchange: Exchange) -> None:
        self.exchanges.add(exchange)

    def exchange_ended(self, exchange: Exchange) -> None:
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
        data: bytes | dict[str, Any],
        chat: bool,
        statuses: Mapping[str, BackendStatus],
        budget: RenderBudget | None = None,
    ) -> Prepared:
        """Check a body and render its prompt for the model it names (on the reactor or a
        worker thread: it reads only ``statuses``, a snapshot per model, and the renderers);
        ``data``: the body's bytes, or the body already parsed (a translated Responses
        request); ``budget`` bounds the chat template's render.  The request's grammar is not
        compiled here: :meth:`grammar_checked` does it.

        :raises HttpError: anything wrong with the request, an unknown model (404
            ``model_not_found``) and a prompt that cannot fit included.
        """
        body = parse_body(data) if isinstance(data, bytes) else data
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
        if status is not None and status.embedding_nodes and not status.serving_nodes:
            raise failures.embeds_only(model.name)
        if request.chat and not renderer.has_chat_template:
            raise failures.no_chat_template(model.name)
        limit = status.context_limit if status is not None else None
        if limit is not None and request.characters > renderer.character_bound(limit):
            # Not tokenized at all: no window can hold this many characters.
            raise failures.too_many_characters(request.characters, limit, request.prompt_param)
        if request.chat:
            # What the window cannot hold is not rendered at all (stopped while it renders).
            cap = renderer.character_bound(limit) if limit is not None else None
            prompt = renderer.chat(request.messages, budget, request.tools, cap)
        elif request.prompt_text is not None:
            prompt = renderer.completion(request.prompt_text)
        else:
            prompt = list(request.prompt_ids)
        if not prompt:
            raise HttpError(400, "the prompt has no tokens", param=request.prompt_param)
        if limit is not None and len(prompt) > limit:
            raise failures.too_long(len(prompt), limit, request.prompt_param)
        return Prepared(request, prompt, model)

    def grammar_checked(self, prepared: Prepared, client: Hashable = "") -> Deferred[Prepared]:
        """``prepared`` once the grammar library can enforce its grammar (compiled on the
        workers in ``client``'s turn, once per grammar); fails with the 400 that refuses it."""
        constraint = prepared.request.constraint
        if constraint is None or constraint.grammar is None:
            return defer.succeed(prepared)
        return self.grammars.check(constraint.grammar, client).addCallback(lambda _: prepared)

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
        :class:`~sfnode.head.api.gate.Route`; everything under ``/v1`` needs the API key, and
        ``/metrics`` too unless ``--metrics-public``)."""
        root = _Branch()
        v1 = _Branch(keyed=True)
        chat = _Branch()
        root.putChild(b"v1", v1)
        v1.putChild(b"chat", chat)
        chat.putChild(b"completions", _Completions(self, chat=True))
        v1.putChild(b"completions", _Completions(self, chat=False))
        v1.putChild(b"models", _Models(self))
        v1.putChild(b"responses", _Responses(self))
        v1.putChild(b"messages", _Messages(self))
        v1.putChild(b"embeddings", _Embeddings(self))
        ollama = _Branch(keyed=True)
        root.putChild(b"api", ollama)
        for name, (route, serve) in OLLAMA_ROUTES.items():
            ollama.putChild(name, _Ollama(self, route, serve))
        root.putChild(b"healthz", _Health(self))
        root.putChild(b"metrics", _Metrics(self, keyed=not self.limits.metrics_public))
        if self.console is not None:
            self._console_tree = ConsoleTree(self, self.console, self.reactor)
            root.putChild(b"console", self._console_tree.root)
        return root


def _own_record(reactor: IReactorTime) -> ConsoleRecord:
    """What an API without a console records of first tokens, 429s and resumed streams
    (sfnode.head.console.record): the same, read by nobody."""
    return ConsoleRecord(EventJournal(reactor.seconds), reactor.seconds)


def _allowed(route: Route) -> tuple[bytes, ...]:
    """The methods a route answers: its own, and HEAD where it serves GET."""
    return (*route.methods, b"HEAD") if b"GET" in route.methods else route.methods


def _unauthorized(request: Any) -> HttpError:
    missing = not request.getHeader(b"authorization") and not request.getHeader(b"x-api-key")
    return HttpError(
        401,
        "You didn't provide an API key: send it as 'Authorization: Bearer KEY' (or "
        "'X-Api-Key: KEY')."
        if missing
        else "Incorrect API key provided.",
        code="invalid_api_key",
        outcome="unauthorized",
        headers={b"www-authenticate": b"Bearer"},
    )


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
            shape = getattr(self, "error_shape", None)
            return answer_error(request, error if shape is None else shape(error))
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


class _ApiLeaf(_Leaf):
    """A :class:`_Leaf` that answers from the API that owns it."""

    def __init__(self, api: OpenAIApi) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.api = api


class _Health(_ApiLeaf):
    def render_GET(self, request: Any) -> bytes:
        api = self.api
        if request.args.get(b"probe") == [b"live"]:
            return answer(request, 200, bodies.ALIVE)
        status = api.status()
        if api.draining:
            state, code = "draining", 503
        elif not status.live_nodes:
            state, code = "unavailable", 503
        else:
            state, code = ("busy" if status.busy else "ok"), 200
        body = bodies.health(
            state,
            nodes=status.live_nodes,
            lanes_active=status.lanes_active,
            lanes_total=status.lanes_total,
            queued=status.queued,
            requests=len(api.exchanges),
        )
        return answer(request, code, body)


class _Metrics(_ApiLeaf):
    def __init__(self, api: OpenAIApi, *, keyed: bool) -> None:
        super().__init__(api)
        self.route = Route(methods=(b"GET",), keyed=keyed)

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", EXPOSITION_CONTENT_TYPE.encode())
        return self.api.metrics.exposition()


class _Models(_ApiLeaf):
    """``/v1/models`` (the list) and ``/v1/models/{id}`` (one, or 404)."""

    route = Route(methods=(b"GET",), suffix=True)

    def _entry(self, name: str) -> dict[str, Any]:
        status = self.api.status(name)
        if status.embedding_nodes and not status.serving_nodes:
            return bodies.model_entry(name, status.window, status.embedding_nodes, embeds=True)
        return bodies.model_entry(name, status.window, status.serving_nodes)

    def render_GET(self, request: Any) -> bytes:
        wanted = b"/".join(request.postpath).strip(b"/").decode("utf-8", "replace")
        names = self.api.models.names()
        if not wanted:
            return answer(request, 200, bodies.model_list([self._entry(n) for n in names]))
        if wanted in names:
            return answer(request, 200, self._entry(wanted))
        error = model_not_found(wanted)
        request.site.count(error.outcome)
        return answer_error(request, error)


class _Responses(_ApiLeaf):
    """``POST /v1/responses``; ``/v1/responses/{id}`` is a :class:`_StoredResponse`."""

    isLeaf = False
    route = Route(methods=(b"POST",), completion=True)

    def getChild(self, path: bytes, request: Any) -> Resource:
        return _StoredResponse(self.api, path.decode("utf-8", "replace"))

    def render_POST(self, request: Any) -> int:
        ResponsesExchange(self.api, request).start()
        return NOT_DONE_YET


class _StoredResponse(_ApiLeaf):
    """``GET`` and ``DELETE /v1/responses/{id}``: the requester's stored response."""

    route = Route(methods=(b"GET", b"DELETE"))

    def __init__(self, api: OpenAIApi, ident: str) -> None:
        super().__init__(api)
        self.ident = ident

    def render(self, request: Any) -> bytes | int:
        if request.method in (b"GET", b"HEAD"):  # twisted.web writes no body for HEAD
            answer_stored(self.api, request, self.ident)
            return NOT_DONE_YET
        return super().render(request)

    def render_DELETE(self, request: Any) -> bytes:
        return delete_stored(self.api, request, self.ident)


class _Embeddings(_ApiLeaf):
    route = Route(methods=(b"POST",), completion=True)

    def render_POST(self, request: Any) -> int:
        EmbeddingsExchange(self.api, request).start()
        return NOT_DONE_YET


class _Messages(_ApiLeaf):
    route = Route(methods=(b"POST",), completion=True)
    error_shape = staticmethod(anthropic_error)
    """The front door's refusals here are in Anthropic's shape."""

    def render_POST(self, request: Any) -> int:
        MessagesExchange(self.api, request).start()
        return NOT_DONE_YET


class _Ollama(_ApiLeaf):
    """One route of Ollama's API (``/api/{name}``: :data:`sfnode.head.api.ollama_exchange.ROUTES`),
    every error in Ollama's shape."""

    error_shape = staticmethod(ollama_error)

    def __init__(self, api: OpenAIApi, route: Route, serve: Serve) -> None:
        super().__init__(api)
        self.route = route
        self.serve = serve

    def render_GET(self, request: Any) -> Any:
        return self.serve(self.api, request)

    def render_POST(self, request: Any) -> Any:
        return self.serve(self.api, request)


class _Completions(_ApiLeaf):
    route = Route(methods=(b"POST",), completion=True)

    def __init__(self, api: OpenAIApi, *, chat: bool) -> None:
        super().__init__(api)
        self.chat = chat

    def render_POST(self, request: Any) -> int:
        Exchange(self.api, request, self.chat).start()
        return NOT_DONE_YET


def _registry(
    models: ModelRegistry | None,
    allow_special_tokens: bool,
    model_name: str,
    tokenizer: Any,
    vocab_size: int | None,
) -> ModelRegistry:
    """``models`` (a new registry if None), serving ``model_name`` with the head's own
    ``tokenizer`` when one is given."""
    if models is None:
        models = ModelRegistry(allow_special_tokens=allow_special_tokens)
    if tokenizer is not None:
        origin = "the head's tokenizer"
        models.serve(model_name, tokenizer, origin=origin, vocab_size=vocab_size, override=True)
    return models
