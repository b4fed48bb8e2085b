"""HeadSession: the head's bookkeeping for one Link F connection (docs/protocol.md
section 8).

It knows which sessions the head placed on the node (epoch, lease, command watermark, and what
is needed to place them again), which generations it asked for, and which token events it has
committed.  It builds the messages the head sends and classifies the token events the node sends
back through :class:`~sfnode.linkf.idempotency.EventDedup`, so every event is committed exactly once
and acknowledged with the highest contiguous seq.

This module is pure logic: it must never do I/O, read a clock, touch a reactor or allocate
epochs (epochs are process-wide, section 8 "Id spaces", and come in as arguments).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sfnode.linkf.idempotency import Accepted, AlreadyCommitted, EventDedup
from sfnode.linkf.wire import (
    AppendContentMsg,
    Constraint,
    Finish,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    GenerationWatermark,
    Lease,
    LeaseGrantMsg,
    LeaseRenewMsg,
    LeaseStateMsg,
    ReconcileAckMsg,
    ReconcileMsg,
    SessionAssignMsg,
    SessionReconcileState,
    SessionRevokeMsg,
    TokenEvent,
    TokenEventsMsg,
    Tokens,
    WatermarkAckMsg,
    encode_tokens,
)

Key = tuple[int, int, int]
"""``(session_id, epoch, generation_id)``: what events are deduplicated and committed under."""


@dataclass(slots=True)
class SessionRecord:
    """What the head knows about one session it placed on this connection's node."""

    epoch: int
    lease: Lease
    command_watermark: int
    """The last command id allocated for the session (sent as RECONCILE's watermark)."""
    params: bytes
    qos_class: int
    codec: str
    context: tuple[int, ...] | None = None
    """The complete token context last appended, or None when nothing was appended yet."""


@dataclass(frozen=True, slots=True)
class IngestedEvents:
    """What one TOKEN_EVENTS batch did: the acks to send and the events newly committed."""

    acks: list[WatermarkAckMsg]
    committed: list[TokenEvent]


class CommittedLog:
    """The head's WAL: every committed token event, per generation, in seq order."""

    def __init__(self) -> None:
        self._events: dict[Key, list[TokenEvent]] = {}

    def record(self, key: Key, event: TokenEvent) -> None:
        self._events.setdefault(key, []).append(event)

    def events(self, session_id: int, epoch: int, generation_id: int) -> list[TokenEvent]:
        """Every committed event of one generation, in seq order."""
        return list(self._events.get((session_id, epoch, generation_id), ()))

    def tokens(self, session_id: int, epoch: int, generation_id: int) -> list[int]:
        """The tokens of the committed ``Tokens`` events of one generation, in order."""
        tokens: list[int] = []
        for event in self._events.get((session_id, epoch, generation_id), ()):
            if isinstance(event.payload, Tokens):
                tokens.extend(event.payload.tokens)
        return tokens

    def finish(self, session_id: int, epoch: int, generation_id: int) -> int | None:
        """The reason of the committed ``Finish`` of one generation, or None."""
        for event in self._events.get((session_id, epoch, generation_id), ()):
            if isinstance(event.payload, Finish):
                return event.payload.reason
        return None

    def keys(self) -> list[Key]:
        return list(self._events)

    def forget(self, session_id: int, epoch: int, generation_id: int) -> None:
        """Drop one generation's committed events (the caller has used them)."""
        self._events.pop((session_id, epoch, generation_id), None)


