"""The fleet head (sfnode.head.fleet) against real mock-engine nodes over loopback TCP.

These pin the head scenarios of LINKF section 8 (items 19-62): placement spreads and routes,
round robin rotates, a dead node is skipped and used again, failover of streaming and
non-streaming generations gives exactly the tokens of an uninterrupted run, a reconnect after a
dropped link is invisible, cancel reaches the node, prompts too long are refused by type, and
sessions move when they outgrow their node.  No sleeps: every wait is a Deferred.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.config import NodeConfig
from sfnode.generation import MOCK_LAYERS, MOCK_VOCAB_SIZE, MockEngine
from sfnode.head.fleet import (
    Fleet,
    FleetGeneration,
    FleetNode,
    FleetOutcome,
    NoNodeAvailable,
    Policy,
    StreamTooLong,
)
from sfnode.head.pipeline import PipelineFleet, check_boundaries, even_boundaries
from sfnode.node import NodeAgent
from sfnode.tap import node_factory
from sfnode.wire import FINISH_CANCELLED, FINISH_LENGTH, CapacitySummary
from tests.nodefixture import NodeTestCase, RunningNode, expected_tokens

PROMPT = list(range(100, 112))


class FleetTestCase(NodeTestCase):
    """Starts mock nodes (any model name, window, vocabulary) and fleets over them."""

    @defer.inlineCallbacks
    def start_mock_node(
        self,
        *,
        identity: str = "node",
        model_name: str = "mock",
        context_window: int = 4096,
        max_lanes: int = 8,
        token_delay_s: float = 0.0,
        vocab_size: int = MOCK_VOCAB_SIZE,
        port: int = 0,
        **config: Any,
    ) -> Generator[defer.Deferred[Any], Any, RunningNode]:
        engine = MockEngine(
            reactor,
            context_window=context_window,
            max_lanes=max_lanes,
            token_delay_s=token_delay_s,
            vocab_size=vocab_size,
        )
        agent = NodeAgent(
            reactor,
            engine,
            NodeConfig(identity=identity, model_name=model_name, max_lanes=max_lanes, **config),
        )
        agent.start()
        listening = yield TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(
            node_factory(agent)
        )
        self.addCleanup(agent.stop)
        self.addCleanup(listening.stopListening)
        return RunningNode(agent, engine, listening)

    @defer.inlineCallbacks
    def relisten(self, node: RunningNode, port: int) -> Generator[defer.Deferred[Any], Any, None]:
        """Listen again on a stopped node's old port (the node 'answers' again)."""
        node.port = yield TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(
            node_factory(node.agent)
        )
        self.addCleanup(node.port.stopListening)

    @defer.inlineCallbacks
    def kill(self, node: RunningNode) -> Generator[defer.Deferred[Any], Any, None]:
        """The node dies: no more connections, the open ones closed, its engine stopped."""
        yield node.port.stopListening()
        yield node.agent.stop()

    @defer.inlineCallbacks
    def fleet_of(
        self, nodes: Sequence[RunningNode], **kwargs: Any
    ) -> Generator[defer.Deferred[Any], Any, Fleet]:
        fleet = Fleet(reactor, ids=self.ids, **kwargs)
        self.addCleanup(fleet.stop)
        for node in nodes:
            yield fleet.add_node(node.endpoint)
        return fleet

    def on(self, fleet: Fleet, node: RunningNode) -> FleetNode:
        found = fleet.node_named(node.agent.config.identity)
        assert found is not None
        return found


