"""The counter-based random numbers every sampler in sfnode draws with (docs/engine.md section 2).

``uniform(position)`` is the splitmix64 finalizer of ``position + golden`` scaled to [0, 1), and
``position = seed + len(context) + k`` for the k-th new token.  A draw is therefore a pure
function of (seed, absolute position in the stream): the same alone or batched, and the same on
the node a session fails over to with the delivered tokens appended to its context.

Pure Python, so that the torch sampler (:mod:`sfnode.decoding.sampler`) and the mock engine's
(:mod:`sfnode.decoding.sparse_sampler`, which must never import torch) draw the very same
numbers.  This module must never keep state or use a random generator.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_TWO_POW_53 = float(1 << 53)


def splitmix64(position: int) -> int:
    """The splitmix64 finalizer of ``position + golden`` (all mod 2**64)."""
    z = (position + _GOLDEN) & _MASK64
    z ^= z >> 30
    z = (z * _MIX1) & _MASK64
    z ^= z >> 27
    z = (z * _MIX2) & _MASK64
    z ^= z >> 31
    return z


def uniform(position: int) -> float:
    """A uniform number in [0, 1) that depends only on ``position`` (53 random bits)."""
    return (splitmix64(position) >> 11) / _TWO_POW_53


def draw_position(seed: int, context_len: int, k: int) -> int:
    """The draw counter of the k-th new token (k from 0) after a context of ``context_len``."""
    return (seed + context_len + k) & _MASK64
