"""What one engine step does, as plain data: the scheduler writes a :class:`StepPlan`, a model
runner executes it and answers with a :class:`StepOutput`.

A plan names lanes by their KV *slot* (a runner keeps one contiguous KV region per slot) and says,
for one forward pass over the model: which slots decode one token (``decode``), which prompt
chunks are computed into which slots (``chunks``), which cached KV blocks are copied into a slot
before the pass (``loads``) and which of a slot's full blocks are copied into the prefix cache's
block pool (``saves``).  docs/engine.md section 3 describes the step.  A decode row may
carry a *draft* (section 3.1): tokens guessed to follow the one it samples, computed in the same
pass at the next positions and kept as far as the sampler would have drawn them.  A row that
samples for a constrained lane carries the lane's :class:`~sfnode.decoding.constraint.LaneStage`:
the one mutable thing a plan holds, touched only by the runner that executes the plan.

This module must never import torch, a runner or a scheduler: it is the contract between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sfnode.decoding.constraint import LaneStage
from sfnode.generation import TokenLogprob
from sfnode.linkf.wire import GenParams


@dataclass(frozen=True)
class DecodeRow:
    """One new token for the lane in ``slot``: feed ``token`` at ``position``, sample the next."""

    slot: int
    token: int
    position: int
    params: GenParams
    draw: int
    """The sampler's counter for the token this row produces (docs/engine.md section 2)."""
    stage: LaneStage | None = None
    """The lane's stage between its logits and the draw (docs/engine.md section 2.4), which
    the runner advances by the token it draws."""
    draft: tuple[int, ...] = ()
    """Tokens guessed to follow the one this row samples (docs/engine.md section 3.1): fed at
    ``position + 1 ..`` in the same pass; the token sampled after each accepted one is kept,
    up to the first guess the sampler does not draw."""

    @property
    def rows(self) -> int:
        """Token rows this decode row takes in the pass (itself and its draft)."""
        return 1 + len(self.draft)


@dataclass(frozen=True)
class ChunkRow:
    """Prompt tokens ``tokens`` at positions ``start ..`` of the lane in ``slot``.

    When ``last`` is true the chunk ends the prompt and its last position's logits give the lane's
    first token (sampled with ``params`` at ``draw``); otherwise nothing is sampled.
    """

    slot: int
    start: int
    tokens: tuple[int, ...]
    last: bool
    params: GenParams
    draw: int
    stage: LaneStage | None = None
    """As :attr:`DecodeRow.stage`, for the first token of a ``last`` chunk."""


@dataclass(frozen=True)
class BlockCopy:
    """KV blocks between a slot and the block pool: lane block ``first + i`` is pool block
    ``blocks[i]``; of the last block only its first ``tail`` positions (a load that ends
    inside a block)."""

    slot: int
    first: int
    blocks: tuple[int, ...]
    tail: int = 16


@dataclass(frozen=True)
class StepPlan:
    """One forward pass.  Order of work: ``saves`` (blocks earlier steps computed, of lanes
    running or ended, whose slot a load may now reuse), then ``loads``, then the pass."""

    decode: tuple[DecodeRow, ...] = ()
    chunks: tuple[ChunkRow, ...] = ()
    loads: tuple[BlockCopy, ...] = ()
    saves: tuple[BlockCopy, ...] = ()

    @property
    def rows(self) -> int:
        """Token rows the pass computes."""
        return sum(row.rows for row in self.decode) + sum(len(c.tokens) for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.chunks or self.loads or self.saves)


@dataclass(frozen=True)
class StepOutput:
    """What a runner answers: one token per decode row, and per chunk its first token or None;
    with each token its logprobs when its row's ``params.logprobs`` asks for them."""

    decode: tuple[int, ...] = ()
    chunks: tuple[int | None, ...] = field(default=())
    decode_logprobs: tuple[TokenLogprob | None, ...] = ()
    """Empty when no decode row asked for logprobs."""
    chunk_logprobs: tuple[TokenLogprob | None, ...] = ()
    """Empty when no chunk asked for logprobs."""
    drafted: tuple[tuple[int, ...], ...] = ()
    """Per decode row, the tokens sampled after its first one at the positions its accepted
    draft tokens opened (so ``drafted[r][i]`` follows ``draft[i]``); empty when no row had a
    draft."""
    drafted_logprobs: tuple[tuple[TokenLogprob | None, ...], ...] = ()
    """Their logprobs, as :attr:`decode_logprobs`; empty when no row asked for logprobs or
    had a draft."""
