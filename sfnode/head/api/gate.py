"""The head's HTTP front door: what is checked before a request body is read, and the clocks that
keep slow or hostile clients from holding the head.  It is built on the guards every sfnode
listener shares (``sfnode.runtime.http_guard``: the header deadline, refusals that read nothing
more, the connection cap), with the head's own checks and its errors in OpenAI's shape.

- :func:`resolve` decides what a request is, once: it decodes and walks the path exactly as
  twisted.web's router does, and the site then serves the resource found there
  (:meth:`GuardedSite.getResourceFor`), so the checks and the answer can never see two
  different requests.  A path that is not in canonical form (not starting with ``/``, an empty,
  ``.`` or ``..`` segment once decoded, a suffix after a resource that takes none) is a 404 before
  anything else.  Each resource declares its :class:`Route`: the methods it serves, whether a
  POST to it produces a completion, whether it takes a suffix, whether it needs the API key.
- :class:`GuardedChannel` asks the API's ``screen`` about every request as soon as its headers
  are complete (Host, API key, Content-Length against ``--max-body``, Content-Type, the
  per-client and per-key limits).  Only a POST to a completion route reads a body: any other
  request that declares one (``/healthz``, ``/metrics``, any GET, unknown paths, a wrong
  method) is answered from its headers (404, 405 or 400).  A refusal is answered at once in
  OpenAI's JSON shape with ``Connection: close``; the body is never read (what the client
  already sent is discarded, and the connection is aborted after :data:`LINGER_BYTES` or
  :data:`LINGER_S`).  The headers must arrive within ``header_timeout_s`` of their first byte
  and the body within ``body_timeout_s`` of the headers, whatever the pace of the bytes (408
  otherwise).
- :class:`GuardedRequest` keeps the body in memory and stops at the body limit while a chunked
  body streams in (413); it never spills to a temporary file.  An unexpected exception while
  rendering is a JSON 500 (counted and logged once), never Twisted's HTML page, and every answer
  says ``Server: sfhead``.
- :class:`GuardedSite` caps the open connections, in total (``max_connections``: one more is
  answered 503 and closed) and per client address (``max_client_connections``: 429).
- :func:`host_allowed`, :func:`canonical_segments` and :class:`ConcurrencyLimits` are the pure
  parts.

This module must never read a body it refused, never write a request to disk, never echo
unbounded input, and never use the global reactor (the site's reactor runs the clocks).
"""

from __future__ import annotations

import ipaddress
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any
from urllib.parse import unquote_to_bytes

from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import Request

from sfnode.head.api.keys import DEFAULT_POLICY, KeyPolicy, TokenMeter
from sfnode.head.api.resume import DEFAULT_RESUME_GRACE_S
from sfnode.runtime.http_guard import (
    IDLE_TIMEOUT_S,
    LINGER_BYTES,
    LINGER_S,
    CappedSite,
    HttpError,
    http_date,
)
from sfnode.runtime.http_guard import (
    GuardedChannel as SharedChannel,
)
from sfnode.runtime.http_guard import raw_response as _raw_response

SERVER = b"sfhead"

_log = Logger(namespace="sfnode.head.api.gate")


@dataclass(frozen=True)
class GateLimits:
    """The front door's settings (``twistd sfhead`` options of the same names)."""

    max_body: int = 4 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    stall_timeout_s: float = 30.0
    """A client that reads nothing of its answer for this long is cut off and its generations
    are cancelled: a reader that stopped must not hold lanes."""
    resume_grace_s: float = DEFAULT_RESUME_GRACE_S
    """How long a stream whose client dropped mid-stream waits for it to resume with
    ``Last-Event-ID`` (0: it is cancelled at once)."""
    max_connections: int = 1024
    max_client_connections: int = 64
    """Open connections per client address (0: no limit besides ``max_connections``)."""
    max_client_requests: int = 64
    """Generations open at once per client address, a request with ``n`` choices counting
    ``n`` (0: no limit)."""
    max_key_requests: int = 0
    """Generations open at once per API key, counted the same way (0: no limit)."""
    keys: Mapping[bytes, KeyPolicy] = field(default_factory=dict)
    """Each API key's own share and caps, from the key file (docs/api.md "API keys")."""
    metrics_public: bool = False
    """``/metrics`` answers without the API key (when one is set)."""
    allowed_hosts: frozenset[str] = frozenset()
    """Host names answered besides IP addresses and ``localhost``; ``*`` is any."""
    cors_origins: frozenset[str] = frozenset()
    """Origins given CORS headers (``*`` is any); empty: no CORS."""


