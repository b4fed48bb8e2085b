"""The fleet: a registry of nodes, placement of sessions on them, a queue, and failover
(docs/protocol.md section 8).

:class:`Fleet` owns one :class:`~sfnode.head.link.NodeLink` per node (decision D2 lets one
connection carry every generation of a node, so the per-lane connection pools of upstream are
not needed).  Nodes come from two directions: the head dials the ones it is told about
(:meth:`Fleet.add_node`; each link redials on its own, from about 0.1 s up to a cap, and its
generations survive a dropped connection through the reconcile), and accepts the ones that
dial in (:meth:`Fleet.listen_factory`), every link built with the fleet's one
:class:`~sfnode.head.link.LinkSettings`.  Their HELLO_ACK_F and NODE_STATUS feed the registry
(:mod:`sfnode.head.fleet.nodes`): identity, models, context window, lanes and load.

On top of that:

- placement (:mod:`sfnode.head.fleet.placement`, pure): a node is a candidate while its link is open
  and the generations the head runs on it are fewer than its lanes; ``load-aware`` (the
  default), ``least-loaded`` or ``round-robin`` orders the candidates;
- prefix affinity (docs/protocol.md section 8.5): each node has a
  :class:`~sfnode.head.fleet.prefix_index.PrefixIndex` of the blocks of the contexts this head
  placed and generated there, cleared when its link opens again; under ``load-aware`` placement
  weighs the leading blocks of a request's context a node holds against its load
  (:class:`~sfnode.head.fleet.placement.PrefixRule`), so requests sharing a system prompt and the
  turns of a conversation go where their prefix is;
- a bounded queue (:class:`~sfnode.head.fleet.wait_queue.WaitQueue`): a request no live node can
take now
  waits (``max_queued``, at most ``queue_timeout_s``) for a node to come back, join, or free a
  lane; lanes go to the waiting clients by weighted fair share, and a client over its share
  gives one back at its node's next step (:mod:`sfnode.head.fleet.shares`), as a batch
  generation does for an interactive one and a stream nobody reads does at once
  (:class:`~sfnode.head.fleet.fair_queue.FairQueue`: by API key, else by address, each client's
  requests in arrival order), and one client address may hold at most
  ``max_client_queued`` of the queue; a full queue refuses at once (:class:`QueueFull`, or
  :class:`ClientQueueFull` for a client at its share), a wait that times out fails with
  :class:`NoNodeAvailable`; a waiter that is cancelled (its client went away) leaves;
- a prompt that no node serving the model can hold is refused with :class:`StreamTooLong`
  (``length``, ``max``), also after a cold fleet learned the windows;
- failover, decided in one place (:func:`sfnode.head.fleet.failover.decide`, carried out by
  :meth:`FleetGeneration._run`): a generation whose node dies (or declines it) moves to another
  node with the delivered tokens appended to its context and ``max_new - delivered`` left to
  generate, so the caller sees exactly the tokens of an
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
  (:class:`~sfnode.head.fleet.backend.BackendStatus`: live nodes, windows, lanes, the queue,
  counters).

This module must never block, never read the global reactor (the reactor and the clock are
parameters), never import torch or the node side (``StreamTooLong`` comes from
``sfnode.generation``, the one "too long" error of both sides, which imports neither), and never
deliver a token to a caller twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.logger import Logger

from sfnode.generation import StreamTooLong, TokenBatch, TokenSink
from sfnode.head.fleet import failover, placement
from sfnode.head.fleet.backend import (
    ANONYMOUS,
    BackendStatus,
    HeadRequest,
    NodeReport,
    Requester,
    needed_features,
)
from sfnode.head.fleet.backend import ClientQueueFull as ClientQueueFull
from sfnode.head.fleet.backend import ConstraintRefused as ConstraintRefused
from sfnode.head.fleet.backend import ConstraintsUnavailable as ConstraintsUnavailable
from sfnode.head.fleet.backend import FleetError as FleetError
from sfnode.head.fleet.backend import FleetOutcome as FleetOutcome
from sfnode.head.fleet.backend import GenerationTimedOut as GenerationTimedOut
from sfnode.head.fleet.backend import LogprobsUnavailable as LogprobsUnavailable
from sfnode.head.fleet.backend import NodeDeclined as NodeDeclined
from sfnode.head.fleet.backend import NodeDown as NodeDown
from sfnode.head.fleet.backend import NoNodeAvailable as NoNodeAvailable
from sfnode.head.fleet.backend import QueueFull as QueueFull
from sfnode.head.fleet.backend import SessionClosed as SessionClosed
from sfnode.head.fleet.embeddings import Embeddings
from sfnode.head.fleet.failover import MAX_FAILOVERS as MAX_FAILOVERS
from sfnode.head.fleet.model_admission import ModelAdmission
from sfnode.head.fleet.nodes import FleetNode as FleetNode
from sfnode.head.fleet.nodes import NodeRegistry
from sfnode.head.fleet.placement import (
    DEFAULT_EXPECTED_OUT,
    DEFAULT_PREFIX_RULE,
    Policy,
    PrefixRule,
)
from sfnode.head.fleet.prefix_index import BlockKey, reusable_keys
from sfnode.head.fleet.shares import ShareLedger
from sfnode.head.fleet.wait_queue import Waiter, WaitQueue
from sfnode.head.link import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_LEASE,
    DEFAULT_PARAMS,
    HeadIds,
    HeadLinkFactory,
    LinkError,
    LinkSettings,
    NodeLink,
)
from sfnode.head.link.machine import (
    DEFAULT_KEEPALIVE_INTERVAL_S,
    DEFAULT_RETRY_MAX_S,
    DEFAULT_SILENCE_TIMEOUT_S,
    RetryPolicy,
    retry_policy,
)
from sfnode.linkf.wire import (
    FEATURE_CONSTRAINTS,
    FINISH_CANCELLED,
    FINISH_LENGTH,
    Constraint,
    GenParams,
    Lease,
    RequestClass,
)

DEFAULT_MAX_QUEUED = 256
"""Requests that may wait for a node at once; one more is refused at once."""
DEFAULT_QUEUE_TIMEOUT_S = 30.0
DEFAULT_NODE_START_S = 600.0
"""How long a node the head dials may take to answer its first time (a first start converts
the model) while requests wait for it past the queue timeout."""
"""How long a request waits for a node before it fails (0: as long as it takes)."""
DEFAULT_MAX_GENERATION_S = 600.0
"""The wall budget of one generation, from its request to its Finish (0: none)."""

_log = Logger(namespace="sfnode.head.fleet.fleet")
_T = TypeVar("_T")


def default_client_queued(max_queued: int) -> int:
    """The default bound of one client address's waiting generations: a quarter of the
    queue (at least 1 when anything may wait)."""
    return max(1, max_queued // 4) if max_queued > 0 else 0


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """How a fleet runs: one frozen value, built once (``twistd sfhead`` builds it from its
    options) and given to the :class:`Fleet`, which hands its links their
    :class:`~sfnode.head.link.LinkSettings`."""

    token: bytes = b""
    """The fleet token every link authenticates with (empty: none)."""
    policy: Policy = Policy.LOAD_AWARE
    lease: Lease = DEFAULT_LEASE
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    keepalive_interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S
    silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S
    retry_max_s: float = DEFAULT_RETRY_MAX_S
    """The cap of a link's redial backoff."""
    max_queued: int = DEFAULT_MAX_QUEUED
    max_client_queued: int | None = None
    """One client address's share of the queue (None: :func:`default_client_queued`)."""
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    node_start_s: float = DEFAULT_NODE_START_S
    """How long after it is added a node the head dials counts as starting until it first
    answers: a request whose queue timeout comes meanwhile waits on for it (0: never)."""
    prefix: PrefixRule = DEFAULT_PREFIX_RULE
    """How placement weighs a node's cached prefix against its load (``load-aware``)."""
    max_generation_s: float = DEFAULT_MAX_GENERATION_S
    """The wall budget of each generation (0: none)."""
    reclaim_lanes: bool = True
    """A client holding more than its share of the lanes gives one back to a client that
    waits (docs/protocol.md section 8.5, "Shares"); False: lanes go back only when
    generations end."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy(self.policy))

    @property
    def link(self) -> LinkSettings:
        """How every link runs, the ones the fleet dials and the ones that dial in alike."""
        return LinkSettings(
            token=self.token,
            handshake_timeout_s=self.handshake_timeout_s,
            keepalive_interval_s=self.keepalive_interval_s,
            silence_timeout_s=self.silence_timeout_s,
            keep_wal=False,
        )

    @property
    def client_queued(self) -> int:
        """The bound of one client address's waiting generations."""
        if self.max_client_queued is None:
            return default_client_queued(self.max_queued)
        return self.max_client_queued


