"""The fleet: a registry of nodes, placement of sessions on them, and failover (LINKF 7.2-7.4).

:class:`Fleet` owns one :class:`~sfnode.head.link.NodeLink` per node (decision D2 lets one
connection carry every generation of a node, so the per-lane connection pools of upstream are
not needed).  Nodes come from two directions: the head dials the ones it is told about
(:meth:`Fleet.add_node`), and accepts the ones that dial in (:meth:`Fleet.listen_factory`).
Their HELLO_ACK_F and NODE_STATUS feed the registry: identity, models, context window and load.

On top of that:

- placement by one of three policies (LINKF 7.4): ``least-loaded``, ``round-robin`` and
  ``load-aware`` (the default, an ETA from the node's reported lanes, queue and token rates);
- a prompt that no node serving the model can hold is refused at the head with
  :class:`StreamTooLong` (``length``, ``max``), also after a cold fleet learned the windows;
- keepalives every 15 s; a node that cannot be reached is marked down, skipped, and retried every
  10 s; a dialed link that drops is reconnected and reconciled (at once when generations are in
  flight, else on next use);
- failover: a generation whose node dies moves to another node with the delivered tokens
  appended to its context and ``max_new - delivered`` left to generate, so the caller sees
  exactly the tokens of an uninterrupted run, none twice (the counter-based sampler makes this
  hold for sampled generations too);
- sessions are revoked when they end; a session whose context outgrows its node moves to one
  that fits.

This module must never block, never read the global reactor (the reactor and the clock are
parameters), never import torch or the node side, and never deliver a token to a caller twice.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.generation import StreamTooLong
from sfnode.head.backend import BackendStatus, NodeReport
from sfnode.head.link import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_LEASE,
    DEFAULT_PARAMS,
    HandshakeError,
    HeadIds,
    HeadLinkFactory,
    LinkError,
    LinkLostError,
    MalformedFrameError,
    NodeLink,
    ReconcileError,
)
from sfnode.wire import (
    FINISH_CANCELLED,
    FINISH_DECLINED,
    FINISH_LENGTH,
    FINISH_REFUSED,
    GenParams,
    Lease,
)

KEEPALIVE_INTERVAL_S = 15.0
RETRY_INTERVAL_S = 10.0
FRESH_SAMPLE_S = 10.0
"""A NODE_STATUS older than this does not count as the node's load (LINKF 7.4)."""
POOL_HIGH_PERCENT = 90
DEFAULT_DECODE_RATE = 20
DEFAULT_PREFILL_RATE = 200
DEFAULT_EXPECTED_OUT = 64

_log = Logger(namespace="sfnode.head.fleet")


class Policy(enum.Enum):
    """How a session's node is chosen among the eligible ones (LINKF 7.4)."""

    LOAD_AWARE = "load-aware"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


# --------------------------------------------------------------------------------------------
# Errors


class FleetError(Exception):
    """A request the fleet cannot serve."""


class NoNodeAvailable(FleetError):
    """No live node serves the model (all down, none joined, or none with that model)."""


class NodeDown(FleetError):
    """A node could not be reached; it is skipped until a retry reaches it."""


class NodeDeclined(FleetError):
    """The node answered FINISH_DECLINED (stale epoch or replayed command)."""


class SessionClosed(FleetError):
    """The session was closed; it cannot append or generate any more."""


def _node_down_is_known(failure: Failure) -> Failure | None:
    """An errback for attempts whose NodeDown was already logged when the node was marked."""
    return None if isinstance(failure.value, NodeDown) else failure


_NODE_FATAL = (LinkLostError, MalformedFrameError, ReconcileError, HandshakeError, NodeDown)
"""Errors that say the node (or the path to it) failed, not the request: these fail over."""


# --------------------------------------------------------------------------------------------
# Links and nodes


