"""The fleet head (sfnode.head.fleet.fleet) against real mock-engine nodes over loopback TCP,
for what is about sockets.

These pin the head's behaviour of docs/protocol.md section 8 when nodes come and go: a node
that dials in is adopted, a dead node is skipped and used again once it answers, failover of
streaming and non-streaming generations gives exactly the tokens of an uninterrupted run, a
hung node's streams fail over within the keepalive window, requests wait in a bounded queue
for a node (and leave it when cancelled).  The rest (placement and prefix affinity, one node's
streaming, cancel and reconnects, windows, the lanes, the pipeline) is pinned on the memory
reactor in tests/test_fleet_memory.py.  No sleeps: every wait is a Deferred.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from sfnode.engines.mock import MockEngine
from sfnode.generation import TokenBatch
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.fleet import (
    Fleet,
    FleetNode,
    FleetSettings,
    NoNodeAvailable,
    Policy,
    QueueFull,
)
from sfnode.linkf.wire import FINISH_CANCELLED, FINISH_LENGTH
from sfnode.node.agent import NodeAgent
from sfnode.node.config import NodeConfig
from sfnode.node.tap import node_factory
from tests.nodefixture import NodeTestCase, RunningNode, expected_tokens

PROMPT = list(range(100, 112))


def _delay(token_delay_s: float | None) -> dict[str, float]:
    """A mock node's ``token_delay_s`` option when one is given, else its default."""
    return {} if token_delay_s is None else {"token_delay_s": token_delay_s}


class FleetTestCase(NodeTestCase):
    """Starts mock nodes (any model name, window, vocabulary) and fleets over them.

    Over real loopback TCP on purpose: these tests kill, restart and hang whole nodes (their
    listening port closed, their connections cut by the kernel, a node back on the same port)
    and check what the fleet makes of it, through Twisted's real connect and its errors.
    The timing rules that need no socket are pinned on the memory reactor
    (tests/test_fleet_memory.py, tests/test_wait_queue.py, tests/test_failover.py)."""

    def start_mock_node(
        self, *, identity: str = "node", **options: Any
    ) -> defer.Deferred[RunningNode]:
        """A mock node on loopback (:meth:`NodeTestCase.start_node`'s ``options``); with
        ``clock`` its own timers (handshake, idle, lease, status, coalescing) run on that
        ``Clock`` while its sockets and engine use the reactor."""
        return self.start_node(identity=identity, **options)

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
    def restart(
        self, node: RunningNode, port: int, **kwargs: Any
    ) -> Generator[defer.Deferred[Any], Any, RunningNode]:
        """A fresh node process in all but name: new agent, new engine, the old port."""
        return (
            yield self.start_mock_node(identity=node.agent.config.identity, port=port, **kwargs)
        )

    def new_fleet(
        self,
        *,
        retry: Callable[[int], float] = lambda failures: 0.05,
        clock: IReactorTime | None = None,
        **settings: Any,
    ) -> Fleet:
        """A fleet whose links redial every 50 ms (tests restart nodes at once), with
        ``settings`` (a :class:`FleetSettings`'s fields)."""
        fleet = Fleet(reactor, FleetSettings(**settings), ids=self.ids, clock=clock, retry=retry)
        self.addCleanup(fleet.stop)
        return fleet

    @defer.inlineCallbacks
    def fleet_of(
        self, nodes: Sequence[RunningNode], **kwargs: Any
    ) -> Generator[defer.Deferred[Any], Any, Fleet]:
        fleet = self.new_fleet(**kwargs)
        for node in nodes:
            yield fleet.add_node(node.endpoint)
        return fleet

    @defer.inlineCallbacks
    def a_and_b(
        self, a_delay_s: float | None = None, b_delay_s: float | None = None
    ) -> Generator[defer.Deferred[Any], Any, tuple[RunningNode, RunningNode, Fleet]]:
        """Mock nodes "a" and "b" (each with its token delay, when given) and a least-loaded
        fleet of both, in that order (so a fresh session lands on "a")."""
        a = yield self.start_mock_node(identity="a", **_delay(a_delay_s))
        b = yield self.start_mock_node(identity="b", **_delay(b_delay_s))
        fleet = yield self.fleet_of([a, b], policy=Policy.LEAST_LOADED)
        return a, b, fleet

    def on(self, fleet: Fleet, node: RunningNode) -> FleetNode:
        found = fleet.node_named(node.agent.config.identity)
        assert found is not None
        return found


