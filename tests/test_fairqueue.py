"""Fair shares of the head's queue (docs/protocol.md section 8.5): the pure round-robin queue
(sfnode.head.fleet.fair_queue) and the fleet's queue built on it, on a ``Clock``.

The fleet tests run a real :class:`~sfnode.head.fleet.fleet.Fleet` on a ``Clock`` with one recording
node link (:class:`FakeLink`): it has a fixed number of lanes, records which session each
GENERATE_REQ was for, and ends a generation only when the test says so; everything else (the
queue, its bounds, placement and the order lanes are given) is the fleet's own code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.fleet.backend import HeadRequest, Requester
from sfnode.head.fleet.fair_queue import FairQueue
from sfnode.head.fleet.fleet import (
    ClientQueueFull,
    Fleet,
    FleetGeneration,
    FleetSettings,
    QueueFull,
)
from sfnode.head.link import GenerationOutcome, HeadIds
from sfnode.linkf.wire import FINISH_CANCELLED, FINISH_LENGTH, CapacitySummary

PROMPT = [5, 6, 7]


class FairQueuePureTests(SynchronousTestCase):
    def test_shares_take_turns_least_recently_served_first(self) -> None:
        """Items of three shares come out round robin (each share's first, then each share's
        second, ...), each share in arrival order; a share that was just served goes to the
        back of the rotation, and one never served comes first."""
        queue: FairQueue[str] = FairQueue()
        for item in ("a1", "a2", "a3"):
            queue.push(item, "A", "10.0.0.1")
        queue.push("b1", "B", "10.0.0.2")
        queue.push("c1", "C", "10.0.0.3")
        queue.push("c2", "C", "10.0.0.3")
        self.assertEqual(queue.order(), ["a1", "b1", "c1", "a2", "c2", "a3"])
        queue.served("A")
        queue.remove("a1")
        self.assertEqual(queue.order(), ["b1", "c1", "a2", "c2", "a3"])
        queue.served("B")
        queue.remove("b1")
        queue.served("C")
        queue.remove("c1")
        self.assertEqual(queue.order(), ["a2", "c2", "a3"])
        queue.push("d1", "D", "10.0.0.4")
        self.assertEqual(queue.order(), ["d1", "a2", "c2", "a3"])

    def test_a_backlog_does_not_delay_a_newcomer(self) -> None:
        """A share with 500 items waiting, served again and again: an item of another share
        that arrives is next, not 500th."""
        queue: FairQueue[int] = FairQueue()
        for i in range(500):
            queue.push(i, "hog", "10.0.0.1")
        for i in range(10):
            queue.served("hog")
            queue.remove(i)
        queue.push(-1, "other", "10.0.0.2")
        self.assertEqual(queue.order()[0], -1)

    def test_priority_items_go_first_newest_first(self) -> None:
        """Priority items (failovers) precede every share, the newest first."""
        queue: FairQueue[str] = FairQueue()
        queue.push("a1", "A")
        queue.push("f1", "A", priority=True)
        queue.push("f2", "B", priority=True)
        self.assertEqual(queue.order(), ["f2", "f1", "a1"])
        queue.remove("f2")
        self.assertEqual(queue.order(), ["f1", "a1"])

    def test_counts_per_address_and_removal(self) -> None:
        """waiting_of counts an address's items across shares (two keys from one address),
        removal gives them back and forgets empty shares; removing twice is harmless; an
        item cannot wait twice."""
        queue: FairQueue[str] = FairQueue()
        queue.push("k1", ("key", b"x"), "10.0.0.1")
        queue.push("k2", ("key", b"y"), "10.0.0.1")
        queue.push("o1", ("address", "10.0.0.2"), "10.0.0.2")
        self.assertEqual((queue.waiting_of("10.0.0.1"), queue.waiting_of("10.0.0.2")), (2, 1))
        self.assertTrue(queue.remove("k1"))
        self.assertFalse(queue.remove("k1"))
        self.assertEqual((len(queue), queue.waiting_of("10.0.0.1")), (2, 1))
        self.assertRaises(ValueError, queue.push, "k2", "A", "10.0.0.1")
        self.assertEqual(queue.clear(), ["k2", "o1"])
        self.assertEqual((len(queue), queue.waiting_of("10.0.0.1"), bool(queue)), (0, 0, False))

    def test_the_memory_of_served_shares_is_bounded(self) -> None:
        """Only the last ``memory`` shares served are remembered; a forgotten one counts as
        never served (served longer ago than any remembered)."""
        queue: FairQueue[str] = FairQueue(memory=2)
        for share in ("A", "B", "C"):
            queue.served(share)
        queue.push("c", "C")
        queue.push("a", "A")
        self.assertEqual(queue.order(), ["a", "c"])


class _Call:
    """A GENERATE_REQ the fake node runs until the test ends it."""

    def __init__(self, session_id: int, remaining: int) -> None:
        self.session_id = session_id
        self.remaining = remaining
        self.result: Deferred[GenerationOutcome] = Deferred()

    def cancel(self) -> None:
        if not self.result.called:
            self.result.callback(GenerationOutcome([], FINISH_CANCELLED))

    def finish(self) -> None:
        self.result.callback(GenerationOutcome([1] * self.remaining, FINISH_LENGTH))


class _HeadSession:
    def __init__(self) -> None:
        self.epochs: dict[int, int] = {}

    def epoch_of(self, session_id: int) -> int | None:
        return self.epochs.get(session_id)


class FakeLink:
    """A node link that is open, serves ``mock`` with ``lanes`` lanes, and records the
    generations it was asked for."""

    dialable = False
    ready = True
    features = 0
    capacity_at = None
    status = "open"
    request_classes = False
    hello_ack = None
    """No HELLO_ACK_F kept: a node that refused nothing (docs/protocol.md D25)."""

    def __init__(self, lanes: int) -> None:
        self.name = self.description = "fake"
        self.models = ("mock",)
        self.capacity = CapacitySummary(max_lanes=lanes)
        self.head_session = _HeadSession()
        self.contexts: dict[int, tuple[int, ...]] = {}
        self.calls: list[_Call] = []

    def observe(self, observer: Any) -> None:
        pass

    def when_open(self) -> Deferred[None]:
        return succeed(None)

    def assign(self, session_id: int, **_: Any) -> None:
        self.head_session.epochs[session_id] = 1

    def append(self, session_id: int, context: Sequence[int]) -> None:
        self.contexts[session_id] = tuple(context)

    def revoke(self, session_id: int, **_: Any) -> None:
        self.head_session.epochs.pop(session_id, None)

    def generate(self, session_id: int, ask: HeadRequest, on_tokens: Any = None) -> _Call:
        call = _Call(session_id, ask.max_new)
        self.calls.append(call)
        return call

    def close(self) -> Deferred[None]:
        return succeed(None)

    @property
    def running(self) -> list[_Call]:
        return [c for c in self.calls if not c.result.called]

    def prompt_of(self, call: _Call) -> tuple[int, ...]:
        return self.contexts[call.session_id]


class FleetQueueTests(SynchronousTestCase):
    def fleet(self, lanes: int = 2, **kwargs: Any) -> tuple[Fleet, FakeLink]:
        """A fleet on a Clock with one fake node of ``lanes`` lanes; at the end of the test
        every generation still waiting or running is ended (none is left suspended)."""
        clock = Clock()
        fleet = Fleet(clock, FleetSettings(**kwargs), ids=HeadIds(), clock=clock)
        link = FakeLink(lanes)
        fleet.registry.adopt(link)  # type: ignore[arg-type]

        self.generations: list[FleetGeneration] = []

        def end_everything() -> None:
            fleet.stop()
            for call in link.running:
                call.cancel()
            for generation in self.generations:
                generation.result.addErrback(lambda _: None)

        self.addCleanup(end_everything)
        return fleet, link

    def ask(
        self, fleet: Fleet, address: str, mark: int, key: bytes | None = None
    ) -> FleetGeneration:
        """A generation of ``address`` whose prompt ends with ``mark`` (to tell them apart)."""
        generation = fleet.generate(
            HeadRequest([*PROMPT, mark], 4, model="mock", requester=Requester(address, key)),
        )
        self.generations.append(generation)
        return generation

    def test_a_second_client_gets_the_next_free_lane(self) -> None:
        """Client A fills both lanes and queues 40 more generations; client B then asks for
        one: the next lane that frees goes to B, the one after to A, and so on in turns."""
        fleet, link = self.fleet(lanes=2, max_queued=256, max_client_queued=64)
        for i in range(42):
            self.ask(fleet, "10.0.0.1", 1000 + i)
        self.assertEqual((len(link.running), fleet.queued), (2, 40))
        self.ask(fleet, "10.0.0.2", 1)
        self.ask(fleet, "10.0.0.2", 2)
        link.running[0].finish()
        self.assertEqual(link.prompt_of(link.calls[-1])[-1], 1)
        link.running[0].finish()
        self.assertEqual(link.prompt_of(link.calls[-1])[-1], 1002)
        link.running[0].finish()
        self.assertEqual(link.prompt_of(link.calls[-1])[-1], 2)
        marks = [link.prompt_of(c)[-1] for c in link.calls]
        self.assertEqual(marks, [1000, 1001, 1, 1002, 2])

    def test_shares_are_by_api_key_else_by_address(self) -> None:
        """Two keys from one address are two clients taking turns; two addresses with one
        key are one client (its requests keep their order)."""
        fleet, link = self.fleet(lanes=1, max_queued=256, max_client_queued=0)
        self.ask(fleet, "10.0.0.1", 0, b"k1")  # takes the lane
        self.ask(fleet, "10.0.0.1", 1, b"k1")
        self.ask(fleet, "10.0.0.2", 2, b"k1")
        self.ask(fleet, "10.0.0.1", 3, b"k2")
        for _ in range(3):
            link.running[0].finish()
        self.assertEqual([link.prompt_of(c)[-1] for c in link.calls], [0, 3, 1, 2])

    def test_one_address_holds_at_most_its_share_of_the_queue(self) -> None:
        """With max_queued 8 and the default share (a quarter: 2), a third waiting generation
        of one address fails at once with ClientQueueFull (the HTTP layer's 429) while another
        address still queues; a program's own generations (no address) are bounded only by
        max_queued."""
        fleet, _ = self.fleet(lanes=1, max_queued=8)
        self.assertEqual(fleet.queue.max_client_queued, 2)
        self.ask(fleet, "10.0.0.1", 0)
        waiting = [self.ask(fleet, "10.0.0.1", i) for i in (1, 2)]
        refused = self.ask(fleet, "10.0.0.1", 3)
        error = self.failureResultOf(refused.result, ClientQueueFull).value
        self.assertIn("--max-client-queued", str(error))
        self.assertEqual(fleet.queue.rejected, 1)
        self.ask(fleet, "10.0.0.2", 4)
        for _ in range(3):
            self.ask(fleet, "", 5)
        self.assertEqual(fleet.queued, 6)
        for generation in waiting:
            self.assertNoResult(generation.result)

    def test_a_full_queue_says_why_with_a_node_up(self) -> None:
        """A full queue with a live node whose lanes are all busy refuses with QueueFull
        saying so, not that no node is live."""
        fleet, _ = self.fleet(lanes=1, max_queued=2, max_client_queued=0)
        for i in range(3):
            self.ask(fleet, "10.0.0.1", i)
        refused = self.ask(fleet, "10.0.0.2", 9)
        error = str(self.failureResultOf(refused.result, QueueFull).value)
        self.assertNotIn("no node is live", error)
        self.assertIn("every lane of the live nodes is busy", error)
        self.assertIn("2 generations may wait", error)