class OneNodeTests(FleetTestCase):
    @defer.inlineCallbacks
    def test_a_fleet_generation_matches_a_local_run(self) -> Generator[Any, Any, None]:
        """16 tokens through the fleet equal the mock's local greedy run; finish LENGTH."""
        node = yield self.start_mock_node(identity="solo")
        fleet = yield self.fleet_of([node])
        outcome = yield fleet.generate(PROMPT, 16).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 16))
        self.assertEqual(outcome.finish, FINISH_LENGTH)
        self.assertEqual(outcome.node, "solo")
        self.assertEqual(self.on(fleet, node).models, ("mock",))

    @defer.inlineCallbacks
    def test_streaming_delivers_incrementally_and_equals_the_result(
        self,
    ) -> Generator[Any, Any, None]:
        """40 tokens arrive in several on_tokens batches; streamed == returned == local."""
        node = yield self.start_mock_node(token_delay_s=0.002)
        fleet = yield self.fleet_of([node])
        batches: list[list[int]] = []
        generation = fleet.generate(PROMPT, 40, on_tokens=lambda t: batches.append(list(t)))
        outcome = yield generation.result
        self.assertGreaterEqual(len(batches), 2)
        self.assertEqual([t for b in batches for t in b], outcome.tokens)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 40))

    @defer.inlineCallbacks
    def test_a_finished_one_shot_session_is_revoked_on_the_node(
        self,
    ) -> Generator[Any, Any, None]:
        """After a one-shot generation the head revokes its session: the node forgets it."""
        node = yield self.start_mock_node()
        fleet = yield self.fleet_of([node])
        first = fleet.generate(PROMPT, 4)
        yield first.result
        # A second request on the same connection: the revoke was handled before it.
        second = yield fleet.open_session(PROMPT)
        yield second.generate(2).result
        self.assertNotIn(first.session.session_id, node.agent.contexts)
        self.assertIn(second.session_id, node.agent.contexts)
        second.close()
        yield fleet.generate(PROMPT, 1).result
        self.assertNotIn(second.session_id, node.agent.contexts)

    @defer.inlineCallbacks
    def test_cancel_reaches_the_node(self) -> Generator[Any, Any, None]:
        """Cancel after a few streamed tokens: GENERATE_CANCEL stops the node's generation,
        finish CANCELLED, far fewer tokens than the budget."""
        node = yield self.start_mock_node(token_delay_s=0.005)
        fleet = yield self.fleet_of([node])
        generation: FleetGeneration | None = None

        def seen(_: Sequence[int]) -> None:
            assert generation is not None
            if len(generation.tokens) >= 5:
                generation.cancel()

        generation = fleet.generate(PROMPT, 1_000_000, on_tokens=seen)
        outcome = yield generation.result
        self.assertEqual(outcome.finish, FINISH_CANCELLED)
        self.assertGreaterEqual(len(outcome.tokens), 5)
        self.assertLess(len(outcome.tokens), 1000)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, len(outcome.tokens)))
        self.assertEqual(node.agent.running_generations, 0)

    @defer.inlineCallbacks
    def test_an_idle_drop_is_invisible_and_the_session_reconciles(
        self,
    ) -> Generator[Any, Any, None]:
        """The node drops the idle link; the next append + generate reconnects, reconciles
        the held session and returns the tokens of the grown context."""
        node = yield self.start_mock_node(idle_timeout_ms=300)
        fleet = yield self.fleet_of([node])
        session = yield fleet.open_session(PROMPT)
        outcome = yield session.generate(8).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 8))
        yield self.on(fleet, node).link.when_closed()
        grown = [*PROMPT, *outcome.tokens, 7, 8, 9]
        yield session.append(grown)
        again = yield session.generate(8).result
        self.assertEqual(again.tokens, expected_tokens(grown, 8))
        self.assertEqual(fleet.reconnects, 1)
        self.assertEqual(fleet.failovers, 0)
        self.assertFalse(self.on(fleet, node).down)

    @defer.inlineCallbacks
    def test_a_link_dropped_mid_stream_reconciles_without_failover(
        self,
    ) -> Generator[Any, Any, None]:
        """The node closes the link during a stream but stays up: the head reconnects,
        reconciles, and the stream completes with exactly the local tokens, none twice."""
        node = yield self.start_mock_node(token_delay_s=0.005)
        fleet = yield self.fleet_of([node])
        streamed: list[int] = []
        dropped: list[bool] = []

        def seen(tokens: Sequence[int]) -> None:
            streamed.extend(tokens)
            if len(streamed) >= 5 and not dropped:
                dropped.append(True)
                reactor.callLater(0, node.agent.close_connections, "test drop")

        outcome = yield fleet.generate(PROMPT, 30, on_tokens=seen).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 30))
        self.assertEqual(streamed, outcome.tokens)
        self.assertEqual((fleet.reconnects, fleet.failovers), (1, 0))

    @defer.inlineCallbacks
    def test_a_node_that_dials_in_is_adopted_and_serves(self) -> Generator[Any, Any, None]:
        """A node that dials the head's fleet port joins by identity and serves a generation."""
        fleet = Fleet(reactor, ids=self.ids)
        self.addCleanup(fleet.stop)
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            fleet.listen_factory()
        )
        self.addCleanup(port.stopListening)
        engine = MockEngine(reactor)
        agent = NodeAgent(reactor, engine, NodeConfig(identity="dialer", model_name="mock"))
        agent.start()
        self.addCleanup(agent.stop)
        joined = fleet.next_join()
        dial = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        yield dial.connect(node_factory(agent))
        node = yield joined
        self.assertEqual(node.name, "dialer")
        outcome = yield fleet.generate(PROMPT, 12).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 12))
        self.assertEqual([n.name for n in fleet.live_nodes()], ["dialer"])
        yield agent.close_connections("leaving")
        yield node.link.when_closed()
        self.assertEqual(fleet.live_nodes(), [])