class _Opened:
    """A LinkObserver that fires ``opened`` at the link's next opening and keeps the reasons
    of its drops."""

    def __init__(self) -> None:
        self.opened: defer.Deferred[None] = defer.Deferred()
        self.dropped: list[Any] = []

    def link_opened(self, link: Any, reconnected: bool) -> None:
        if not self.opened.called:
            self.opened.callback(None)

    def link_failed(self, link: Any, reason: Any, retry_in_s: float | None) -> None:
        pass

    def link_dropped(self, link: Any, reason: Any) -> None:
        self.dropped.append(reason)

    def link_reported(self, link: Any) -> None:
        pass

    def link_closed(self, link: Any) -> None:
        pass


class _Reported(_Opened):
    """Fires ``reported`` the first time its link hears a NODE_STATUS after it was added."""

    def __init__(self) -> None:
        super().__init__()
        self.reported: defer.Deferred[None] = defer.Deferred()

    def link_reported(self, link: Any) -> None:
        if not self.reported.called:
            self.reported.callback(None)


def next_status(node: FleetNode) -> defer.Deferred[None]:
    """Fires when ``node``'s link next hears a NODE_STATUS (after the link has taken it)."""
    observer = _Reported()
    node.link.observe(observer)
    return observer.reported


def next_open(node: FleetNode) -> defer.Deferred[None]:
    """Fires the next time ``node``'s link opens."""
    observer = _Opened()
    node.link.observe(observer)
    return observer.opened


class DialInTests(FleetTestCase):
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
        outcome = yield fleet.generate(HeadRequest(PROMPT, 12)).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 12))
        self.assertEqual([n.name for n in fleet.live_nodes()], ["dialer"])
        yield agent.close_connections("leaving")
        yield node.link.when_closed()
        self.assertEqual(fleet.live_nodes(), [])


