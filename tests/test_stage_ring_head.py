"""The head's side of a generation's stage-ring run (docs/protocol.md section 12.10):
tokens taken once each and in order of position, and every way a run ends."""

from __future__ import annotations

from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.fleet.ring import RING_SILENCE_S, RingBroken, RingRun


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
        """No token for RING_SILENCE_S while a caller waits ends the run; a token before
        then resets the wait."""
        waiting = self.run.take()
        self.clock.advance(RING_SILENCE_S - 1)
        self.run.offer(13, 100)
        self.assertEqual(self.successResultOf(waiting), 100)
        waiting = self.run.take()
        self.clock.advance(RING_SILENCE_S - 1)
        self.assertNoResult(waiting)
        self.clock.advance(1)
        self.assertIn("no token", str(self.failureResultOf(waiting, RingBroken).value))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_caller_that_stops_waiting_ends_the_run(self) -> None:
        """Cancelling the wait (the generation's wall budget) ends the run and its timer."""
        waiting = self.run.take()
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.assertIsNotNone(self.run.broken)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.run.offer(13, 100)
        self.failureResultOf(self.run.take(), RingBroken)