class PlacementTests(FleetTestCase):
    @defer.inlineCallbacks
    def three(self, **kwargs: Any) -> Generator[Any, Any, list[RunningNode]]:
        nodes = []
        for i in range(3):
            nodes.append((yield self.start_mock_node(identity=f"n{i}", **kwargs)))
        return nodes

    @defer.inlineCallbacks
    def test_least_loaded_spreads_sessions(self) -> Generator[Any, Any, None]:
        """6 sessions on 3 nodes with least-loaded placement land 2, 2, 2."""
        nodes = yield self.three()
        fleet = yield self.fleet_of(nodes, policy=Policy.LEAST_LOADED)
        for _ in range(6):
            yield fleet.open_session(PROMPT)
        self.assertEqual([self.on(fleet, n).sessions for n in nodes], [2, 2, 2])

    @defer.inlineCallbacks
    def test_load_aware_degrades_to_session_count_when_nothing_is_reported(
        self,
    ) -> Generator[Any, Any, None]:
        """With no load reported, load-aware placement spreads by session count: 2, 2, 2."""
        nodes = yield self.three()
        fleet = yield self.fleet_of(nodes)
        self.assertIs(fleet.policy, Policy.LOAD_AWARE)
        for _ in range(6):
            yield fleet.open_session(PROMPT)
        self.assertEqual([self.on(fleet, n).sessions for n in nodes], [2, 2, 2])

    @defer.inlineCallbacks
    def test_generation_routes_to_the_owning_node_and_is_correct(
        self,
    ) -> Generator[Any, Any, None]:
        """Each session generates on the node it was placed on, with the local tokens."""
        nodes = yield self.three()
        fleet = yield self.fleet_of(nodes, policy=Policy.LEAST_LOADED)
        sessions = []
        for i in range(3):
            sessions.append((yield fleet.open_session([*PROMPT, i])))
        outcomes = yield defer.gatherResults([s.generate(10).result for s in sessions])
        for i, (session, outcome) in enumerate(zip(sessions, outcomes, strict=True)):
            assert session.node is not None
            self.assertEqual(outcome.node, session.node.name)
            self.assertEqual(outcome.tokens, expected_tokens([*PROMPT, i], 10))
        self.assertEqual(sorted(o.node for o in outcomes), ["n0", "n1", "n2"])

    @defer.inlineCallbacks
    def test_round_robin_rotates_nodes(self) -> Generator[Any, Any, None]:
        """Three round-robin placements land on three distinct nodes, in rotation."""
        nodes = yield self.three()
        fleet = yield self.fleet_of(nodes, policy="round-robin")
        placed = []
        for _ in range(4):
            session = yield fleet.open_session(PROMPT)
            placed.append(session.node.name)
        self.assertEqual(placed, ["n0", "n1", "n2", "n0"])

    @defer.inlineCallbacks
    def test_concurrent_generation_across_nodes_is_correct(self) -> Generator[Any, Any, None]:
        """12 concurrent one-shot generations on 3 nodes: all correct, all nodes used."""
        nodes = yield self.three(token_delay_s=0.001)
        fleet = yield self.fleet_of(nodes)
        generations = [fleet.generate([*PROMPT, i], 16) for i in range(12)]
        outcomes: list[FleetOutcome] = yield defer.gatherResults([g.result for g in generations])
        for i, outcome in enumerate(outcomes):
            self.assertEqual(outcome.tokens, expected_tokens([*PROMPT, i], 16))
        self.assertEqual({o.node for o in outcomes}, {"n0", "n1", "n2"})

    @defer.inlineCallbacks
    def test_capability_miss_does_not_poison_a_healthy_node(self) -> Generator[Any, Any, None]:
        """Sessions for model-a go to the model-a node, model-b to model-b; an unknown model
        finds no node, and both nodes stay up."""
        a = yield self.start_mock_node(identity="a", model_name="model-a")
        b = yield self.start_mock_node(identity="b", model_name="model-b")
        fleet = yield self.fleet_of([a, b])
        for _ in range(2):
            sa = yield fleet.open_session(PROMPT, model="model-a")
            sb = yield fleet.open_session(PROMPT, model="model-b")
            self.assertEqual((sa.node.name, sb.node.name), ("a", "b"))
        yield self.assertFailure(fleet.open_session(PROMPT, model="model-c"), NoNodeAvailable)
        self.assertEqual(len(fleet.live_nodes()), 2)


