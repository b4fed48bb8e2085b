"""Tests of the fleet (sfnode.head.fleet.fleet) against real node agents on a
``MemoryReactorClock``: the bytes move through iosim pumps and time moves only when a test says, so
the timing rules (the wall budget, the queue's timeout, the keepalive window) are pinned exactly,
and placement across several nodes (the policies, prefix affinity, the prefix index) runs with
no socket and no waiting (tests/nodefixture.py ``MemoryNodeTestCase``, tests/memoryhead.py
``MemoryHeadTestCase``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet import defer
from twisted.internet.testing import MemoryReactorClock

from sfnode.engines.mock import MOCK_LAYERS
from sfnode.generation import TokenBatch
from sfnode.head.fleet.backend import (
    FleetOutcome,
    GenerationTimedOut,
    HeadRequest,
    NoNodeAvailable,
)
from sfnode.head.fleet.fleet import (
    Fleet,
    FleetGeneration,
    FleetSettings,
    Policy,
    StreamTooLong,
)
from sfnode.head.fleet.pipeline import PipelineFleet, check_boundaries, even_boundaries
from sfnode.head.fleet.placement import NO_PREFIX
from sfnode.head.fleet.prefix_index import reusable_keys
from sfnode.head.link import NodeSilentError
from sfnode.linkf.wire import FINISH_LENGTH
from tests.memoryhead import MemoryHeadTestCase, stop_at_end
from tests.nodefixture import MEMORY_PORT, MemoryNode, MemoryNodeTestCase, expected_tokens
from tests.test_fleet import next_open

PROMPT = list(range(100, 112))


class MemoryFleetTests(MemoryNodeTestCase):
    def fleet(self, **options: object) -> Fleet:
        """A fleet on the test's memory reactor that has dialed the memory node."""
        assert isinstance(self.reactor, MemoryReactorClock)
        fleet = Fleet(self.reactor, FleetSettings(**options), ids=self.ids)  # type: ignore[arg-type]
        added = fleet.add_node(f"tcp:127.0.0.1:{MEMORY_PORT}")
        self.connect()
        self.successResultOf(added)
        stop_at_end(self, fleet.stop)
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


class StartingNodeTests(MemoryNodeTestCase):
    """The queue's timeout while a node the head dials has not answered for the first time
    (docs/protocol.md section 8.5, ``--node-start-timeout``)."""

    def starting(self, **options: Any) -> tuple[Fleet, defer.Deferred[Any]]:
        """A fleet dialing the memory node, which has not answered yet (the dial is left
        pending until the test calls ``connect()``), and the Deferred of that first dial."""
        assert isinstance(self.reactor, MemoryReactorClock)
        self.start_node(token_delay_s=0.01)
        fleet = Fleet(self.reactor, FleetSettings(**options), ids=self.ids)
        added = fleet.add_node(f"tcp:127.0.0.1:{MEMORY_PORT}")
        stop_at_end(self, fleet.stop)
        return fleet, added

    def fails_between(self, fleet: Fleet, waiting: float, failed: float) -> str:
        """A generation asked for now: still waiting at ``waiting`` seconds, failed with
        NoNodeAvailable by ``failed``; the failure's message."""
        generation = fleet.generate(HeadRequest(PROMPT, 30))
        self.advance(waiting)
        self.assertNoResult(generation.result)
        self.advance(failed - waiting)
        return str(self.failureResultOf(generation.result, NoNodeAvailable).value)

    def test_a_request_waits_past_its_timeout_for_a_node_still_starting(self) -> None:
        """A generation asked for while the dialled node has not answered (its first start
        loads the model) is still waiting at 5 s although its queue timeout is 2 s, and gets
        every token once the node answers; the queue counts no timeout."""
        fleet, added = self.starting(queue_timeout_s=2.0, node_start_s=60.0)
        generation = fleet.generate(HeadRequest(PROMPT, 30))
        self.advance(5.0)
        self.assertNoResult(generation.result)
        self.assertEqual(fleet.queued, 1)
        self.connect()
        self.successResultOf(added)
        self.advance(1.0)
        outcome = self.successResultOf(generation.result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 30))
        self.assertEqual(fleet.queue.timeouts, 0)

    def test_the_wait_for_a_starting_node_ends_with_its_start_timeout(self) -> None:
        """A node that never answers holds a waiting generation only until its start timeout
        (10 s after the head began dialing it): still waiting at 9.9 s, failed with
        NoNodeAvailable by 10.01 s, saying it also waited for the node's start."""
        fleet, _ = self.starting(queue_timeout_s=2.0, node_start_s=10.0)
        message = self.fails_between(fleet, 9.9, 10.01)
        self.assertIn("within 2 s, nor while a node it dials was starting", message)
        self.assertEqual((fleet.queued, fleet.queue.timeouts), (0, 1))

    def test_without_a_start_timeout_the_queue_timeout_is_all(self) -> None:
        """With node_start_s 0 a node that has not answered holds nobody: the generation
        fails at its queue timeout of 2 s, as when no node is starting."""
        fleet, _ = self.starting(queue_timeout_s=2.0, node_start_s=0.0)
        self.assertIn("within 2 s (", self.fails_between(fleet, 1.99, 2.0))

    def test_a_node_that_answered_once_holds_nobody_after_it_drops(self) -> None:
        """A node that joined and then went silent is not starting: with a start timeout of
        60 s, a generation waiting for it fails at its queue timeout (5 s) all the same."""
        self.start_node(token_delay_s=0.01)
        assert isinstance(self.reactor, MemoryReactorClock)
        fleet = Fleet(
            self.reactor,
            FleetSettings(silence_timeout_s=1.0, queue_timeout_s=5.0, node_start_s=60.0),
            ids=self.ids,
        )
        added = fleet.add_node(f"tcp:127.0.0.1:{MEMORY_PORT}")
        self.connect()
        self.successResultOf(added)
        stop_at_end(self, fleet.stop)
        silent = fleet.nodes[0].link.when_closed()
        pumps, self.pumps = self.pumps, []
        self.reactor.advance(1.1)
        self.successResultOf(silent)
        generation = fleet.generate(HeadRequest(PROMPT, 30))
        self.reactor.advance(4.99)
        self.assertNoResult(generation.result)
        self.reactor.advance(0.01)
        self.failureResultOf(generation.result, NoNodeAvailable)
        self.pumps = pumps


