"""Tests of sfnode.agent_session.AgentSession, the node's session state of LINKF section 5.

They pin LINKF section 8 items 8 to 11, every operation of 5.3 (including the reconcile and
lease-grant rules behind items 16 and 17) and the renewal throttle of decision D3.  Pure logic:
time is an integer passed in, no reactor is involved.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.agent_session import RENEW_INTERVAL_MS, AgentSession, SelfFence
from sfnode.wire import (
    Finish,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    GenerationWatermark,
    Lease,
    LeaseGrantMsg,
    LeaseRenewMsg,
    LeaseStateMsg,
    ReconcileMsg,
    RetryRange,
    SessionAssignMsg,
    SessionReconcileState,
    SessionRevokeMsg,
    TokenEvent,
    TokenEventsMsg,
    Tokens,
    WatermarkAckMsg,
)


def assign(
    session: int, epoch: int, command: int, duration_ms: int = 1000, renew_by_ms: int = 600
) -> SessionAssignMsg:
    return SessionAssignMsg(
        command_id=command,
        session_id=session,
        epoch=epoch,
        lease=Lease(duration_ms=duration_ms, renew_by_ms=renew_by_ms),
        codec="chatml",
        params=b"",
        qos_class=0,
        policy_ref=0,
    )


def generate(session: int, epoch: int, command: int, generation: int) -> GenerateReqMsg:
    return GenerateReqMsg(
        command_id=command,
        session_id=session,
        epoch=epoch,
        generation_id=generation,
        budgets=GenerationBudgetsMsg(max_new_tokens=4, max_wall_ms=100),
        policy_ref=0,
    )


def head_state(
    session: int,
    epoch: int,
    command_watermark: int = 0,
    marks: tuple[tuple[int, int | None], ...] = (),
    lease_state: LeaseStateMsg | None = None,
) -> SessionReconcileState:
    return SessionReconcileState(
        session_id=session,
        epoch=epoch,
        lease_state=lease_state or LeaseStateMsg(Lease(60_000, 30_000), 0),
        command_watermark=command_watermark,
        generation_watermarks=tuple(GenerationWatermark(g, w) for g, w in marks),
    )


def streaming(events: int = 0) -> AgentSession:
    """Session 1 at epoch 5 (lease 1000/600 from 0) with generation 100 and ``events`` emitted."""
    agent = AgentSession()
    assert agent.on_assign(assign(1, 5, 10), 0)
    assert agent.on_generate(generate(1, 5, 11, 100))
    for i in range(events):
        assert agent.emit(1, 100, Tokens((i,))) is not None
    return agent


class AssignTests(SynchronousTestCase):
    def test_assign_is_idempotent_and_epochs_absolute(self) -> None:
        """The same ASSIGN twice applies once; a lower epoch with a new command is refused (8)."""
        agent = AgentSession()
        msg = assign(1, 5, 10)
        self.assertTrue(agent.on_assign(msg, 0))
        self.assertFalse(agent.on_assign(msg, 1))
        self.assertFalse(agent.on_assign(assign(1, 4, 11), 2))
        self.assertEqual(agent.session_epoch(1), 5)

    def test_lower_epoch_does_not_consume_command(self) -> None:
        """A stale-epoch ASSIGN is refused before its command id is recorded."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        self.assertFalse(agent.on_assign(assign(1, 4, 11), 0))
        self.assertTrue(agent.on_append(1, 5, 11))

    def test_same_epoch_refreshes_lease_and_unfences(self) -> None:
        """Same epoch with a fresh command restarts the lease and lifts a self-fence."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        self.assertEqual(agent.poll(1000), [SelfFence(1)])
        self.assertTrue(agent.is_fenced(1))
        self.assertTrue(agent.on_assign(assign(1, 5, 11), 1200))
        self.assertFalse(agent.is_fenced(1))
        self.assertEqual(agent.poll(2100), [])
        self.assertEqual(agent.poll(2200), [SelfFence(1)])

    def test_higher_epoch_drops_older_generations(self) -> None:
        """A higher-epoch ASSIGN drops the session's generations of older epochs only."""
        agent = streaming(events=2)
        agent.on_assign(assign(2, 5, 20), 0)
        agent.on_generate(generate(2, 5, 21, 100))
        self.assertTrue(agent.on_assign(assign(1, 6, 12), 10))
        self.assertEqual(agent.session_epoch(1), 6)
        self.assertEqual(agent.generation_ids(1), [])
        self.assertEqual(agent.unacked_events(1, 100), 0)
        self.assertEqual(agent.generation_ids(2), [100])

    def test_commands_survive_epochs(self) -> None:
        """The command table is not reset by a new epoch: an old command id stays a replay."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        agent.on_append(1, 5, 11)
        agent.on_assign(assign(1, 6, 12), 0)
        self.assertFalse(agent.on_append(1, 6, 11))
        self.assertFalse(agent.on_assign(assign(1, 7, 10), 0))


class RevokeTests(SynchronousTestCase):
    def test_revoke(self) -> None:
        """REVOKE of an unknown or stale session is refused; otherwise it deletes everything."""
        agent = streaming(events=1)
        self.assertFalse(agent.on_revoke(SessionRevokeMsg(99, 2, 5)))
        self.assertFalse(agent.on_revoke(SessionRevokeMsg(99, 1, 4)))
        self.assertTrue(agent.on_revoke(SessionRevokeMsg(99, 1, 5)))
        self.assertIsNone(agent.is_fenced(1))
        self.assertEqual(agent.session_ids(), [])
        self.assertEqual(agent.unacked_events(1, 100), 0)
        self.assertFalse(agent.on_revoke(SessionRevokeMsg(99, 1, 5)))

    def test_revoke_command_not_recorded(self) -> None:
        """REVOKE's command id is neither checked nor recorded; a higher epoch also applies."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        self.assertTrue(agent.on_revoke(SessionRevokeMsg(10, 1, 7)))
        self.assertTrue(agent.on_assign(assign(1, 5, 10), 0))

    def test_revoke_deletes_fenced_session(self) -> None:
        """A fenced session is deleted by REVOKE like any other."""
        agent = streaming()
        agent.poll(1000)
        self.assertTrue(agent.on_revoke(SessionRevokeMsg(0, 1, 5)))
        self.assertFalse(agent.has_session(1))


