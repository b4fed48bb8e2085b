"""The head's prefix index (sfnode.head.fleet.prefix_index) as plain objects: no links, no reactor.

What one node is believed to hold: the leading run of a context's block keys, least recently
used first and bounded like the node's pool, with the keys of the blocks a request can reuse
(docs/protocol.md section 8.5).
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.fleet.prefix_index import (
    MAX_INDEX_BLOCKS,
    PrefixIndex,
    head_salt,
    reusable_keys,
)
from sfnode.linkf.prefix_blocks import block_keys

SYSTEM = list(range(1000, 1064))
"""64 tokens: four full blocks."""


class KeysTests(SynchronousTestCase):
    def test_the_block_holding_the_last_token_is_never_reusable(self) -> None:
        """A node computes at least a context's last token, so a context of 16 tokens or
        fewer has no reusable block, one of 32 has one, one of 33 has two."""
        self.assertEqual(reusable_keys(SYSTEM[:16], "m"), ())
        self.assertEqual(len(reusable_keys(SYSTEM[:17], "m")), 1)
        self.assertEqual(len(reusable_keys(SYSTEM[:32], "m")), 1)
        self.assertEqual(len(reusable_keys(SYSTEM[:33], "m")), 2)

    def test_keys_name_the_whole_prefix_and_the_model(self) -> None:
        """Contexts that share their first blocks share those keys and no later one; the same
        tokens for another model have other keys; the keys are the node's hash chain with the
        head's salt."""
        a = reusable_keys([*SYSTEM, 1, 2, 3], "m")
        b = reusable_keys([*SYSTEM, 4, 5, 6], "m")
        self.assertEqual(a, b)
        c = reusable_keys([*SYSTEM[:40], 9, *SYSTEM[41:], 1], "m")
        self.assertEqual(c[:2], a[:2])
        self.assertNotEqual(c[2:], a[2:4])
        self.assertNotEqual(reusable_keys([*SYSTEM, 1], "other"), reusable_keys([*SYSTEM, 1], "m"))
        self.assertEqual(list(a), block_keys(SYSTEM, head_salt("m")))


class IndexTests(SynchronousTestCase):
    def test_the_leading_run_counts_and_a_lookup_touches_nothing(self) -> None:
        """cached_blocks counts the keys held from the first up to the first missing one;
        looking up does not make a key recent (only recording does)."""
        index = PrefixIndex(capacity=4)
        keys = reusable_keys([*SYSTEM, 1], "m")
        index.record(keys[:3])
        self.assertEqual(index.cached_blocks(keys), 3)
        self.assertEqual(index.cached_blocks(keys[1:]), 2)
        self.assertEqual(index.cached_blocks(()), 0)
        other = reusable_keys([7, *SYSTEM], "m")
        self.assertEqual(index.cached_blocks(other), 0)
        index.cached_blocks(keys[:1])
        index.record(other[:2])
        # The capacity is 4: the oldest, keys[0], went although it was just looked up.
        self.assertEqual(index.cached_blocks(keys), 0)
        self.assertEqual(index.cached_blocks(keys[1:]), 2)
        self.assertEqual(len(index), 4)

    def test_recording_again_makes_a_prefix_recent(self) -> None:
        """A prefix recorded again survives newer ones; the least recently used goes first."""
        index = PrefixIndex(capacity=4)
        first = reusable_keys([*SYSTEM[:32], 1], "m")
        second = reusable_keys([*SYSTEM[32:], 1], "m")
        third = reusable_keys([5, *SYSTEM[:32]], "m")
        index.record(first)
        index.record(second)
        index.record(first)
        index.record(third)
        self.assertEqual(index.cached_blocks(first), 2)
        self.assertEqual(index.cached_blocks(third), 2)
        self.assertEqual(index.cached_blocks(second), 0)

    def test_the_capacity_follows_the_node_within_bounds(self) -> None:
        """Shrinking forgets the oldest at once; the capacity stays between 1 and
        MAX_INDEX_BLOCKS; clear forgets everything."""
        index = PrefixIndex(capacity=8)
        keys = reusable_keys([*SYSTEM, *SYSTEM, 1], "m")
        index.record(keys)
        self.assertEqual(index.cached_blocks(keys), 8)
        index.capacity = 3
        self.assertEqual(len(index), 3)
        self.assertEqual(index.cached_blocks(keys), 0)
        index.capacity = 0
        self.assertEqual(index.capacity, 1)
        index.capacity = MAX_INDEX_BLOCKS * 4
        self.assertEqual(index.capacity, MAX_INDEX_BLOCKS)
        index.record(keys)
        index.clear()
        self.assertEqual((len(index), index.cached_blocks(keys)), (0, 0))
