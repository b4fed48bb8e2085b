"""Tests of sfnode.node.sessions.AgentSession, the node's sessions of docs/protocol.md section 6.

They pin the upstream behaviours 8 to 11 of docs/protocol.md section 10, every rule of sections
6.2 to 6.5 (including the reconcile and lease-grant rules behind behaviours 16 and 17) and the
renewal throttle of decision D3.  Time is a ``Clock``: the lease timers that fire here are those
of the session's lease machine, the very one the node runs, so a change to its renew or expiry
timing fails these tests.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.linkf.wire import (
    Finish,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    GenerationWatermark,
    Lease,
    LeaseGrantMsg,
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
from sfnode.node.sessions import RENEW_INTERVAL_MS, AgentSession


class RecordingOwner:
    """The node's side of the lease machines: what they asked for, and at which millisecond."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.log: list[tuple[str, int, int]] = []

    def _now(self) -> int:
        return round(self.clock.seconds() * 1000)

    def send_renew(self, session_id: int) -> None:
        self.log.append(("renew", session_id, self._now()))

    def self_fenced(self, session_id: int) -> None:
        self.log.append(("fence", session_id, self._now()))

    def gave_up(self, session_id: int, reason: str) -> None:
        self.log.append((f"gave up: {reason}", session_id, self._now()))

    def renewals(self) -> list[tuple[int, int]]:
        """(session, ms) of every LEASE_RENEW asked for."""
        return [(s, t) for kind, s, t in self.log if kind == "renew"]

    def fences(self) -> list[tuple[int, int]]:
        """(session, ms) of every self-fence."""
        return [(s, t) for kind, s, t in self.log if kind == "fence"]


class Node:
    """An AgentSession on a Clock that tests move to absolute milliseconds."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.owner = RecordingOwner(self.clock)
        self.agent: AgentSession[object] = AgentSession(self.clock, self.owner)

    def at(self, ms: int) -> AgentSession[object]:
        """Move the clock to ``ms`` (never back), firing every timer due by then at its own
        time, so the owner logs the millisecond each timer was due."""
        target = ms / 1000
        assert target >= self.clock.seconds(), "time only moves forward"
        while True:
            due = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= target]
            if not due:
                break
            self.clock.advance(max(0.0, min(due) - self.clock.seconds()))
        self.clock.advance(target - self.clock.seconds())
        return self.agent


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


def next_seq(agent: AgentSession[object], session: int, generation: int) -> int:
    """The ``event_seq`` the generation's next event will carry."""
    entry = agent.generation(session, generation)
    assert entry is not None
    return entry.next_seq


def streaming(events: int = 0) -> Node:
    """Session 1 at epoch 5 (lease 1000/600 from 0) with generation 100 and ``events`` emitted."""
    node = Node()
    agent = node.agent
    assert agent.on_assign(assign(1, 5, 10))
    assert agent.on_generate(generate(1, 5, 11, 100))
    for i in range(events):
        assert agent.emit(1, 100, Tokens((i,))) is not None
    return node