class LivenessTests(FleetTestCase):
    @defer.inlineCallbacks
    def test_a_dead_node_is_skipped_and_used_again_once_it_answers(
        self,
    ) -> Generator[Any, Any, None]:
        """A node that hung up is down and skipped (all placements go to the live one); its
        link keeps redialling, and once it listens again it receives placements again."""
        a, _, fleet = yield self.a_and_b()
        port = a.port_number
        yield self.kill(a)
        yield self.on(fleet, a).link.when_closed()  # the head saw the connection go
        for _ in range(4):
            session = yield fleet.open_session(PROMPT)
            self.assertEqual(session.node.name, "b")
        self.assertTrue(self.on(fleet, a).down)
        self.assertEqual([n.name for n in fleet.live_nodes()], ["b"])
        back = next_open(self.on(fleet, a))
        a = yield self.restart(a, port)
        yield back
        self.assertFalse(self.on(fleet, a).down)
        placed = []
        for _ in range(2):
            session = yield fleet.open_session(PROMPT)
            placed.append(session.node.name)
        self.assertEqual(placed, ["a", "a"])
        outcome = yield session.generate(6).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 6))

    @defer.inlineCallbacks
    def test_an_unreachable_node_is_down_with_the_real_reason(
        self,
    ) -> Generator[Any, Any, None]:
        """A node whose address refuses connections is tried, reported down with "connection
        refused" (not an object repr, not a token guess), and never takes a placement."""
        dead = yield self.start_mock_node(identity="dead")
        live = yield self.start_mock_node(identity="live")
        dead_endpoint = dead.endpoint
        yield dead.port.stopListening()
        fleet = self.new_fleet(retry=lambda failures: 30.0)
        cold = yield fleet.add_node(dead_endpoint)
        yield fleet.add_node(live.endpoint)
        for _ in range(3):
            session = yield fleet.open_session(PROMPT)
            self.assertEqual(session.node.name, "live")
        self.assertTrue(cold.down)
        self.assertEqual(cold.name, dead_endpoint)
        self.assertEqual(str(cold.link.last_reason), "could not connect: connection refused")

    @defer.inlineCallbacks
    def test_failover_when_the_owning_node_died_while_idle(self) -> Generator[Any, Any, None]:
        """A session's node dies between turns: the next generate moves the session to the
        survivor and returns the local tokens."""
        a, _, fleet = yield self.a_and_b()
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
        a, b, fleet = yield self.a_and_b(a_delay_s=0.005, b_delay_s=0.001)
        streamed: list[int] = []
        killed: list[bool] = []

        def seen(tokens: Sequence[int]) -> None:
            streamed.extend(tokens)
            if len(streamed) >= 7 and not killed:
                killed.append(True)
                reactor.callLater(0, self.kill, a)

        outcome = yield fleet.generate(HeadRequest(PROMPT, 40), on_tokens=seen).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 40))
        self.assertEqual(streamed, outcome.tokens)
        self.assertEqual(outcome.finish, FINISH_LENGTH)
        self.assertEqual((outcome.node, outcome.failovers, fleet.failovers), ("b", 1, 1))
        self.assertTrue(self.on(fleet, a).down)
        self.assertNotEqual(b.agent.engine.statistics().decoded_tokens, 0)

    @defer.inlineCallbacks
    def test_a_link_that_lost_a_failed_over_session_gets_prompt_and_delivered(
        self,
    ) -> Generator[Any, Any, None]:
        """A session's generation fails over from a (dead after 7 tokens) to b, and b's link
        no longer holds the session when the generation is sent there (here: revoked right
        after the placement, standing in for any way a link loses it): the session is
        assigned there again with prompt + the delivered tokens (not the session's own
        context, the prompt alone), so the answer still equals the uninterrupted run."""
        a, _, fleet = yield self.a_and_b(a_delay_s=0.005, b_delay_s=0.001)
        session = yield fleet.open_session(PROMPT)
        self.assertEqual(session.node.name, "a")
        assign = fleet._assign
        lost: list[int] = []

        def assign_then_lose(placing: Any, node: FleetNode) -> None:
            assign(placing, node)
            if node.name == "b" and not lost:
                lost.append(len(placing.context))
                node.link.revoke(placing.session.session_id)

        fleet._assign = assign_then_lose  # type: ignore[method-assign]
        streamed: list[int] = []

        def seen(batch: TokenBatch) -> None:
            streamed.extend(batch.tokens)
            if len(streamed) >= 7 and len(streamed) - len(batch) < 7:
                reactor.callLater(0, self.kill, a)

        outcome = yield session.generate(40, on_tokens=seen).result
        self.assertEqual(len(lost), 1)
        self.assertGreater(lost[0], len(PROMPT))
        self.assertEqual((outcome.node, outcome.failovers), ("b", 1))
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 40))
        self.assertEqual(streamed, outcome.tokens)

    @defer.inlineCallbacks
    def test_non_streaming_generation_fails_over_when_the_owning_node_dies(
        self,
    ) -> Generator[Any, Any, None]:
        """A non-streaming generation whose node dies mid-way (after its engine made 7
        tokens) returns exactly the tokens of an uninterrupted run, from the survivor."""
        a, _, fleet = yield self.a_and_b(a_delay_s=0.005)
        submit = a.engine.submit
        killed: list[bool] = []

        def submit_and_watch(request: Any, on_tokens: Any) -> Any:
            made: list[int] = []

            def watched(batch: TokenBatch) -> None:
                on_tokens(batch)
                made.extend(batch.tokens)
                if len(made) >= 7 and not killed:
                    killed.append(True)
                    reactor.callLater(0, self.kill, a)

            return submit(request, watched)

        a.engine.submit = submit_and_watch  # type: ignore[method-assign]
        outcome = yield fleet.generate(HeadRequest(PROMPT, 30)).result
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
        full = yield fleet.generate(HeadRequest(PROMPT, 20)).result
        prefix = yield fleet.generate(HeadRequest(PROMPT, 6)).result
        rest = yield fleet.generate(HeadRequest([*PROMPT, *prefix.tokens], 14)).result
        self.assertEqual(prefix.tokens + rest.tokens, full.tokens)


