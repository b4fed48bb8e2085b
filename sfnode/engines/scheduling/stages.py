"""Stage sessions (docs/protocol.md section 12.8): which KV slot each pipeline stage session of a
connection keeps its rows in, how many rows it holds, and the bounds on them.

A session is opened by a request at position 0 on a free slot, continues from any position up
to the rows it holds (what lies beyond is forgotten), and is dropped when a request does not fit
it, when its head releases it, when its connection closes, or, once idle ``idle_s``, when a new
session needs its slot.  Every refusal is a :class:`~sfnode.generation.StageForwardError`.

:class:`KeptRows` is what the runner is asked to compute: rows at positions of one slot.

This module must never compute anything, read a clock of its own, or hold more sessions than it
has slots.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from sfnode.generation import StageForwardError

STAGE_IDLE_S = 60.0
"""A stage session that ran no forward this long gives its slot to a new one (section 12.8)."""


@dataclass(frozen=True)
class KeptRows:
    """Rows for a runner's kept stage: ``tokens`` (a first stage) or ``hidden`` (the runner's
    own form of the rows' states) at positions ``position ..`` of ``slot``, through layers
    ``[start, end)``."""

    slot: int
    position: int
    tokens: Sequence[int]
    hidden: Any
    start: int
    end: int


@dataclass
class _Session:
    slot: int
    rows: int
    start: int
    end: int
    used_at: float


class StageSessions:
    """The stage sessions of every connection over ``slots`` slots (see the module)."""

    def __init__(self, slots: int, window: int, idle_s: float = STAGE_IDLE_S) -> None:
        self.slots = slots
        self.window = window
        self.idle_s = idle_s
        self._sessions: dict[tuple[Hashable, int], _Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def claim(
        self,
        owner: Hashable,
        session: int,
        position: int,
        rows: int,
        layers: tuple[int, int],
        now: float,
    ) -> int:
        """The slot that computes ``rows`` rows at ``position`` of ``owner``'s ``session``
        through ``layers``; the session then holds ``position + rows`` rows.

        :raises StageForwardError: the request does not fit (the session is dropped)."""
        key = (owner, session)
        kept = self._sessions.get(key)
        try:
            if rows <= 0:
                raise StageForwardError("a kept stage request carries no rows")
            if position + rows > self.window:
                raise StageForwardError(
                    f"positions up to {position + rows} exceed the window of {self.window}"
                )
            if position == 0:
                slot = kept.slot if kept is not None else self._free_slot(now)
                kept = self._sessions[key] = _Session(slot, 0, *layers, now)
            elif kept is None:
                raise StageForwardError(f"stage session {session} is unknown here")
            elif kept.rows < position:
                raise StageForwardError(
                    f"stage session {session} holds {kept.rows} rows, not {position}"
                )
            elif (kept.start, kept.end) != layers:
                raise StageForwardError(
                    f"stage session {session} runs layers [{kept.start}, {kept.end})"
                )
        except StageForwardError:
            self._sessions.pop(key, None)
            raise
        kept.rows = position + rows
        kept.used_at = now
        return kept.slot

    def _free_slot(self, now: float) -> int:
        used = {kept.slot: key for key, kept in self._sessions.items()}
        for slot in range(self.slots):
            if slot not in used:
                return slot
        idle = min(self._sessions.items(), key=lambda item: item[1].used_at)
        if now - idle[1].used_at < self.idle_s:
            raise StageForwardError(f"all {self.slots} stage sessions are in use")
        del self._sessions[idle[0]]
        return idle[1].slot

    def drop(self, owner: Hashable, session: int | None = None) -> None:
        """Forget ``owner``'s ``session``, or every session of ``owner`` (its connection
        closed)."""
        if session is not None:
            self._sessions.pop((owner, session), None)
            return
        for key in [key for key in self._sessions if key[0] == owner]:
            del self._sessions[key]