class FleetNode:
    """One node of the registry: its link, its state (up or down) and its placement load."""

    def __init__(self, link: NodeLink, description: str, order: int) -> None:
        self.link = link
        self.description = description
        """The endpoint dialed, or the peer's identity for a node that dialed in."""
        self.order = order
        self.down = False
        self.down_reason = ""
        self.sessions = 0
        """Sessions placed here and not ended."""
        self.inflight = 0
        """Generations running here."""
        self.ever_connected = False
        self._connecting: Deferred[None] | None = None
        self._waiters: list[Deferred[NodeLink]] = []
        self._sample: object = None
        self._sample_at: float | None = None

    def sample_age(self, now: float) -> float | None:
        """Seconds since the node's load report last changed (None: never reported).

        NodeLink keeps only the latest capacity; a new report is a new object, so watching
        its identity (at every placement and keepalive tick) dates the reports closely enough
        for the 10 s freshness rule.
        """
        capacity = self.link.capacity
        if capacity is None:
            return None
        if capacity is not self._sample:
            self._sample, self._sample_at = capacity, now
        assert self._sample_at is not None
        return now - self._sample_at

    @property
    def name(self) -> str:
        return self.link.hello_ack.node_identity if self.link.hello_ack else self.description

    @property
    def dialed(self) -> bool:
        return self.link.dialable

    @property
    def models(self) -> tuple[str, ...]:
        return self.link.models

    @property
    def window(self) -> int | None:
        """The node's context window: None while unknown, 0 when unlimited."""
        capacity = self.link.capacity
        return None if capacity is None else capacity.max_context_tokens

    def serves(self, model: str | None) -> bool:
        """Whether the node serves ``model`` (or has not said yet)."""
        return model is None or not self.models or model in self.models

    def fits(self, length: int) -> bool:
        """Whether a context of ``length`` tokens fits (an unknown window is tried)."""
        window = self.window
        return window is None or window == 0 or length <= window

    def __repr__(self) -> str:
        return f"<FleetNode {self.name}{' down' if self.down else ''}>"


# --------------------------------------------------------------------------------------------
# Sessions and generations


@dataclass(frozen=True, slots=True)
class FleetOutcome:
    """How a fleet generation ended: every token delivered, in order, and the finish reason."""

    tokens: list[int]
    finish: int
    node: str
    """The node that finished it."""
    failovers: int


class FleetSession:
    """A session placed on one node of the fleet; it moves when its node dies or is too small."""

    def __init__(
        self,
        fleet: Fleet,
        session_id: int,
        model: str | None,
        params: GenParams,
        lease: Lease,
        context: Sequence[int],
    ) -> None:
        self.fleet = fleet
        self.session_id = session_id
        self.model = model
        self.params = params
        self.lease = lease
        self.context: tuple[int, ...] = tuple(context)
        """The complete context last appended."""
        self.node: FleetNode | None = None
        self.closed = False

    @defer.inlineCallbacks
    def append(self, context: Sequence[int]) -> Generator[Deferred[Any], Any, None]:
        """Replace the session's context (the COMPLETE context, LINKF 3.4).

        A context that no longer fits the node's window moves the session to a node that fits
        (or fails with :class:`StreamTooLong`).
        """
        if self.closed:
            raise SessionClosed(f"session {self.session_id} is closed")
        context = tuple(context)
        node = self.node
        if node is not None and node.fits(len(context)):
            try:
                link = yield self.fleet._bound_link(self)
            except _NODE_FATAL as e:
                _log.info(
                    "session {session} lost its node {node}: {error}; placing it again",
                    session=self.session_id,
                    node=node.name,
                    error=str(e),
                )
            else:
                if node.fits(len(context)):
                    link.append(self.session_id, context)
                    self.context = context
                    return
        if node is not None:
            _log.info(
                "session {session} moves off {node} ({length} tokens)",
                session=self.session_id,
                node=node.name,
                length=len(context),
            )
            self.fleet._detach(self)
        self.context = context
        yield self.fleet._place(self, context, set(), DEFAULT_EXPECTED_OUT)

    def generate(
        self,
        max_new: int,
        *,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
        max_wall_ms: int = 0,
    ) -> FleetGeneration:
        """Generate up to ``max_new`` tokens after the session's context; fails over on its own."""
        generation = FleetGeneration(self, max_new, on_tokens, max_wall_ms, one_shot=False)
        generation._start()
        return generation

    def close(self) -> None:
        """End the session: SESSION_REVOKE on its node, which then forgets it."""
        if self.closed:
            return
        self.closed = True
        if self.node is not None:
            self.fleet._detach(self)