class AssignTests(SynchronousTestCase):
    def test_assign_is_idempotent_and_epochs_absolute(self) -> None:
        """The same ASSIGN twice applies once; a lower epoch with a new command is refused (8)."""
        agent = Node().agent
        msg = assign(1, 5, 10)
        self.assertIsNotNone(agent.on_assign(msg))
        self.assertIsNone(agent.on_assign(msg))
        self.assertIsNone(agent.on_assign(assign(1, 4, 11)))
        self.assertEqual(agent.session_epoch(1), 5)

    def test_lower_epoch_does_not_consume_command(self) -> None:
        """A stale-epoch ASSIGN is refused before its command id is recorded."""
        agent = Node().agent
        agent.on_assign(assign(1, 5, 10))
        self.assertIsNone(agent.on_assign(assign(1, 4, 11)))
        self.assertIsNotNone(agent.on_append(1, 5, 11))

    def test_same_epoch_refreshes_lease_and_unfences(self) -> None:
        """Same epoch with a fresh command restarts the lease and lifts a self-fence."""
        node = Node()
        node.agent.on_assign(assign(1, 5, 10))
        self.assertTrue(node.at(1000).is_fenced(1))
        self.assertEqual(node.owner.fences(), [(1, 1000)])
        self.assertIsNotNone(node.at(1200).on_assign(assign(1, 5, 11)))
        self.assertFalse(node.agent.is_fenced(1))
        self.assertFalse(node.at(2199).is_fenced(1))
        self.assertTrue(node.at(2201).is_fenced(1))
        self.assertEqual(len(node.owner.fences()), 2)

    def test_higher_epoch_drops_older_generations(self) -> None:
        """A higher-epoch ASSIGN drops the session's generations of older epochs only."""
        agent = streaming(events=2).agent
        agent.on_assign(assign(2, 5, 20))
        agent.on_generate(generate(2, 5, 21, 100))
        self.assertIsNotNone(agent.on_assign(assign(1, 6, 12)))
        self.assertEqual(agent.session_epoch(1), 6)
        self.assertEqual(agent.generation_ids(1), [])
        self.assertEqual(agent.unacked_events(1, 100), 0)
        self.assertEqual(agent.generation_ids(2), [100])

    def test_commands_survive_epochs(self) -> None:
        """The command table is not reset by a new epoch: an old command id stays a replay."""
        agent = Node().agent
        agent.on_assign(assign(1, 5, 10))
        agent.on_append(1, 5, 11)
        agent.on_assign(assign(1, 6, 12))
        self.assertIsNone(agent.on_append(1, 6, 11))
        self.assertIsNone(agent.on_assign(assign(1, 7, 10)))

    def test_one_record_per_session(self) -> None:
        """ASSIGN, APPEND and GENERATE of one session return its one record, which holds its
        epoch, lease and generations."""
        agent = Node().agent
        record = agent.on_assign(assign(1, 5, 10, duration_ms=9000, renew_by_ms=7000))
        assert record is not None
        self.assertIs(agent.on_append(1, 5, 11), record)
        self.assertIs(agent.on_generate(generate(1, 5, 12, 100)), record)
        self.assertIs(agent.get(1), record)
        self.assertEqual((record.session_id, record.epoch), (1, 5))
        self.assertEqual((record.lease.duration_ms, record.lease.renew_by_ms), (9000, 7000))
        self.assertEqual(list(record.generations), [100])
        self.assertEqual(list(agent), [record])


class RevokeTests(SynchronousTestCase):
    def test_revoke(self) -> None:
        """REVOKE of an unknown or stale session is refused; otherwise it deletes everything."""
        agent = streaming(events=1).agent
        self.assertIsNone(agent.on_revoke(SessionRevokeMsg(99, 2, 5)))
        self.assertIsNone(agent.on_revoke(SessionRevokeMsg(99, 1, 4)))
        self.assertIsNotNone(agent.on_revoke(SessionRevokeMsg(99, 1, 5)))
        self.assertIsNone(agent.is_fenced(1))
        self.assertEqual(agent.session_ids(), [])
        self.assertEqual(agent.unacked_events(1, 100), 0)
        self.assertIsNone(agent.on_revoke(SessionRevokeMsg(99, 1, 5)))

    def test_revoke_command_is_checked(self) -> None:
        """REVOKE's command id is checked like any other: a replay of a known id (here the
        ASSIGN's) changes nothing, a fresh one applies, also with a higher epoch."""
        agent = Node().agent
        agent.on_assign(assign(1, 5, 10))
        self.assertIsNone(agent.on_revoke(SessionRevokeMsg(10, 1, 7)))
        self.assertTrue(agent.has_session(1))
        self.assertIsNotNone(agent.on_revoke(SessionRevokeMsg(11, 1, 7)))
        self.assertFalse(agent.has_session(1))
        self.assertIsNotNone(agent.on_assign(assign(1, 5, 10)))

    def test_revoke_deletes_fenced_session_and_stops_its_timers(self) -> None:
        """A fenced session is deleted by REVOKE like any other; a revoked session's lease
        machine leaves no timer behind."""
        node = streaming()
        self.assertTrue(node.at(1000).is_fenced(1))
        self.assertIsNotNone(node.agent.on_revoke(SessionRevokeMsg(0, 1, 5)))
        self.assertFalse(node.agent.has_session(1))
        node.agent.on_assign(assign(2, 1, 1))
        node.agent.on_revoke(SessionRevokeMsg(0, 2, 1))
        self.assertEqual(node.clock.getDelayedCalls(), [])


