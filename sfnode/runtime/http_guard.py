"""The HTTP guards every listener of sfnode shares: the head's API (``sfnode.head.api.gate`` builds
its front door on them) and the node's ``--metrics`` listener.

- :class:`GuardedChannel` gives a request's headers ``header_timeout_s`` from their first byte,
  whatever the pace of the bytes (408 after); answers a malformed request line, header or
  chunk, or an over-long line, with a short JSON 400; and, once it refused a request, answers
  at once with ``Connection: close``, reads nothing more of that connection (what the client
  still sends is discarded) and aborts it after :data:`LINGER_BYTES` or :data:`LINGER_S`.
- :class:`CappedSite` caps the open connections: one more is answered 503 and closed.
- :class:`HttpError` is such an answer, in OpenAI's JSON shape (``{"error": {message, type,
  param, code}}``): the one error class of every listener, the head's API included (its
  ``param`` names the request field); :func:`clip` bounds what of a client's input it quotes.

This module must never read a body it refused, never write a request to disk, never echo
unbounded input, and never use the global reactor (the site's reactor runs the clocks).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Site

LINGER_BYTES = 256 * 1024
"""After a refusal: how much of the unread request is discarded before the connection is
aborted (enough for a normal client to finish sending and read the answer)."""
LINGER_S = 5.0
"""After a refusal: how long the connection may stay half-open before it is aborted."""
IDLE_TIMEOUT_S = 60.0
"""A keep-alive connection with no request in progress is closed after this long."""
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 1024


ECHO_LIMIT = 64
"""The most characters of a client's input that an error message repeats."""


class HttpError(Exception):
    """An error answered in OpenAI's JSON shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        outcome: str = "bad_request",
        headers: Mapping[bytes, bytes] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        """The request field the error is about (OpenAI's ``param``), if one."""
        self.code = code
        self.outcome = outcome
        """The ``sfhead_requests_total`` label it is counted under."""
        self.headers = dict(headers or {})
        """Extra response headers (``WWW-Authenticate``, ``Allow``, ``Retry-After``)."""

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` as an error message may quote it: at most ``limit`` characters, printable."""
    shown = text if len(text) <= limit else text[:limit] + "..."
    return shown.encode("utf-8", "backslashreplace").decode("utf-8")


def raw_response(
    error: HttpError, date: bytes, server: bytes, extra: Mapping[bytes, bytes] | None = None
) -> bytes:
    """A complete HTTP/1.1 response for ``error`` that closes the connection."""
    body = error.encoded()
    reason = http.RESPONSES.get(error.status, b"Error")
    lines = [
        b"HTTP/1.1 %d %s" % (error.status, reason),
        b"Server: " + server,
        b"Date: " + date,
        b"Content-Type: application/json",
        b"Content-Length: %d" % len(body),
        b"Connection: close",
    ]
    for name, value in {**error.headers, **(extra or {})}.items():
        lines.append(name + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def http_date(clock: IReactorTime) -> bytes:
    """The ``Date`` header's value now, on ``clock``."""
    date: bytes = http.datetimeToString(clock.seconds())  # type: ignore[no-untyped-call]
    return date


class GuardedChannel(http.HTTPChannel):
    """An HTTP/1.1 channel with a deadline for each request's headers and refusals that never
    read what follows them."""

    site: CappedSite
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
            HttpError(
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
            self._arm(self.site.header_timeout_s, "headers")
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
        super().allHeadersReceived()  # type: ignore[no-untyped-call]

    # Refusals

    def _respondToBadRequestAndDisconnect(self) -> None:
        # twisted.web's answer to a malformed request line, header or chunk is a bare
        # "400 Bad Request"; ours is JSON like every other error.
        self.refuse(
            HttpError(
                400,
                "malformed HTTP request (request line, headers or chunked body)",
                code="bad_http_request",
            )
        )

    def lineLengthExceeded(self, line: bytes) -> None:
        # LineReceiver would close the connection without a word.
        self.refuse(
            HttpError(
                400,
                f"a request line or header is longer than {self.MAX_LENGTH} bytes",
                code="bad_http_request",
            )
        )

    def refuse(self, error: HttpError) -> None:
        """Answer ``error`` now, read nothing more of this connection, and close it."""
        if self.refused:
            return
        self.refused = True
        self._cancel_deadline()
        self.setTimeout(None)  # type: ignore[no-untyped-call]
        self.site.count(error.outcome)
        transport = self.transport
        assert transport is not None
        transport.write(raw_response(error, http_date(self.site.reactor), self.site.server))
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


class _Overloaded(TwistedProtocol):
    """What a connection beyond the cap gets: a 503 and the end of the connection."""

    def __init__(self, site: CappedSite) -> None:
        self.site = site

    def connectionMade(self) -> None:
        error = HttpError(
            503,
            "the server has too many open connections; retry shortly",
            kind="service_unavailable",
            code="too_many_connections",
            outcome="overloaded",
            headers={b"retry-after": b"1"},
        )
        self.site.count(error.outcome)
        assert self.transport is not None
        self.transport.write(raw_response(error, http_date(self.site.reactor), self.site.server))
        self.transport.loseConnection()


class CappedSite(Site):
    """A twisted.web ``Site`` whose channels are :class:`GuardedChannel` and whose open
    connections are capped at ``max_connections``.

    ``server`` is the ``Server`` header of the answers made here; :meth:`count` is told each
    one's outcome (subclasses count them).
    """

    protocol = GuardedChannel  # type: ignore[assignment]
    server = b"sfnode"

    def __init__(
        self,
        resource: Resource,
        *,
        reactor: IReactorTime,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    ) -> None:
        super().__init__(resource, timeout=IDLE_TIMEOUT_S, reactor=reactor)  # type: ignore[no-untyped-call]
        self.displayTracebacks = False
        self.noisy = False
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.connections: set[GuardedChannel] = set()

    def buildProtocol(self, addr: Any) -> Any:
        if len(self.connections) >= self.max_connections:
            return _Overloaded(self)
        return super().buildProtocol(addr)  # type: ignore[no-untyped-call]

    def count(self, outcome: str) -> None:
        """A refusal made by the guards (nothing to count here)."""


__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "ECHO_LIMIT",
    "IDLE_TIMEOUT_S",
    "LINGER_BYTES",
    "LINGER_S",
    "CappedSite",
    "GuardedChannel",
    "HttpError",
    "clip",
    "http_date",
    "raw_response",
]
