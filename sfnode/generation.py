"""The engine contract of the node: what an engine is asked and what it answers.

The node agent talks to its engine only through :class:`Engine` (docs/engine.md section 1):

1. ``submit`` a streamed generation; its tokens come back on the reactor thread as
   :class:`TokenBatch` values through the ``on_tokens`` callback (the same value the head
   passes on to its HTTP writer), and the generation's :class:`GenerationResult` through a
   Deferred;
2. ``statistics`` for NODE_STATUS;
3. ``context_window`` (``max_context_tokens`` in the capacity summary);
4. ``stage_forward`` for pipeline stages (docs/protocol.md section 7.6).

An engine that serves an embedding model is also an :class:`Embedder` (``embed``: texts in,
one vector each out, docs/protocol.md section 12.7); it generates nothing.

Every callback and every Deferred of an engine fires on the reactor thread.  An engine that
computes on a worker thread crosses back with ``reactor.callFromThread`` and nothing else.

The engines themselves live in :mod:`sfnode.engines` (the loop they share, the transformers
engine, the mock engine of the protocol tests).  This module must never import torch or any
part of sfnode but the wire core: the node and the head both read it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

from twisted.internet import defer

from sfnode.linkf.wire import Constraint, GenParams


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


class EmbeddingError(Exception):
    """Texts an embedder cannot embed (it is stopped, or its run failed)."""


@dataclass(frozen=True)
class Embedded:
    """The answer of an embedding: one vector of ``dim`` little-endian float32 per text,
    row-major (EMBED_RESP's ``vectors``), and the tokens the texts took."""

    vectors: bytes
    dim: int
    tokens: int


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
    closed: bool = False
    """The generation's budget closed its grammar's output: it ended with EOS, its last tokens
    held to the shortest closing (docs/engine.md section 2.4; the Finish's ``detail``,
    docs/protocol.md section 12.6)."""


@dataclass(frozen=True)
class StepFigures:
    """An engine's steps since start (docs/engine.md sections 3 and 3.1)."""

    steps: int = 0
    """Forward passes run (decode and prompt rows together count once)."""
    decode_rows: int = 0
    """Decode rows computed (one per decoding lane per step, however long its draft)."""
    decode_tokens: int = 0
    """Tokens those rows gave (more than one a row when drafts were accepted)."""
    speculative: bool = False
    """Whether the engine drafts (speculative decoding); the two figures below count only
    then."""
    drafted: int = 0
    """Draft tokens verified."""
    accepted: int = 0
    """Draft tokens the sampler drew as drafted."""


@dataclass(frozen=True)
class PrefixFigures:
    """An engine's prefix cache: cumulative figures since start (``hits``: generations that
    reused at least one block, ``misses``: generations that reused nothing, the context tokens
    reused, the blocks saved and evicted), and the blocks held now."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    saved_blocks: int = 0
    evictions: int = 0
    cached_blocks: int = 0

    def __add__(self, other: PrefixFigures) -> PrefixFigures:
        """Two caches' figures together."""
        return PrefixFigures(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(PrefixFigures))
        )


@dataclass(frozen=True)
class MaskFigures:
    """The grammar masks an engine computed for constrained rows (docs/engine.md section 2.4)."""

    masks: int = 0
    seconds: float = 0.0
    """Spent computing them, beside the forward passes."""
    wait_seconds: float = 0.0
    """Steps waited for them after their forward pass."""


@dataclass(frozen=True)
class WeightFigures:
    """The weights an engine holds against the files it read them from (docs/engine.md
    section 5.4): a quantized file's blocks are held as stored, so ``held_bytes`` stays near
    ``file_bytes``."""

    held_bytes: int
    """Bytes of the weights its step reads (a file's maps counted whole)."""
    file_bytes: int
    """Bytes of the weight files read."""
    resident_bytes: int | None = None
    """Of ``held_bytes``, those resident now: a table read a row at a time has only the pages
    of the rows read since the engine last rested (None: not known, all of them)."""

    @property
    def ratio(self) -> float:
        """Held per file byte (0 for an engine that read no file)."""
        return self.held_bytes / self.file_bytes if self.file_bytes else 0.0


