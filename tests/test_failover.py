"""Tests of the fleet's failover decision (sfnode.head.fleet.failover) alone: what a generation does
after each attempt on a node (docs/protocol.md section 8, "Failover")."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.generation import StreamTooLong
from sfnode.head.fleet.backend import ConstraintRefused, NodeDeclined, NoNodeAvailable
from sfnode.head.fleet.failover import (
    MAX_FAILOVERS,
    Attempt,
    Cancelled,
    End,
    Fail,
    Finished,
    Lost,
    MoveOn,
    NotSent,
    decide,
    declined,
)
from sfnode.head.link.machine import LinkLostError
from sfnode.linkf.wire import (
    FINISH_CANCELLED,
    FINISH_DECLINED,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_REFUSED,
)

ATTEMPT = Attempt("a", context_length=40, fits=True)


class DecideTests(SynchronousTestCase):
    def test_a_finish_ends_the_generation(self) -> None:
        """EOS, LENGTH and CANCELLED from the node end it with that finish; the session's
        context is put back only after a failover."""
        for finish in (FINISH_EOS, FINISH_LENGTH, FINISH_CANCELLED):
            self.assertEqual(decide(ATTEMPT, Finished(finish)), End(finish))
        moved = Attempt("b", 40, True, failovers=1)
        self.assertEqual(decide(moved, Finished(FINISH_EOS)), End(FINISH_EOS, restore=True))

    def test_a_refusal_fails_as_a_constraint_or_a_context_too_long(self) -> None:
        """REFUSED for a constrained generation whose context fits is ConstraintRefused;
        otherwise StreamTooLong with the context's length and the node's window."""
        constrained = decide(Attempt("a", 40, True, constrained=True), Finished(FINISH_REFUSED))
        assert isinstance(constrained, Fail)
        self.assertIsInstance(constrained.error, ConstraintRefused)
        self.assertIn("a refused the generation's constraint", str(constrained.error))
        for attempt in (
            Attempt("a", 40, False, constrained=True, window=32),
            Attempt("a", 40, False, window=32),
        ):
            too_long = decide(attempt, Finished(FINISH_REFUSED))
            assert isinstance(too_long, Fail)
            self.assertIsInstance(too_long.error, StreamTooLong)

    def test_a_lost_node_or_a_refusal_to_run_moves_on(self) -> None:
        """A lost node, or DECLINED, moves the generation on with the reason; only DECLINED
        marks the node as declining."""
        lost = LinkLostError("gone")
        self.assertEqual(decide(ATTEMPT, Lost(lost)), MoveOn(lost))
        moved = decide(ATTEMPT, Finished(FINISH_DECLINED))
        assert isinstance(moved, MoveOn)
        self.assertIsInstance(moved.error, NodeDeclined)
        self.assertTrue(declined(Finished(FINISH_DECLINED)))
        self.assertFalse(declined(Lost(lost)))
        self.assertFalse(declined(Finished(FINISH_EOS)))

    def test_a_cancelled_generation_does_not_move_on(self) -> None:
        """Cancelled before its request went out, or cancelled while its node failed, it ends
        without a failover."""
        self.assertEqual(decide(ATTEMPT, NotSent()), Cancelled())
        cancelled = Attempt("a", 40, True, cancelled=True)
        self.assertEqual(decide(cancelled, Lost(LinkLostError("gone"))), Cancelled())
        self.assertEqual(decide(cancelled, Finished(FINISH_DECLINED)), Cancelled())

    def test_it_gives_up_after_max_failovers(self) -> None:
        """After MAX_FAILOVERS moves a lost node fails the generation with NoNodeAvailable
        (caused by the last error), and a refusal with the node's NodeDeclined."""
        spent = Attempt("a", 40, True, failovers=MAX_FAILOVERS)
        lost = LinkLostError("gone")
        given_up = decide(spent, Lost(lost))
        assert isinstance(given_up, Fail)
        self.assertIsInstance(given_up.error, NoNodeAvailable)
        self.assertIn(
            f"gave up after {MAX_FAILOVERS} failovers; the last: gone", str(given_up.error)
        )
        self.assertIs(given_up.error.__cause__, lost)
        refused = decide(spent, Finished(FINISH_DECLINED))
        assert isinstance(refused, Fail)
        self.assertIsInstance(refused.error, NodeDeclined)
        self.assertIsInstance(
            decide(Attempt("a", 40, True, failovers=MAX_FAILOVERS - 1), Lost(lost)), MoveOn
        )
