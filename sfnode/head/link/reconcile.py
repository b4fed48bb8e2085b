"""One reconnect's reconcile, as a pure class (docs/protocol.md sections 6.5 and 8).

After a redial the head sends RECONCILE and the link stays in its reconciling phase until the
node's RECONCILE_ACK has arrived and every event its retry ranges promise has come in.
:class:`Reconcile` keeps that phase's facts: which sessions the node still holds, which
generations it showed it still has, and which events are still owed.  It decides which
generations suspended by the drop continue.

This module must never send a frame, hold a reactor or a clock, or touch a link: the link
feeds it what arrives and asks it what follows.
"""

from __future__ import annotations

from collections.abc import Callable

from sfnode.linkf.wire import PayloadError, ReconcileAckMsg

MAX_RETRY_RANGE = 1 << 20
"""The most seqs one RetryRange may ask the head to wait for."""

GenerationKey = tuple[int, int]
"""(session, generation)."""
EventKey = tuple[int, int, int]
"""(session, generation, event seq)."""


class Reconcile:
    """What a reconnect's RECONCILE is waiting for, and what it learnt."""

    def __init__(self) -> None:
        self.seen: set[EventKey] = set()
        """Every event that arrived since RECONCILE was sent."""
        self.missing: set[EventKey] | None = None
        """Retry-range seqs not arrived yet; None until RECONCILE_ACK."""
        self.held: list[int] = []
        """Sessions the node still holds."""
        self.not_held: list[int] = []
        """Sessions the head knows and the node no longer holds (assigned again)."""
        self.retried: set[GenerationKey] = set()
        """Every generation a RetryRange named."""

    @property
    def acknowledged(self) -> bool:
        """RECONCILE_ACK has arrived."""
        return self.missing is not None

    @property
    def done(self) -> bool:
        """RECONCILE_ACK has arrived and every event it promised has too."""
        return self.missing is not None and not self.missing

    def saw(self, session_id: int, generation_id: int, event_seq: int) -> None:
        """An event arrived (committed or not)."""
        key = (session_id, generation_id, event_seq)
        self.seen.add(key)
        if self.missing is not None:
            self.missing.discard(key)

    def acknowledge(
        self,
        message: ReconcileAckMsg,
        known: Callable[[int], bool],
        not_held: Callable[[ReconcileAckMsg], list[int]],
    ) -> None:
        """Take the node's RECONCILE_ACK: ``known`` says whether the head still has a session;
        ``not_held`` (the head session's own reading of the ack) lists the sessions to assign
        again.  A second ack is ignored.

        :raises PayloadError: a retry range that runs backwards or asks for more than
            :data:`MAX_RETRY_RANGE` events (the node's stream cannot be trusted).
        """
        if self.acknowledged:
            return
        missing: set[EventKey] = set()
        for entry in message.sessions:
            if not known(entry.session_id):
                continue
            if entry.held:
                self.held.append(entry.session_id)
            self.retried.update((entry.session_id, r.generation_id) for r in entry.retry_ranges)
            for r in entry.retry_ranges:
                if r.to_seq < r.from_seq or r.to_seq - r.from_seq >= MAX_RETRY_RANGE:
                    raise PayloadError(f"unreasonable retry range {r}")
                missing.update(
                    (entry.session_id, r.generation_id, seq)
                    for seq in range(r.from_seq, r.to_seq + 1)
                )
        self.not_held = [s for s in not_held(message) if known(s)]
        self.missing = missing - self.seen

    def keeps(self, key: GenerationKey, committed: bool) -> bool:
        """Whether a generation suspended by the drop continues: its session is held, and the
        node showed it has it (a retry range, an event since RECONCILE) or it had committed
        events before the drop (``committed``)."""
        evidence = key in self.retried or key in {(s, g) for s, g, _ in self.seen}
        return key[0] in self.held and (evidence or committed)
