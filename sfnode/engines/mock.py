"""The mock engine: the real engine loop with a pretend forward pass, for protocol tests and
``--engine mock``.

:class:`MockEngine` is :class:`~sfnode.engines.loop.EngineLoop`, the transformers engine's own
loop: the real :class:`~sfnode.engines.scheduling.scheduler.Scheduler` plans every step, with its
admission, interactive lanes, prompt chunks, prefix cache, cancellation, deadlines, KV-block
accounting and statistics, and the loop's refusals and stage forwards.  Only the forward pass is
pretend: :class:`MockRunner` executes the plans over each KV slot's tokens instead of keys and
values, and its logits are a pure function of a slot's tokens, :func:`mock_logits`, whose best
candidate is :func:`mock_next_token` (the full 24-layer staged forward of docs/protocol.md section
7.6, mod the vocabulary).  It samples with the sparse form of the sampler
(:mod:`sfnode.decoding.sparse_sampler`) at the draws the scheduler gives, and with a
:class:`~sfnode.decoding.constraint.Vocabulary` it honours constraints through the same
:class:`~sfnode.decoding.constraint.LaneStage` the transformers engine uses.

Steps run on the reactor (:class:`ReactorWorker`), ``token_delay_s`` after they are planned (the
next reactor turn when 0): no thread, no model.  Their time is not measured, so steps are sized
in tokens only (``step_ms`` does not apply).  A context holding ``poison_token`` makes the step
that computes it fail, as a failing forward pass would.

This module must never import torch (a head and its tests run the mock), start a thread, or keep
state its outputs depend on other than the slots' tokens.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import xxhash
from twisted.internet import defer, task
from twisted.internet.interfaces import IReactorTime

from sfnode.decoding.constraint import LaneStage, Vocabulary
from sfnode.decoding.sparse_sampler import SparseLogits, sample_sparse, sparse_logprob
from sfnode.engines.config import EngineConfig
from sfnode.engines.loop import EngineLoop, RunnerTraits
from sfnode.engines.scheduling.plan import BlockCopy, StepOutput, StepPlan
from sfnode.engines.scheduling.stages import KeptRows
from sfnode.generation import PrefixFigures, StageForwardError, StageResult, TokenLogprob
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS
from sfnode.linkf.wire import GenParams

T = TypeVar("T")

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
    """The failure a mock engine's step raises for a context that holds its ``poison_token``."""


