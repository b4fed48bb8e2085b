"""The sampler of docs/engine.md section 2 over sparse logits, in pure Python float64: what the
mock engine's runner draws with (:mod:`sfnode.engines.mock`).

Logits are a list of (token id, logit) of their finite entries; every id not listed is -inf.
The rule is the one :mod:`sfnode.decoding.sampler` applies to a model's dense float32 logits
with torch (temperature, top-k, min-p, top-p over candidates sorted by probability, ties to the
lower id, then the draw ``target = uniform(position) * kept mass``), and the two draw the same
tokens from the same logits (tests/test_sampling.py).  It is a second implementation because
the mock must never import torch, and its float64 values are what the tests pin.

This module must never keep state, use a random generator or import torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sfnode.decoding.draws import uniform
from sfnode.generation import TokenLogprob
from sfnode.linkf.wire import LOGPROBS_MAX, GenParams

SparseLogits = Sequence[tuple[int, float]]
"""(token id, logit) of the finite entries; every other id is -inf."""


def kept_candidates(logits: SparseLogits, params: GenParams) -> list[tuple[int, float]]:
    """The candidates the sampler draws from, as (token id, probability) best first, ties to
    the lower id.

    Greedy parameters keep the one best token (probability 1).  Otherwise: the softmax of the
    logits over ``temperature``, then top-k, min-p and top-p; the probabilities are those of
    the full softmax (not renormalised).
    """
    if params.temperature <= 0.0:
        return [(min(logits, key=lambda entry: (-entry[1], entry[0]))[0], 1.0)]
    ranked = softmax(logits, params.temperature)
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


def softmax(logits: SparseLogits, temperature: float) -> list[tuple[int, float]]:
    """softmax(logits / temperature) as (token id, probability), best first, ties to the lower
    id."""
    best = max(logit for _, logit in logits)
    weights = [(token, math.exp((logit - best) / temperature)) for token, logit in logits]
    total = sum(weight for _, weight in weights)
    return sorted(
        ((token, weight / total) for token, weight in weights),
        key=lambda entry: (-entry[1], entry[0]),
    )


def sample_sparse(logits: SparseLogits, params: GenParams, position: int) -> int:
    """The token drawn from ``logits`` under ``params`` at draw counter ``position``: the kept
    candidates (:func:`kept_candidates`), then ``target = uniform(position) * kept mass``."""
    kept = kept_candidates(logits, params)
    if params.temperature <= 0.0:
        return kept[0][0]
    target = uniform(position) * sum(p for _, p in kept)
    for token, p in kept:
        if target < p:
            return token
        target -= p
    return [token for token, p in kept if p > 0.0][-1]


def sparse_logprob(logits: SparseLogits, params: GenParams, token: int) -> TokenLogprob:
    """``token``'s logprob in the distribution the sampler drew it from, and the
    ``params.logprobs - 1`` most likely tokens there (docs/protocol.md section 12.1).

    Greedy: the softmax of the logits, unfiltered, so the chosen (best) token's logprob is the
    first alternative's.  Sampled: the softmax of ``logits / temperature`` over the candidates
    top-k, min-p and top-p keep, renormalised; tokens outside them are never listed.  Values
    are clamped to 0 from above (rounding may push a certain token a hair over it).
    """
    alternatives = max(0, min(params.logprobs, LOGPROBS_MAX) - 1)
    if params.temperature <= 0.0:
        ranked = softmax(logits, 1.0)
    else:
        kept = kept_candidates(logits, params)
        mass = sum(p for _, p in kept)
        ranked = [(t, p / mass) for t, p in kept]
    logprobs = {t: (math.log(p) if p > 0.0 else -math.inf) for t, p in ranked}
    return TokenLogprob(
        min(logprobs.get(token, -math.inf), 0.0),
        tuple((t, min(logprobs[t], 0.0)) for t, _ in ranked[:alternatives]),
    )
