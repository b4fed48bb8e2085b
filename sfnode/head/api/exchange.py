"""One completion request's life in the head: body in, ``n`` generations, text or chunks out.

An :class:`Exchange` goes through six phases, and only the moves listed in :data:`MOVES`::

    preparing --placed--> placed --streamed--> streaming <--resumed-- away
        |                   |                      |  --dropped-->  |
        +------answered-----+------answered--------+----------------+--> done
        +------lost---------+------lost------------+----------------+--> gone

*preparing*: the body is checked and its prompt rendered (:mod:`sfnode.head.api.schema`,
:mod:`sfnode.head.models.text`); *placed*: the generations were handed to the backend, nothing is
written yet; *streaming*: the event-stream headers are out and chunks flow; *done*: the whole
answer (or an error) is written and the request finished; *gone*: the client went away or was
cut off, nothing more is written; *away*: a stream's client dropped mid-stream and may come
back with ``Last-Event-ID`` within ``--resume-grace`` (:mod:`sfnode.head.api.resume`): its
generations are parked, its events kept, and the grace's end is ``lost``.  ``lost`` in *done*
or *gone* is a deliberate no-op (the connection closes after the answer, or after the stall
timer cut it).

The phases are a small explicit state class rather than an Automat machine.  The exchange's
outputs write to a twisted.web request, and a write can re-enter the exchange synchronously:
the connection's loss fires the request's finish errback, which is the ``lost`` input.  Automat
postpones such an input until the running outputs finish, but the rest of those outputs must
already see *gone* and write nothing (a stream writes chunk after chunk in one output).  So the
phase changes at once, in one method (``_move``) that checks each move against :data:`MOVES`
and traces it (``exchange ... [old].input -> [new]`` at debug level).

Three concerns each live in one place: back-pressure in :class:`StallWatch` (the producer
twisted.web pauses when the client does not read; ``--stall-timeout`` later the client is cut
off), the ``sfhead_requests_total`` label of a finished request in :func:`request_label` (errors
carry their own, :mod:`sfnode.head.api.failures`), and the error answers in
:mod:`sfnode.head.api.failures`. The bodies and chunks are built by :mod:`sfnode.head.api.bodies`.

This module must never read the fleet's internals (only the backend's
:class:`~sfnode.head.fleet.backend.GenerationHandle`), never use the global reactor, never block the
reactor (rendering runs on the API's workers) and never write to a request once the exchange
is done or gone.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from sfnode.decoding.constraint import ConstraintError
from sfnode.generation import TokenBatch, TokenSink
from sfnode.head.api import bodies, failures
from sfnode.head.api.gate import GateLimits, body_too_large, client_address
from sfnode.head.api.logprobs import ChoiceLogprobs
from sfnode.head.api.metrics import HeadMetrics
from sfnode.head.api.request_class import HEADER as CLASS_HEADER
from sfnode.head.api.request_class import ClassRule, HeadClass, class_name, parse_header
from sfnode.head.api.resume import HEADER as RESUME_HEADER
from sfnode.head.api.resume import Exchanges, ResumableStream, StreamExpired, find
from sfnode.head.api.schema import CompletionRequest
from sfnode.head.console.record import ConsoleRecord
from sfnode.head.fleet.backend import (
    Backend,
    BackendStatus,
    FleetOutcome,
    GenerationHandle,
    HeadRequest,
    Requester,
)
from sfnode.head.models.floors import AnswerFloors
from sfnode.head.models.registry import ServedModel
from sfnode.head.models.text import Detokenizer, RenderBudget, StopText
from sfnode.head.models.tools import (
    CallDone,
    CallEvent,
    CallsAnswer,
    CallSplitter,
    Content,
    call_delta,
)
from sfnode.linkf.wire import FINISH_CANCELLED, FINISH_DETAIL_CLOSED, FINISH_EOS
from sfnode.runtime.http_guard import HttpError

DEFAULT_MAX_TOKENS = 512
"""max_tokens when a request gives none (capped by the window left after the prompt)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for the legacy /v1/completions."""
INLINE_BODY_BYTES = 16 * 1024
"""Completion bodies up to this size are checked and tokenized on the reactor (a fraction of a
millisecond); larger ones go to the worker pool, and so does every chat request (its template
is code from a model file, run under ``--template-timeout``)."""

_log = Logger(namespace="sfnode.head.api.http")
_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------
# What the exchange needs of the API


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request, its prompt's token ids, and the model it names."""

    request: CompletionRequest
    prompt: list[int]
    model: ServedModel
    shortest: int | None = None
    """The fewest tokens of an answer its grammar allows (None: no grammar, or not known):
    a smaller budget is refused before placing (docs/api.md "Budgets")."""