# --------------------------------------------------------------------------------------------
# Routes: what a request is, decided once


@dataclass(frozen=True)
class Route:
    """What the front door must know of a resource before it reads a body."""

    methods: tuple[bytes, ...] = ()
    """The methods it serves (HEAD goes with GET, OPTIONS with CORS); none: a 404."""
    completion: bool = False
    """A POST here produces a completion: the only requests whose body is read, and only
    after the API key, ``Content-Type: application/json`` and the limits."""
    suffix: bool = False
    """It takes further path segments (``/v1/models/{id}``); any other resource is a 404
    when the path goes on after it."""
    keyed: bool = False
    """It and everything under it need the API key (when one is set)."""


CORS_METHODS = b"GET, POST, DELETE, OPTIONS"
"""What an allowed origin's preflight may ask for (``DELETE``: ``/v1/responses/{id}``)."""
CORS_HEADERS = (
    b"Authorization, Content-Type, X-Request-Class, X-Api-Key, anthropic-version, "
    b"anthropic-beta, anthropic-dangerous-direct-browser-access"
)
"""The request headers an allowed origin may send: the key either way (bearer or
``X-Api-Key``), the request class, and the headers Anthropic's clients send
(docs/operating.md)."""

NOT_FOUND = Route()
"""The route of a path that reaches nothing (a resource that serves no method)."""


def route_of(resource: object) -> Route:
    """The :class:`Route` a resource declares (one that declares none is served by nothing:
    a 404, so a resource added without thinking of the front door cannot be reached)."""
    route = getattr(resource, "route", None)
    return route if isinstance(route, Route) else NOT_FOUND


def canonical_segments(path: bytes) -> list[bytes] | None:
    """The decoded segments twisted.web routes ``path`` by (``Request.process``:
    ``unquote(segment)`` for each ``/``-separated segment after the first character), or None
    when the path is not in canonical form: it does not start with ``/``, or a decoded segment
    is empty, ``.``, ``..`` or holds a ``/`` (``%2F``).  A canonical path routes the same
    whether or not it is percent-decoded again, and no proxy or client normalises it into
    another route."""
    if not path.startswith(b"/"):
        return None
    segments = [unquote_to_bytes(s) for s in path[1:].split(b"/")]
    for segment in segments:
        if segment in (b"", b".", b"..") or b"/" in segment:
            return None
    return segments


@dataclass(frozen=True)
class Resolved:
    """Where the router sends a request: the resource that answers it (the not-found one
    for a path that reaches no route), its :class:`Route`, whether the API key is needed, and
    twisted.web's ``prepath``/``postpath`` after the walk (what the resource reads)."""

    resource: Resource
    route: Route
    keyed: bool
    canonical: bool
    prepath: tuple[bytes, ...] = ()
    postpath: tuple[bytes, ...] = ()

    @property
    def found(self) -> bool:
        """A resource that serves something (one that serves no method is a 404)."""
        return bool(self.route.methods)


def resolve(root: Resource, path: bytes, request: object, not_found: Resource) -> Resolved:
    """Walk ``root`` with ``path`` as twisted.web does (``getChildForRequest``), on the same
    decoded segments.  A non-canonical path, a path that reaches no route and a suffix after
    a resource that takes none resolve to ``not_found``.  ``keyed``: a resource on the way
    needs the API key."""
    segments = canonical_segments(path)
    if segments is None:
        return Resolved(not_found, NOT_FOUND, False, canonical=False)
    resource: Resource = root
    keyed = route_of(root).keyed
    prepath: list[bytes] = []
    postpath = list(segments)
    while postpath and not resource.isLeaf:
        segment = postpath.pop(0)
        prepath.append(segment)
        resource = resource.getChildWithDefault(segment, request)  # type: ignore[no-untyped-call]
        keyed = keyed or route_of(resource).keyed
    route = route_of(resource)
    if not route.methods or (postpath and not route.suffix):
        return Resolved(not_found, NOT_FOUND, keyed, True, tuple(prepath), tuple(postpath))
    return Resolved(resource, route, keyed, True, tuple(prepath), tuple(postpath))