class PlacementTests(MemoryHeadTestCase):
    def three(self, **kwargs: Any) -> list[MemoryNode]:
        nodes = []
        for i in range(3):
            nodes.append(self.start_mock_node(identity=f"n{i}", **kwargs))
        return nodes

    def sessions_after_six_opens(self, fleet: Fleet, nodes: list[MemoryNode]) -> list[int]:
        """Opens 6 sessions on ``fleet``: how many each of ``nodes`` then holds."""
        for _ in range(6):
            self.wait(fleet.open_session(PROMPT))
        return [self.on(fleet, n).sessions for n in nodes]

    def test_least_loaded_spreads_sessions(self) -> None:
        """6 sessions on 3 nodes with least-loaded placement land 2, 2, 2."""
        nodes = self.three()
        fleet = self.fleet_of(nodes, policy=Policy.LEAST_LOADED)
        self.assertEqual(self.sessions_after_six_opens(fleet, nodes), [2, 2, 2])

    def test_load_aware_degrades_to_session_count_when_nothing_is_reported(
        self,
    ) -> None:
        """With no load reported, load-aware placement spreads by session count: 2, 2, 2."""
        nodes = self.three()
        fleet = self.fleet_of(nodes)
        self.assertIs(fleet.policy, Policy.LOAD_AWARE)
        self.assertEqual(self.sessions_after_six_opens(fleet, nodes), [2, 2, 2])

    def test_generation_routes_to_the_owning_node_and_is_correct(
        self,
    ) -> None:
        """Each session generates on the node it was placed on, with the local tokens."""
        nodes = self.three()
        fleet = self.fleet_of(nodes, policy=Policy.LEAST_LOADED)
        sessions = []
        for i in range(3):
            sessions.append(self.wait(fleet.open_session([*PROMPT, i])))
        outcomes = self.wait(defer.gatherResults([s.generate(10).result for s in sessions]))
        for i, (session, outcome) in enumerate(zip(sessions, outcomes, strict=True)):
            assert session.node is not None
            self.assertEqual(outcome.node, session.node.name)
            self.assertEqual(outcome.tokens, expected_tokens([*PROMPT, i], 10))
        self.assertEqual(sorted(o.node for o in outcomes), ["n0", "n1", "n2"])

    def test_round_robin_rotates_nodes(self) -> None:
        """Three round-robin placements land on three distinct nodes, in rotation."""
        nodes = self.three()
        fleet = self.fleet_of(nodes, policy="round-robin")
        placed = []
        for _ in range(4):
            session = self.wait(fleet.open_session(PROMPT))
            placed.append(session.node.name)
        self.assertEqual(placed, ["n0", "n1", "n2", "n0"])

    def test_concurrent_generation_across_nodes_is_correct(self) -> None:
        """12 concurrent one-shot generations on 3 nodes: all correct, all nodes used."""
        nodes = self.three(token_delay_s=0.001)
        fleet = self.fleet_of(nodes)
        generations = [fleet.generate(HeadRequest([*PROMPT, i], 16)) for i in range(12)]
        outcomes: list[FleetOutcome] = self.wait(
            defer.gatherResults([g.result for g in generations])
        )
        for i, outcome in enumerate(outcomes):
            self.assertEqual(outcome.tokens, expected_tokens([*PROMPT, i], 16))
        self.assertEqual({o.node for o in outcomes}, {"n0", "n1", "n2"})

    def test_capability_miss_does_not_poison_a_healthy_node(self) -> None:
        """Sessions for model-a go to the model-a node, model-b to model-b; an unknown model
        finds no node, and both nodes stay up."""
        a = self.start_mock_node(identity="a", model_name="model-a")
        b = self.start_mock_node(identity="b", model_name="model-b")
        fleet = self.fleet_of([a, b])
        for _ in range(2):
            sa = self.wait(fleet.open_session(PROMPT, model="model-a"))
            sb = self.wait(fleet.open_session(PROMPT, model="model-b"))
            self.assertEqual((sa.node.name, sb.node.name), ("a", "b"))
        self.wait_failure(fleet.open_session(PROMPT, model="model-c"), NoNodeAvailable)
        self.assertEqual(len(fleet.live_nodes()), 2)


