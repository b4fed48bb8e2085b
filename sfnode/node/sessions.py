"""The node's sessions (docs/protocol.md section 6): one record per session, and the rules of Link F
that decide what the node may do with it.

:class:`AgentSession` holds one :class:`NodeSession` per session the node holds: its epoch, its
command table, its lease clock and lease machine, whether it is fenced, its token context and
GenParams, the connection that last spoke for it, and its generations' unacknowledged events.
It decides which ASSIGN, APPEND, GENERATE, REVOKE and LEASE_GRANT apply, which token events a
generation may emit (and keeps them for retransmission), and what a RECONCILE is answered.  One
instance is shared by every connection of a node.

Each session's lease machine (``sfnode.node.machines.SessionMachine``) is the only writer of its
``fenced`` flag: it un-fences on an accepted ASSIGN, and fences at lease expiry, on a RECONCILE
that names a higher epoch, or when the node gives up on the session.  Its timers read the
session's :class:`~sfnode.linkf.idempotency.LeaseClock`, on this object's millisecond clock.

This module never does I/O, never decodes a payload and never sends: it takes typed messages
of :mod:`sfnode.linkf.wire` and returns typed messages.  It reads time only from the clock it is
given, and what the lease machines want done (a LEASE_RENEW, forgetting a fenced session's
context) goes to the :class:`~sfnode.node.machines.SessionOwner` it is given.

Section numbers in this module are those of docs/protocol.md.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from twisted.internet.interfaces import IReactorTime

from sfnode.linkf.idempotency import CommandTable, GenerationKey, LeaseClock, RetryBuffer
from sfnode.linkf.wire import (
    GenerateReqMsg,
    GenParams,
    Lease,
    LeaseGrantMsg,
    LeaseStateMsg,
    ReconcileAckMsg,
    ReconcileMsg,
    RetryRange,
    SessionAssignMsg,
    SessionReconcileAck,
    SessionRevokeMsg,
    TokenEvent,
    TokenEventPayload,
    TokenEventsMsg,
    WatermarkAckMsg,
)
from sfnode.node.machines import SessionCore, SessionInputs, SessionMachine, SessionOwner

RENEW_INTERVAL_MS = 1000
"""Decision D3: at most one LEASE_RENEW per session per this many ms while renewal is due."""

_NO_LEASE = Lease(duration_ms=0, renew_by_ms=0)

C = TypeVar("C")
"""The type of a session's home connection (the node's ``NodeConnection``)."""


@dataclass(slots=True)
class GenerationEntry:
    """What the node keeps of one generation: its epoch, next event seq and unacked events."""

    epoch: int
    next_seq: int = 0
    retry: RetryBuffer[TokenEvent] = field(default_factory=RetryBuffer)


@dataclass(eq=False)
class NodeSession(Generic[C]):
    """Everything the node holds for one session (docs/protocol.md section 6.1)."""

    session_id: int
    epoch: int
    commands: CommandTable
    lease: LeaseClock
    """The lease as last received (ASSIGN or LEASE_GRANT), on the node's millisecond clock."""
    machine: SessionInputs = field(init=False)
    fenced: bool = False
    """Written only by the lease machine's outputs."""
    fenced_at: int = 0
    """When it was last fenced (node milliseconds); written with ``fenced``."""
    context: array[int] | None = None
    """The token context of the last accepted APPEND, 4 bytes a token; None before one."""
    params: GenParams = field(default_factory=GenParams)
    home: C | None = None
    """The connection that last spoke for this session; its LEASE_RENEWs go there first."""
    generations: dict[int, GenerationEntry] = field(default_factory=dict)
    """By generation id, WITHOUT the epoch: a replayed GENERATE continues its ``next_seq``."""

    def forget_context(self) -> None:
        """Drop the context and GenParams (a fenced or revoked session needs neither)."""
        self.context = None
        self.params = GenParams()