DEFAULT_FLEET_SETTINGS = FleetSettings()


def _deferred(coroutine: Coroutine[Any, Any, _T]) -> Deferred[_T]:
    return Deferred.fromCoroutine(coroutine)


# --------------------------------------------------------------------------------------------
# Errors (the types a caller sees live in sfnode.head.fleet.backend)


_NODE_FATAL = (LinkError, NodeDown)
"""Errors that say the node (or the path to it) failed, not the request: these fail over."""


def ensure_session(
    link: NodeLink, session: FleetSession, context: Sequence[int], *, fresh: bool = False
) -> None:
    """Make ``link`` hold ``session`` with ``context`` (its COMPLETE context) appended:
    assigned at a new epoch and appended when ``fresh`` (a placement) or when the link does
    not hold the session; left alone when it does (docs/protocol.md sections 6.2 and 8)."""
    if fresh or link.head_session.epoch_of(session.session_id) is None:
        link.assign(session.session_id, lease=session.lease, params=session.params)
        if context:
            link.append(session.session_id, context)


# --------------------------------------------------------------------------------------------
# Nodes


# --------------------------------------------------------------------------------------------
# The queue


@dataclass(frozen=True, slots=True)
class _Placing:
    """What one waiter of the queue asks for: a session placed with ``context``."""

    session: FleetSession
    context: tuple[int, ...]
    request: placement.Request
    claim_lane: bool
    keys: tuple[BlockKey, ...] = ()
    """The block keys of ``context`` (when placement weighs cached prefixes)."""