class LivenessTests(FleetTestCase):
    @defer.inlineCallbacks
    def test_a_dead_node_is_skipped_and_used_again_once_it_answers(
        self,
    ) -> Generator[Any, Any, None]:
        """A node that hung up is marked down and skipped (all placements go to the live one);
        after it listens again and the retry ran, it receives placements again."""
        a = yield self.start_mock_node(identity="a")
        b = yield self.start_mock_node(identity="b")
        fleet = yield self.fleet_of([a, b], policy=Policy.LEAST_LOADED)
        port = a.port_number
        yield self.kill(a)
        yield self.on(fleet, a).link.when_closed()  # the head saw the connection go
        for _ in range(4):
            session = yield fleet.open_session(PROMPT)
            self.assertEqual(session.node.name, "b")
        self.assertTrue(self.on(fleet, a).down)
        self.assertEqual([n.name for n in fleet.live_nodes()], ["b"])
        yield self.relisten(a, port)
        yield fleet.retry_down_nodes()
        self.assertFalse(self.on(fleet, a).down)
        placed = []
        for _ in range(2):
            session = yield fleet.open_session(PROMPT)
            placed.append(session.node.name)
        self.assertEqual(placed, ["a", "a"])
        outcome = yield session.generate(6).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 6))

    @defer.inlineCallbacks
    def test_a_silent_node_does_not_keep_looking_idle(self) -> Generator[Any, Any, None]:
        """A cold node whose address is dead is tried once, marked down, and never wins a
        load-aware placement again."""
        dead = yield self.start_mock_node(identity="dead")
        live = yield self.start_mock_node(identity="live")
        dead_endpoint = dead.endpoint
        yield dead.port.stopListening()
        fleet = Fleet(reactor, ids=self.ids)
        self.addCleanup(fleet.stop)
        cold = yield fleet.add_node(dead_endpoint, connect=False)
        yield fleet.add_node(live.endpoint)
        for _ in range(3):
            session = yield fleet.open_session(PROMPT)
            self.assertEqual(session.node.name, "live")
        self.assertTrue(cold.down)

    def test_keepalives_every_15_s_and_retries_every_10_s(self) -> None:
        """The fleet's loops run on its clock: KEEPALIVE on open links every 15 s, a retry of
        down nodes every 10 s."""
        clock = Clock()
        fleet = Fleet(reactor, ids=self.ids, clock=clock)
        calls: list[str] = []

        class Recorder:
            dialable = True
            hello_ack = None
            capacity = None
            models = ()

            def __init__(self, connected: bool) -> None:
                self.connected = connected

            def keepalive(self) -> None:
                calls.append("keepalive")

            def reconnect(self) -> defer.Deferred[None]:
                calls.append("reconnect")
                return defer.Deferred()

        up = FleetNode(Recorder(True), "up", 0)  # type: ignore[arg-type]
        up.ever_connected = True
        down = FleetNode(Recorder(False), "down", 1)  # type: ignore[arg-type]
        down.ever_connected = True
        down.down = True
        fleet.nodes.extend([up, down])
        fleet.start()
        self.addCleanup(lambda: setattr(fleet, "_stopping", True))
        clock.advance(9.9)
        self.assertEqual(calls, [])
        clock.advance(0.1)
        self.assertEqual(calls, ["reconnect"])
        clock.advance(5)
        self.assertEqual(calls, ["reconnect", "keepalive"])
        for loop in (fleet._keepalive, fleet._retry):
            loop.stop()

    @defer.inlineCallbacks
    def test_failover_when_the_owning_node_died_while_idle(self) -> Generator[Any, Any, None]:
        """A session's node dies between turns: the next generate moves the session to the
        survivor and returns the local tokens."""
        a = yield self.start_mock_node(identity="a")
        b = yield self.start_mock_node(identity="b")
        fleet = yield self.fleet_of([a, b], policy=Policy.LEAST_LOADED)
        session = yield fleet.open_session(PROMPT)
        self.assertEqual(session.node.name, "a")
        yield self.kill(a)
        outcome = yield session.generate(12).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 12))
        self.assertEqual((outcome.node, outcome.failovers), ("b", 1))
        self.assertEqual(session.node.name, "b")
        # The session keeps its own context on the new node for the next turn.
        again = yield session.generate(4).result
        self.assertEqual(again.tokens, expected_tokens(PROMPT, 4))

    @defer.inlineCallbacks
    def test_streaming_generation_fails_over_when_the_owning_node_dies(
        self,
    ) -> Generator[Any, Any, None]:
        """The node dies after 7 streamed tokens: the stream continues on the survivor with
        prompt + delivered as context and equals the uninterrupted run, no token twice."""
        a = yield self.start_mock_node(identity="a", token_delay_s=0.005)
        b = yield self.start_mock_node(identity="b", token_delay_s=0.001)
        fleet = yield self.fleet_of([a, b], policy=Policy.LEAST_LOADED)
        streamed: list[int] = []
        killed: list[bool] = []

        def seen(tokens: Sequence[int]) -> None:
            streamed.extend(tokens)
            if len(streamed) >= 7 and not killed:
                killed.append(True)
                reactor.callLater(0, self.kill, a)

        outcome = yield fleet.generate(PROMPT, 40, on_tokens=seen).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 40))
        self.assertEqual(streamed, outcome.tokens)
        self.assertEqual(outcome.finish, FINISH_LENGTH)
        self.assertEqual((outcome.node, outcome.failovers, fleet.failovers), ("b", 1, 1))
        self.assertTrue(self.on(fleet, a).down)
        self.assertNotEqual(b.agent.engine.statistics().decoded_tokens, 0)

    @defer.inlineCallbacks
    def test_non_streaming_generation_fails_over_when_the_owning_node_dies(
        self,
    ) -> Generator[Any, Any, None]:
        """A non-streaming generation whose node dies mid-way (after its engine made 7
        tokens) returns exactly the tokens of an uninterrupted run, from the survivor."""
        a = yield self.start_mock_node(identity="a", token_delay_s=0.005)
        b = yield self.start_mock_node(identity="b")
        fleet = yield self.fleet_of([a, b], policy=Policy.LEAST_LOADED)
        submit = a.engine.submit
        killed: list[bool] = []

        def submit_and_watch(request: Any, on_tokens: Any) -> Any:
            made: list[int] = []

            def watched(tokens: Sequence[int]) -> None:
                on_tokens(tokens)
                made.extend(tokens)
                if len(made) >= 7 and not killed:
                    killed.append(True)
                    reactor.callLater(0, self.kill, a)

            return submit(request, watched)

        a.engine.submit = submit_and_watch  # type: ignore[method-assign]
        outcome = yield fleet.generate(PROMPT, 30).result
        self.assertEqual(killed, [True])
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 30))
        self.assertEqual((outcome.node, outcome.failovers), ("b", 1))

    @defer.inlineCallbacks
    def test_continuation_from_a_prefix_matches_the_full_generation(
        self,
    ) -> Generator[Any, Any, None]:
        """k tokens, then a continuation from prompt + those k, equals the full run (the
        determinism failover relies on)."""
        node = yield self.start_mock_node()
        fleet = yield self.fleet_of([node])
        full = yield fleet.generate(PROMPT, 20).result
        prefix = yield fleet.generate(PROMPT, 6).result
        rest = yield fleet.generate([*PROMPT, *prefix.tokens], 14).result
        self.assertEqual(prefix.tokens + rest.tokens, full.tokens)


