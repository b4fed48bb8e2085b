"""Idempotency helpers of Link F: command tables, retry buffers, lease clocks and event dedup.

These are the small machines docs/protocol.md sections 6.1 and 8.1 build on: the node's
:class:`~sfnode.node.sessions.AgentSession` uses :class:`CommandTable`, :class:`RetryBuffer` and
:class:`LeaseClock` (whose timing its lease machines arm their timers from); the head's
``HeadSession`` uses :class:`EventDedup`.  :class:`GenerationKey` and :class:`DedupKey` are how the
node and the head name a generation.  Times are integer milliseconds passed in by the caller.

This module is pure logic: it must never do I/O, read a clock, touch a reactor or import anything
from the wire layer.  Everything here is deterministic and can be tested in microseconds.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

U64_MAX = 0xFFFF_FFFF_FFFF_FFFF

DEFAULT_COMMAND_CAPACITY = 1 << 16
"""Command ids a table remembers one by one before it starts to fold the oldest into a floor."""

E = TypeVar("E")


# --------------------------------------------------------------------------------------------
# Commands


class CommandTable:
    """The set of command ids already applied to one session (docs/protocol.md sections 6.1 and
    6.2).

    :meth:`apply` says whether an id is fresh (and records it); :meth:`trim` forgets every id at
    or below a watermark, as RECONCILE asks.

    Memory stays bounded without a RECONCILE: past ``capacity`` remembered ids the table folds
    the lowest into one range of ids that it refuses wholesale.  Folding only ever refuses more,
    never less, so a replay is never applied twice; the price is that an unseen id inside the
    folded range is refused too (heads allocate ids in increasing order, so no head sends one).
    """

    def __init__(self, capacity: int = DEFAULT_COMMAND_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a command table needs room for at least one id")
        self._capacity = capacity
        self._applied: set[int] = set()
        self._by_age: list[int] = []
        """A min-heap of the ids in ``_applied``: the next ones to fold."""
        self._folded: tuple[int, int] | None = None
        """``(low, high)``: ids with ``low < id <= high`` were folded and are refused."""

    def __len__(self) -> int:
        """Ids remembered one by one (folded ids are not counted)."""
        return len(self._applied)

    def __contains__(self, command_id: object) -> bool:
        """Whether ``command_id`` would be refused as a replay."""
        if not isinstance(command_id, int):
            return False
        if command_id in self._applied:
            return True
        return self._folded is not None and self._folded[0] < command_id <= self._folded[1]

    def __iter__(self) -> Iterator[int]:
        """The ids remembered one by one, lowest first."""
        return iter(sorted(self._applied))

    def apply(self, command_id: int) -> bool:
        """True, and record the id, iff it was never applied; False for a replay."""
        if command_id in self:
            return False
        self._applied.add(command_id)
        heapq.heappush(self._by_age, command_id)
        if len(self._applied) > self._capacity:
            self._fold_oldest()
        return True

    def trim(self, watermark: int) -> None:
        """Forget every id <= ``watermark`` (``U64_MAX`` forgets everything)."""
        if watermark >= U64_MAX:
            self._applied.clear()
            self._by_age.clear()
            self._folded = None
            return
        if self._by_age and self._by_age[0] <= watermark:
            self._applied = {i for i in self._applied if i > watermark}
            self._by_age = list(self._applied)
            heapq.heapify(self._by_age)
        if self._folded is not None:
            low, high = self._folded
            self._folded = None if watermark >= high else (max(low, watermark), high)

    def _fold_oldest(self) -> None:
        oldest = heapq.heappop(self._by_age)
        self._applied.discard(oldest)
        if self._folded is None:
            self._folded = (oldest - 1, oldest)
        else:
            low, high = self._folded
            self._folded = (min(low, oldest - 1), max(high, oldest))


# --------------------------------------------------------------------------------------------
# Retry buffer


class RetryBuffer(Generic[E]):
    """The events of one generation not yet acknowledged by the head, oldest first (docs/protocol.md
    section 6.1).

    Sequence numbers are pushed in increasing order; :meth:`ack` pops the acknowledged prefix.
    Nothing is ever dropped otherwise: an unacked event waits here for the next RECONCILE.
    """

    def __init__(self) -> None:
        self._events: deque[tuple[int, E]] = deque()

    def __len__(self) -> int:
        return len(self._events)

    def push(self, event_seq: int, event: E) -> None:
        """Buffer ``event`` under ``event_seq`` (the caller keeps the seqs increasing)."""
        self._events.append((event_seq, event))

    def ack(self, watermark: int) -> None:
        """Drop events from the front while their seq is <= ``watermark``."""
        events = self._events
        while events and events[0][0] <= watermark:
            events.popleft()

    def retransmit_from(self, from_seq: int) -> list[E]:
        """Every buffered event with seq >= ``from_seq``, in order; the buffer is unchanged."""
        return [event for seq, event in self._events if seq >= from_seq]


# --------------------------------------------------------------------------------------------
# Lease clock


@dataclass(frozen=True, slots=True)
class LeaseClock:
    """A lease as the node received it (docs/protocol.md section 6.4): when, for how long, when
    to ask again.

    With ``age = now - received_at_ms``: renewal is due once ``age >= renew_by_ms`` and the lease
    is expired once ``age >= duration_ms``.  A ``now`` before receipt is never due nor expired.
    The node's lease machine arms its timers from :meth:`renew_in` and :meth:`expires_in`, so
    these boundaries are exactly the ones the node runs.
    """

    received_at_ms: int
    duration_ms: int
    renew_by_ms: int

    def age(self, now_ms: int) -> int:
        """Milliseconds since receipt, never negative."""
        return max(0, now_ms - self.received_at_ms)

    def renew_in(self, now_ms: int) -> int:
        """Milliseconds from ``now_ms`` until renewal is due (0: due now or already)."""
        return max(0, self.received_at_ms + self.renew_by_ms - now_ms)

    def expires_in(self, now_ms: int) -> int:
        """Milliseconds from ``now_ms`` until the lease expires (0: expired now or already)."""
        return max(0, self.received_at_ms + self.duration_ms - now_ms)

    def must_renew(self, now_ms: int) -> bool:
        return now_ms >= self.received_at_ms and self.renew_in(now_ms) == 0

    def expired(self, now_ms: int) -> bool:
        return now_ms >= self.received_at_ms and self.expires_in(now_ms) == 0


# --------------------------------------------------------------------------------------------
# Keys: how the node and the head name a generation


class GenerationKey(NamedTuple):
    """How the node names a generation: WITHOUT its epoch, so that a generation id replayed
    under a fresh command continues its event seqs (docs/protocol.md section 6.1), and with the
    identity of the head whose session it is (None: a head without one; section 12.4)."""

    session_id: int
    generation_id: int
    head_id: int | None = None


class DedupKey(NamedTuple):
    """What the head deduplicates token events by: the generation *and* its epoch, so that
    events of a superseded epoch are told apart (docs/protocol.md section 8.1)."""

    session_id: int
    epoch: int
    generation_id: int


# --------------------------------------------------------------------------------------------
# Event dedup (the head side, docs/protocol.md section 8.1)


@dataclass(frozen=True, slots=True)
class Accepted:
    """The next event in order: commit it and acknowledge."""


@dataclass(frozen=True, slots=True)
class AlreadyCommitted:
    """A seq below the next expected one (a retransmission): re-acknowledge, commit nothing."""


@dataclass(frozen=True, slots=True)
class Gap:
    """A seq beyond the next expected one: drop it, acknowledge nothing."""

    expected: int
    got: int


@dataclass(frozen=True, slots=True)
class StaleEpoch:
    """An event of an epoch older than the session's current one: drop it silently."""