class AppendTests(SynchronousTestCase):
    def test_append_gated_on_epoch_session_command_and_fence(self) -> None:
        """APPEND needs the session, its exact epoch, a fresh command and no fence (10)."""
        node = Node()
        agent = node.agent
        agent.on_assign(assign(1, 5, 10))
        self.assertIsNotNone(agent.on_append(1, 5, 20))
        self.assertIsNone(agent.on_append(1, 5, 20))
        self.assertIsNone(agent.on_append(1, 4, 21))
        self.assertIsNone(agent.on_append(1, 6, 21))
        self.assertIsNone(agent.on_append(2, 5, 22))
        agent.on_generate(generate(1, 5, 30, 100))
        self.assertIsNone(node.at(5000).on_append(1, 5, 31))

    def test_refused_append_records_nothing(self) -> None:
        """A command id refused for a wrong epoch or a fence is not recorded."""
        node = Node()
        agent = node.agent
        agent.on_assign(assign(1, 5, 10))
        self.assertIsNone(agent.on_append(1, 4, 21))
        self.assertIsNotNone(agent.on_append(1, 5, 21))
        self.assertIsNone(node.at(1000).on_append(1, 5, 22))
        agent.on_assign(assign(1, 5, 23))
        self.assertIsNotNone(agent.on_append(1, 5, 22))


class GenerateTests(SynchronousTestCase):
    def test_replayed_generate_does_not_restart(self) -> None:
        """A replayed GENERATE is refused and the stream continues at event_seq 1 (9)."""
        agent = streaming().agent
        agent.emit(1, 100, Tokens((1,)))
        self.assertIsNone(agent.on_generate(generate(1, 5, 11, 100)))
        batch = agent.emit(1, 100, Tokens((2,)))
        assert batch is not None
        self.assertEqual(batch.events[0].event_seq, 1)

    def test_new_command_same_generation_keeps_entry(self) -> None:
        """A fresh command for an existing generation keeps its next_seq and buffer."""
        agent = streaming(events=2).agent
        self.assertIsNotNone(agent.on_generate(generate(1, 5, 12, 100)))
        self.assertEqual(next_seq(agent, 1, 100), 2)
        self.assertEqual(agent.unacked_events(1, 100), 2)

    def test_generate_gates(self) -> None:
        """GENERATE needs the session, its exact epoch and no fence."""
        node = Node()
        agent = node.agent
        self.assertIsNone(agent.on_generate(generate(1, 5, 11, 100)))
        agent.on_assign(assign(1, 5, 10))
        self.assertIsNone(agent.on_generate(generate(1, 4, 11, 100)))
        self.assertIsNone(agent.on_generate(generate(1, 6, 11, 100)))
        self.assertEqual(agent.generation_ids(1), [])
        self.assertIsNone(node.at(1000).on_generate(generate(1, 5, 11, 100)))
        self.assertEqual(agent.generation_ids(1), [])