class MockRunner:
    """The mock's forward pass: executes plans over ``slots`` slots of tokens (its KV) and a
    pool of blocks of tokens (the prefix cache's), sampling from :func:`mock_logits`."""

    def __init__(
        self, traits: RunnerTraits, slots: int, poison_token: int | None, logprobs: bool
    ) -> None:
        self._slots: list[list[int]] = [[] for _ in range(slots)]
        self._pool: dict[int, tuple[int, ...]] = {}
        self._vocab_size = traits.vocab_size
        self._n_layers = traits.n_layers
        self._poison_token = poison_token
        self._logprobs = logprobs
        """Whether rows that ask get their logprobs (False: a model without them)."""

    def run(self, plan: StepPlan) -> StepOutput:
        """Saves, loads, then each row: its tokens into its slot, and what it samples."""
        for save in plan.saves:
            self._save(save)
        for load in plan.loads:
            self._load(load)
        decode: list[int] = []
        decode_logprobs: list[TokenLogprob | None] = []
        for row in plan.decode:
            if row.draft:
                raise ValueError("the mock runner does not verify drafts")
            context = self._write(row.slot, row.position, (row.token,))
            token, logprob = self._sample(context, row.params, row.draw, row.stage)
            decode.append(token)
            decode_logprobs.append(logprob)
        chunks: list[int | None] = []
        chunk_logprobs: list[TokenLogprob | None] = []
        for chunk in plan.chunks:
            context = self._write(chunk.slot, chunk.start, chunk.tokens)
            first: tuple[int | None, TokenLogprob | None] = (None, None)
            if chunk.last:
                first = self._sample(context, chunk.params, chunk.draw, chunk.stage)
            chunks.append(first[0])
            chunk_logprobs.append(first[1])
        return StepOutput(
            decode=tuple(decode),
            chunks=tuple(chunks),
            decode_logprobs=tuple(decode_logprobs) if any(decode_logprobs) else (),
            chunk_logprobs=tuple(chunk_logprobs) if any(chunk_logprobs) else (),
        )

    def _write(self, slot: int, start: int, tokens: Sequence[int]) -> list[int]:
        """Put ``tokens`` at positions ``start ..`` of ``slot``; its tokens up to them."""
        context = self._slots[slot]
        del context[start:]
        context.extend(tokens)
        if self._poison_token is not None and self._poison_token in context:
            raise MockEngineFault("the context holds the poison token")
        return context

    def _sample(
        self, context: Sequence[int], params: GenParams, draw: int, stage: LaneStage | None
    ) -> tuple[int, TokenLogprob | None]:
        logits: SparseLogits | None = None
        if stage is None:
            token = mock_token(context, params, draw, self._vocab_size)
        else:
            logits = mock_staged_logits(context, stage, self._vocab_size)
            token = sample_sparse(logits, params, draw)
            stage.advance(token)
        if params.logprobs <= 0 or not self._logprobs:
            return token, None
        if logits is None:
            logits = mock_logits(context, self._vocab_size)
        return token, sparse_logprob(logits, params, token)

    def _save(self, save: BlockCopy) -> None:
        tokens = self._slots[save.slot]
        for index, block in enumerate(save.blocks):
            first = (save.first + index) * KV_BLOCK_TOKENS
            self._pool[block] = tuple(tokens[first : first + KV_BLOCK_TOKENS])

    def _load(self, load: BlockCopy) -> None:
        tokens: list[int] = []
        for index, block in enumerate(load.blocks):
            last = index == len(load.blocks) - 1
            tokens.extend(self._pool[block][: load.tail if last else KV_BLOCK_TOKENS])
        self._write(load.slot, load.first * KV_BLOCK_TOKENS, tokens)

    def stage(
        self, tokens: Sequence[int], start: int, end: int, hidden_in: int | None
    ) -> StageResult:
        """Pretend layers ``[start, end)`` over the tokens' embedding or ``hidden_in``; the
        last stage answers the greedy token."""
        hidden = mock_embed(tokens) if hidden_in is None else hidden_in
        hidden = mock_layers(hidden, start, end)
        if end == self._n_layers:
            return StageResult(token=hidden % self._vocab_size)
        return StageResult(hidden=struct.pack("<Q", hidden))


class MockStages:
    """The mock's kept stage sessions (docs/protocol.md section 12.8): a first stage keeps each
    slot's tokens, and each row's state is the stateless state of the context up to that row;
    a later stage maps each 8-byte row through its layers."""

    def __init__(self, slots: int, n_layers: int, vocab_size: int) -> None:
        self.slots = slots
        self.prefix_figures: PrefixFigures | None = None
        """The mock reuses no prefixes."""
        self._tokens: list[list[int]] = [[] for _ in range(slots)]
        self._n_layers = n_layers
        self._vocab_size = vocab_size

    def read_rows(self, blob: bytes) -> list[int]:
        """``8n`` bytes: one little-endian u64 per row."""
        if not blob or len(blob) % 8:
            raise StageForwardError(f"mock rows are 8 bytes each, got {len(blob)} bytes")
        return list(struct.unpack(f"<{len(blob) // 8}Q", blob))

    def forward(self, batch: Sequence[KeptRows]) -> list[StageResult | StageForwardError]:
        """Each request of the batch in turn (a pretend pass: nothing is shared)."""
        return [self._forward(rows) for rows in batch]

    def _forward(self, rows: KeptRows) -> StageResult:
        if rows.hidden is None:
            context = self._tokens[rows.slot] = [*self._tokens[rows.slot][: rows.position]]
            states = []
            for token in rows.tokens:
                context.append(int(token))
                states.append(mock_embed(context))
        else:
            states = list(rows.hidden)
        states = [mock_layers(h, rows.start, rows.end) for h in states]
        if rows.end == self._n_layers:
            return StageResult(token=states[-1] % self._vocab_size)
        return StageResult(hidden=struct.pack(f"<{len(states)}Q", *states))


