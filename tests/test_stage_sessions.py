"""The stage sessions' table (docs/protocol.md section 12.8): slots, positions, layer ranges and
the bounds, pure (no engine, no reactor)."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.engines.scheduling.stages import STAGE_IDLE_S, StageSessions
from sfnode.generation import StageForwardError

LAYERS = (0, 4)


class StageSessionsTests(SynchronousTestCase):
    def test_a_session_continues_from_any_position_it_holds(self) -> None:
        """Opened at 0 on a free slot, a session continues at its length or before it (the
        rows beyond are forgotten), keeps its slot, and position 0 starts it over."""
        table = StageSessions(slots=2, window=100)
        slot = table.claim("a", 1, 0, 10, LAYERS, 0.0)
        self.assertEqual(table.claim("a", 1, 10, 1, LAYERS, 1.0), slot)
        self.assertEqual(table.claim("a", 1, 5, 2, LAYERS, 2.0), slot)
        self.assertRaises(StageForwardError, table.claim, "a", 1, 8, 1, LAYERS, 3.0)
        self.assertEqual(len(table), 0)
        self.assertEqual(table.claim("a", 1, 0, 3, (0, 2), 4.0), slot)

    def test_refusals_drop_the_session(self) -> None:
        """An unknown session past 0, another layer range, no rows, or positions past the
        window are refused, and the session is then gone."""
        table = StageSessions(slots=2, window=16)
        self.assertRaises(StageForwardError, table.claim, "a", 1, 3, 1, LAYERS, 0.0)
        for position, rows, layers in ((4, 1, (0, 2)), (4, 0, LAYERS), (4, 13, LAYERS)):
            table.claim("a", 1, 0, 4, LAYERS, 0.0)
            self.assertRaises(
                StageForwardError, table.claim, "a", 1, position, rows, layers, 0.0
            )
            self.assertEqual(len(table), 0)

    def test_sessions_are_bounded_by_the_slots_and_idleness(self) -> None:
        """With every slot held, a new session is refused until one has been idle
        STAGE_IDLE_S; it then takes that slot, and the evicted one is unknown."""
        table = StageSessions(slots=2, window=100)
        first = table.claim("a", 1, 0, 1, LAYERS, 0.0)
        table.claim("b", 1, 0, 1, LAYERS, 10.0)
        self.assertRaises(StageForwardError, table.claim, "c", 1, 0, 1, LAYERS, STAGE_IDLE_S - 1)
        self.assertEqual(table.claim("c", 1, 0, 1, LAYERS, STAGE_IDLE_S), first)
        self.assertRaises(StageForwardError, table.claim, "a", 1, 1, 1, LAYERS, 70.0)
        self.assertEqual(len(table), 2)

    def test_an_owner_or_a_session_is_released(self) -> None:
        """Dropping a session frees its slot; dropping an owner frees all of its, and only
        its; two owners' sessions of one id are distinct."""
        table = StageSessions(slots=3, window=100)
        table.claim("a", 1, 0, 1, LAYERS, 0.0)
        table.claim("a", 2, 0, 1, LAYERS, 0.0)
        table.claim("b", 1, 0, 1, LAYERS, 0.0)
        table.drop("a", 2)
        self.assertEqual(len(table), 2)
        table.drop("a")
        self.assertEqual(len(table), 1)
        self.assertEqual(table.claim("b", 1, 1, 1, LAYERS, 1.0), 2)
