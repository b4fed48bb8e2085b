"""The engine interface of the node, and the deterministic mock engine used by protocol tests.

The node agent talks to its engine only through :class:`Engine` (docs/engine.md section 1):

1. ``submit`` a streamed generation; its tokens come back on the reactor thread as
   :class:`TokenBatch` values through the ``on_tokens`` callback (the same value the head
   passes on to its HTTP writer), and the generation's :class:`GenerationResult` through a
   Deferred;
2. ``statistics`` for NODE_STATUS;
3. ``context_window`` (``max_context_tokens`` in the capacity summary);
4. ``stage_forward`` for pipeline stages (docs/protocol.md section 7.6).

Every callback and every Deferred of an engine fires on the reactor thread.  An engine that
computes on a worker thread crosses back with ``reactor.callFromThread`` and nothing else.

This module must never import torch: the mock engine is pure Python, and the transformers engine
lives in its own module, imported only when it is chosen.
"""

from __future__ import annotations

import enum
import math
import struct
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from sfnode.decoding.constraint import ConstraintError, LaneStage, Vocabulary
from sfnode.decoding.draws import draw_position, uniform
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS
from sfnode.linkf.wire import LOGPROBS_MAX, Constraint, GenParams

"""Tokens per KV block; ``kv_blocks_used`` counts ``ceil(tokens / 16)`` per live lane."""


class EngineStop(enum.Enum):
    """Why an engine ended a generation that it ran (a refusal or an error is a failure)."""

    EOS = "eos"
    """The model emitted an EOS id; that id is the last token handed over (decision D6)."""
    LENGTH = "length"
    """``max_new`` tokens were produced, or the context reached the window."""
    EXPIRED = "expired"
    """The wall budget ``max_wall_ms`` ran out."""
    CANCELLED = "cancelled"
    """The node asked the engine to stop (cancel, fence or peer gone)."""


class EngineRefusal(Exception):
    """A client refusal: the request can never run here.  The node answers FINISH_REFUSED."""


class StreamTooLong(EngineRefusal):
    """A context of ``length`` tokens does not fit a window of at most ``max`` tokens.

    The one error for "too long" on both sides: an engine refuses a prompt longer than its
    context window with it (before any token; the node answers FINISH_REFUSED), and the head
    fails a request with it when no node serving the model has a window that large (``max`` is
    then the largest window among them; the HTTP API answers 400 context_length_exceeded).
    """

    def __init__(self, length: int, max: int) -> None:
        super().__init__(
            f"a context of {length} tokens does not fit: the largest window is {max} tokens"
        )
        self.length = length
        self.max = max


class StageForwardError(Exception):
    """A stage forward that cannot run: bad layer bounds, a malformed hidden blob, no support."""


@dataclass(frozen=True)
class GenerationRequest:
    """One streamed generation: the session's whole context and its budgets."""

    context: Sequence[int]
    params: GenParams
    max_new: int
    max_wall_ms: int = 0
    """0 means no wall budget."""
    interactive: bool = False
    """An interactive request (a person waiting on it) goes ahead of batch work: it is admitted
    first and its prompt computed first (docs/engine.md section 3)."""
    constraint: Constraint | None = None
    """A grammar the output must follow and the sampler's per-lane controls (docs/engine.md
    section 2.4), only for an engine that ``supports_constraints``."""


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the distribution the sampler drew it from,
    and the most likely tokens there, best first (docs/protocol.md section 12.1)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    """How a generation that ran ended; ``tokens`` are all tokens handed to ``on_tokens``."""

    tokens: Sequence[int]
    stop: EngineStop


@dataclass(frozen=True)
class EngineStatistics:
    """Live figures of an engine (docs/engine.md section 1, item 2); counters are cumulative since
    start."""

    decoded_tokens: int = 0
    prefilled_tokens: int = 0
    queue_depth: int = 0
    lanes_active: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