def unknown_url(method: bytes, path: bytes) -> HttpError:
    return HttpError(
        404,
        f"Unknown request URL: {method.decode('latin-1')[:16]} {path[:100].decode('latin-1')}",
        code="unknown_url",
        outcome="not_found",
    )


def method_not_allowed(method: bytes, path: bytes, route: Route) -> HttpError:
    return HttpError(
        405,
        f"{method.decode('latin-1')[:16]} is not allowed on {path[:100].decode('latin-1')}; use "
        + ", ".join(m.decode() for m in route.methods),
        code="method_not_allowed",
        outcome="bad_request",
        headers={b"allow": b", ".join(route.methods)},
    )


def no_body_here(method: bytes, path: bytes) -> HttpError:
    return HttpError(
        400,
        f"{method.decode('latin-1')[:16]} {path[:100].decode('latin-1')} takes no request body",
        code="unexpected_body",
    )


# --------------------------------------------------------------------------------------------
# Pure checks


def host_allowed(host: bytes | None, allowed: Iterable[str]) -> bool:
    """Whether a request's ``Host`` header may be answered.

    IP literals and ``localhost`` always may (a page can only send them from its own origin,
    which DNS rebinding cannot fake); other names only when listed, or when ``*`` is.
    A request without ``Host`` (HTTP/1.0) is answered: browsers always send one.
    """
    if host is None:
        return True
    try:
        text = host.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return False
    if text.startswith("["):  # [v6]:port
        if "]" not in text:
            return False
        name = text[1 : text.find("]")]
    else:
        name = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
    name = name.rstrip(".")
    names = {a.lower().rstrip(".") for a in allowed}
    if "*" in names or name == "localhost" or name in names:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Permit:
    """One request's generations in :class:`ConcurrencyLimits`: :meth:`widen` counts more of
    them, :meth:`release` gives them all back (once)."""

    def __init__(self, limits: ConcurrencyLimits, client: str, key: bytes | None, count: int):
        self._limits: ConcurrencyLimits | None = limits
        self.client = client
        self.key = key
        self.count = count
        self.policy = limits.policy(key)
        """The key's share and caps (the defaults without a key)."""
        self._meter = limits.meter

    def spend(self, tokens: int, now: float) -> None:
        """The request spent ``tokens`` (its prompt, or generated tokens) of its key's
        tokens per minute."""
        self._meter.spend(self.key, tokens, now)

    def widen(self, extra: int) -> None:
        """Count ``extra`` more generations of the same request (its ``n`` choices).

        :raises HttpError: 429 when a limit would be passed (nothing is taken), or 400 when the
            request alone is larger than a limit (it could never run).
        """
        limits = self._limits
        if limits is None or extra <= 0:
            return
        total = self.count + extra
        per_key = limits.key_limit(self.key)
        for limit, what in ((limits.per_client, "client address"), (per_key, "API key")):
            if limit and total > limit and (what == "client address" or self.key is not None):
                raise HttpError(
                    400,
                    f"n is {total}, more than the {limit} generations one {what} may have open "
                    "at once on this server",
                    param="n",
                    code="invalid_value",
                    outcome="bad_request",
                )
        limits._take(self.client, self.key, extra)
        self.count = total

    def release(self) -> None:
        limits, self._limits = self._limits, None
        if limits is not None:
            limits._give_back(self.client, self.key, self.count)


