"""The fleet: a registry of nodes, placement of sessions on them, a queue, and failover
(docs/protocol.md section 8).

:class:`Fleet` owns one :class:`~sfnode.head.link.NodeLink` per node (decision D2 lets one
connection carry every generation of a node, so the per-lane connection pools of upstream are
not needed).  Nodes come from two directions: the head dials the ones it is told about
(:meth:`Fleet.add_node`; each link redials on its own, from about 0.1 s up to a cap, and its
generations survive a dropped connection through the reconcile), and accepts the ones that
dial in (:meth:`Fleet.listen_factory`).  Their HELLO_ACK_F and NODE_STATUS feed the registry:
identity, models, context window, lanes and load.

On top of that:

- placement (:mod:`sfnode.head.placement`, pure): a node is a candidate while its link is open
  and the generations the head runs on it are fewer than its lanes; ``load-aware`` (the
  default), ``least-loaded`` or ``round-robin`` orders the candidates;
- prefix affinity (docs/protocol.md section 8.5): each node has a
  :class:`~sfnode.head.prefix_index.PrefixIndex` of the blocks of the contexts this head placed
  and generated there, cleared when its link opens again; under ``load-aware`` placement
  weighs the leading blocks of a request's context a node holds against its load
  (:class:`~sfnode.head.placement.PrefixRule`), so requests sharing a system prompt and the
  turns of a conversation go where their prefix is;
- a bounded queue: a request no live node can take now waits (``max_queued``, at most
  ``queue_timeout_s``) for a node to come back, join, or free a lane; lanes go to the waiting
  clients round robin (:class:`~sfnode.head.fairqueue.FairQueue`: by API key, else by address,
  each client's requests in arrival order), and one client address may hold at most
  ``max_client_queued`` of the queue; a full queue refuses at once (:class:`QueueFull`, or
  :class:`ClientQueueFull` for a client at its share), a wait that times out fails with
  :class:`NoNodeAvailable`; a waiter that is cancelled (its client went away) leaves;
- a prompt that no node serving the model can hold is refused with :class:`StreamTooLong`
  (``length``, ``max``), also after a cold fleet learned the windows;
- failover, in one place (:meth:`FleetGeneration._run`): a generation whose node dies (or
  declines it) moves to another node with the delivered tokens appended to its context and
  ``max_new - delivered`` left to generate, so the caller sees exactly the tokens of an
  uninterrupted run, none twice (the counter-based sampler makes this hold for sampled
  generations too); with no other node live it waits in the queue, ahead of new requests;
- a wall budget per generation (``max_generation_s``, ``--max-generation-time``): a
  generation still running when it passes, placement and failovers included, is cancelled on
  its node, its lane freed, and it fails with :class:`GenerationTimedOut`, so no request hangs
  on a Finish that never comes (a node that lost the generation);
- a node that declined a generation (full: its live sessions are at ``max_sessions``, or
  draining) is not given new work until its next load report, which tells whether it has
  room again (a fresh report of ``active_sessions`` at ``max_sessions`` counts as full too);
- sessions are revoked when they end; a session whose context outgrows its node moves to one
  that fits;
- a session whose GenParams ask for logprobs is placed only on nodes that offer them
  (``FEATURE_LOGPROBS``, docs/protocol.md section 12.1), failover included; when every node
  serving the model has said it has none, it fails with :class:`LogprobsUnavailable`;
- a constrained generation (docs/protocol.md section 12.3) likewise only on nodes that offer
  ``FEATURE_CONSTRAINTS``, else :class:`ConstraintsUnavailable`; a failover sends the same
  constraint with ``generated_from`` at the end of the prompt, so the new node replays the
  delivered tokens through its grammar; a node that refuses the constraint fails the
  generation with :class:`ConstraintRefused`;
- :meth:`Fleet.status` answers what the HTTP layer asks of its backend
  (:class:`~sfnode.head.backend.BackendStatus`: live nodes, windows, lanes, the queue, counters).

This module must never block, never read the global reactor (the reactor and the clock are
parameters), never import torch or the node side (``StreamTooLong`` comes from
``sfnode.generation``, the one "too long" error of both sides, which imports neither), and never
deliver a token to a caller twice.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.logger import Logger

from sfnode.generation import KV_BLOCK_TOKENS, StreamTooLong, TokenBatch, TokenSink
from sfnode.head import placement
from sfnode.head.backend import ANONYMOUS, BackendStatus, NodeReport, Requester
from sfnode.head.backend import ClientQueueFull as ClientQueueFull
from sfnode.head.backend import ConstraintRefused as ConstraintRefused
from sfnode.head.backend import ConstraintsUnavailable as ConstraintsUnavailable
from sfnode.head.backend import FleetError as FleetError
from sfnode.head.backend import FleetOutcome as FleetOutcome
from sfnode.head.backend import GenerationTimedOut as GenerationTimedOut
from sfnode.head.backend import LogprobsUnavailable as LogprobsUnavailable
from sfnode.head.backend import NodeDeclined as NodeDeclined
from sfnode.head.backend import NodeDown as NodeDown
from sfnode.head.backend import NoNodeAvailable as NoNodeAvailable
from sfnode.head.backend import QueueFull as QueueFull
from sfnode.head.backend import SessionClosed as SessionClosed
from sfnode.head.fairqueue import FairQueue
from sfnode.head.link import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_LEASE,
    DEFAULT_PARAMS,
    HeadIds,
    HeadLinkFactory,
    LinkError,
    NodeLink,
    describe_endpoint,
)
from sfnode.head.machines import (
    DEFAULT_KEEPALIVE_INTERVAL_S,
    DEFAULT_RETRY_MAX_S,
    DEFAULT_SILENCE_TIMEOUT_S,
    RetryPolicy,
    retry_policy,
)
from sfnode.head.model_admission import ModelAdmission
from sfnode.head.placement import DEFAULT_EXPECTED_OUT, DEFAULT_PREFIX_RULE, Policy, PrefixRule
from sfnode.head.prefix_index import BlockKey, PrefixIndex, reusable_keys
from sfnode.wire import (
    FEATURE_CONSTRAINTS,
    FEATURE_LOGPROBS,
    FINISH_CANCELLED,
    FINISH_DECLINED,
    FINISH_LENGTH,
    FINISH_REFUSED,
    Constraint,
    GenParams,
    Lease,
    RequestClass,
)

DEFAULT_MAX_QUEUED = 256
"""Requests that may wait for a node at once; one more is refused at once."""
DEFAULT_QUEUE_TIMEOUT_S = 30.0
"""How long a request waits for a node before it fails (0: as long as it takes)."""
DEFAULT_MAX_GENERATION_S = 600.0
"""The wall budget of one generation, from its request to its Finish (0: none)."""
MAX_FAILOVERS = 16
"""Moves one generation may make before the fleet gives up on it (a request that kills every
node it reaches must not go round for ever)."""

_log = Logger(namespace="sfnode.head.fleet")
_T = TypeVar("_T")


def default_client_queued(max_queued: int) -> int:
    """The default bound of one client address's waiting generations: a quarter of the
    queue (at least 1 when anything may wait)."""
    return max(1, max_queued // 4) if max_queued > 0 else 0


def _deferred(coroutine: Coroutine[Any, Any, _T]) -> Deferred[_T]:
    return Deferred.fromCoroutine(coroutine)


# --------------------------------------------------------------------------------------------
# Errors (the types a caller sees live in sfnode.head.backend)


_NODE_FATAL = (LinkError, NodeDown)
"""Errors that say the node (or the path to it) failed, not the request: these fail over."""


def needed_features(params: GenParams, constraint: Constraint | None = None) -> int:
    """The feature flags a node must offer to serve a session with ``params`` (and a
    generation with ``constraint``)."""
    return (FEATURE_LOGPROBS if params.logprobs else 0) | (
        FEATURE_CONSTRAINTS if constraint is not None else 0
    )


# --------------------------------------------------------------------------------------------
# Nodes


class FleetNode:
    """One node of the registry: its link, and the head's own count of its load."""

    def __init__(self, link: NodeLink, order: int) -> None:
        self.link = link
        self.order = order
        """Registration order: unique, the last tie-breaker of placement."""
        self.sessions = 0
        """Sessions placed here and not ended."""
        self.inflight = 0
        """Generations the head runs here."""
        self.admitted = True
        """The head serves the model it names with it (sfnode.head.model_admission)."""
        self.interactive_inflight = 0
        """How many of them are interactive (docs/protocol.md section 12.2)."""
        self.failed_attempts = 0
        """Failed (re)connection attempts since the link was last open."""
        self.last_failure = ""
        self.prefixes = PrefixIndex()
        """The blocks of the contexts placed and generated here (what its cache may hold)."""
        self.declined_at: float | None = None
        """When it last declined a generation (clock seconds); it takes nothing new until a
        load report sampled after that arrives."""
        self.ended: deque[float] = deque()
        """When this head's generations here ended, since the node's latest load report."""

    @property
    def name(self) -> str:
        return self.link.name

    @property
    def description(self) -> str:
        """The endpoint string dialed, or the peer of a node that dialed in."""
        return self.link.description

    @property
    def label(self) -> str:
        """The name and, when it says more, the endpoint: ``vm (tcp:10.0.0.5:8454)``."""
        name, description = self.link.name, self.link.description
        return name if name == description else f"{name} ({description})"

    @property
    def dialed(self) -> bool:
        return self.link.dialable

    @property
    def live(self) -> bool:
        """Its link is open and the head serves its model with it: placement may use it."""
        return self.link.ready and self.admitted

    @property
    def down(self) -> bool:
        return not self.link.ready

    @property
    def models(self) -> tuple[str, ...]:
        return self.link.models

    @property
    def window(self) -> int | None:
        """The node's context window: None while unknown, 0 when unlimited."""
        capacity = self.link.capacity
        return None if capacity is None else capacity.max_context_tokens

    def view(self, now: float, keys: Sequence[BlockKey] = ()) -> placement.NodeView:
        """What placement knows of this node now, for a request whose context has the block
        keys ``keys`` (how much of it the node is believed to hold)."""
        at = self.link.capacity_at
        self._forget_reported_ends()
        return placement.NodeView(
            key=self.order,
            live=self.live,
            models=self.link.models,
            capacity=self.link.capacity,
            report_age_s=None if at is None else now - at,
            sessions=self.sessions,
            inflight=self.inflight,
            features=self.link.features,
            interactive_inflight=self.interactive_inflight,
            cached_tokens=self.prefixes.cached_blocks(keys) * KV_BLOCK_TOKENS if keys else 0,
            ended_since_report=len(self.ended),
            declined=self.declined_at is not None and (at is None or at <= self.declined_at),
        )

    def generation_started(self, interactive: bool) -> None:
        """One of this head's generations starts here (counted by class, section 12.2)."""
        self.inflight += 1
        if interactive:
            self.interactive_inflight += 1

    def generation_ended(self, now: float, interactive: bool) -> None:
        """One of this head's generations here ended (its lane is free)."""
        self.inflight -= 1
        if interactive:
            self.interactive_inflight -= 1
        self._forget_reported_ends()
        self.ended.append(now)

    def _forget_reported_ends(self) -> None:
        # Only the ends after the latest report matter: that report still counts them, a
        # later one does not.
        at = self.link.capacity_at
        while self.ended and (at is None or self.ended[0] <= at):
            self.ended.popleft()

    def remember(self, keys: Sequence[BlockKey]) -> None:
        """The node was sent, or computed, the blocks named ``keys``."""
        capacity = self.link.capacity
        if capacity is not None and capacity.kv_blocks_total:
            # Bounded like the node's own pool, so the index forgets about when the node evicts.
            self.prefixes.capacity = capacity.kv_blocks_total
        self.prefixes.record(keys)

    def fits(self, length: int) -> bool:
        """Whether a context of ``length`` tokens fits (an unknown window is tried)."""
        window = self.window
        return window is None or window == 0 or length <= window

    def __repr__(self) -> str:
        return f"<FleetNode {self.name} {self.link.status}>"


