"""The pipeline driver (docs/protocol.md section 7.6): each generation runs across stage nodes,
layer range by range.

P stage nodes split ``n_layers`` layers at boundaries given by the operator, or else by the
stage nodes' memory and speed as their reports say (:mod:`sfnode.head.fleet.stage_plan`, once
every stage has reported, before the first generation), or else evenly (``boundary[i] =
((i+1)·n_layers) // P``).  Stage 0 gets tokens and no hidden state, stage i > 0 gets no
tokens and the previous stage's hidden state; the first stage that answers with a token ends the
step (greedy).

When every stage's node keeps stage KV (feature bit 7, docs/protocol.md section 12.8), each
generation has a stage session: its context goes through the stages once, in chunks of
:data:`PREFILL_CHUNK` positions, and each step then sends only the new token (and its hidden
state) at its position; a generation that steps alone, when every stage's node joins stage rings
(bit 9, section 12.10), has its steps handed from stage to stage
(:class:`~sfnode.head.fleet.ring.StageRing`) and the head only receives the tokens.  Otherwise
each step recomputes the whole context (section 7.6).  A stage that answers nothing or is lost
makes the generation wait for that stage's link (retrying with backoff, at most
:data:`MAX_REBUILDS` times without a new token) and rebuild every stage from position 0 with the
context it holds, the prompt and every token delivered: the token it then gets is the one the
lost step would have given, so nothing is repeated or lost.  Before a rebuild, the layers of a
stage whose link is down go to a spare node whose link is up
(:meth:`PipelineFleet.replace_down`); without one the rebuild waits for the stage's own address.

The stage nodes are kept in a :class:`~sfnode.head.fleet.fleet.Fleet` of their own, so they are
dialed, kept alive, redialled and reported (health, metrics) like any fleet's nodes, but never
placed on: a pipeline needs all of its stages.  A stage that stays unreachable through every
rebuild fails the generation (:class:`NoNodeAvailable`).  A generation has the fleet's wall
budget (``max_generation_s``): past it the step in flight is abandoned and the generation fails
with :class:`~sfnode.head.fleet.backend.GenerationTimedOut`.

This module must never block, never use the global reactor, and never hand a caller a token twice
or a token computed from a context it did not ask for.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from twisted.internet import defer, task
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.generation import TokenBatch, TokenSink
from sfnode.head.fleet.backend import (
    BackendStatus,
    ConstraintsUnavailable,
    FleetError,
    FleetOutcome,
    GenerationTimedOut,
    HeadRequest,
    LogprobsUnavailable,
    NoNodeAvailable,
    StageReport,
)
from sfnode.head.fleet.fleet import DEFAULT_FLEET_SETTINGS, Fleet, FleetNode, FleetSettings
from sfnode.head.fleet.ring import RingBroken, RingRun, StageRing
from sfnode.head.fleet.stage_plan import StageModel, StagePlanError, plan_boundaries, stage_node
from sfnode.head.link import HeadIds, LinkError, NodeLink, stage_batch
from sfnode.linkf.wire import (
    FEATURE_STAGE_BATCH,
    FEATURE_STAGE_KV,
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_LENGTH,
    StageBatchRespMsg,
    StageBatchRow,
    StageForwardRespMsg,
    StageReleaseMsg,
)

_log = Logger(namespace="sfnode.head.fleet.pipeline")

PREFILL_CHUNK = 256
"""Positions per kept-stage request while a context goes through (docs/protocol.md 12.8)."""
MAX_REBUILDS = 12
"""Rebuilds of a generation's stages in a row, without a new token, before it fails."""
COALESCE_TOKENS = 16
COALESCE_S = 0.2
"""A generation's tokens go to its caller as a node sends them (docs/protocol.md section 4.4):
the first at once, then this many together or this long after the last batch."""
MICRO_BATCHES = 2
"""Step groups of a pipeline (:class:`StepGroup`): while one group's rows are on a stage,
another's can be on the next."""
REBUILD_DELAYS = (0.1, 0.2, 0.4, 0.8, 1.6, 2.0)
"""Seconds waited before each rebuild (the last repeats): a stage node being restarted."""


class PipelineError(FleetError):
    """A stage answered nothing usable (no hidden state and no token)."""