class ConcurrencyLimits:
    """Generations open at once, per client address and per API key (a request with ``n``
    choices counts ``n``: it runs ``n`` generations)."""

    def __init__(
        self, per_client: int, per_key: int, policies: Mapping[bytes, KeyPolicy] | None = None
    ) -> None:
        self.per_client = per_client
        self.per_key = per_key
        self.policies: Mapping[bytes, KeyPolicy] = policies or {}
        """Each key's own caps (its ``concurrency`` replaces ``per_key``)."""
        self.meter = TokenMeter(self.policies)
        """Each key's tokens per minute."""
        self.clients: Counter[str] = Counter()
        self.keys: Counter[bytes] = Counter()

    @classmethod
    def of(cls, limits: GateLimits) -> ConcurrencyLimits:
        """The limits ``limits`` set: per client address, per key, each key's own."""
        return cls(limits.max_client_requests, limits.max_key_requests, limits.keys)

    def policy(self, key: bytes | None) -> KeyPolicy:
        return self.policies.get(key, DEFAULT_POLICY) if key is not None else DEFAULT_POLICY

    def key_limit(self, key: bytes | None) -> int:
        """Generations ``key`` may have open at once (0: no limit)."""
        return self.policy(key).concurrency or self.per_key

    def acquire(
        self, client: str, key: bytes | None, count: int = 1, now: float = 0.0
    ) -> Permit:
        """A permit for ``count`` more generations of ``client`` (and ``key``).

        :raises HttpError: 429 when either limit would be passed, or the key spent its
            tokens per minute (with ``Retry-After`` the seconds until it may go on).
        """
        wait_s = self.meter.wait_s(key, now)
        if wait_s > 0:
            raise rate_limited(
                "Too many tokens: this API key spent its tokens per minute (its key file's "
                "tokens-per-minute); retry after the seconds Retry-After says.",
                "rate_limit_exceeded",
                retry_after_s=wait_s,
            )
        self._take(client, key, count)
        return Permit(self, client, key, count)

    def _take(self, client: str, key: bytes | None, count: int) -> None:
        if self.per_client and self.clients[client] + count > self.per_client:
            raise _too_many(f"this client address has {self.clients[client]} generations open "
                            f"(at most {self.per_client})")  # fmt: skip
        per_key = self.key_limit(key)
        if key is not None and per_key and self.keys[key] + count > per_key:
            raise _too_many(f"this API key has {self.keys[key]} generations open "
                            f"(at most {per_key})")  # fmt: skip
        self.clients[client] += count
        if key is not None:
            self.keys[key] += count

    def _give_back(self, client: str, key: bytes | None, count: int) -> None:
        self.clients[client] -= count
        if self.clients[client] <= 0:
            del self.clients[client]
        if key is not None:
            self.keys[key] -= count
            if self.keys[key] <= 0:
                del self.keys[key]


def _too_many(why: str) -> HttpError:
    return rate_limited(
        f"Too many concurrent requests: {why}, a request with n choices counting n; retry "
        "when one of them has ended.",
        "rate_limit_exceeded",
    )


def rate_limited(message: str, code: str, retry_after_s: float = 1.0) -> HttpError:
    """A 429 (counted ``rate_limited``) that asks the client to retry in ``retry_after_s``
    seconds (rounded up to whole seconds, at least 1)."""
    seconds = max(1, math.ceil(retry_after_s))
    return HttpError(
        429,
        message,
        kind="requests",
        code=code,
        outcome="rate_limited",
        headers={b"retry-after": b"%d" % seconds},
    )


# --------------------------------------------------------------------------------------------
# Responses written outside twisted.web's request machinery


def raw_response(
    error: HttpError, date: bytes, extra: Mapping[bytes, bytes] | None = None
) -> bytes:
    """A complete HTTP/1.1 response for ``error`` that closes the connection."""
    return _raw_response(error, date, SERVER, extra)


def _date(clock: IReactorTime) -> bytes:
    return http_date(clock)


def body_too_large(limit: int) -> HttpError:
    return HttpError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes (--max-body)",
        code="request_too_large",
        outcome="too_large",
    )


# --------------------------------------------------------------------------------------------
# twisted.web pieces