# --------------------------------------------------------------------------------------------
# The queue


@dataclass(eq=False)
class _Waiter:
    """One request waiting for a node."""

    session: FleetSession
    context: tuple[int, ...]
    request: placement.Request
    claim_lane: bool
    placed: Deferred[FleetNode]
    since: float
    keys: tuple[BlockKey, ...] = ()
    """The block keys of ``context`` (when placement weighs cached prefixes)."""
    timer: IDelayedCall | None = None
    reason: str = ""
    """Why it waits (the last decision), for the timeout's message."""
    settled: bool = field(default=False)


# --------------------------------------------------------------------------------------------
# Sessions and generations


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
        requester: Requester = ANONYMOUS,
    ) -> None:
        self.fleet = fleet
        self.session_id = session_id
        self.model = model
        self.params = params
        self.lease = lease
        self.requester = requester
        """Who it serves: its share of the queue (docs/protocol.md section 8.5)."""
        self.context: tuple[int, ...] = tuple(context)
        """The complete context last appended."""
        self.node: FleetNode | None = None
        self.closed = False

    def append(self, context: Sequence[int]) -> Deferred[None]:
        """Replace the session's context (the COMPLETE context, section 8 "Per request").

        A context that no longer fits the node's window, or a node that cannot be reached,
        moves the session to a node that fits (waiting in the queue if none is live), or fails
        with :class:`StreamTooLong`.
        """
        return _deferred(self._append(tuple(context)))

    async def _append(self, context: tuple[int, ...]) -> None:
        if self.closed:
            raise SessionClosed(f"session {self.session_id} is closed")
        fleet = self.fleet
        node = self.node
        if node is not None and node.fits(len(context)):
            try:
                link = await fleet._bound_link(self)
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
                    fleet._remember(node, context, self.model)
                    return
        if node is not None and self.node is node:
            _log.info(
                "session {session} moves off {node} ({length} tokens)",
                session=self.session_id,
                node=node.name,
                length=len(context),
            )
            fleet._detach(self)
        self.context = context
        await fleet._place(self, context, expected_out=DEFAULT_EXPECTED_OUT, claim_lane=False)

    def generate(
        self,
        max_new: int,
        *,
        on_tokens: TokenSink | None = None,
        max_wall_ms: int = 0,
        request_class: RequestClass = RequestClass.INTERACTIVE,
        constraint: Constraint | None = None,
    ) -> FleetGeneration:
        """Generate up to ``max_new`` tokens after the session's context; fails over on its own.

        A session whose GenParams ask for logprobs gets them in each batch (see
        :meth:`NodeLink.generate`).  ``constraint``:
        as :meth:`Fleet.generate`."""
        generation = FleetGeneration(
            self,
            max_new,
            on_tokens,
            max_wall_ms,
            one_shot=False,
            request_class=request_class,
            constraint=constraint,
        )
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
        on_tokens: TokenSink | None,
        max_wall_ms: int,
        *,
        one_shot: bool,
        expected_out: int = DEFAULT_EXPECTED_OUT,
        request_class: RequestClass = RequestClass.INTERACTIVE,
        constraint: Constraint | None = None,
    ) -> None:
        self.session = session
        self.max_new = max_new
        self.max_wall_ms = max_wall_ms
        self.request_class = request_class
        """Interactive or batch (docs/protocol.md section 12.2); kept across failovers."""
        self.constraint = constraint
        """Its grammar and sampler controls (docs/protocol.md section 12.3); every
        GENERATE_REQ carries it with ``generated_from`` at the end of the prompt."""
        self.features = needed_features(session.params, constraint)
        """What a node must offer to run it."""
        self.tokens: list[int] = []
        """Every token delivered to the caller, in order, each once."""
        self.failovers = 0
        self.result: Deferred[FleetOutcome] = Deferred()
        self._on_tokens = on_tokens
        self._one_shot = one_shot
        self._expected_out = expected_out
        self._cancelled = False
        self._call: Any = None
        self._waiting: Deferred[FleetNode] | None = None
        self._placed = False
        self._placement_failure: Any = None
        self._placement_waiters: list[Deferred[None]] = []
        self._deadline: IDelayedCall | None = None
        self._timed_out: GenerationTimedOut | None = None
        """Set when the wall budget passed: how the generation ends, whatever stopping it
        produced."""

    def when_placed(self) -> Deferred[None]:
        """Fires once the first GENERATE_REQ is sent (or the generation ended first), or
        fails as the generation does if it never got that far (for example with
        :class:`StreamTooLong` or :class:`QueueFull`)."""
        d: Deferred[None] = Deferred()
        if self._placed:
            d.callback(None)
        elif self._placement_failure is not None:
            d.errback(self._placement_failure)
        else:
            self._placement_waiters.append(d)
        return d

    def cancel(self) -> None:
        """Stop the generation (GENERATE_CANCEL to its node, or leave the queue); ``result``
        still fires, with finish CANCELLED."""
        self._cancelled = True
        if self._waiting is not None:
            self._waiting.cancel()
        if self._call is not None:
            self._call.cancel()

    def _start(self) -> None:
        fleet = self.session.fleet
        if fleet.max_generation_s > 0:
            self._deadline = fleet._clock.callLater(fleet.max_generation_s, self._expire)
        _deferred(self._run()).addCallbacks(self._succeeded, self._failed)

    def _succeeded(self, outcome: FleetOutcome) -> None:
        if self._timed_out is not None:
            self._failed(self._timed_out)
            return
        self._stop_deadline()
        self._placement_done(None)
        self.result.callback(outcome)

    def _failed(self, failure: Any) -> None:
        if self._timed_out is not None:
            failure = self._timed_out
        self._stop_deadline()
        self._placement_done(failure)
        self.result.errback(failure)

    def _stop_deadline(self) -> None:
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _expire(self) -> None:
        """The wall budget passed: stop whatever still runs (the queue wait, or the call on
        its node, which sends GENERATE_CANCEL and frees the lane at once whether or not a
        Finish ever comes); the run then ends at once, failing with GenerationTimedOut."""
        self._deadline = None
        session = self.session
        budget = session.fleet.max_generation_s
        _log.warn(
            "generation of session {session} passed its wall budget of {budget:g} s after "
            "{delivered} tokens; cancelling it",
            session=session.session_id,
            budget=budget,
            delivered=len(self.tokens),
        )
        self._timed_out = GenerationTimedOut(
            f"the generation did not end within {budget:g} s (--max-generation-time) "
            f"after {len(self.tokens)} tokens"
        )
        self._cancelled = True
        if self._waiting is not None:
            self._waiting.cancel()
        if self._call is not None:
            self._call.result.cancel()

    def _placement_done(self, failure: Any) -> None:
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

    def _deliver(self, batch: TokenBatch) -> None:
        self.tokens.extend(batch.tokens)
        if self._on_tokens is not None:
            self._on_tokens(batch)

    def _outcome(self, finish: int, node: FleetNode | None) -> FleetOutcome:
        return FleetOutcome(
            list(self.tokens), finish, node.name if node is not None else "", self.failovers
        )

    async def _run(self) -> FleetOutcome:
        """Place, generate, and on a node failure move on with what was delivered."""
        session = self.session
        fleet = session.fleet
        base = session.context
        tried: list[FleetNode] = []
        node: FleetNode | None = None
        try:
            if session.closed:
                raise SessionClosed(f"session {session.session_id} is closed")
            while True:
                if self._cancelled:
                    return self._outcome(FINISH_CANCELLED, node)
                remaining = self.max_new - len(self.tokens)
                if remaining <= 0:
                    return self._outcome(FINISH_LENGTH, node)
                if session.node is None:
                    # Failovers wait ahead of new requests: their clients are mid-answer.
                    self._waiting = fleet._place(
                        session,
                        (*base, *self.tokens),
                        expected_out=remaining if self._one_shot else self._expected_out,
                        claim_lane=True,
                        avoid=tried,
                        priority=bool(self.failovers),
                        interactive=self.interactive,
                        features=self.features,
                    )
                    try:
                        node = await self._waiting
                    except CancelledError:
                        if self._cancelled:
                            return self._outcome(FINISH_CANCELLED, node)
                        raise
                    finally:
                        self._waiting = None
                else:
                    node = session.node
                    node.generation_started(self.interactive)
                try:
                    outcome = await self._generate_on(node, remaining)
                except _NODE_FATAL as e:
                    error: Exception = e
                else:
                    if outcome is None:
                        return self._outcome(FINISH_CANCELLED, node)
                    if outcome.finish == FINISH_REFUSED:
                        length = len(base) + len(self.tokens)
                        if self.constraint is not None and node.fits(length):
                            raise ConstraintRefused(
                                f"{node.name} refused the generation's constraint"
                            )
                        raise StreamTooLong(length, node.window or 0)
                    if outcome.finish != FINISH_DECLINED:
                        if self.failovers and not self._one_shot and session.node is node:
                            # The node holds prompt + the tokens delivered before the
                            # failover; put the session's own context back for its next turn.
                            node.link.append(session.session_id, base)
                        # Its cache now holds the blocks of the answer too: the next turn
                        # of a conversation starts with them.
                        fleet._remember(node, (*base, *self.tokens), session.model)
                        return FleetOutcome(
                            list(self.tokens), outcome.finish, node.name, self.failovers
                        )
                    error = NodeDeclined(
                        f"{node.name} declined the generation (it is full or draining, or a "
                        "stale epoch or replayed command)"
                    )
                    fleet._declined(node)
                if self._cancelled:
                    return self._outcome(FINISH_CANCELLED, node)
                if self.failovers >= MAX_FAILOVERS:
                    if isinstance(error, NodeDeclined):
                        raise error
                    raise NoNodeAvailable(
                        f"gave up after {self.failovers} failovers; the last: {error}"
                    ) from error
                tried.append(node)
                _log.info(
                    "generation of session {session} fails over from {node} after "
                    "{delivered} tokens: {error}",
                    session=session.session_id,
                    node=node.name,
                    delivered=len(self.tokens),
                    error=str(error),
                )
                if session.node is node:
                    fleet._detach(session)
                fleet.failovers += 1
                self.failovers += 1
        finally:
            if self._one_shot:
                session.close()

    async def _generate_on(self, node: FleetNode, remaining: int) -> Any:
        """One GENERATE_REQ on ``node`` (whose lane this generation holds): its outcome, or
        None when the generation was cancelled before it could be sent."""
        fleet = self.session.fleet
        try:
            link = await fleet._bound_link(self.session, self.features)
            if self._cancelled:
                return None
            constraint = self.constraint
            if constraint is not None:
                constraint = replace(constraint, generated_from=len(self.session.context))
            call = link.generate(
                self.session.session_id,
                remaining,
                max_wall_ms=self.max_wall_ms,
                on_tokens=self._deliver,
                request_class=self.request_class,
                constraint=constraint,
            )
            self._call = call
            self._placement_done(None)
            try:
                return await call.result
            finally:
                self._call = None
        finally:
            fleet._release(node, self.interactive)

    @property
    def interactive(self) -> bool:
        return self.request_class == RequestClass.INTERACTIVE


