"""The node's session state of Link F (LINKF section 5): epochs, commands, leases, fences, events.

:class:`AgentSession` decides what a node may do for each session: which ASSIGN, APPEND and
GENERATE commands apply, which token events it may emit and keep for retransmission, when it asks
for a lease renewal and when it fences itself because its lease ran out, and what it answers to a
RECONCILE.  One instance is shared by every connection of a node; the caller passes the time.

This module is pure logic: it must never do I/O, read a clock, touch a reactor, or decode a
payload.  It takes typed messages of :mod:`sfnode.wire` and returns typed messages; sending them
is the caller's business.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from sfnode.idempotency import CommandTable, LeaseClock, RetryBuffer
from sfnode.wire import (
    GenerateReqMsg,
    Lease,
    LeaseGrantMsg,
    LeaseRenewMsg,
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

RENEW_INTERVAL_MS = 1000
"""Decision D3: at most one LEASE_RENEW per session per this many ms while renewal is due."""

_NO_LEASE = Lease(duration_ms=0, renew_by_ms=0)


@dataclass(frozen=True, slots=True)
class SelfFence:
    """The action :meth:`AgentSession.poll` yields when a session's lease expired."""

    session_id: int


@dataclass(slots=True)
class _Session:
    epoch: int
    clock: LeaseClock
    commands: CommandTable
    fenced: bool = False
    renew_requested_at_ms: int | None = None
    """When :meth:`AgentSession.needs_renew` last asked for this lease (D3 throttle)."""


@dataclass(slots=True)
class _Generation:
    epoch: int
    next_seq: int = 0
    retry: RetryBuffer[TokenEvent] = field(default_factory=RetryBuffer)


def _clock(now_ms: int, duration_ms: int, renew_by_ms: int) -> LeaseClock:
    return LeaseClock(received_at_ms=now_ms, duration_ms=duration_ms, renew_by_ms=renew_by_ms)