class Runner(Protocol):
    """Runs work off the reactor, in a client's turn (the API's
    :class:`~sfnode.head.api.workers.Workers`)."""

    def run(
        self,
        work: Callable[[], _T],
        client: Hashable = "",
        *,
        budget_s: float | None = None,
        refusal: Callable[[], HttpError] | None = None,
    ) -> Deferred[_T]: ...


class Host(Protocol):
    """What an exchange asks of the API that owns it (:class:`~sfnode.head.api.http.OpenAIApi`)."""

    reactor: IReactorTime
    backend: Backend
    metrics: HeadMetrics
    floors: AnswerFloors
    limits: GateLimits
    class_rule: ClassRule
    template_timeout_s: float
    draining: bool
    exchanges: Exchanges[Exchange]
    record: ConsoleRecord

    @property
    def workers(self) -> Runner: ...

    def status(self, model: str | None = None) -> BackendStatus: ...

    def statuses(self) -> dict[str, BackendStatus]: ...

    def prepare(
        self,
        data: bytes | dict[str, Any],
        chat: bool,
        statuses: Mapping[str, BackendStatus],
        budget: RenderBudget | None = None,
    ) -> Prepared: ...

    def grammar_checked(self, prepared: Prepared, client: Hashable = "") -> Deferred[Prepared]: ...

    def unexpected(self, failure: Failure, request: Any = None) -> HttpError: ...

    def exchange_began(self, exchange: Exchange) -> None: ...

    def exchange_ended(self, exchange: Exchange) -> None: ...


# --------------------------------------------------------------------------------------------
# The phases


class Phase(enum.Enum):
    PREPARING = "preparing"
    PLACED = "placed"
    STREAMING = "streaming"
    AWAY = "away"
    DONE = "done"
    GONE = "gone"


MOVES: dict[tuple[Phase, str], Phase] = {
    (Phase.PREPARING, "placed"): Phase.PLACED,
    (Phase.PREPARING, "answered"): Phase.DONE,
    (Phase.PREPARING, "lost"): Phase.GONE,
    (Phase.PLACED, "streamed"): Phase.STREAMING,
    (Phase.PLACED, "answered"): Phase.DONE,
    (Phase.PLACED, "lost"): Phase.GONE,
    (Phase.STREAMING, "answered"): Phase.DONE,
    (Phase.STREAMING, "lost"): Phase.GONE,
    # The client dropped mid-stream: the stream waits --resume-grace for it (resume.py).
    (Phase.STREAMING, "dropped"): Phase.AWAY,
    (Phase.AWAY, "resumed"): Phase.STREAMING,
    (Phase.AWAY, "answered"): Phase.DONE,
    (Phase.AWAY, "lost"): Phase.GONE,
    # The connection closes after the whole answer: nothing to undo.
    (Phase.DONE, "lost"): Phase.DONE,
    # The stall timer cut the client off, then its connection's loss arrives.
    (Phase.GONE, "lost"): Phase.GONE,
}
"""Every move an exchange makes, ``(phase, input) -> phase``; any other is a defect."""


def finish_reason(outcome: FleetOutcome, stopped: bool, *, drained: bool, gone: bool) -> str:
    """A choice's ``finish_reason``: ``stop`` (a stop string, the end of sequence, or the
    head's drain), ``cancelled`` (its client went away), else ``length``."""
    if stopped or outcome.finish == FINISH_EOS:
        return "stop"
    if outcome.finish == FINISH_CANCELLED and drained and not gone:
        return "stop"
    if outcome.finish == FINISH_CANCELLED and gone:
        return "cancelled"
    return "length"


def request_label(finishes: Sequence[str | None], drain_cancelled: bool) -> str:
    """The ``sfhead_requests_total`` label of a request whose generations all ended:
    ``drained`` (the drain cancelled one), ``cancelled`` (its client went away), else
    ``ok``.  A request answered with an error is counted under that error's ``outcome``."""
    if drain_cancelled:
        return "drained"
    if "cancelled" in finishes:
        return "cancelled"
    return "ok"


# --------------------------------------------------------------------------------------------
# Back-pressure