def even_boundaries(n_layers: int, stages: int) -> list[int]:
    """``boundary[i] = ((i+1)·n_layers) // P``: the end layer of each stage."""
    if stages < 1 or n_layers < stages:
        raise ValueError(f"cannot split {n_layers} layers over {stages} stages")
    return [((i + 1) * n_layers) // stages for i in range(stages)]


def check_boundaries(boundaries: Sequence[int], stages: int) -> list[int]:
    """Given end layers, one per stage, strictly increasing from above 0."""
    out = [int(b) for b in boundaries]
    if len(out) != stages:
        raise ValueError(f"{len(out)} layer boundaries given for {stages} stages")
    previous = 0
    for b in out:
        if b <= previous:
            raise ValueError(f"layer boundaries must increase from above 0: {out}")
        previous = b
    return out


def plan_stages(sizes: StageModel, stages: Sequence[FleetNode]) -> tuple[list[int] | None, str]:
    """The boundaries :func:`~sfnode.head.fleet.stage_plan.plan_boundaries` gives the stages'
    reports, and what they rest on; None (and why) while a stage has not reported, when the
    reports say neither speed nor memory, or when the nodes cannot hold the model."""
    missing = [node.name for node in stages if node.link.capacity is None]
    if missing:
        return None, f"stage nodes {', '.join(missing)} have not reported their capacity"
    nodes = [stage_node(node.link.capacity, node.link.resident_bytes) for node in stages]
    speeds = [node.speed or 0 for node in nodes]
    free = [node.free_bytes for node in nodes]
    if not any(speeds) and not sizes.layer_bytes and not sizes.head_layers:
        return None, (
            "no stage node has reported a decode rate, and the model's layer size and LM "
            "head are unknown"
        )
    try:
        boundaries = plan_boundaries(sizes, nodes)
    except StagePlanError as e:
        return None, str(e)
    return boundaries, (
        f"decode rates {speeds} tokens/s, free bytes {free}, {sizes.layer_bytes} bytes a "
        f"layer, the LM head's work {sizes.head_layers:.1f} layers"
    )


@dataclass
class _Kept:
    """A generation's stage session (docs/protocol.md section 12.8): its id on every stage, and
    how many positions every stage holds; ``session`` None: none is open."""

    session: int | None = None
    rows: int = 0
    links: list[NodeLink] = field(default_factory=list)
    """The links the session was opened on (released there)."""
    forwarded: int = 0
    """Hidden-state bytes the generation sent to stages (what crosses between stages)."""
    recomputes: bool = False
    """A stage refused to open a session (none free): the generation recomputes (7.6)."""
    run: RingRun | None = None
    """Its steps in the stage ring (docs/protocol.md section 12.10), while they run there."""
    row_bytes: int = 0
    """The bytes of one row's hidden state, as the stages answered its context's last chunk
    (what a ring step sends from each stage to the next)."""
    step_s: float = 0.0
    """How long its last request through the step groups took (a ring run's first wait is
    bounded by it, section 12.10)."""


@dataclass
class _Row:
    """One generation's rows waiting for its step group's round: its session's request, and
    the token it answers."""

    kept: _Kept
    tokens: tuple[int, ...]
    position: int
    answer: Deferred[int]
    hidden: bytes | None = None


class StepGroup:
    """Generations whose kept-stage steps go through the stages together (docs/protocol.md
    section 12.8): a round starts once every member has asked for its next step, sends every
    member's rows to a stage in the same reactor turn (so the node computes them in one pass
    over its layers), then the next stage with their hidden states, and answers each member its
    token.  A member that fails leaves the group (its rebuild waits alone) and joins it again
    with its next step; one that ends leaves it."""

    def __init__(self, pipeline: PipelineFleet) -> None:
        self._pipeline = pipeline
        self.members: set[int] = set()
        """The ``id`` of each member's :class:`_Kept`."""
        self._waiting: dict[int, _Row] = {}
        self._running = False
        self._called: IDelayedCall | None = None
        self.rounds = 0
        """Rounds run (each one pass per stage for every member)."""

    def submit(self, kept: _Kept, tokens: tuple[int, ...], position: int) -> Deferred[int]:
        """The token after ``tokens`` at ``position`` of ``kept``'s session."""
        key = id(kept)

        def cancel(_: Deferred[int]) -> None:
            self._waiting.pop(key, None)
            self.leave(kept)

        row = _Row(kept, tokens, position, Deferred(cancel))
        self.members.add(key)
        self._waiting[key] = row
        self._check()
        return row.answer

    def leave(self, kept: _Kept) -> None:
        """``kept``'s generation steps no more with the group (it ended, or waits to rebuild)."""
        self.members.discard(id(kept))
        self._waiting.pop(id(kept), None)
        self._check()

    def _all_wait(self) -> bool:
        """Every member has asked for its next step (and there is one)."""
        return bool(self._waiting) and set(self._waiting) == self.members

    def _check(self) -> None:
        """A round starts at the end of this reactor turn once every member waits (so the
        members that ask in the same turn go together)."""
        if self._running or self._called is not None or not self._all_wait():
            return
        self._called = self._pipeline.clock.callLater(0, self._start_round)

    def _start_round(self) -> None:
        self._called = None
        if self._running or not self._all_wait():
            return
        rows, self._waiting = list(self._waiting.values()), {}
        self._running = True
        self.rounds += 1
        self._round(rows).addBoth(self._round_done)

    def _round_done(self, _: object) -> None:
        """The next round starts now when every member asked again while this one answered
        (as a generation does at once with its token): the next STAGE_BATCH_REQ leaves in the
        turn the last token came in, not one reactor turn later."""
        self._running = False
        if self._all_wait():
            self._start_round()
        else:
            self._check()

    @defer.inlineCallbacks
    def _round(self, rows: list[_Row]) -> Generator[Deferred[Any], Any, None]:
        """Every row through the stages, one stage at a time; each answer fires at the end."""
        pipeline = self._pipeline
        answers: list[tuple[_Row, int | Failure | PipelineError]] = []
        for i, (start, end) in enumerate(pipeline.ranges):
            results = yield _through_stage(i, start, end, rows)
            going = []
            for row, (ok, response) in zip(rows, results, strict=True):
                pipeline.count_forwarded(row.kept, row.hidden)
                answer = _answer(ok, response, row.kept.links[i].name, start, end)
                if isinstance(answer, bytes):
                    row.hidden = answer
                    row.kept.row_bytes = len(answer) // max(1, len(row.tokens))
                    going.append(row)
                else:
                    answers.append((row, answer))
            rows = going
            if not rows:
                break
        for row in rows:
            answers.append((row, PipelineError("no stage answered a token")))
        for row, answer in answers:
            if not isinstance(answer, int):
                self.members.discard(id(row.kept))
                if not row.answer.called:
                    row.answer.errback(answer)
            elif not row.answer.called:
                row.answer.callback(answer)


def _through_stage(
    i: int, start: int, end: int, rows: Sequence[_Row]
) -> Deferred[list[tuple[bool, Any]]]:
    """Every row through stage ``i`` (layers ``[start, end)``), each row's ``(ok, answer)``
    in order: one STAGE_BATCH_REQ per link whose node set ``FEATURE_STAGE_BATCH``, one
    STAGE_FORWARD_REQ per row on any other (docs/protocol.md section 12.8)."""
    by_link: dict[int, list[int]] = {}
    for n, row in enumerate(rows):
        by_link.setdefault(id(row.kept.links[i]), []).append(n)
    link = rows[0].kept.links[i]
    if len(by_link) == 1 and (link.features or 0) & FEATURE_STAGE_BATCH:
        # Every row on one batching link (every step's case): its answers are the rows' own,
        # without a Deferred per row.
        batch = [_batch_row(row, i) for row in rows]
        return stage_batch(link, start, end, batch).addBoth(_batch_answers, link.name, len(rows))
    sent: list[Deferred[Any]] = [Deferred() for _ in rows]
    for indices in by_link.values():
        link = rows[indices[0]].kept.links[i]
        if (link.features or 0) & FEATURE_STAGE_BATCH:
            answered = stage_batch(link, start, end, [_batch_row(rows[n], i) for n in indices])
            answered.addBoth(_split_batch, link.name, [sent[n] for n in indices])
        else:
            for n in indices:
                row = rows[n]
                link.stage_forward(
                    row.tokens if i == 0 else (),
                    start,
                    end,
                    row.hidden,
                    row.kept.session,
                    row.position,
                ).chainDeferred(sent[n])
    return defer.DeferredList(sent, consumeErrors=True)


def _batch_row(row: _Row, i: int) -> StageBatchRow:
    """``row``'s request to stage ``i`` in a STAGE_BATCH_REQ: its tokens to the first stage
    only, the hidden state the stage before answered to the others."""
    return StageBatchRow(
        row.kept.session or 0, row.position, row.tokens if i == 0 else (), row.hidden
    )


def _batch_answers(
    response: StageBatchRespMsg | Failure, name: str, count: int
) -> list[tuple[bool, Any]]:
    """Each of ``count`` rows' ``(ok, answer)`` from one STAGE_BATCH_RESP, as a DeferredList
    gives them: all failed when the batch failed or answered another number of rows."""
    if isinstance(response, Failure):
        return [(False, response)] * count
    if len(response.answers) != count:
        error = PipelineError(f"stage {name} answered another batch")
        return [(False, error)] * count
    return [(True, answer) for answer in response.answers]


def _split_batch(
    response: StageBatchRespMsg | Failure, name: str, rows: Sequence[Deferred[Any]]
) -> None:
    """Fire each row's Deferred with its answer in a STAGE_BATCH_RESP (:func:`_batch_answers`:
    all of them fail when the batch failed or answered another number of rows)."""
    for row, (ok, answer) in zip(rows, _batch_answers(response, name, len(rows)), strict=True):
        if ok:
            row.callback(answer)
        else:
            row.errback(answer)


def _answer(
    ok: bool, response: Any, name: str, start: int, end: int
) -> int | bytes | Failure | PipelineError:
    """A stage's answer to one row: its token, the hidden state to send on, or the failure."""
    if not ok:
        failure: Failure | PipelineError = response
        return failure
    if response.token is not None:
        return int(response.token)
    if response.hidden is None:
        return PipelineError(
            f"stage {name} answered nothing for layers [{start}, {end}): the engine lacks "
            "staged forward, the layers are out of its range, or it lost the generation's "
            "stage session"
        )
    hidden: bytes = response.hidden
    return hidden


class PipelineGeneration:
    """One pipelined generation: ``result`` fires with a :class:`FleetOutcome`."""

    def __init__(
        self,
        pipeline: PipelineFleet,
        prompt: Sequence[int],
        max_new: int,
        on_tokens: TokenSink | None,
    ) -> None:
        self.tokens: list[int] = []
        self.result: Deferred[FleetOutcome] = Deferred()
        self._pipeline = pipeline
        self._prompt = list(prompt)
        self._max_new = max_new
        self._on_tokens = on_tokens
        self._cancelled = False
        self._running: Deferred[FleetOutcome] | None = None
        self._deadline: IDelayedCall | None = None
        self._timed_out: GenerationTimedOut | None = None
        self._kept = _Kept()
        self._pending: list[int] = []
        """Tokens not handed to ``on_tokens`` yet (:meth:`_deliver`)."""
        self._flush_call: IDelayedCall | None = None
        self._last_flush = 0.0
        """Its stage session (docs/protocol.md section 12.8)."""

    def when_placed(self) -> Deferred[None]:
        """A pipeline needs no placement: fires at once."""
        return defer.succeed(None)

    def cancel(self) -> None:
        """Stop after the step in flight; ``result`` then says CANCELLED."""
        self._cancelled = True

    def park(self) -> None:
        """A pipeline's generation holds no lane of a node's scheduler (its stage sessions are
        slots of their own, docs/protocol.md section 12.8): there is none to give back, and it
        goes on."""

    def unpark(self) -> None:
        """Nothing was given back (:meth:`park`)."""

    def _start(self) -> None:
        budget = self._pipeline.fleet.max_generation_s
        if budget > 0:
            self._deadline = self._pipeline.clock.callLater(budget, self._expire, budget)
        self._running = self._run()
        self._running.addCallbacks(self._succeeded, self._failed)

    def _succeeded(self, outcome: FleetOutcome) -> None:
        if self._timed_out is not None:
            self._failed(self._timed_out)
            return
        self._stop_deadline()
        self.result.callback(outcome)

    def _failed(self, failure: Failure | Exception) -> None:
        if self._timed_out is not None:
            failure = self._timed_out
        self._stop_deadline()
        self.result.errback(failure)

    def _stop_deadline(self) -> None:
        self._flush()
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _expire(self, budget: float) -> None:
        """The wall budget passed: abandon the step in flight (its stage forward), which ends
        the run at once, failing with GenerationTimedOut."""
        self._deadline = None
        self._cancelled = True
        self._timed_out = GenerationTimedOut(
            f"the generation did not end within {budget:g} s (--max-generation-time) "
            f"after {len(self.tokens)} tokens"
        )
        if self._running is not None:
            self._running.cancel()

    @defer.inlineCallbacks
    def _run(self) -> Generator[Deferred[Any], Any, FleetOutcome]:
        pipeline = self._pipeline
        context = list(self._prompt)
        last = pipeline.stages[-1].name if pipeline.stages else ""
        kept = self._kept
        try:
            for _ in range(self._max_new):
                if self._cancelled:
                    return FleetOutcome(list(self.tokens), FINISH_CANCELLED, last, 0)
                token = yield self._next_token(context, kept, self._max_new - len(self.tokens))
                self._deliver(token, context)
                if token in pipeline.eos_ids:
                    return FleetOutcome(list(self.tokens), FINISH_EOS, last, 0)
            return FleetOutcome(list(self.tokens), FINISH_LENGTH, last, 0)
        finally:
            pipeline.release(kept)
            _log.info(
                "pipeline generation: {tokens} tokens, {forwarded} bytes of hidden states "
                "between stages",
                tokens=len(self.tokens),
                forwarded=kept.forwarded,
            )

    @defer.inlineCallbacks
    def _next_token(
        self, context: Sequence[int], kept: _Kept, left: int
    ) -> Generator[Deferred[Any], Any, int]:
        """The token after ``context`` (``left`` tokens still wanted, this one counted),
        rebuilding the stages while they fail."""
        pipeline = self._pipeline
        for attempt in range(MAX_REBUILDS + 1):
            try:
                token: int = yield pipeline.advance(context, kept, left)
                return token
            except (LinkError, PipelineError, NoNodeAvailable, RingBroken) as e:
                if self._cancelled or attempt == MAX_REBUILDS:
                    raise
                delay = REBUILD_DELAYS[min(attempt, len(REBUILD_DELAYS) - 1)]
                _log.info(
                    "pipeline stage failed ({why}): rebuilding the stages in {delay} s",
                    why=e,
                    delay=delay,
                )
                pipeline.release(kept)
                yield task.deferLater(pipeline.clock, delay, lambda: None)
                pipeline.replace_down()
        raise AssertionError("unreachable")

    def _deliver(self, token: int, context: list[int]) -> None:
        """The token to the context, and to the caller as a node sends tokens (docs/protocol.md
        section 4.4): the first at once, then 16 at a time or 200 ms after the last batch."""
        context.append(token)
        self.tokens.append(token)
        self._pending.append(token)
        if len(self.tokens) == 1 or len(self._pending) >= COALESCE_TOKENS:
            self._flush()
        elif self._flush_call is None:
            clock = self._pipeline.clock
            delay = max(0.0, self._last_flush + COALESCE_S - clock.seconds())
            self._flush_call = clock.callLater(delay, self._flush)

    def _flush(self) -> None:
        """Hand the caller the tokens not handed yet (before any result fires)."""
        call, self._flush_call = self._flush_call, None
        if call is not None and call.active():
            call.cancel()
        pending, self._pending = self._pending, []
        self._last_flush = self._pipeline.clock.seconds()
        if pending and self._on_tokens is not None:
            self._on_tokens(TokenBatch(tuple(pending)))


class PipelineFleet:
    """Runs generations across stage nodes (``--pipeline``); a backend for the HTTP API."""

    embeddings = None
    """A pipeline serves no embedding model."""

    def __init__(
        self,
        reactor: Any,
        endpoints: Sequence[str],
        *,
        boundaries: Sequence[int] | None = None,
        n_layers: int | None = None,
        eos_ids: Sequence[int] = (),
        ids: HeadIds | None = None,
        clock: IReactorTime | None = None,
        settings: FleetSettings = DEFAULT_FLEET_SETTINGS,
        spares: Sequence[str] = (),
        micro_batches: int = MICRO_BATCHES,
        sizes: StageModel | None = None,
        rings: bool = True,
    ) -> None:
        """``settings`` are the stages' :class:`Fleet`'s (token, redial cap, keepalive
        window, wall budget); ``spares`` are nodes dialed too, that take the layers of a stage
        whose link is down when a generation rebuilds its stages; the generations that keep
        stage KV step in ``micro_batches`` :class:`StepGroup` s (a new one joins the
        smallest), so that one group's rows are on one stage while another's are on the
        next.  Without ``boundaries``, the stages split ``n_layers`` evenly until every stage
        has reported, then by their memory and speed (with ``sizes``, the model's layer and
        extras' bytes: :func:`plan_stages`).  With ``rings``, a generation's steps run in
        a stage ring when every stage's node joins rings (docs/protocol.md section 12.10)."""
        if not endpoints:
            raise ValueError("a pipeline needs at least one stage")
        self.sizes: StageModel | None = None
        """The model the stages are planned for; None once planned, or given boundaries."""
        self.how = "given"
        """How the boundaries were chosen (:class:`StageReport`'s ``planned``)."""
        if boundaries is not None:
            self.boundaries = check_boundaries(boundaries, len(endpoints))
        elif n_layers is not None:
            self.boundaries = even_boundaries(n_layers, len(endpoints))
            self.sizes = sizes if sizes is not None else StageModel(n_layers)
            self.how = "even"
        else:
            raise ValueError("give the layer count or the layer boundaries of the stages")
        self.endpoints = list(endpoints)
        self.eos_ids = frozenset(eos_ids)
        self.fleet = Fleet(reactor, settings, ids=ids, clock=clock)
        self.clock: IReactorTime = clock if clock is not None else reactor
        self.stages: list[FleetNode] = []
        self.spare_endpoints = list(spares)
        self.spares: list[FleetNode] = []
        """Nodes that hold no layers, ready to take a down stage's (:meth:`replace_down`)."""
        self._sessions = 0
        """The last stage session id given (docs/protocol.md section 12.8)."""
        self.bytes_forwarded = 0
        """Hidden-state bytes sent to stages so far (what crosses between stages)."""
        self.groups = [StepGroup(self) for _ in range(max(1, micro_batches))]
        self._group_of: dict[int, StepGroup] = {}
        self.ring = StageRing(self.clock, eos_ids) if rings else None
        """The stages' ring (docs/protocol.md section 12.10); None: every step goes through
        the head."""

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` layers of each stage."""
        starts = [0, *self.boundaries[:-1]]
        return list(zip(starts, self.boundaries, strict=True))

    @defer.inlineCallbacks
    def start(self) -> Generator[Deferred[Any], Any, None]:
        """Dial every stage (a stage that does not answer is retried like any down node)."""
        self.fleet.start()
        for endpoint in self.endpoints:
            node = yield self.fleet.add_node(endpoint)
            self.stages.append(node)
        for endpoint in self.spare_endpoints:
            self.spares.append((yield self.fleet.add_node(endpoint)))
        self.plan()
        if self.how != "planned":
            self._log_ranges("")

    def _log_ranges(self, why: str) -> None:
        for node, (start, end) in zip(self.stages, self.ranges, strict=True):
            _log.info(
                "pipeline stage {node}: layers [{start}, {end}){why}",
                node=node.name,
                start=start,
                end=end,
                why=why,
            )

    def plan(self) -> None:
        """Set the boundaries by the stages' reports (:func:`plan_stages`) once every stage
        has reported, before any generation runs on them: said in the log either way, and
        the boundaries kept even until then (or for good when the reports cannot tell)."""
        sizes = self.sizes
        if sizes is None or len(self.stages) != len(self.endpoints):
            return
        boundaries, why = plan_stages(sizes, self.stages)
        if boundaries is None:
            if all(node.link.capacity is not None for node in self.stages):
                self.sizes = None
            _log.info("pipeline stages split evenly: {why}", why=why)
            return
        self.sizes = None
        self.boundaries, self.how = boundaries, "planned"
        self._log_ranges(f", planned by {why}")

    def stop(self) -> Deferred[None]:
        return self.fleet.stop()

    def _open_links(self) -> Deferred[list[NodeLink]]:
        """Every stage's link, once open; :class:`NoNodeAvailable` when one is down.  At once
        when every link is open already (every step's case: no waiter through each link's
        machine before the next request leaves)."""
        links = [node.link for node in self.stages]
        if len(links) == len(self.endpoints) and all(link.status == "open" for link in links):
            self.plan()
            return defer.succeed(links)
        return self._wait_links()

    @defer.inlineCallbacks
    def _wait_links(self) -> Generator[Deferred[Any], Any, list[NodeLink]]:
        """:meth:`_open_links` once each link's attempt under way settles."""
        if len(self.stages) != len(self.endpoints):
            raise NoNodeAvailable("the pipeline's stages are not all connected yet")
        links = []
        for node in self.stages:
            try:
                yield node.link.when_open()
            except LinkError as e:
                raise NoNodeAvailable(f"pipeline stage {node.name} is down: {e}") from e
            links.append(node.link)
        self.plan()
        return links

    @defer.inlineCallbacks
    def advance(
        self, context: Sequence[int], kept: _Kept, left: int = 1
    ) -> Generator[Deferred[Any], Any, int]:
        """The token after ``context`` (``left`` tokens still wanted, this one counted):
        through the generation's stage session when every stage keeps its KV (the positions
        it does not hold yet, in chunks; a step, when every stage joins rings and more than
        one token is wanted, through the stage ring, section 12.10), else recomputing the
        whole context (section 7.6)."""
        links: list[NodeLink] = yield self._open_links()
        keeping = all((link.features or 0) & FEATURE_STAGE_KV for link in links)
        if kept.recomputes or not keeping:
            token: int = yield self._through(links, tuple(context), kept, None, 0)
            return token
        if kept.session is None or kept.links != links:
            self.release(kept)
            self._sessions += 1
            kept.session, kept.rows, kept.links = self._sessions, 0, links
        ring = self.ring
        if ring is not None and kept.run is None and left > 1 and self._alone(kept):
            if kept.rows == len(context) - 1 and ring.join(links, self.ranges) is not None:
                self._start_run(ring, context, kept, left)
        if ring is not None and kept.run is not None:
            token = yield ring.take(kept.run)
            kept.rows += 1
            self.count_forwarded(kept, None, kept.row_bytes * (len(links) - 1))
            return token
        opening = kept.rows == 0
        try:
            while True:
                chunk = tuple(context[kept.rows : kept.rows + PREFILL_CHUNK])
                asked = self.clock.seconds()
                token = yield self._group(kept).submit(kept, chunk, kept.rows)
                kept.step_s = self.clock.seconds() - asked
                kept.rows += len(chunk)
                if kept.rows == len(context):
                    return token
        except PipelineError:
            if not opening:
                raise
        # A stage refused to open the session (all of its sessions are in use, 12.8): this
        # generation recomputes its context at every step instead.
        _log.info("a pipeline stage keeps no more sessions: a generation recomputes instead")
        self.release(kept)
        kept.recomputes = True
        token = yield self._through(links, tuple(context), kept, None, 0)
        return token

    @defer.inlineCallbacks
    def _through(
        self,
        links: Sequence[NodeLink],
        tokens: tuple[int, ...],
        kept: _Kept,
        session: int | None,
        position: int,
    ) -> Generator[Deferred[Any], Any, int]:
        """``tokens`` through every stage (at ``position`` of ``session`` when one is given)
        until one answers a token; the hidden bytes sent count in ``kept``."""
        hidden: bytes | None = None
        for i, (link, (start, end)) in enumerate(zip(links, self.ranges, strict=True)):
            response: StageForwardRespMsg = yield link.stage_forward(
                tokens if i == 0 else (), start, end, hidden, session, position
            )
            self.count_forwarded(kept, hidden)
            answer = _answer(True, response, link.name, start, end)
            if isinstance(answer, PipelineError):
                raise answer
            if isinstance(answer, int):
                return answer
            assert isinstance(answer, bytes)
            hidden = answer
        raise PipelineError("no stage answered a token (the last boundary is below n_layers?)")

    def replace_down(self) -> None:
        """Give the layers of each stage whose link is down to a spare whose link is up (the
        down node becomes a spare); the generations rebuild their stages there."""
        for i, node in enumerate(self.stages):
            if node.link.connected:
                continue
            spare = next((s for s in self.spares if s.link.connected), None)
            if spare is None:
                return
            self.spares.remove(spare)
            self.spares.append(node)
            self.stages[i] = spare
            start, end = self.ranges[i]
            _log.info(
                "pipeline stage {down} is down: its layers [{start}, {end}) go to {spare}",
                down=node.name,
                start=start,
                end=end,
                spare=spare.name,
            )

    def count_forwarded(self, kept: _Kept, hidden: bytes | None, more: int = 0) -> None:
        """Hidden-state bytes sent to a stage (and ``more``, what a ring step sent between
        stages), for the generation and the pipeline."""
        self.bytes_forwarded += len(hidden or b"") + more
        kept.forwarded += len(hidden or b"") + more

    def _alone(self, kept: _Kept) -> bool:
        """Whether ``kept``'s generation is the only one stepping: no ring run under way and
        no other generation in the step groups.  Only such a generation runs its steps in
        the ring (docs/protocol.md section 12.10): the generations of a step group go
        through every stage together, one pass for all their rows, while rows that enter a
        ring at different times travel it as separate passes (measured at eight streams on
        two stages: 1.19 of one node in the ring against 1.38 through the head)."""
        key = id(kept)
        running = self.ring is not None and self.ring.running
        return not running and not any(g.members - {key} for g in self.groups)

    def _start_run(self, ring: StageRing, context: Sequence[int], kept: _Kept, left: int) -> None:
        """``kept``'s next steps to the ring (:meth:`StageRing.start`); the generation leaves
        its step group while the ring runs them."""
        group = self._group_of.pop(id(kept), None)
        if group is not None:
            group.leave(kept)
        assert kept.session is not None
        kept.run = ring.start(kept.session, kept.rows, context[-1], left, kept.step_s)

    def _group(self, kept: _Kept) -> StepGroup:
        """The step group of ``kept``'s generation (a new one joins the smallest)."""
        group = self._group_of.get(id(kept))
        if group is None:
            group = min(self.groups, key=lambda g: len(g.members))
            self._group_of[id(kept)] = group
        return group

    def release(self, kept: _Kept) -> None:
        """Close a generation's stage session on every stage whose link is up (12.8); it
        leaves its step group."""
        group = self._group_of.pop(id(kept), None)
        if group is not None:
            group.leave(kept)
        if kept.run is not None and self.ring is not None and kept.session is not None:
            self.ring.end(kept.session, "the generation released its stage sessions")
        kept.run = None
        session, links = kept.session, kept.links
        kept.session, kept.rows, kept.links = None, 0, []
        if session is None:
            return
        for link in links:
            if (link.features or 0) & FEATURE_STAGE_KV:
                link.send_now(StageReleaseMsg(session))

    def generate(
        self, request: HeadRequest, on_tokens: TokenSink | None = None
    ) -> PipelineGeneration:
        """Generate ``request.max_new`` greedy tokens (sampling parameters do not apply here):
        the :meth:`~sfnode.head.fleet.backend.Backend.generate` of a pipeline.

        Each generation runs on every stage (the stages batch the ones they carry); there is
        no lane to keep, so neither the request class nor the requester changes anything
        here.  Stage forwards
        return tokens, not distributions: a request for logprobs fails with
        :class:`~sfnode.head.fleet.backend.LogprobsUnavailable`; stage forwards carry no
        constraint (docs/protocol.md section 12.3): one fails with
        :class:`~sfnode.head.fleet.backend.ConstraintsUnavailable`."""
        generation = PipelineGeneration(self, request.prompt, request.max_new, on_tokens)
        if request.params.logprobs:
            generation.result.errback(LogprobsUnavailable("a pipeline returns no logprobs"))
            return generation
        if request.constraint is not None:
            generation.result.errback(
                ConstraintsUnavailable("a pipeline does not honour constraints")
            )
            return generation
        generation._start()
        return generation

    def status(self, model: str | None = None) -> BackendStatus:
        """The status of the fleet that keeps the stage links, with the stages' layers."""
        return replace(self.fleet.status(model), stages=self.plan_report())

    def plan_report(self) -> tuple[StageReport, ...]:
        """Each stage's node and layers ``[start, end)`` now."""
        return tuple(
            StageReport(i, node.name, start, end, self.how)
            for i, (node, (start, end)) in enumerate(zip(self.stages, self.ranges, strict=False))
        )