class EmitTests(SynchronousTestCase):
    def test_emit_builds_one_event_per_batch(self) -> None:
        """emit numbers events from 0, carries the generation's epoch and buffers a copy."""
        agent = streaming().agent
        first = agent.emit(1, 100, Tokens((7, 8)))
        second = agent.emit(1, 100, Finish(2))
        self.assertEqual(first, TokenEventsMsg((TokenEvent(1, 5, 100, 0, Tokens((7, 8))),)))
        self.assertEqual(second, TokenEventsMsg((TokenEvent(1, 5, 100, 1, Finish(2)),)))
        self.assertEqual(agent.unacked_events(1, 100), 2)

    def test_emit_refusals(self) -> None:
        """emit refuses an unknown session or generation and a generation of another epoch."""
        agent = streaming().agent
        self.assertIsNone(agent.emit(2, 100, Tokens((1,))))
        self.assertIsNone(agent.emit(1, 101, Tokens((1,))))
        self.assertEqual(agent.unacked_events(1, 101), 0)


class WatermarkAckTests(SynchronousTestCase):
    def test_ack_releases_prefix(self) -> None:
        """WATERMARK_ACK of the right epoch releases the acknowledged events."""
        agent = streaming(events=3).agent
        agent.on_watermark_ack(WatermarkAckMsg(1, 5, 100, 1))
        self.assertEqual(agent.unacked_events(1, 100), 1)

    def test_ack_of_other_epoch_or_generation_ignored(self) -> None:
        """An ack for another epoch or an unknown generation releases nothing."""
        agent = streaming(events=3).agent
        agent.on_watermark_ack(WatermarkAckMsg(1, 4, 100, 2))
        agent.on_watermark_ack(WatermarkAckMsg(1, 5, 101, 2))
        agent.on_watermark_ack(WatermarkAckMsg(2, 5, 100, 2))
        self.assertEqual(agent.unacked_events(1, 100), 3)

    def test_ack_applies_to_fenced_session(self) -> None:
        """The session's fence is not consulted: a fenced session's events can still be acked."""
        node = streaming(events=2)
        node.at(1000).on_watermark_ack(WatermarkAckMsg(1, 5, 100, 0))
        self.assertTrue(node.agent.is_fenced(1))
        self.assertEqual(node.agent.unacked_events(1, 100), 1)


