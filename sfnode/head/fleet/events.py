"""The fleet's event journal: what happened to the fleet, in order, for the operator's console
(docs/api.md "The console").

A :class:`FleetEvent` is one thing worth telling an operator: a node joined, left, came back,
refused its model, was drained; a generation failed over (from which node to which, with how
many tokens kept), gave its lane back (a preemption); a client's stream resumed.  The places
that count the same things for ``/metrics`` (``sfhead_failovers``, ``sfhead_lanes_reclaimed``,
``sfhead_reconnects``) record them here too.  :class:`EventJournal` keeps the latest
:data:`JOURNAL_EVENTS` of them, numbered, so a viewer asks for what came after the last number it
saw.

Recording is one append to a bounded deque: nothing else is computed, whether anyone watches
or not.  This module must never do I/O, keep more than its bound, or hold a reactor (the time
of an event comes from the function it is given).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

JOURNAL_EVENTS = 200
"""The events kept (the oldest go first)."""

TEXT_CHARS = 200
"""The most characters of an event's ``detail`` kept (a node's refusal reason, say)."""

KINDS = (
    "joined",
    "back",
    "lost",
    "left",
    "refused",
    "draining",
    "failover",
    "preempted",
    "resumed",
)
"""Every kind of event, for the console's legend."""


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """One event: its number, when (clock seconds), its kind (one of :data:`KINDS`) and what
    it is about."""

    seq: int
    at: float
    kind: str
    node: str = ""
    """The node it happened on (a failover's node it left)."""
    to_node: str = ""
    """A failover's node it went on on ("" when it found none)."""
    model: str = ""
    tokens: int = 0
    """A failover's or preemption's tokens kept (delivered before it moved)."""
    detail: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "seq": self.seq,
            "at": round(self.at, 3),
            "kind": self.kind,
            "node": self.node,
            "to_node": self.to_node,
            "model": self.model,
            "tokens": self.tokens,
            "detail": self.detail,
        }


class EventJournal:
    """The latest :data:`JOURNAL_EVENTS` events, numbered from 1; ``listeners`` are told of
    each new one (the console's feed, while it has viewers)."""

    def __init__(self, now: Callable[[], float], limit: int = JOURNAL_EVENTS) -> None:
        self._now = now
        self._events: deque[FleetEvent] = deque(maxlen=limit)
        self._seq = itertools.count(1)
        self.listeners: list[Callable[[FleetEvent], None]] = []

    def record(
        self,
        kind: str,
        node: str = "",
        *,
        to_node: str = "",
        model: str | None = "",
        tokens: int = 0,
        detail: str = "",
    ) -> FleetEvent:
        """Add an event of ``kind`` now (a ``detail`` past :data:`TEXT_CHARS` is cut)."""
        event = FleetEvent(
            next(self._seq),
            self._now(),
            kind,
            node,
            to_node,
            model or "",
            tokens,
            detail[:TEXT_CHARS],
        )
        self._events.append(event)
        for listener in list(self.listeners):
            listener(event)
        return event

    def latest(self, count: int) -> list[FleetEvent]:
        """The newest ``count`` events, oldest first."""
        if count <= 0:
            return []
        return list(itertools.islice(reversed(self._events), count))[::-1]

    def since(self, seq: int) -> list[FleetEvent]:
        """The events numbered after ``seq`` still kept, oldest first."""
        return [e for e in self._events if e.seq > seq]

    @property
    def last_seq(self) -> int:
        """The number of the newest event (0: none yet)."""
        return self._events[-1].seq if self._events else 0

    def __len__(self) -> int:
        return len(self._events)


__all__ = ["JOURNAL_EVENTS", "KINDS", "EventJournal", "FleetEvent"]