class ReactorWorker:
    """Runs a step on the reactor ``delay_s`` after it is sent (the mock's pretend forward
    time), and everything else at once; a step not run yet is dropped when the engine stops."""

    def __init__(self, reactor: IReactorTime, runner: MockRunner, delay_s: float) -> None:
        self._reactor = reactor
        self._runner = runner
        self._delay_s = delay_s
        self._pending: defer.Deferred[tuple[StepOutput, float]] | None = None
        self.rests = 0
        """How many times the engine ran out of work (:meth:`rest`)."""

    def start(self) -> None:
        """Nothing to start: the reactor runs the steps."""

    def step(self, plan: StepPlan) -> defer.Deferred[tuple[StepOutput, float]]:
        """The step's output ``delay_s`` from now; its time is that pretend delay."""
        self._pending = task.deferLater(self._reactor, self._delay_s, self._run, plan)
        return self._pending

    def _run(self, plan: StepPlan) -> tuple[StepOutput, float]:
        self._pending = None
        return self._runner.run(plan), self._delay_s

    def call(self, work: Callable[..., T], *args: Any) -> defer.Deferred[T]:
        return defer.maybeDeferred(work, *args)

    def compile_grammar(self, work: Callable[..., T], *args: Any) -> defer.Deferred[T]:
        """At once, on the reactor (the mock has no thread)."""
        return defer.maybeDeferred(work, *args)

    def rest(self) -> None:
        """Counted (the mock holds nothing a step alone needs)."""
        self.rests += 1

    def interrupt(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.cancel()

    def stop(self) -> None:
        """Nothing to release."""


MOCK_CONTEXT_WINDOW = 4096
"""The mock's context window when its configuration gives none."""
MOCK_CONFIG = EngineConfig(context_window=MOCK_CONTEXT_WINDOW)
"""The mock's configuration unless it is given one: the engine defaults of ``twistd sfnode``."""


class MockEngine(EngineLoop):
    """A deterministic engine for protocol tests: the engine loop with :class:`MockRunner`
    (see the module); every step runs ``token_delay_s`` after it is planned.

    ``config`` is the same value the transformers engine takes (lanes, KV blocks, prompt chunks,
    interactive lanes, the prefix cache); without a ``context_window`` the mock's is
    :data:`MOCK_CONTEXT_WINDOW`; the weights and kernels fields, speculation and ``step_ms`` do
    not apply.  The pretend model has ``vocab_size`` tokens (its contexts may hold any u32 id: its
    embedding hashes them) and ``n_layers`` layers; EOS is
    ``eos_token_id`` and, with a ``vocabulary``, the vocabulary's EOS ids.
    """

    path = "mock"

    def __init__(
        self,
        reactor: IReactorTime,
        config: EngineConfig = MOCK_CONFIG,
        *,
        token_delay_s: float = 0.0,
        vocab_size: int = MOCK_VOCAB_SIZE,
        n_layers: int = MOCK_LAYERS,
        eos_token_id: int | None = None,
        poison_token: int | None = None,
        supports_logprobs: bool = True,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        if config.context_window is None:
            config = replace(config, context_window=MOCK_CONTEXT_WINDOW)
        eos_ids = set(vocabulary.eos_ids) if vocabulary is not None else set()
        if eos_token_id is not None:
            eos_ids.add(eos_token_id)
        traits = RunnerTraits(
            n_layers=n_layers,
            vocab_size=vocab_size,
            eos_ids=frozenset(eos_ids),
            # Its pretend embedding hashes any u32 token, as a head's tokenizer may give it.
            context_ids=1 << 32,
            salt=b"mock",
            block_copies=True,
            timed=False,
        )
        runner = MockRunner(traits, config.max_lanes, poison_token, supports_logprobs)
        super().__init__(
            config,
            traits,
            runner,
            ReactorWorker(reactor, runner, token_delay_s),
            clock=reactor.seconds,
            vocabulary=vocabulary,
            supports_logprobs=supports_logprobs,
            stages=MockStages(config.max_lanes, n_layers, vocab_size),
        )

    def read_hidden(self, blob: bytes) -> int:
        """The mock's hidden state is one u64, little-endian (docs/protocol.md section 7.6)."""
        if len(blob) != 8:
            raise StageForwardError(f"mock hidden state is 8 bytes, got {len(blob)}")
        (hidden,) = struct.unpack("<Q", blob)
        return int(hidden)
