"""The head's side of stage rings (docs/protocol.md section 12.10): a generation's run takes
its tokens once each and in order of position, every way a run ends, and the pipeline's ring
joined, started and broken over stage links."""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.fleet.ring import RING_SILENCE_S, RingBroken, RingRun, StageRing
from sfnode.linkf.wire import (
    FEATURE_STAGE_RING,
    Message,
    StageRingJoinMsg,
    StageRingRow,
    StageRingRowsMsg,
    StageRingToken,
    StageRingTokensMsg,
)


class RingRunTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.run = RingRun(self.clock, 13)

    def test_tokens_are_taken_in_order_of_position_once(self) -> None:
        """A token at the expected position is taken (at once when it came first, or when
        it comes to a waiting caller); one at any other position (sent twice, from an
        earlier run, or ahead) is dropped."""
        self.run.offer(13, 100)
        self.run.offer(13, 999)
        self.run.offer(15, 999)
        self.assertEqual(self.successResultOf(self.run.take()), 100)
        waiting = self.run.take()
        self.assertNoResult(waiting)
        self.run.offer(12, 999)
        self.run.offer(14, 101)
        self.assertEqual(self.successResultOf(waiting), 101)
        self.assertEqual(self.run.expected, 15)

    def test_a_nil_ends_the_run_after_the_tokens_before_it(self) -> None:
        """A nil at the expected position (a row refused or lost) ends the run: the tokens
        that came before it are still taken, then the run fails with RingBroken, and later
        entries are dropped."""
        self.run.offer(13, 100)
        self.run.offer(14, None)
        self.run.offer(14, 101)
        self.assertEqual(self.successResultOf(self.run.take()), 100)
        self.assertIsInstance(self.failureResultOf(self.run.take(), RingBroken).value, RingBroken)

    def test_a_waiting_caller_fails_when_the_run_ends(self) -> None:
        waiting = self.run.take()
        self.run.end(RingBroken("the stage ring lost stage1"))
        self.assertIn("stage1", str(self.failureResultOf(waiting, RingBroken).value))

    def test_silence_ends_the_run(self) -> None:
        """No token for RING_SILENCE_S (the least wait; these steps are fast) while a
        caller waits ends the run; a token before then resets the wait."""
        waiting = self.run.take()
        self.clock.advance(0.5)
        self.run.offer(13, 100)
        self.assertEqual(self.successResultOf(waiting), 100)
        waiting = self.run.take()
        self.clock.advance(RING_SILENCE_S - 1)
        self.assertNoResult(waiting)
        self.clock.advance(1)
        self.assertIn("no token", str(self.failureResultOf(waiting, RingBroken).value))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_slow_model_is_waited_for_ten_of_its_slowest_steps(self) -> None:
        """A generation whose last step took 3 s waits 30 s for its first ring token, not
        RING_SILENCE_S; a gap of 5 s between tokens then makes it 50 s."""
        run = RingRun(self.clock, 13, step_s=3.0)
        self.assertEqual(run.silence_s, 30.0)
        waiting = run.take()
        self.clock.advance(5)
        run.offer(13, 100)
        self.assertEqual(self.successResultOf(waiting), 100)
        self.assertEqual(run.silence_s, 50.0)
        waiting = run.take()
        self.clock.advance(49)
        self.assertNoResult(waiting)
        self.clock.advance(1)
        self.failureResultOf(waiting, RingBroken)

    def test_a_caller_that_stops_waiting_ends_the_run(self) -> None:
        """Cancelling the wait (the generation's wall budget) ends the run and its timer."""
        waiting = self.run.take()
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.assertIsNotNone(self.run.broken)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.run.offer(13, 100)
        self.failureResultOf(self.run.take(), RingBroken)


class _Link:
    """What :class:`StageRing` uses of a stage's NodeLink: its features, how it was dialled,
    the frames sent, and the Deferred of its next drop."""

    def __init__(self, name: str, features: int = FEATURE_STAGE_RING) -> None:
        self.name = name
        self.description = f"tcp:127.0.0.1:{name}"
        self.features = features
        self.dialable = True
        self.sent: list[Message] = []
        self.up = True
        self.ring_tokens: Any = None
        self.closed: Deferred[Exception] = Deferred()

    def send_now(self, message: Message) -> bool:
        if self.up:
            self.sent.append(message)
        return self.up

    def when_closed(self) -> Deferred[Exception]:
        return self.closed