class _Relay(Protocol):
    """One side of a proxied connection; holds what it would forward while frozen."""

    def __init__(self, proxy: FreezingProxy) -> None:
        self.proxy = proxy
        self.peer: _Relay | None = None
        self.held: list[bytes] = []

    def dataReceived(self, data: bytes) -> None:
        if self.proxy.frozen or self.peer is None:
            self.held.append(data)
        else:
            self.peer.transport.write(data)  # type: ignore[union-attr]

    def release(self) -> None:
        held, self.held = self.held, []
        if self.peer is not None and self.peer.transport is not None:
            for data in held:
                self.peer.transport.write(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self in self.proxy.relays:
            self.proxy.relays.remove(self)
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.loseConnection()


class FreezingProxy(Factory):
    """A TCP relay to a node that can stop forwarding in both directions while keeping every
    connection open, like a process under SIGSTOP (the kernel still accepts and buffers)."""

    noisy = False

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = False
        self.relays: list[_Relay] = []

    def buildProtocol(self, addr: Any) -> _Relay:
        front = _Relay(self)
        back = _Relay(self)
        front.peer, back.peer = back, front
        self.relays += [front, back]
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.target_port)
        connected = endpoint.connect(Factory.forProtocol(lambda: back))

        def failed(failure: Failure) -> None:
            if front.transport is not None:
                front.transport.loseConnection()

        connected.addCallbacks(lambda _: front.release(), failed)
        return front

    def freeze(self) -> None:
        self.frozen = True

    def thaw(self) -> None:
        self.frozen = False
        for relay in list(self.relays):
            relay.release()

    def close_all(self) -> None:
        for relay in list(self.relays):
            if relay.transport is not None:
                relay.transport.abortConnection()  # type: ignore[attr-defined]


class HungNodeTests(FleetTestCase):
    @defer.inlineCallbacks
    def test_a_hung_node_fails_over_within_the_keepalive_window_and_rejoins(
        self,
    ) -> Generator[Any, Any, None]:
        """A node that stops answering mid-stream (frozen behind a proxy, the connection still
        open) is given up after the keepalive window: the stream continues on the other node
        with exactly the tokens of an uninterrupted run.  Once it answers again it rejoins
        and serves correctly, and nothing it still had running reached the client twice.

        The head's timers run on a ``Clock``: the frozen node is given up exactly when the
        test moves the clock 0.5 s past its last token, and the other node, heard since (a
        NODE_STATUS every 50 ms), is not, however long the machine takes between the two."""
        clock = Clock()
        frozen = yield self.start_mock_node(identity="frozen", token_delay_s=0.01)
        other = yield self.start_mock_node(identity="other", status_interval_ms=50)
        proxy = FreezingProxy(frozen.port_number)
        listening = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(proxy)
        self.addCleanup(listening.stopListening)
        self.addCleanup(proxy.close_all)
        fleet = self.new_fleet(
            policy=Policy.ROUND_ROBIN, silence_timeout_s=0.5, handshake_timeout_s=0.5, clock=clock
        )
        hung = yield fleet.add_node(f"tcp:127.0.0.1:{listening.getHost().port}")
        alive = yield fleet.add_node(other.endpoint)
        drops = _Opened()
        hung.link.observe(drops)
        streamed: list[int] = []
        froze: defer.Deferred[None] = defer.Deferred()

        def seen(tokens: Sequence[int]) -> None:
            streamed.extend(tokens)
            if len(streamed) >= 5 and not proxy.frozen:
                proxy.freeze()
                froze.callback(None)

        generation = fleet.generate(HeadRequest(PROMPT, 40), on_tokens=seen)
        yield froze
        clock.advance(0.3)
        yield next_status(alive)
        clock.advance(0.2)
        outcome = yield generation.result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 40))
        self.assertEqual(streamed, outcome.tokens)
        self.assertEqual((outcome.node, outcome.failovers), ("other", 1))
        self.assertTrue(hung.down)
        self.assertFalse(alive.down)
        (reason,) = drops.dropped
        self.assertIn("frozen sent nothing for", str(reason))
        back = next_open(hung)
        proxy.thaw()
        clock.advance(0.05)  # the redial delay of new_fleet's retry policy
        yield back
        session = yield fleet.open_session(PROMPT)
        if session.node is not hung:
            session.close()
            session = yield fleet.open_session(PROMPT)
        self.assertIs(session.node, hung)
        again = yield session.generate(8).result
        self.assertEqual(again.tokens, expected_tokens(PROMPT, 8))


