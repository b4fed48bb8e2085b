"""The prefix cache's index: which KV blocks of earlier prompts are kept, and where.

Every full block of 16 tokens of a context is named by a hash chain: block ``i``'s key hashes
block ``i - 1``'s key with the block's own token ids (and a salt naming the model and the weights
mode), so a key stands for the whole prefix up to the end of its block.  When a new generation's
context starts with blocks whose keys are here, their KV is copied into its lane and only the rest
of the prompt is computed (docs/engine.md section 4).

This index holds no tensors.  It hands out block numbers of a pool that a model runner owns
(``0 .. capacity - 1``), keeps them in least-recently-used order, and when the pool is full it
evicts the least recently used block to make room for a new one.  Lanes never read the pool
directly: a step first writes the blocks it saves, then copies the blocks lanes reuse into them,
then computes (docs/engine.md section 4), so a block evicted while a step is planned was either
copied out by an earlier step or is not read at all.

This module must never import torch or touch a runner: it is pure bookkeeping, tested alone.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from sfnode.generation import KV_BLOCK_TOKENS

BlockKey = bytes


def block_keys(tokens: Sequence[int], salt: bytes, limit: int | None = None) -> list[BlockKey]:
    """The chain keys of the full blocks of ``tokens`` (at most ``limit`` blocks)."""
    full = len(tokens) // KV_BLOCK_TOKENS
    if limit is not None:
        full = min(full, limit)
    keys: list[BlockKey] = []
    previous = salt
    for index in range(full):
        block = tokens[index * KV_BLOCK_TOKENS : (index + 1) * KV_BLOCK_TOKENS]
        digest = xxhash.xxh3_128()
        digest.update(previous)
        digest.update(array("q", block).tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


@dataclass
class PrefixCacheStats:
    """Cumulative figures since start, and the blocks held now."""

    hits: int = 0
    """Generations that reused at least one block."""
    misses: int = 0
    """Generations that reused nothing."""
    reused_tokens: int = 0
    saved_blocks: int = 0
    evictions: int = 0
    cached_blocks: int = 0


class PrefixCache:
    """Keys of cached blocks and their pool numbers, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must not be negative")
        self.capacity = capacity
        self._blocks: OrderedDict[BlockKey, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pool numbers of the longest run of ``keys`` from the start that is cached.

        The matched blocks become the most recently used.
        """
        found: list[int] = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            found.append(block)
        return found

    def record_use(self, reused_blocks: int) -> None:
        """Count one generation's lookup (a hit when it reused any block)."""
        if reused_blocks:
            self.stats.hits += 1
            self.stats.reused_tokens += reused_blocks * KV_BLOCK_TOKENS
        else:
            self.stats.misses += 1

    def allocate(self, key: BlockKey) -> int | None:
        """A pool block to store the block named ``key`` in, or None.

        None when ``key`` is cached already (it becomes the most recently used) or the pool has
        no blocks at all.  A full pool gives up its least recently used block.
        """
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return None
        if self._free:
            block = self._free.pop()
        else:
            if not self._blocks:
                return None
            _, block = self._blocks.popitem(last=False)
            self.stats.evictions += 1
        self._blocks[key] = block
        self.stats.saved_blocks += 1
        self.stats.cached_blocks = len(self._blocks)
        return block

    def discard(self, key: BlockKey) -> None:
        """Forget ``key`` (its block was never written: the step that would write it failed)."""
        block = self._blocks.pop(key, None)
        if block is not None:
            self._free.append(block)
            self.stats.cached_blocks = len(self._blocks)