_Waiter = Waiter["FleetNode"]


# --------------------------------------------------------------------------------------------
# Sessions and generations


@dataclass(eq=False)
class FleetSession:
    """A session placed on one node of the fleet; it moves when its node dies or is too small."""

    fleet: Fleet
    session_id: int
    model: str | None
    params: GenParams
    lease: Lease
    context: tuple[int, ...]
    """The complete context last appended."""
    requester: Requester = ANONYMOUS
    """Who it serves: its share of the queue (docs/protocol.md section 8.5)."""
    node: FleetNode | None = field(default=None, init=False)
    closed: bool = field(default=False, init=False)

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
                link = await fleet._bound_link(self, self.context)
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
        request = HeadRequest(
            self.context,
            max_new,
            model=self.model,
            params=self.params,
            max_wall_ms=max_wall_ms,
            request_class=request_class,
            requester=self.requester,
            constraint=constraint,
        )
        generation = FleetGeneration(self, request, on_tokens, one_shot=False)
        generation._start()
        return generation

    def model_generation(self, generation: FleetGeneration) -> bool:
        """Whether ``generation`` may give its lane to this session (it runs this session's
        model and may yield: :meth:`FleetGeneration.may_yield`)."""
        return generation.may_yield(self.model)

    def close(self) -> None:
        """End the session: SESSION_REVOKE on its node, which then forgets it."""
        if self.closed:
            return
        self.closed = True
        if self.node is not None:
            self.fleet._detach(self)


class LaneYield:
    """A generation's giving its lane back (docs/protocol.md section 8.5, "Shares"): told to
    yield (its node was sent GENERATE_CANCEL), parked until its client reads again, or
    waiting to resume."""

    def __init__(self) -> None:
        self.asked = False
        """Told to give its lane back: a CANCELLED finish then means "wait again and
        resume", not the end."""
        self.parked: Deferred[None] | None = None
        """Set while parked (its client reads nothing): fires when it may run again."""
        self.resuming = False
        """It gave its lane back and waits for one again (first in its client's line)."""

    def park(self) -> bool:
        """Park; False if it already was."""
        if self.parked is not None:
            return False
        self.parked = Deferred()
        return True

    def wake(self) -> None:
        """No longer parked (its client reads again, or it was cancelled)."""
        parked, self.parked = self.parked, None
        if parked is not None:
            parked.callback(None)

    def gave_way(self, outcome: failover.Outcome, cancelled: bool) -> bool:
        """The attempt ended because the generation yielded its lane (or was parked before
        its GENERATE_REQ went out), not because it finished, was cancelled or its node
        failed."""
        yielded = self.asked or self.parked is not None
        self.asked = False
        if not yielded or cancelled:
            return False
        if isinstance(outcome, failover.NotSent):
            return True
        return isinstance(outcome, failover.Finished) and outcome.reason == FINISH_CANCELLED