class LeaseTests(SynchronousTestCase):
    def test_lease_expiry_self_fences_and_retains(self) -> None:
        """Lease 1000/600: renewal asked at 600, self-fence at 1000 (not before), emit refused,
        event kept (11)."""
        node = streaming(events=1)
        node.at(599)
        self.assertEqual(node.owner.log, [])
        node.at(600)
        self.assertEqual(node.owner.renewals(), [(1, 600)])
        self.assertFalse(node.at(999).is_fenced(1))
        self.assertTrue(node.at(1000).is_fenced(1))
        self.assertEqual(node.owner.fences(), [(1, 1000)])
        self.assertIsNone(node.agent.emit(1, 100, Tokens((2,))))
        self.assertEqual(node.agent.unacked_events(1, 100), 1)
        node.at(5000)
        self.assertEqual(node.owner.fences(), [(1, 1000)])
        self.assertEqual(node.agent.session_epoch(1), 5)

    def test_fenced_session_asks_no_renewal(self) -> None:
        """Once fenced, a session asks for no renewal and its machine holds no timer."""
        node = streaming()
        node.at(1000)
        asked = len(node.owner.renewals())
        node.at(10_000)
        self.assertEqual(len(node.owner.renewals()), asked)
        self.assertEqual(node.clock.getDelayedCalls(), [])

    def test_grant_extends_lease(self) -> None:
        """A grant of the current epoch restarts the lease from its receipt: renewal 600 ms and
        expiry 1000 ms after the grant."""
        node = streaming()
        self.assertIsNotNone(node.at(800).on_lease_grant(LeaseGrantMsg(1, 5, 1000, 600)))
        node.at(1399)
        self.assertEqual(node.owner.renewals(), [(1, 600)])
        node.at(1400)
        self.assertEqual(node.owner.renewals(), [(1, 600), (1, 1400)])
        self.assertFalse(node.at(1799).is_fenced(1))
        self.assertTrue(node.at(1800).is_fenced(1))
        self.assertEqual(node.owner.fences(), [(1, 1800)])

    def test_stale_epoch_grant_ignored(self) -> None:
        """A grant for a superseded epoch never extends the new epoch's lease (item 17)."""
        node = Node()
        node.agent.on_assign(assign(1, 5, 10))
        node.at(200).on_assign(assign(1, 6, 11))
        self.assertIsNone(node.at(500).on_lease_grant(LeaseGrantMsg(1, 5, 60_000, 30_000)))
        self.assertFalse(node.at(1199).is_fenced(1))
        self.assertTrue(node.at(1201).is_fenced(1))

    def test_grant_for_fenced_or_unknown_session_ignored(self) -> None:
        """A grant neither revives a fenced session nor creates an unknown one."""
        node = streaming()
        agent = node.at(1000)
        self.assertIsNone(agent.on_lease_grant(LeaseGrantMsg(1, 5, 60_000, 30_000)))
        self.assertTrue(agent.is_fenced(1))
        self.assertIsNone(agent.on_lease_grant(LeaseGrantMsg(2, 5, 60_000, 30_000)))
        self.assertFalse(agent.has_session(2))

    def test_renew_and_grant_cycle(self) -> None:
        """Item 16's lease: 10000/8500 renewal due at 8.5 s; a grant then avoids the fence at
        12 s, and the fence comes 10 s after the grant."""
        node = Node()
        node.agent.on_assign(assign(1, 5, 10, duration_ms=10_000, renew_by_ms=8_500))
        node.at(8_499)
        self.assertEqual(node.owner.renewals(), [])
        node.at(8_500)
        self.assertEqual(node.owner.renewals(), [(1, 8_500)])
        node.at(9_000).on_lease_grant(LeaseGrantMsg(1, 5, 10_000, 8_500))
        self.assertFalse(node.at(12_000).is_fenced(1))
        self.assertFalse(node.at(18_999).is_fenced(1))
        self.assertTrue(node.at(19_001).is_fenced(1))

    def test_giving_up_fences_once_and_keeps_the_events(self) -> None:
        """give_up fences the session through its lease machine (the owner hears why, once);
        its unacknowledged events stay; a new ASSIGN un-fences it."""
        node = streaming(events=2)
        node.agent.give_up(1, "a bound")
        node.agent.give_up(1, "again")
        self.assertTrue(node.agent.is_fenced(1))
        self.assertEqual(node.owner.log, [("gave up: a bound", 1, 0)])
        self.assertEqual(node.agent.unacked_events(1, 100), 2)
        self.assertEqual(node.clock.getDelayedCalls(), [])
        node.agent.on_assign(assign(1, 5, 12))
        self.assertFalse(node.agent.is_fenced(1))


class RenewThrottleTests(SynchronousTestCase):
    def test_at_most_once_per_interval(self) -> None:
        """D3: a session in its renew window is asked for once a second, then fences."""
        node = Node()
        node.agent.on_assign(assign(1, 5, 10, duration_ms=10_000, renew_by_ms=5_000))
        for ms in range(0, 10_020, 20):
            node.at(ms)
        self.assertEqual(
            node.owner.renewals(), [(1, 5_000), (1, 6_000), (1, 7_000), (1, 8_000), (1, 9_000)]
        )
        self.assertEqual(node.owner.fences(), [(1, 10_000)])
        self.assertEqual(RENEW_INTERVAL_MS, 1000)

    def test_grant_resets_throttle(self) -> None:
        """After a grant, the next renew window asks at once, without waiting out the interval."""
        node = Node()
        node.agent.on_assign(assign(1, 5, 10, duration_ms=1000, renew_by_ms=100))
        node.at(100)
        self.assertEqual(node.owner.renewals(), [(1, 100)])
        node.at(150).on_lease_grant(LeaseGrantMsg(1, 5, 1000, 100))
        node.at(249)
        self.assertEqual(len(node.owner.renewals()), 1)
        node.at(251)
        self.assertEqual(len(node.owner.renewals()), 2)
        node.at(1000)
        self.assertEqual(len(node.owner.renewals()), 2)

    def test_assign_resets_throttle(self) -> None:
        """A refreshing ASSIGN is a new lease: its renew window asks at once."""
        node = Node()
        node.agent.on_assign(assign(1, 5, 10, duration_ms=1000, renew_by_ms=100))
        node.at(100)
        node.at(150).on_assign(assign(1, 5, 11, duration_ms=1000, renew_by_ms=100))
        node.at(251)
        self.assertEqual(len(node.owner.renewals()), 2)

    def test_throttle_is_per_session(self) -> None:
        """One session's request does not hold back another's."""
        node = Node()
        node.agent.on_assign(assign(1, 5, 10))
        node.at(50).on_assign(assign(2, 7, 10))
        node.at(700)
        self.assertEqual([s for s, _ in node.owner.renewals()], [1, 2])


