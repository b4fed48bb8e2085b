"""One generation's steps in a stage ring, as the head sees them (docs/protocol.md section 12.10).

Once a generation's context is through its kept stages (12.8), the head may send its next step
to the first stage as a ring row: the stages then hand each step's rows to each other, and the
last stage copies every token to the head.  :class:`RingRun` is what the head keeps of such a
run: the position of the token it expects next, the tokens that came and were not taken yet,
and why the run ended, if it did.  A token at any other position than the expected one is
dropped (a row of an earlier run, or one sent twice), so the generation gets each position's
token once and in order; a nil entry (a row a stage refused or lost), the loss of a stage's
link, or :data:`RING_SILENCE_S` without a token while the generation waits end the run, and
the generation then rebuilds its stages as 12.8 says.

This module must never block or use the global reactor: the clock is passed in.
"""

from __future__ import annotations

from collections import deque

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

RING_SILENCE_S = 10.0
"""Seconds a generation waits for its next ring token before it takes the ring as broken."""


class RingBroken(Exception):
    """A generation's ring run ended without its token: a stage refused or lost a row, a
    stage's link was lost, or no token came for :data:`RING_SILENCE_S`."""


class RingRun:
    """The tokens of one generation's ring run, taken in order of position."""

    def __init__(self, clock: IReactorTime, position: int) -> None:
        self._clock = clock
        self.expected = position
        """The position of the next token the run gives (the context's length)."""
        self._ready: deque[int] = deque()
        self._waiter: Deferred[int] | None = None
        self._silence: IDelayedCall | None = None
        self.broken: RingBroken | None = None
        """Why the run ended, once it has; its tokens that came before are still taken."""

    def offer(self, position: int, token: int | None) -> None:
        """A STAGE_RING_TOKENS entry of this run's session: the token at ``position``, or
        None (the row was refused or lost).  Entries at other positions are dropped."""
        if self.broken is not None or position != self.expected:
            return
        if token is None:
            self.end(RingBroken(f"a stage refused or lost the ring row before position {position}"))
            return
        self.expected += 1
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            self._ready.append(token)
            return
        self._stop_silence()
        waiter.callback(token)

    def take(self) -> Deferred[int]:
        """The next token, at once when it came already; fails with :class:`RingBroken`
        once the run has ended and every token that came before is taken."""
        if self._ready:
            return defer.succeed(self._ready.popleft())
        if self.broken is not None:
            return defer.fail(self.broken)
        if self._waiter is not None:
            raise RuntimeError("a ring run's token is taken by one caller at a time")
        self._waiter = Deferred(lambda _: self._cancelled())
        self._silence = self._clock.callLater(RING_SILENCE_S, self._silent)
        return self._waiter

    def end(self, reason: RingBroken) -> None:
        """End the run (a waiting caller fails with ``reason``); later entries are dropped."""
        if self.broken is not None:
            return
        self.broken = reason
        self._stop_silence()
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.errback(reason)

    def _silent(self) -> None:
        self._silence = None
        self.end(RingBroken(f"no token came from the stage ring for {RING_SILENCE_S:g} s"))

    def _cancelled(self) -> None:
        """The caller gave up waiting (the generation's wall budget): the run ends."""
        self._waiter = None
        self._stop_silence()
        self.end(RingBroken("the generation stopped waiting for the ring"))

    def _stop_silence(self) -> None:
        silence, self._silence = self._silence, None
        if silence is not None and silence.active():
            silence.cancel()


__all__ = ["RING_SILENCE_S", "RingBroken", "RingRun"]