class AgentSession(Generic[C]):
    """Every session a node holds, keyed by session id (docs/protocol.md section 6)."""

    def __init__(
        self,
        clock: IReactorTime,
        owner: SessionOwner,
        renew_interval_ms: int = RENEW_INTERVAL_MS,
        *,
        grace_ms: int = 0,
        started_at: float | None = None,
    ) -> None:
        self._clock = clock
        self._started_at = clock.seconds() if started_at is None else started_at
        self._owner = owner
        self._renew_interval_ms = renew_interval_ms
        self._grace_ms = grace_ms
        """How long a fenced session is kept before it is deleted (0: no time limit, 6.4)."""
        self._sessions: dict[int, NodeSession[C]] = {}

    def now_ms(self) -> int:
        """Monotonic milliseconds since ``started_at`` (default: this object's creation): the
        node's time base, shared by the tables of all its heads when they pass the same."""
        return int((self._clock.seconds() - self._started_at) * 1000)

    def _lease(self, duration_ms: int, renew_by_ms: int) -> LeaseClock:
        return LeaseClock(self.now_ms(), duration_ms, renew_by_ms)

    # ---------------------------------------------------------------- commands from the head

    def on_assign(self, msg: SessionAssignMsg) -> NodeSession[C] | None:
        """SESSION_ASSIGN (6.2): create, re-epoch, or refresh-and-unfence a session.

        Returns the session when the ASSIGN applied, else None.
        """
        lease = msg.lease
        session = self._sessions.get(msg.session_id)
        if session is None:
            commands = CommandTable()
            commands.apply(msg.command_id)
            session = NodeSession(
                msg.session_id,
                msg.epoch,
                commands,
                self._lease(lease.duration_ms, lease.renew_by_ms),
            )
            session.machine = SessionMachine(
                SessionCore(
                    clock=self._clock,
                    now_ms=self.now_ms,
                    owner=self._owner,
                    session=session,
                    renew_interval_ms=self._renew_interval_ms,
                    grace_ms=self._grace_ms,
                )
            )
            self._sessions[msg.session_id] = session
            session.machine.assigned()
            return session
        if msg.epoch < session.epoch:
            return None
        if not session.commands.apply(msg.command_id):
            return None
        if msg.epoch > session.epoch:
            session.generations = {
                g: entry for g, entry in session.generations.items() if entry.epoch >= msg.epoch
            }
        session.epoch = msg.epoch
        session.lease = self._lease(lease.duration_ms, lease.renew_by_ms)
        session.machine.assigned()
        return session

    def on_revoke(self, msg: SessionRevokeMsg) -> NodeSession[C] | None:
        """SESSION_REVOKE (6.2): forget the session and its generations unless stale or a
        replay.

        Its command id is checked like any other (a known id is a replay and changes nothing);
        nothing is left to record it in.  Returns the forgotten session (its lease machine
        stopped), or None when the REVOKE did not apply.
        """
        session = self._sessions.get(msg.session_id)
        if session is None or msg.epoch < session.epoch:
            return None
        if not session.commands.apply(msg.command_id):
            return None
        return self.delete(msg.session_id)

    def delete(self, session_id: int, *, stop_machine: bool = True) -> NodeSession[C] | None:
        """Forget a session now: its record, commands, generations and unacknowledged events
        (a revoke, or a fenced session whose place a new one needs); its machine stops.  A
        session whose lease machine ended its grace period (6.4) is deleted with
        ``stop_machine`` False: the machine has no timer left and is not told again."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return None
        if stop_machine:
            session.machine.stopped()
        session.forget_context()
        return session

    def on_append(self, session_id: int, epoch: int, command_id: int) -> NodeSession[C] | None:
        """APPEND_CONTENT (6.2): same epoch, not fenced, fresh command (recorded last).

        Returns the session when the APPEND applied (the caller stores the context), else None.
        """
        session = self._sessions.get(session_id)
        if session is None or epoch != session.epoch or session.fenced:
            return None
        return session if session.commands.apply(command_id) else None

    def on_generate(self, msg: GenerateReqMsg) -> NodeSession[C] | None:
        """GENERATE_REQ (6.2): like an append; an existing generation entry is kept as is."""
        session = self._sessions.get(msg.session_id)
        if session is None or msg.epoch != session.epoch or session.fenced:
            return None
        if not session.commands.apply(msg.command_id):
            return None
        if msg.generation_id not in session.generations:
            session.generations[msg.generation_id] = GenerationEntry(epoch=msg.epoch)
        return session

    # ---------------------------------------------------------------- token events

    def emit(
        self, session_id: int, generation_id: int, payload: TokenEventPayload
    ) -> TokenEventsMsg | None:
        """One event of a generation, buffered for retransmission (6.3); None when refused.

        Refused when the session is unknown or fenced, or the generation is unknown or belongs
        to another epoch than the session's.
        """
        session = self._sessions.get(session_id)
        if session is None or session.fenced:
            return None
        generation = session.generations.get(generation_id)
        if generation is None or generation.epoch != session.epoch:
            return None
        event = TokenEvent(
            session_id=session_id,
            epoch=generation.epoch,
            generation_id=generation_id,
            event_seq=generation.next_seq,
            payload=payload,
        )
        generation.next_seq += 1
        generation.retry.push(event.event_seq, event)
        return TokenEventsMsg(events=(event,))

    def on_watermark_ack(self, msg: WatermarkAckMsg) -> None:
        """WATERMARK_ACK (6.3): release acknowledged events of a generation of that epoch."""
        generation = self.generation(msg.session_id, msg.generation_id)
        if generation is not None and generation.epoch == msg.epoch:
            generation.retry.ack(msg.watermark)

    # ---------------------------------------------------------------- leases

    def on_lease_grant(self, msg: LeaseGrantMsg) -> NodeSession[C] | None:
        """LEASE_GRANT (6.4): restart the lease clock and its timers; the session when applied.

        A grant for another epoch (a superseded one) or for a fenced session changes nothing.
        """
        session = self._sessions.get(msg.session_id)
        if session is None or msg.epoch != session.epoch or session.fenced:
            return None
        session.lease = self._lease(msg.duration_ms, msg.renew_by_ms)
        session.machine.granted()
        return session

    def give_up(self, session_id: int, reason: str) -> None:
        """Fence a session the node gives up on (a bound was reached); its events are kept.

        Like a lease expiry without the clock: the lease machine fences it and has the owner
        forget its context, unless it is already fenced.  A new ASSIGN un-fences it as usual.
        """
        session = self._sessions.get(session_id)
        if session is not None:
            session.machine.give_up(reason)

    # ---------------------------------------------------------------- reconcile

    def on_reconcile(self, msg: ReconcileMsg) -> tuple[ReconcileAckMsg, list[TokenEventsMsg]]:
        """RECONCILE (6.5): the ack, then one retransmission batch per generation with a tail.

        Never refreshes a lease and never removes buffered events.  ``lease_view.elapsed_ms``
        of a known session carries the node's uptime, as upstream does.
        """
        now_ms = self.now_ms()
        acks: list[SessionReconcileAck] = []
        retransmissions: list[TokenEventsMsg] = []
        for state in msg.sessions:
            session = self._sessions.get(state.session_id)
            if session is None:
                acks.append(
                    SessionReconcileAck(
                        session_id=state.session_id,
                        held=False,
                        retry_ranges=(),
                        lease_view=state.lease_state,
                    )
                )
                continue
            if state.epoch > session.epoch:
                session.machine.superseded()
            session.commands.trim(max(state.command_watermark - 1, 0))
            held = state.epoch == session.epoch and not session.fenced
            ranges: list[RetryRange] = []
            if held:
                for mark in state.generation_watermarks:
                    generation = session.generations.get(mark.generation_id)
                    if generation is None:
                        continue
                    from_seq = 0 if mark.watermark is None else mark.watermark + 1
                    tail = generation.retry.retransmit_from(from_seq)
                    if not tail:
                        continue
                    ranges.append(
                        RetryRange(
                            generation_id=mark.generation_id,
                            from_seq=tail[0].event_seq,
                            to_seq=tail[-1].event_seq,
                        )
                    )
                    retransmissions.append(TokenEventsMsg(events=tuple(tail)))
            acks.append(
                SessionReconcileAck(
                    session_id=state.session_id,
                    held=held,
                    retry_ranges=tuple(ranges),
                    lease_view=LeaseStateMsg(lease=_NO_LEASE, elapsed_ms=now_ms),
                )
            )
        return ReconcileAckMsg(sessions=tuple(acks)), retransmissions

    # ---------------------------------------------------------------- the node stops

    def stop_all(self) -> None:
        """Stop every lease machine's timers (the node stops); the records stay.

        A session's next accepted ASSIGN starts its lease again.
        """
        for session in self._sessions.values():
            session.machine.stopped()

    # ---------------------------------------------------------------- accessors

    def get(self, session_id: int) -> NodeSession[C] | None:
        """The session's record; None when the node does not hold it."""
        return self._sessions.get(session_id)

    def __iter__(self) -> Iterator[NodeSession[C]]:
        """Every session the node holds (fenced ones included), in id order."""
        return iter([self._sessions[s] for s in sorted(self._sessions)])

    def __len__(self) -> int:
        return len(self._sessions)

    def is_fenced(self, session_id: int) -> bool | None:
        """Whether the session is fenced; None when the node does not hold it."""
        session = self._sessions.get(session_id)
        return None if session is None else session.fenced

    def unacked_events(self, session_id: int, generation_id: int) -> int:
        """Events of the generation still waiting for a WATERMARK_ACK (0 when unknown)."""
        generation = self.generation(session_id, generation_id)
        return 0 if generation is None else len(generation.retry)

    def session_epoch(self, session_id: int) -> int | None:
        """The session's current epoch; None when the node does not hold it."""
        session = self._sessions.get(session_id)
        return None if session is None else session.epoch

    def has_session(self, session_id: int) -> bool:
        return session_id in self._sessions

    def session_ids(self) -> list[int]:
        """Every session the node holds (fenced ones included), in id order."""
        return sorted(self._sessions)

    def generation_ids(self, session_id: int) -> list[int]:
        """The generations kept for a session (any epoch), in id order."""
        session = self._sessions.get(session_id)
        return [] if session is None else sorted(session.generations)

    def generation(self, session_id: int, generation_id: int) -> GenerationEntry | None:
        """What is kept of a generation (the epoch it was started under, the ``event_seq`` its
        next event will carry, its unacknowledged events); None when it is not kept."""
        session = self._sessions.get(session_id)
        return None if session is None else session.generations.get(generation_id)


__all__ = [
    "RENEW_INTERVAL_MS",
    "AgentSession",
    "GenerationEntry",
    "GenerationKey",
    "NodeSession",
]