@dataclass(frozen=True)
class StageResult:
    """The answer of a stage forward: hidden bytes for a middle stage, a token for the last."""

    hidden: bytes | None = None
    token: int | None = None


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """The one value a generation's tokens travel in, from the engine's delivery to the head's
    HTTP writer: tokens in order and, when the generation asked for them, one
    :class:`TokenLogprob` per token (docs/protocol.md section 12.1).

    Every hop passes the batch on as it is (the tuples are shared, never copied); only where
    batches are really joined (the node's coalescing, the tokens held for a head that does not
    read) is a new one built, with :meth:`join`.  A field added later (text the head derives
    from the tokens, a parsed tool call) gets a default, so every producer stays valid.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per token, or None: the generation did not ask for logprobs."""

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise ValueError(
                f"{len(self.logprobs)} logprobs for {len(self.tokens)} tokens: a batch carries "
                "one per token or none"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def __iter__(self) -> Iterator[int]:
        """A batch iterates as its tokens (``seen.extend(batch)`` keeps the tokens)."""
        return iter(self.tokens)

    @staticmethod
    def join(batches: Sequence[TokenBatch]) -> TokenBatch:
        """The batches one after the other, as one batch (the only place one is copied).

        :raises ValueError: some batches carry logprobs and others do not (a generation's
            stream carries them throughout or not at all)."""
        if len(batches) == 1:
            return batches[0]
        tokens = tuple(token for batch in batches for token in batch.tokens)
        with_logprobs = sum(batch.logprobs is not None for batch in batches)
        if not with_logprobs:
            return TokenBatch(tokens)
        if with_logprobs != len(batches):
            raise ValueError("batches with and without logprobs cannot be joined")
        return TokenBatch(tokens, tuple(e for batch in batches for e in batch.logprobs or ()))


EMPTY_BATCH = TokenBatch(())
"""A batch of no tokens."""

TokenSink = Callable[[TokenBatch], None]
"""Where a generation's batches go, in order, each token exactly once: an engine's
``on_tokens``, a head link's, the fleet's and the HTTP writer's alike."""


class Generation(Protocol):
    """A generation handed to an engine."""

    @property
    def result(self) -> defer.Deferred[GenerationResult]:
        """Fires with the result, or fails with :class:`EngineRefusal` or another error."""

    def cancel(self) -> None:
        """Ask the engine to stop within one decode step; the result then says CANCELLED.

        No ``on_tokens`` call happens after ``cancel`` returns.
        """


class Engine(Protocol):
    """What the node agent needs from a generation engine."""

    @property
    def context_window(self) -> int:
        """The most tokens one stream may hold (0 = unknown or unlimited)."""

    @property
    def n_layers(self) -> int:
        """How many layers stage forwards split."""

    @property
    def supports_logprobs(self) -> bool:
        """Whether the engine hands over token logprobs to a generation whose
        ``params.logprobs`` asks (in each :class:`TokenBatch`); the node then
        offers ``FEATURE_LOGPROBS`` (docs/protocol.md section 12.1)."""

    @property
    def supports_constraints(self) -> bool:
        """Whether the engine honours ``GenerationRequest.constraint`` (a grammar needs the
        model's vocabulary); the node then offers ``FEATURE_CONSTRAINTS`` (docs/protocol.md
        section 12.3)."""

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's figures."""

    def submit(self, request: GenerationRequest, on_tokens: TokenSink) -> Generation:
        """Queue a generation; tokens arrive in order, each exactly once, on the reactor thread."""

    def stage_forward(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> defer.Deferred[StageResult]:
        """Run layers ``[start_layer, end_layer)``; fails with :class:`StageForwardError`."""

    def start(self) -> None:
        """Start workers, if any.  Called once before the first submit."""

    def stop(self) -> defer.Deferred[None]:
        """Cancel everything still queued or running and stop the workers."""


# --------------------------------------------------------------------------------------------
# The mock engine


MOCK_VOCAB_SIZE = 32000
MOCK_LAYERS = 24
_LAYER_STEP = struct.Struct("<QI")


def mock_embed(tokens: Sequence[int]) -> int:
    """The mock's hidden state before layer 0: xxh3_64 of the tokens as LE u32 (docs/protocol.md
    section 7.6)."""
    return int(xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens)))


def mock_layers(hidden: int, start_layer: int, end_layer: int) -> int:
    """Run pretend layers ``[start_layer, end_layer)`` on a mock hidden state."""
    for layer in range(start_layer, end_layer):
        hidden = int(xxhash.xxh3_64_intdigest(_LAYER_STEP.pack(hidden, layer)))
    return hidden


