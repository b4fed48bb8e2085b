"""What the console shows that only the HTTP layer sees, recorded where ``/metrics`` counts the
same things: each request's time to first token (``sfhead_time_to_first_token_seconds``) and
the tokens delivered (``sfhead_completion_tokens``), per model; the 429s answered
(``sfhead_requests_total{outcome="rate_limited"}``), per client; and the streams resumed with
``Last-Event-ID``, into the fleet's event journal.

Each record is one bounded append or one counter: nothing is computed here, whether anyone
watches or not (the console's snapshot reads these when it is asked for).  This module must never
keep more than its bounds, read a clock itself, or keep an API key (clients are named by
:func:`client_label`).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Hashable

from sfnode.head.fleet.events import EventJournal

FIRST_TOKENS_KEPT = 2048
"""First-token times kept, all models together (the newest)."""
CLIENTS_COUNTED = 256
"""Clients whose 429s are counted one by one; the rest are counted together."""
OTHERS = "(others)"


def client_label(share: Hashable) -> str:
    """How the console names a client (a fair-share key, ``Requester.share``): an API key by
    the first 8 hex digits of its SHA-256 (never the key), an address as it is, the head's own
    generations as ``(head)``."""
    if isinstance(share, tuple) and len(share) == 2:
        kind, value = share
        if kind == "key" and isinstance(value, bytes):
            return "key:" + hashlib.sha256(value).hexdigest()[:8]
        if kind == "address":
            return str(value) or "(head)"
    return str(share)[:64]


class ConsoleRecord:
    """The HTTP layer's figures for the console, and the fleet's journal it adds to."""

    def __init__(self, events: EventJournal, now: Callable[[], float]) -> None:
        self.events = events
        self._now = now
        self.first_tokens: deque[tuple[float, str, float]] = deque(maxlen=FIRST_TOKENS_KEPT)
        """(when, model, seconds to the first token), oldest first."""
        self.delivered: dict[str, int] = {}
        """Tokens delivered to clients since the start, per model."""
        self.rate_limited: dict[str, int] = {}
        """429s answered since the start, per client (:func:`client_label`)."""

    def first_token(self, model: str, seconds: float) -> None:
        self.first_tokens.append((self._now(), model, seconds))

    def tokens(self, model: str, count: int) -> None:
        self.delivered[model] = self.delivered.get(model, 0) + count

    def refused(self, share: Hashable) -> None:
        """A request of ``share`` was answered 429."""
        label = client_label(share)
        if label not in self.rate_limited and len(self.rate_limited) >= CLIENTS_COUNTED:
            label = OTHERS
        self.rate_limited[label] = self.rate_limited.get(label, 0) + 1

    def resumed(self, model: str, after: int) -> None:
        """A client resumed its stream after its ``after``-th event."""
        self.events.record("resumed", model=model, detail=f"after event {after}")


__all__ = ["ConsoleRecord", "client_label"]
