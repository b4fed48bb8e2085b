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

from sfnode.generation import TokenBatch
from sfnode.head.fleet.backend import HeadRequest, Requester
from sfnode.head.fleet.fair_queue import FairQueue
from sfnode.head.fleet.fleet import (
    ClientQueueFull,
    Fleet,
    FleetGeneration,
    FleetSettings,
    QueueFull,
)
from sfnode.head.fleet.shares import ShareLedger
from sfnode.head.link import GenerationOutcome, HeadIds
from sfnode.linkf.wire import FINISH_CANCELLED, FINISH_LENGTH, CapacitySummary, RequestClass

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


    def test_a_share_using_fewer_lanes_per_weight_goes_first(self) -> None:
        """Given each share's use (lanes held per unit of weight), the least used share's
        items come first whatever the last service; equal use falls back to round robin; an
        item pushed to the front of its line precedes its share's older ones."""
        use = {"A": 2.0, "B": 0.5, "C": 0.5}
        queue: FairQueue[str] = FairQueue(use=lambda share: use.get(str(share), 0.0))
        queue.push("a1", "A")
        queue.push("b1", "B")
        queue.push("c1", "C")
        queue.served("B")
        self.assertEqual(queue.order(), ["c1", "b1", "a1"])
        queue.push("a0", "A", front=True)
        use["A"] = 0.0
        self.assertEqual(queue.order(), ["a0", "c1", "b1", "a1"])


class ShareLedgerTests(SynchronousTestCase):
    def test_the_most_used_share_gives_its_newest_lane(self) -> None:
        """A holds 3 lanes, B 1: a waiter of C takes back A's newest; once A's lane is on
        its way to C (given, not yet dropped), A counts 2 and C 1, so a second waiter of C
        takes none (A 2 against C 2 would be no fairer); dropping the lane keeps the counts
        where they went."""
        ledger: ShareLedger[str] = ShareLedger()
        for item in ("a1", "a2", "a3"):
            ledger.hold("A", 1.0, item)
        ledger.hold("B", 1.0, "b1")
        victim = ledger.victim("C", 1.0, lambda item: True)
        self.assertEqual(victim, "a3")
        ledger.give("a3", "C", 1.0)
        self.assertEqual((ledger.held("A"), ledger.held("C")), (2, 1))
        self.assertIsNone(ledger.victim("C", 1.0, lambda item: True))
        ledger.drop("a3")
        self.assertEqual((ledger.held("A"), ledger.held("C")), (2, 0))
        self.assertEqual(ledger.holding("A"), ["a1", "a2"])
        ledger.hold("C", 1.0, "c1")
        self.assertEqual(ledger.victim("D", 1.0, lambda item: item != "a2"), "a1")

    def test_weights_decide_the_shares(self) -> None:
        """With weight 3 against 1, B may hold three lanes to A's one: B holding 3 of 4
        gives none back to A (A holds 1); A holding 2 gives one to B holding 2 (2/1 > 3/3);
        ineligible generations are skipped for older ones."""
        ledger: ShareLedger[str] = ShareLedger()
        ledger.hold("A", 1.0, "a1")
        for item in ("b1", "b2", "b3"):
            ledger.hold("B", 3.0, item)
        self.assertIsNone(ledger.victim("A", 1.0, lambda item: True))
        ledger.drop("b3")
        ledger.hold("A", 1.0, "a2")
        self.assertEqual(ledger.victim("B", 3.0, lambda item: item != "a2"), "a1")
        self.assertAlmostEqual(ledger.use("B"), 2 / 3)

    def test_a_later_class_gives_way_first(self) -> None:
        """A waiter of rank 0 (interactive) takes the newest batch (rank 1) lane whatever the
        shares say, even from its own share; a batch waiter never takes an interactive lane,
        and takes a batch one only by the share rule."""
        ledger: ShareLedger[str] = ShareLedger()
        ledger.hold("A", 1.0, "a-chat", 0)
        ledger.hold("A", 1.0, "a-batch1", 1)
        ledger.hold("A", 1.0, "a-batch2", 1)
        ledger.hold("B", 1.0, "b-chat", 0)
        self.assertEqual(ledger.victim("B", 1.0, lambda item: True, 0), "a-batch2")
        self.assertEqual(ledger.below(0, lambda item: item != "a-batch2"), "a-batch1")
        self.assertIsNone(ledger.below(1, lambda item: True))
        self.assertEqual(ledger.victim("C", 1.0, lambda item: True, 1), "a-batch2")
        self.assertIsNone(ledger.victim("C", 1.0, lambda item: item.endswith("chat"), 1))

    def test_background_gives_way_before_batch(self) -> None:
        """Of a batch (rank 1) and a newer background (rank 2) holder, an interactive waiter
        takes the background one's lane first, even when it is older."""
        ledger: ShareLedger[str] = ShareLedger()
        ledger.hold("A", 1.0, "background", 2)
        ledger.hold("A", 1.0, "batch", 1)
        self.assertEqual(ledger.below(0, lambda item: True), "background")
        self.assertEqual(ledger.below(1, lambda item: True), "background")
        self.assertIsNone(ledger.below(2, lambda item: True))

    def test_lanes_on_their_way_do_not_order_the_queue(self) -> None:
        """For the order of the queue (use), a lane given back no longer counts for its share
        and a lane on its way does not yet count for the share it goes to: B, waiting for
        A's lane, still comes before A's waiters once A parks (gives) the rest."""
        ledger: ShareLedger[str] = ShareLedger()
        ledger.hold("A", 1.0, "a1")
        ledger.hold("A", 1.0, "a2")
        ledger.give("a2", "B", 1.0)
        self.assertEqual((ledger.use("A"), ledger.use("B")), (1.0, 0.0))
        self.assertEqual(ledger.held("B"), 1)
        ledger.give("a1")
        self.assertEqual((ledger.use("A"), ledger.use("B")), (0.0, 0.0))

    def test_one_lane_each_is_never_taken_back(self) -> None:
        """Equal use after the move (1 each) is no reason to take a lane back: a single lane
        is not passed to and fro."""
        ledger: ShareLedger[str] = ShareLedger()
        ledger.hold("A", 1.0, "a1")
        self.assertIsNone(ledger.victim("B", 1.0, lambda item: True))


