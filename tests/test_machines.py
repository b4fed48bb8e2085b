"""Each machine of ``sfnode.node.machines`` alone, with a recording owner and a ``Clock``.

The lease machine is also driven through the session rules that build it, exactly as the node
runs it, in tests/test_agent_session.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.generation import EngineStop, GenerationResult, TokenBatch, TokenLogprob
from sfnode.linkf.idempotency import GenerationKey, LeaseClock
from sfnode.linkf.wire import (
    FINISH_CANCELLED,
    FINISH_DETAIL_CLOSED,
    FINISH_EOS,
    FINISH_EXPIRED,
    FINISH_LENGTH,
    FINISH_REFUSED,
    Frame,
    Hello,
    LinkRole,
    MsgType,
)
from sfnode.node.machines import (
    ConnectionCore,
    ConnectionMachine,
    DrainCore,
    DrainMachine,
    GenerationCore,
    GenerationMachine,
    SessionCore,
    SessionMachine,
    trace_machine,
)

HELLO = Frame(int(MsgType.HELLO), 1, Hello((2, 2), LinkRole.HEAD_DAEMON, b"").payload())
FRAME = Frame(int(MsgType.WATERMARK_ACK), 1, b"")


class RecordingConnection:
    """Records what the connection machine asks of its owner."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.log: list[str] = []

    def check_hello(self, frame: Frame) -> str | None:
        self.log.append("check_hello")
        return self.refuse

    def send_hello_ack(self) -> None:
        self.log.append("send_hello_ack")

    def send_status(self) -> None:
        self.log.append("send_status")

    def serve(self, frame: Frame) -> None:
        self.log.append(f"serve {frame.seq}")

    def close(self, reason: str) -> None:
        self.log.append(f"close {reason}")

    def ended(self) -> None:
        self.log.append("ended")


