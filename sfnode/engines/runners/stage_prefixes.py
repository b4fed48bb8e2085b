"""Prefix reuse for pipeline stages that keep their KV (docs/protocol.md section 12.8,
docs/engine.md section 4).

A stage node computes the same prefix again and again: every chat's system prompt, every turn
of a conversation resent whole.  A full node keeps such blocks in its prefix cache; a stage keeps
them here, per layer range: each full block of 16 positions of a stage session is named by a hash
chain over the block's **inputs** (a first stage's token ids, a later stage's hidden rows as
their bytes), and the pool keeps the block's keys and values for the stage's layers and, but for
the last stage, its 16 output rows.  A request whose rows start at a block boundary and begin
with cached blocks has their KV copied into its slot and their output rows taken from the pool;
only the rest is computed.  At least the request's last row is always computed, so the last
stage always has the logits it answers from.

The inputs of a stage's row are a function of its context (the previous stages compute them
exactly, section 12.8), so a block's key names its whole prefix as a token chain does, and no
stage needs to agree with another on what it reused: every stage answers every row of a request,
reused or computed, as the request asks.  A row's keys, values and output are the same bit for
bit however its context was cut into requests (docs/engine.md section 4), so reused rows equal
computed ones.

This module must never decide which slot a session has (the loop's
:class:`~sfnode.engines.scheduling.stages.StageSessions` does) and runs on the engine's worker
thread only, as :class:`~sfnode.engines.runners.stages.DecoderStages` does.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sfnode.engines.runners.kv import BlockPool, SlotKV
from sfnode.engines.scheduling.prefix_cache import PrefixCache
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS, BlockKey, chain_key


def row_inputs(tokens: Sequence[int], hidden: torch.Tensor | None) -> list[bytes]:
    """Each row's input as bytes: a token id (a first stage), else a hidden row's bytes."""
    if hidden is None:
        return [struct.pack("<q", int(t)) for t in tokens]
    raw = hidden.detach().cpu().contiguous().view(torch.uint8).numpy()
    return [row.tobytes() for row in raw]


@dataclass
class _Chain:
    """What a slot's session has named so far: the keys of its full blocks, and the inputs
    (and, but for the last stage, the output rows) of its rows since the last full block."""

    keys: list[BlockKey] = field(default_factory=list)
    inputs: list[bytes] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(self.keys) * KV_BLOCK_TOKENS + len(self.inputs)

    def cut(self, position: int) -> None:
        """Forget the rows at ``position`` and after (a request there overwrites them)."""
        full, rest = divmod(position, KV_BLOCK_TOKENS)
        if full < len(self.keys):
            self.keys[full:] = []
            self.inputs, self.outputs = [], []
        else:
            self.inputs[rest:], self.outputs[rest:] = [], []


class StagePrefixes:
    """The prefix pool of one layer range ``[start, end)`` of a stage (see the module)."""

    def __init__(
        self, kv: SlotKV, capacity: int, start: int, end: int, last: bool, salt: bytes
    ) -> None:
        self.start, self.end, self.last = start, end, last
        self.index = PrefixCache(capacity)
        self.pool = BlockPool(kv, capacity, range(start, end))
        self._outputs: dict[int, torch.Tensor] = {}
        """Each pool block's 16 output rows (not kept by the last stage)."""
        self._salts = {
            kind: b"stage|%d|%d|%s|" % (start, end, kind) + salt for kind in (b"tokens", b"hidden")
        }
        self._chains: dict[int, _Chain] = {}

    @property
    def reused_rows(self) -> int:
        """Rows taken from the pool instead of computed, since start."""
        return self.index.stats.reused_tokens

    def take(
        self, slot: int, position: int, inputs: Sequence[bytes], tokens: bool
    ) -> tuple[int, torch.Tensor | None]:
        """The cached blocks a request of ``inputs`` at ``position`` of ``slot`` starts with,
        copied into the slot: how many rows they are, and (but for the last stage) their
        output rows.  The request's last row is never taken."""
        chain = self._chains.setdefault(slot, _Chain())
        chain.cut(position)
        if chain.rows != position or chain.inputs:
            return 0, None
        parent = chain.keys[-1] if chain.keys else self._salts[b"tokens" if tokens else b"hidden"]
        keys = []
        for first in range(0, len(inputs) - 1 - (KV_BLOCK_TOKENS - 1), KV_BLOCK_TOKENS):
            parent = chain_key(parent, *inputs[first : first + KV_BLOCK_TOKENS])
            keys.append(parent)
        if not keys:
            return 0, None  # no full block to look for: neither a hit nor a miss
        found = self.index.match(keys)
        self.index.record_use(len(found) * KV_BLOCK_TOKENS)
        if not found:
            return 0, None
        self.pool.load(slot, position // KV_BLOCK_TOKENS, found)
        chain.keys.extend(keys[: len(found)])
        reused = len(found) * KV_BLOCK_TOKENS
        if self.last:
            return reused, None
        return reused, torch.cat([self._outputs[block] for block in found])

    def keep(
        self,
        slot: int,
        position: int,
        inputs: Sequence[bytes],
        outputs: torch.Tensor | None,
        tokens: bool,
    ) -> None:
        """Name the computed rows ``inputs`` at ``position`` of ``slot`` (their ``outputs``
        but for the last stage), and save each block they complete into the pool."""
        chain = self._chains.setdefault(slot, _Chain())
        if chain.rows != position:
            return  # not named from the session's start (taken over mid-block): nothing kept
        salt = self._salts[b"tokens" if tokens else b"hidden"]
        for row, raw in enumerate(inputs):
            chain.inputs.append(raw)
            if outputs is not None:
                chain.outputs.append(outputs[row : row + 1].clone())
            if len(chain.inputs) < KV_BLOCK_TOKENS:
                continue
            parent = chain.keys[-1] if chain.keys else salt
            key = chain_key(parent, *chain.inputs)
            block = self.index.allocate(key, parent, ())
            if block is not None:
                self.pool.save(slot, len(chain.keys), [block])
                if outputs is not None:
                    self._outputs[block] = torch.cat(chain.outputs)
            chain.keys.append(key)
            chain.inputs, chain.outputs = [], []
