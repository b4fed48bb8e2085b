"""A pipeline's stage ring, as the head sees it (docs/protocol.md section 12.10).

Once a generation's context is through its kept stages (12.8), the head may send its next step
to the first stage as a ring row: the stages then hand each step's rows to each other, and the
last stage copies every token to the head. :class:`StageRing` joins a pipeline's stage links to
a ring (again whenever the links or their layers change, or one of them drops), starts
generations' runs (the first rows of one reactor turn in one frame) and hands each
STAGE_RING_TOKENS entry to its run. :class:`RingRun` is what the head keeps of one run: the
position of the token it expects next, the tokens that came and were not taken yet, and why the
run ended, if it did. A token at any other position than the expected one is dropped (a row of
an earlier run, or one sent twice), so the generation gets each position's token once and in
order; a nil entry (a row a stage refused or lost), the loss of a stage's link, or no token
while the generation waits for :data:`RING_SILENCE_STEPS` times its slowest step so far (at
least :data:`RING_SILENCE_S`) end the run, and the generation then rebuilds its stages as 12.8
says.

This module must never block or use the global reactor: the clock is passed in.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Sequence

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from sfnode.head.link import NodeLink
from sfnode.linkf.wire import (
    FEATURE_STAGE_RING,
    StageRingJoinMsg,
    StageRingRow,
    StageRingRowsMsg,
    StageRingTokensMsg,
)

_log = Logger(namespace="sfnode.head.fleet.ring")

RING_SILENCE_S = 10.0
"""The least time a generation waits for its next ring token before it takes the ring as
broken."""
RING_SILENCE_STEPS = 10
"""...and it waits this many times its slowest step so far (a model whose steps take seconds
is slow, not broken)."""


class RingBroken(Exception):
    """A generation's ring run ended without its token: a stage refused or lost a row, a
    stage's link was lost, or no token came for too long (:meth:`RingRun.silence_s`)."""


class RingRun:
    """The tokens of one generation's ring run, taken in order of position."""

    def __init__(self, clock: IReactorTime, position: int, step_s: float = 0.0) -> None:
        self._clock = clock
        self.expected = position
        """The position of the next token the run gives (the context's length)."""
        self._slowest = step_s
        """The longest time a token of the generation took: ``step_s``, its last step before
        the run, then the gaps between the run's tokens."""
        self._last = clock.seconds()
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
        now = self._clock.seconds()
        self._slowest, self._last = max(self._slowest, now - self._last), now
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
        self._silence = self._clock.callLater(self.silence_s, self._silent)
        return self._waiter

    @property
    def silence_s(self) -> float:
        """How long the run may give no token before it is taken as broken: ten times the
        generation's slowest step so far, and at least :data:`RING_SILENCE_S`."""
        return max(RING_SILENCE_S, RING_SILENCE_STEPS * self._slowest)

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
        self.end(RingBroken(f"no token came from the stage ring for {self.silence_s:g} s"))

    def _cancelled(self) -> None:
        """The caller gave up waiting (the generation's wall budget): the run ends."""
        self._waiter = None
        self.end(RingBroken("the generation stopped waiting for the ring"))

    def _stop_silence(self) -> None:
        silence, self._silence = self._silence, None
        if silence is not None and silence.active():
            silence.cancel()


def in_rings(link: NodeLink) -> bool:
    """Whether ``link``'s node joins stage rings and can be dialled by its neighbour at the
    endpoint the head dials (a ``tcp:`` one, section 12.10)."""
    return bool(
        (link.features or 0) & FEATURE_STAGE_RING
        and link.dialable
        and link.description.startswith("tcp:")
    )


