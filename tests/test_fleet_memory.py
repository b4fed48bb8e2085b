"""Tests of the fleet (sfnode.head.fleet.fleet) against a real node agent on a
``MemoryReactorClock``: the bytes move through iosim pumps and time moves only when a test says, so
the timing rules (the wall budget, the queue's timeout, the keepalive window) are pinned exactly,
with no socket and no waiting (tests/nodefixture.py ``MemoryNodeTestCase``)."""

from __future__ import annotations

from twisted.internet.testing import MemoryReactorClock

from sfnode.generation import TokenBatch
from sfnode.head.fleet.backend import GenerationTimedOut, HeadRequest, NoNodeAvailable
from sfnode.head.fleet.fleet import Fleet, FleetSettings
from sfnode.head.link import NodeSilentError
from sfnode.linkf.wire import FINISH_LENGTH
from tests.nodefixture import MEMORY_PORT, MemoryNodeTestCase, expected_tokens

PROMPT = list(range(100, 112))


class MemoryFleetTests(MemoryNodeTestCase):
    def fleet(self, **options: object) -> Fleet:
        """A fleet on the test's memory reactor that has dialed the memory node."""
        assert isinstance(self.reactor, MemoryReactorClock)
        fleet = Fleet(
            self.reactor,
            FleetSettings(**options),
            ids=self.ids,
        )  # type: ignore[arg-type]
        added = fleet.add_node(f"tcp:127.0.0.1:{MEMORY_PORT}")
        self.connect()
        self.successResultOf(added)

        def stop() -> None:
            stopped = fleet.stop()
            self.flush()
            self.successResultOf(stopped)

        self.addCleanup(stop)
        return fleet

    def test_a_generation_streams_every_token_once(self) -> None:
        """A generation through the fleet streams the mock's tokens in batches, each once, in
        order, and its outcome holds the same tokens, finish LENGTH, no failover."""
        self.start_node(token_delay_s=0.01)
        fleet = self.fleet()
        batches: list[TokenBatch] = []
        generation = fleet.generate(HeadRequest(PROMPT, 30), on_tokens=batches.append)
        self.advance(1.0)
        outcome = self.successResultOf(generation.result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 30))
        self.assertEqual([t for b in batches for t in b.tokens], outcome.tokens)
        self.assertGreater(len(batches), 1)
        self.assertEqual((outcome.finish, outcome.failovers), (FINISH_LENGTH, 0))

    def test_the_wall_budget_ends_a_generation_at_its_second(self) -> None:
        """With max_generation_s 0.5, a generation that would take 10 s is still running at
        0.49 s and fails with GenerationTimedOut at 0.5 s, naming the budget; its lane is free
        again at once (the fleet runs nothing on the node)."""
        self.start_node(token_delay_s=0.01)
        fleet = self.fleet(max_generation_s=0.5)
        generation = fleet.generate(HeadRequest(PROMPT, 1000))
        self.advance(0.49)
        self.assertNoResult(generation.result)
        self.advance(0.01)
        failure = self.failureResultOf(generation.result, GenerationTimedOut)
        self.assertIn("within 0.5 s", str(failure.value))
        self.assertEqual(fleet.nodes[0].inflight, 0)

    def test_a_request_waits_for_a_lane_the_queue_timeout_and_no_longer(self) -> None:
        """On a node with one lane, a second generation waits in the queue; with a queue
        timeout of 2 s it fails with NoNodeAvailable at 2 s (the first still running), and
        the fleet counts one timeout."""
        self.start_node(token_delay_s=0.01, max_lanes=1)
        fleet = self.fleet(queue_timeout_s=2.0)
        first = fleet.generate(HeadRequest(PROMPT, 1000))
        self.flush()
        second = fleet.generate(HeadRequest(PROMPT, 10))
        self.assertEqual(fleet.queued, 1)
        self.advance(1.99)
        self.assertNoResult(second.result)
        self.advance(0.01)
        failure = self.failureResultOf(second.result, NoNodeAvailable)
        self.assertIn("within 2 s", str(failure.value))
        self.assertEqual((fleet.queued, fleet.queue.timeouts), (0, 1))
        self.assertNoResult(first.result)
        first.cancel()
        self.advance(0.1)
        self.successResultOf(first.result)

    def test_a_silent_node_fails_its_generation_within_the_keepalive_window(self) -> None:
        """A node that stops sending (its bytes no longer move) is given up once the fleet's
        keepalive window of 1 s has passed since it was last heard (it streamed until 0.1 s):
        not at 0.95 s, by 1.1 s; the link reports it silent, and the generation, with no
        other node, waits for one until the queue timeout ends it."""
        self.start_node(token_delay_s=0.01)
        fleet = self.fleet(silence_timeout_s=1.0, queue_timeout_s=5.0)
        generation = fleet.generate(HeadRequest(PROMPT, 1000))
        self.advance(0.1)
        link = fleet.nodes[0].link
        silent = link.when_closed()
        pumps, self.pumps = self.pumps, []
        for _ in range(85):
            self.reactor.advance(0.01)
        self.assertNoResult(silent)
        for _ in range(15):
            self.reactor.advance(0.01)
        self.assertIsInstance(self.successResultOf(silent), NodeSilentError)
        self.assertNoResult(generation.result)
        self.reactor.advance(5.0)
        self.failureResultOf(generation.result, NoNodeAvailable)
        self.pumps = pumps
        self.flush()