def mock_next_token(context: Sequence[int], vocab_size: int = MOCK_VOCAB_SIZE) -> int:
    """The mock's next token: the full 24-layer staged forward of the context, mod the vocab.

    A pure function of the context, stable across processes, so any split of the layers into
    stages gives the same token as a whole forward.
    """
    return mock_layers(mock_embed(context), 0, MOCK_LAYERS) % vocab_size


MOCK_CANDIDATES = 8
"""How many token ids have a finite logit in the mock's logits (all others are -inf)."""
MOCK_LOGIT_STEP = 0.5
"""The gap between the logits of consecutive mock candidates: 0, -0.5, -1.0, ..."""


def mock_logits(
    context: Sequence[int], vocab_size: int = MOCK_VOCAB_SIZE
) -> list[tuple[int, float]]:
    """The mock's logits after ``context``, as (token id, logit) of its finite entries, best first.

    The best candidate is :func:`mock_next_token` (so greedy decoding is unchanged); the others
    are further distinct ids drawn from the same hidden state by hashing it with a counter; the
    logits fall by :data:`MOCK_LOGIT_STEP` per rank; every other id of the vocabulary has logit
    -inf (probability 0).  A pure function of the context, like the greedy token.
    """
    hidden = mock_layers(mock_embed(context), 0, MOCK_LAYERS)
    ids = [hidden % vocab_size]
    counter = MOCK_LAYERS
    while len(ids) < min(MOCK_CANDIDATES, vocab_size):
        token = mock_layers(hidden, counter, counter + 1) % vocab_size
        counter += 1
        if token not in ids:
            ids.append(token)
    return [(token, -MOCK_LOGIT_STEP * rank) for rank, token in enumerate(ids)]


def kept_candidates(
    logits: Sequence[tuple[int, float]], params: GenParams
) -> list[tuple[int, float]]:
    """The candidates the sampler of docs/engine.md section 2 draws from, over sparse logits
    (ids not listed are -inf), as (token id, probability) best first, ties to the lower id.

    Greedy parameters keep the one best token (probability 1).  Otherwise: the softmax of the
    logits over ``temperature``, then top-k, min-p and top-p; the probabilities are those of
    the full softmax (not renormalised).  Pure Python, in float64 (the torch sampler of
    :mod:`sfnode.decoding.sampler` works in float32 over dense logits).
    """
    if params.temperature <= 0.0:
        return [(min(logits, key=lambda entry: (-entry[1], entry[0]))[0], 1.0)]
    ranked = _softmax(logits, params.temperature)
    keep = len(ranked)
    if params.top_k > 0:
        keep = min(keep, params.top_k)
    if params.min_p > 0.0:
        threshold = params.min_p * ranked[0][1]
        keep = max(1, sum(1 for _, p in ranked[:keep] if p >= threshold))
    if params.top_p <= 0.0:
        keep = 1
    elif params.top_p < 1.0:
        running = 0.0
        for n, (_, p) in enumerate(ranked[:keep]):
            running += p
            if running >= params.top_p:
                keep = n + 1
                break
    return ranked[:keep]


def _softmax(logits: Sequence[tuple[int, float]], temperature: float) -> list[tuple[int, float]]:
    """softmax(logits / temperature) as (token id, probability), best first, ties to the lower
    id."""
    best = max(logit for _, logit in logits)
    weights = [(token, math.exp((logit - best) / temperature)) for token, logit in logits]
    total = sum(weight for _, weight in weights)
    return sorted(
        ((token, weight / total) for token, weight in weights),
        key=lambda entry: (-entry[1], entry[0]),
    )


def sample_sparse(logits: Sequence[tuple[int, float]], params: GenParams, position: int) -> int:
    """The sampler of docs/engine.md section 2 over sparse logits (ids not listed are -inf).

    Temperature, then top-k, min-p and top-p over candidates sorted by probability (ties to the
    lower id) (:func:`kept_candidates`), then the draw ``target = uniform(position) * kept
    mass``.
    """
    kept = kept_candidates(logits, params)
    if params.temperature <= 0.0:
        return kept[0][0]
    target = uniform(position) * sum(p for _, p in kept)
    for token, p in kept:
        if target < p:
            return token
        target -= p
    return [token for token, p in kept if p > 0.0][-1]


