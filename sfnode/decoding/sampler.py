"""The exact token sampler of docs/engine.md section 2, as pure functions over float32 logits.

Per token the order is: temperature, top-k, min-p, top-p, draw.  The draw uses a counter-based
random number ``uniform(position)`` with ``position = seed + len(context) + k`` for the k-th new
token, so a draw depends only on (seed, absolute position in the stream): identical alone, batched,
or after a failover that appends the delivered tokens to the context.

This module must never keep state, use a random generator (``torch.multinomial``, ``random``),
touch a model, a thread or the reactor.  It is imported only by the transformers engine (it needs
torch); the random numbers themselves live in the all-Python :mod:`sfnode.decoding.draws`
(re-exported here), which the mock engine's sampler (:mod:`sfnode.decoding.sparse_sampler`) draws
with too.

Running sums (top-p walk, the draw) are taken in float64 over the float32 probabilities; the draw
takes the first kept candidate at which ``target`` is below the running sum, which is the
"subtract each probability until ``target < p``" walk of docs/engine.md section 2.1 done without a
Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import NDArray

from sfnode.decoding.constraint import LaneStage
from sfnode.decoding.draws import draw_position as draw_position
from sfnode.decoding.draws import splitmix64 as splitmix64
from sfnode.decoding.draws import uniform
from sfnode.generation import TokenLogprob
from sfnode.linkf.wire import GenParams

MAX_LOGPROBS = 21
"""The most ``params.logprobs`` means: the chosen token and 20 alternatives (docs/protocol.md
section 12.1)."""


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_rows(masks: NDArray[np.int32], vocab: int) -> torch.Tensor:
    """A ``[rows, vocab]`` bool tensor of a grammar bitmask (bit ``t % 32`` of word ``t // 32``
    allows token ``t``)."""
    words = torch.from_numpy(masks)
    bits = (words.unsqueeze(-1) >> _BITS) & 1
    return bits.to(torch.bool).reshape(words.shape[0], -1)[:, :vocab]


def apply_controls(logits: torch.Tensor, stages: Sequence[LaneStage | None]) -> None:
    """Each row's logit bias, then its penalties, in place (docs/engine.md section 2.4): a
    bias is added; in the repetition window a logit is divided by ``repetition_penalty`` (or
    multiplied by it when not positive); a token the generation produced ``c`` times loses
    ``c * frequency_penalty + presence_penalty``.  The float32 form of
    :meth:`sfnode.decoding.constraint.LaneStage.adjusted`."""
    vocab = logits.shape[-1]
    for row, stage in enumerate(stages):
        if stage is None or stage.controls is None:
            continue
        line = logits[row]
        if stage.bias:
            pairs = [(t, b) for t, b in stage.bias.items() if t < vocab]
            if pairs:
                ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
                values = torch.tensor([b for _, b in pairs], dtype=logits.dtype)
                line.index_add_(0, ids, values)
        penalties = [p for p in stage.penalties() if p.token < vocab]
        if not penalties:
            continue
        controls = stage.controls
        ids = torch.tensor([p.token for p in penalties], dtype=torch.long)
        values = line[ids]
        repeated = torch.tensor([p.repeated for p in penalties], dtype=torch.bool)
        if bool(repeated.any()):
            r = float(controls.repetition_penalty)
            values = torch.where(repeated, torch.where(values <= 0, values * r, values / r), values)
        counts = torch.tensor([p.count for p in penalties], dtype=logits.dtype)
        values = values - (
            counts * controls.frequency_penalty
            + (counts > 0).to(logits.dtype) * controls.presence_penalty
        )
        line[ids] = values


def sample_with_stages(
    logits: torch.Tensor,
    params: Sequence[GenParams],
    positions: Sequence[int],
    stages: Sequence[LaneStage | None],
    allowed: torch.Tensor | None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row through each row's stage (docs/engine.md section 2.4): the grammar's
    mask (``allowed``, None when no row is constrained), the bias and penalties, then the
    sampler; logprobs for the rows that ask (of the distribution drawn from); then each stage
    advances by its row's token.  ``logits`` is changed in place."""
    if allowed is not None:
        logits.masked_fill_(~allowed, float("-inf"))
    apply_controls(logits, stages)
    tokens = sample_tokens(logits, params, positions)
    logprobs = token_logprobs(logits, params, tokens) if any(p.logprobs for p in params) else []
    for stage, token in zip(stages, tokens, strict=True):
        if stage is not None:
            stage.advance(token)
    return tokens, logprobs


