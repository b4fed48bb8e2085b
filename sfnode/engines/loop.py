"""The engine loop: what joins the scheduler to a runner, for the transformers engine and the mock
engine alike (docs/engine.md section 3).

:class:`EngineLoop` takes the node's generations (:meth:`EngineLoop.submit`), hands them to the
pure :class:`~sfnode.engines.scheduling.scheduler.Scheduler`, sends each step's plan to its
:class:`Worker` (which runs the engine's runner: on a worker thread for the transformers engine,
on the reactor after a pretend step time for the mock), and when a step's output comes back has
the scheduler plan the next step (sent off at once) before it hands the tokens and ends to the
generations, so that handing them over overlaps the next step's computation.  Cancelling,
deadlines, KV block accounting and statistics are plain reactor-side bookkeeping with no locks.

A constrained request's :class:`~sfnode.decoding.constraint.LaneStage` is prepared by the worker
(compiling a grammar can take 100 ms: the transformers engine does it on a thread of its own)
before the request queues, with the tokens the lane may draw (its ``max_new`` within the
window), so that its masks close the output within them (docs/engine.md section 2.4).

This module must never import torch, touch a model or a thread itself (the worker does), never
let one generation's failure stop the engine (a failed step fails the lanes it carried and the
engine goes on), and never call a generation's ``on_tokens`` after it was cancelled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.decoding.constraint import ConstraintError, LaneStage, Vocabulary
from sfnode.engines.config import EngineConfig
from sfnode.engines.scheduling.drafts import Speculation
from sfnode.engines.scheduling.pace import RateEstimator, StepCost
from sfnode.engines.scheduling.plan import StepOutput, StepPlan
from sfnode.engines.scheduling.prefix_cache import PrefixCache
from sfnode.engines.scheduling.scheduler import (
    Emitted,
    Ended,
    Request,
    Scheduler,
    blocks_for,
)
from sfnode.engines.scheduling.stages import KeptRows, StageSessions
from sfnode.generation import (
    EngineRefusal,
    EngineStatistics,
    EngineStop,
    GenerationRequest,
    GenerationResult,
    MaskFigures,
    PrefixFigures,
    StageForward,
    StageForwardError,
    StageResult,
    StreamTooLong,
    TokenBatch,
    TokenLogprob,
    TokenSink,
)
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS

if TYPE_CHECKING:
    from sfnode.generation import Generation

log = Logger(namespace="sfnode.engines.loop")

T = TypeVar("T")


class Runner(Protocol):
    """What executes a step's plan and a pipeline stage (a model runner, or the mock's)."""

    def run(self, plan: StepPlan) -> StepOutput: ...

    def stage(self, tokens: Sequence[int], start: int, end: int, hidden_in: Any) -> StageResult: ...


class StageKeeper(Protocol):
    """What computes kept pipeline stages (docs/protocol.md section 12.8) on the worker: rows
    of a slot of its own KV."""

    slots: int
    prefix_figures: PrefixFigures | None
    """Its prefix pools' figures (docs/engine.md section 4), summed; None: it reuses none.
    Replaced whole on the worker, read on the reactor."""

    def read_rows(self, blob: bytes) -> Any:
        """The rows of a hidden blob; :class:`StageForwardError` for a malformed one."""

    def forward(self, batch: Sequence[KeptRows]) -> list[StageResult | StageForwardError]:
        """Each request's answer, or the error that stopped it, in order."""


