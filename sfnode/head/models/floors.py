"""The fewest tokens a constrained answer needs, per model: what the head checks a request's
``max_tokens`` against before placing it (docs/api.md "Budgets"; docs/protocol.md section
12.6, "Before placing").

A node closes a constrained output within its budget (:mod:`sfnode.decoding.closing`), but a
budget below the shortest closing at the start of the output cannot give a whole answer.
:class:`AnswerFloors` finds that length with the node's own rule
(:func:`sfnode.decoding.constraint.shortest_answer`) over the model's tokenizer, so that such a
request is a 400 naming the minimum instead of a cut structure.

The grammar library's view of a tokenizer (a :class:`~sfnode.decoding.constraint.Vocabulary`)
takes about a second to build for a 49,152-token vocabulary, so it is built once per tokenizer,
on first need, and the lengths are kept per grammar (an agent sends the same tools every turn).
Both are computed on the API's worker threads, never on the reactor.

This module must never do I/O, touch the reactor or import torch; a tokenizer without a
tokenizer JSON or an EOS gives no floor (the node still closes the output).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from sfnode.decoding.constraint import Vocabulary, grammar_text, shortest_answer
from sfnode.head.models.text import Renderer
from sfnode.linkf.wire import Grammar

KEPT_GRAMMARS = 256
"""Shortest answers kept per tokenizer, the least recently used forgotten first."""


class _Floors:
    """One tokenizer's vocabulary for the grammar library and its grammars' floors."""

    def __init__(self, vocabulary: Vocabulary | None) -> None:
        self.vocabulary = vocabulary
        self.lengths: OrderedDict[str, int | None] = OrderedDict()
        self.lock = threading.Lock()


class AnswerFloors:
    """The shortest answer of a grammar on a model's tokenizer (thread-safe: called from the
    API's workers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._floors: weakref.WeakKeyDictionary[Renderer, _Floors] = weakref.WeakKeyDictionary()

    def shortest(self, renderer: Renderer, vocab_size: int, grammar: Grammar) -> int | None:
        """The tokens of the shortest answer a node closes ``grammar``'s output with on
        ``renderer``'s tokenizer (logits ``vocab_size`` wide), its EOS included; None when it
        is not known (no tokenizer the grammar library reads, no EOS, or no closing within
        the walk's reach).

        :raises ConstraintError: the grammar cannot be built for this tokenizer.
        """
        floors = self._of(renderer, vocab_size)
        if floors.vocabulary is None:
            return None
        key = grammar_text(grammar)
        with floors.lock:
            if key in floors.lengths:
                floors.lengths.move_to_end(key)
                return floors.lengths[key]
            length = shortest_answer(floors.vocabulary, grammar)
            floors.lengths[key] = length
            while len(floors.lengths) > KEPT_GRAMMARS:
                floors.lengths.popitem(last=False)
            return length

    def _of(self, renderer: Renderer, vocab_size: int) -> _Floors:
        with self._lock:
            floors = self._floors.get(renderer)
            if floors is None:
                floors = self._floors[renderer] = _Floors(_vocabulary(renderer, vocab_size))
            return floors


def _vocabulary(renderer: Renderer, vocab_size: int) -> Vocabulary | None:
    """The grammar library's view of ``renderer``'s tokenizer, or None when it has no
    tokenizer JSON or no EOS."""
    codec = renderer.codec
    text = codec.tokenizer_json()
    eos = codec.eos_token_id
    if text is None or eos is None:
        return None
    return Vocabulary(text, size=max(vocab_size, codec.vocab_size), eos_ids=(eos,))


__all__ = ["KEPT_GRAMMARS", "AnswerFloors"]
