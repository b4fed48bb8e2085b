"""The pipeline driver (docs/protocol.md section 7.6): each generation runs across stage nodes,
layer range by range.

P stage nodes split ``n_layers`` layers: evenly (``boundary[i] = ((i+1)·n_layers) // P``) or at
boundaries given by the operator.  Per generated token, stage 0 gets the full context and no
hidden state, stage i > 0 gets no tokens and the previous stage's hidden state; the first stage
that answers with a token ends the step.  The token is appended and the step repeats, recomputing
the whole context each time (no KV cache, greedy).

The stage nodes are kept in a :class:`~sfnode.head.fleet.fleet.Fleet` of their own, so they are
dialed, kept alive, redialled and reported (health, metrics) like any fleet's nodes, but never
placed on: a pipeline needs all of its stages.  A step whose stage is reconnecting waits for that
attempt; a stage that cannot be reached fails the generation (:class:`NoNodeAvailable`).  A
generation has the fleet's wall budget (``max_generation_s``): past it the step in flight is
abandoned and the generation fails with :class:`~sfnode.head.fleet.backend.GenerationTimedOut`.

This module must never block, never use the global reactor, and never hand a caller a token twice
or a token computed from a context it did not ask for.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

from twisted.internet import defer
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
)
from sfnode.head.fleet.fleet import DEFAULT_FLEET_SETTINGS, Fleet, FleetNode, FleetSettings
from sfnode.head.link import HeadIds, LinkError
from sfnode.linkf.wire import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_LENGTH,
    StageForwardRespMsg,
)

_log = Logger(namespace="sfnode.head.fleet.pipeline")


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

    def when_placed(self) -> Deferred[None]:
        """A pipeline needs no placement: fires at once."""
        return defer.succeed(None)

    def cancel(self) -> None:
        """Stop after the step in flight; ``result`` then says CANCELLED."""
        self._cancelled = True

    def park(self) -> None:
        """A pipeline's steps hold no lane between them (each recomputes the whole context,
        docs/protocol.md section 8.6): there is none to give back, and it goes on."""

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
        for _ in range(self._max_new):
            if self._cancelled:
                return FleetOutcome(list(self.tokens), FINISH_CANCELLED, last, 0)
            token = yield pipeline.step(context)
            context.append(token)
            self.tokens.append(token)
            if self._on_tokens is not None:
                self._on_tokens(TokenBatch((token,)))
            if token in pipeline.eos_ids:
                return FleetOutcome(list(self.tokens), FINISH_EOS, last, 0)
        return FleetOutcome(list(self.tokens), FINISH_LENGTH, last, 0)


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
    ) -> None:
        """``settings`` are the stages' :class:`Fleet`'s (token, redial cap, keepalive
        window, wall budget)."""
        if not endpoints:
            raise ValueError("a pipeline needs at least one stage")
        if boundaries is not None:
            self.boundaries = check_boundaries(boundaries, len(endpoints))
        elif n_layers is not None:
            self.boundaries = even_boundaries(n_layers, len(endpoints))
        else:
            raise ValueError("give the layer count or the layer boundaries of the stages")
        self.endpoints = list(endpoints)
        self.eos_ids = frozenset(eos_ids)
        self.fleet = Fleet(reactor, settings, ids=ids, clock=clock)
        self.clock: IReactorTime = clock if clock is not None else reactor
        self.stages: list[FleetNode] = []

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
        for node, (start, end) in zip(self.stages, self.ranges, strict=True):
            _log.info(
                "pipeline stage {node}: layers [{start}, {end})",
                node=node.name,
                start=start,
                end=end,
            )

    def stop(self) -> Deferred[None]:
        return self.fleet.stop()

    @defer.inlineCallbacks
    def step(self, context: Sequence[int]) -> Generator[Deferred[Any], Any, int]:
        """One token: the context through every stage until one answers a token."""
        if len(self.stages) != len(self.endpoints):
            raise NoNodeAvailable("the pipeline's stages are not all connected yet")
        hidden: bytes | None = None
        for i, (node, (start, end)) in enumerate(zip(self.stages, self.ranges, strict=True)):
            try:
                yield node.link.when_open()
            except LinkError as e:
                raise NoNodeAvailable(f"pipeline stage {node.name} is down: {e}") from e
            link = node.link
            response: StageForwardRespMsg = yield link.stage_forward(
                tuple(context) if i == 0 else (), start, end, hidden
            )
            if response.token is not None:
                return int(response.token)
            if response.hidden is None:
                raise PipelineError(
                    f"stage {node.name} answered nothing for layers [{start}, {end}): the "
                    "engine lacks staged forward, or the layers are out of its range"
                )
            hidden = response.hidden
        raise PipelineError("no stage answered a token (the last boundary is below n_layers?)")

    def generate(
        self, request: HeadRequest, on_tokens: TokenSink | None = None
    ) -> PipelineGeneration:
        """Generate ``request.max_new`` greedy tokens (sampling parameters do not apply here):
        the :meth:`~sfnode.head.fleet.backend.Backend.generate` of a pipeline.

        A pipeline runs one generation at a time on its stages: there is no lane to keep, so
        neither the request class nor the requester changes anything here.  Stage forwards
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
        """The status of the fleet that keeps the stage links."""
        return self.fleet.status(model)