SYSTEM_A = list(range(1000, 1480))
"""A 480-token "system prompt" (30 blocks)."""
SYSTEM_B = list(range(2000, 2480))


class PrefixPlacementTests(MemoryHeadTestCase):
    """Prefix affinity: the fleet's per-node prefix index and the rule of section 8.5."""

    def later_nodes(self, **kwargs: Any) -> tuple[list[str], list[str]]:
        """Two nodes; a request with system prompt A and one with B at once (A lands on n0,
        then B on n1, the idler), then one at a time three more of each, B first: the nodes
        the later A and B requests landed on."""
        nodes = []
        for i in range(2):
            nodes.append(self.start_mock_node(identity=f"n{i}"))
        fleet = self.fleet_of(nodes, **kwargs)
        first = [
            fleet.generate(HeadRequest([*SYSTEM_A, 1], 4)),
            fleet.generate(HeadRequest([*SYSTEM_B, 1], 4)),
        ]
        outcomes = self.wait(defer.gatherResults([g.result for g in first]))
        self.assertEqual([o.node for o in outcomes], ["n0", "n1"])
        later_a: list[str] = []
        later_b: list[str] = []
        for i in range(2, 5):
            outcome = self.wait(fleet.generate(HeadRequest([*SYSTEM_B, i], 4)).result)
            later_b.append(outcome.node)
            outcome = self.wait(fleet.generate(HeadRequest([*SYSTEM_A, i], 4)).result)
            later_a.append(outcome.node)
        return later_a, later_b

    def test_requests_sharing_a_prefix_land_where_it_is(self) -> None:
        """With two idle nodes, every later request lands on the node its system prompt was
        sent to first."""
        later_a, later_b = self.later_nodes()
        self.assertEqual((later_a, later_b), (["n0"] * 3, ["n1"] * 3))

    def test_without_the_rule_idle_nodes_go_by_registration(self) -> None:
        """With prefix weight 0 the same requests all go to the first registered idle node:
        the affinity above is the rule's doing."""
        later_a, later_b = self.later_nodes(prefix=NO_PREFIX)
        self.assertEqual((later_a, later_b), (["n0"] * 3, ["n0"] * 3))

    def test_the_index_learns_the_answer_and_the_next_turn(self) -> None:
        """After a generation the node's index holds the blocks of prompt and answer (what the
        node computed), so the next turn of the conversation matches beyond the old prompt;
        a session's appended turn is learned at once."""
        node = self.start_mock_node()
        fleet = self.fleet_of([node])
        prompt = [*SYSTEM_A, 1]
        outcome = self.wait(fleet.generate(HeadRequest(prompt, 40)).result)
        index = self.on(fleet, node).prefixes
        turn = [*prompt, *outcome.tokens, 7, 8, 9]
        self.assertEqual(
            index.cached_blocks(reusable_keys(turn, None)), (len(prompt) + 40 - 1) // 16
        )
        session = self.wait(fleet.open_session(SYSTEM_B))
        grown = [*SYSTEM_B, *range(3000, 3100)]
        self.assertEqual(index.cached_blocks(reusable_keys(grown, None)), 29)
        self.wait(session.append(grown))
        self.assertEqual(index.cached_blocks(reusable_keys([*grown, 1], None)), len(grown) // 16)

    def test_the_index_is_bounded_by_the_nodes_pool(self) -> None:
        """A node reporting 8 KV blocks is believed to hold at most 8, the newest."""
        node = self.start_mock_node(context_window=128, max_lanes=1)
        fleet = self.fleet_of([node])
        first = list(range(500, 600))
        second = list(range(700, 800))
        self.wait(fleet.generate(HeadRequest(first, 20)).result)
        self.wait(fleet.generate(HeadRequest(second, 20)).result)
        index = self.on(fleet, node).prefixes
        self.assertEqual((index.capacity, len(index)), (8, 8))
        self.assertEqual(index.cached_blocks(reusable_keys([*second, 1], None)), 6)
        self.assertEqual(index.cached_blocks(reusable_keys([*first, 1], None)), 0)

    def test_a_reconnect_forgets_what_the_node_held(self) -> None:
        """When a node's link opens again the node may be a new process: its index is empty
        until the head sends it prompts again."""
        node = self.start_mock_node()
        fleet = self.fleet_of([node])
        self.wait(fleet.generate(HeadRequest([*SYSTEM_A, 1], 4)).result)
        member = self.on(fleet, node)
        self.assertGreater(len(member.prefixes), 0)
        reopened = next_open(member)
        node.agent.close_connections("test drop")
        self.wait(reopened)
        self.assertEqual(len(member.prefixes), 0)

    def test_generations_that_ended_since_the_report_are_counted(
        self,
    ) -> None:
        """The fleet tells placement how many of its generations on a node ended after the
        node's latest load report, and forgets them when a new report arrives."""
        node = self.start_mock_node(status_interval_ms=600_000)
        fleet = self.fleet_of([node])
        member = self.on(fleet, node)
        self.advance(0.01)  # the generations end after the handshake's report, not with it
        self.wait(
            defer.gatherResults(
                [fleet.generate(HeadRequest([*PROMPT, i], 4)).result for i in range(2)]
            )
        )
        self.assertEqual(member.view(self.reactor.seconds()).ended_since_report, 2)
        reopened = next_open(member)
        node.agent.close_connections("test drop")
        self.wait(reopened)  # a new HELLO_ACK_F: a new load report
        self.assertEqual(member.view(self.reactor.seconds()).ended_since_report, 0)

    def test_other_policies_keep_no_index(self) -> None:
        """least-loaded placement does not weigh prefixes, so the fleet does not hash them."""
        node = self.start_mock_node()
        fleet = self.fleet_of([node], policy=Policy.LEAST_LOADED)
        self.assertFalse(fleet.prefix_aware)
        self.wait(fleet.generate(HeadRequest([*SYSTEM_A, 1], 4)).result)
        self.assertEqual(len(self.on(fleet, node).prefixes), 0)


class OneNodeTests(MemoryHeadTestCase):
    def test_a_fleet_generation_matches_a_local_run(self) -> None:
        """16 tokens through the fleet equal the mock's local greedy run; finish LENGTH."""
        node = self.start_mock_node(identity="solo")
        fleet = self.fleet_of([node])
        outcome = self.wait(fleet.generate(HeadRequest(PROMPT, 16)).result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 16))
        self.assertEqual(outcome.finish, FINISH_LENGTH)
        self.assertEqual(outcome.node, "solo")
        self.assertEqual(self.on(fleet, node).models, ("mock",))

    def test_streaming_delivers_incrementally_and_equals_the_result(
        self,
    ) -> None:
        """40 tokens arrive in several on_tokens batches; streamed == returned == local."""
        node = self.start_mock_node(token_delay_s=0.002)
        fleet = self.fleet_of([node])
        batches: list[list[int]] = []
        generation = fleet.generate(
            HeadRequest(PROMPT, 40),
            on_tokens=lambda t: batches.append(list(t)),
        )
        outcome = self.wait(generation.result)
        self.assertGreaterEqual(len(batches), 2)
        self.assertEqual([t for b in batches for t in b], outcome.tokens)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 40))

    def test_a_finished_one_shot_session_is_revoked_on_the_node(
        self,
    ) -> None:
        """After a one-shot generation the head revokes its session: the node forgets it."""
        node = self.start_mock_node()
        fleet = self.fleet_of([node])
        first = fleet.generate(HeadRequest(PROMPT, 4))
        self.wait(first.result)
        # A second request on the same connection: the revoke was handled before it.
        second = self.wait(fleet.open_session(PROMPT))
        self.wait(second.generate(2).result)
        contexts = node.agent.contexts_of
        self.assertNotIn(first.session.session_id, contexts(self.ids.head_id))
        self.assertIn(second.session_id, contexts(self.ids.head_id))
        second.close()
        self.wait(fleet.generate(HeadRequest(PROMPT, 1)).result)
        self.assertNotIn(second.session_id, contexts(self.ids.head_id))

    def test_cancel_reaches_the_node(self) -> None:
        """Cancel after a few streamed tokens: GENERATE_CANCEL stops the node's generation,
        finish CANCELLED, far fewer tokens than the budget."""
        node = self.start_mock_node(token_delay_s=0.005)
        fleet = self.fleet_of([node])
        generation: FleetGeneration | None = None

        def seen(_: Sequence[int]) -> None:
            assert generation is not None
            if len(generation.tokens) >= 5:
                generation.cancel()

        generation = fleet.generate(HeadRequest(PROMPT, 1_000_000), on_tokens=seen)
        self.assert_cancelled_after_five(self.wait(generation.result), node)

    def test_an_idle_drop_is_invisible_and_the_session_reconciles(
        self,
    ) -> None:
        """The node drops the idle link; the next append + generate reconnects, reconciles
        the held session and returns the tokens of the grown context.  Node and head run on
        the memory clock, so the link goes idle exactly once, when the test moves the clock
        past the 300 ms idle timeout, however slowly the machine runs."""
        node = self.start_mock_node(idle_timeout_ms=300)
        fleet = self.fleet_of([node])
        session = self.wait(fleet.open_session(PROMPT))
        outcome = self.wait(session.generate(8).result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 8))
        self.assertEqual(fleet.registry.reconnects, 0)
        closed = self.on(fleet, node).link.when_closed()
        self.advance(0.3)
        self.wait(closed)
        grown = [*PROMPT, *outcome.tokens, 7, 8, 9]
        self.wait(session.append(grown))
        again = self.wait(session.generate(8).result)
        self.assertEqual(again.tokens, expected_tokens(grown, 8))
        self.assertEqual(fleet.registry.reconnects, 1)
        self.assertEqual(fleet.failovers, 0)
        self.assertFalse(self.on(fleet, node).down)

    def test_a_link_dropped_mid_stream_reconciles_without_failover(
        self,
    ) -> None:
        """The node closes the link during a stream but stays up: the head reconnects,
        reconciles, and the stream completes with exactly the local tokens, none twice."""
        node = self.start_mock_node(token_delay_s=0.005)
        fleet = self.fleet_of([node])
        streamed: list[int] = []
        dropped: list[bool] = []

        def seen(tokens: Sequence[int]) -> None:
            streamed.extend(tokens)
            if len(streamed) >= 5 and not dropped:
                dropped.append(True)
                self.reactor.callLater(0, node.agent.close_connections, "test drop")

        outcome = self.wait(fleet.generate(HeadRequest(PROMPT, 30), on_tokens=seen).result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 30))
        self.assertEqual(streamed, outcome.tokens)
        self.assertEqual((fleet.registry.reconnects, fleet.failovers), (1, 0))