class ConnectionMachineTests(SynchronousTestCase):
    def build(
        self, refuse: str | None = None, handshake_ms: int = 300, idle_ms: int = 400
    ) -> tuple[Clock, RecordingConnection, object]:
        clock = Clock()
        owner = RecordingConnection(refuse)
        machine = ConnectionMachine(ConnectionCore(clock, owner, handshake_ms, idle_ms, 2000))
        machine.connected()
        return clock, owner, machine

    def test_hello_is_answered_and_frames_are_served(self) -> None:
        """An accepted HELLO gets HELLO_ACK_F; later frames are served in order."""
        _clock, owner, machine = self.build()
        machine.frame(Frame(int(MsgType.KEEPALIVE), 9, b""))  # type: ignore[attr-defined]
        machine.hello(HELLO)  # type: ignore[attr-defined]
        machine.frame(Frame(int(MsgType.WATERMARK_ACK), 2, b""))  # type: ignore[attr-defined]
        self.assertEqual(owner.log, ["check_hello", "send_hello_ack", "serve 2"])

    def test_a_hello_after_the_handshake_is_activity_only(self) -> None:
        """A second HELLO is neither checked nor served, but it restarts the idle deadline."""
        clock, owner, machine = self.build(idle_ms=400)
        machine.hello(HELLO)  # type: ignore[attr-defined]
        clock.advance(0.3)
        machine.hello(Frame(int(MsgType.HELLO), 2, b"\xc1"))  # type: ignore[attr-defined]
        clock.advance(0.3)
        self.assertEqual(owner.log, ["check_hello", "send_hello_ack"])
        clock.advance(0.1)
        self.assertEqual(owner.log[-2:], ["close dropped an idle connection", "ended"])

    def test_refused_hello_closes_with_the_reason(self) -> None:
        """A HELLO that fails a check closes the connection, naming the check, and sends nothing."""
        _clock, owner, machine = self.build(refuse="peer is not a head daemon")
        machine.hello(HELLO)  # type: ignore[attr-defined]
        self.assertEqual(
            owner.log,
            ["check_hello", "close refused the handshake: peer is not a head daemon", "ended"],
        )
        machine.frame(FRAME)  # type: ignore[attr-defined]
        self.assertEqual(len(owner.log), 3)

    def test_silent_peer_dropped_after_handshake_timeout(self) -> None:
        """No HELLO within the handshake timeout: the connection is dropped, not before."""
        clock, owner, _machine = self.build(handshake_ms=300)
        clock.advance(0.299)
        self.assertEqual(owner.log, [])
        clock.advance(0.001)
        self.assertEqual(owner.log[0][:31], "close dropped a silent connecti")

    def test_zero_handshake_timeout_waits_forever(self) -> None:
        """A handshake timeout of 0 never drops a silent connection."""
        clock, owner, _machine = self.build(handshake_ms=0)
        clock.advance(10_000)
        self.assertEqual(owner.log, [])

    def test_idle_timeout_counts_from_the_last_frame(self) -> None:
        """Each frame restarts the idle timeout; silence for the whole timeout drops it."""
        clock, owner, machine = self.build(idle_ms=400)
        machine.hello(HELLO)  # type: ignore[attr-defined]
        clock.advance(0.3)
        machine.frame(FRAME)  # type: ignore[attr-defined]
        clock.advance(0.3)
        self.assertNotIn("close dropped an idle connection", owner.log)
        clock.advance(0.1)
        self.assertIn("close dropped an idle connection", owner.log)
        self.assertEqual(owner.log[-1], "ended")

    def test_status_every_interval_until_lost(self) -> None:
        """NODE_STATUS goes out every 2 s while serving and stops when the connection is lost."""
        clock, owner, machine = self.build(idle_ms=0)
        machine.hello(HELLO)  # type: ignore[attr-defined]
        clock.advance(2.0)
        clock.advance(2.0)
        self.assertEqual(owner.log.count("send_status"), 2)
        machine.lost()  # type: ignore[attr-defined]
        clock.advance(10.0)
        self.assertEqual(owner.log.count("send_status"), 2)
        self.assertEqual(owner.log[-1], "ended")
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_trace_reports_transitions(self) -> None:
        """The trace hook names machine[old].input -> [new] for every transition."""
        clock = Clock()
        owner = RecordingConnection()
        machine = ConnectionMachine(ConnectionCore(clock, owner, 300, 400, 2000))
        seen: list[tuple[str, str, str]] = []
        trace_machine(machine, "connection", lambda *t: seen.append(t))
        machine.connected()
        machine.hello(HELLO)  # type: ignore[attr-defined]
        self.assertEqual(
            seen,
            [
                ("connection[new]", "connected", "[awaiting_hello]"),
                ("connection[awaiting_hello]", "hello", "[awaiting_hello]"),
                ("connection[awaiting_hello]", "_hello_accepted", "[serving]"),
            ],
        )


@dataclass
class Lease:
    """The part of a session record the lease machine reads and writes."""

    session_id: int
    lease: LeaseClock
    fenced: bool = False


