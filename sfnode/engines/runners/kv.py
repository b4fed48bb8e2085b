"""KV memory of the Llama runner: one contiguous region per lane slot, and the prefix cache's pool.

**Slots.**  Layer ``l`` keeps keys and values as ``[slots, kv_heads, capacity, head_dim]``; slot
``s`` holds its lane's positions ``0 .. n-1`` at the start of its row.  A lane's attention reads
its own row up to its length, and a lane's join or leave moves no memory: a new lane writes its
prompt into a free slot, a finished lane's slot is simply overwritten by the next one.  The
capacity grows (doubling, up to the window) when a lane needs more positions, which copies the
buffers once.

**Pool.**  The prefix cache's blocks live in ``[blocks, kv_heads, 16, head_dim]`` per layer.
Saving copies a lane's full blocks from its slot into pool blocks; reusing copies pool blocks into
the start of a new lane's slot.  On a CPU a copy of a block costs far less than computing it.

Both are zero-filled when allocated: attention multiplies masked positions by zero, and a zero
times a stale NaN from uninitialised memory would still be NaN.

This module must never decide which slot or block holds what: the scheduler does; this module
only holds tensors and copies between them, on the runner's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field

import torch

from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS

KV_GROWTH = 256
"""Slot capacity is a multiple of this many positions."""


def _grow(
    buffers: list[torch.Tensor],
    layers: int,
    shape: tuple[int, ...],
    kept: tuple[slice, ...],
    like: SlotKV,
) -> None:
    """Give each layer's buffer ``shape`` (zero-filled), keeping the part ``kept`` selects."""
    for index in range(layers):
        grown = torch.zeros(shape, dtype=like.dtype, device=like.device)
        if index < len(buffers):
            grown[kept] = buffers[index][kept]
            buffers[index] = grown
        else:
            buffers.append(grown)


@dataclass(eq=False)
class _LayerBuffers:
    """A key and a value buffer per layer, grown (by :func:`_grow`) as they are needed."""

    keys: list[torch.Tensor] = field(default_factory=list, init=False)
    values: list[torch.Tensor] = field(default_factory=list, init=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass(eq=False)
class SlotKV(_LayerBuffers):
    """Per-layer key and value buffers for ``slots`` lanes of up to ``window`` positions."""

    _: KW_ONLY
    layers: int
    slots: int
    kv_heads: int
    head_dim: int
    window: int
    dtype: torch.dtype
    device: torch.device
    capacity: int = field(default=0, init=False)

    def ensure(self, positions: int) -> None:
        """Make room for ``positions`` positions in every slot (copies once when it grows)."""
        if positions <= self.capacity:
            return
        if positions > self.window:
            raise ValueError(f"{positions} positions exceed the window of {self.window}")
        target = max(positions, min(self.window, 2 * self.capacity))
        target = min(self.window, -(-target // KV_GROWTH) * KV_GROWTH)
        shape = (self.slots, self.kv_heads, target, self.head_dim)
        kept = (slice(None), slice(None), slice(0, self.capacity))
        for buffers in (self.keys, self.values):
            _grow(buffers, self.layers, shape, kept, self)
        self.capacity = target


class BlockPool(_LayerBuffers):
    """The prefix cache's KV blocks, ``[blocks, kv_heads, 16, head_dim]`` per layer, grown as
    blocks are first written."""

    def __init__(self, kv: SlotKV, capacity: int, layers: range | None = None) -> None:
        """Blocks of ``kv``'s ``layers`` (all of them by default: a pipeline stage keeps only
        its own range's)."""
        super().__init__()
        self._kv = kv
        self.capacity = capacity
        self.layers = range(kv.layers) if layers is None else layers
        self.allocated = 0

    def _ensure(self, blocks: int) -> None:
        if blocks <= self.allocated:
            return
        if blocks > self.capacity:
            raise ValueError(f"pool block {blocks - 1} is beyond its {self.capacity} blocks")
        kv = self._kv
        target = min(self.capacity, max(blocks, 2 * self.allocated, 64))
        shape = (target, kv.kv_heads, KV_BLOCK_TOKENS, kv.head_dim)
        for buffers in (self.keys, self.values):
            _grow(buffers, len(self.layers), shape, (slice(0, self.allocated),), kv)
        self.allocated = target

    def save(self, slot: int, first: int, blocks: Sequence[int]) -> None:
        """Copy lane blocks ``first ..`` of ``slot`` into pool ``blocks``."""
        self._ensure(max(blocks) + 1)
        kv = self._kv
        n = len(blocks)
        span = slice(first * KV_BLOCK_TOKENS, (first + n) * KV_BLOCK_TOKENS)
        index = torch.tensor(blocks, dtype=torch.long, device=kv.device)
        for held, layer in enumerate(self.layers):
            for pool, slots in ((self.keys, kv.keys), (self.values, kv.values)):
                source = slots[layer][slot, :, span].view(kv.kv_heads, n, KV_BLOCK_TOKENS, -1)
                pool[held].index_copy_(0, index, source.transpose(0, 1))

    def load(
        self, slot: int, first: int, blocks: Sequence[int], tail: int = KV_BLOCK_TOKENS
    ) -> None:
        """Copy pool ``blocks`` into lane blocks ``first ..`` of ``slot`` (of the last one only
        its first ``tail`` positions)."""
        kv = self._kv
        n = len(blocks)
        positions = (n - 1) * KV_BLOCK_TOKENS + tail
        start = first * KV_BLOCK_TOKENS
        kv.ensure(start + positions)
        index = torch.tensor(blocks, dtype=torch.long, device=kv.device)
        for held, layer in enumerate(self.layers):
            for pool, slots in ((self.keys, kv.keys), (self.values, kv.values)):
                taken = pool[held].index_select(0, index)  # [n, heads, 16, dim]
                rows = taken.transpose(0, 1).reshape(kv.kv_heads, n * KV_BLOCK_TOKENS, -1)
                slots[layer][slot, :, start : start + positions] = rows[:, :positions]