class WindowTests(MemoryHeadTestCase):
    def test_a_prompt_no_node_can_hold_is_refused_at_the_head(self) -> None:
        """A 96-token prompt against a 64-token node: StreamTooLong(96, 64) by type, from the
        head (nothing is placed); a fitting prompt still places."""
        node = self.start_mock_node(context_window=64)
        fleet = self.fleet_of([node])
        error = self.wait_failure(
            fleet.generate(HeadRequest(list(range(96)), 4)).result, StreamTooLong
        ).value
        self.assertEqual((error.length, error.max), (96, 64))
        self.assertRaises(StreamTooLong, fleet.check_fits, None, 96)
        self.assertEqual(self.on(fleet, node).sessions, 0)
        outcome = self.wait(fleet.generate(HeadRequest(PROMPT, 4)).result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 4))

    def test_a_cold_fleet_still_refuses_an_oversized_prompt_by_type(
        self,
    ) -> None:
        """With the window not known before the attempt, the refusal is still StreamTooLong."""
        node = self.start_mock_node(context_window=64)
        fleet = self.fleet_of([])
        fleet.add_node(node.endpoint)  # not waited for: the window is unknown for now
        error = self.wait_failure(
            fleet.generate(HeadRequest(list(range(96)), 4)).result, StreamTooLong
        ).value
        self.assertEqual((error.length, error.max), (96, 64))

    def test_placement_routes_around_a_node_too_narrow_for_the_prompt(
        self,
    ) -> None:
        """A 96-token prompt goes to the wide node; the narrow one still takes short prompts."""
        narrow = self.start_mock_node(identity="narrow", context_window=64)
        wide = self.start_mock_node(identity="wide", context_window=4096)
        fleet = self.fleet_of([narrow, wide], policy=Policy.ROUND_ROBIN)
        long_prompt = list(range(96))
        for _ in range(2):
            outcome = self.wait(fleet.generate(HeadRequest(long_prompt, 4)).result)
            self.assertEqual(outcome.node, "wide")
            self.assertEqual(outcome.tokens, expected_tokens(long_prompt, 4))
        names = set()
        for _ in range(2):
            names.add(self.wait(fleet.generate(HeadRequest(PROMPT, 2)).result).node)
        self.assertEqual(names, {"narrow", "wide"})

    def test_the_quoted_limit_ignores_nodes_that_serve_another_model(
        self,
    ) -> None:
        """StreamTooLong quotes the largest window among nodes of the requested model only."""
        small = self.start_mock_node(identity="s", model_name="m", context_window=64)
        other = self.start_mock_node(identity="o", model_name="x", context_window=4096)
        fleet = self.fleet_of([small, other])
        error = self.wait_failure(
            fleet.generate(HeadRequest(list(range(96)), 4, model="m")).result, StreamTooLong
        ).value
        self.assertEqual(error.max, 64)

    def test_a_session_that_outgrows_its_node_is_moved_to_one_that_fits(
        self,
    ) -> None:
        """An append past the 64-token window moves the session to the 4096-token node, which
        then generates the local tokens of the grown context; the narrow node forgets it."""
        narrow = self.start_mock_node(identity="narrow", context_window=64)
        wide = self.start_mock_node(identity="wide", context_window=4096)
        fleet = self.fleet_of([narrow, wide], policy=Policy.LEAST_LOADED)
        session = self.wait(fleet.open_session(PROMPT))
        self.assertEqual(session.node.name, "narrow")
        grown = list(range(100))
        self.wait(session.append(grown))
        self.assertEqual(session.node.name, "wide")
        outcome = self.wait(session.generate(5).result)
        self.assertEqual(outcome.tokens, expected_tokens(grown, 5))
        self.assertEqual(self.on(fleet, narrow).sessions, 0)
        self.wait(fleet.generate(HeadRequest(PROMPT, 1)).result)  # a round trip on each link
        self.wait(fleet.generate(HeadRequest(PROMPT, 1)).result)
        self.assertNotIn(session.session_id, narrow.agent.contexts_of(self.ids.head_id))