class FleetGeneration:
    """One generation as the fleet runs it, across failovers; ``result`` fires with a
    :class:`FleetOutcome` or fails with a :class:`FleetError` or :class:`LinkError`."""

    def __init__(
        self,
        session: FleetSession,
        request: HeadRequest,
        on_tokens: TokenSink | None,
        *,
        one_shot: bool,
    ) -> None:
        self.session = session
        self.request = request
        """What was asked (its ``request_class`` and ``constraint`` kept across failovers:
        every GENERATE_REQ carries the constraint with ``generated_from`` at the end of the
        prompt)."""
        self.features = needed_features(session.params, request.constraint)
        """What a node must offer to run it."""
        self.tokens: list[int] = []
        """Every token delivered to the caller, in order, each once."""
        self.failovers = 0
        self.result: Deferred[FleetOutcome] = Deferred()
        self._on_tokens = on_tokens
        self._one_shot = one_shot
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
        self.lane = LaneYield()
        """Whether it gives its lane back, or is parked (docs/protocol.md section 8.5)."""
        self.yields = 0
        """Times it gave its lane back and resumed (docs/protocol.md section 8.5, "Shares")."""

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
        self.lane.wake()
        if self._waiting is not None:
            self._waiting.cancel()
        if self._call is not None:
            self._call.cancel()

    def park(self) -> None:
        """Give the lane back and hold no other until :meth:`unpark` (its client stopped
        reading: docs/protocol.md section 8.5, "Shares"); what was delivered stays
        delivered, and the generation resumes exactly where it stopped."""
        if self.result.called or self._cancelled or not self.lane.park():
            return
        if self._call is not None:
            self.session.fleet.shares.give(self)
            self.yield_lane()
        elif self._waiting is not None:
            self._waiting.cancel()

    def unpark(self) -> None:
        """Its client reads again: wait for a lane (first in its client's line) and go on."""
        self.lane.wake()

    def may_yield(self, model: str | None) -> bool:
        """Whether it may give its lane to a waiter of ``model``: a one-shot generation of
        that model running on a node now, not parked, cancelled or yielding already."""
        return (
            self._one_shot
            and self._call is not None
            and not self.lane.asked
            and not self._cancelled
            and self.lane.parked is None
            and self.session.model == model
        )

    def yield_lane(self) -> None:
        """Give the lane back at the node's next step boundary (GENERATE_CANCEL; the
        CANCELLED finish makes it wait again, to resume with prompt + delivered tokens)."""
        if self._call is None or self.lane.asked:
            return
        self.lane.asked = True
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
        self.lane.wake()
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

    def _outcome(self, finish: int, node: FleetNode | None, detail: int = 0) -> FleetOutcome:
        name = node.name if node is not None else ""
        return FleetOutcome(list(self.tokens), finish, name, self.failovers, detail)

    async def _run(self) -> FleetOutcome:
        """Place, generate, and on a node failure move on with what was delivered: one
        attempt after another, each judged by :func:`failover.decide`."""
        session = self.session
        tried: list[FleetNode] = []
        node: FleetNode | None = None
        moved_from = ""  # the node of a failed attempt, until the journal says where it went
        try:
            if session.closed:
                raise SessionClosed(f"session {session.session_id} is closed")
            while True:
                if self._cancelled:
                    return self._outcome(FINISH_CANCELLED, node)
                if self._remaining <= 0:
                    return self._outcome(FINISH_LENGTH, node)
                if self.lane.parked is not None:
                    await self.lane.parked
                    continue
                placed = await self._take_node(tried)
                if placed is None:
                    if self._cancelled:
                        return self._outcome(FINISH_CANCELLED, node)
                    continue
                node = placed
                if moved_from:
                    _journal_failover(self, moved_from, node.name)
                    moved_from = ""
                outcome = await self._attempt(node)
                if self.lane.gave_way(outcome, self._cancelled):
                    self._step_aside(node)
                    continue
                decision = self._judge(node, outcome)
                if not isinstance(decision, failover.MoveOn):
                    return self._conclude(decision, node)
                self._move_on(node, decision.error, tried)
                moved_from = node.name
        finally:
            if moved_from:
                _journal_failover(self, moved_from, "")
            if self._one_shot:
                session.close()

    def _step_aside(self, node: FleetNode) -> None:
        """Leave ``node`` after yielding: the session is revoked there (the node's prefix
        cache may keep its blocks) and the next attempt waits, first in its client's line,
        with prompt + delivered tokens as its context: the failover's exact resume, without
        counting a failover."""
        session = self.session
        _log.debug(
            "generation of session {session} gave its lane on {node} back after "
            "{delivered} tokens",
            session=session.session_id,
            node=node.name,
            delivered=len(self.tokens),
        )
        session.fleet._remember(node, self._context, session.model)
        if session.node is node:
            session.fleet._detach(session)
        session.fleet.registry.events.record(
            "preempted", node.name, model=session.model, tokens=len(self.tokens)
        )
        self.yields += 1
        self.lane.resuming = True

    @property
    def _remaining(self) -> int:
        return self.request.max_new - len(self.tokens)

    @property
    def _context(self) -> tuple[int, ...]:
        """What the next attempt's node must hold: the prompt and the tokens delivered."""
        return (*self.session.context, *self.tokens)

    async def _take_node(self, tried: Sequence[FleetNode]) -> FleetNode | None:
        """The node of the next attempt, with a lane claimed on it: the session's own, or one
        placed now or when the queue lets it (not one of ``tried``); None when the generation
        was cancelled while it waited."""
        session = self.session
        if session.node is not None:
            session.node.generation_started(self.request.interactive)
            return session.node
        # Failovers wait ahead of new requests: their clients are mid-answer.
        self._waiting = session.fleet._place(
            session,
            self._context,
            expected_out=self._remaining if self._one_shot else DEFAULT_EXPECTED_OUT,
            claim_lane=True,
            avoid=tried,
            priority=bool(self.failovers) and not self.lane.resuming,
            resumed=self.lane.resuming,
            interactive=self.request.interactive,
            rank=self.request.rank,
            features=self.features,
        )
        try:
            node = await self._waiting
        except CancelledError:
            if self._cancelled or self.lane.parked is not None:
                return None
            raise
        finally:
            self._waiting = None
        self.lane.resuming = False
        return node

    async def _attempt(self, node: FleetNode) -> failover.Outcome:
        """One GENERATE_REQ on ``node`` and how it went."""
        try:
            answer = await self._generate_on(node, self._remaining, self._context)
        except _NODE_FATAL as e:
            return failover.Lost(e)
        if answer is None:
            return failover.NotSent()
        return failover.Finished(answer.finish, answer.detail)

    def _judge(self, node: FleetNode, outcome: failover.Outcome) -> failover.Decision:
        """What follows the attempt on ``node`` (:func:`failover.decide`); a node that
        declined takes no new work until it reports again."""
        length = len(self._context)
        attempt = failover.Attempt(
            node.name,
            length,
            node.fits(length),
            constrained=self.request.constraint is not None,
            failovers=self.failovers,
            cancelled=self._cancelled,
            window=node.window or 0,
        )
        if failover.declined(outcome):
            node.declined_at = self.session.fleet._clock.seconds()
        return failover.decide(attempt, outcome)

    def _conclude(
        self, decision: failover.End | failover.Cancelled | failover.Fail, node: FleetNode
    ) -> FleetOutcome:
        """The generation ends as ``decision`` says (or fails with its error)."""
        if isinstance(decision, failover.Fail):
            raise decision.error
        if isinstance(decision, failover.Cancelled):
            return self._outcome(FINISH_CANCELLED, node)
        session = self.session
        if decision.restore and not self._one_shot and session.node is node:
            # The node holds prompt + the tokens delivered before the failover; put the
            # session's own context back for its next turn.
            node.link.append(session.session_id, session.context)
        # Its cache now holds the blocks of the answer too: the next turn of a conversation
        # starts with them.
        session.fleet._remember(node, self._context, session.model)
        return self._outcome(decision.finish, node, decision.detail)

    def _move_on(self, node: FleetNode, error: Exception, tried: list[FleetNode]) -> None:
        """Leave ``node`` after a failed attempt: the next one goes elsewhere."""
        session = self.session
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
            session.fleet._detach(session)
        session.fleet.failovers += 1
        self.failovers += 1

    async def _generate_on(self, node: FleetNode, remaining: int, context: Sequence[int]) -> Any:
        """One GENERATE_REQ on ``node`` (whose lane this generation holds), which holds (or
        gets) ``context``: its outcome, or None when the generation was cancelled before it
        could be sent."""
        fleet = self.session.fleet
        requester = self.request.requester
        fleet.shares.hold(requester.share, requester.weight, self, self.request.rank)
        try:
            link = await fleet._bound_link(self.session, context, self.features)
            if self._cancelled or self.lane.parked is not None:
                return None
            ask = replace(self.request, max_new=remaining)
            if ask.constraint is not None:
                constraint = replace(ask.constraint, generated_from=len(self.session.context))
                ask = replace(ask, constraint=constraint)
            call = link.generate(self.session.session_id, ask, self._deliver)
            self._call = call
            self._placement_done(None)
            try:
                return await call.result
            finally:
                self._call = None
        finally:
            fleet.shares.drop(self)
            fleet._release(node, self.request.interactive)