DedupOutcome = Accepted | AlreadyCommitted | Gap | StaleEpoch

ACCEPTED = Accepted()
ALREADY_COMMITTED = AlreadyCommitted()
STALE_EPOCH = StaleEpoch()


class EventDedup:
    """The head's exactly-once filter over token events (docs/protocol.md section 8.1).

    For each key ``(session, epoch, generation)`` it keeps the next expected ``event_seq``; for
    each session the current epoch.  Memory is bounded by the caller retiring generations and
    sessions, and by epoch changes forgetting every key of an older epoch.
    """

    def __init__(self) -> None:
        self._next_seq: dict[DedupKey, int] = {}
        self._keys_of: dict[int, set[DedupKey]] = {}
        self._session_epoch: dict[int, int] = {}

    def __len__(self) -> int:
        """Keys tracked (generations with at least one accepted event)."""
        return len(self._next_seq)

    def session_epoch(self, session_id: int) -> int | None:
        return self._session_epoch.get(session_id)

    def accept(self, key: tuple[int, int, int], event_seq: int) -> DedupOutcome:
        """Classify one event and, when it is :class:`Accepted`, advance its key."""
        key = DedupKey(*key)
        current = self._session_epoch.get(key.session_id)
        if current is not None and key.epoch < current:
            return STALE_EPOCH
        expected = self._next_seq.get(key, 0)
        if event_seq < expected:
            return ALREADY_COMMITTED
        if event_seq > expected:
            return Gap(expected, event_seq)
        self._next_seq[key] = expected + 1
        self._keys_of.setdefault(key.session_id, set()).add(key)
        return ACCEPTED

    def watermark(self, key: tuple[int, int, int]) -> int | None:
        """The highest contiguous seq accepted under ``key``, or None when nothing was."""
        expected = self._next_seq.get(DedupKey(*key), 0)
        return expected - 1 if expected else None

    def set_session_epoch(self, session_id: int, epoch: int) -> None:
        """Record the session's epoch; a higher one forgets every key of an older epoch."""
        previous = self._session_epoch.get(session_id)
        self._session_epoch[session_id] = epoch
        if previous is not None and previous >= epoch:
            return
        keys = self._keys_of.get(session_id)
        if not keys:
            return
        for key in [k for k in keys if k.epoch < epoch]:
            keys.discard(key)
            del self._next_seq[key]
        if not keys:
            del self._keys_of[session_id]

    def retire_generation(self, key: tuple[int, int, int]) -> None:
        """Forget one key (a generation the head is done with)."""
        key = DedupKey(*key)
        if self._next_seq.pop(key, None) is None:
            return
        keys = self._keys_of[key.session_id]
        keys.discard(key)
        if not keys:
            del self._keys_of[key.session_id]

    def retire_session(self, session_id: int) -> None:
        """Forget every key of the session and its epoch."""
        for key in self._keys_of.pop(session_id, ()):
            del self._next_seq[key]
        self._session_epoch.pop(session_id, None)