class QueueTests(FleetTestCase):
    @defer.inlineCallbacks
    def test_a_request_waits_for_a_node_that_dials_in(self) -> Generator[Any, Any, None]:
        """With no node at all a request waits in the queue (visible as queued); a node that
        dials in takes it and the answer is the local run."""
        fleet = self.new_fleet()
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            fleet.listen_factory()
        )
        self.addCleanup(port.stopListening)
        generation = fleet.generate(HeadRequest(PROMPT, 12))
        self.assertEqual(fleet.queued, 1)
        self.assertNoResult(generation.result)
        engine = MockEngine(reactor)
        agent = NodeAgent(reactor, engine, NodeConfig(identity="late", model_name="mock"))
        agent.start()
        self.addCleanup(agent.stop)
        dial = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        yield dial.connect(node_factory(agent))
        outcome = yield generation.result
        self.assertEqual((outcome.tokens, outcome.node), (expected_tokens(PROMPT, 12), "late"))
        self.assertEqual(fleet.queued, 0)

    def test_a_full_queue_refuses_at_once_and_a_wait_times_out(self) -> None:
        """max_queued requests may wait; one more fails with QueueFull at once.  A wait longer
        than queue_timeout_s fails with NoNodeAvailable saying why it waited."""
        clock = Clock()
        fleet = Fleet(
            reactor,
            FleetSettings(max_queued=1, queue_timeout_s=5.0),
            ids=self.ids,
            clock=clock,
        )
        first = fleet.generate(HeadRequest(PROMPT, 4))
        second = fleet.generate(HeadRequest(PROMPT, 4))
        self.assertEqual(fleet.queued, 1)
        self.failureResultOf(second.result, QueueFull)
        self.failureResultOf(second.when_placed(), QueueFull)
        self.assertEqual(fleet.queue.rejected, 1)
        clock.advance(4.9)
        self.assertNoResult(first.result)
        clock.advance(0.1)
        error = self.failureResultOf(first.result, NoNodeAvailable).value
        self.assertIn("no node could take the request within 5 s (no live node", str(error))
        self.assertEqual((fleet.queued, fleet.queue.timeouts), (0, 1))

    def test_the_status_counts_the_queue(self) -> None:
        """Fleet.status() (what /healthz and /metrics read) counts the requests waiting in the
        head's queue in ``queued`` and ``waiting``, and the queue's refusals and timeouts."""
        clock = Clock()
        fleet = Fleet(
            reactor,
            FleetSettings(max_queued=2, queue_timeout_s=5.0),
            ids=self.ids,
            clock=clock,
        )
        waiting = [fleet.generate(HeadRequest(PROMPT, 4)) for _ in range(2)]
        refused = fleet.generate(HeadRequest(PROMPT, 4))
        self.failureResultOf(refused.result, QueueFull)
        status = fleet.status("mock")
        self.assertEqual(
            (status.live_nodes, status.queued, status.waiting, status.queue_rejected),
            (0, 2, 2, 1),
        )
        self.assertTrue(status.busy)
        clock.advance(5.0)
        for generation in waiting:
            self.failureResultOf(generation.result, NoNodeAvailable)
        status = fleet.status("mock")
        self.assertEqual(
            (status.queued, status.waiting, status.queue_rejected, status.queue_timeouts),
            (0, 0, 1, 2),
        )

    def test_a_cancelled_request_leaves_the_queue(self) -> None:
        """Cancelling a waiting generation (its client went away) takes it out of the queue;
        it ends CANCELLED with no tokens and no timer left behind."""
        clock = Clock()
        fleet = Fleet(reactor, ids=self.ids, clock=clock)
        generation = fleet.generate(HeadRequest(PROMPT, 4))
        self.assertEqual(fleet.queued, 1)
        generation.cancel()
        outcome = self.successResultOf(generation.result)
        self.assertEqual((outcome.tokens, outcome.finish), ([], FINISH_CANCELLED))
        self.assertEqual(fleet.queued, 0)
        self.assertEqual(clock.getDelayedCalls(), [])

    @defer.inlineCallbacks
    def test_a_stream_whose_only_node_died_waits_for_it_and_continues_exactly(
        self,
    ) -> Generator[Any, Any, None]:
        """The only node is killed mid-stream and restarted on its port: the stream waits for
        it (no error), then continues with exactly the tokens of an uninterrupted run."""
        node = yield self.start_mock_node(identity="only", token_delay_s=0.005)
        fleet = yield self.fleet_of([node])
        port = node.port_number
        streamed: list[int] = []
        restarted: list[defer.Deferred[Any]] = []

        def seen(tokens: Sequence[int]) -> None:
            streamed.extend(tokens)
            if len(streamed) >= 6 and not restarted:
                restarted.append(self.kill(node).addCallback(lambda _: self.restart(node, port)))

        outcome = yield fleet.generate(HeadRequest(PROMPT, 30), on_tokens=seen).result
        yield restarted[0]
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 30))
        self.assertEqual(streamed, outcome.tokens)
        self.assertEqual((outcome.node, outcome.failovers), ("only", 1))


