"""The console's live feed (``GET /console/feed``): the snapshot as server-sent events, to each
viewer, every :data:`PERIOD_S` seconds while at least one viewer is connected.

The snapshot is built and encoded once per update, whatever the number of viewers, and only
while there are viewers: the timer starts with the first and stops with the last.  A viewer
that connects gets the latest update at once (built anew only when it is older than a period),
so viewers that come and go cannot make the head build more than one a period.  Viewers are
at most ``max_viewers`` (one more is refused); each is bounded: a viewer whose connection stops
taking data (twisted.web pauses its producer) is skipped, as the next update replaces the one it
missed, and after :data:`STALLED_UPDATES` skipped updates in a row it is cut off.

This module must never build a snapshot with no viewer, write to a viewer that is paused or
gone, or use the global reactor (the clock is a parameter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

PERIOD_S = 0.5
"""Between two updates: two a second at most."""
MAX_VIEWERS = 16
"""Viewers of the feed at once."""
STALLED_UPDATES = 20
"""A viewer that took none of this many updates in a row (10 s) is cut off."""
RETRY_MS = 2000
"""What the feed tells a browser to wait before it reconnects (the SSE ``retry:`` field)."""

_log = Logger(namespace="sfnode.head.console.feed")


def sse(data: bytes, event: bytes = b"state") -> bytes:
    """One server-sent event carrying ``data`` (JSON on one line)."""
    return b"event: " + event + b"\ndata: " + data + b"\n\n"


@implementer(IPushProducer)
class Viewer:
    """One viewer's request, registered as the producer of its connection: twisted.web pauses
    it when the connection's buffer is full."""

    def __init__(self, request: Any) -> None:
        self.request = request
        self.paused = False
        self.skipped = 0
        """Updates skipped in a row while paused."""
        self.gone = False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        self.gone = True


@dataclass(eq=False)
class Feed:
    """The viewers and the timer that updates them.  ``render()`` builds one update's bytes
    (the snapshot, encoded)."""

    clock: IReactorTime
    render: Callable[[], bytes]
    _: KW_ONLY
    max_viewers: int = MAX_VIEWERS
    period_s: float = PERIOD_S
    viewers: list[Viewer] = field(default_factory=list, init=False)
    _timer: IDelayedCall | None = field(default=None, init=False)
    updates: int = field(default=0, init=False)
    """Updates built since the start (one per period with viewers, none without)."""
    _latest: tuple[float, bytes] | None = field(default=None, init=False)
    """When the latest update was built, and its event."""

    @property
    def full(self) -> bool:
        return len(self.viewers) >= self.max_viewers

    def add(self, request: Any) -> Viewer:
        """Start sending updates to ``request`` (the caller checked :attr:`full`): the first at
        once, then one per period until it goes away."""
        viewer = Viewer(request)
        self.viewers.append(viewer)
        request.registerProducer(viewer, True)
        request.notifyFinish().addBoth(lambda _: self._left(viewer))
        request.write(b"retry: %d\n\n" % RETRY_MS)
        latest = self._latest
        fresh = latest is not None and self.clock.seconds() - latest[0] < self.period_s
        self._send([viewer], latest[1] if fresh and latest is not None else self._build())
        if self._timer is None:
            self._timer = self.clock.callLater(self.period_s, self._tick)
        return viewer

    def stop(self) -> None:
        """End every viewer's stream (the head stops)."""
        for viewer in list(self.viewers):
            self._cut(viewer)
        self._stop_timer()
        self._latest = None

    def _tick(self) -> None:
        self._timer = None
        if not self.viewers:
            return
        self._send(list(self.viewers), self._build())
        if self.viewers:
            self._timer = self.clock.callLater(self.period_s, self._tick)

    def _build(self) -> bytes:
        self.updates += 1
        data = sse(self.render())
        self._latest = (self.clock.seconds(), data)
        return data

    def _send(self, viewers: list[Viewer], data: bytes) -> None:
        for viewer in viewers:
            if viewer.gone:
                continue
            if viewer.paused:
                viewer.skipped += 1
                if viewer.skipped >= STALLED_UPDATES:
                    _log.info("a console viewer took no update for a while: cut off")
                    self._cut(viewer)
                continue
            viewer.skipped = 0
            viewer.request.write(data)

    def _cut(self, viewer: Viewer) -> None:
        viewer.gone = True
        self._left(viewer)
        request = viewer.request
        transport = getattr(request, "transport", None)
        if transport is not None:
            transport.abortConnection()

    def _left(self, viewer: Viewer) -> None:
        viewer.gone = True
        if viewer in self.viewers:
            self.viewers.remove(viewer)
            if getattr(viewer.request, "channel", None) is not None:
                # A request whose connection is gone has no channel (nor producer) left.
                viewer.request.unregisterProducer()
        if not self.viewers:
            self._stop_timer()

    def _stop_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()


__all__ = ["MAX_VIEWERS", "PERIOD_S", "Feed", "Viewer", "sse"]