class ReconcileTests(SynchronousTestCase):
    def test_unknown_session_echoes_lease_state(self) -> None:
        """An unknown session is not held and its lease state comes back as the head sent it."""
        agent = Node().at(7)
        lease_state = LeaseStateMsg(Lease(60_000, 30_000), 123)
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(9, 1, 5, (), lease_state),)))
        self.assertEqual(len(ack.sessions), 1)
        entry = ack.sessions[0]
        self.assertEqual((entry.session_id, entry.held, entry.retry_ranges), (9, False, ()))
        self.assertEqual(entry.lease_view, lease_state)
        self.assertEqual(batches, [])

    def test_held_without_retransmission(self) -> None:
        """Watermark 2 over seqs 0..2 is held with no ranges; lease_view is (0,0) + uptime."""
        agent = streaming(events=3).at(42)
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((100, 2),)),)))
        entry = ack.sessions[0]
        self.assertTrue(entry.held)
        self.assertEqual(entry.retry_ranges, ())
        self.assertEqual(entry.lease_view, LeaseStateMsg(Lease(0, 0), 42))
        self.assertEqual(batches, [])

    def test_retransmits_tail_in_one_batch(self) -> None:
        """The unacked tail past the head's watermark goes out as one batch with its range."""
        agent = streaming(events=5).agent
        agent.on_watermark_ack(WatermarkAckMsg(1, 5, 100, 0))
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((100, 2),)),)))
        self.assertEqual(ack.sessions[0].retry_ranges, (RetryRange(100, 3, 4),))
        self.assertEqual(len(batches), 1)
        self.assertEqual([e.event_seq for e in batches[0].events], [3, 4])
        self.assertEqual(agent.unacked_events(1, 100), 4)

    def test_none_watermark_retransmits_everything_buffered(self) -> None:
        """Watermark None means nothing committed: every buffered event is retransmitted."""
        agent = streaming(events=2).agent
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((100, None),)),)))
        self.assertEqual(ack.sessions[0].retry_ranges, (RetryRange(100, 0, 1),))
        self.assertEqual([e.event_seq for e in batches[0].events], [0, 1])

    def test_batches_follow_head_generation_order(self) -> None:
        """Several generations give one batch each, in the order of the head's list."""
        agent = streaming(events=1).agent
        agent.on_generate(generate(1, 5, 12, 200))
        agent.emit(1, 200, Tokens((9,)))
        ack, batches = agent.on_reconcile(
            ReconcileMsg((head_state(1, 5, 12, ((200, None), (300, None), (100, None))),))
        )
        self.assertEqual(
            ack.sessions[0].retry_ranges, (RetryRange(200, 0, 0), RetryRange(100, 0, 0))
        )
        self.assertEqual([b.events[0].generation_id for b in batches], [200, 100])

    def test_higher_head_epoch_fences_without_action(self) -> None:
        """A head epoch above the node's fences the session (not held, no retransmission) and
        its lease machine stops without a self-fence: no later renewal, no fence action."""
        node = streaming(events=2)
        agent = node.agent
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 6, 20, ((100, None),)),)))
        self.assertFalse(ack.sessions[0].held)
        self.assertEqual(batches, [])
        self.assertTrue(agent.is_fenced(1))
        node.at(5000)
        self.assertEqual(node.owner.log, [])
        self.assertEqual(agent.unacked_events(1, 100), 2)

    def test_lower_head_epoch_not_held_not_fenced(self) -> None:
        """A head epoch below the node's is not held but does not fence."""
        agent = streaming(events=1).agent
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 4, 20, ((100, None),)),)))
        self.assertFalse(ack.sessions[0].held)
        self.assertEqual(batches, [])
        self.assertFalse(agent.is_fenced(1))

    def test_fenced_session_not_held(self) -> None:
        """A self-fenced session reconciles as not held even at the same epoch."""
        agent = streaming(events=1).at(1000)
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((100, None),)),)))
        self.assertFalse(ack.sessions[0].held)
        self.assertEqual(batches, [])

    def test_trims_commands_below_head_watermark(self) -> None:
        """Reconcile keeps only command ids >= the head's command watermark."""
        agent = Node().agent
        agent.on_assign(assign(1, 5, 10))
        agent.on_append(1, 5, 11)
        agent.on_append(1, 5, 12)
        agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11),)))
        self.assertIsNotNone(agent.on_append(1, 5, 10))
        self.assertIsNone(agent.on_append(1, 5, 11))
        self.assertIsNone(agent.on_append(1, 5, 12))

    def test_zero_command_watermark_saturates(self) -> None:
        """A command watermark of 0 trims at 0 (saturating), keeping every positive id."""
        agent = Node().agent
        agent.on_assign(assign(1, 5, 10))
        agent.on_reconcile(ReconcileMsg((head_state(1, 5, 0),)))
        self.assertIsNone(agent.on_append(1, 5, 10))

    def test_reconcile_never_refreshes_lease(self) -> None:
        """Reconcile leaves the lease clock alone: the session still expires on time."""
        node = streaming()
        node.at(900).on_reconcile(ReconcileMsg((head_state(1, 5, 11),)))
        self.assertTrue(node.at(1000).is_fenced(1))
        self.assertEqual(node.owner.fences(), [(1, 1000)])

    def test_unknown_generation_skipped(self) -> None:
        """A generation the node does not keep contributes neither range nor batch."""
        agent = streaming().agent
        ack, batches = agent.on_reconcile(ReconcileMsg((head_state(1, 5, 11, ((7, None),)),)))
        self.assertTrue(ack.sessions[0].held)
        self.assertEqual((ack.sessions[0].retry_ranges, batches), ((), []))


