"""Streams that survive their client's own drop (docs/api.md "Streams that resume").

Every event of a streamed answer goes through one :class:`ResumableStream`: it is numbered
(an ``id: <request id>.<n>`` line before its data), kept, and written to the client's request
while one is attached.  When the client's connection drops mid-stream, the exchange detaches
it and the stream waits ``grace_s`` for the client to come back: a request carrying
``Last-Event-ID: <request id>.<n>`` (and the same API key) is found by :func:`find` and
given every event after ``n``, then the rest as it comes; nothing is repeated or lost.  A
stream nobody resumed within the grace calls ``expired`` (the exchange cancels its
generations and forgets it).

This module must never write to a request that is not the attached one, never keep a stream
past its grace once its client left, and never hand a stream to a request of another API key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from sfnode.runtime.http_guard import HttpError

HEADER = b"last-event-id"
"""The header a reconnecting client names the last event it received with."""
DEFAULT_RESUME_GRACE_S = 60.0
"""How long a stream whose client dropped waits for it to come back (``--resume-grace``)."""
KEPT_BYTES = 64 * 1024 * 1024
"""The most bytes of ended streams kept for their grace (the oldest go first beyond it)."""


class StreamExpired(Exception):
    """Nobody resumed the stream within its grace."""


class ResumableStream:
    """The numbered events of one streamed answer, kept while it may be resumed, and the
    request they are written to now (None while its client is away)."""

    def __init__(
        self, clock: IReactorTime, grace_s: float, request: Any, expired: Callable[[Failure], None]
    ) -> None:
        self._clock = clock
        self.grace_s = grace_s
        """0: a stream whose client drops is not kept (it ends at once)."""
        self.request: Any = request
        self._expired = expired
        self.name = ""
        """The request id event ids start with (set once the exchange's id is final)."""
        self.key: bytes | None = None
        """The API key of the request that opened it: only that key may resume it."""
        self.events: list[bytes] = []
        """Every event sent, each with its ``id:`` line (kept only when ``grace_s`` > 0)."""
        self.sent = 0
        self.finished = False
        """The answer is complete (its last event sent)."""
        self.closed = False
        """Its client was cut off or its generations cancelled: it cannot be resumed."""
        self.framed = True
        """Its events are server-sent events, numbered and resumable; False: lines of another
        format (Ollama's NDJSON), written as they are, never kept nor resumed."""
        self._timer: IDelayedCall | None = None

    @property
    def size(self) -> int:
        """Bytes of events kept."""
        return sum(len(event) for event in self.events)

    @property
    def away(self) -> bool:
        """Its client dropped and may still come back."""
        return self._timer is not None

    def watch(self, request: Any, lost: Callable[[Failure], None]) -> None:
        """Call ``lost`` when ``request``'s connection goes while it is still the attached
        one (a request replaced by a resume is let go quietly)."""

        def gone(failure: Failure) -> None:
            if request is self.request:
                lost(failure)

        request.notifyFinish().addErrback(gone)

    def send(self, event: bytes) -> None:
        """Number and keep ``event`` (one whole server-sent event) and write it to the
        attached request, if any."""
        if not event:
            return
        self.sent += 1
        if not self.framed:
            if self.request is not None:
                self.request.write(event)
            return
        framed = b"id: %s.%d\n%s" % (self.name.encode(), self.sent, event)
        if self.grace_s > 0:
            self.events.append(framed)
        if self.request is not None:
            self.request.write(framed)

    def close(self) -> None:
        """It cannot be resumed any more (its client was cut off, or it was given up)."""
        self.closed = True
        self.events = []

    def finish(self) -> None:
        """The answer is complete: finish the attached request (a client away gets the end
        when it resumes)."""
        self.finished = True
        if self.request is not None:
            self.request.finish()

    def detach(self) -> bool:
        """The client dropped: keep the stream for ``grace_s``; False when it is not kept
        (no grace, or nothing streamed yet)."""
        if self.grace_s <= 0 or self.request is None or not self.framed:
            return False
        self.request = None
        self._timer = self._clock.callLater(self.grace_s, self.expire)
        return True

    def expire(self) -> None:
        """The grace is over (or the head drains): a stream still away is given up."""
        timer, self._timer = self._timer, None
        if timer is None:
            return
        if timer.active():
            timer.cancel()
        self.close()
        self._expired(Failure(StreamExpired(f"nobody resumed {self.name}")))  # type: ignore[no-untyped-call]

    def resume(self, request: Any, after: int) -> None:
        """Attach ``request`` (a client that came back): every event after the ``after``-th,
        then the rest as it comes (or the end, if the answer is complete)."""
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        for event in self.events[after:]:
            request.write(event)
        self.request = request
        if self.finished:
            request.finish()


class Resumable(Protocol):
    """What :func:`find` needs of an exchange."""

    stream: ResumableStream

    def resume(self, request: Any, after: int) -> None: ...


_E = TypeVar("_E", bound=Resumable)


class Exchanges(set[_E], Generic[_E]):
    """The completion requests in flight (what a drain waits for), and the streams that
    ended lately, kept for their grace: a client may have lost the end of one with its
    connection (at most :data:`KEPT_BYTES` of them, the oldest dropped first)."""

    def __init__(self, clock: IReactorTime, grace_s: float, kept_bytes: int = KEPT_BYTES):
        super().__init__()
        self._clock = clock
        self.grace_s = grace_s
        self.ended: OrderedDict[str, tuple[ResumableStream, IDelayedCall]] = OrderedDict()
        self._bytes = 0
        self._kept_bytes = kept_bytes

    def keep(self, stream: ResumableStream) -> None:
        """``stream`` ended: keep it for its grace (once)."""
        if self.grace_s <= 0 or stream.closed or not stream.events or stream.name in self.ended:
            return
        timer = self._clock.callLater(self.grace_s, self._forget, stream.name)
        self.ended[stream.name] = (stream, timer)
        self._bytes += stream.size
        while self._bytes > self._kept_bytes and self.ended:
            name = next(iter(self.ended))
            self.ended[name][1].cancel()
            self._forget(name)

    def _forget(self, name: str) -> None:
        stream, _ = self.ended.pop(name)
        self._bytes -= stream.size

    def clear_ended(self) -> None:
        """Forget every ended stream (the head stops)."""
        for name in list(self.ended):
            self.ended[name][1].cancel()
            self._forget(name)


def parse_last_event(value: bytes) -> tuple[str, int] | None:
    """The request id and event number of a ``Last-Event-ID`` (None: not one of ours)."""
    name, dot, number = value.decode("latin-1").strip().rpartition(".")
    if not dot or not name or not number.isdigit() or len(number) > 9:
        return None
    return name, int(number)


def _resumable(stream: ResumableStream, name: str, key: bytes | None, after: int) -> bool:
    return (
        stream.name == name
        and not stream.closed
        and stream.grace_s > 0
        and stream.key == key
        and 1 <= after <= stream.sent
    )


def find(
    exchanges: Exchanges[_E], value: bytes, key: bytes | None
) -> tuple[_E | None, ResumableStream, int]:
    """The exchange a ``Last-Event-ID`` of ``key``'s names (None: its stream ended and is
    kept), its stream, and the number of the last event its client got.

    :raises HttpError: 404 ``stream_not_found`` when there is none (an unknown id, another
        key's stream, a stream cut off, or one whose grace is over).
    """
    parsed = parse_last_event(value)
    if parsed is not None:
        name, after = parsed
        for exchange in exchanges:
            if _resumable(exchange.stream, name, key, after):
                return exchange, exchange.stream, after
        kept = exchanges.ended.get(name)
        if kept is not None and _resumable(kept[0], name, key, after):
            return None, kept[0], after
    raise HttpError(
        404,
        "no stream to resume with this Last-Event-ID: it ended or its client left more than "
        "--resume-grace seconds ago, it was cut off, or it never was (or was another API "
        "key's)",
        code="stream_not_found",
        outcome="not_found",
    )


__all__ = [
    "DEFAULT_RESUME_GRACE_S",
    "HEADER",
    "KEPT_BYTES",
    "Exchanges",
    "Resumable",
    "ResumableStream",
    "StreamExpired",
    "find",
    "parse_last_event",
]