class QueueTests(MemoryHeadTestCase):
    def test_requests_beyond_the_lanes_wait_at_the_head(self) -> None:
        """A node with one lane runs one of the head's generations at a time: the second
        waits at the head (queued) until the first ends, and both answers are right."""
        node = self.start_mock_node(max_lanes=1, token_delay_s=0.002)
        fleet = self.fleet_of([node])
        first = fleet.generate(HeadRequest(PROMPT, 10))
        second = fleet.generate(HeadRequest([*PROMPT, 1], 10))
        self.assertEqual(fleet.queued, 1)
        outcomes = self.wait(defer.gatherResults([first.result, second.result]))
        self.assertEqual(
            [o.tokens for o in outcomes],
            [expected_tokens(PROMPT, 10), expected_tokens([*PROMPT, 1], 10)],
        )
        self.assertEqual(fleet.queued, 0)


class PipelineTests(MemoryHeadTestCase):
    def run_pipeline(
        self, stages: int, boundaries: list[int] | None
    ) -> list[int]:
        nodes = []
        for i in range(stages):
            nodes.append(self.start_mock_node(identity=f"stage{i}"))
        pipeline = PipelineFleet(
            self.reactor,
            [n.endpoint for n in nodes],
            boundaries=boundaries,
            n_layers=MOCK_LAYERS,
            ids=self.ids,
        )
        self.addCleanup(lambda: self.wait(pipeline.stop()))
        self.wait(pipeline.start())
        streamed: list[int] = []
        generation = pipeline.generate(HeadRequest(PROMPT, 8), on_tokens=streamed.extend)
        outcome = self.wait(generation.result)
        self.assertEqual(streamed, outcome.tokens)
        return list(outcome.tokens)

    def test_a_two_stage_pipeline_matches_a_single_full_node(self) -> None:
        """Layers split evenly over two mock stages give the tokens of one full node."""
        tokens = self.run_pipeline(2, None)
        self.assertEqual(tokens, expected_tokens(PROMPT, 8))

    def test_a_three_stage_pipeline_with_given_boundaries_matches(
        self,
    ) -> None:
        """Boundaries [8, 16, 24] over three stages give the tokens of one full node."""
        tokens = self.run_pipeline(3, [8, 16, 24])
        self.assertEqual(tokens, expected_tokens(PROMPT, 8))

    def test_stages_without_a_free_session_recompute(self) -> None:
        """Three generations at once over two mock stages that keep one stage session each
        (one lane): the first keeps its KV, the others are refused a session and recompute
        (docs/protocol.md section 12.8); all three give one full node's tokens."""
        nodes = [self.start_mock_node(identity=f"stage{i}", max_lanes=1) for i in range(2)]
        pipeline = PipelineFleet(
            self.reactor, [n.endpoint for n in nodes], n_layers=MOCK_LAYERS, ids=self.ids
        )
        self.addCleanup(lambda: self.wait(pipeline.stop()))
        self.wait(pipeline.start())
        prompts = [[*PROMPT, k] for k in range(3)]
        running = [pipeline.generate(HeadRequest(p, 8)) for p in prompts]
        outcomes = self.wait(defer.gatherResults([g.result for g in running]))
        for prompt, outcome in zip(prompts, outcomes, strict=True):
            self.assertEqual(outcome.tokens, expected_tokens(prompt, 8))
        self.assertEqual([g._kept.recomputes for g in running].count(True), 2)

    def test_tokens_reach_the_caller_as_a_node_sends_them(self) -> None:
        """docs/protocol.md section 4.4: the first token at once, then 16 at a time (no
        time passes here), the rest before the result; together exactly the tokens."""
        nodes = [self.start_mock_node(identity=f"stage{i}") for i in range(2)]
        pipeline = PipelineFleet(
            self.reactor, [n.endpoint for n in nodes], n_layers=MOCK_LAYERS, ids=self.ids
        )
        self.addCleanup(lambda: self.wait(pipeline.stop()))
        self.wait(pipeline.start())
        batches: list[tuple[int, ...]] = []
        generation = pipeline.generate(
            HeadRequest(PROMPT, 40), on_tokens=lambda batch: batches.append(batch.tokens)
        )
        outcome = self.wait(generation.result)
        self.assertEqual([len(b) for b in batches], [1, 16, 16, 7])
        self.assertEqual([t for b in batches for t in b], outcome.tokens)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 40))

    def test_boundaries(self) -> None:
        """Even boundaries are ((i+1)·n) // P; given ones must be one per stage, increasing."""
        self.assertEqual(even_boundaries(24, 2), [12, 24])
        self.assertEqual(even_boundaries(10, 3), [3, 6, 10])
        self.assertRaises(ValueError, check_boundaries, [12], 2)
        self.assertRaises(ValueError, check_boundaries, [12, 12], 2)
