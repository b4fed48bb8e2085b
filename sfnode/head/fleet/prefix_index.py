"""The head's picture of which prompt prefixes each node holds (docs/protocol.md section 8.5).

A node keeps the KV blocks of earlier contexts in its prefix cache: full blocks of 16 tokens,
each named by a hash chain over the tokens up to its end, evicted least recently used first.
Link F has no message that tells the head what a node holds, and none is needed: the head knows
what it sent.  :class:`PrefixIndex` keeps, for one node, the chain keys of the full blocks of
the contexts the head placed or generated there, in least-recently-used order and bounded like
the node's pool (the node's reported ``kv_blocks_total``, at most :data:`MAX_INDEX_BLOCKS`),
so it forgets a prefix about when the node would evict it.  Placement reads how many leading
blocks of a new request's context a node is believed to hold (:meth:`PrefixIndex.cached_blocks`).

The picture is approximate by design: other heads use the node's cache too, the node may keep
a pool of another size (``--prefix-cache-blocks``), and a node that restarted holds nothing
(the fleet clears a node's index whenever its link opens again).  A wrong guess costs one
prefill, never a wrong token: the node checks its own cache.

Keys are :func:`sfnode.engines.scheduling.prefix_cache.block_keys` (the same chain the node uses,
torch-free) with a head-side salt (:func:`head_salt`); they are never compared with the node's own
keys.

This module must never do I/O, read a clock, touch a link, or import torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS, BlockKey, block_keys

DEFAULT_INDEX_BLOCKS = 4096
"""Blocks remembered for a node that has not reported its pool size yet."""
MAX_INDEX_BLOCKS = 1 << 16
"""Blocks remembered per node at most, whatever its pool (about 8 MB of keys and links)."""


def head_salt(model: str | None) -> bytes:
    """The salt of the head's block keys: prefixes of different models never match."""
    return b"sfhead\0" + (model or "").encode()


def reusable_keys(context: Sequence[int], model: str | None) -> tuple[BlockKey, ...]:
    """The keys of the full blocks of ``context`` except one holding its last token.

    These are the blocks a request with this context can reuse (a node always computes at
    least the last token), and the blocks a node has computed once it generated ``context``
    (prompt and new tokens: the last new token is never fed back).
    """
    if len(context) <= KV_BLOCK_TOKENS:
        return ()
    return tuple(block_keys(context, head_salt(model), (len(context) - 1) // KV_BLOCK_TOKENS))


class PrefixIndex:
    """Chain keys of the blocks one node is believed to hold, least recently used first."""

    def __init__(self, capacity: int = DEFAULT_INDEX_BLOCKS) -> None:
        self._keys: OrderedDict[BlockKey, None] = OrderedDict()
        self._capacity = 0
        self.capacity = capacity

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, blocks: int) -> None:
        """Resize (to the node's pool, clamped to 1 .. MAX_INDEX_BLOCKS); the oldest go first."""
        self._capacity = max(1, min(blocks, MAX_INDEX_BLOCKS))
        self._trim()

    def __len__(self) -> int:
        return len(self._keys)

    def cached_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, are held (a lookup: nothing is touched)."""
        count = 0
        for key in keys:
            if key not in self._keys:
                break
            count += 1
        return count

    def record(self, keys: Sequence[BlockKey]) -> None:
        """The node was sent (or computed) the blocks named ``keys``: they become the most
        recently used, in order, as the node's own cache orders them; the least recently used
        beyond the capacity are forgotten."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        self._trim()

    def clear(self) -> None:
        """Forget everything (the node may have restarted)."""
        self._keys.clear()

    def _trim(self) -> None:
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)


__all__ = [
    "DEFAULT_INDEX_BLOCKS",
    "MAX_INDEX_BLOCKS",
    "BlockKey",
    "PrefixIndex",
    "head_salt",
    "reusable_keys",
]
