"""Drafts by prompt lookup (docs/engine.md section 3.1), alone: the n-gram index and the draft
length's adaptation.  Pure: no model, no torch, no reactor."""

from __future__ import annotations

from twisted.trial import unittest

from sfnode.engines.scheduling.drafts import DraftLength, PromptLookup, Speculation


def lookup(tokens: list[int], low: int = 3, high: int = 5) -> PromptLookup:
    return PromptLookup(tokens, ngram_min=low, ngram_max=high)


class PromptLookupTests(unittest.SynchronousTestCase):
    """What a lane drafts from its own tokens."""

    def test_the_tokens_after_the_last_earlier_occurrence(self) -> None:
        """The draft is what followed the last earlier occurrence of the n-gram the tokens end
        with, up to the limit."""
        index = lookup([1, 2, 3, 10, 11, 12, 13, 9, 1, 2, 3])
        self.assertEqual(index.draft(3), (10, 11, 12))
        self.assertEqual(index.draft(10), (10, 11, 12, 13, 9, 1, 2, 3))
        self.assertEqual(index.draft(0), ())

    def test_the_longest_ngram_wins_and_the_latest_occurrence(self) -> None:
        """A 4-gram match is preferred to a later 3-gram one; between equal n-grams the latest
        occurrence is used."""
        tokens = [7, 1, 2, 3, 40, 8, 1, 2, 3, 50, 7, 1, 2, 3]
        # [7, 1, 2, 3] occurred at the start (then 40); [1, 2, 3] last occurred before 50.
        self.assertEqual(lookup(tokens).draft(1), (40,))
        self.assertEqual(lookup(tokens, 3, 3).draft(1), (50,))

    def test_nothing_without_an_earlier_occurrence(self) -> None:
        """No draft when the last n-gram (of at least ngram_min tokens) never occurred before,
        nor for a context shorter than that."""
        self.assertEqual(lookup([1, 2, 3, 4, 5, 6]).draft(4), ())
        self.assertEqual(lookup([1, 2]).draft(4), ())
        self.assertEqual(lookup([1, 2, 1, 2]).draft(4), ())  # a 2-gram is below ngram_min

    def test_extending_equals_building_from_all_tokens(self) -> None:
        """Tokens appended one by one give the drafts of an index built from them at once."""
        tokens = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 7]
        grown = lookup(tokens[:3])
        for n in range(3, len(tokens)):
            self.assertEqual(grown.draft(4), lookup(tokens[:n]).draft(4), n)
            grown.extend(tokens[n : n + 1])
        self.assertEqual(len(grown), len(tokens))

    def test_speculation_settings_are_checked(self) -> None:
        """A draft of no tokens, or n-gram sizes out of order, are refused."""
        self.assertRaises(ValueError, Speculation, draft_tokens=0)
        self.assertRaises(ValueError, Speculation, ngram_min=4, ngram_max=3)
        self.assertRaises(ValueError, Speculation, ngram_min=0)


class DraftLengthTests(unittest.SynchronousTestCase):
    """How much a lane drafts after what was accepted."""

    def test_adapts_to_what_was_accepted(self) -> None:
        """All after a whole draft accepted, one more than accepted after a partial one, and
        after two drafts with nothing accepted a rest of two steps, then one token."""
        length = DraftLength(4)
        self.assertEqual(length.budget(), 4)
        length.verified(4, 1)
        self.assertEqual(length.budget(), 2)
        length.verified(2, 2)
        self.assertEqual(length.budget(), 4)
        length.verified(4, 0)
        self.assertEqual(length.budget(), 1)
        length.verified(1, 0)
        self.assertEqual([length.budget() for _ in range(3)], [0, 0, 1])
        length.verified(0, 0)  # a step without a draft changes nothing
        self.assertEqual(length.budget(), 1)
        length.verified(1, 1)
        self.assertEqual(length.budget(), 4)
