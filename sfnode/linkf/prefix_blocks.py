"""KV blocks and the keys that name them, as node and head both count them (docs/protocol.md
section 8.5, docs/engine.md section 4).

A context's KV is accounted in blocks of :data:`KV_BLOCK_TOKENS` tokens.  Every full block is
named by a hash chain: block ``i``'s key hashes block ``i - 1``'s key with the block's own token
ids (and a salt naming the model and the weights mode), so a key stands for the whole prefix up
to the end of its block.  The node's prefix cache and the head's prefix index must compute the
same keys, so they live here, in the core both sides share.  Pure: no I/O, no clock.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

KV_BLOCK_TOKENS = 16
"""Tokens per KV block: the unit of ``kv_blocks_used`` / ``kv_blocks_total`` and of prefix reuse."""

BlockKey = bytes


def chain_key(parent: BlockKey, *parts: bytes) -> BlockKey:
    """The key of the block whose content is ``parts`` (in order) after the block named
    ``parent`` (or after the salt, for a first block)."""
    digest = xxhash.xxh3_128()
    digest.update(parent)
    for part in parts:
        digest.update(part)
    return digest.digest()


def block_keys(
    tokens: Sequence[int],
    salt: bytes,
    limit: int | None = None,
    known: Sequence[BlockKey] = (),
) -> list[BlockKey]:
    """The chain keys of the full blocks of ``tokens`` (at most ``limit`` blocks); ``known``
    are the keys of its first blocks, already computed (a growing context's keys are
    extended, not computed again)."""
    full = len(tokens) // KV_BLOCK_TOKENS
    if limit is not None:
        full = min(full, limit)
    keys = list(known[:full])
    previous = keys[-1] if keys else salt
    for index in range(len(keys), full):
        block = tokens[index * KV_BLOCK_TOKENS : (index + 1) * KV_BLOCK_TOKENS]
        previous = chain_key(previous, array("q", block).tobytes())
        keys.append(previous)
    return keys