class AccessorTests(SynchronousTestCase):
    def test_accessors(self) -> None:
        """The accessors report sessions, epochs, fences and generations, None when unknown."""
        agent = streaming(events=1).agent
        agent.on_assign(assign(3, 2, 1))
        self.assertEqual(agent.session_ids(), [1, 3])
        self.assertEqual(len(agent), 2)
        self.assertEqual(agent.session_epoch(3), 2)
        self.assertIsNone(agent.session_epoch(2))
        self.assertIsNone(agent.get(2))
        self.assertIs(agent.is_fenced(1), False)
        self.assertIsNone(agent.is_fenced(2))
        entry = agent.generation(1, 100)
        assert entry is not None
        self.assertEqual((entry.epoch, entry.next_seq), (5, 1))
        self.assertIsNone(agent.generation(1, 101))

    def test_time_base(self) -> None:
        """now_ms counts milliseconds from the creation of the session table."""
        node = Node()
        node.clock.advance(1.5)
        self.assertEqual(node.agent.now_ms(), 1500)

    def test_stop_all_leaves_no_timer(self) -> None:
        """stop_all (the node stops) cancels every lease timer; the records stay, and a new
        ASSIGN starts a session's lease again."""
        node = streaming()
        node.agent.on_assign(assign(2, 1, 1))
        node.agent.stop_all()
        self.assertEqual(node.clock.getDelayedCalls(), [])
        self.assertEqual(node.agent.session_ids(), [1, 2])
        node.agent.on_assign(assign(1, 5, 20))
        self.assertEqual(len(node.clock.getDelayedCalls()), 2)