def sparse_logprob(
    logits: Sequence[tuple[int, float]], params: GenParams, token: int
) -> TokenLogprob:
    """``token``'s logprob in the distribution the sampler drew it from, and the
    ``params.logprobs - 1`` most likely tokens there (docs/protocol.md section 12.1), over
    sparse logits.

    Greedy: the softmax of the logits, unfiltered, so the chosen (best) token's logprob is the
    first alternative's.  Sampled: the softmax of ``logits / temperature`` over the candidates
    top-k, min-p and top-p keep, renormalised; tokens outside them are never listed.  Values
    are clamped to 0 from above (rounding may push a certain token a hair over it).
    """
    alternatives = max(0, min(params.logprobs, LOGPROBS_MAX) - 1)
    if params.temperature <= 0.0:
        ranked = _softmax(logits, 1.0)
    else:
        kept = kept_candidates(logits, params)
        mass = sum(p for _, p in kept)
        ranked = [(t, p / mass) for t, p in kept]
    logprobs = {t: (math.log(p) if p > 0.0 else -math.inf) for t, p in ranked}
    return TokenLogprob(
        min(logprobs.get(token, -math.inf), 0.0),
        tuple((t, min(logprobs[t], 0.0)) for t, _ in ranked[:alternatives]),
    )


def mock_staged_logits(
    context: Sequence[int], stage: LaneStage, vocab_size: int = MOCK_VOCAB_SIZE
) -> list[tuple[int, float]]:
    """The mock's logits after ``context`` through a lane's stage (docs/engine.md section 2.4):
    each candidate of :func:`mock_logits` with its bias and penalties, then only the ones the
    grammar allows.  When the grammar allows none of them, the :data:`MOCK_CANDIDATES` lowest
    allowed ids stand in, at logits 0, -0.5, ... (then biased and penalised alike), so a
    constrained mock always writes what its grammar allows.  Ids not listed are -inf, so a
    bias only moves listed candidates.
    """
    logits = [(t, stage.adjusted(t, v)) for t, v in mock_logits(context, vocab_size)]
    if stage.matcher is None:
        return logits
    allowed = stage.matcher.allowed()
    allowed = allowed[allowed < vocab_size]
    kept = [(t, v) for t, v in logits if _holds(allowed, t)]
    if kept:
        return kept
    return [
        (int(t), stage.adjusted(int(t), -MOCK_LOGIT_STEP * rank))
        for rank, t in enumerate(allowed[:MOCK_CANDIDATES])
    ]


def _holds(ascending: Any, token: int) -> bool:
    index = int(ascending.searchsorted(token))
    return index < len(ascending) and int(ascending[index]) == token


def mock_token(
    context: Sequence[int], params: GenParams, position: int, vocab_size: int = MOCK_VOCAB_SIZE
) -> int:
    """The mock engine's next token after ``context`` under ``params`` at draw ``position``.

    Greedy parameters give :func:`mock_next_token`; sampled ones draw from :func:`mock_logits`
    with ``uniform(position)``, where ``position = seed + len(context)`` (docs/engine.md
    section 2), so a sampled stream depends on the seed and continues exactly after a failover.
    """
    if params.temperature <= 0.0:
        return mock_next_token(context, vocab_size)
    return sample_sparse(mock_logits(context, vocab_size), params, position)


class MockEngineFault(Exception):
    """The failure a mock engine injects for a context that holds its ``poison_token``."""


class _MockGeneration:
    """A generation inside the mock engine."""

    def __init__(
        self, engine: MockEngine, request: GenerationRequest, on_tokens: TokenSink
    ) -> None:
        self._engine = engine
        self.request = request
        self.on_tokens = on_tokens
        self.context = list(request.context)
        self.produced: list[int] = []
        self.deadline: float | None = None
        self.cancelled = False
        self.stage: LaneStage | None = None
        """The lane's stage when the request has a constraint (it ends with the lane)."""
        self._result: defer.Deferred[GenerationResult] = defer.Deferred()

    @property
    def result(self) -> defer.Deferred[GenerationResult]:
        return self._result

    def cancel(self) -> None:
        if self._result.called or self.cancelled:
            return
        self.cancelled = True
        self._engine._leave(self)
        self._engine._reactor.callLater(
            0, self._result.callback, GenerationResult(tuple(self.produced), EngineStop.CANCELLED)
        )