def _journal_failover(generation: FleetGeneration, moved_from: str, to: str) -> None:
    """The fleet's journal learns that ``generation`` failed over from the node named
    ``moved_from`` to the one named ``to`` ("": none took it), with the tokens it kept."""
    session = generation.session
    session.fleet.registry.events.record(
        "failover", moved_from, to_node=to, model=session.model, tokens=len(generation.tokens)
    )


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


def _take_lanes_back(shares: ShareLedger[FleetGeneration], waiting: Sequence[_Waiter]) -> None:
    """Clients wait for lanes: take one back, for each, from a client that holds more than
    its share (:meth:`ShareLedger.reclaim`), at the victim's next step boundary (its node
    finishes it CANCELLED; it then waits again, first in its own client's line, and resumes
    exactly as a failover does)."""
    claims = (
        (
            w.request.session.requester.share,
            w.request.session.requester.weight,
            w.request.session.model_generation,
            w.rank,
        )
        for w in waiting
        if w.request.claim_lane
    )
    for victim in shares.reclaim(claims):
        victim.yield_lane()


def _make_room(shares: ShareLedger[FleetGeneration], node: FleetNode, placing: _Placing) -> None:
    """An interactive generation went to ``node`` beyond its lanes (docs/protocol.md section
    12.2: the node admits it first when a lane frees): the newest batch generation there gives
    its lane back at the next step, so that it starts at once, and resumes later exactly
    (section 8.5, "Shares")."""
    capacity = node.link.capacity
    if capacity is None or not capacity.max_lanes or node.inflight <= capacity.max_lanes:
        return
    model = placing.session.model
    victim = shares.below(0, lambda g: g.session.node is node and g.may_yield(model))
    if victim is not None:
        requester = placing.session.requester
        shares.give(victim, requester.share, requester.weight)
        shares.reclaimed += 1
        victim.yield_lane()


