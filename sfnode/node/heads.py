"""The node's session tables, one per head identity (docs/protocol.md section 12.4, decision D13).

A connection reaches only the sessions of the head that named itself in its HELLO; heads without
an identity share one table.  :class:`HeadTables` holds every table of a node, creates one when
a head first speaks and forgets an empty one whose head has no connection left (so identities
that heads invent cannot grow the node's memory), and answers the node-wide figures that
``max_sessions`` and the capacity reports read.  :class:`HeadSessions` is one head's table and
the owner its sessions' lease machines report to (:class:`~sfnode.node.machines.SessionOwner`):
it sends LEASE_RENEWs to the head's connections and has the node's generations of a fenced or
deleted session stopped.

This module never decodes or frames bytes and reads time only from the clock it is given.
Section numbers are those of docs/protocol.md.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from twisted.logger import Logger

from sfnode.linkf.idempotency import GenerationKey
from sfnode.linkf.wire import LeaseRenewMsg
from sfnode.node.config import NodeCommon
from sfnode.node.sessions import RENEW_INTERVAL_MS, AgentSession, NodeSession

log = Logger()


class HeadConnection(Protocol):
    """What a session table needs of a connection (the node's ``NodeConnection``)."""

    @property
    def head_id(self) -> int | None: ...

    @property
    def open(self) -> bool: ...

    def send(self, message: LeaseRenewMsg) -> bool: ...


StopGenerations = Callable[["HeadSessions", int], None]
"""Stops the node's generations of one session of one head."""


class HeadSessions:
    """The session table of one head identity (decision D13), and the owner its sessions'
    lease machines report to."""

    def __init__(self, tables: HeadTables, head_id: int | None) -> None:
        self._tables = tables
        self.head_id = head_id
        """The HELLO's ``head_id``; None for the table that heads without one share."""
        self.table: AgentSession[HeadConnection] = AgentSession(
            tables.common.clock,
            owner=self,
            renew_interval_ms=RENEW_INTERVAL_MS,
            grace_ms=tables.common.config.fenced_grace_ms,
            started_at=tables.common.started_at,
        )

    @property
    def label(self) -> str:
        """How log lines name this head: its identity in hex, or "a head without identity"."""
        return "a head without identity" if self.head_id is None else f"head {self.head_id:016x}"

    # SessionOwner

    def send_renew(self, session_id: int) -> None:
        """A lease machine asks for a grant: to the session's home, else the first connection
        of the same head."""
        session = self.table.get(session_id)
        if session is None:
            return
        home = session.home
        if home is not None and home.open:
            targets: Sequence[HeadConnection] = [home]
        else:
            targets = [c for c in self._tables.connections() if c.head_id == self.head_id][:1]
        for connection in targets:
            connection.send(LeaseRenewMsg(session_id, session.epoch))

    def self_fenced(self, session_id: int) -> None:
        """That session's lease expired (its machine fenced it): forget its context and stop
        its generations; its record and unacknowledged events stay for the grace period
        (section 6.4)."""
        log.warn(
            "session {session} of {head} fenced itself: its lease expired",
            session=session_id,
            head=self.label,
        )
        self._forget_context(session_id)
        self._tables.stop_generations(self, session_id)

    def gave_up(self, session_id: int, reason: str) -> None:
        """That session's machine fenced it because a bound was reached: forget its context."""
        log.warn(
            "fenced session {session} of {head}: {reason}",
            session=session_id,
            head=self.label,
            reason=reason,
        )
        self._forget_context(session_id)

    def orphaned(self, session_id: int) -> None:
        """That session stayed fenced for the grace period: no head came back for it, so its
        record and unacknowledged events go (section 6.4)."""
        log.info(
            "deleted session {session} of {head}: fenced for {grace} ms and not reclaimed",
            session=session_id,
            head=self.label,
            grace=self._tables.common.config.fenced_grace_ms,
        )
        self.table.delete(session_id, stop_machine=False)
        self._tables.stop_generations(self, session_id)
        self._tables.forget_if_idle(self)

    def _forget_context(self, session_id: int) -> None:
        session = self.table.get(session_id)
        if session is not None:
            session.forget_context()


class HeadTables:
    """Every session table of one node, by head identity (see the module)."""

    def __init__(
        self,
        common: NodeCommon,
        connections: Callable[[], Sequence[HeadConnection]],
        stop_generations: StopGenerations,
    ) -> None:
        self.common = common
        self.connections = connections
        """The node's connections past their handshake."""
        self.stop_generations = stop_generations
        self._heads: dict[int | None, HeadSessions] = {}

    def __iter__(self) -> Iterator[HeadSessions]:
        return iter(list(self._heads.values()))

    def of(self, head_id: int | None) -> HeadSessions:
        """The table of ``head_id``, created when that head first speaks."""
        head = self._heads.get(head_id)
        if head is None:
            head = self._heads[head_id] = HeadSessions(self, head_id)
        return head

    def peek(self, head_id: int | None) -> HeadSessions | None:
        """The table of ``head_id`` if the node keeps one (nothing is created)."""
        return self._heads.get(head_id)

    def forget_if_idle(self, head: HeadSessions) -> None:
        """Drop an empty table whose head has no connection left (bounded memory whatever
        identities heads invent)."""
        if head.head_id is None or len(head.table):
            return
        if any(c.head_id == head.head_id for c in self.connections()):
            return
        if self._heads.get(head.head_id) is head:
            del self._heads[head.head_id]

    def live_sessions(self) -> int:
        """Sessions held and not fenced, over every head: what ``max_sessions`` bounds."""
        return sum(1 for head in self._heads.values() for s in head.table if not s.fenced)

    def session_records(self) -> int:
        """Sessions held, fenced ones included, over every head."""
        return sum(len(head.table) for head in self._heads.values())

    def sessions_with_context(self) -> int:
        """Sessions holding a token context, over every head."""
        return sum(1 for head in self._heads.values() for s in head.table if s.context is not None)

    def contexts_of(self, head_id: int | None) -> Mapping[int, array[int]]:
        """Each session's token context, for that head's sessions that have one."""
        head = self._heads.get(head_id)
        if head is None:
            return {}
        return {s.session_id: s.context for s in head.table if s.context is not None}

    def make_room(self) -> None:
        """Delete the session fenced longest ago, of any head, for a new one (section 7.7)."""
        oldest: tuple[NodeSession[HeadConnection], HeadSessions] | None = None
        for head in self._heads.values():
            fenced = [s for s in head.table if s.fenced]
            session = min(fenced, key=lambda s: (s.fenced_at, s.session_id), default=None)
            if session is not None and (oldest is None or session.fenced_at < oldest[0].fenced_at):
                oldest = (session, head)
        if oldest is None:
            return
        session, head = oldest
        log.info(
            "deleted fenced session {session} of {head} to make room for a new session",
            session=session.session_id,
            head=head.label,
        )
        head.table.delete(session.session_id)
        self.stop_generations(head, session.session_id)
        self.forget_if_idle(head)

    def unacked_events(self, keys: frozenset[GenerationKey]) -> int:
        """Events of these generations still waiting for a WATERMARK_ACK."""
        total = 0
        for session_id, generation_id, head_id in keys:
            head = self._heads.get(head_id)
            if head is not None:
                total += head.table.unacked_events(session_id, generation_id)
        return total