class _Call:
    """A GENERATE_REQ the fake node runs until the test ends it."""

    def __init__(self, session_id: int, remaining: int, on_tokens: Any = None) -> None:
        self.session_id = session_id
        self.remaining = remaining
        self.on_tokens = on_tokens
        self.result: Deferred[GenerationOutcome] = Deferred()

    def deliver(self, tokens: Sequence[int]) -> None:
        """The node sends ``tokens`` of this generation."""
        self.remaining -= len(tokens)
        self.on_tokens(TokenBatch(tuple(tokens)))

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
        call = _Call(session_id, ask.max_new, on_tokens)
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
        one: the next lane that frees goes to B, the one after to A, and so on in turns (the
        order of the queue alone: no lane is taken back here, see ReclaimTests)."""
        fleet, link = self.fleet(
            lanes=2, max_queued=256, max_client_queued=64, reclaim_lanes=False
        )
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


class ReclaimTests(FleetQueueTests):
    """Lanes taken back from a client over its share (docs/protocol.md section 8.5,
    "Shares"), and parked generations."""

    def test_a_second_client_takes_a_lane_back_at_once(self) -> None:
        """A holds both lanes and queues 40 more; B asks: A's newest running generation is
        cancelled on its node at once, B gets its lane, and A's generation waits first in
        A's line, then resumes with prompt + the tokens it delivered and what is left of its
        budget (no failover counted); A's tokens reach its caller once each."""
        fleet, link = self.fleet(lanes=2, max_queued=256, max_client_queued=64)
        for i in range(42):
            self.ask(fleet, "10.0.0.1", 1000 + i)
        first, second = link.running
        second.deliver([70, 71])
        self.ask(fleet, "10.0.0.2", 1)
        self.assertEqual([link.prompt_of(c)[-1] for c in link.running], [1000, 1])
        self.assertEqual(fleet.shares.reclaimed, 1)
        first.finish()
        resumed = link.calls[-1]
        self.assertEqual(link.prompt_of(resumed), (*PROMPT, 1001, 70, 71))
        self.assertEqual(resumed.remaining, 2)
        resumed.deliver([72, 73])
        resumed.finish()
        outcome = self.successResultOf(self.generations[1].result)
        self.assertEqual((outcome.tokens, outcome.failovers), ([70, 71, 72, 73], 0))
        self.assertEqual(self.generations[1].yields, 1)

    def test_weights_share_the_lanes(self) -> None:
        """On four lanes, a client of weight 3 that arrives while a client of weight 1
        holds all four takes back three of them, not two."""
        fleet, link = self.fleet(lanes=4, max_queued=256, max_client_queued=0)
        for i in range(8):
            self.ask(fleet, "10.0.0.1", 1000 + i)
        heavy = Requester("10.0.0.2", b"heavy", 3.0)
        for i in range(4):
            self.generations.append(
                fleet.generate(HeadRequest([*PROMPT, i], 4, model="mock", requester=heavy))
            )
        marks = sorted(link.prompt_of(c)[-1] for c in link.running)
        self.assertEqual(marks, [0, 1, 2, 1000])

    def test_batch_work_takes_a_background_lane(self) -> None:
        """Two background generations hold both lanes; a batch generation of the same client
        takes the newer one's lane at once (background gives way to batch whatever the
        shares), and a second background one waits for a lane to free."""
        fleet, link = self.fleet(lanes=2, max_queued=256, max_client_queued=0)
        requester = Requester("10.0.0.1")
        for mark in (0, 1):
            request = HeadRequest(
                [*PROMPT, mark], 4, model="mock", requester=requester,
                request_class=RequestClass.BATCH, background=True,
            )  # fmt: skip
            self.generations.append(fleet.generate(request))
        self.generations.append(fleet.generate(HeadRequest(
            [*PROMPT, 2], 4, model="mock", requester=requester, request_class=RequestClass.BATCH
        )))  # fmt: skip
        self.assertEqual([link.prompt_of(c)[-1] for c in link.running], [0, 2])
        self.assertEqual((fleet.shares.reclaimed, fleet.queued), (1, 1))

    def test_a_single_lane_is_not_taken_back(self) -> None:
        """With one lane, a second client waits for it to free (one lane each is no share
        to take back: it would only pass to and fro)."""
        fleet, link = self.fleet(lanes=1, max_queued=256, max_client_queued=0)
        self.ask(fleet, "10.0.0.1", 0)
        self.ask(fleet, "10.0.0.2", 1)
        self.assertEqual((len(link.calls), fleet.shares.reclaimed), (1, 0))

    def test_a_parked_generation_gives_its_lane_and_resumes_exactly(self) -> None:
        """A running generation parks: its node is told to stop, its lane goes to the one
        waiting, and it takes no lane while parked even when one frees; unparked, it waits
        first in its client's line and resumes with prompt + delivered tokens."""
        fleet, link = self.fleet(lanes=1, max_queued=256, max_client_queued=0)
        parked = self.ask(fleet, "10.0.0.1", 0)
        link.running[0].deliver([9])
        self.ask(fleet, "10.0.0.1", 1)
        parked.park()
        self.assertEqual([link.prompt_of(c)[-1] for c in link.running], [1])
        link.running[0].finish()
        self.assertEqual(link.running, [])
        self.assertIsNotNone(parked.lane.parked)
        parked.unpark()
        self.assertEqual(link.prompt_of(link.running[0]), (*PROMPT, 0, 9))
        link.running[0].deliver([8, 7, 6])
        link.running[0].finish()
        self.assertEqual(self.successResultOf(parked.result).tokens, [9, 8, 7, 6])

    def test_a_parked_generation_cancels_cleanly(self) -> None:
        """Cancelling a parked generation ends it CANCELLED with what it delivered, and it
        never takes a lane again."""
        fleet, link = self.fleet(lanes=1, max_queued=256, max_client_queued=0)
        parked = self.ask(fleet, "10.0.0.1", 0)
        link.running[0].deliver([9])
        parked.park()
        parked.cancel()
        outcome = self.successResultOf(parked.result)
        self.assertEqual((outcome.tokens, outcome.finish), ([9], FINISH_CANCELLED))
        self.assertEqual(len(link.calls), 1)
