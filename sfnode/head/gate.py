"""The head's HTTP front door: what is checked before a request body is read, and the clocks that
keep slow or hostile clients from holding the head.

- :class:`GuardedChannel` asks the API's ``screen`` about every request as soon as its headers
  are complete (Host, API key, Content-Length against ``--max-body``, Content-Type, the
  per-client and per-key limits).  A refusal is answered at once in OpenAI's JSON shape with
  ``Connection: close``; the body is never read (what the client already sent is discarded, and
  the connection is aborted after :data:`LINGER_BYTES` or :data:`LINGER_S`).  The headers must
  arrive within ``header_timeout_s`` of their first byte and the body within
  ``body_timeout_s`` of the headers, whatever the pace of the bytes (408 otherwise).
- :class:`GuardedRequest` keeps the body in memory and stops at the body limit while a chunked
  body streams in (413); it never spills to a temporary file.  An unexpected exception while
  rendering is a JSON 500 (counted and logged once), never Twisted's HTML page, and every answer
  says ``Server: sfhead``.
- :class:`GuardedSite` caps the open connections (``max_connections``): one more is answered
  503 and closed.
- :func:`host_allowed` and :class:`ConcurrencyLimits` are the pure parts.

This module must never read a body it refused, never write a request to disk, never echo
unbounded input, and never use the global reactor (the site's reactor runs the clocks).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from io import BytesIO
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from sfnode.head.schema import ApiError

LINGER_BYTES = 256 * 1024
"""After a refusal: how much of the unread body is discarded before the connection is aborted
(enough for a normal client to finish sending and read the answer)."""
LINGER_S = 5.0
"""After a refusal: how long the connection may stay half-open before it is aborted."""
IDLE_TIMEOUT_S = 60.0
"""A keep-alive connection with no request in progress is closed after this long."""
SERVER = b"sfhead"

_log = Logger(namespace="sfnode.head.gate")


@dataclass(frozen=True)
class GateLimits:
    """The front door's settings (``twistd sfhead`` options of the same names)."""

    max_body: int = 4 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    stall_timeout_s: float = 30.0
    """A client that reads nothing of its answer for this long is cut off and its generations
    are cancelled: a reader that stopped must not hold lanes."""
    max_connections: int = 1024
    max_client_requests: int = 64
    """Completion requests open at once per client address (0: no limit)."""
    max_key_requests: int = 0
    """Completion requests open at once per API key (0: no limit)."""
    allowed_hosts: frozenset[str] = frozenset()
    """Host names answered besides IP addresses and ``localhost``; ``*`` is any."""
    cors_origins: frozenset[str] = frozenset()
    """Origins given CORS headers (``*`` is any); empty: no CORS."""


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
    """One request's place in :class:`ConcurrencyLimits`; :meth:`release` gives it back (once)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class ConcurrencyLimits:
    """Completion requests open at once, per client address and per API key."""

    def __init__(self, per_client: int, per_key: int) -> None:
        self.per_client = per_client
        self.per_key = per_key
        self.clients: Counter[str] = Counter()
        self.keys: Counter[bytes] = Counter()

    def acquire(self, client: str, key: bytes | None) -> Permit:
        """A permit for one more request of ``client`` (and ``key``).

        :raises ApiError: 429 when either limit is reached.
        """
        if self.per_client and self.clients[client] >= self.per_client:
            raise _too_many(f"this client address has {self.per_client} requests open")
        if key is not None and self.per_key and self.keys[key] >= self.per_key:
            raise _too_many(f"this API key has {self.per_key} requests open")
        self.clients[client] += 1
        if key is not None:
            self.keys[key] += 1

        def release() -> None:
            self.clients[client] -= 1
            if not self.clients[client]:
                del self.clients[client]
            if key is not None:
                self.keys[key] -= 1
                if not self.keys[key]:
                    del self.keys[key]

        return Permit(release)


def _too_many(why: str) -> ApiError:
    return ApiError(
        429,
        f"Too many concurrent requests: {why}; retry when one of them has ended.",
        kind="requests",
        code="rate_limit_exceeded",
        outcome="rate_limited",
        headers={b"retry-after": b"1"},
    )


# --------------------------------------------------------------------------------------------
# Responses written outside twisted.web's request machinery


def raw_response(error: ApiError, date: bytes, extra: Mapping[bytes, bytes] | None = None) -> bytes:
    """A complete HTTP/1.1 response for ``error`` that closes the connection."""
    body = error.encoded()
    reason = http.RESPONSES.get(error.status, b"Error")
    lines = [
        b"HTTP/1.1 %d %s" % (error.status, reason),
        b"Server: " + SERVER,
        b"Date: " + date,
        b"Content-Type: application/json",
        b"Content-Length: %d" % len(body),
        b"Connection: close",
    ]
    for name, value in {**error.headers, **(extra or {})}.items():
        lines.append(name + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _date(clock: IReactorTime) -> bytes:
    date: bytes = http.datetimeToString(clock.seconds())  # type: ignore[no-untyped-call]
    return date


def body_too_large(limit: int) -> ApiError:
    return ApiError(
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


class GuardedChannel(http.HTTPChannel):
    """An HTTP/1.1 channel that screens each request at the end of its headers and runs the
    header and body deadlines."""

    site: GuardedSite
    refused = False
    """A refusal was written: everything the client sends from now on is discarded."""
    _deadline: IDelayedCall | None = None
    _discarded = 0

    def connectionMade(self) -> None:
        super().connectionMade()  # type: ignore[no-untyped-call]
        self.site.connections.add(self)

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        self.site.connections.discard(self)
        self._cancel_deadline()
        super().connectionLost(reason)  # type: ignore[no-untyped-call]

    # Deadlines

    def _arm(self, seconds: float, what: str) -> None:
        self._cancel_deadline()
        self._deadline = self.site.reactor.callLater(seconds, self._timed_out, what, seconds)

    def _cancel_deadline(self) -> None:
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _timed_out(self, what: str, seconds: float) -> None:
        self._deadline = None
        self.refuse(
            ApiError(
                408,
                f"the request {what} did not arrive within {seconds:g} s",
                code="request_timeout",
                outcome="timeout",
            )
        )

    # Bytes in

    def dataReceived(self, data: bytes) -> None:
        if self.refused:
            self._discard(data)
            return
        if data and not self._handlingRequest and self._deadline is None:
            self._arm(self.site.limits.header_timeout_s, "headers")
        super().dataReceived(data)  # type: ignore[no-untyped-call]

    def lineReceived(self, line: bytes) -> None:
        if not self.refused:
            super().lineReceived(line)  # type: ignore[no-untyped-call]

    def rawDataReceived(self, data: bytes) -> None:
        if self.refused:
            self._discard(data)
            return
        super().rawDataReceived(data)

    def allHeadersReceived(self) -> None:
        self._cancel_deadline()
        request = self.requests[-1]
        # The request line is known here, but twisted.web sets these only once the body is
        # in; the screen needs them now.
        request.method = self._command
        request.uri = self._path
        request.path = self._path.split(b"?", 1)[0]
        request.site = self.site
        error = self.site.screen(request, self.length)
        if error is not None:
            self.refuse(error)
            return
        super().allHeadersReceived()  # type: ignore[no-untyped-call]
        if self.length != 0 and not self.refused:
            self._arm(self.site.limits.body_timeout_s, "body")

    def allContentReceived(self) -> None:
        if self.refused:
            return
        self._cancel_deadline()
        super().allContentReceived()  # type: ignore[no-untyped-call]

    # Refusals

    def _respondToBadRequestAndDisconnect(self) -> None:
        # twisted.web's answer to a malformed request line, header or chunk is a bare
        # "400 Bad Request"; ours is OpenAI's JSON like every other error.
        self.refuse(
            ApiError(
                400,
                "malformed HTTP request (request line, headers or chunked body)",
                code="bad_http_request",
            )
        )

    def lineLengthExceeded(self, line: bytes) -> None:
        # LineReceiver would close the connection without a word.
        self.refuse(
            ApiError(
                400,
                f"a request line or header is longer than {self.MAX_LENGTH} bytes",
                code="bad_http_request",
            )
        )

    def refuse(self, error: ApiError) -> None:
        """Answer ``error`` now, read nothing more of this connection, and close it."""
        if self.refused:
            return
        self.refused = True
        self._cancel_deadline()
        self.setTimeout(None)  # type: ignore[no-untyped-call]
        self.site.count(error.outcome)
        transport = self.transport
        assert transport is not None
        transport.write(raw_response(error, _date(self.site.reactor)))
        # Half-close: the client reads the answer and its end of the stream, while whatever
        # it still sends is discarded (a full close now would reset the connection and could
        # destroy the answer before the client reads it).
        lose_write = getattr(transport, "loseWriteConnection", None)
        if lose_write is not None:
            lose_write()
        else:
            transport.loseConnection()
        self._deadline = self.site.reactor.callLater(LINGER_S, self._abort)

    def _discard(self, data: bytes) -> None:
        self._discarded += len(data)
        if self._discarded > LINGER_BYTES:
            self._abort()

    def _abort(self) -> None:
        self._cancel_deadline()
        transport: Any = self.transport
        if transport is not None:
            transport.abortConnection()


class _Overloaded(Protocol):
    """What a connection beyond the cap gets: a 503 and the end of the connection."""

    def __init__(self, site: GuardedSite) -> None:
        self.site = site

    def connectionMade(self) -> None:
        error = ApiError(
            503,
            "the server has too many open connections; retry shortly",
            kind="service_unavailable",
            code="too_many_connections",
            outcome="overloaded",
            headers={b"retry-after": b"1"},
        )
        self.site.count(error.outcome)
        assert self.transport is not None
        self.transport.write(raw_response(error, _date(self.site.reactor)))
        self.transport.loseConnection()


Screen = Callable[[GuardedRequest, "int | None"], "ApiError | None"]


@dataclass
class _Hooks:
    screen: Screen
    count: Callable[[str], None]
    unexpected: Callable[[Failure, GuardedRequest], ApiError]


class GuardedSite(Site):
    """A twisted.web ``Site`` with the front door: screened requests, bounded bodies,
    deadlines, a connection cap, CORS only for configured origins.

    ``screen(request, content_length)`` returns the refusal of a request whose headers are in
    (or None); ``count(outcome)`` counts a refusal made here; ``unexpected(failure, request)``
    logs an unexpected exception once and returns the 500 to answer.
    """

    protocol = GuardedChannel  # type: ignore[assignment]
    requestFactory = GuardedRequest

    def __init__(
        self,
        resource: Resource,
        *,
        reactor: IReactorTime,
        limits: GateLimits,
        screen: Screen,
        count: Callable[[str], None],
        unexpected: Callable[[Failure, GuardedRequest], ApiError],
    ) -> None:
        super().__init__(resource, timeout=IDLE_TIMEOUT_S, reactor=reactor)  # type: ignore[no-untyped-call]
        self.displayTracebacks = False
        self.limits = limits
        self.hooks = _Hooks(screen, count, unexpected)
        self.connections: set[GuardedChannel] = set()

    def buildProtocol(self, addr: Any) -> Any:
        if len(self.connections) >= self.limits.max_connections:
            return _Overloaded(self)
        return super().buildProtocol(addr)  # type: ignore[no-untyped-call]

    def screen(self, request: GuardedRequest, length: int | None) -> ApiError | None:
        return self.hooks.screen(request, length)

    def count(self, outcome: str) -> None:
        self.hooks.count(outcome)

    def unexpected(self, failure: Failure, request: GuardedRequest) -> ApiError:
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
            request.setHeader(b"access-control-allow-methods", b"GET, POST, OPTIONS")
            request.setHeader(
                b"access-control-allow-headers", b"Authorization, Content-Type, X-Request-Class"
            )
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
    "IDLE_TIMEOUT_S",
    "LINGER_BYTES",
    "LINGER_S",
    "ConcurrencyLimits",
    "GateLimits",
    "GuardedChannel",
    "GuardedRequest",
    "GuardedSite",
    "Permit",
    "body_too_large",
    "host_allowed",
    "raw_response",
]
