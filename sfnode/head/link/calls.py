"""The outstanding calls of one head link, in one correlation table (like AMP's
``BoxDispatcher``): generations by (session, generation), stage forwards and embeddings by
request id.

A :class:`GenerationCall` is what a caller holds for one GENERATE_REQ; :class:`CallTable` is
where the link finds it again when the node's events, a STAGE_FORWARD_RESP or an EMBED_RESP
arrive.  This
module must never send or receive a frame: the link does, through the small
:class:`CallOwner` interface.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Generic, TypeVar
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from sfnode.generation import TokenBatch, TokenLogprob, TokenSink
from sfnode.linkf.wire import (
    Constraint,
    EmbedRespMsg,
    GenerateCancelMsg,
    Message,
    RequestClass,
    StageBatchRespMsg,
    StageForwardRespMsg,
    Tokens,
    TokensLogprobs,
)

_log = Logger(namespace="sfnode.head.link")

_A = TypeVar("_A")

GenerationKey = tuple[int, int]
"""(session, generation)."""


def token_logprobs(payload: TokensLogprobs) -> tuple[TokenLogprob, ...]:
    """The logprobs of a TokensLogprobs event, one per token (alternatives empty when the
    event lists none)."""
    tops = payload.top or [()] * len(payload.tokens)
    return tuple(TokenLogprob(v, top) for v, top in zip(payload.logprobs, tops, strict=True))


@dataclass(frozen=True, slots=True)
class GenerationOutcome:
    """The tokens a generation committed, in order, and its finish reason."""

    tokens: list[int]
    finish: int
    detail: int = 0
    """The Finish's ``detail`` bits (docs/protocol.md section 12.6)."""


class GenerationAsk(TypingProtocol):
    """What one GENERATE_REQ asks of a node beyond its session: the budgets, the class and the
    constraint (docs/protocol.md sections 7.3, 12.2 and 12.3).  The head's request value
    (``sfnode.head.fleet.backend.HeadRequest``) is one, passed down as it is."""

    @property
    def max_new(self) -> int: ...

    @property
    def max_wall_ms(self) -> int: ...

    @property
    def request_class(self) -> RequestClass: ...

    @property
    def constraint(self) -> Constraint | None: ...


class CallOwner(TypingProtocol):
    """What a call asks of its link."""

    def send_now(self, message: Message) -> bool:
        """Send now if a connection is up; False otherwise."""

    def forget_generation(self, call: GenerationCall) -> None:
        """Take the call out of the link's table (its result was cancelled)."""


@dataclass(eq=False)
class GenerationCall:
    """One GENERATE_REQ in flight: its result and a way to cancel it.

    ``result`` fires with a :class:`GenerationOutcome` when the node's Finish arrives (any
    finish, DECLINED and REFUSED included), or fails with a :class:`LinkError` when the link
    loses it.  Cancelling ``result`` itself also sends GENERATE_CANCEL and forgets the call.
    """

    link: CallOwner
    session_id: int
    generation_id: int
    epoch: int
    on_tokens: TokenSink | None
    _: KW_ONLY
    logprobs: bool = False
    """Its session's GenParams ask for logprobs (docs/protocol.md section 12.1)."""
    tokens: list[int] = field(default_factory=list, init=False)
    """Tokens delivered so far (committed events only, each once)."""
    finish: int | None = field(default=None, init=False)
    detail: int = field(default=0, init=False)
    """The Finish's ``detail`` bits (docs/protocol.md section 12.6)."""
    result: Deferred[GenerationOutcome] = field(init=False)
    _cancel_sent: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.result = Deferred(self._cancel_result)

    @property
    def done(self) -> bool:
        return self.result.called

    def cancel(self) -> None:
        """Ask the node to stop (GENERATE_CANCEL, sent at most once); the Finish still comes."""
        if self._cancel_sent or self.done:
            return
        if self.link.send_now(GenerateCancelMsg(self.session_id, self.generation_id)):
            self._cancel_sent = True

    def _cancel_result(self, _: Deferred[GenerationOutcome]) -> None:
        self.cancel()
        self.link.forget_generation(self)

    def _deliver(self, payload: Tokens) -> None:
        batch = TokenBatch(
            payload.tokens,
            token_logprobs(payload)
            if self.logprobs and isinstance(payload, TokensLogprobs)
            else None,
        )
        self.tokens.extend(batch.tokens)
        if self.on_tokens is not None:
            try:
                self.on_tokens(batch)
            except Exception:
                _log.failure("an on_tokens callback failed")

    def _complete(self) -> None:
        assert self.finish is not None
        if not self.result.called:
            self.result.callback(GenerationOutcome(list(self.tokens), self.finish, self.detail))

    def _fail(self, error: Exception) -> None:
        if not self.result.called:
            self.result.errback(error)