@dataclass(frozen=True)
class EngineStatistics:
    """Live figures of an engine (docs/engine.md section 1, item 2); counters are cumulative since
    start.  The node's capacity reports read the first six; its ``/metrics`` page all of them."""

    decoded_tokens: int = 0
    prefilled_tokens: int = 0
    queue_depth: int = 0
    lanes_active: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    steps: StepFigures | None = None
    """None: an engine without steps of its own."""
    prefix: PrefixFigures | None = None
    """None: an engine without a prefix cache (not zeros, which would read as "nothing
    reused")."""
    stage_prefix: PrefixFigures | None = None
    """Its pipeline stages' prefix pools (docs/engine.md section 4), summed; None: an engine
    whose stages reuse no prefixes."""
    masks: MaskFigures | None = None
    """None: an engine that honours no constraints."""
    weights: WeightFigures | None = None
    """None: an engine that holds no weights of its own (the mock, a model object's forward)."""
    kv_bytes: int | None = None
    """Bytes of keys and values allocated now; None: an engine that does not count them."""


@dataclass(frozen=True)
class StageResult:
    """The answer of a stage forward: hidden bytes for a middle stage, a token for the last."""

    hidden: bytes | None = None
    token: int | None = None


@dataclass(frozen=True)
class StageForward:
    """A stage forward's rows and layers (docs/protocol.md section 7.6): ``tokens`` for a first
    stage, else ``hidden_in``, through layers ``[start_layer, end_layer)``."""

    tokens: tuple[int, ...]
    start_layer: int
    end_layer: int
    hidden_in: bytes | None


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
    def path(self) -> str:
        """How it computes, in a few words (``native step, q4_1 weights``, ``mock``): the node
        tells its heads (docs/protocol.md section 12.9), and the console shows it."""

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


class KeptStages(Protocol):
    """Pipeline stages that keep their KV per stage session (docs/protocol.md section 12.8)."""

    def forward(
        self, owner: Hashable, session: int, position: int, forward: StageForward
    ) -> defer.Deferred[StageResult]:
        """``forward`` against ``owner``'s ``session`` from ``position``; fails with
        :class:`StageForwardError` (the session is then dropped)."""

    def forward_all(
        self, owner: Hashable, requests: Sequence[tuple[int, int, StageForward]]
    ) -> defer.Deferred[list[StageResult | StageForwardError]]:
        """Each ``(session, position, forward)`` as :meth:`forward`, computed in one pass
        (STAGE_BATCH_REQ, docs/protocol.md section 12.8): fires with each one's answer, or
        the :class:`StageForwardError` that refused it (its session then dropped), in order."""

    def release(self, owner: Hashable, session: int | None = None) -> None:
        """Forget ``owner``'s ``session``, or every session of ``owner``."""


def kept_stages_of(engine: object) -> KeptStages | None:
    """``engine``'s kept stage sessions (:class:`StageKeeping`), None when it keeps none: one
    attribute read, where ``isinstance(engine, StageKeeping)`` walks the Protocol's members at
    every call (every stage request asks)."""
    kept: KeptStages | None = getattr(engine, "kept_stages", None)
    return kept


@runtime_checkable
class StageKeeping(Protocol):
    """An engine whose pipeline stages may keep their KV: the node then offers
    ``FEATURE_STAGE_KV`` when :attr:`kept_stages` is not None."""

    @property
    def kept_stages(self) -> KeptStages | None:
        """The kept stage sessions, or None: this engine's stages are stateless."""


@runtime_checkable
class Embedder(Protocol):
    """An engine that serves an embedding model (docs/protocol.md section 12.7): the node then
    offers ``FEATURE_EMBEDDINGS`` and answers EMBED_REQ."""

    @property
    def embedding_dim(self) -> int:
        """The length of each vector."""

    def embed(self, texts: Sequence[str]) -> defer.Deferred[Embedded]:
        """One vector per text, in order; fails with :class:`EmbeddingError`."""