class AppendTests(SynchronousTestCase):
    def test_append_gated_on_epoch_session_command_and_fence(self) -> None:
        """APPEND needs the session, its exact epoch, a fresh command and no fence (10)."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        self.assertTrue(agent.on_append(1, 5, 20))
        self.assertFalse(agent.on_append(1, 5, 20))
        self.assertFalse(agent.on_append(1, 4, 21))
        self.assertFalse(agent.on_append(1, 6, 21))
        self.assertFalse(agent.on_append(2, 5, 22))
        agent.on_generate(generate(1, 5, 30, 100))
        agent.poll(5000)
        self.assertFalse(agent.on_append(1, 5, 31))

    def test_refused_append_records_nothing(self) -> None:
        """A command id refused for a wrong epoch or a fence is not recorded."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        self.assertFalse(agent.on_append(1, 4, 21))
        self.assertTrue(agent.on_append(1, 5, 21))
        agent.poll(1000)
        self.assertFalse(agent.on_append(1, 5, 22))
        agent.on_assign(assign(1, 5, 23), 1000)
        self.assertTrue(agent.on_append(1, 5, 22))


class GenerateTests(SynchronousTestCase):
    def test_replayed_generate_does_not_restart(self) -> None:
        """A replayed GENERATE is refused and the stream continues at event_seq 1 (9)."""
        agent = streaming()
        agent.emit(1, 100, Tokens((1,)))
        self.assertFalse(agent.on_generate(generate(1, 5, 11, 100)))
        batch = agent.emit(1, 100, Tokens((2,)))
        assert batch is not None
        self.assertEqual(batch.events[0].event_seq, 1)

    def test_new_command_same_generation_keeps_entry(self) -> None:
        """A fresh command for an existing generation keeps its next_seq and buffer."""
        agent = streaming(events=2)
        self.assertTrue(agent.on_generate(generate(1, 5, 12, 100)))
        self.assertEqual(agent.next_event_seq(1, 100), 2)
        self.assertEqual(agent.unacked_events(1, 100), 2)

    def test_generate_gates(self) -> None:
        """GENERATE needs the session, its exact epoch and no fence."""
        agent = AgentSession()
        self.assertFalse(agent.on_generate(generate(1, 5, 11, 100)))
        agent.on_assign(assign(1, 5, 10), 0)
        self.assertFalse(agent.on_generate(generate(1, 4, 11, 100)))
        self.assertFalse(agent.on_generate(generate(1, 6, 11, 100)))
        self.assertEqual(agent.generation_ids(1), [])
        agent.poll(1000)
        self.assertFalse(agent.on_generate(generate(1, 5, 11, 100)))
        self.assertEqual(agent.generation_ids(1), [])