def _lanes(nodes: Sequence[FleetNode]) -> tuple[int, int, int]:
    """Lanes decoding, lanes in total and generations waiting for one on ``nodes``: their
    reports, raised to what this head knows it runs there now."""
    active = total = queued = 0
    for node in nodes:
        capacity = node.link.capacity
        if capacity is None or not capacity.max_lanes:
            active += node.inflight
            continue
        total += capacity.max_lanes
        active += min(max(capacity.lanes_active, node.inflight), capacity.max_lanes)
        queued += max(capacity.queue_depth, node.inflight - capacity.max_lanes)
    return active, total, queued


# --------------------------------------------------------------------------------------------
# The fleet


class Fleet:
    """The head's registry of nodes, the placement of sessions on them and the queue of
    requests waiting for one (section 8)."""

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
        keepalive_interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S,
        silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S,
        retry_max_s: float = DEFAULT_RETRY_MAX_S,
        retry: RetryPolicy | None = None,
        max_queued: int = DEFAULT_MAX_QUEUED,
        max_client_queued: int | None = None,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
        prefix: PrefixRule = DEFAULT_PREFIX_RULE,
        max_generation_s: float = DEFAULT_MAX_GENERATION_S,
        models: ModelAdmission | None = None,
    ) -> None:
        self._reactor = reactor
        self.models = models
        """Which nodes serve which model, by the head's model registry (None: every node
        serves the model it names)."""
        if models is not None:
            models.changed = self._model_judged
        self._clock: IReactorTime = clock if clock is not None else reactor
        self.ids = ids if ids is not None else HeadIds()
        self.token = token
        self.policy = Policy(policy)
        self.lease = lease
        self.handshake_timeout_s = handshake_timeout_s
        self.keepalive_interval_s = keepalive_interval_s
        self.silence_timeout_s = silence_timeout_s
        """The keepalive window: a node silent this long is dropped (0: never)."""
        self.retry_max_s = retry_max_s
        self._retry = retry if retry is not None else retry_policy(retry_max_s)
        self.max_queued = max_queued
        self.max_client_queued = (
            default_client_queued(max_queued) if max_client_queued is None else max_client_queued
        )
        """Generations one client address may have waiting (0: no bound but ``max_queued``;
        generations without an address, such as a program's own, are not bounded by it)."""
        self.queue_timeout_s = queue_timeout_s
        self.prefix = prefix
        """How placement weighs a node's cached prefix against its load (``load-aware``)."""
        self.max_generation_s = max_generation_s
        """The wall budget of each generation (0: none)."""
        self.nodes: list[FleetNode] = []
        self.failovers = 0
        self.reconnects = 0
        self.queue_rejected = 0
        """Requests refused at once because the queue was full."""
        self.queue_timeouts = 0
        """Requests that waited ``queue_timeout_s`` for a node in vain."""
        self._queue: FairQueue[_Waiter] = FairQueue()
        self._dispatching = False
        self._dispatch_again = False
        self._orders = itertools.count()
        self._session_ids = itertools.count(1)
        self._cursor = 0
        self._stopping = False
        self._join_waiters: list[Deferred[FleetNode]] = []

    # ----------------------------------------------------------------------------------------
    # Life cycle and registry

    def start(self) -> None:
        """Let the fleet take requests (links keep themselves alive: nothing to start)."""
        self._stopping = False

    def stop(self) -> Deferred[None]:
        """Fail what waits in the queue and close every link."""
        self._stopping = True
        for waiter in self._queue.clear():
            self._settle(waiter, NoNodeAvailable("the head is stopping"))
        closing = [node.link.close() for node in self.nodes]
        return defer.gatherResults(closing).addCallback(lambda _: None)

    def add_node(self, endpoint: str | IStreamClientEndpoint) -> Deferred[FleetNode]:
        """Register a node the head dials and start dialing it; fires with it once the first
        attempt ended, whether it reached the node or not (a node that cannot be reached is
        kept and redialled with backoff)."""
        if isinstance(endpoint, str):
            description = endpoint
            dialer = cast(
                IStreamClientEndpoint,
                clientFromString(self._reactor, endpoint),  # type: ignore[no-untyped-call]
            )
        else:
            description = describe_endpoint(endpoint)
            dialer = endpoint
        link = NodeLink(
            self._reactor,
            self.ids,
            token=self.token,
            endpoint=dialer,
            description=description,
            handshake_timeout_s=self.handshake_timeout_s,
            clock=self._clock,
            keep_wal=False,
            retry=self._retry,
            keepalive_interval_s=self.keepalive_interval_s,
            silence_timeout_s=self.silence_timeout_s,
        )
        node = FleetNode(link, next(self._orders))
        self.nodes.append(node)
        link.observe(self)
        link.start()
        first = link.when_open()
        return first.addBoth(lambda _: node)

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
            clock=self._clock,
            keep_wal=False,
            loopback_only=loopback_only,
            silence_timeout_s=self.silence_timeout_s,
        )

    def live_nodes(self) -> list[FleetNode]:
        """Nodes whose link is open."""
        return [n for n in self.nodes if n.live]

    def node_named(self, name: str) -> FleetNode | None:
        for node in self.nodes:
            if node.name == name:
                return node
        return None

    @property
    def queued(self) -> int:
        """Requests waiting for a node now."""
        return len(self._queue)

    def next_join(self) -> Deferred[FleetNode]:
        """Fires with the next node that dials in and passes the handshake."""
        d: Deferred[FleetNode] = Deferred()
        self._join_waiters.append(d)
        return d

    def _node_of(self, link: NodeLink) -> FleetNode | None:
        for node in self.nodes:
            if node.link is link:
                return node
        return None

    def _adopt(self, link: NodeLink) -> None:
        """A node dialed in and passed the handshake: it joins by identity."""
        if self._stopping:
            link.close()
            return
        node = FleetNode(link, next(self._orders))
        self.nodes.append(node)
        link.observe(self)
        self._judge(node)
        _log.info(
            "node {node} joined (dialed in from {peer}; models {models}, window {window})",
            node=link.name,
            peer=link.description,
            models=", ".join(link.models) or "-",
            window=node.window,
        )
        waiters, self._join_waiters = self._join_waiters, []
        for d in waiters:
            d.callback(node)
        self._dispatch()

    # ----------------------------------------------------------------------------------------
    # LinkObserver: what the links say

    def link_opened(self, link: NodeLink, reconnected: bool) -> None:
        node = self._node_of(link)
        if node is None:
            return
        self._judge(node)
        if not reconnected:
            _log.info(
                "node {node} joined (dialed {endpoint}; models {models}, window {window})",
                node=node.name,
                endpoint=node.description,
                models=", ".join(link.models) or "-",
                window=node.window,
            )
        else:
            self.reconnects += 1
            if node.failed_attempts:
                _log.info(
                    "node {node} is back after {count} failed attempts",
                    node=node.label,
                    count=node.failed_attempts,
                )
            else:
                _log.info(
                    "the link to {node} is open again (reconciled)",
                    node=node.label,
                )
        node.failed_attempts = 0
        node.last_failure = ""
        if reconnected:
            # The node may have restarted with an empty cache; what it kept is learned again.
            node.prefixes.clear()
        self._dispatch()

    def link_failed(self, link: NodeLink, reason: LinkError, retry_in_s: float | None) -> None:
        node = self._node_of(link)
        if node is None:
            return
        node.failed_attempts += 1
        text = str(reason)
        if node.failed_attempts == 1:
            _log.warn(
                "node {node} is down: {reason}; redialling in {delay:.1f} s, "
                "then backing off up to {cap:g} s",
                node=node.label,
                reason=text,
                delay=retry_in_s or 0.0,
                cap=self.retry_max_s,
            )
        elif text != node.last_failure:
            _log.info(
                "node {node} is still down: {reason} (attempt {count})",
                node=node.label,
                reason=text,
                count=node.failed_attempts,
            )
        node.last_failure = text

    def link_dropped(self, link: NodeLink, reason: LinkError) -> None:
        node = self._node_of(link)
        if node is None:
            return
        if link.dialable:
            _log.info(
                "the link to {node} dropped: {reason}; redialling",
                node=node.label,
                reason=str(reason),
            )

    def link_reported(self, link: NodeLink) -> None:
        if self._queue and self._node_of(link) is not None:
            # A fresh report may say that a full node (or one that declined) has room again.
            self._dispatch()

    def link_closed(self, link: NodeLink) -> None:
        node = self._node_of(link)
        if node is None or self._stopping or link.dialable:
            return
        self.nodes.remove(node)
        if self.models is not None:
            self.models.forget(link)
        _log.info(
            "node {node} left: {reason}",
            node=node.name,
            reason=str(link.last_reason or "its connection ended"),
        )

    def _judge(self, node: FleetNode) -> None:
        """Whether the head serves the model ``node`` names with it (every handshake: a node
        may come back with other files)."""
        if self.models is not None:
            node.admitted = self.models.judge(node.link)

    def _model_judged(self, link: NodeLink) -> None:
        node = self._node_of(link)
        if node is not None and self.models is not None:
            node.admitted = self.models.admits(link)
            self._dispatch()

    # ----------------------------------------------------------------------------------------
    # Placement

    def _views(self, keys: Sequence[BlockKey] = ()) -> list[placement.NodeView]:
        now = self._clock.seconds()
        return [n.view(now, keys) for n in self.nodes]

    @property
    def prefix_aware(self) -> bool:
        """Whether placement weighs cached prefixes (``load-aware`` with a weight above 0)."""
        return self.policy is Policy.LOAD_AWARE and self.prefix.weight > 0

    def _prefix_keys(self, context: Sequence[int], model: str | None) -> tuple[BlockKey, ...]:
        return reusable_keys(context, model) if self.prefix_aware else ()

    def _remember(self, node: FleetNode, context: Sequence[int], model: str | None) -> None:
        """``node`` holds ``context`` (appended, or generated there): its index learns it."""
        if self.prefix_aware:
            node.remember(reusable_keys(context, model))

    def check_fits(self, model: str | None, length: int) -> None:
        """Raise :class:`StreamTooLong` when the known windows already say nothing fits."""
        largest = placement.too_long([v for v in self._views() if v.serves(model)], length)
        if largest is not None:
            raise StreamTooLong(length, largest)

    def max_window(self, model: str | None) -> int:
        """The largest known window among nodes serving ``model`` (0: unknown or unlimited)."""
        return placement.max_window(self._views(), model)

    def status(self, model: str | None = None) -> BackendStatus:
        """How the fleet stands for ``model``: what the HTTP layer asks of its backend
        (``sfnode.head.backend.Backend``) instead of reading the registry itself.

        Lanes and waiting generations come from the nodes' reports (docs/protocol.md section
        7.5), raised to what this head knows it runs there right now, so a fresh burst shows
        at once rather than at the next NODE_STATUS; the requests waiting in this head's own
        queue (section 8.5) are counted in ``queued`` too.
        """
        live = self.live_nodes()
        lanes_active, lanes_total, queued = _lanes(live)
        serving = [n for n in live if model is not None and model in n.models]
        model_running, _, model_queued = _lanes(serving)
        capacities = [n.link.capacity for n in serving if n.link.capacity is not None]
        views = self._views()
        return BackendStatus(
            live_nodes=len(live),
            window=placement.max_window(views, model),
            context_limit=placement.too_long([v for v in views if v.serves(model)], 1 << 62),
            lanes_active=lanes_active,
            lanes_total=lanes_total,
            queued=queued + len(self._queue),
            waiting=len(self._queue),
            queue_rejected=self.queue_rejected,
            queue_timeouts=self.queue_timeouts,
            failovers=self.failovers,
            reconnects=self.reconnects,
            nodes=tuple(
                NodeReport(n.name, n.live, n.sessions, n.link.capacity) for n in self.nodes
            ),
            serving_nodes=len(serving),
            model_running=model_running,
            model_waiting=model_queued
            + sum(1 for w in self._queue if model is not None and w.request.model == model),
            model_kv_blocks_used=sum(c.kv_blocks_used for c in capacities),
            model_kv_blocks_total=sum(c.kv_blocks_total for c in capacities),
        )

    def _place(
        self,
        session: FleetSession,
        context: Sequence[int],
        *,
        expected_out: int,
        claim_lane: bool,
        avoid: Sequence[FleetNode] = (),
        priority: bool = False,
        interactive: bool = False,
        features: int = 0,
    ) -> Deferred[FleetNode]:
        """Assign ``session`` (new epoch) and append ``context`` on the best node that can take
        it, now or when one can (the queue).  ``claim_lane`` counts a generation on the node at
        once.  ``priority`` (a failover) goes ahead of the queue and past its bound;
        ``interactive`` places it as docs/protocol.md section 12.2 says; ``features`` are what
        the node must offer beyond what the session's GenParams need."""
        request = placement.Request(
            model=session.model,
            length=len(context),
            expected_out=expected_out,
            needs_lane=claim_lane,
            avoid=frozenset(n.order for n in avoid),
            features=needed_features(session.params) | features,
            interactive=interactive,
        )
        waiter = _Waiter(
            session,
            tuple(context),
            request,
            claim_lane,
            Deferred(lambda _: self._leave(waiter)),
            self._clock.seconds(),
            self._prefix_keys(context, session.model),
        )
        if self._stopping:
            return defer.fail(NoNodeAvailable("the head is stopping"))
        if priority or not self._queue:
            if self._try(waiter):
                return waiter.placed
        requester = session.requester
        if not priority:
            if len(self._queue) >= self.max_queued:
                self.queue_rejected += 1
                return defer.fail(
                    QueueFull(
                        f"no node can take the request now ({self._why_waiting(waiter)}) and "
                        f"the queue is full ({self.max_queued} generations may wait)"
                    )
                )
            limit = self.max_client_queued
            if requester.address and limit and self._queue.waiting_of(requester.address) >= limit:
                self.queue_rejected += 1
                return defer.fail(ClientQueueFull(requester.address, limit))
        if self.queue_timeout_s > 0:
            waiter.timer = self._clock.callLater(self.queue_timeout_s, self._expire, waiter)
        self._queue.push(waiter, requester.share, requester.address, priority=priority)
        self._dispatch()
        return waiter.placed

    def _why_waiting(self, waiter: _Waiter) -> str:
        """Why ``waiter`` cannot be placed now (for a refusal's message)."""
        if waiter.reason:
            return waiter.reason
        decision = placement.decide(
            self._views(waiter.keys), waiter.request, self.policy, self._cursor, self.prefix
        )
        if isinstance(decision, placement.Wait):
            return decision.reason
        return f"{len(self._queue)} generations wait ahead of it"

    def _try(self, waiter: _Waiter) -> bool:
        """Settle ``waiter`` now if the nodes allow (placed, or refused); False: it waits."""
        decision = placement.decide(
            self._views(waiter.keys), waiter.request, self.policy, self._cursor, self.prefix
        )
        if isinstance(decision, placement.Place):
            by_key = {n.order: n for n in self.nodes}
            node = by_key[decision.order[0]]
            if self.policy is Policy.ROUND_ROBIN:
                self._cursor += 1
            self._queue.served(waiter.session.requester.share)
            self._assign(waiter, node)
            self._settle(waiter, node)
            return True
        if isinstance(decision, placement.TooLong):
            self._settle(waiter, StreamTooLong(decision.length, decision.largest))
            return True
        if isinstance(decision, placement.Unserved):
            if self.models is not None and self.models.knows(decision.model):
                # A model the head serves whose nodes are all gone: it waits for one.
                waiter.reason = f"no live node serves {decision.model}"
                return False
            self._settle(waiter, NoNodeAvailable(f"no node serves {decision.model}"))
            return True
        if isinstance(decision, placement.Unsupported):
            model = waiter.session.model or "the model"
            serving = [v for v in self._views() if v.serves(waiter.request.model)]
            if decision.features & FEATURE_CONSTRAINTS and isinstance(
                placement.with_features(serving, FEATURE_CONSTRAINTS), placement.Unsupported
            ):
                error: FleetError = ConstraintsUnavailable(
                    f"no node serving {model} honours constraints (response_format, tools)"
                )
            else:
                error = LogprobsUnavailable(f"no node serving {model} returns logprobs")
            self._settle(waiter, error)
            return True
        waiter.reason = decision.reason
        return False

    def _assign(self, waiter: _Waiter, node: FleetNode) -> None:
        session, link = waiter.session, node.link
        link.assign(session.session_id, lease=session.lease, params=session.params)
        if waiter.context:
            link.append(session.session_id, waiter.context)
            node.remember(waiter.keys)
        session.node = node
        node.sessions += 1
        if waiter.claim_lane:
            node.generation_started(waiter.request.interactive)

    def _dispatch(self) -> None:
        """Place what waits on whatever the nodes can take now: failovers first, then the
        clients round robin (:meth:`FairQueue.order`)."""
        if self._dispatching:
            # Settling a waiter runs its generation, which may free a lane right here: go
            # round once more when this pass is done.
            self._dispatch_again = True
            return
        self._dispatching = True
        try:
            self._dispatch_again = True
            while self._dispatch_again:
                self._dispatch_again = False
                for waiter in self._queue.order():
                    if not waiter.settled:
                        self._try(waiter)
        finally:
            self._dispatching = False

    def _settle(self, waiter: _Waiter, result: FleetNode | Exception) -> None:
        if waiter.settled:
            return
        waiter.settled = True
        self._queue.remove(waiter)
        if waiter.timer is not None and waiter.timer.active():
            waiter.timer.cancel()
        if isinstance(result, Exception):
            waiter.placed.errback(result)
        else:
            waiter.placed.callback(result)

    def _leave(self, waiter: _Waiter) -> None:
        """The waiter was cancelled (its client went away): it leaves the queue."""
        waiter.settled = True
        self._queue.remove(waiter)
        if waiter.timer is not None and waiter.timer.active():
            waiter.timer.cancel()

    def _expire(self, waiter: _Waiter) -> None:
        waiter.timer = None
        self.queue_timeouts += 1
        self._settle(
            waiter,
            NoNodeAvailable(
                f"no node could take the request within {self.queue_timeout_s:g} s "
                f"({self._why_waiting(waiter)})"
            ),
        )

    async def _bound_link(self, session: FleetSession, features: int = 0) -> NodeLink:
        """The open link of the session's node (waiting for a reconnect under way); a link
        that lacks the session (it was placed over another connection) gets it assigned and
        appended first.  Fails with :class:`NodeDown` when the node cannot be reached now."""
        node = session.node
        assert node is not None
        link = node.link
        try:
            await link.when_open()
        except LinkError as e:
            raise NodeDown(f"{node.name} is down: {e}") from e
        needed = needed_features(session.params) | features
        if (link.features or 0) & needed != needed:
            # The node came back without a feature the session needs (restarted with
            # another engine): the session moves to a node that has it.
            raise NodeDown(f"{node.name} no longer offers what the generation needs")
        if link.head_session.epoch_of(session.session_id) is None:
            link.assign(session.session_id, lease=session.lease, params=session.params)
            if session.context:
                link.append(session.session_id, session.context)
        return link

    def _detach(self, session: FleetSession) -> None:
        """Take ``session`` off its node: SESSION_REVOKE there (now, or once it is back)."""
        node, session.node = session.node, None
        if node is None:
            return
        node.sessions -= 1
        node.link.revoke(session.session_id)

    def _declined(self, node: FleetNode) -> None:
        """``node`` declined a generation: no new work there until it reports again."""
        node.declined_at = self._clock.seconds()

    def _release(self, node: FleetNode, interactive: bool) -> None:
        """A generation on ``node`` ended: its lane may take a waiting request."""
        node.generation_ended(self._clock.seconds(), interactive)
        self._dispatch()

    # ----------------------------------------------------------------------------------------
    # Sessions and one-shot generations

    def open_session(
        self,
        context: Sequence[int] = (),
        *,
        model: str | None = None,
        params: GenParams = DEFAULT_PARAMS,
        lease: Lease | None = None,
        expected_out: int = DEFAULT_EXPECTED_OUT,
    ) -> Deferred[FleetSession]:
        """Place a new session holding ``context`` (waiting in the queue while no live node
        can take it); fails with :class:`StreamTooLong`, :class:`QueueFull` or
        :class:`NoNodeAvailable`."""
        session = self.new_session(context, model=model, params=params, lease=lease)
        placed = self._place(session, session.context, expected_out=expected_out, claim_lane=False)
        return placed.addCallback(lambda _: session)

    def new_session(
        self,
        context: Sequence[int] = (),
        *,
        model: str | None = None,
        params: GenParams = DEFAULT_PARAMS,
        lease: Lease | None = None,
        requester: Requester = ANONYMOUS,
    ) -> FleetSession:
        """A session not placed yet (its first generation places it)."""
        return FleetSession(
            self,
            next(self._session_ids),
            model,
            params,
            lease if lease is not None else self.lease,
            context,
            requester,
        )

    def generate(
        self,
        prompt: Sequence[int],
        max_new: int,
        *,
        model: str | None = None,
        params: GenParams = DEFAULT_PARAMS,
        on_tokens: TokenSink | None = None,
        max_wall_ms: int = 0,
        request_class: RequestClass = RequestClass.INTERACTIVE,
        requester: Requester = ANONYMOUS,
        constraint: Constraint | None = None,
    ) -> FleetGeneration:
        """One request: place a new session with ``prompt``, generate, revoke the session.

        ``params`` asking for logprobs place it only on nodes that return them (failover
        included); when every node serving the model has said it does not, the generation
        fails with :class:`LogprobsUnavailable`.

        ``request_class`` (docs/protocol.md section 12.2): interactive (the default, which is
        also how a node reads a request that says nothing) or batch.  ``requester``: the
        client it serves, its share of the queue (section 8.5).

        ``constraint`` (docs/protocol.md section 12.3; its ``generated_from`` is set here): a
        grammar the output follows and the sampler's per-lane controls, on nodes that offer
        FEATURE_CONSTRAINTS only, failover included; when every node serving the model has
        said it does not, the generation fails with :class:`ConstraintsUnavailable`.  Build
        it with :mod:`sfnode.constraint`.
        """
        session = self.new_session(prompt, model=model, params=params, requester=requester)
        generation = FleetGeneration(
            session,
            max_new,
            on_tokens,
            max_wall_ms,
            one_shot=True,
            expected_out=max_new,
            request_class=request_class,
            constraint=constraint,
        )
        generation._start()
        return generation


__all__ = [
    "DEFAULT_MAX_GENERATION_S",
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_QUEUE_TIMEOUT_S",
    "ClientQueueFull",
    "ConstraintRefused",
    "ConstraintsUnavailable",
    "Fleet",
    "FleetError",
    "FleetGeneration",
    "FleetNode",
    "FleetOutcome",
    "FleetSession",
    "GenerationTimedOut",
    "LinkError",
    "LogprobsUnavailable",
    "NoNodeAvailable",
    "NodeDeclined",
    "NodeDown",
    "NodeLink",
    "Policy",
    "QueueFull",
    "Requester",
    "SessionClosed",
    "StreamTooLong",
]