@implementer(IPushProducer)
@dataclass(eq=False)
class StallWatch:
    """The request's streaming producer: twisted.web pauses it when the client's connection
    is full (the client is not reading) and resumes it when the data went out.  A pause
    calls ``paused`` (the exchange parks its generations: an unread stream holds no lane,
    docs/protocol.md section 8.5 "Shares"), a resume ``resumed``; a pause that lasts
    ``timeout_s`` calls ``stalled`` (the exchange cuts the client off)."""

    clock: IReactorTime
    timeout_s: float
    stalled: Callable[[], None]
    paused: Callable[[], None] = lambda: None
    resumed: Callable[[], None] = lambda: None
    _timer: IDelayedCall | None = field(default=None, init=False)
    _request: Any = field(default=None, init=False)

    def attach(self, request: Any) -> None:
        """Register on ``request`` (from now on its pauses are watched)."""
        self._request = request
        request.registerProducer(self, True)

    def detach(self, *, gone: bool) -> None:
        """Stop watching (``gone``: the connection is lost, there is nothing to unregister)."""
        self._stop_timer()
        request, self._request = self._request, None
        if request is not None and not gone:
            request.unregisterProducer()

    def pauseProducing(self) -> None:
        if self._timer is None and self._request is not None:
            self._timer = self.clock.callLater(self.timeout_s, self._fire)
            self.paused()

    def resumeProducing(self) -> None:
        if self._stop_timer():
            self.resumed()

    def stopProducing(self) -> None:
        self._stop_timer()

    def _stop_timer(self) -> bool:
        """Stop the stall timer; whether one ran (the producer was paused)."""
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
            return True
        return False

    def _fire(self) -> None:
        self._timer = None
        self.stalled()


# --------------------------------------------------------------------------------------------
# One request


class RequestChoice:
    """One of the ``n`` generations of a request: its text so far and how it ended."""

    def __init__(
        self,
        index: int,
        detok: Detokenizer,
        stops: Sequence[str],
        logprobs: ChoiceLogprobs | None = None,
    ) -> None:
        self.index = index
        self.detok = detok
        self.stop = StopText(stops)
        self.text: list[str] = []
        self.generation: GenerationHandle | None = None
        self.outcome: FleetOutcome | None = None
        self.finish: str | None = None
        self.logprobs = logprobs
        """The logprobs of the tokens shown so far, when the request asked for them."""
        self.decoded = 0
        """Characters the detokenizer released so far (where the next token's text starts)."""
        self.calls: CallSplitter | None = None
        """Reads tool calls out of the text, when the request's output may hold some."""
        self.answer = CallsAnswer()
        """The content and calls shown so far."""

    @property
    def closed(self) -> bool:
        """The node closed the choice's constrained output within its budget (it ended with
        its grammar's end, docs/protocol.md section 12.6)."""
        return (
            self.outcome is not None
            and self.outcome.finish == FINISH_EOS
            and bool(self.outcome.detail & FINISH_DETAIL_CLOSED)
        )


def _max_tokens(parsed: CompletionRequest, prompt_length: int, window: Callable[[], int]) -> int:
    """The tokens a request may generate: its ``max_tokens``, else what the model's window
    leaves after the prompt, within the default (the default alone while no window is
    known)."""
    if parsed.max_tokens is not None:
        return parsed.max_tokens
    default = DEFAULT_MAX_TOKENS if parsed.chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    known = window()
    room = known - prompt_length if known else default
    return max(1, min(default, room))


def measure(prepared: Prepared, api: Host, client: Hashable = "") -> Deferred[Prepared]:
    """``prepared`` with the shortest answer its grammar allows, when it is constrained
    (found on ``api``'s workers in ``client``'s turn: the first one of a tokenizer reads its
    whole vocabulary)."""
    constraint = prepared.request.constraint
    grammar = constraint.grammar if constraint is not None else None
    if grammar is None:
        return defer.succeed(prepared)
    model, floors = prepared.model, api.floors

    def work() -> Prepared:
        try:
            shortest = floors.shortest(model.renderer, model.vocab_size, grammar)
        except ConstraintError as e:
            raise HttpError(400, e.message, param=e.param) from e
        return replace(prepared, shortest=shortest)

    return api.workers.run(work, client)