class EmitTests(SynchronousTestCase):
    def test_emit_builds_one_event_per_batch(self) -> None:
        """emit numbers events from 0, carries the generation's epoch and buffers a copy."""
        agent = streaming()
        first = agent.emit(1, 100, Tokens((7, 8)))
        second = agent.emit(1, 100, Finish(2))
        self.assertEqual(first, TokenEventsMsg((TokenEvent(1, 5, 100, 0, Tokens((7, 8))),)))
        self.assertEqual(second, TokenEventsMsg((TokenEvent(1, 5, 100, 1, Finish(2)),)))
        self.assertEqual(agent.unacked_events(1, 100), 2)

    def test_emit_refusals(self) -> None:
        """emit refuses an unknown session or generation and a generation of another epoch."""
        agent = streaming()
        self.assertIsNone(agent.emit(2, 100, Tokens((1,))))
        self.assertIsNone(agent.emit(1, 101, Tokens((1,))))
        self.assertEqual(agent.unacked_events(1, 101), 0)


class WatermarkAckTests(SynchronousTestCase):
    def test_ack_releases_prefix(self) -> None:
        """WATERMARK_ACK of the right epoch releases the acknowledged events."""
        agent = streaming(events=3)
        agent.on_watermark_ack(WatermarkAckMsg(1, 5, 100, 1))
        self.assertEqual(agent.unacked_events(1, 100), 1)

    def test_ack_of_other_epoch_or_generation_ignored(self) -> None:
        """An ack for another epoch or an unknown generation releases nothing."""
        agent = streaming(events=3)
        agent.on_watermark_ack(WatermarkAckMsg(1, 4, 100, 2))
        agent.on_watermark_ack(WatermarkAckMsg(1, 5, 101, 2))
        agent.on_watermark_ack(WatermarkAckMsg(2, 5, 100, 2))
        self.assertEqual(agent.unacked_events(1, 100), 3)

    def test_ack_applies_to_fenced_session(self) -> None:
        """The session's fence is not consulted: a fenced session's events can still be acked."""
        agent = streaming(events=2)
        agent.poll(1000)
        agent.on_watermark_ack(WatermarkAckMsg(1, 5, 100, 0))
        self.assertEqual(agent.unacked_events(1, 100), 1)


class LeaseTests(SynchronousTestCase):
    def test_lease_expiry_self_fences_and_retains(self) -> None:
        """Lease 1000/600: renewal due at 700, fence at 1500, emit refused, event kept (11)."""
        agent = streaming(events=1)
        self.assertEqual(agent.needs_renew(599), [])
        self.assertEqual(agent.needs_renew(700), [LeaseRenewMsg(1, 5)])
        self.assertEqual(agent.poll(1500), [SelfFence(1)])
        self.assertIsNone(agent.emit(1, 100, Tokens((2,))))
        self.assertEqual(agent.unacked_events(1, 100), 1)
        self.assertEqual(agent.poll(1600), [])
        self.assertEqual(agent.session_epoch(1), 5)

    def test_fenced_or_expired_session_asks_no_renewal(self) -> None:
        """A session past expiry (fenced or not yet polled) is not asked for."""
        agent = streaming()
        self.assertEqual(agent.needs_renew(1000), [])
        agent.poll(1000)
        self.assertEqual(agent.needs_renew(900), [])

    def test_grant_extends_lease(self) -> None:
        """A grant of the current epoch restarts the clock from its receipt."""
        agent = streaming()
        self.assertTrue(agent.on_lease_grant(LeaseGrantMsg(1, 5, 1000, 600), 800))
        self.assertEqual(agent.poll(1700), [])
        self.assertEqual(agent.needs_renew(1300), [])
        self.assertEqual(agent.needs_renew(1400), [LeaseRenewMsg(1, 5)])
        self.assertEqual(agent.poll(1800), [SelfFence(1)])

    def test_stale_epoch_grant_ignored(self) -> None:
        """A grant for a superseded epoch never extends the new epoch's lease (item 17)."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        agent.on_assign(assign(1, 6, 11), 200)
        self.assertFalse(agent.on_lease_grant(LeaseGrantMsg(1, 5, 60_000, 30_000), 500))
        self.assertEqual(agent.poll(1199), [])
        self.assertEqual(agent.poll(1200), [SelfFence(1)])

    def test_grant_for_fenced_or_unknown_session_ignored(self) -> None:
        """A grant neither revives a fenced session nor creates an unknown one."""
        agent = streaming()
        agent.poll(1000)
        self.assertFalse(agent.on_lease_grant(LeaseGrantMsg(1, 5, 60_000, 30_000), 1000))
        self.assertTrue(agent.is_fenced(1))
        self.assertFalse(agent.on_lease_grant(LeaseGrantMsg(2, 5, 60_000, 30_000), 1000))
        self.assertFalse(agent.has_session(2))

    def test_renew_and_grant_cycle(self) -> None:
        """Item 16's lease: 10000/8500 renewal due at 8.5 s; a grant then avoids the fence."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10, duration_ms=10_000, renew_by_ms=8_500), 0)
        self.assertEqual(agent.needs_renew(8_499), [])
        self.assertEqual(agent.needs_renew(8_500), [LeaseRenewMsg(1, 5)])
        agent.on_lease_grant(LeaseGrantMsg(1, 5, 10_000, 8_500), 9_000)
        self.assertEqual(agent.poll(12_000), [])
        self.assertEqual(agent.poll(19_000), [SelfFence(1)])