class WindowTests(FleetTestCase):
    @defer.inlineCallbacks
    def test_a_prompt_no_node_can_hold_is_refused_at_the_head(self) -> Generator[Any, Any, None]:
        """A 96-token prompt against a 64-token node: StreamTooLong(96, 64) by type, from the
        head (nothing is placed); a fitting prompt still places."""
        node = yield self.start_mock_node(context_window=64)
        fleet = yield self.fleet_of([node])
        error = yield self.assertFailure(fleet.generate(list(range(96)), 4).result, StreamTooLong)
        self.assertEqual((error.length, error.max), (96, 64))
        self.assertRaises(StreamTooLong, fleet.check_fits, None, 96)
        self.assertEqual(self.on(fleet, node).sessions, 0)
        outcome = yield fleet.generate(PROMPT, 4).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 4))

    @defer.inlineCallbacks
    def test_a_cold_fleet_still_refuses_an_oversized_prompt_by_type(
        self,
    ) -> Generator[Any, Any, None]:
        """With the window not known before the attempt, the refusal is still StreamTooLong."""
        node = yield self.start_mock_node(context_window=64)
        fleet = Fleet(reactor, ids=self.ids)
        self.addCleanup(fleet.stop)
        yield fleet.add_node(node.endpoint, connect=False)
        error = yield self.assertFailure(fleet.generate(list(range(96)), 4).result, StreamTooLong)
        self.assertEqual((error.length, error.max), (96, 64))

    @defer.inlineCallbacks
    def test_placement_routes_around_a_node_too_narrow_for_the_prompt(
        self,
    ) -> Generator[Any, Any, None]:
        """A 96-token prompt goes to the wide node; the narrow one still takes short prompts."""
        narrow = yield self.start_mock_node(identity="narrow", context_window=64)
        wide = yield self.start_mock_node(identity="wide", context_window=4096)
        fleet = yield self.fleet_of([narrow, wide], policy=Policy.ROUND_ROBIN)
        long_prompt = list(range(96))
        for _ in range(2):
            outcome = yield fleet.generate(long_prompt, 4).result
            self.assertEqual(outcome.node, "wide")
            self.assertEqual(outcome.tokens, expected_tokens(long_prompt, 4))
        names = set()
        for _ in range(2):
            names.add((yield fleet.generate(PROMPT, 2).result).node)
        self.assertEqual(names, {"narrow", "wide"})

    @defer.inlineCallbacks
    def test_the_quoted_limit_ignores_nodes_that_serve_another_model(
        self,
    ) -> Generator[Any, Any, None]:
        """StreamTooLong quotes the largest window among nodes of the requested model only."""
        small = yield self.start_mock_node(identity="s", model_name="m", context_window=64)
        other = yield self.start_mock_node(identity="o", model_name="x", context_window=4096)
        fleet = yield self.fleet_of([small, other])
        error = yield self.assertFailure(
            fleet.generate(list(range(96)), 4, model="m").result, StreamTooLong
        )
        self.assertEqual(error.max, 64)

    @defer.inlineCallbacks
    def test_a_session_that_outgrows_its_node_is_moved_to_one_that_fits(
        self,
    ) -> Generator[Any, Any, None]:
        """An append past the 64-token window moves the session to the 4096-token node, which
        then generates the local tokens of the grown context; the narrow node forgets it."""
        narrow = yield self.start_mock_node(identity="narrow", context_window=64)
        wide = yield self.start_mock_node(identity="wide", context_window=4096)
        fleet = yield self.fleet_of([narrow, wide], policy=Policy.LEAST_LOADED)
        session = yield fleet.open_session(PROMPT)
        self.assertEqual(session.node.name, "narrow")
        grown = list(range(100))
        yield session.append(grown)
        self.assertEqual(session.node.name, "wide")
        outcome = yield session.generate(5).result
        self.assertEqual(outcome.tokens, expected_tokens(grown, 5))
        self.assertEqual(self.on(fleet, narrow).sessions, 0)
        yield fleet.generate(PROMPT, 1).result  # a round trip on each link
        yield fleet.generate(PROMPT, 1).result
        self.assertNotIn(session.session_id, narrow.agent.contexts)