class Exchange:
    """One completion request, from its body to the last byte of its answer."""

    def __init__(self, api: Host, request: Any, chat: bool) -> None:
        self.api = api
        self.request: Any = request
        self.chat = chat
        self.phase = Phase.PREPARING
        self.received = api.reactor.seconds()
        self.ident = bodies.new_ident(chat)
        self.created = int(self.received)
        self.parsed: CompletionRequest | None = None
        self.prompt: list[int] = []
        self.model: ServedModel | None = None
        """The model the request names (its renderer, the name asked of nodes)."""
        self.choices: list[RequestChoice] = []
        self.first_token_at: float | None = None
        self.named_class: HeadClass | None = None
        """The class the X-Request-Class header named (None: it named none)."""
        self.drained = False
        """Cancelled by the head's drain timeout (it ends with finish_reason stop)."""
        self.failure: HttpError | None = None
        """The error answered for the whole request (the first one wins)."""
        self._pending = 0
        """Generations not ended yet."""
        self._watch = StallWatch(
            api.reactor,
            api.limits.stall_timeout_s,
            self._stalled,
            paused=lambda: _park(self, True),
            resumed=lambda: _park(self, False),
        )
        self.writer: Writer = ChatWriter(self)
        """How the answer is written (chat's and completions' shapes, or another API's)."""
        self.stream = ResumableStream(api.reactor, api.limits.resume_grace_s, request, self._lost)
        """Every event written, numbered and kept while the stream may be resumed."""

    @property
    def answered(self) -> bool:
        """The answer is complete, or the client is gone: nothing more is written."""
        return self.phase in (Phase.DONE, Phase.GONE)

    def _move(self, given: str) -> None:
        """The one place the phase changes (see :data:`MOVES`)."""
        new = MOVES.get((self.phase, given))
        if new is None:
            raise RuntimeError(f"exchange {self.ident}: no move from {self.phase.value} on {given}")
        _log.debug(
            "exchange {ident} [{old}].{given} -> [{new}]",
            ident=self.ident, old=self.phase.value, given=given, new=new.value,
        )  # fmt: skip
        self.phase = new

    # Life cycle

    def start(self) -> None:
        api = self.api
        if self.request.permit is None:
            # The front door admits every completion with a permit: one without is a
            # defect, and must never produce a completion.
            raise RuntimeError(f"a completion reached {self.request.path!r} unscreened")
        last = self.request.getHeader(RESUME_HEADER)
        if last is not None:
            _resume(api, self.request, last)
            return
        self.stream.watch(self.request, self._lost)
        api.exchange_began(self)
        client: Hashable = ""
        try:
            if api.draining:
                raise failures.draining()
            self.named_class = parse_header(self.request.getHeader(CLASS_HEADER))
            data = self.request.content.getvalue()
            if len(data) > api.limits.max_body:
                raise body_too_large(api.limits.max_body)
            statuses = api.statuses()
            client = client_of(self.request)
            if self.chat:
                prepared: Deferred[Prepared] = self._prepare_chat(data, statuses)
            elif len(data) <= INLINE_BODY_BYTES:
                prepared = defer.maybeDeferred(api.prepare, data, self.chat, statuses)
            else:
                prepared = api.workers.run(lambda: api.prepare(data, self.chat, statuses), client)
            # The grammar is compiled on the workers, once per grammar, within its time limit.
            prepared.addCallback(api.grammar_checked, client)
        except Exception:
            # An HttpError is answered as such; anything else as an unexpected failure.
            prepared = defer.fail()
        measured = prepared.addCallback(measure, api, client)
        measured.addCallback(self._place).addErrback(self._refused).addErrback(self._unexpected)

    def _prepare_chat(
        self, data: bytes | dict[str, Any], statuses: Mapping[str, BackendStatus]
    ) -> Deferred[Prepared]:
        """Check and render a chat body (its bytes, or parsed) on a worker, in its client's
        turn, its template's render stopped after ``--template-timeout`` seconds (timed from
        when the render starts)."""
        api = self.api
        timer: list[IDelayedCall] = []

        def arm() -> None:
            if not budget.stopped:
                timer.append(api.reactor.callLater(api.template_timeout_s, timed_out))

        def timed_out() -> None:
            _log.warn(
                "the chat template took more than {seconds:g} s to render the messages of "
                "{ident}; stopped it (--template-timeout)",
                seconds=api.template_timeout_s,
                ident=self.ident,
            )
            budget.stop()

        def disarm(result: object) -> object:
            for call in timer:
                if call.active():
                    call.cancel()
            return result

        budget = RenderBudget(lambda: api.reactor.callFromThread(arm))  # type: ignore[attr-defined]
        prepared = api.workers.run(
            lambda: api.prepare(data, True, statuses, budget), client_of(self.request)
        )
        return prepared.addBoth(disarm)

    def _place(self, prepared: Prepared) -> None:
        """The request is checked and rendered: hand its ``n`` generations to the backend."""
        api = self.api
        self.parsed, self.prompt, self.model = prepared.request, prepared.prompt, prepared.model
        if self.phase is Phase.GONE:
            self._end_if_idle()
            return
        if api.draining:
            raise failures.draining()
        # No "is a node live?" check here: a request no node can take now waits in the
        # fleet's queue (a node may come back or dial in) and fails from there when it is
        # full or the wait times out.
        permit = self.request.permit
        assert permit is not None  # start() refused a request without one
        self.stream.name, self.stream.key = self.ident, permit.key
        parsed = prepared.request
        model = prepared.model
        budget = _max_tokens(parsed, len(self.prompt), lambda: self.api.status(model.name).window)
        if prepared.shortest is not None and budget < prepared.shortest:
            raise failures.budget_too_small(budget, prepared.shortest, parsed.max_tokens_param)
        permit.widen(parsed.n - 1)
        permit.spend(len(self.prompt) * parsed.n, api.reactor.seconds())
        named = self.named_class
        named = named if named is not None else permit.policy.request_class
        request_class = self.api.class_rule.classify(named, len(self.prompt))
        self.request.setHeader(CLASS_HEADER, class_name(request_class).encode())
        request = HeadRequest(
            tuple(self.prompt),
            budget,
            model=model.name,
            params=parsed.params,
            request_class=request_class.wire,
            background=request_class is HeadClass.BACKGROUND,
            requester=Requester(
                client_address(self.request.getClientAddress()), permit.key, permit.policy.weight
            ),
            constraint=parsed.constraint,
        )
        # Streamed chunks are small writes: without TCP_NODELAY, Nagle's algorithm holds each
        # one back until the client's delayed ACK of the previous one (about 40 ms).
        no_delay = getattr(self.request.transport, "setTcpNoDelay", None)
        if no_delay is not None:
            no_delay(True)
        self._watch.attach(self.request)
        self._move("placed")
        placed = [self._start_choice(prepared, index, request) for index in range(parsed.n)]
        if parsed.stream:
            defer.gatherResults(placed, consumeErrors=True).addCallbacks(
                self._begin_stream, lambda _: None
            )

    def _start_choice(self, prepared: Prepared, index: int, request: HeadRequest) -> Deferred[None]:
        """Hand choice ``index`` (its own seed) to the backend; fires once it is placed."""
        parsed, renderer = prepared.request, prepared.model.renderer
        logprobs = None
        if parsed.logprobs is not None:
            logprobs = ChoiceLogprobs(self.chat, parsed.logprobs, renderer.token_bytes)
        choice = RequestChoice(index, renderer.detokenizer(), parsed.stop, logprobs)
        if parsed.calls:
            choice.calls = CallSplitter()
        self.choices.append(choice)
        generation = self.api.backend.generate(
            replace(request, params=parsed.choice_params(index)), _receiver(self, choice)
        )
        choice.generation = generation
        self._pending += 1
        placed = generation.when_placed() if parsed.stream else defer.succeed(None)
        generation.result.addCallbacks(
            self._choice_done, self._choice_failed, callbackArgs=(choice,),
            errbackArgs=(choice,),
        ).addErrback(self._unexpected)  # fmt: skip
        return placed

    def _refused(self, failure: Failure) -> None:
        """A request that ends before any generation: its error answered and counted."""
        failure.trap(HttpError)  # type: ignore[no-untyped-call]
        error = failure.value
        assert isinstance(error, HttpError)
        self.api.metrics.requests.labels(error.outcome).inc()
        self._answer_error(error)
        self._end_if_idle()

    def _unexpected(self, failure: Failure) -> None:
        """Anything else that went wrong: one log line, one count, a JSON 500 if possible."""
        error = self.api.unexpected(failure, self.request)
        for choice in self.choices:
            if choice.generation is not None and choice.outcome is None:
                choice.generation.cancel()
        self._answer_error(error)
        self._pending = 0
        self._end_if_idle()

    def _end_if_idle(self) -> None:
        """Once no generation runs: the exchange is over for the API (a drain waits for
        this)."""
        if self._pending == 0 and not self.stream.away:
            self._watch.detach(gone=self.phase is Phase.GONE)
            if self.stream.finished:
                self.api.exchanges.keep(self.stream)
            self.api.exchange_ended(self)

    def drain_cancel(self) -> None:
        """The drain timeout: cancel the generations; the client still gets a clean end (a
        client away gets none: its stream is given up)."""
        self.drained = True
        self._cancel_all()
        self.stream.expire()

    def _cancel_all(self) -> None:
        for choice in self.choices:
            if choice.generation is not None:
                choice.generation.cancel()

    # The client

    def _lost(self, failure: Failure) -> None:
        """The client's connection is gone (it went away, or was cut off), or nobody resumed
        its stream in time (StreamExpired).  A stream's client that drops mid-stream may come
        back within --resume-grace (unless the head drains: then nobody can): its generations
        park meanwhile."""
        before = self.phase
        expired = isinstance(failure.value, StreamExpired)
        if before is Phase.STREAMING and not self.api.draining and self.stream.detach():
            self._move("dropped")
            self._watch.detach(gone=True)
            _park(self, True)
            _log.info(
                "client of {ident} dropped mid-stream ({reason}); keeping it {grace:g} s",
                ident=self.ident,
                reason=failure.getErrorMessage(),
                grace=self.stream.grace_s,
            )
            return
        self._move("lost")
        if before in (Phase.DONE, Phase.GONE):
            if expired:
                self._end_if_idle()
            return
        self.stream.close()
        self._watch.detach(gone=True)
        if self.choices:
            _log.info(
                "client of {ident} went away ({reason}); cancelling",
                ident=self.ident,
                reason=failure.getErrorMessage(),
            )
        self._cancel_all()

    def resume(self, request: Any, after: int) -> None:
        """``request`` resumes the stream after its ``after``-th event (docs/api.md
        "Streams that resume"): the events since, then the rest as it comes."""
        _log.info("client of {ident} resumed after event {after}", ident=self.ident, after=after)
        old, self.request = self.request, request
        if self.phase is Phase.AWAY:
            self._move("resumed")
        elif self.phase is Phase.STREAMING:
            # Its old connection is half open (the client knows it is gone): the new wins.
            self._watch.detach(gone=True)
            self.stream.request = None
            if old.transport is not None:
                old.transport.abortConnection()
        self.stream.resume(request, after)
        if self.phase is Phase.STREAMING:
            self.stream.watch(request, self._lost)
            self._watch.attach(request)
            _park(self, False)
        else:
            self._end_if_idle()

    def _stalled(self) -> None:
        """The client read nothing for ``--stall-timeout`` seconds: cut it off."""
        _log.info(
            "client of {ident} read nothing for {seconds} s; cutting it off",
            ident=self.ident,
            seconds=self.api.limits.stall_timeout_s,
        )
        self._move("lost")
        self._watch.detach(gone=True)
        self.stream.close()
        self._cancel_all()
        transport = self.request.transport
        if transport is not None:
            transport.abortConnection()

    # Writing

    @property
    def reply(self) -> bodies.Reply:
        assert self.parsed is not None
        return bodies.Reply(self.ident, self.created, self.parsed.model, self.chat)

    def _begin_stream(self, _: object = None) -> None:
        if self.phase is not Phase.PLACED:
            return
        self._move("streamed")
        request = self.request
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        self.writer.opened()

    def _emit(self, choice: RequestChoice, text: str, *, last: bool = False) -> None:
        """Show ``text`` (a chunk when streaming), with the logprobs of the tokens shown since
        the last chunk; ``last``: the choice's final text, sent even when empty if logprobs
        are still pending (tokens whose text is empty, such as an EOS)."""
        pending = choice.logprobs is not None and choice.logprobs.pending
        if not text and not (last and pending):
            return
        choice.text.append(text)
        self._show(choice, choice.calls.feed(text) if choice.calls is not None else [Content(text)])

    def _show(self, choice: RequestChoice, events: Sequence[CallEvent]) -> None:
        """Content and tool-call deltas read out of a choice's text (a chunk each when
        streaming; a call's raw tags never reach the client)."""
        choice.answer.add(events)
        assert self.parsed is not None
        if self.parsed.stream and events:
            self._begin_stream()
        if events and not self.answered:
            self.writer.show(choice, events, streamed=self.parsed.stream)

    def _answer_error(self, error: HttpError) -> None:
        if self.answered:
            return
        streaming = self.phase in (Phase.STREAMING, Phase.AWAY)
        self._move("answered")
        self._watch.detach(gone=False)
        if streaming:
            self.writer.failed(error)
        else:
            self.request.write(answer_error(self.request, error))
        self.stream.finish()

    # The generations

    def _tokens(self, choice: RequestChoice, batch: TokenBatch) -> None:
        tokens, logprobs = batch.tokens, batch.logprobs
        if self.first_token_at is None and tokens:
            self.first_token_at = self.api.reactor.seconds()
            self.api.metrics.ttft.observe(self.first_token_at - self.received)
            self.api.record.first_token(_model_of(self), self.first_token_at - self.received)
        if choice.stop.stopped or self.answered:
            return
        if choice.logprobs is None:
            self._emit(choice, choice.stop.feed(choice.detok.push(tokens)))
        elif logprobs is None:
            # The fleet places such requests only on nodes that return logprobs, and their
            # links refuse a stream without them: a defect, answered as one.
            self._give_up(failures.missing_logprobs())
            return
        else:
            # One token at a time: each entry is shown with the text its token released, and
            # the tokens after a stop string are not listed.
            for token, logprob in zip(tokens, logprobs, strict=True):
                choice.logprobs.add(token, logprob, choice.decoded)
                piece = choice.detok.push((token,))
                choice.decoded += len(piece)
                self._emit(choice, choice.stop.feed(piece))
                if choice.stop.stopped:
                    break
        if choice.stop.stopped and choice.generation is not None:
            choice.generation.cancel()

    def _choice_done(self, outcome: FleetOutcome, choice: RequestChoice) -> None:
        choice.outcome = outcome
        self._pending -= 1
        self.api.metrics.completion_tokens.inc(len(outcome.tokens))
        self.api.record.tokens(_model_of(self), len(outcome.tokens))
        if self.request.permit is not None:
            self.request.permit.spend(len(outcome.tokens), self.api.reactor.seconds())
        if not self.answered:
            if not choice.stop.stopped:
                self._emit(choice, choice.stop.feed(choice.detok.flush()))
            self._emit(choice, choice.stop.flush(), last=True)
            if choice.calls is not None:
                self._show(choice, choice.calls.finish())
        choice.finish = finish_reason(
            outcome, choice.stop.stopped, drained=self.drained, gone=self.phase is Phase.GONE
        )
        if choice.answer.calls and choice.finish == "stop":
            choice.finish = "tool_calls"
        assert self.parsed is not None
        if self.parsed.stream and not self.answered:
            self._begin_stream()
            self.writer.choice_finished(choice)
        if self._pending == 0:
            self._all_done()

    def _choice_failed(self, failure: Failure, choice: RequestChoice) -> None:
        self._pending -= 1
        assert self.parsed is not None
        assert failure.value is not None
        error = failures.fleet_error(failure.value, self.parsed.prompt_param)
        if error is None:
            failure.raiseException()
        self._give_up(error)
        self._end_if_idle()

    def _give_up(self, error: HttpError) -> None:
        """Answer ``error`` for the whole request (the first error wins) and cancel the
        generations still running."""
        if self.failure is None:
            self.failure = error
            self.api.metrics.requests.labels(error.outcome).inc()
            self._cancel_all()
            self._answer_error(error)

    def _all_done(self) -> None:
        """Every generation ended: count the request and write the rest of the answer."""
        api = self.api
        parsed = self.parsed
        assert parsed is not None
        if self.failure is not None:
            self._end_if_idle()
            return
        api.metrics.prompt_tokens.inc(len(self.prompt))
        drain_cancelled = self.drained and any(
            c.outcome is not None and c.outcome.finish == FINISH_CANCELLED for c in self.choices
        )
        label = request_label([c.finish for c in self.choices], drain_cancelled)
        api.metrics.requests.labels(label).inc()
        if self.answered:
            self._end_if_idle()
            return
        completion_tokens = sum(len(c.outcome.tokens) for c in self.choices if c.outcome)
        if parsed.stream:
            self._begin_stream()
            self._move("answered")
            self._watch.detach(gone=False)
            self.writer.closed(completion_tokens)
        else:
            self._move("answered")
            self._watch.detach(gone=False)
            body = self.writer.whole(completion_tokens)
            self.request.write(answer(self.request, 200, body))
        self.stream.finish()
        self._end_if_idle()


