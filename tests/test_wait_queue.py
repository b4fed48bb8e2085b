"""Tests of the head's wait queue (sfnode.head.fleet.wait_queue) alone, on a ``Clock``: its bounds,
its timeout, its fair dispatch and that it settles each waiter exactly once (docs/protocol.md
section 8.5).  The fleet's placement is replaced by a recording ``place`` that places only the
waiters a test allows."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.fleet.backend import ClientQueueFull, NoNodeAvailable, QueueFull
from sfnode.head.fleet.wait_queue import Waiter, WaitQueue


class Harness:
    """A queue whose ``place`` settles the waiters named in ``allowed`` with "node" and
    records every offer."""

    def __init__(self, **bounds: Any) -> None:
        self.clock = Clock()
        self.allowed: set[str] = set()
        self.offers: list[str] = []
        settings = {"max_queued": 4, "max_client_queued": 2, "timeout_s": 30.0, **bounds}
        self.queue: WaitQueue[str] = WaitQueue(self.clock, self.place, self.why, **settings)

    def place(self, waiter: Waiter[str]) -> bool:
        self.offers.append(waiter.request)
        if waiter.request in self.allowed:
            self.queue.served(waiter)
            self.queue.settle(waiter, "node")
            return True
        waiter.reason = "every lane is busy"
        return False

    def why(self, waiter: Waiter[str]) -> str:
        return waiter.reason or "no node yet"

    def wait(self, name: str, share: str = "", address: str = "", **kw: Any) -> Waiter[str]:
        waiter = self.queue.waiter(name, share or name, address)
        self.queue.wait(waiter, **kw)
        return waiter


class WaitQueueTests(SynchronousTestCase):
    def test_a_waiter_is_placed_when_the_fleet_can_place_it(self) -> None:
        """A waiter is offered at once, waits while ``place`` says no, and is placed (its
        Deferred fires with the node) by the next dispatch after ``place`` says yes."""
        h = Harness()
        waiter = h.wait("a")
        self.assertNoResult(waiter.placed)
        self.assertEqual(len(h.queue), 1)
        h.allowed.add("a")
        h.queue.dispatch()
        self.assertEqual(self.successResultOf(waiter.placed), "node")
        self.assertEqual((len(h.queue), h.offers), (0, ["a", "a"]))
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_the_queue_and_each_address_are_bounded(self) -> None:
        """Four may wait; a fifth is refused with QueueFull naming why it would wait; one
        address may hold two (ClientQueueFull for a third); each refusal is counted."""
        h = Harness()
        for name in ("a1", "a2"):
            h.wait(name, address="10.0.0.1")
        third = h.queue.waiter("a3", "a3", "10.0.0.1")
        self.assertIsInstance(h.queue.refusal(third), ClientQueueFull)
        h.wait("b")
        h.wait("c")
        fifth = h.queue.waiter("d", "d")
        refused = h.queue.refusal(fifth)
        self.assertIsInstance(refused, QueueFull)
        self.assertIn("no node yet", str(refused))
        self.assertIn("4 generations may wait", str(refused))
        self.assertEqual(h.queue.rejected, 2)

    def test_a_waiter_times_out_once_with_the_last_reason(self) -> None:
        """After ``timeout_s`` a waiter fails with NoNodeAvailable naming the timeout and why
        it waited; it is counted once and a later dispatch does not offer it again."""
        h = Harness(timeout_s=5.0)
        waiter = h.wait("a")
        h.clock.advance(4.9)
        self.assertNoResult(waiter.placed)
        h.clock.advance(0.1)
        failure = self.failureResultOf(waiter.placed, NoNodeAvailable)
        self.assertIn("within 5 s (every lane is busy)", str(failure.value))
        self.assertEqual((h.queue.timeouts, len(h.queue)), (1, 0))
        h.allowed.add("a")
        h.queue.dispatch()
        self.assertEqual(h.offers, ["a"])

    def test_a_cancelled_waiter_leaves_and_its_timer_stops(self) -> None:
        """Cancelling a waiter's Deferred takes it out of the queue and cancels its timeout."""
        h = Harness()
        waiter = h.wait("a")
        waiter.placed.cancel()
        self.failureResultOf(waiter.placed, CancelledError)
        self.assertEqual((len(h.queue), h.clock.getDelayedCalls()), (0, []))
        self.assertEqual(h.queue.timeouts, 0)

    def test_dispatch_is_fair_and_failovers_go_first(self) -> None:
        """Offers go to a priority waiter first, then round robin across shares (least
        recently served first), whatever the arrival order."""
        h = Harness(max_queued=10, max_client_queued=0)
        for name in ("x1", "x2", "x3"):
            h.wait(name, share="x")
        h.wait("y1", share="y")
        h.wait("f", share="x", priority=True)
        h.offers.clear()
        h.queue.dispatch()
        self.assertEqual(h.offers, ["f", "x1", "y1", "x2", "x3"])

    def test_a_place_that_frees_a_lane_gets_another_round(self) -> None:
        """A dispatch asked for while one runs (a placed generation ended at once) goes round
        again when the running one is done, so the waiter offered before the lane freed ("b",
        ahead of "a") is offered again."""
        h = Harness()
        second = h.wait("b")
        first = h.wait("a")
        h.allowed.add("a")

        def place(waiter: Waiter[str]) -> bool:
            placed = Harness.place(h, waiter)
            if waiter.request == "a":
                h.allowed.add("b")
                h.queue.dispatch()
            return placed

        h.queue._place = place  # type: ignore[method-assign]
        h.queue.dispatch()
        self.assertEqual(self.successResultOf(first.placed), "node")
        self.assertEqual(self.successResultOf(second.placed), "node")

    def test_clear_fails_every_waiter(self) -> None:
        """Stopping fails every waiter with the error given and leaves no timer."""
        h = Harness()
        waiters = [h.wait(name) for name in ("a", "b")]
        h.queue.clear(NoNodeAvailable("the head is stopping"))
        for waiter in waiters:
            self.failureResultOf(waiter.placed, NoNodeAvailable)
        self.assertEqual((len(h.queue), h.clock.getDelayedCalls()), (0, []))