def greedy_token(logits: torch.Tensor) -> int:
    """Argmax of one logits row; ties go to the lowest token id."""
    return int(torch.argmax(logits).item())


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Row-wise argmax of a ``[batch, vocab]`` logits tensor; ties go to the lowest id."""
    return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]


def candidates(logits: torch.Tensor, params: GenParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept candidates (ids, full-softmax probabilities), best first, after top-k/min-p/top-p.

    ``params.temperature`` must be > 0.  Candidates are sorted by probability descending, ties by
    lower id; at least one candidate is always kept.
    """
    row = logits.reshape(-1).to(torch.float32)
    temperature = torch.tensor(params.temperature, dtype=torch.float32)
    probs = torch.softmax(row / temperature, dim=-1)
    # Stable descending sort keeps equal probabilities in id order: ties go to the lower id.
    sorted_probs, sorted_ids = torch.sort(probs, descending=True, stable=True)
    keep = sorted_probs.shape[0]
    if params.top_k > 0:
        keep = min(keep, params.top_k)
    if params.min_p > 0.0:
        threshold = float(params.min_p) * float(sorted_probs[0].item())
        above = int((sorted_probs[:keep] >= threshold).sum().item())
        keep = max(1, above)
    if params.top_p <= 0.0:
        keep = 1
    elif params.top_p < 1.0:
        running = torch.cumsum(sorted_probs[:keep].to(torch.float64), dim=0)
        reached = torch.nonzero(running >= float(params.top_p))
        if reached.numel() > 0:
            keep = int(reached[0].item()) + 1
    return sorted_ids[:keep], sorted_probs[:keep]


def draw(ids: torch.Tensor, probs: torch.Tensor, u: float) -> int:
    """Pick among kept candidates with ``target = u * sum(probs)`` (docs/engine.md section 2.1)."""
    running = torch.cumsum(probs.to(torch.float64), dim=0)
    total = float(running[-1].item())
    target = u * total
    hit = torch.nonzero(running > target)
    if hit.numel() > 0:
        return int(ids[int(hit[0].item())].item())
    nonzero = torch.nonzero(probs > 0)
    if nonzero.numel() == 0:
        return int(ids[0].item())
    return int(ids[int(nonzero[-1].item())].item())


def sample_token(logits: torch.Tensor, params: GenParams, position: int) -> int:
    """The token of one logits row under ``params`` at stream counter ``position``."""
    if params.temperature <= 0.0:
        return greedy_token(logits)
    ids, probs = candidates(logits, params)
    if ids.shape[0] == 1:
        return int(ids[0].item())
    return draw(ids, probs, uniform(position))


def sample_tokens(
    logits: torch.Tensor, params: Sequence[GenParams], positions: Sequence[int]
) -> list[int]:
    """One token per row of a ``[batch, vocab]`` logits tensor; greedy rows share one argmax."""
    out = greedy_tokens(logits)
    for row, (p, position) in enumerate(zip(params, positions, strict=True)):
        if p.temperature > 0.0:
            out[row] = sample_token(logits[row], p, position)
    return out


def token_logprob(logits: torch.Tensor, params: GenParams, token: int) -> TokenLogprob:
    """``token``'s log probability in the distribution it was drawn from, and the
    ``params.logprobs - 1`` most likely tokens there (docs/protocol.md section 12.1).

    Greedy rows use the softmax of the raw logits; sampled rows the candidates ``candidates``
    keeps, renormalised, so tokens outside them are never listed.  Values are clamped to 0 from
    above (rounding can push a certain token's log probability a hair over it).
    """
    alternatives = max(0, min(params.logprobs, MAX_LOGPROBS) - 1)
    row = logits.reshape(-1).to(torch.float32)
    if params.temperature <= 0.0:
        logprobs = torch.log_softmax(row, dim=-1)
        chosen = float(logprobs[token].item())
        top: list[tuple[int, float]] = []
        if alternatives:
            # A few more than asked, then ties ordered by the lower id, as the sampler does.
            k = min(row.shape[0], alternatives + 8)
            values, ids = torch.topk(logprobs, k)
            pairs = sorted(
                zip(ids.tolist(), values.tolist(), strict=True), key=lambda p: (-p[1], p[0])
            )
            # A grammar's mask leaves tokens at probability 0: they are never alternatives.
            top = [p for p in pairs if p[1] != float("-inf")][:alternatives]
    else:
        ids, probs = candidates(row, params)
        kept = torch.log(probs.to(torch.float64) / probs.to(torch.float64).sum())
        position = int(torch.nonzero(ids == token)[0].item()) if bool((ids == token).any()) else -1
        chosen = float(kept[position].item()) if position >= 0 else float("-inf")
        top = [
            (i, v) for i, v in zip(ids.tolist(), kept.tolist(), strict=True) if v != float("-inf")
        ][:alternatives]
    return TokenLogprob(min(chosen, 0.0), tuple((int(i), min(float(v), 0.0)) for i, v in top))


def token_logprobs(
    logits: torch.Tensor, params: Sequence[GenParams], tokens: Sequence[int]
) -> list[TokenLogprob | None]:
    """:func:`token_logprob` for each row whose ``params.logprobs`` asks for it, else None."""
    return [
        token_logprob(logits[row], p, token) if p.logprobs > 0 else None
        for row, (p, token) in enumerate(zip(params, tokens, strict=True))
    ]