def client_of(request: Any) -> Hashable:
    """Whose turn a request's work runs in on the workers: its API key, else its address (as
    the fleet's queue counts clients)."""
    permit = request.permit
    if permit is not None and permit.key:
        return ("key", permit.key)
    return ("address", client_address(request.getClientAddress()))


def _receiver(exchange: Exchange, choice: RequestChoice) -> TokenSink:
    def receive(batch: TokenBatch) -> None:
        exchange._tokens(choice, batch)

    return receive


def _resume(api: Host, request: Any, last: bytes) -> None:
    """A request with ``Last-Event-ID``: hand it to the stream it names, or answer 404."""
    try:
        exchange, stream, after = find(api.exchanges, last, request.permit.key)
    except HttpError as error:
        api.metrics.requests.labels(error.outcome).inc()
        request.write(answer_error(request, error))
        request.finish()
        return
    api.record.resumed(_model_of(exchange), after)
    if exchange is not None:
        exchange.resume(request, after)
    else:
        stream.resume(request, after)


def _model_of(exchange: Exchange | None) -> str:
    """The name of the model ``exchange`` asks (the console's label; "" before it is known)."""
    model = exchange.model if exchange is not None else None
    return model.name if model is not None else ""


def _park(exchange: Exchange, park: bool) -> None:
    """Park (or unpark) each generation of ``exchange`` still running: its client stopped
    (or started again) reading (docs/protocol.md section 8.5, "Shares")."""
    if exchange.answered:
        return
    for choice in exchange.choices:
        generation = choice.generation
        if generation is not None and choice.outcome is None:
            if park:
                generation.park()
            else:
                generation.unpark()