class Worker(Protocol):
    """Where an engine's runner executes: a worker thread, or the reactor itself."""

    def start(self) -> None:
        """Before the first step (start a thread, check the runner)."""

    def step(self, plan: StepPlan) -> defer.Deferred[tuple[StepOutput, float]]:
        """Run ``plan`` on the runner; fires on the reactor thread with its output and the
        seconds it took, or fails with what the runner raised."""

    def call(self, work: Callable[..., T], *args: Any) -> defer.Deferred[T]:
        """Run ``work(*args)`` where the steps run, between them (a pipeline stage)."""

    def compile_grammar(self, work: Callable[..., T], *args: Any) -> defer.Deferred[T]:
        """Run ``work(*args)`` (a constrained request's :meth:`LaneStage.prepare`, which
        compiles its grammar) where grammars are compiled, off the steps' way."""

    def rest(self) -> None:
        """The engine has run out of work: give back what only steps need (where the steps
        run, never during one; a worker may wait a while, and not give back when a step
        comes first)."""

    def interrupt(self) -> None:
        """The engine stops: end the step in flight now if that can be done (its Deferred then
        fails), else let it finish."""

    def stop(self) -> None:
        """No step is in flight and none will come: release what the worker holds."""


@dataclass(frozen=True)
class RunnerTraits:
    """What an engine's model and runner are: the facts the loop sizes itself by."""

    n_layers: int
    vocab_size: int
    eos_ids: frozenset[int]
    context_ids: int = 0
    """A context's token ids must be below this (refused otherwise); 0: ``vocab_size``."""
    model_window: int = 0
    """The model's own context window; 0: none (the configuration then gives one)."""
    salt: bytes = b""
    """What a block's KV depends on besides its tokens (the prefix cache's keys start from it)."""
    block_copies: bool = False
    """The runner executes a plan's block loads and saves: a prefix cache can be kept."""
    drafts: bool = False
    """The runner verifies drafted tokens: speculative decoding can be on."""
    timed: bool = True
    """A step's duration is measured (steps may be sized in time, docs/engine.md section 3);
    False: the steps take no real time and are sized in tokens only."""


def prefix_pool_blocks(config: EngineConfig, traits: RunnerTraits) -> int:
    """The blocks of a prefix pool (the lanes', and each of a stage's): what the configuration
    gives beside its KV blocks, where the runner can copy blocks; 0: none."""
    _, kv_blocks = config.kv_sizes(traits.model_window)
    return config.prefix_blocks(kv_blocks) if traits.block_copies else 0