class FleetGeneration:
    """One generation as the fleet runs it, across failovers; ``result`` fires with a
    :class:`FleetOutcome` or fails with a :class:`FleetError` or :class:`LinkError`."""

    def __init__(
        self,
        session: FleetSession,
        max_new: int,
        on_tokens: Callable[[Sequence[int]], None] | None,
        max_wall_ms: int,
        *,
        one_shot: bool,
        expected_out: int = DEFAULT_EXPECTED_OUT,
    ) -> None:
        self.session = session
        self.max_new = max_new
        self.max_wall_ms = max_wall_ms
        self.tokens: list[int] = []
        """Every token delivered to the caller, in order, each once."""
        self.failovers = 0
        self.result: Deferred[FleetOutcome] = Deferred()
        self._on_tokens = on_tokens
        self._one_shot = one_shot
        self._expected_out = expected_out
        self._cancelled = False
        self._call: Any = None
        self._placed = False
        self._placement_failure: Failure | None = None
        self._placement_waiters: list[Deferred[None]] = []

    def when_placed(self) -> Deferred[None]:
        """Fires once the first GENERATE_REQ is sent, or fails as the generation does if
        placement fails (for example with :class:`StreamTooLong`)."""
        d: Deferred[None] = Deferred()
        if self._placed:
            d.callback(None)
        elif self._placement_failure is not None:
            d.errback(self._placement_failure)
        else:
            self._placement_waiters.append(d)
        return d

    def cancel(self) -> None:
        """Stop the generation (GENERATE_CANCEL to its node); ``result`` still fires, CANCELLED."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def _start(self) -> None:
        d = self._run()
        d.addCallbacks(self._succeeded, self._failed)

    def _succeeded(self, outcome: FleetOutcome) -> None:
        self._placement_done(None)
        self.result.callback(outcome)

    def _failed(self, failure: Failure) -> None:
        self._placement_done(failure)
        self.result.errback(failure)

    def _placement_done(self, failure: Failure | None) -> None:
        waiters, self._placement_waiters = self._placement_waiters, []
        if failure is None:
            self._placed = True
        elif not self._placed:
            self._placement_failure = failure
        for d in waiters:
            if failure is None:
                d.callback(None)
            else:
                d.errback(failure)

    def _deliver(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        if self._on_tokens is not None:
            self._on_tokens(tokens)

    @defer.inlineCallbacks
    def _run(self) -> Generator[Deferred[Any], Any, FleetOutcome]:
        session = self.session
        fleet = session.fleet
        base = session.context
        tried: set[FleetNode] = set()
        try:
            if session.closed:
                raise SessionClosed(f"session {session.session_id} is closed")
            if session.node is None:
                yield fleet._place(session, base, tried, self._expected_out)
            while True:
                node = session.node
                assert node is not None
                if self._cancelled:
                    return FleetOutcome(
                        list(self.tokens), FINISH_CANCELLED, node.name, self.failovers
                    )
                remaining = self.max_new - len(self.tokens)
                if remaining <= 0:
                    return FleetOutcome(list(self.tokens), FINISH_LENGTH, node.name, self.failovers)
                try:
                    link = yield fleet._bound_link(session)
                    call = link.generate(
                        session.session_id,
                        remaining,
                        max_wall_ms=self.max_wall_ms,
                        on_tokens=self._deliver,
                    )
                    self._call = call
                    self._placement_done(None)
                    node.inflight += 1
                    try:
                        outcome = yield call.result
                    finally:
                        node.inflight -= 1
                        self._call = None
                except _NODE_FATAL as e:
                    tried.add(node)
                    fleet._node_failed(node, e)
                    if self._cancelled:
                        return FleetOutcome(
                            list(self.tokens), FINISH_CANCELLED, node.name, self.failovers
                        )
                    if self.max_new - len(self.tokens) <= 0:
                        return FleetOutcome(
                            list(self.tokens), FINISH_LENGTH, node.name, self.failovers
                        )
                    context = (*base, *self.tokens)
                    _log.info(
                        "generation of session {session} fails over from {node} after "
                        "{delivered} tokens: {error}",
                        session=session.session_id,
                        node=node.name,
                        delivered=len(self.tokens),
                        error=str(e),
                    )
                    fleet._detach(session)
                    fleet.failovers += 1
                    self.failovers += 1
                    yield fleet._place(session, context, tried, self._expected_out)
                    continue
                if outcome.finish == FINISH_DECLINED:
                    raise NodeDeclined(
                        f"{node.name} declined the generation (stale epoch or replayed command)"
                    )
                if outcome.finish == FINISH_REFUSED:
                    raise StreamTooLong(len(base) + len(self.tokens), node.window or 0)
                if self.failovers and not self._one_shot:
                    # The node holds prompt + the tokens delivered before the failover; put
                    # the session's own context back for its next turn.
                    link.append(session.session_id, base)
                return FleetOutcome(list(self.tokens), outcome.finish, node.name, self.failovers)
        finally:
            if self._one_shot:
                session.close()


# --------------------------------------------------------------------------------------------
# The fleet


class Fleet:
    """The head's registry of nodes and the placement of sessions on them (LINKF 7.4)."""

    def __init__(
        self,
        reactor: Any,
        *,
        ids: HeadIds | None = None,
        token: bytes = b"",
        policy: Policy | str = Policy.LOAD_AWARE,
        lease: Lease = DEFAULT_LEASE,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        clock: IReactorTime | None = None,
        keepalive_interval_s: float = KEEPALIVE_INTERVAL_S,
        retry_interval_s: float = RETRY_INTERVAL_S,
    ) -> None:
        self._reactor = reactor
        self._clock: IReactorTime = clock if clock is not None else reactor
        self.ids = ids if ids is not None else HeadIds()
        self.token = token
        self.policy = Policy(policy)
        self.lease = lease
        self.handshake_timeout_s = handshake_timeout_s
        self.nodes: list[FleetNode] = []
        self.failovers = 0
        self.reconnects = 0
        self._orders = itertools.count()
        self._session_ids = itertools.count(1)
        self._cursor = 0
        self._stopping = False
        self._join_waiters: list[Deferred[FleetNode]] = []
        self._keepalive = LoopingCall(self.tend)
        self._keepalive.clock = self._clock
        self._keepalive_interval_s = keepalive_interval_s
        self._retry = LoopingCall(self.retry_down_nodes)
        self._retry.clock = self._clock
        self._retry_interval_s = retry_interval_s

    # ----------------------------------------------------------------------------------------
    # Life cycle and registry

    def start(self) -> None:
        """Start the keepalive (every 15 s) and down-node retry (every 10 s) loops."""
        self._stopping = False
        self._keepalive.start(self._keepalive_interval_s, now=False).addErrback(
            self._loop_failed, "keepalive"
        )
        self._retry.start(self._retry_interval_s, now=False).addErrback(self._loop_failed, "retry")

    def _loop_failed(self, failure: Failure, name: str) -> None:
        _log.failure("the fleet's {name} loop failed", failure, name=name)

    def stop(self) -> Deferred[None]:
        """Stop the loops and close every link."""
        self._stopping = True
        for loop in (self._keepalive, self._retry):
            if loop.running:
                loop.stop()
        closing = [node.link.close() for node in self.nodes]
        return defer.gatherResults(closing).addCallback(lambda _: None)

    def add_node(
        self, endpoint: str | IStreamClientEndpoint, *, connect: bool = True
    ) -> Deferred[FleetNode]:
        """Register a node the head dials; fires with it after the first connection attempt
        (a node that cannot be reached is kept, marked down, and retried every 10 s).

        ``connect=False`` registers it cold: it is dialed on first use.
        """
        if isinstance(endpoint, str):
            description = endpoint
            dialer = cast(
                IStreamClientEndpoint,
                clientFromString(self._reactor, endpoint),  # type: ignore[no-untyped-call]
            )
        else:
            description = repr(endpoint)
            dialer = endpoint
        link = NodeLink(
            self._reactor,
            self.ids,
            token=self.token,
            endpoint=dialer,
            handshake_timeout_s=self.handshake_timeout_s,
            keep_wal=False,
        )
        node = FleetNode(link, description, next(self._orders))
        self.nodes.append(node)
        if not connect:
            return defer.succeed(node)
        d = self._ensure(node)
        d.addErrback(_node_down_is_known)
        return d.addCallback(lambda _: node)

    def listen_factory(self, *, loopback_only: bool = False) -> HeadLinkFactory:
        """The protocol factory for a port that nodes dial (``--fleet-listen``).

        ``loopback_only`` (what ``twistd sfhead`` asks for without a fleet token, unless
        --insecure-no-auth) closes connections from anywhere but loopback at once.
        """
        return HeadLinkFactory(
            self._adopt,
            reactor=self._reactor,
            ids=self.ids,
            token=self.token,
            handshake_timeout_s=self.handshake_timeout_s,
            keep_wal=False,
            loopback_only=loopback_only,
        )

    def live_nodes(self) -> list[FleetNode]:
        """Nodes that are up (reached at least once and not marked down)."""
        return [n for n in self.nodes if n.ever_connected and not n.down]

    def node_named(self, name: str) -> FleetNode | None:
        for node in self.nodes:
            if node.name == name:
                return node
        return None

    def _adopt(self, link: NodeLink) -> None:
        """A node dialed in and passed the handshake: it joins (or rejoins) by identity."""
        identity = link.node_identity
        if self._stopping:
            link.close()
            return
        node = FleetNode(link, identity, next(self._orders))
        node.ever_connected = True
        self.nodes.append(node)
        _log.info(
            "node {node} joined (dialed in; models {models}, window {window})",
            node=identity,
            models=", ".join(link.models) or "-",
            window=node.window,
        )
        self._watch(node)
        waiters, self._join_waiters = self._join_waiters, []
        for d in waiters:
            d.callback(node)

    def next_join(self) -> Deferred[FleetNode]:
        """Fires with the next node that dials in and passes the handshake."""
        d: Deferred[FleetNode] = Deferred()
        self._join_waiters.append(d)
        return d

    def _watch(self, node: FleetNode) -> None:
        link = node.link
        link.when_closed().addCallback(self._dropped, node, link)

    def _dropped(self, reason: Exception, node: FleetNode, link: NodeLink) -> None:
        if self._stopping or node.link is not link:
            return
        if not link.dialable:
            if node in self.nodes:
                self.nodes.remove(node)
            _log.info("node {node} left: {reason}", node=node.name, reason=str(reason))
            return
        if link.pending_generations():
            # Reconnect right here so the generations in flight wait for the reconcile
            # (NodeLink keeps them suspended) instead of failing at once.
            _log.info(
                "the link to {node} dropped during generations ({reason}); reconnecting",
                node=node.name,
                reason=str(reason),
            )
            self._start_connect(node)
        else:
            _log.info(
                "the link to {node} dropped ({reason}); reconnecting on next use",
                node=node.name,
                reason=str(reason),
            )

    # ----------------------------------------------------------------------------------------
    # Connections, up and down

    def _ensure(self, node: FleetNode) -> Deferred[NodeLink]:
        """The node's link, open and reconciled; fails with :class:`NodeDown`."""
        if node.link.connected and node._connecting is None:
            return defer.succeed(node.link)
        if self._stopping:
            return defer.fail(NodeDown("the fleet is stopping"))
        if not node.dialed:
            return defer.fail(NodeDown(f"{node.name} left the fleet"))
        d: Deferred[NodeLink] = Deferred()
        node._waiters.append(d)
        self._start_connect(node)
        return d

    def _start_connect(self, node: FleetNode) -> None:
        if node._connecting is not None or self._stopping:
            return
        link = node.link
        reconnecting = node.ever_connected
        attempt = link.reconnect() if reconnecting else link.dial()
        node._connecting = attempt

        def connected(_: None) -> None:
            node._connecting = None
            if reconnecting:
                self.reconnects += 1
            node.ever_connected = True
            self._watch(node)
            if node.down:
                node.down = False
                _log.info("node {node} is up again", node=node.name)
            elif not reconnecting:
                _log.info(
                    "node {node} joined (dialed {endpoint}; models {models}, window {window})",
                    node=node.name,
                    endpoint=node.description,
                    models=", ".join(link.models) or "-",
                    window=node.window,
                )
            waiters, node._waiters = node._waiters, []
            for d in waiters:
                d.callback(link)

        def failed(failure: Failure) -> None:
            node._connecting = None
            error = NodeDown(f"{node.name} is down: {failure.getErrorMessage()}")
            self._mark_down(node, failure.getErrorMessage())
            waiters, node._waiters = node._waiters, []
            for d in waiters:
                d.errback(error)

        attempt.addCallbacks(connected, failed)

    def _mark_down(self, node: FleetNode, reason: str) -> None:
        node.down_reason = reason
        if not node.down:
            node.down = True
            _log.warn("node {node} marked down: {reason}", node=node.name, reason=reason)

    def _node_failed(self, node: FleetNode, error: Exception) -> None:
        """A generation on ``node`` failed for a node-side reason: mark it down unless its
        link is up again (a reconnect may have settled the failure)."""
        if not node.link.connected:
            self._mark_down(node, str(error))

    def tend(self) -> None:
        """KEEPALIVE on every open link; redial dialed links that dropped while idle."""
        for node in list(self.nodes):
            if node.down:
                continue
            node.sample_age(self._clock.seconds())
            if node.link.connected:
                node.link.keepalive()
            elif node.dialed:
                self._start_connect(node)

    def retry_down_nodes(self) -> Deferred[None]:
        """Try every down node once; fires when every attempt ended (LINKF 7.4's 10 s retry)."""
        attempts = []
        for node in self.nodes:
            if node.down and node.dialed:
                d = self._ensure(node)
                d.addErrback(_node_down_is_known)
                attempts.append(d)
        return defer.gatherResults(attempts).addCallback(lambda _: None)

    # ----------------------------------------------------------------------------------------
    # Placement

    def check_fits(self, model: str | None, length: int) -> None:
        """Raise :class:`StreamTooLong` when the known windows already say nothing fits."""
        error = self._too_long(model, length)
        if error is not None:
            raise error

    def _too_long(self, model: str | None, length: int) -> StreamTooLong | None:
        windows = [n.window for n in self.nodes if n.serves(model)]
        if not windows or any(w is None or w == 0 for w in windows):
            return None
        largest = max(cast(list[int], windows))
        return StreamTooLong(length, largest) if length > largest else None

    def max_window(self, model: str | None) -> int:
        """The largest known window among nodes serving ``model`` (0: unknown or unlimited)."""
        windows = [n.window or 0 for n in self.nodes if n.serves(model)]
        return max(windows, default=0)

    def status(self, model: str | None = None) -> BackendStatus:
        """How the fleet stands for ``model``: what the HTTP layer asks of its backend
        (``sfnode.head.backend.Backend``) instead of reading the registry itself.

        Lanes and waiting generations come from the nodes' reports (docs/protocol.md section
        7.5), raised to what this head knows it runs there right now, so a fresh burst shows
        at once rather than at the next NODE_STATUS.
        """
        now = self._clock.seconds()
        live = self.live_nodes()
        lanes_active = lanes_total = queued = 0
        for node in live:
            node.sample_age(now)
            capacity = node.link.capacity
            if capacity is None or not capacity.max_lanes:
                lanes_active += node.inflight
                continue
            lanes_total += capacity.max_lanes
            lanes_active += min(max(capacity.lanes_active, node.inflight), capacity.max_lanes)
            queued += max(capacity.queue_depth, node.inflight - capacity.max_lanes)
        too_long = self._too_long(model, 1 << 62)
        return BackendStatus(
            live_nodes=len(live),
            joining_nodes=sum(
                1 for n in self.nodes if n.dialed and not n.ever_connected and not n.down
            ),
            window=self.max_window(model),
            context_limit=too_long.max if too_long is not None else None,
            lanes_active=lanes_active,
            lanes_total=lanes_total,
            queued=queued,
            failovers=self.failovers,
            reconnects=self.reconnects,
            nodes=tuple(
                NodeReport(n.name, n in live, n.sessions, n.link.capacity) for n in self.nodes
            ),
        )

    def candidates(
        self,
        model: str | None,
        length: int,
        exclude: set[FleetNode] | frozenset[FleetNode] = frozenset(),
        expected_out: int = DEFAULT_EXPECTED_OUT,
    ) -> list[FleetNode]:
        """The eligible nodes in the order the policy tries them."""
        eligible = [
            n
            for n in self.nodes
            if not n.down and n not in exclude and n.serves(model) and n.fits(length)
        ]
        if not eligible:
            return []
        if self.policy is Policy.ROUND_ROBIN:
            eligible.sort(key=lambda n: n.order)
            start = self._cursor % len(eligible)
            self._cursor += 1
            return eligible[start:] + eligible[:start]
        if self.policy is Policy.LEAST_LOADED:
            return sorted(eligible, key=lambda n: (n.sessions + n.inflight, n.order))
        return self._load_aware(eligible, length, expected_out)

    def _fresh(self, node: FleetNode) -> bool:
        age = node.sample_age(self._clock.seconds())
        return age is not None and age < FRESH_SAMPLE_S

    def _load_aware(
        self, eligible: list[FleetNode], length: int, expected_out: int
    ) -> list[FleetNode]:
        def hot(node: FleetNode) -> bool:
            capacity = node.link.capacity
            if capacity is None or not capacity.kv_blocks_total or not self._fresh(node):
                return False
            return capacity.kv_blocks_used * 100 // capacity.kv_blocks_total >= POOL_HIGH_PERCENT

        cool = [n for n in eligible if not hot(n)]
        pool = cool or eligible
        decode_rates = [
            n.link.capacity.decode_tokens_per_s
            for n in pool
            if n.link.capacity is not None and n.link.capacity.decode_tokens_per_s
        ]
        prefill_rates = [
            n.link.capacity.prefill_tokens_per_s
            for n in pool
            if n.link.capacity is not None and n.link.capacity.prefill_tokens_per_s
        ]
        mean_decode = sum(decode_rates) / len(decode_rates) if decode_rates else DEFAULT_DECODE_RATE
        mean_prefill = (
            sum(prefill_rates) / len(prefill_rates) if prefill_rates else DEFAULT_PREFILL_RATE
        )

        def eta(node: FleetNode) -> float:
            capacity = node.link.capacity
            fresh = capacity is not None and self._fresh(node)
            if fresh and capacity is not None:
                ahead = capacity.lanes_active + capacity.queue_depth + node.inflight
            else:
                ahead = node.inflight
            decode = (capacity.decode_tokens_per_s if capacity is not None else 0) or mean_decode
            prefill = (capacity.prefill_tokens_per_s if capacity is not None else 0) or mean_prefill
            return (
                ahead * expected_out * 1000 / decode
                + length * 1000 / prefill
                + expected_out * 1000 / decode
            )

        return sorted(pool, key=lambda n: (eta(n), n.sessions, n.order))

    @defer.inlineCallbacks
    def _place(
        self,
        session: FleetSession,
        context: Sequence[int],
        exclude: set[FleetNode],
        expected_out: int,
    ) -> Generator[Deferred[Any], Any, FleetNode]:
        """Assign ``session`` (new epoch) and append ``context`` on the best eligible node."""
        model = session.model
        order = self.candidates(model, len(context), exclude, expected_out)
        for node in order:
            try:
                link = yield self._ensure(node)
            except NodeDown:
                continue
            if node.down or not node.serves(model) or not node.fits(len(context)):
                continue  # fresh metadata says no (a cold node learned its window just now)
            link.assign(session.session_id, lease=session.lease, params=session.params)
            if context:
                link.append(session.session_id, context)
            session.node = node
            node.sessions += 1
            return node
        too_long = self._too_long(model, len(context))
        if too_long is not None:
            raise too_long
        raise NoNodeAvailable(
            f"no live node serves {model or 'any model'}"
            + (f" (tried {', '.join(n.name for n in order)})" if order else "")
        )

    @defer.inlineCallbacks
    def _bound_link(self, session: FleetSession) -> Generator[Deferred[Any], Any, NodeLink]:
        """The open link of the session's node; a link that lacks the session (a new
        connection of a node that dialed in again) gets it assigned and appended first."""
        node = session.node
        assert node is not None
        link: NodeLink = yield self._ensure(node)
        if link.head_session.epoch_of(session.session_id) is None:
            link.assign(session.session_id, lease=session.lease, params=session.params)
            if session.context:
                link.append(session.session_id, session.context)
        return link

    def _detach(self, session: FleetSession) -> None:
        """Take ``session`` off its node: SESSION_REVOKE there (sent if the link is up)."""
        node, session.node = session.node, None
        if node is None:
            return
        node.sessions -= 1
        node.link.revoke(session.session_id)

    # ----------------------------------------------------------------------------------------
    # Sessions and one-shot generations

    @defer.inlineCallbacks
    def open_session(
        self,
        context: Sequence[int] = (),
        *,
        model: str | None = None,
        params: GenParams = DEFAULT_PARAMS,
        lease: Lease | None = None,
        expected_out: int = DEFAULT_EXPECTED_OUT,
    ) -> Generator[Deferred[Any], Any, FleetSession]:
        """Place a new session holding ``context``; fails with :class:`StreamTooLong` or
        :class:`NoNodeAvailable`."""
        session = self.new_session(context, model=model, params=params, lease=lease)
        yield self._place(session, session.context, set(), expected_out)
        return session

    def new_session(
        self,
        context: Sequence[int] = (),
        *,
        model: str | None = None,
        params: GenParams = DEFAULT_PARAMS,
        lease: Lease | None = None,
    ) -> FleetSession:
        """A session not placed yet (its first generation places it)."""
        return FleetSession(
            self,
            next(self._session_ids),
            model,
            params,
            lease if lease is not None else self.lease,
            context,
        )

    def generate(
        self,
        prompt: Sequence[int],
        max_new: int,
        *,
        model: str | None = None,
        params: GenParams = DEFAULT_PARAMS,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
        max_wall_ms: int = 0,
    ) -> FleetGeneration:
        """One request: place a new session with ``prompt``, generate, revoke the session."""
        session = self.new_session(prompt, model=model, params=params)
        generation = FleetGeneration(
            session, max_new, on_tokens, max_wall_ms, one_shot=True, expected_out=max_new
        )
        generation._start()
        return generation


__all__ = [
    "Fleet",
    "FleetError",
    "FleetGeneration",
    "FleetNode",
    "FleetOutcome",
    "FleetSession",
    "LinkError",
    "NoNodeAvailable",
    "NodeDeclined",
    "NodeDown",
    "NodeLink",
    "Policy",
    "SessionClosed",
    "StreamTooLong",
]