class RenewThrottleTests(SynchronousTestCase):
    def test_at_most_once_per_interval(self) -> None:
        """D3: a session in its renew window is asked for at most once per 1000 ms."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10, duration_ms=10_000, renew_by_ms=5_000), 0)
        asked = [t for t in range(5_000, 10_000, 20) if agent.needs_renew(t)]
        self.assertEqual(asked, [5_000, 6_000, 7_000, 8_000, 9_000])
        self.assertEqual(RENEW_INTERVAL_MS, 1000)

    def test_grant_resets_throttle(self) -> None:
        """After a grant, the next renew window asks at once, without waiting out the interval."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10, duration_ms=1000, renew_by_ms=100), 0)
        self.assertEqual(len(agent.needs_renew(100)), 1)
        agent.on_lease_grant(LeaseGrantMsg(1, 5, 1000, 100), 150)
        self.assertEqual(agent.needs_renew(249), [])
        self.assertEqual(agent.needs_renew(250), [LeaseRenewMsg(1, 5)])
        self.assertEqual(agent.needs_renew(260), [])

    def test_assign_resets_throttle(self) -> None:
        """A refreshing ASSIGN is a new lease: its renew window asks at once."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10, duration_ms=1000, renew_by_ms=100), 0)
        agent.needs_renew(100)
        agent.on_assign(assign(1, 5, 11, duration_ms=1000, renew_by_ms=100), 150)
        self.assertEqual(agent.needs_renew(250), [LeaseRenewMsg(1, 5)])

    def test_throttle_is_per_session(self) -> None:
        """One session's request does not hold back another's."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        agent.on_assign(assign(2, 7, 10), 50)
        self.assertEqual(agent.needs_renew(600), [LeaseRenewMsg(1, 5)])
        self.assertEqual(agent.needs_renew(650), [LeaseRenewMsg(2, 7)])
        self.assertEqual(agent.needs_renew(700), [])