class _FakeLink:
    """Just what placement reads of a link: connected, capacity, models."""

    dialable = True
    hello_ack = None
    models: tuple[str, ...] = ()
    connected = True

    def __init__(self, capacity: CapacitySummary) -> None:
        self.capacity = capacity


class LoadAwareTests(SynchronousTestCase):
    def fleet(self, *capacities: CapacitySummary) -> tuple[Fleet, list[FleetNode]]:
        fleet = Fleet(Clock())
        nodes = [
            FleetNode(_FakeLink(c), f"n{i}", i)  # type: ignore[arg-type]
            for i, c in enumerate(capacities)
        ]
        for node in nodes:
            node.ever_connected = True
        fleet.nodes.extend(nodes)
        return fleet, nodes

    def test_the_eta_prefers_the_node_with_less_work_ahead(self) -> None:
        """A fresh report of busy lanes and a queue puts a node behind an idle one, even with
        fewer sessions; a faster decode rate wins among equals."""
        busy = CapacitySummary(lanes_active=6, queue_depth=2, decode_tokens_per_s=50)
        idle = CapacitySummary(decode_tokens_per_s=50)
        fast = CapacitySummary(decode_tokens_per_s=500)
        fleet, (b, i, f) = self.fleet(busy, idle, fast)
        i.sessions = f.sessions = 3
        self.assertEqual(fleet.candidates(None, 10), [f, i, b])

    def test_a_hot_kv_pool_is_avoided_unless_all_are_hot(self) -> None:
        """A node at >= 90 % KV occupancy is dropped from the candidates while another is
        cooler; when all are hot they all stay."""
        hot = CapacitySummary(kv_blocks_used=95, kv_blocks_total=100)
        cool = CapacitySummary(kv_blocks_used=10, kv_blocks_total=100)
        fleet, (_, c) = self.fleet(hot, cool)
        self.assertEqual(fleet.candidates(None, 10), [c])
        fleet, (h1, h2) = self.fleet(hot, hot)
        self.assertEqual(fleet.candidates(None, 10), [h1, h2])

    def test_a_stale_report_counts_only_the_heads_own_inflight(self) -> None:
        """A report older than 10 s no longer counts as the node's load."""
        busy = CapacitySummary(lanes_active=8, queue_depth=8)
        fleet, (b, other) = self.fleet(busy, CapacitySummary())
        other.inflight = 1
        self.assertEqual(fleet.candidates(None, 10), [other, b])
        clock = fleet._clock
        assert isinstance(clock, Clock)
        clock.advance(11)
        self.assertEqual(fleet.candidates(None, 10), [b, other])