class HeadSession:
    """Per-connection bookkeeping of the head (section 8); builds messages, never sends them."""

    def __init__(self, command_base: int = 1) -> None:
        if command_base < 1:
            raise ValueError("command ids start at 1 or above")
        self._next_command_id = command_base
        self._sessions: dict[int, SessionRecord] = {}
        self._tracked: dict[int, set[tuple[int, int]]] = {}
        """session -> {(epoch, generation)} the head still expects events for."""
        self._issued: dict[tuple[int, int], GenerateReqMsg] = {}
        self._dedup = EventDedup()
        self.wal = CommittedLog()
        """The events committed so far, per generation."""

    # ----------------------------------------------------------------------------------------
    # Queries

    @property
    def next_command_id(self) -> int:
        return self._next_command_id

    @property
    def dedup(self) -> EventDedup:
        return self._dedup

    def session(self, session_id: int) -> SessionRecord | None:
        """The record of a known session (do not mutate it), or None."""
        return self._sessions.get(session_id)

    def session_ids(self) -> list[int]:
        return list(self._sessions)

    def epoch_of(self, session_id: int) -> int | None:
        record = self._sessions.get(session_id)
        return None if record is None else record.epoch

    def tracked(self, session_id: int) -> list[tuple[int, int]]:
        """The ``(epoch, generation)`` pairs still tracked for a session, sorted."""
        return sorted(self._tracked.get(session_id, ()))

    def issued(self, session_id: int, generation_id: int) -> GenerateReqMsg | None:
        return self._issued.get((session_id, generation_id))

    def watermark(self, session_id: int, epoch: int, generation_id: int) -> int | None:
        """The highest contiguous seq committed for a generation, or None."""
        return self._dedup.watermark((session_id, epoch, generation_id))

    # ----------------------------------------------------------------------------------------
    # Commands

    def alloc_command(self, session_id: int) -> int:
        """The next command id; a known session's ``command_watermark`` becomes that id."""
        command_id = self._next_command_id
        self._next_command_id += 1
        record = self._sessions.get(session_id)
        if record is not None:
            record.command_watermark = command_id
        return command_id

    def assign_session(
        self,
        session_id: int,
        epoch: int,
        lease: Lease,
        *,
        params: bytes = b"",
        qos_class: int = 0,
        codec: str = "",
    ) -> SessionAssignMsg:
        """Place (or re-place) a session at ``epoch``: SESSION_ASSIGN with a new command id.

        ``params`` is the GenParams blob (``wire.encode_params``).  A stored context survives a
        re-assign so the caller can append it again under the new epoch.
        """
        previous = self._sessions.get(session_id)
        self._sessions[session_id] = SessionRecord(
            epoch=epoch,
            lease=lease,
            command_watermark=0,
            params=params,
            qos_class=qos_class,
            codec=codec,
            context=None if previous is None else previous.context,
        )
        self._dedup.set_session_epoch(session_id, epoch)
        for key in [k for k, m in self._issued.items() if k[0] == session_id and m.epoch < epoch]:
            del self._issued[key]
        tracked = self._tracked.get(session_id)
        if tracked:
            tracked.difference_update({t for t in tracked if t[0] < epoch})
        return self._assign_message(session_id)

    def reassign(self, session_id: int) -> SessionAssignMsg | None:
        """SESSION_ASSIGN again with the same epoch and stored settings, new command id (7.3)."""
        if session_id not in self._sessions:
            return None
        return self._assign_message(session_id)

    def _assign_message(self, session_id: int) -> SessionAssignMsg:
        record = self._sessions[session_id]
        return SessionAssignMsg(
            command_id=self.alloc_command(session_id),
            session_id=session_id,
            epoch=record.epoch,
            lease=record.lease,
            codec=record.codec,
            params=record.params,
            qos_class=record.qos_class,
            policy_ref=0,
        )

    def append(self, session_id: int, context: Sequence[int]) -> AppendContentMsg | None:
        """APPEND_CONTENT carrying ``context``, the session's COMPLETE token context (3.4).

        The context is stored (to re-append after a reconnect).  Unknown session: None.
        """
        record = self._sessions.get(session_id)
        if record is None:
            return None
        blocks = encode_tokens(context)  # checks every token before anything is stored
        record.context = tuple(context)
        return AppendContentMsg(
            command_id=self.alloc_command(session_id),
            session_id=session_id,
            epoch=record.epoch,
            blocks=blocks,
        )

    def reappend(self, session_id: int) -> AppendContentMsg | None:
        """APPEND_CONTENT of the stored context with a new command id; None if there is none."""
        record = self._sessions.get(session_id)
        if record is None or record.context is None:
            return None
        return AppendContentMsg(
            command_id=self.alloc_command(session_id),
            session_id=session_id,
            epoch=record.epoch,
            blocks=encode_tokens(record.context),
        )

    def context(self, session_id: int) -> tuple[int, ...] | None:
        record = self._sessions.get(session_id)
        return None if record is None else record.context

    def generate(
        self,
        session_id: int,
        generation_id: int,
        budgets: GenerationBudgetsMsg,
        request_class: int | None = None,
        constraint: Constraint | None = None,
    ) -> GenerateReqMsg | None:
        """GENERATE_REQ for ``generation_id``; a retry returns the SAME message (same command,
        same ``request_class``: None leaves the element out, docs/protocol.md section 12.2;
        same ``constraint``, section 12.3).

        Unknown session: None.
        """
        record = self._sessions.get(session_id)
        if record is None:
            return None
        issued = self._issued.get((session_id, generation_id))
        if issued is not None:
            return issued
        message = GenerateReqMsg(
            command_id=self.alloc_command(session_id),
            session_id=session_id,
            epoch=record.epoch,
            generation_id=generation_id,
            budgets=budgets,
            policy_ref=0,
            request_class=request_class,
            constraint=constraint,
        )
        self._issued[(session_id, generation_id)] = message
        self._tracked.setdefault(session_id, set()).add((record.epoch, generation_id))
        return message

    def revoke(self, session_id: int, *, epoch: int | None = None) -> SessionRevokeMsg | None:
        """SESSION_REVOKE for a known session, which the head then forgets (WAL kept).

        An unknown session gets a revoke only when ``epoch`` is given (a session placed over
        another connection, section 8); otherwise None.
        """
        record = self._sessions.get(session_id)
        if record is None:
            if epoch is None:
                return None
            return SessionRevokeMsg(self.alloc_command(session_id), session_id, epoch)
        command_id = self.alloc_command(session_id)
        del self._sessions[session_id]
        self._tracked.pop(session_id, None)
        for key in [k for k in self._issued if k[0] == session_id]:
            del self._issued[key]
        return SessionRevokeMsg(command_id, session_id, record.epoch)

    def retire_generation(self, session_id: int, generation_id: int) -> None:
        """The head is done with a generation: forget its dedup key, tracking and request."""
        record = self._sessions.get(session_id)
        if record is not None:
            self._dedup.retire_generation((session_id, record.epoch, generation_id))
        tracked = self._tracked.get(session_id)
        if tracked:
            tracked.difference_update({t for t in tracked if t[1] == generation_id})
            if not tracked:
                del self._tracked[session_id]
        self._issued.pop((session_id, generation_id), None)

    # ----------------------------------------------------------------------------------------
    # What the node sends

    def ingest(self, batch: TokenEventsMsg | Iterable[TokenEvent]) -> IngestedEvents:
        """Classify a batch of token events; see :meth:`on_token_events` for the rules."""
        events = batch.events if isinstance(batch, TokenEventsMsg) else tuple(batch)
        touched: dict[Key, None] = {}
        committed: list[TokenEvent] = []
        for event in events:
            key = (event.session_id, event.epoch, event.generation_id)
            outcome = self._dedup.accept(key, event.event_seq)
            if isinstance(outcome, Accepted):
                self.wal.record(key, event)
                self._tracked.setdefault(event.session_id, set()).add(
                    (event.epoch, event.generation_id)
                )
                committed.append(event)
                touched[key] = None
            elif isinstance(outcome, AlreadyCommitted):
                touched[key] = None
            # StaleEpoch and Gap: dropped without an ack.
        acks: list[WatermarkAckMsg] = []
        for key in touched:
            watermark = self._dedup.watermark(key)
            if watermark is not None:
                acks.append(WatermarkAckMsg(key[0], key[1], key[2], watermark))
        return IngestedEvents(acks, committed)

    def on_token_events(
        self, batch: TokenEventsMsg | Iterable[TokenEvent]
    ) -> list[WatermarkAckMsg]:
        """The WATERMARK_ACKs for one TOKEN_EVENTS batch (section 8).

        Per event: StaleEpoch is dropped silently; AlreadyCommitted is re-acknowledged but not
        committed; Accepted is committed to the WAL and acknowledged; Gap is dropped silently.
        One ack per touched key, carrying its highest contiguous seq.
        """
        return self.ingest(batch).acks

    def on_lease_renew(self, message: LeaseRenewMsg) -> LeaseGrantMsg | None:
        """A LEASE_GRANT when the session is known at that epoch, else nothing."""
        record = self._sessions.get(message.session_id)
        if record is None or record.epoch != message.epoch:
            return None
        return LeaseGrantMsg(
            message.session_id, record.epoch, record.lease.duration_ms, record.lease.renew_by_ms
        )

    def reconcile(self) -> ReconcileMsg:
        """RECONCILE for every known session: epoch, watermark, per-generation watermarks."""
        states: list[SessionReconcileState] = []
        for session_id, record in self._sessions.items():
            generations = sorted(
                g for e, g in self._tracked.get(session_id, ()) if e == record.epoch
            )
            states.append(
                SessionReconcileState(
                    session_id=session_id,
                    epoch=record.epoch,
                    lease_state=LeaseStateMsg(record.lease, 0),
                    command_watermark=record.command_watermark,
                    generation_watermarks=tuple(
                        GenerationWatermark(g, self._dedup.watermark((session_id, record.epoch, g)))
                        for g in generations
                    ),
                )
            )
        return ReconcileMsg(tuple(states))

    def on_reconcile_ack(self, ack: ReconcileAckMsg) -> list[int]:
        """The ids of the sessions the node does not hold (to be re-assigned)."""
        return [entry.session_id for entry in ack.sessions if not entry.held]