class MockEngine:
    """A deterministic engine for protocol tests: no model, no threads, all on the reactor.

    Every step (``token_delay_s`` apart, or each reactor turn when 0) each running lane gets
    one token, :func:`mock_next_token` of its context.  Lanes, the queue, the context window
    and KV block accounting behave like a real engine's, so the node's scheduling and its
    capacity reports can be tested without a model.  Sampling parameters are honoured
    (:func:`mock_token`): a sampled lane draws at ``seed + len(context)`` from the mock's logits.
    A generation whose ``params.logprobs`` asks gets each token's logprob and alternatives from
    those same logits (:func:`sparse_logprob`).
    A free lane takes the first queued interactive request before any batch one.
    With a :class:`~sfnode.decoding.constraint.Vocabulary` it honours constraints: a constrained
    lane draws from :func:`mock_staged_logits`, through the same :class:`LaneStage` the
    transformers engine uses (prepared at submit, on the reactor: the mock has no thread), and
    the vocabulary's EOS ids end a lane as ``eos_token_id`` does.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        *,
        context_window: int = 4096,
        max_lanes: int = 8,
        token_delay_s: float = 0.0,
        vocab_size: int = MOCK_VOCAB_SIZE,
        n_layers: int = MOCK_LAYERS,
        eos_token_id: int | None = None,
        poison_token: int | None = None,
        supports_logprobs: bool = True,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        self._reactor = reactor
        self._supports_logprobs = supports_logprobs
        self._vocabulary = vocabulary
        self._context_window = context_window
        self._max_lanes = max(1, max_lanes)
        self._token_delay_s = token_delay_s
        self._vocab_size = vocab_size
        self._n_layers = n_layers
        self._eos_token_id = eos_token_id
        self._poison_token = poison_token
        self._queue: deque[_MockGeneration] = deque()
        self._lanes: list[_MockGeneration] = []
        self._step_call: IDelayedCall | None = None
        self._decoded = 0
        self._prefilled = 0

    @property
    def context_window(self) -> int:
        return self._context_window

    @property
    def n_layers(self) -> int:
        return self._n_layers

    @property
    def supports_logprobs(self) -> bool:
        """True unless built with ``supports_logprobs=False`` (an engine without them, for
        tests of nodes that do not offer ``FEATURE_LOGPROBS``)."""
        return self._supports_logprobs

    @property
    def supports_constraints(self) -> bool:
        """True when built with a vocabulary (a grammar needs one)."""
        return self._vocabulary is not None

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            decoded_tokens=self._decoded,
            prefilled_tokens=self._prefilled,
            queue_depth=len(self._queue),
            lanes_active=len(self._lanes),
            kv_blocks_used=sum(-(-len(g.context) // KV_BLOCK_TOKENS) for g in self._lanes),
            kv_blocks_total=-(-self._context_window // KV_BLOCK_TOKENS) * self._max_lanes,
        )

    def start(self) -> None:
        """Nothing to start: the mock runs on the reactor."""

    def stop(self) -> defer.Deferred[None]:
        """End every generation at once with CANCELLED and leave no timer behind."""
        if self._step_call is not None and self._step_call.active():
            self._step_call.cancel()
        self._step_call = None
        for generation in [*self._lanes, *self._queue]:
            generation.cancelled = True
            self._finish(generation, EngineStop.CANCELLED)
        return defer.succeed(None)

    def submit(self, request: GenerationRequest, on_tokens: TokenSink) -> Generation:
        generation = _MockGeneration(self, request, on_tokens)
        if self._context_window and len(request.context) > self._context_window:
            refusal = StreamTooLong(len(request.context), self._context_window)
            self._reactor.callLater(0, generation.result.errback, refusal)
            return generation
        if request.constraint is not None:
            try:
                if request.constraint.grammar is not None and self._vocabulary is None:
                    raise ConstraintError("this engine has no grammar support", "grammar")
                generation.stage = LaneStage.prepare(
                    self._vocabulary, request.constraint, request.context
                )
            except ConstraintError as e:
                failure = EngineRefusal(f"the constraint cannot be honoured: {e}")
                self._reactor.callLater(0, generation.result.errback, failure)
                return generation
        self._queue.append(generation)
        self._schedule()
        return generation

    def stage_forward(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> defer.Deferred[StageResult]:
        try:
            if not 0 <= start_layer <= end_layer <= self._n_layers:
                raise StageForwardError(
                    f"layers [{start_layer}, {end_layer}) are outside 0..{self._n_layers}"
                )
            if hidden_in is None:
                hidden = mock_embed(tokens)
            elif len(hidden_in) != 8:
                raise StageForwardError(f"mock hidden state is 8 bytes, got {len(hidden_in)}")
            else:
                (hidden,) = struct.unpack("<Q", hidden_in)
            hidden = mock_layers(hidden, start_layer, end_layer)
        except StageForwardError as e:
            return defer.fail(e)
        if end_layer == self._n_layers:
            return defer.succeed(StageResult(token=hidden % self._vocab_size))
        return defer.succeed(StageResult(hidden=struct.pack("<Q", hidden)))

    # The step loop.

    def _schedule(self) -> None:
        if self._step_call is None and (self._queue or self._lanes):
            self._step_call = self._reactor.callLater(self._token_delay_s, self._step)

    def _leave(self, generation: _MockGeneration) -> None:
        if generation in self._lanes:
            self._lanes.remove(generation)
        elif generation in self._queue:
            self._queue.remove(generation)

    def _finish(self, generation: _MockGeneration, stop: EngineStop) -> None:
        self._leave(generation)
        generation.result.callback(GenerationResult(tuple(generation.produced), stop))

    def _next_admitted(self) -> _MockGeneration:
        """The queued generation a free lane takes: the first interactive one, else the first
        (docs/protocol.md section 12.2; the mock keeps no lane for interactive work)."""
        for generation in self._queue:
            if generation.request.interactive:
                self._queue.remove(generation)
                return generation
        return self._queue.popleft()

    def _step(self) -> None:
        self._step_call = None
        while self._queue and len(self._lanes) < self._max_lanes:
            generation = self._next_admitted()
            self._prefilled += len(generation.context)
            if generation.request.max_wall_ms:
                generation.deadline = (
                    self._reactor.seconds() + generation.request.max_wall_ms / 1000.0
                )
            self._lanes.append(generation)
        now = self._reactor.seconds()
        for generation in list(self._lanes):
            self._advance(generation, now)
        self._schedule()

    def _advance(self, generation: _MockGeneration, now: float) -> None:
        request = generation.request
        if generation.deadline is not None and now >= generation.deadline:
            self._finish(generation, EngineStop.EXPIRED)
            return
        if len(generation.produced) >= request.max_new or (
            self._context_window and len(generation.context) >= self._context_window
        ):
            self._finish(generation, EngineStop.LENGTH)
            return
        if self._poison_token is not None and self._poison_token in generation.context:
            self._leave(generation)
            generation.result.errback(MockEngineFault("the context holds the poison token"))
            return
        params = request.params
        position = draw_position(params.seed, len(request.context), len(generation.produced))
        stage = generation.stage
        if stage is None:
            token = mock_token(generation.context, params, position, self._vocab_size)
            logits = None
        else:
            logits = mock_staged_logits(generation.context, stage, self._vocab_size)
            token = sample_sparse(logits, params, position)
            stage.advance(token)
        logprob = None
        if params.logprobs > 0 and self._supports_logprobs:
            if logits is None:
                logits = mock_logits(generation.context, self._vocab_size)
            logprob = sparse_logprob(logits, params, token)
        generation.context.append(token)
        generation.produced.append(token)
        self._decoded += 1
        generation.on_tokens(TokenBatch((token,), None if logprob is None else (logprob,)))
        if generation.cancelled or generation.result.called:
            return
        if token == self._eos_token_id or (
            self._vocabulary is not None and token in self._vocabulary.eos_ids
        ):
            self._finish(generation, EngineStop.EOS)
        elif len(generation.produced) >= request.max_new:
            self._finish(generation, EngineStop.LENGTH)