RANGES = [(0, 12), (12, 24)]


class StageRingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.ring = StageRing(self.clock, [2])
        self.links = [_Link("1"), _Link("2")]

    def join(self, links: list[_Link] | None = None) -> int | None:
        return self.ring.join(cast(Any, links or self.links), RANGES)

    def test_the_stages_are_joined_once_each_naming_the_next(self) -> None:
        """Each stage gets a STAGE_RING_JOIN of its layers naming the next stage's endpoint
        (the last, the first's); joining again with the same links and layers sends nothing,
        and other layers make a new ring."""
        ring = self.join()
        assert ring is not None
        self.assertEqual(
            [link.sent for link in self.links],
            [
                [StageRingJoinMsg(ring, 0, 12, "tcp:127.0.0.1:2")],
                [StageRingJoinMsg(ring, 12, 24, "tcp:127.0.0.1:1")],
            ],
        )
        self.assertEqual(self.join(), ring)
        self.assertEqual(self.ring.joined, 1)
        again = self.ring.join(cast(Any, self.links), [(0, 10), (10, 24)])
        self.assertNotEqual(again, ring)
        self.assertEqual(self.ring.joined, 2)

    def test_no_ring_for_one_stage_or_a_node_that_cannot_join(self) -> None:
        """A single stage, a node without feature bit 9, one the head did not dial, or one
        at a non-tcp endpoint: no ring, nothing sent."""
        self.assertIsNone(self.ring.join(cast(Any, self.links[:1]), RANGES[:1]))
        plain = _Link("3", features=0)
        self.assertIsNone(self.join([self.links[0], plain]))
        dialled_in = _Link("4")
        dialled_in.dialable = False
        self.assertIsNone(self.join([self.links[0], dialled_in]))
        unix = _Link("5")
        unix.description = "unix:/tmp/stage"
        self.assertIsNone(self.join([self.links[0], unix]))
        self.assertEqual([link.sent for link in self.links], [[], []])

    def test_runs_started_in_one_turn_leave_in_one_frame(self) -> None:
        """Two runs started in one reactor turn: one STAGE_RING_ROWS to the first stage at
        the end of the turn, each row its token at its position, its tokens left and the
        stop tokens; each run then takes its own tokens."""
        ring = self.join()
        assert ring is not None
        first = self.ring.start(5, 12, 31198, 3)
        second = self.ring.start(6, 3, 7, 2)
        self.assertEqual(len(self.links[0].sent), 1)
        self.clock.advance(0)
        rows = (
            StageRingRow(5, 12, (31198,), None, 3, (2,)),
            StageRingRow(6, 3, (7,), None, 2, (2,)),
        )
        self.assertEqual(self.links[0].sent[1:], [StageRingRowsMsg(ring, rows)])
        tokens = (StageRingToken(5, 13, 16521), StageRingToken(6, 4, 8))
        self.links[1].ring_tokens(self.links[1], StageRingTokensMsg(ring, tokens))
        self.links[1].ring_tokens(self.links[1], StageRingTokensMsg(ring + 1, tokens))
        self.assertEqual(self.successResultOf(self.ring.take(first)), 16521)
        self.assertEqual(self.successResultOf(self.ring.take(second)), 8)
        self.assertNoResult(self.ring.take(first))
        self.assertEqual(self.ring.tokens, 2)

    def test_a_dropped_stage_link_ends_every_run(self) -> None:
        """A stage's link drops: the ring is forgotten (the next join makes a new one) and
        every run fails with RingBroken naming the stage."""
        ring = self.join()
        run = self.ring.start(5, 12, 31198, 3)
        self.clock.advance(0)
        waiting = self.ring.take(run)
        self.links[1].closed.callback(ConnectionLost("gone"))
        self.assertIn("2", str(self.failureResultOf(waiting, RingBroken).value))
        self.assertFalse(self.ring.running)
        self.assertNotEqual(self.join(), ring)

    def test_a_run_ended_before_its_turn_sends_nothing(self) -> None:
        """A generation released in the turn its run started: no row is sent for it."""
        self.join()
        self.ring.start(5, 12, 31198, 3)
        self.ring.end(5, "released")
        self.clock.advance(0)
        self.assertEqual(len(self.links[0].sent), 1)