# --------------------------------------------------------------------------------------------
# Writing an answer


class Writer(Protocol):
    """How an exchange's answer is written: the events of a stream, or one body."""

    def opened(self) -> None:
        """The first events of a stream (its headers are set)."""

    def show(self, choice: RequestChoice, events: Sequence[CallEvent], *, streamed: bool) -> None:
        """Text and tool calls a choice shows (``streamed``: as events, now)."""

    def choice_finished(self, choice: RequestChoice) -> None:
        """A streamed choice ended (its ``finish`` is set)."""

    def closed(self, completion_tokens: int) -> None:
        """The events that end a stream whose choices all ended."""

    def whole(self, completion_tokens: int) -> Any:
        """The body of a non-streamed answer."""

    def failed(self, error: HttpError) -> None:
        """The events that end a stream that failed."""


class ChatWriter:
    """Chat and text completions: OpenAI's chunks ending with ``data: [DONE]``, or one
    ``chat.completion`` / ``text_completion`` body (:mod:`sfnode.head.api.bodies`)."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    def opened(self) -> None:
        x = self.exchange
        if x.chat:
            for choice in x.choices:
                x.stream.send(bodies.event(bodies.role_chunk(x.reply, choice.index)))
        else:
            x.request.write(b"")

    def show(self, choice: RequestChoice, events: Sequence[CallEvent], *, streamed: bool) -> None:
        if not streamed:
            return  # the whole answer reads the choice's text (whole)
        x = self.exchange
        for shown in events:
            if isinstance(shown, CallDone):
                continue  # no chunk: the next call or the finish says it
            logprobs = choice.logprobs.take() if choice.logprobs is not None else None
            if isinstance(shown, Content):
                chunk = bodies.delta_chunk(x.reply, choice.index, shown.text, logprobs=logprobs)
            else:
                chunk = bodies.calls_chunk(
                    x.reply, choice.index, [call_delta(shown)], logprobs=logprobs
                )
            x.stream.send(bodies.event(chunk))

    def choice_finished(self, choice: RequestChoice) -> None:
        assert choice.finish is not None
        chunk = bodies.finish_chunk(
            self.exchange.reply, choice.index, choice.finish, closed=choice.closed
        )
        self.exchange.stream.send(bodies.event(chunk))

    def closed(self, completion_tokens: int) -> None:
        x = self.exchange
        assert x.parsed is not None
        if x.parsed.include_usage:
            chunk = bodies.usage_chunk(x.reply, len(x.prompt), completion_tokens)
            x.stream.send(bodies.event(chunk))
        x.stream.send(bodies.DONE)

    def whole(self, completion_tokens: int) -> Any:
        x = self.exchange
        choices = [
            bodies.ChoiceBody(
                c.index,
                c.answer.text if c.calls is not None else "".join(c.text),
                c.finish,
                c.logprobs.whole() if c.logprobs is not None else None,
                # A call the budget cut keeps its fragments, as a stream shows them.
                c.answer.calls if c.calls is not None else None,
                closed=c.closed,
            )
            for c in x.choices
        ]
        return bodies.completion(x.reply, choices, len(x.prompt), completion_tokens)

    def failed(self, error: HttpError) -> None:
        self.exchange.stream.send(bodies.event(error.body()))
        self.exchange.stream.send(bodies.DONE)


# --------------------------------------------------------------------------------------------
# JSON answers


def answer(
    request: Any, status: int, body: Any, headers: dict[bytes, bytes] | None = None
) -> bytes:
    """Set ``request``'s status and JSON headers; the bytes of ``body`` to write."""
    data = json.dumps(body).encode()
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"content-length", b"%d" % len(data))
    for name, value in (headers or {}).items():
        request.setHeader(name, value)
    return data


def answer_error(request: Any, error: HttpError) -> bytes:
    return answer(request, error.status, error.body(), error.headers)


__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "INLINE_BODY_BYTES",
    "MOVES",
    "ChatWriter",
    "Exchange",
    "Host",
    "Phase",
    "Prepared",
    "StallWatch",
    "Writer",
    "answer",
    "answer_error",
    "client_of",
    "finish_reason",
    "measure",
    "request_label",
]