class Answers(Generic[_A]):
    """Deferreds waiting for an answer, by request id: :meth:`answer` fires one, cancelling
    one forgets it, :meth:`fail` fails them all."""

    def __init__(self) -> None:
        self._waiting: dict[int, Deferred[_A]] = {}

    def expect(self, request_id: int) -> Deferred[_A]:
        def forget(_: Deferred[_A]) -> None:
            self._waiting.pop(request_id, None)

        d: Deferred[_A] = Deferred(forget)
        self._waiting[request_id] = d
        return d

    def answer(self, request_id: int, answer: _A) -> None:
        d = self._waiting.pop(request_id, None)
        if d is not None:
            d.callback(answer)

    def fail(self, error: Exception) -> None:
        waiting, self._waiting = self._waiting, {}
        for d in waiting.values():
            d.errback(error)

    def __len__(self) -> int:
        return len(self._waiting)


class CallTable:
    """Every outstanding call of one link (AMP's ``BoxDispatcher``): generations by (session,
    generation), stage forwards by request id, the ids they are given, and the generations a
    dropped connection suspended until the redial's reconcile settles them."""

    def __init__(self) -> None:
        self._next_id = 1
        self._generations: dict[GenerationKey, GenerationCall] = {}
        self._forwards: Answers[StageForwardRespMsg] = Answers()
        self._batches: Answers[StageBatchRespMsg] = Answers()
        self._embeddings: Answers[EmbedRespMsg] = Answers()
        self._suspended: set[GenerationKey] = set()

    def next_id(self) -> int:
        """A new generation id (or stage forward request id) on this link."""
        value = self._next_id
        self._next_id += 1
        return value

    # Generations

    def add(self, call: GenerationCall) -> None:
        self._generations[(call.session_id, call.generation_id)] = call

    def get(self, key: GenerationKey) -> GenerationCall | None:
        return self._generations.get(key)

    def pending(self) -> list[GenerationCall]:
        return list(self._generations.values())

    def of_session(self, session_id: int) -> list[GenerationCall]:
        return [call for key, call in self._generations.items() if key[0] == session_id]

    def forget(self, call: GenerationCall) -> bool:
        """Take ``call`` out; False when it was not (or no longer) in the table."""
        key = (call.session_id, call.generation_id)
        if self._generations.get(key) is not call:
            return False
        del self._generations[key]
        self._suspended.discard(key)
        return True

    def suspend_all(self) -> None:
        """The connection dropped: every pending generation waits for the reconcile."""
        self._suspended.update(self._generations)

    def take_suspended(self) -> list[GenerationCall]:
        """The suspended generations still pending, no longer marked suspended."""
        suspended, self._suspended = self._suspended, set()
        return [call for key in suspended if (call := self._generations.get(key)) is not None]

    @property
    def any_suspended(self) -> bool:
        return bool(self._suspended)

    # Stage forwards

    def expect_forward(self, request_id: int) -> Deferred[StageForwardRespMsg]:
        """The Deferred that :meth:`answer_forward` fires for ``request_id``."""
        return self._forwards.expect(request_id)

    def answer_forward(self, message: StageForwardRespMsg) -> None:
        """A STAGE_FORWARD_RESP: fire its request's Deferred (an unknown id is ignored)."""
        self._forwards.answer(message.request_id, message)

    def expect_batch(self, request_id: int) -> Deferred[StageBatchRespMsg]:
        """The Deferred that :meth:`answer_batch` fires for ``request_id``."""
        return self._batches.expect(request_id)

    def answer_batch(self, message: StageBatchRespMsg) -> None:
        """A STAGE_BATCH_RESP: fire its request's Deferred (an unknown id is ignored)."""
        self._batches.answer(message.request_id, message)

    @property
    def forwards(self) -> int:
        """Stage forwards (and stage batches) waiting for their answer."""
        return len(self._forwards) + len(self._batches)

    def fail_forwards(self, error: Exception) -> None:
        """The connection is lost: every stage forward and embedding waiting fails."""
        self._forwards.fail(error)
        self._batches.fail(error)
        self._embeddings.fail(error)

    # Embeddings (docs/protocol.md section 12.7)

    def expect_embedding(self, request_id: int) -> Deferred[EmbedRespMsg]:
        """The Deferred that :meth:`answer_embedding` fires for ``request_id``."""
        return self._embeddings.expect(request_id)

    def answer_embedding(self, message: EmbedRespMsg) -> None:
        """An EMBED_RESP: fire its request's Deferred (an unknown id is ignored)."""
        self._embeddings.answer(message.request_id, message)