class GuardedRequest(Request):
    """A request whose body stays in memory, bounded; JSON for unexpected failures."""

    site: GuardedSite
    permit: Permit | None = None
    """Its place in the per-client/per-key limits (released when it finishes or is lost)."""
    resolved: Resolved | None = None
    """What the front door decided this request is (:func:`resolve`); the site serves it."""
    _body_bytes = 0

    def gotLength(self, length: int | None) -> None:
        # Twisted spills bodies of 100 kB and more (or of unknown length) to a temporary file;
        # bodies here are bounded by --max-body, so memory is the right place.
        self.content = BytesIO()

    def handleContentChunk(self, data: bytes) -> None:
        channel: GuardedChannel | None = self.channel  # type: ignore[assignment]
        if channel is None or channel.refused:
            return
        self._body_bytes += len(data)
        limit = channel.site.limits.max_body
        if self._body_bytes > limit:
            channel.refuse(body_too_large(limit))
            return
        assert self.content is not None
        self.content.write(data)

    def render(self, resrc: Any) -> None:
        self.setHeader(b"server", SERVER)  # type: ignore[no-untyped-call]
        self.site.add_cors_headers(self)
        super().render(resrc)  # type: ignore[no-untyped-call]

    def processingFailed(self, reason: Failure) -> Failure:
        error = self.site.unexpected(reason, self)
        request: Any = self  # twisted.web's Request is not annotated
        if request.finished or request._disconnected:
            return reason
        if request.startedWriting:
            # The status line is out: all that is left is to end the answer visibly.
            request.loseConnection()
            return reason
        body = error.encoded()
        request.setResponseCode(error.status)
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"content-length", b"%d" % len(body))
        request.write(body)
        request.finish()
        return reason


class GuardedChannel(SharedChannel):
    """The shared channel (header deadline, refusals) that also screens each request at the
    end of its headers and runs the body deadline."""

    site: GuardedSite
    client = ""
    """The peer's address (what ``max_client_connections`` counts)."""

    def connectionMade(self) -> None:
        super().connectionMade()
        self.client = client_address(self.transport.getPeer() if self.transport else None)
        self.site.client_connections[self.client] += 1

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        counts = self.site.client_connections
        if counts.get(self.client, 0) > 0:
            counts[self.client] -= 1
            if counts[self.client] <= 0:
                del counts[self.client]
        super().connectionLost(reason)

    def allHeadersReceived(self) -> None:
        self._cancel_deadline()
        request = self.requests[-1]
        # The request line is known here, but twisted.web sets these only once the body is
        # in; the screen needs them now.
        request.method = self._command
        request.uri = self._path
        request.path = self._path.split(b"?", 1)[0]
        request.site = self.site
        resolved = request.resolved = self.site.resolve(request)
        if not resolved.canonical:
            # Before anything else: a path that routes differently depending on who decodes
            # or normalises it is never served.
            self.refuse(unknown_url(request.method, request.path))
            return
        error = self.site.screen(request, self.length)
        if error is not None:
            self.refuse(error)
            return
        super().allHeadersReceived()
        if self.length != 0 and not self.refused:
            self._arm(self.site.limits.body_timeout_s, "body")

    def allContentReceived(self) -> None:
        if self.refused:
            return
        self._cancel_deadline()
        super().allContentReceived()  # type: ignore[no-untyped-call]


def client_address(address: object) -> str:
    """A peer's address as the per-client limits count it (its host; the kind of address for
    one without a host, such as a Unix socket)."""
    return str(getattr(address, "host", None) or type(address).__name__)


def too_many_client_connections(limit: int) -> HttpError:
    return rate_limited(
        f"this client address has {limit} connections open, the most this server allows one "
        "address; reuse them (keep-alive) or close some",
        "too_many_connections",
    )


class _ClientOverloaded(Protocol):
    """What a connection beyond its address's cap gets: a 429 and the end of the
    connection."""

    def __init__(self, site: GuardedSite) -> None:
        self.site = site

    def connectionMade(self) -> None:
        error = too_many_client_connections(self.site.limits.max_client_connections)
        self.site.count(error.outcome)
        assert self.transport is not None
        self.transport.write(raw_response(error, _date(self.site.reactor)))
        self.transport.loseConnection()


Screen = Callable[[GuardedRequest, "int | None"], "HttpError | None"]


@dataclass
class _Hooks:
    screen: Screen
    count: Callable[[str], None]
    unexpected: Callable[[Failure, GuardedRequest], HttpError]