class ReconcileTests(SynchronousTestCase):
    def test_unknown_session_echoes_lease_state(self) -> None:
        """An unknown session is not held and its lease state comes back as the head sent it."""
        agent = AgentSession()
        lease_state = LeaseStateMsg(Lease(60_000, 30_000), 123)
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(9, 1, 5, (), lease_state),)), 7)
        self.assertEqual(len(ack.sessions), 1)
        entry = ack.sessions[0]
        self.assertEqual((entry.session_id, entry.held, entry.retry_ranges), (9, False, ()))
        self.assertEqual(entry.lease_view, lease_state)
        self.assertEqual(batches, [])

    def test_held_without_retransmission(self) -> None:
        """Watermark 2 over seqs 0..2 is held with no ranges; lease_view is (0,0) + uptime."""
        agent = streaming(events=3)
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((100, 2),)),)), 42)
        entry = ack.sessions[0]
        self.assertTrue(entry.held)
        self.assertEqual(entry.retry_ranges, ())
        self.assertEqual(entry.lease_view, LeaseStateMsg(Lease(0, 0), 42))
        self.assertEqual(batches, [])

    def test_retransmits_tail_in_one_batch(self) -> None:
        """The unacked tail past the head's watermark goes out as one batch with its range."""
        agent = streaming(events=5)
        agent.on_watermark_ack(WatermarkAckMsg(1, 5, 100, 0))
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((100, 2),)),)), 0)
        self.assertEqual(ack.sessions[0].retry_ranges, (RetryRange(100, 3, 4),))
        self.assertEqual(len(batches), 1)
        self.assertEqual([e.event_seq for e in batches[0].events], [3, 4])
        self.assertEqual(agent.unacked_events(1, 100), 4)

    def test_none_watermark_retransmits_everything_buffered(self) -> None:
        """Watermark None means nothing committed: every buffered event is retransmitted."""
        agent = streaming(events=2)
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((100, None),)),)), 0)
        self.assertEqual(ack.sessions[0].retry_ranges, (RetryRange(100, 0, 1),))
        self.assertEqual([e.event_seq for e in batches[0].events], [0, 1])

    def test_batches_follow_head_generation_order(self) -> None:
        """Several generations give one batch each, in the order of the head's list."""
        agent = streaming(events=1)
        agent.on_generate(generate(1, 5, 12, 200))
        agent.emit(1, 200, Tokens((9,)))
        ack, batches = agent.on_reconcile(
            ReconcileMsg((head_state(1, 5, 12, ((200, None), (300, None), (100, None))),)), 0
        )
        self.assertEqual(
            ack.sessions[0].retry_ranges, (RetryRange(200, 0, 0), RetryRange(100, 0, 0))
        )
        self.assertEqual([b.events[0].generation_id for b in batches], [200, 100])

    def test_higher_head_epoch_fences_without_action(self) -> None:
        """A head epoch above the node's fences the session, not held, no retransmission."""
        agent = streaming(events=2)
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 6, 20, ((100, None),)),)), 0)
        self.assertFalse(ack.sessions[0].held)
        self.assertEqual(batches, [])
        self.assertTrue(agent.is_fenced(1))
        self.assertEqual(agent.poll(5000), [])
        self.assertEqual(agent.unacked_events(1, 100), 2)

    def test_lower_head_epoch_not_held_not_fenced(self) -> None:
        """A head epoch below the node's is not held but does not fence."""
        agent = streaming(events=1)
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 4, 20, ((100, None),)),)), 0)
        self.assertFalse(ack.sessions[0].held)
        self.assertEqual(batches, [])
        self.assertFalse(agent.is_fenced(1))

    def test_fenced_session_not_held(self) -> None:
        """A self-fenced session reconciles as not held even at the same epoch."""
        agent = streaming(events=1)
        agent.poll(1000)
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((100, None),)),)), 0)
        self.assertFalse(ack.sessions[0].held)
        self.assertEqual(batches, [])

    def test_trims_commands_below_head_watermark(self) -> None:
        """Reconcile keeps only command ids >= the head's command watermark."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        agent.on_append(1, 5, 11)
        agent.on_append(1, 5, 12)
        agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11),)), 0)
        self.assertTrue(agent.on_append(1, 5, 10))
        self.assertFalse(agent.on_append(1, 5, 11))
        self.assertFalse(agent.on_append(1, 5, 12))

    def test_zero_command_watermark_saturates(self) -> None:
        """A command watermark of 0 trims at 0 (saturating), keeping every positive id."""
        agent = AgentSession()
        agent.on_assign(assign(1, 5, 10), 0)
        agent.on_reconcile(ReconcileMsg((head_state(1, 5, 0),)), 0)
        self.assertFalse(agent.on_append(1, 5, 10))

    def test_reconcile_never_refreshes_lease(self) -> None:
        """Reconcile leaves the lease clock alone: the session still expires on time."""
        agent = streaming()
        agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11),)), 900)
        self.assertEqual(agent.poll(1000), [SelfFence(1)])

    def test_unknown_generation_skipped(self) -> None:
        """A generation the node does not keep contributes neither range nor batch."""
        agent = streaming()
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((7, None),)),)), 0)
        self.assertTrue(ack.sessions[0].held)
        self.assertEqual((ack.sessions[0].retry_ranges, batches), ((), []))


class AccessorTests(SynchronousTestCase):
    def test_accessors(self) -> None:
        """The accessors report sessions, epochs, fences and generations, None when unknown."""
        agent = streaming(events=1)
        agent.on_assign(assign(3, 2, 1), 0)
        self.assertEqual(agent.session_ids(), [1, 3])
        self.assertEqual(agent.session_epoch(3), 2)
        self.assertIsNone(agent.session_epoch(2))
        self.assertIs(agent.is_fenced(1), False)
        self.assertIsNone(agent.is_fenced(2))
        self.assertEqual(agent.generation_epoch(1, 100), 5)
        self.assertIsNone(agent.generation_epoch(1, 101))
        self.assertIsNone(agent.next_event_seq(1, 101))
        self.assertEqual(agent.next_event_seq(1, 100), 1)