class EngineGeneration:
    """The node's handle on one generation of an :class:`EngineLoop`; lives on the reactor
    thread."""

    def __init__(self, cancel: Callable[[Request], None], on_tokens: TokenSink) -> None:
        self._cancel_request = cancel
        self._on_tokens = on_tokens
        self._delivered: list[int] = []
        self._cancelled = False
        self._result: defer.Deferred[GenerationResult] = defer.Deferred(lambda _d: self.cancel())
        self.request: Request | None = None
        """Its request, once it is queued in the scheduler."""
        self.preparing = False
        """Its constraint's stage is being prepared; it queues when that is done."""

    @property
    def result(self) -> defer.Deferred[GenerationResult]:
        return self._result

    def cancel(self) -> None:
        if self._result.called or self._cancelled:
            return
        self._cancelled = True
        if self.request is not None:
            self._cancel_request(self.request)
        elif self.preparing:
            self.finish(EngineStop.CANCELLED)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def deliver(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        if self._result.called or self._cancelled:
            return
        self._delivered.extend(tokens)
        try:
            batch = TokenBatch(tuple(tokens), None if logprobs is None else tuple(logprobs))
            self._on_tokens(batch)
        except Exception:
            log.failure("on_tokens raised; cancelling the generation")
            self.cancel()

    def finish(self, stop: EngineStop, closed: bool = False) -> None:
        """It ended with ``stop`` (``closed``: its budget closed its grammar's output)."""
        if self._result.called:
            return
        if self._cancelled:
            stop, closed = EngineStop.CANCELLED, False
        self._result.callback(GenerationResult(tuple(self._delivered), stop, closed))

    def fail(self, error: BaseException) -> None:
        if self._result.called:
            return
        if self._cancelled:
            self._result.callback(GenerationResult(tuple(self._delivered), EngineStop.CANCELLED))
        else:
            self._result.errback(error)


def check_stage(forward: StageForward, n_layers: int, running: bool) -> None:
    """:raises StageForwardError: bad layer bounds, no input, or a stopped engine."""
    if not 0 <= forward.start_layer <= forward.end_layer <= n_layers:
        raise StageForwardError(
            f"bad layer bounds [{forward.start_layer}, {forward.end_layer}) for {n_layers} layers"
        )
    if forward.hidden_in is None and (forward.start_layer != 0 or not forward.tokens):
        raise StageForwardError("a stage without hidden input must start at layer 0 with tokens")
    if not running:
        raise StageForwardError("the engine is stopped")


def _stage_failed(failure: Failure) -> Failure:
    """A stage forward's failure as a :class:`StageForwardError` (logged when unexpected)."""
    if isinstance(failure.value, StageForwardError):
        return failure
    raise _stage_error(failure)


_UNANSWERED = StageForwardError("not answered")
"""A claimed request's place in its answers until the worker's batch answers it."""


def _only(answers: StageAnswers) -> StageResult:
    """A one-request batch's answer, or its error raised."""
    (answer,) = answers
    if isinstance(answer, StageForwardError):
        raise answer
    return answer


def _stage_error(failure: Failure) -> StageForwardError:
    if isinstance(failure.value, StageForwardError):
        return failure.value
    log.failure("stage forward failed", failure)
    return StageForwardError(f"stage forward failed: {failure.value}")


class EngineLoop:
    """The reactor side of an engine (see the module): the engines are this loop with a runner
    and a worker of their own (:class:`~sfnode.engines.mock.MockEngine`,
    :class:`~sfnode.engines.transformers_engine.TransformersEngine`)."""

    def __init__(
        self,
        config: EngineConfig,
        traits: RunnerTraits,
        runner: Runner,
        worker: Worker,
        *,
        clock: Callable[[], float],
        vocabulary: Vocabulary | None = None,
        supports_logprobs: bool = True,
        stages: StageKeeper | None = None,
    ) -> None:
        """``clock`` reads the seconds deadlines are kept in; ``vocabulary`` lets the engine
        honour grammars (docs/engine.md section 2.4); ``stages`` lets pipeline stages keep
        their KV (docs/protocol.md section 12.8)."""
        self.config = config
        self._window, kv_blocks = config.kv_sizes(traits.model_window)
        self._traits = traits
        prefix_blocks = prefix_pool_blocks(config, traits)
        self.prefix_cache = PrefixCache(prefix_blocks) if prefix_blocks else None
        """The prefix cache's index, when the configuration and the runner keep one."""
        self.scheduler = Scheduler(
            lanes=config.max_lanes,
            kv_blocks=kv_blocks,
            prefill_chunk=config.prefill_chunk,
            step_tokens=config.step_tokens,
            prefix=self.prefix_cache,
            salt=traits.salt,
            interactive_lanes=config.interactive_lanes,
            speculation=(
                Speculation(draft_tokens=config.draft_tokens)
                if config.speculative == "ngram" and traits.drafts
                else None
            ),
            step_ms=config.step_ms if traits.timed else 0.0,
        )
        self.runner = runner
        self.worker = worker
        self.pace = RateEstimator()
        """What a step takes here, fitted to the steps measured (docs/engine.md section 3)."""
        self.vocabulary = vocabulary
        """The model's vocabulary for grammars; None: the engine honours no grammar."""
        self._clock = clock
        self.clock = clock
        """The seconds the loop's deadlines (and stage sessions' idleness) are kept in."""
        self._supports_logprobs = supports_logprobs
        self.kept_stages = (
            StageDriver(self, stages, StageSessions(stages.slots, self._window))
            if stages is not None and stages.slots > 0
            else None
        )
        """Stage sessions that keep their KV (docs/protocol.md section 12.8), or None."""
        self.refusal: str | None = None
        """Why it refuses all work now (a failed start-up check: docs/engine.md section 4.1)."""
        self._started = False
        self._stopping = False
        self._stepping = False
        self._worked = False  # a step ran since the worker last rested
        self._stopped = False
        self._stop_waiters: list[defer.Deferred[None]] = []

    # -- what the node reads (reactor thread) -----------------------------------------------

    @property
    def context_window(self) -> int:
        return self._window

    @property
    def n_layers(self) -> int:
        return self._traits.n_layers

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._traits.eos_ids

    @property
    def supports_logprobs(self) -> bool:
        """Token logprobs are computed for generations that ask (docs/protocol.md 12.1)."""
        return self._supports_logprobs

    @property
    def supports_constraints(self) -> bool:
        """Constraints are honoured when the engine has the model's vocabulary, docs/protocol.md
        section 12.3."""
        return self.vocabulary is not None

    @property
    def speculation(self) -> Speculation | None:
        """How the scheduler drafts, or None (docs/engine.md section 3.1)."""
        return self.scheduler.speculation

    def mask_figures(self) -> MaskFigures | None:
        """The grammar masks computed so far (docs/engine.md section 2.4); None: the engine
        computes none."""
        return None

    def statistics(self) -> EngineStatistics:
        scheduler = self.scheduler
        counts = scheduler.counts
        prefix = self.prefix_cache
        stages = self.kept_stages
        return EngineStatistics(
            decoded_tokens=counts.decoded,
            prefilled_tokens=counts.prefilled,
            queue_depth=len(scheduler.waiting),
            lanes_active=len(scheduler.running),
            kv_blocks_used=scheduler.kv_blocks_used,
            kv_blocks_total=scheduler.kv_blocks,
            steps=counts.figures(speculative=scheduler.speculation is not None),
            prefix=None if prefix is None else prefix.stats,
            stage_prefix=None if stages is None else stages.prefix_figures,
            masks=self.mask_figures(),
        )

    # -- generations ------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, on_tokens: TokenSink) -> EngineGeneration:
        handle = EngineGeneration(self._cancel, on_tokens)
        context = tuple(int(t) for t in request.context)
        refusal = self._refusal(context)
        if refusal is not None:
            handle.fail(refusal)
            return handle
        if request.max_new <= 0 or len(context) >= self._window:
            handle.finish(EngineStop.LENGTH)
            return handle
        job = self._request(handle, request, context)
        constraint = request.constraint
        if constraint is None:
            self._queue(handle, job)
        elif constraint.grammar is not None and self.vocabulary is None:
            handle.fail(EngineRefusal("this engine has no vocabulary for grammars"))
        else:
            handle.preparing = True
            # What the lane may still draw: its grammar's masks close the output within it.
            budget = min(job.max_new, job.token_limit - len(context))
            # Controls alone have nothing to compile: prepared at once, on the reactor.
            grammar = constraint.grammar is not None
            where = self.worker.compile_grammar if grammar else defer.maybeDeferred
            prepared = where(LaneStage.prepare, self.vocabulary, constraint, context, budget)
            prepared.addCallbacks(
                self._prepared, self._unprepared, callbackArgs=(handle, job), errbackArgs=(handle,)
            )
        return handle

    def _refusal(self, context: tuple[int, ...]) -> BaseException | None:
        """Why a generation of ``context`` cannot run here, or None."""
        if self.refusal is not None:
            return EngineRefusal(f"this node withdrew: {self.refusal}")
        if not context:
            return EngineRefusal("the context is empty; there is nothing to extend")
        if len(context) > self._window:
            return StreamTooLong(len(context), self._window)
        if self._stopping:
            return RuntimeError("the engine is stopped")
        vocab = self._traits.context_ids or self._traits.vocab_size
        if min(context) < 0 or max(context) >= vocab:
            bad = next(t for t in context if not 0 <= t < vocab)
            return EngineRefusal(f"token id {bad} is outside the vocabulary of {vocab}")
        return None

    def _request(
        self, handle: EngineGeneration, request: GenerationRequest, context: tuple[int, ...]
    ) -> Request:
        """The scheduler's view of ``request``: its KV reservation, token limit and deadline."""
        limit = min(len(context) + request.max_new, self._window)
        reserve = min(blocks_for(limit), self.scheduler.kv_blocks)
        wall = request.max_wall_ms
        return Request(
            handle=handle,
            context=context,
            params=request.params,
            max_new=request.max_new,
            token_limit=min(limit, reserve * KV_BLOCK_TOKENS),
            reserve_blocks=reserve,
            eos_ids=self._traits.eos_ids,
            deadline=self._clock() + wall / 1000.0 if wall > 0 else None,
            interactive=request.interactive,
        )

    def _queue(self, handle: EngineGeneration, job: Request) -> None:
        handle.request = job
        self.scheduler.submit(job)
        self._kick()

    def _prepared(self, stage: LaneStage, handle: EngineGeneration, job: Request) -> None:
        handle.preparing = False
        if handle.cancelled or handle.result.called:
            return
        if self._stopping:
            handle.finish(EngineStop.CANCELLED)
            return
        job.stage = stage
        self._queue(handle, job)

    def _unprepared(self, failure: Failure, handle: EngineGeneration) -> None:
        handle.preparing = False
        if isinstance(failure.value, ConstraintError):
            handle.fail(EngineRefusal(f"the constraint cannot be honoured: {failure.value}"))
        else:
            handle.fail(failure.value if failure.value is not None else RuntimeError("failed"))

    def _cancel(self, request: Request) -> None:
        self.scheduler.cancel(request)
        self._kick()

    # -- pipeline stages (docs/protocol.md section 7.6) -------------------------------------

    def stage_forward(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> defer.Deferred[StageResult]:
        try:
            forward = StageForward(tuple(tokens), start_layer, end_layer, hidden_in)
            check_stage(forward, self._traits.n_layers, self._started and not self._stopping)
            hidden = None if hidden_in is None else self.read_hidden(hidden_in)
        except StageForwardError as e:
            return defer.fail(e)
        d = self.worker.call(
            self.runner.stage, [int(t) for t in tokens], start_layer, end_layer, hidden
        )
        d.addErrback(_stage_failed)
        return d

    def read_hidden(self, blob: bytes) -> Any:
        """A stage's hidden input as the runner takes it.

        :raises StageForwardError: the blob is malformed or mis-sized."""
        raise StageForwardError("this engine runs no pipeline stages")

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.worker.start()
        self._kick()

    def stop(self) -> defer.Deferred[None]:
        """Cancel everything, end the step in flight (or wait for it), stop the worker."""
        done: defer.Deferred[None] = defer.Deferred()
        if self._stopped:
            done.callback(None)
            return done
        self._stop_waiters.append(done)
        if not self._stopping:
            self._stopping = True
            self._deliver([], self.scheduler.abandon())
            if self._stepping:
                self.worker.interrupt()
            else:
                self._stopped_now()
        return done

    def _stopped_now(self) -> None:
        self.worker.stop()
        self._stopped = True
        waiters, self._stop_waiters = self._stop_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    # -- steps (reactor thread) ---------------------------------------------------------------

    def _kick(self) -> None:
        """Send off the next step if none is running and there is something to do."""
        if self._stepping or self._stopping or not self._started:
            return
        plan, ended = self.scheduler.plan(self._clock(), self.pace.rates)
        if plan.empty and self._worked:
            self._worked = False
            self.worker.rest()
        if not plan.empty:
            self._stepping = self._worked = True
            d = self.worker.step(plan)
            d.addCallbacks(
                self._step_done, self._step_failed, callbackArgs=(plan,), errbackArgs=(plan,)
            )
            d.addErrback(lambda failure: log.failure("the engine's step handling failed", failure))
        self._deliver([], ended)

    def _step_done(self, result: tuple[StepOutput, float], plan: StepPlan) -> None:
        self._stepping = False
        if self._stopping:
            self._stopped_now()
            return
        output, seconds = result
        if self._traits.timed and (plan.decode or plan.chunks):
            self.pace.observe(StepCost.of(plan), seconds)
        emitted, ended = self.scheduler.complete(plan, output)
        self._kick()
        self._deliver(emitted, ended)

    def _step_failed(self, failure: Failure, plan: StepPlan) -> None:
        self._stepping = False
        if self._stopping:
            self._stopped_now()
            return
        log.failure(
            "an engine step failed; its {n} generations fail, the engine keeps serving",
            failure,
            n=len(plan.decode) + len(plan.chunks),
        )
        error = failure.value if failure.value is not None else RuntimeError("step failed")
        ended = self.scheduler.fail(plan, error)
        self._kick()
        self._deliver([], ended)

    def _deliver(self, emitted: Sequence[Emitted], ended: Sequence[Ended]) -> None:
        """Hand tokens to their generations (one call per generation per step), then ends."""
        batches: dict[int, tuple[EngineGeneration, list[int], list[TokenLogprob]]] = {}
        for request, token, logprob in emitted:
            handle: EngineGeneration = request.handle
            _, tokens, logprobs = batches.setdefault(id(handle), (handle, [], []))
            tokens.append(token)
            if logprob is not None:
                logprobs.append(logprob)
        for handle, tokens, logprobs in batches.values():
            asked = (
                self._supports_logprobs
                and handle.request is not None
                and handle.request.params.logprobs > 0
            )
            handle.deliver(tokens, logprobs if asked else None)
        for request, stop, error, closed in ended:
            handle = request.handle
            if error is not None:
                handle.fail(error)
            else:
                assert stop is not None
                handle.finish(stop, closed)


if TYPE_CHECKING:

    def _conforms(generation: EngineGeneration) -> Generation:
        """mypy checks here that the handle implements the node's protocol."""
        return generation


StageAnswers = list[StageResult | StageForwardError]
"""A batch's answers, one per request in order: its result, or the error that refused it."""


@dataclass
class _Waiting:
    """The requests of one :meth:`StageDriver.forward_all` waiting for the worker: the
    ``(index, rows, session)`` of each that was claimed, and the answers so far (the refused
    requests' errors are in already)."""

    owner: Hashable
    rows: list[tuple[int, KeptRows, int]]
    answers: list[StageResult | StageForwardError]
    answered: defer.Deferred[StageAnswers]


class StageDriver:
    """An engine loop's stage sessions that keep their KV (docs/protocol.md section 12.8): the
    sessions' table on the reactor thread, their rows computed by ``stages`` on the loop's
    worker.  A batch takes, when the worker starts it, every request that has arrived by then
    (one pass over the weights for the generations a stage carries); the requests that arrive
    while it runs go together in the next."""

    def __init__(self, loop: EngineLoop, stages: StageKeeper, sessions: StageSessions) -> None:
        self._loop = loop
        self._stages = stages
        self.sessions = sessions
        self._lock = threading.Lock()
        self._waiting: list[_Waiting] = []
        """Appended on the reactor thread, taken by the worker (under the lock)."""
        self._called = False
        """A batch is asked of the worker and has not taken its requests yet."""

    def forward(
        self, owner: Hashable, session: int, position: int, forward: StageForward
    ) -> defer.Deferred[StageResult]:
        """``forward`` against ``owner``'s stage ``session`` from ``position``; fails with
        :class:`StageForwardError`, and the session is then dropped."""
        return self.forward_all(owner, [(session, position, forward)]).addCallback(_only)

    def forward_all(
        self, owner: Hashable, requests: Sequence[tuple[int, int, StageForward]]
    ) -> defer.Deferred[StageAnswers]:
        """Each ``(session, position, forward)`` against ``owner``'s stage sessions, all in
        the same batch (the worker is asked once every one of them waits: STAGE_BATCH_REQ,
        section 12.8); fires with each request's answer in order, a refused request's
        :class:`StageForwardError` (its session then dropped) among them."""
        answers: list[StageResult | StageForwardError] = []
        claimed = []
        for index, (session, position, forward) in enumerate(requests):
            rows = self._claim(owner, session, position, forward)
            answers.append(rows if isinstance(rows, StageForwardError) else _UNANSWERED)
            if isinstance(rows, KeptRows):
                claimed.append((index, rows, session))
        if not claimed:
            return defer.succeed(answers)
        answered: defer.Deferred[StageAnswers] = defer.Deferred()
        with self._lock:
            self._waiting.append(_Waiting(owner, claimed, answers, answered))
        self._ask()
        return answered

    def _claim(
        self, owner: Hashable, session: int, position: int, forward: StageForward
    ) -> KeptRows | StageForwardError:
        """``forward``'s rows in ``owner``'s ``session``, checked; the error refuses it (the
        session dropped)."""
        loop, stages = self._loop, self._stages
        try:
            check_stage(forward, loop.n_layers, loop._started and not loop._stopping)
            if forward.start_layer == forward.end_layer:
                raise StageForwardError("a kept stage runs at least one layer")
            rows = None if forward.hidden_in is None else stages.read_rows(forward.hidden_in)
            count = len(forward.tokens) if rows is None else len(rows)
            layers = (forward.start_layer, forward.end_layer)
            slot = self.sessions.claim(owner, session, position, count, layers, loop.clock())
        except StageForwardError as e:
            self.sessions.drop(owner, session)
            return e
        return KeptRows(slot, position, forward.tokens, rows, *layers)

    def _ask(self) -> None:
        """Ask the worker for a batch, unless one is asked already or nothing waits."""
        with self._lock:
            if self._called or not self._waiting:
                return
            self._called = True
        self._loop.worker.call(self._batch).addCallbacks(self._answered, self._failed)

    def _batch(self) -> tuple[list[_Waiting], StageAnswers]:
        """On the worker: every request waiting, computed together."""
        with self._lock:
            batch, self._waiting = self._waiting, []
            self._called = False
        kept = [rows for waiting in batch for _, rows, _ in waiting.rows]
        try:
            return batch, self._stages.forward(kept)
        except Exception as e:
            log.failure("kept stage forward failed")
            error = StageForwardError(f"stage forward failed: {e}")
            return batch, [error for _ in kept]

    def _answered(self, done: tuple[list[_Waiting], StageAnswers]) -> None:
        batch, results = done
        computed = iter(results)
        for waiting in batch:
            for index, _, session in waiting.rows:
                answer = next(computed)
                if isinstance(answer, StageForwardError):
                    self.sessions.drop(waiting.owner, session)
                waiting.answers[index] = answer
            waiting.answered.callback(waiting.answers)

    def _failed(self, failure: Failure) -> None:
        """The worker could not run the batch (it stopped): every request waiting fails."""
        with self._lock:
            batch, self._waiting = self._waiting, []
            self._called = False
        error = _stage_error(failure)
        for waiting in batch:
            for index, _, session in waiting.rows:
                self.sessions.drop(waiting.owner, session)
                waiting.answers[index] = error
            waiting.answered.callback(waiting.answers)

    @property
    def prefix_figures(self) -> PrefixFigures | None:
        """The stages' prefix pools' figures (:attr:`StageKeeper.prefix_figures`)."""
        return self._stages.prefix_figures

    def release(self, owner: Hashable, session: int | None = None) -> None:
        """Forget ``owner``'s stage ``session``, or all of its sessions."""
        self.sessions.drop(owner, session)