class GuardedSite(CappedSite):
    """A twisted.web ``Site`` with the front door: screened requests, bounded bodies,
    deadlines, a connection cap, CORS only for configured origins.

    ``screen(request, content_length)`` returns the refusal of a request whose headers are in
    (or None); ``count(outcome)`` counts a refusal made here; ``unexpected(failure, request)``
    logs an unexpected exception once and returns the 500 to answer.
    """

    protocol = GuardedChannel
    requestFactory = GuardedRequest
    server = SERVER

    def __init__(
        self,
        resource: Resource,
        *,
        reactor: IReactorTime,
        limits: GateLimits,
        screen: Screen,
        count: Callable[[str], None],
        unexpected: Callable[[Failure, GuardedRequest], HttpError],
        not_found: Resource,
    ) -> None:
        super().__init__(
            resource,
            reactor=reactor,
            max_connections=limits.max_connections,
            header_timeout_s=limits.header_timeout_s,
        )
        self.limits = limits
        self.hooks = _Hooks(screen, count, unexpected)
        self.not_found = not_found
        """What answers a path that reaches no route (a JSON 404)."""
        self.client_connections: Counter[str] = Counter()
        """Open connections per client address."""

    def buildProtocol(self, addr: Any) -> Any:
        per_client = self.limits.max_client_connections
        if per_client and self.client_connections[client_address(addr)] >= per_client:
            return _ClientOverloaded(self)
        return super().buildProtocol(addr)

    def resolve(self, request: GuardedRequest) -> Resolved:
        """What ``request`` is (:func:`resolve` on this site's resource tree)."""
        return resolve(self.resource, request.path, request, self.not_found)

    def getResourceFor(self, request: Any) -> Any:
        """The resource the front door resolved for ``request`` (it never walks the tree a
        second time: the checks and the answer see one request)."""
        resolved = request.resolved
        if resolved is None:
            resolved = request.resolved = self.resolve(request)
        request.site = self
        request.sitepath = []
        request.prepath = list(resolved.prepath)
        request.postpath = list(resolved.postpath)
        return resolved.resource

    def screen(self, request: GuardedRequest, length: int | None) -> HttpError | None:
        return self.hooks.screen(request, length)

    def count(self, outcome: str) -> None:
        self.hooks.count(outcome)

    def unexpected(self, failure: Failure, request: GuardedRequest) -> HttpError:
        return self.hooks.unexpected(failure, request)

    def add_cors_headers(self, request: Any) -> None:
        """CORS headers for an allowed ``Origin`` (none unless ``cors_origins`` is set)."""
        origins = self.limits.cors_origins
        origin = request.getHeader(b"origin")
        if not origins or origin is None:
            return
        if "*" in origins:
            request.setHeader(b"access-control-allow-origin", b"*")
        elif origin.decode("latin-1") in origins:
            request.setHeader(b"access-control-allow-origin", origin)
            request.setHeader(b"vary", b"Origin")
        else:
            return
        if request.method == b"OPTIONS":
            request.setHeader(b"access-control-allow-methods", CORS_METHODS)
            request.setHeader(b"access-control-allow-headers", CORS_HEADERS)
            request.setHeader(b"access-control-max-age", b"600")

    def cors_allows(self, request: GuardedRequest) -> bool:
        """Whether ``request`` comes from an origin given CORS (a preflight may be answered)."""
        origins = self.limits.cors_origins
        origin = request.getHeader(b"origin")
        return (
            bool(origins)
            and origin is not None
            and ("*" in origins or origin.decode("latin-1") in origins)
        )


__all__ = [
    "CORS_HEADERS",
    "CORS_METHODS",
    "IDLE_TIMEOUT_S",
    "LINGER_BYTES",
    "LINGER_S",
    "NOT_FOUND",
    "SERVER",
    "ConcurrencyLimits",
    "GateLimits",
    "GuardedChannel",
    "GuardedRequest",
    "GuardedSite",
    "Permit",
    "Resolved",
    "Route",
    "body_too_large",
    "canonical_segments",
    "client_address",
    "host_allowed",
    "method_not_allowed",
    "no_body_here",
    "raw_response",
    "resolve",
    "route_of",
    "unknown_url",
]
