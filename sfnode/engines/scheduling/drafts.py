"""Drafts for speculative decoding by prompt lookup (docs/engine.md section 3.1).

A lane's next tokens are guessed from its own context: when the last few tokens (an n-gram)
occurred earlier in the prompt or the output, the tokens that followed them there are the draft.
Agents' work (repeating, quoting, fixing text they were given) copies long runs of the prompt,
and there such drafts are mostly right.  The runner then verifies a lane's draft in one forward
pass of its rows, and the sampler's own rule decides which drafted tokens stand, so drafting
changes how fast tokens come, never which tokens come.

:class:`PromptLookup` keeps, per n-gram size, where each n-gram of the lane's tokens last
ended, updated as tokens are appended, so a draft costs a few dictionary lookups whatever the
context's length.  :class:`DraftLength` adapts how many tokens a lane drafts to how many of its
last drafts were accepted: a verified row costs a share of a step's time, so a lane whose drafts
fail drafts little.

This module is pure: it must never import torch, touch a model, a thread or the reactor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

NGRAM_MIN = 3
"""The shortest n-gram a draft is looked up by (shorter ones match too often by chance)."""
NGRAM_MAX = 5
"""The longest n-gram a draft is looked up by (the longest match is tried first)."""


@dataclass(frozen=True)
class Speculation:
    """How the scheduler drafts (``--speculative ngram``, ``--draft-tokens``)."""

    draft_tokens: int = 4
    """The most tokens drafted for one lane in one step."""
    ngram_min: int = NGRAM_MIN
    ngram_max: int = NGRAM_MAX

    def __post_init__(self) -> None:
        if self.draft_tokens < 1:
            raise ValueError("draft_tokens must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("the n-gram sizes must satisfy 1 <= ngram_min <= ngram_max")


class PromptLookup:
    """The n-gram index of one lane's tokens (see the module docstring)."""

    def __init__(self, tokens: Iterable[int], *, ngram_min: int, ngram_max: int) -> None:
        self._sizes = tuple(range(ngram_max, ngram_min - 1, -1))
        self._tokens: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._sizes}
        """Per size n: an n-gram -> the index of the token that followed its last occurrence
        (only occurrences that have a following token are indexed)."""
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """The lane's next tokens, in order."""
        own = self._tokens
        for token in tokens:
            end = len(own)
            for n, index in self._ends.items():
                if end >= n:
                    index[tuple(own[end - n : end])] = end
            own.append(int(token))

    def draft(self, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens that followed the last earlier occurrence of the longest
        n-gram the tokens end with; empty when none occurred before."""
        own = self._tokens
        if limit < 1:
            return ()
        for n in self._sizes:
            if len(own) <= n:
                continue
            follows = self._ends[n].get(tuple(own[-n:]))
            if follows is not None:
                return tuple(own[follows : follows + limit])
        return ()


class DraftLength:
    """How many tokens a lane drafts next: all ``most`` after a draft that was accepted whole,
    one more than were accepted after one that was not, and after ``patience`` drafts in a
    row of which nothing was accepted, none for as many steps (then one token again)."""

    def __init__(self, most: int, *, patience: int = 2) -> None:
        self.most = most
        self._next = most
        self._patience = patience
        self._misses = 0
        self._resting = 0

    def budget(self) -> int:
        """The most tokens to draft in this step (0: do not draft)."""
        if self._resting:
            self._resting -= 1
            return 0
        return self._next

    def verified(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens had its first ``accepted`` ones accepted."""
        if drafted <= 0:
            return
        if accepted >= drafted:
            self._next = self.most
            self._misses = 0
            return
        self._next = max(1, min(self.most, accepted + 1))
        if accepted:
            self._misses = 0
            return
        self._misses += 1
        if self._misses >= self._patience:
            self._resting = self._misses
            self._next = 1