class AgentSession:
    """Every session a node holds, and every generation's unacknowledged events (LINKF 5).

    ``sessions`` is keyed by session id; ``generations`` by ``(session, generation)`` WITHOUT the
    epoch, so a generation id continues its ``next_seq`` across a replayed GENERATE.
    """

    def __init__(self, renew_interval_ms: int = RENEW_INTERVAL_MS) -> None:
        self._renew_interval_ms = renew_interval_ms
        self._sessions: dict[int, _Session] = {}
        self._generations: dict[tuple[int, int], _Generation] = {}

    # ---------------------------------------------------------------- commands from the head

    def on_assign(self, msg: SessionAssignMsg, now_ms: int) -> bool:
        """SESSION_ASSIGN (5.3.1): create, re-epoch, or refresh-and-unfence a session."""
        lease = msg.lease
        session = self._sessions.get(msg.session_id)
        if session is None:
            commands = CommandTable()
            commands.apply(msg.command_id)
            self._sessions[msg.session_id] = _Session(
                epoch=msg.epoch,
                clock=_clock(now_ms, lease.duration_ms, lease.renew_by_ms),
                commands=commands,
            )
            return True
        if msg.epoch < session.epoch:
            return False
        if not session.commands.apply(msg.command_id):
            return False
        if msg.epoch > session.epoch:
            self._drop_generations(msg.session_id, below_epoch=msg.epoch)
        session.epoch = msg.epoch
        session.fenced = False
        session.clock = _clock(now_ms, lease.duration_ms, lease.renew_by_ms)
        session.renew_requested_at_ms = None
        return True

    def on_revoke(self, msg: SessionRevokeMsg) -> bool:
        """SESSION_REVOKE (5.3.2): forget the session and its generations unless stale.

        The command id a REVOKE carries is neither checked nor recorded (5.2).
        """
        session = self._sessions.get(msg.session_id)
        if session is None or msg.epoch < session.epoch:
            return False
        del self._sessions[msg.session_id]
        self._drop_generations(msg.session_id)
        return True

    def on_append(self, session_id: int, epoch: int, command_id: int) -> bool:
        """APPEND_CONTENT (5.3.3): same epoch, not fenced, fresh command (recorded last)."""
        session = self._sessions.get(session_id)
        if session is None or epoch != session.epoch or session.fenced:
            return False
        return session.commands.apply(command_id)

    def on_generate(self, msg: GenerateReqMsg) -> bool:
        """GENERATE_REQ (5.3.4): like an append; an existing generation entry is kept as is."""
        session = self._sessions.get(msg.session_id)
        if session is None or msg.epoch != session.epoch or session.fenced:
            return False
        if not session.commands.apply(msg.command_id):
            return False
        key = (msg.session_id, msg.generation_id)
        if key not in self._generations:
            self._generations[key] = _Generation(epoch=msg.epoch)
        return True

    # ---------------------------------------------------------------- token events

    def emit(
        self, session_id: int, generation_id: int, payload: TokenEventPayload
    ) -> TokenEventsMsg | None:
        """One event of a generation, buffered for retransmission (5.3.5); None when refused.

        Refused when the session is unknown or fenced, or the generation is unknown or belongs
        to another epoch than the session's.
        """
        session = self._sessions.get(session_id)
        if session is None or session.fenced:
            return None
        generation = self._generations.get((session_id, generation_id))
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
        """WATERMARK_ACK (5.3.6): release acknowledged events of a generation of that epoch."""
        generation = self._generations.get((msg.session_id, msg.generation_id))
        if generation is not None and generation.epoch == msg.epoch:
            generation.retry.ack(msg.watermark)

    # ---------------------------------------------------------------- leases

    def needs_renew(self, now_ms: int) -> list[LeaseRenewMsg]:
        """LEASE_RENEW messages due now (5.3.7), at most one per session per renew interval.

        A session is due when it is not fenced and its lease is inside the renew window but
        not expired; the throttle of D3 then holds it back until the interval has passed since
        its last request or a grant arrived.
        """
        renewals: list[LeaseRenewMsg] = []
        for session_id, session in self._iter_sessions():
            if session.fenced:
                continue
            clock = session.clock
            if not clock.must_renew(now_ms) or clock.expired(now_ms):
                continue
            last = session.renew_requested_at_ms
            if last is not None and now_ms - last < self._renew_interval_ms:
                continue
            session.renew_requested_at_ms = now_ms
            renewals.append(LeaseRenewMsg(session_id=session_id, epoch=session.epoch))
        return renewals

    def on_lease_grant(self, msg: LeaseGrantMsg, now_ms: int) -> bool:
        """LEASE_GRANT (5.3.8): restart the lease clock; True when it applied.

        A grant for another epoch (a superseded one) or for a fenced session changes nothing.
        """
        session = self._sessions.get(msg.session_id)
        if session is None or msg.epoch != session.epoch or session.fenced:
            return False
        session.clock = _clock(now_ms, msg.duration_ms, msg.renew_by_ms)
        session.renew_requested_at_ms = None
        return True

    def poll(self, now_ms: int) -> list[SelfFence]:
        """Fence every session whose lease expired (5.3.9); their state and events are kept."""
        actions: list[SelfFence] = []
        for session_id, session in self._iter_sessions():
            if not session.fenced and session.clock.expired(now_ms):
                session.fenced = True
                actions.append(SelfFence(session_id))
        return actions

    def fence(self, session_id: int) -> bool:
        """Fence a session the node gives up on (a bound was reached); its events are kept.

        Like a lease expiry (5.3.9) without the clock: False when the session is unknown or
        already fenced.  A new ASSIGN (or LEASE_GRANT) un-fences it as usual.
        """
        session = self._sessions.get(session_id)
        if session is None or session.fenced:
            return False
        session.fenced = True
        return True

    # ---------------------------------------------------------------- reconcile

    def on_reconcile(
        self, msg: ReconcileMsg, now_ms: int
    ) -> tuple[ReconcileAckMsg, list[TokenEventsMsg]]:
        """RECONCILE (5.3.10): the ack, then one retransmission batch per generation with a tail.

        Never refreshes a lease and never removes buffered events.  ``lease_view.elapsed_ms``
        of a known session carries ``now_ms`` (the node's uptime), as upstream does.
        """
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
                session.fenced = True
            session.commands.trim(max(state.command_watermark - 1, 0))
            held = state.epoch == session.epoch and not session.fenced
            ranges: list[RetryRange] = []
            if held:
                for mark in state.generation_watermarks:
                    generation = self._generations.get((state.session_id, mark.generation_id))
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

    # ---------------------------------------------------------------- accessors

    def is_fenced(self, session_id: int) -> bool | None:
        """Whether the session is fenced; None when the node does not hold it."""
        session = self._sessions.get(session_id)
        return None if session is None else session.fenced

    def unacked_events(self, session_id: int, generation_id: int) -> int:
        """Events of the generation still waiting for a WATERMARK_ACK (0 when unknown)."""
        generation = self._generations.get((session_id, generation_id))
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
        return sorted(g for s, g in self._generations if s == session_id)

    def generation_epoch(self, session_id: int, generation_id: int) -> int | None:
        """The epoch a generation was started under; None when it is not kept."""
        generation = self._generations.get((session_id, generation_id))
        return None if generation is None else generation.epoch

    def next_event_seq(self, session_id: int, generation_id: int) -> int | None:
        """The ``event_seq`` the generation's next event will carry; None when not kept."""
        generation = self._generations.get((session_id, generation_id))
        return None if generation is None else generation.next_seq

    # ---------------------------------------------------------------- internals

    def _iter_sessions(self) -> Iterator[tuple[int, _Session]]:
        for session_id in sorted(self._sessions):
            yield session_id, self._sessions[session_id]

    def _drop_generations(self, session_id: int, below_epoch: int | None = None) -> None:
        doomed = [
            key
            for key, generation in self._generations.items()
            if key[0] == session_id and (below_epoch is None or generation.epoch < below_epoch)
        ]
        for key in doomed:
            del self._generations[key]