# --------------------------------------------------------------------------------------------
# The fleet


class Fleet:
    """The head's registry of nodes, the placement of sessions on them and the queue of
    requests waiting for one (section 8)."""

    def __init__(
        self,
        reactor: Any,
        settings: FleetSettings = DEFAULT_FLEET_SETTINGS,
        *,
        ids: HeadIds | None = None,
        clock: IReactorTime | None = None,
        retry: RetryPolicy | None = None,
        models: ModelAdmission | None = None,
    ) -> None:
        self._reactor = reactor
        self.settings = settings
        self.models = models
        """Which nodes serve which model, by the head's model registry (None: every node
        serves the model it names)."""
        self._clock: IReactorTime = clock if clock is not None else reactor
        self.ids = ids if ids is not None else HeadIds()
        self.link_settings = settings.link
        """How every link runs, the ones it dials and the ones that dial in alike."""
        self.policy = settings.policy
        self.lease = settings.lease
        self.shares: ShareLedger[FleetGeneration] = ShareLedger()
        """The lanes each client holds, and whose lane goes back to a client that waits."""
        reclaim = partial(_take_lanes_back, self.shares) if settings.reclaim_lanes else None
        self.queue: WaitQueue[FleetNode] = WaitQueue(
            self._clock,
            self._try,
            self._why_waiting,
            max_queued=settings.max_queued,
            max_client_queued=settings.client_queued,
            timeout_s=settings.queue_timeout_s,
            use=self.shares.use,
            still_waiting=reclaim,
            hold=lambda: self.registry.starting_for(settings.node_start_s),
        )
        """Generations waiting for a node, with the queue's bounds, timeout and counters
        (generations without a client address, such as a program's own, are not bounded by
        the per-address one)."""
        self.prefix = settings.prefix
        self.max_generation_s = settings.max_generation_s
        self.registry = NodeRegistry(
            reactor,
            self._clock,
            self.ids,
            self.link_settings,
            retry if retry is not None else retry_policy(settings.retry_max_s),
            settings.retry_max_s,
            on_room=lambda: self.queue.dispatch(),
            on_report=lambda: self.queue.dispatch() if self.queue else None,
            models=models,
        )
        self.nodes = self.registry.nodes
        """The registry's nodes (the same list)."""
        self.failovers = 0
        self.embeddings = Embeddings(self.live_nodes)
        """Embedding requests, on the nodes that serve an embedding model."""
        self._session_ids = itertools.count(1)
        self._cursor = 0

    # ----------------------------------------------------------------------------------------
    # Life cycle and registry

    def start(self) -> None:
        """Let the fleet take requests (links keep themselves alive: nothing to start)."""
        self.registry.stopping = False

    def stop(self) -> Deferred[None]:
        """Fail what waits in the queue, cancel the models' drops and close every link."""
        self.registry.stopping = True
        if self.models is not None:
            self.models.stop()
        self.queue.clear(NoNodeAvailable("the head is stopping"))
        closing = [node.link.close() for node in self.nodes]
        return defer.gatherResults(closing).addCallback(lambda _: None)

    def add_node(self, endpoint: str | IStreamClientEndpoint) -> Deferred[FleetNode]:
        """Register a node the head dials and start dialing it; fires with it once the first
        attempt ended, whether it reached the node or not (a node that cannot be reached is
        kept and redialled with backoff)."""
        return self.registry.dial(endpoint)

    def listen_factory(self, *, loopback_only: bool = False) -> HeadLinkFactory:
        """The protocol factory for a port that nodes dial (``--fleet-listen``).

        ``loopback_only`` (what ``twistd sfhead`` asks for without a fleet token, unless
        --insecure-no-auth) closes connections from anywhere but loopback at once.
        """
        return self.registry.listen_factory(loopback_only=loopback_only)

    def live_nodes(self) -> list[FleetNode]:
        """Nodes whose link is open."""
        return [n for n in self.nodes if n.live]

    def node_named(self, name: str) -> FleetNode | None:
        return self.registry.named(name)

    def next_join(self) -> Deferred[FleetNode]:
        """Fires with the next node that dials in and passes the handshake."""
        return self.registry.next_join()

    @property
    def queued(self) -> int:
        """Requests waiting for a node now."""
        return len(self.queue)

    # ----------------------------------------------------------------------------------------
    # Placement

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
        largest = placement.too_long([v for v in self.registry.views() if v.serves(model)], length)
        if largest is not None:
            raise StreamTooLong(length, largest)

    def status(self, model: str | None = None) -> BackendStatus:
        """How the fleet stands for ``model``: what the HTTP layer asks of its backend
        (``sfnode.head.fleet.backend.Backend``) instead of reading the registry itself.

        Lanes and waiting generations come from the nodes' reports (docs/protocol.md section
        7.5), raised to what this head knows it runs there right now, so a fresh burst shows
        at once rather than at the next NODE_STATUS; the requests waiting in this head's own
        queue (section 8.5) are counted in ``queued`` too.
        """
        live = self.live_nodes()
        lanes_active, lanes_total, queued = _lanes(live)
        named = [n for n in live if model is not None and model in n.models]
        serving = [n for n in named if not n.embeds]
        model_running, _, model_queued = _lanes(serving)
        capacities = [n.link.capacity for n in serving if n.link.capacity is not None]
        views = self.registry.views()
        return BackendStatus(
            live_nodes=len(live),
            window=placement.max_window(views, model),
            context_limit=placement.too_long([v for v in views if v.serves(model)], 1 << 62),
            lanes_active=lanes_active,
            lanes_total=lanes_total,
            queued=queued + len(self.queue),
            waiting=len(self.queue),
            queue_rejected=self.queue.rejected,
            queue_timeouts=self.queue.timeouts,
            failovers=self.failovers,
            reclaimed=self.shares.reclaimed,
            reconnects=self.registry.reconnects,
            nodes=tuple(
                NodeReport(n.name, n.live, n.sessions, n.link.capacity, n.refused)
                for n in self.nodes
            ),
            serving_nodes=len(serving),
            model_running=model_running,
            model_waiting=model_queued
            + sum(1 for w in self.queue if model is not None and w.request.request.model == model),
            model_kv_blocks_used=sum(c.kv_blocks_used for c in capacities),
            model_kv_blocks_total=sum(c.kv_blocks_total for c in capacities),
            embedding_nodes=len(named) - len(serving),
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
        resumed: bool = False,
        interactive: bool = False,
        rank: int = 0,
        features: int = 0,
    ) -> Deferred[FleetNode]:
        """Assign ``session`` (new epoch) and append ``context`` on the best node that can take
        it, now or when one can (the queue).  ``claim_lane`` counts a generation on the node at
        once.  ``priority`` (a failover) goes ahead of the queue and past its bound;
        ``resumed`` (a generation that gave its lane back) goes past the bound to the front
        of its own client's line;
        ``interactive`` places it as docs/protocol.md section 12.2 says and ``rank`` is its
        class's place in the queue (section 8.5, "Shares"); ``features`` are what
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
        requester = session.requester
        waiter = self.queue.waiter(
            _Placing(
                session,
                tuple(context),
                request,
                claim_lane,
                self._prefix_keys(context, session.model),
            ),
            requester.share,
            requester.address,
        )
        waiter.rank = rank
        if self.registry.stopping:
            return defer.fail(NoNodeAvailable("the head is stopping"))
        if (priority or not self.queue) and self._try(waiter):
            return waiter.placed
        if not (priority or resumed):
            refused = self.queue.refusal(waiter)
            if refused is not None:
                return defer.fail(refused)
        self.queue.wait(waiter, priority=priority, front=resumed)
        return waiter.placed

    def _decide(self, placing: _Placing) -> placement.Decision:
        """Where ``placing`` goes now, from the nodes' views (placement is pure)."""
        views = self.registry.views(placing.keys)
        return placement.decide(views, placing.request, self.policy, self._cursor, self.prefix)

    def _why_waiting(self, waiter: _Waiter) -> str:
        """Why ``waiter`` cannot be placed now (for a refusal's message)."""
        if waiter.reason:
            return waiter.reason
        decision = self._decide(waiter.request)
        if isinstance(decision, placement.Wait):
            return decision.reason
        return f"{len(self.queue)} generations wait ahead of it"

    def _try(self, waiter: _Waiter) -> bool:
        """Settle ``waiter`` now if the nodes allow (placed, or refused); False: it waits."""
        placing: _Placing = waiter.request
        decision = self._decide(placing)
        if isinstance(decision, placement.Place):
            by_key = {n.order: n for n in self.nodes}
            node = by_key[decision.order[0]]
            if self.policy is Policy.ROUND_ROBIN:
                self._cursor += 1
            self.queue.served(waiter)
            self._assign(placing, node)
            self.queue.settle(waiter, node)
            return True
        if isinstance(decision, placement.TooLong):
            self.queue.settle(waiter, StreamTooLong(decision.length, decision.largest))
            return True
        if isinstance(decision, placement.Unserved):
            if self.models is not None and self.models.knows(decision.model):
                # A model the head serves whose nodes are all gone: it waits for one.
                waiter.reason = f"no live node serves {decision.model}"
                return False
            self.queue.settle(waiter, NoNodeAvailable(f"no node serves {decision.model}"))
            return True
        if isinstance(decision, placement.Unsupported):
            model = placing.session.model or "the model"
            serving = [v for v in self.registry.views() if v.serves(placing.request.model)]
            if decision.features & FEATURE_CONSTRAINTS and isinstance(
                placement.with_features(serving, FEATURE_CONSTRAINTS), placement.Unsupported
            ):
                error: FleetError = ConstraintsUnavailable(
                    f"no node serving {model} honours constraints (response_format, tools)"
                )
            else:
                error = LogprobsUnavailable(f"no node serving {model} returns logprobs")
            self.queue.settle(waiter, error)
            return True
        waiter.reason = decision.reason
        return False

    def _assign(self, placing: _Placing, node: FleetNode) -> None:
        session = placing.session
        ensure_session(node.link, session, placing.context, fresh=True)
        if placing.context:
            node.remember(placing.keys)
        session.node = node
        node.sessions += 1
        if placing.claim_lane:
            node.generation_started(placing.request.interactive)
            if placing.request.interactive and self.settings.reclaim_lanes:
                _make_room(self.shares, node, placing)

    async def _bound_link(
        self, session: FleetSession, context: Sequence[int], features: int = 0
    ) -> NodeLink:
        """The open link of the session's node (waiting for a reconnect under way); a link
        that lacks the session gets it assigned with ``context`` (what the node must hold for
        the call to come: the session's context, or for a generation that failed over, its
        prompt and the tokens delivered so far) appended first.  Fails with :class:`NodeDown`
        when the node cannot be reached now."""
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
        ensure_session(link, session, context)
        return link

    def _detach(self, session: FleetSession) -> None:
        """Take ``session`` off its node: SESSION_REVOKE there (now, or once it is back)."""
        node, session.node = session.node, None
        if node is None:
            return
        node.sessions -= 1
        node.link.revoke(session.session_id)

    def _release(self, node: FleetNode, interactive: bool) -> None:
        """A generation on ``node`` ended: its lane may take a waiting request."""
        node.generation_ended(self._clock.seconds(), interactive)
        self.queue.dispatch()

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
            tuple(context),
            requester,
        )

    def generate(
        self, request: HeadRequest, on_tokens: TokenSink | None = None
    ) -> FleetGeneration:
        """One request: place a new session with ``request.prompt``, generate, revoke the
        session.

        GenParams asking for logprobs place it only on nodes that return them (failover
        included); when every node serving the model has said it does not, the generation
        fails with :class:`LogprobsUnavailable`.

        The request class (docs/protocol.md section 12.2): interactive (the default, which is
        also how a node reads a request that says nothing) or batch.  The requester: the
        client it serves, its share of the queue (section 8.5).

        A constraint (docs/protocol.md section 12.3; its ``generated_from`` is set here): a
        grammar the output follows and the sampler's per-lane controls, on nodes that offer
        FEATURE_CONSTRAINTS only, failover included; when every node serving the model has
        said it does not, the generation fails with :class:`ConstraintsUnavailable`.  Build
        it with :mod:`sfnode.decoding.constraint`.
        """
        session = self.new_session(
            request.prompt,
            model=request.model,
            params=request.params,
            requester=request.requester,
        )
        generation = FleetGeneration(session, request, on_tokens, one_shot=True)
        generation._start()
        return generation


__all__ = [
    "DEFAULT_FLEET_SETTINGS",
    "DEFAULT_MAX_GENERATION_S",
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_NODE_START_S",
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
    "FleetSettings",
    "GenerationTimedOut",
    "HeadRequest",
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