class StageRing:
    """The stage ring of one pipeline's stages (section 12.10): the ring they are joined to,
    the runs under way, by stage session, and what they gave.  ``stop`` are the token ids
    that end a generation (its end-of-sequence ids)."""

    def __init__(self, clock: IReactorTime, stop: Sequence[int]) -> None:
        self._clock = clock
        self._stop = tuple(sorted(stop))
        self.ring: int | None = None
        """The ring the stages are joined to; None before the first join and after a stage's
        link dropped."""
        self._links: list[NodeLink] = []
        self._ranges: list[tuple[int, int]] = []
        """The links and layers the ring was joined with (another of either: a new ring)."""
        self._runs: dict[int, RingRun] = {}
        self._starting: list[StageRingRow] = []
        """First rows of the runs started in this reactor turn (:meth:`start`)."""
        self._send_starts: IDelayedCall | None = None
        self.tokens = 0
        """Tokens the ring gave."""
        self.joined = 0
        """Rings the stages were joined to (one more after each change of their links)."""

    @property
    def running(self) -> bool:
        """Whether a run is under way."""
        return bool(self._runs)

    def join(self, links: Sequence[NodeLink], ranges: Sequence[tuple[int, int]]) -> int | None:
        """The ring of ``links`` cut at ``ranges``: joined now when the links or the layers
        changed since the last join; None for a single stage (it would dial itself), or when
        a stage's node does not join rings or the head did not dial it (no endpoint to give
        its neighbour)."""
        if len(links) < 2 or not all(in_rings(link) for link in links):
            return None
        if self.ring is None or self._links != list(links) or self._ranges != list(ranges):
            ring = secrets.randbits(64)
            for i, (link, (start, end)) in enumerate(zip(links, ranges, strict=True)):
                following = links[(i + 1) % len(links)].description
                link.ring_tokens = self._tokens
                link.send_now(StageRingJoinMsg(ring, start, end, following))
                link.when_closed().addCallback(self._link_lost, ring, link.name)
            self.ring, self._links, self._ranges = ring, list(links), list(ranges)
            self.joined += 1
            _log.info("pipeline stages joined to stage ring {ring:016x}", ring=ring)
        return self.ring

    def start(
        self, session: int, position: int, token: int, left: int, step_s: float = 0.0
    ) -> RingRun:
        """A run of stage ``session`` from ``token`` at ``position`` (the context's last),
        ``left`` tokens wanted, the generation's last step having taken ``step_s``: its first
        row goes to the first stage at the end of this reactor turn, in one frame with the
        other runs started in it (a step group's members, whose round just answered them all:
        so their rows stay one batch on every stage)."""
        run = RingRun(self._clock, position + 1, step_s)
        self._runs[session] = run
        self._starting.append(StageRingRow(session, position, (token,), None, left, self._stop))
        if self._send_starts is None:
            self._send_starts = self._clock.callLater(0, self._send_started, self.ring)
        return run

    def take(self, run: RingRun) -> Deferred[int]:
        """``run``'s next token (:meth:`RingRun.take`), counted once it comes."""
        return run.take().addCallback(self._count)

    def _count(self, token: int) -> int:
        self.tokens += 1
        return token

    def end(self, session: int, reason: str) -> None:
        """End ``session``'s run, if one is under way (its generation released its stages)."""
        run = self._runs.pop(session, None)
        if run is not None:
            run.end(RingBroken(reason))

    def _send_started(self, ring: int | None) -> None:
        """The first rows of the runs started in the last reactor turn, in one frame to the
        first stage (a run whose generation ended meanwhile is left out)."""
        self._send_starts = None
        rows, self._starting = self._starting, []
        rows = [row for row in rows if row.stage_session in self._runs]
        why = None
        if ring is None or ring != self.ring:
            why = "the stage ring changed"
        elif rows and not self._links[0].send_now(StageRingRowsMsg(ring, tuple(rows))):
            why = f"the link to {self._links[0].name} is down"
        if why is not None:
            for row in rows:
                self.end(row.stage_session, why)

    def _tokens(self, link: NodeLink, message: StageRingTokensMsg) -> None:
        """A STAGE_RING_TOKENS: each entry to its generation's run (entries of another ring,
        or of a session no run holds, are dropped)."""
        if message.ring != self.ring:
            return
        for entry in message.tokens:
            run = self._runs.get(entry.stage_session)
            if run is not None:
                run.offer(entry.position, entry.token)

    def _link_lost(self, reason: Exception, ring: int, name: str) -> None:
        """A stage's link of ``ring`` dropped: the node forgot the ring, and the rows on
        their way through it are lost; every run ends (its generation rebuilds)."""
        if ring != self.ring:
            return
        self.ring = None
        for session in list(self._runs):  # an ended run's generation releases it
            self.end(session, f"the stage ring lost {name}: {reason}")


__all__ = ["RING_SILENCE_S", "RING_SILENCE_STEPS", "RingBroken", "RingRun", "StageRing", "in_rings"]
