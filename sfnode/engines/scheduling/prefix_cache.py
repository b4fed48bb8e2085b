"""The prefix cache's index: which KV blocks of earlier prompts are kept, and where.

Every full block of 16 tokens of a context is named by a hash chain
(:mod:`sfnode.linkf.prefix_blocks`), so a key stands for the whole prefix up to the end of its
block.  When a new generation's context starts with blocks whose keys are here, their KV is
copied into its lane and only the rest of the prompt is computed (docs/engine.md section 4).

This index holds no tensors.  It hands out block numbers of a pool that a model runner owns
(``0 .. capacity - 1``), keeps them in least-recently-used order, and when the pool is full it
evicts the least recently used block to make room for a new one.  Lanes never read the pool
directly: a step first writes the blocks it saves, then copies the blocks lanes reuse into them,
then computes (docs/engine.md section 4), so a block evicted while a step is planned was either
copied out by an earlier step or is not read at all.

This module must never import torch or touch a runner: it is pure bookkeeping, tested alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sfnode.generation import PrefixFigures
from sfnode.linkf.prefix_blocks import BlockKey


@dataclass
class _Entry:
    block: int
    parent: BlockKey
    tokens: tuple[int, ...]


class PrefixCache:
    """Keys of cached blocks and their pool numbers, least recently used first.

    Each entry also remembers its parent key and its 16 tokens, so that a context that leaves
    the cached chain in the middle of a block can still take the positions it shares with a
    cached child of its last full block (:meth:`partial`).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must not be negative")
        self.capacity = capacity
        self._blocks: OrderedDict[BlockKey, _Entry] = OrderedDict()
        self._children: dict[BlockKey, set[BlockKey]] = {}
        self._free: list[int] = []
        """Blocks given back (:meth:`discard`), taken again last in first out."""
        self._unused = 0
        """Blocks ``_unused ..`` were never taken (a pool of millions costs nothing until used)."""
        self.stats = PrefixFigures()
        """Cumulative figures since start, and the blocks held now (a new value at each
        change)."""

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
            entry = self._blocks.get(key)
            if entry is None:
                break
            self._blocks.move_to_end(key)
            found.append(entry.block)
        return found

    def partial(self, parent: BlockKey, tokens: Sequence[int]) -> tuple[int, int]:
        """``(block, n)``: the cached child of ``parent`` whose first ``n`` tokens are the first
        ``n`` of ``tokens``, for the largest ``n`` (``n`` 0 when none shares a first token)."""
        best_block, best, best_key = -1, 0, b""
        for key in self._children.get(parent, ()):
            entry = self._blocks[key]
            n = 0
            for mine, theirs in zip(tokens, entry.tokens, strict=False):
                if mine != theirs:
                    break
                n += 1
            if n > best:
                best_block, best = entry.block, n
                best_key = key
        if best:
            self._blocks.move_to_end(best_key)
        return best_block, best

    def record_use(self, reused_tokens: int) -> None:
        """Count one generation's lookup (a hit when it reused any token)."""
        stats = self.stats
        if reused_tokens:
            self.stats = replace(
                stats, hits=stats.hits + 1, reused_tokens=stats.reused_tokens + reused_tokens
            )
        else:
            self.stats = replace(stats, misses=stats.misses + 1)

    def allocate(self, key: BlockKey, parent: BlockKey, tokens: Sequence[int]) -> int | None:
        """A pool block to store the block named ``key`` (``tokens``, after ``parent``) in, or None.

        None when ``key`` is cached already (it becomes the most recently used) or the pool has
        no blocks at all.  A full pool gives up its least recently used block.
        """
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return None
        if self._free:
            block = self._free.pop()
        elif self._unused < self.capacity:
            block = self._unused
            self._unused += 1
        else:
            if not self._blocks:
                return None
            old_key, old = self._blocks.popitem(last=False)
            self._unlink(old_key, old)
            block = old.block
            self.stats = replace(self.stats, evictions=self.stats.evictions + 1)
        self._blocks[key] = _Entry(block, parent, tuple(tokens))
        self._children.setdefault(parent, set()).add(key)
        self.stats = replace(
            self.stats, saved_blocks=self.stats.saved_blocks + 1, cached_blocks=len(self._blocks)
        )
        return block

    def discard(self, key: BlockKey) -> None:
        """Forget ``key`` (its block was never written: the step that would write it failed)."""
        entry = self._blocks.pop(key, None)
        if entry is not None:
            self._unlink(key, entry)
            self._free.append(entry.block)
            self.stats = replace(self.stats, cached_blocks=len(self._blocks))

    def _unlink(self, key: BlockKey, entry: _Entry) -> None:
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[entry.parent]
