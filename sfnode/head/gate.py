"""The head's HTTP front door: what is checked before a request body is read, and the clocks that
keep slow or hostile clients from holding the head.  It is built on the guards every sfnode
listener shares (``sfnode.webguard``: the header deadline, refusals that read nothing more, the
connection cap), with the head's own checks and its errors in OpenAI's shape.

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

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import Request

from sfnode.head.schema import ApiError
from sfnode.webguard import (
    IDLE_TIMEOUT_S,
    LINGER_BYTES,
    LINGER_S,
    CappedSite,
    Refusal,
    http_date,
)
from sfnode.webguard import (
    GuardedChannel as SharedChannel,
)
from sfnode.webguard import raw_response as _raw_response

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
    return _raw_response(error, date, SERVER, extra)


def _date(clock: IReactorTime) -> bytes:
    return http_date(clock)


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


class GuardedChannel(SharedChannel):
    """The shared channel (header deadline, refusals) that also screens each request at the
    end of its headers and runs the body deadline."""

    site: GuardedSite

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
        super().allHeadersReceived()
        if self.length != 0 and not self.refused:
            self._arm(self.site.limits.body_timeout_s, "body")

    def allContentReceived(self) -> None:
        if self.refused:
            return
        self._cancel_deadline()
        super().allContentReceived()  # type: ignore[no-untyped-call]


Screen = Callable[[GuardedRequest, "int | None"], "ApiError | None"]


@dataclass
class _Hooks:
    screen: Screen
    count: Callable[[str], None]
    unexpected: Callable[[Failure, GuardedRequest], ApiError]


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
        unexpected: Callable[[Failure, GuardedRequest], ApiError],
    ) -> None:
        super().__init__(
            resource,
            reactor=reactor,
            max_connections=limits.max_connections,
            header_timeout_s=limits.header_timeout_s,
        )
        self.limits = limits
        self.hooks = _Hooks(screen, count, unexpected)

    def error(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        outcome: str = "bad_request",
        headers: Mapping[bytes, bytes] | None = None,
    ) -> Refusal:
        return ApiError(status, message, kind=kind, code=code, outcome=outcome, headers=headers)

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
    "SERVER",
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