class PipelineTests(FleetTestCase):
    @defer.inlineCallbacks
    def run_pipeline(
        self, stages: int, boundaries: list[int] | None
    ) -> Generator[Any, Any, list[int]]:
        nodes = []
        for i in range(stages):
            nodes.append((yield self.start_mock_node(identity=f"stage{i}")))
        pipeline = PipelineFleet(
            reactor,
            [n.endpoint for n in nodes],
            boundaries=boundaries,
            n_layers=MOCK_LAYERS,
            ids=self.ids,
        )
        self.addCleanup(pipeline.stop)
        yield pipeline.start()
        streamed: list[int] = []
        outcome = yield pipeline.generate(PROMPT, 8, on_tokens=streamed.extend).result
        self.assertEqual(streamed, outcome.tokens)
        return list(outcome.tokens)

    @defer.inlineCallbacks
    def test_a_two_stage_pipeline_matches_a_single_full_node(self) -> Generator[Any, Any, None]:
        """Layers split evenly over two mock stages give the tokens of one full node."""
        tokens = yield self.run_pipeline(2, None)
        self.assertEqual(tokens, expected_tokens(PROMPT, 8))

    @defer.inlineCallbacks
    def test_a_three_stage_pipeline_with_given_boundaries_matches(
        self,
    ) -> Generator[Any, Any, None]:
        """Boundaries [8, 16, 24] over three stages give the tokens of one full node."""
        tokens = yield self.run_pipeline(3, [8, 16, 24])
        self.assertEqual(tokens, expected_tokens(PROMPT, 8))

    def test_boundaries(self) -> None:
        """Even boundaries are ((i+1)·n) // P; given ones must be one per stage, increasing."""
        self.assertEqual(even_boundaries(24, 2), [12, 24])
        self.assertEqual(even_boundaries(10, 3), [3, 6, 10])
        self.assertRaises(ValueError, check_boundaries, [12], 2)
        self.assertRaises(ValueError, check_boundaries, [12, 12], 2)