class RecordingSession:
    """Records what a lease machine asks of its owner, with the time it asked."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.log: list[tuple[str, float]] = []

    def send_renew(self, session_id: int) -> None:
        self.log.append(("renew", round(self.clock.seconds(), 3)))

    def self_fenced(self, session_id: int) -> None:
        self.log.append(("fence", round(self.clock.seconds(), 3)))

    def gave_up(self, session_id: int, reason: str) -> None:
        self.log.append((f"gave up: {reason}", round(self.clock.seconds(), 3)))


class SessionMachineTests(SynchronousTestCase):
    def build(self) -> tuple[Clock, RecordingSession, Lease, object]:
        clock = Clock()
        owner = RecordingSession(clock)
        record = Lease(7, LeaseClock(0, 0, 0))

        def now_ms() -> int:
            return int(clock.seconds() * 1000)

        machine = SessionMachine(SessionCore(clock, now_ms, owner, record, 1000))
        return clock, owner, record, machine

    def lease(self, clock: Clock, record: Lease, duration_ms: int, renew_by_ms: int) -> None:
        """What the session rules do before telling the machine: store the lease as received."""
        record.lease = LeaseClock(int(clock.seconds() * 1000), duration_ms, renew_by_ms)

    def test_renewals_are_throttled_then_the_lease_fences(self) -> None:
        """Lease 10000/8000: renew at 8 s, again once a second (D3), self-fence at 10 s."""
        clock, owner, record, machine = self.build()
        self.lease(clock, record, 10_000, 8_000)
        machine.assigned()  # type: ignore[attr-defined]
        clock.advance(7.999)
        self.assertEqual(owner.log, [])
        clock.advance(0.001)
        self.assertEqual(owner.log, [("renew", 8.0)])
        clock.advance(0.999)
        self.assertEqual(owner.log, [("renew", 8.0)])
        clock.advance(0.001)
        self.assertFalse(record.fenced)
        clock.advance(1.0)
        self.assertEqual(owner.log, [("renew", 8.0), ("renew", 9.0), ("fence", 10.0)])
        self.assertTrue(record.fenced)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_grant_restarts_the_lease(self) -> None:
        """A grant in the renew window restarts both timers from the grant."""
        clock, owner, record, machine = self.build()
        self.lease(clock, record, 1000, 600)
        machine.assigned()  # type: ignore[attr-defined]
        clock.advance(0.6)
        self.assertEqual(owner.log, [("renew", 0.6)])
        clock.advance(0.1)
        self.lease(clock, record, 1000, 600)
        machine.granted()  # type: ignore[attr-defined]
        clock.advance(0.599)
        self.assertEqual(owner.log, [("renew", 0.6)])
        clock.advance(0.001)
        self.assertEqual(owner.log, [("renew", 0.6), ("renew", 1.3)])
        clock.advance(0.398)
        self.assertFalse(record.fenced)
        clock.advance(0.002)
        self.assertEqual([entry for entry, _ in owner.log], ["renew", "renew", "fence"])

    def test_fenced_session_unfenced_by_new_lease(self) -> None:
        """After a self-fence a grant changes nothing; only a new ASSIGN brings the timers back
        and clears the fence."""
        clock, owner, record, machine = self.build()
        self.lease(clock, record, 100, 80)
        machine.assigned()  # type: ignore[attr-defined]
        clock.advance(1.0)
        self.assertEqual(owner.log[-1][0], "fence")
        self.assertEqual(clock.getDelayedCalls(), [])
        machine.granted()  # type: ignore[attr-defined]
        self.assertEqual((record.fenced, clock.getDelayedCalls()), (True, []))
        self.lease(clock, record, 100, 80)
        machine.assigned()  # type: ignore[attr-defined]
        self.assertFalse(record.fenced)
        self.assertEqual(len(clock.getDelayedCalls()), 2)

    def test_superseded_fences_without_a_self_fence_action(self) -> None:
        """A reconcile with a higher epoch fences quietly and stops the timers."""
        clock, owner, record, machine = self.build()
        self.lease(clock, record, 100, 80)
        machine.assigned()  # type: ignore[attr-defined]
        machine.superseded()  # type: ignore[attr-defined]
        self.assertTrue(record.fenced)
        clock.advance(1.0)
        self.assertEqual(owner.log, [])

    def test_give_up_fences_once_and_tells_the_owner(self) -> None:
        """Giving up fences the session and tells the owner why, once; the timers stop."""
        clock, owner, record, machine = self.build()
        self.lease(clock, record, 100, 80)
        machine.assigned()  # type: ignore[attr-defined]
        machine.give_up("too many")  # type: ignore[attr-defined]
        machine.give_up("again")  # type: ignore[attr-defined]
        self.assertTrue(record.fenced)
        self.assertEqual(owner.log, [("gave up: too many", 0.0)])
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_stopped_leaves_no_timer_until_a_new_assign(self) -> None:
        """A stopped machine (revoked session, stopping node) leaves no timer behind and
        ignores grants; a new ASSIGN starts the lease again."""
        clock, _owner, record, machine = self.build()
        self.lease(clock, record, 100, 80)
        machine.assigned()  # type: ignore[attr-defined]
        machine.stopped()  # type: ignore[attr-defined]
        machine.granted()  # type: ignore[attr-defined]
        self.assertEqual(clock.getDelayedCalls(), [])
        machine.assigned()  # type: ignore[attr-defined]
        self.assertEqual(len(clock.getDelayedCalls()), 2)

    def test_second_assign_while_held_rearms_the_timers(self) -> None:
        """A lease restarted while still held (a re-assign) re-arms both timers from now."""
        clock, owner, record, machine = self.build()
        self.lease(clock, record, 250, 200)
        machine.assigned()  # type: ignore[attr-defined]
        clock.advance(0.1)
        self.lease(clock, record, 250, 200)
        machine.assigned()  # type: ignore[attr-defined]
        self.assertEqual(len(clock.getDelayedCalls()), 2)
        clock.advance(0.199)
        self.assertEqual(owner.log, [])
        clock.advance(0.001)
        self.assertEqual(owner.log, [("renew", 0.3)])
        clock.advance(0.05)
        self.assertEqual(owner.log[-1], ("fence", 0.35))


class RecordingGeneration:
    def __init__(self, accept: int = 1_000_000) -> None:
        self.accept = accept
        self.log: list[object] = []

    def emit_tokens(self, batch: TokenBatch) -> bool:
        if self.accept <= 0:
            self.log.append("refused")
            return False
        self.accept -= 1
        tokens, logprobs = list(batch.tokens), batch.logprobs
        self.log.append(tokens if logprobs is None else (tokens, list(logprobs)))
        return True

    def emit_finish(self, reason: int, detail: int = 0) -> None:
        self.log.append(("finish", reason, detail) if detail else ("finish", reason))

    def stop_engine(self) -> None:
        self.log.append("stop_engine")

    def fail(self, reason: str) -> None:
        self.log.append(("fail", reason))

    def done(self) -> None:
        self.log.append("done")


class GenerationMachineTests(SynchronousTestCase):
    def build(self, accept: int = 1_000_000) -> tuple[Clock, RecordingGeneration, object]:
        clock = Clock()
        owner = RecordingGeneration(accept)
        return clock, owner, GenerationMachine(GenerationCore(clock, owner, 16, 200))

    def test_first_tokens_go_out_at_once(self) -> None:
        """The first batch is flushed as it arrives (no wait for time-to-first-token)."""
        _clock, owner, machine = self.build()
        machine.tokens(TokenBatch((7,)))  # type: ignore[attr-defined]
        self.assertEqual(owner.log, [[7]])

    def test_sixteen_tokens_flush_at_once(self) -> None:
        """Coalescing: after the first batch, the 16th pending token flushes one event."""
        _clock, owner, machine = self.build()
        machine.tokens(TokenBatch((99,)))  # type: ignore[attr-defined]
        for t in range(15):
            machine.tokens(TokenBatch((t,)))  # type: ignore[attr-defined]
        self.assertEqual(owner.log, [[99]])
        machine.tokens(TokenBatch((15,)))  # type: ignore[attr-defined]
        self.assertEqual(owner.log, [[99], list(range(16))])

    def test_logprobs_are_coalesced_with_their_tokens(self) -> None:
        """Tokens handed over with logprobs are emitted with exactly their own logprobs, in the
        same events as without (first at once, then 16 at a time or after 200 ms)."""
        clock, owner, machine = self.build()
        machine.tokens(TokenBatch((99,), (TokenLogprob(-0.5),)))  # type: ignore[attr-defined]
        for t in range(18):
            machine.tokens(TokenBatch((t,), (TokenLogprob(-t - 1.0),)))  # type: ignore[attr-defined]
        clock.advance(0.2)
        self.assertEqual(
            owner.log,
            [
                ([99], [TokenLogprob(-0.5)]),
                (list(range(16)), [TokenLogprob(-t - 1.0) for t in range(16)]),
                ([16, 17], [TokenLogprob(-17.0), TokenLogprob(-18.0)]),
            ],
        )

    def test_slow_tokens_flush_after_200_ms(self) -> None:
        """Fewer than 16 tokens are flushed 200 ms after the last flush, by a timer."""
        clock, owner, machine = self.build()
        machine.tokens(TokenBatch((0,)))  # type: ignore[attr-defined]
        machine.tokens(TokenBatch((1,)))  # type: ignore[attr-defined]
        clock.advance(0.1)
        machine.tokens(TokenBatch((2,)))  # type: ignore[attr-defined]
        clock.advance(0.099)
        self.assertEqual(owner.log, [[0]])
        clock.advance(0.001)
        self.assertEqual(owner.log, [[0], [1, 2]])

    def test_finish_flushes_then_reports_the_reason(self) -> None:
        """Each engine stop maps to its Finish reason after a final flush."""
        for stop, reason in [
            (EngineStop.EOS, FINISH_EOS),
            (EngineStop.LENGTH, FINISH_LENGTH),
            (EngineStop.EXPIRED, FINISH_EXPIRED),
            (EngineStop.CANCELLED, FINISH_CANCELLED),
        ]:
            clock, owner, machine = self.build()
            machine.tokens(TokenBatch((5, 6)))  # type: ignore[attr-defined]
            machine.finished(GenerationResult((5, 6), stop))  # type: ignore[attr-defined]
            self.assertEqual(owner.log, [[5, 6], ("finish", reason), "done"])
            self.assertEqual(clock.getDelayedCalls(), [])

    def test_a_closed_end_carries_its_detail(self) -> None:
        """An EOS the budget closed (GenerationResult.closed) is Finish EOS with the closed
        bit of its detail (docs/protocol.md section 12.6), after the final flush."""
        _clock, owner, machine = self.build()
        machine.tokens(TokenBatch((5, 6)))  # type: ignore[attr-defined]
        machine.finished(GenerationResult((5, 6), EngineStop.EOS, True))  # type: ignore[attr-defined]
        self.assertEqual(owner.log, [[5, 6], ("finish", FINISH_EOS, FINISH_DETAIL_CLOSED), "done"])

    def test_cancel_flushes_pending_and_drops_later_tokens(self) -> None:
        """Cancel: pending tokens go out, the engine is stopped, later tokens are never sent,
        and the Finish says CANCELLED whatever the engine reports."""
        _clock, owner, machine = self.build()
        machine.tokens(TokenBatch((1, 2)))  # type: ignore[attr-defined]
        machine.cancel()  # type: ignore[attr-defined]
        machine.tokens(TokenBatch((3,)))  # type: ignore[attr-defined]
        machine.finished(GenerationResult((1, 2, 3), EngineStop.LENGTH))  # type: ignore[attr-defined]
        self.assertEqual(owner.log, [[1, 2], "stop_engine", ("finish", FINISH_CANCELLED), "done"])

    def test_fenced_emit_stops_without_finish(self) -> None:
        """An emit refused by the session state stops the engine and sends no Finish."""
        _clock, owner, machine = self.build(accept=1)
        machine.tokens(TokenBatch(tuple(range(16))))  # type: ignore[attr-defined]
        machine.tokens(TokenBatch(tuple(range(16))))  # type: ignore[attr-defined]
        machine.tokens(TokenBatch((1,)))  # type: ignore[attr-defined]
        machine.finished(GenerationResult((), EngineStop.LENGTH))  # type: ignore[attr-defined]
        self.assertEqual(owner.log, [list(range(16)), "refused", "stop_engine", "done"])

    def test_refusal_before_any_token(self) -> None:
        """An engine refusal gives FINISH_REFUSED."""
        _clock, owner, machine = self.build()
        machine.refused()  # type: ignore[attr-defined]
        self.assertEqual(owner.log, [("finish", FINISH_REFUSED), "done"])

    def test_engine_failure_fails_the_connection(self) -> None:
        """An engine error asks the owner to fail (close the asking connection), no Finish."""
        clock, owner, machine = self.build()
        machine.tokens(TokenBatch((1,)))  # type: ignore[attr-defined]
        machine.failed("boom")  # type: ignore[attr-defined]
        self.assertEqual(owner.log, [[1], ("fail", "boom"), "done"])
        self.assertEqual(clock.getDelayedCalls(), [])


class RecordingDrain:
    """A node for the drain machine: running generations, their unacked events, a log."""

    def __init__(self, running: int = 0, unacked: int = 0) -> None:
        self.running = {GenerationKey(1, g) for g in range(running)}
        self.unacked = unacked
        self.log: list[str] = []

    def running_generation_keys(self) -> frozenset[GenerationKey]:
        return frozenset(self.running)

    def cancel_generations(self) -> None:
        self.log.append(f"cancel {len(self.running)}")

    def unacked_events(self, keys: frozenset[GenerationKey]) -> int:
        return self.unacked


class DrainMachineTests(SynchronousTestCase):
    def build(self, running: int = 0, unacked: int = 0) -> tuple[Clock, RecordingDrain, object]:
        clock = Clock()
        owner = RecordingDrain(running, unacked)
        return clock, owner, DrainMachine(DrainCore(clock, owner, 1000, 200))

    def test_an_idle_node_drains_at_once(self) -> None:
        """No generation and nothing unacknowledged: the drain fires at once, leaves no timer,
        and new generations are no longer accepted."""
        clock, _owner, machine = self.build()
        self.assertTrue(machine.accepting())  # type: ignore[attr-defined]
        drained: Deferred[None] = machine.drain()  # type: ignore[attr-defined]
        self.assertIsNone(self.successResultOf(drained))
        self.assertFalse(machine.accepting())  # type: ignore[attr-defined]
        self.assertEqual(clock.getDelayedCalls(), [])
        self.successResultOf(machine.drain())  # type: ignore[attr-defined]

    def test_running_generations_finish_then_acks_settle(self) -> None:
        """The drain waits for the running generations, then for their acknowledgements; a
        second drain() joins the first."""
        clock, owner, machine = self.build(running=2, unacked=3)
        first = machine.drain()  # type: ignore[attr-defined]
        second = machine.drain()  # type: ignore[attr-defined]
        owner.running.pop()
        machine.generation_done()  # type: ignore[attr-defined]
        owner.running.clear()
        machine.generation_done()  # type: ignore[attr-defined]
        self.assertNoResult(first)
        owner.unacked = 0
        machine.acked()  # type: ignore[attr-defined]
        self.successResultOf(first)
        self.successResultOf(second)
        self.assertEqual((owner.log, clock.getDelayedCalls()), ([], []))

    def test_the_timeout_cancels_what_still_runs_and_acks_are_waited_for_briefly(self) -> None:
        """At the drain timeout the running generations are cancelled; once they ended the
        node waits at most the ack wait (200 ms here) for acknowledgements."""
        clock, owner, machine = self.build(running=1, unacked=1)
        drained = machine.drain()  # type: ignore[attr-defined]
        clock.advance(0.999)
        self.assertEqual(owner.log, [])
        clock.advance(0.001)
        self.assertEqual(owner.log, ["cancel 1"])
        owner.running.clear()
        machine.generation_done()  # type: ignore[attr-defined]
        clock.advance(0.199)
        self.assertNoResult(drained)
        clock.advance(0.001)
        self.successResultOf(drained)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_stopping_the_node_ends_the_drain(self) -> None:
        """A node stopped in the middle of a drain fires its waiters and leaves no timer; a
        node stopped without a drain still accepts (it may be started again)."""
        clock, _owner, machine = self.build(running=1)
        drained = machine.drain()  # type: ignore[attr-defined]
        machine.stopped()  # type: ignore[attr-defined]
        self.successResultOf(drained)
        self.assertEqual(clock.getDelayedCalls(), [])
        _clock, _owner, idle = self.build()
        idle.stopped()  # type: ignore[attr-defined]
        self.assertTrue(idle.accepting())  # type: ignore[attr-defined]
