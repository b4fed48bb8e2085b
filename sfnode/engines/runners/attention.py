"""Attention as torch operators, laid out so that a row's result depends on its lane's tokens
only (docs/engine.md section 4): the per-step layout (:class:`StepAttention`: where each decode
row's key and value go, which lanes are attended together, each prompt chunk's calls) and the
attention of one layer's rows over the KV slots (:class:`Attender`), with what a family adds
(docs/engine.md section 5.4): a sliding window on some layers, soft-capped scores.

Every query row is attended the same way wherever it comes from (a decode row, any prompt chunk,
a prompt after a reused prefix): it reads the keys up to :func:`key_length` of its position, the
positions past its own (and, in a sliding-window layer, those before its window) masked; the
query heads that share a key/value head are laid out as that head's query rows; and the call it
is in has fewer than :data:`CALL_ROWS` rows, padded (:func:`padded_rows`) so that no block of
torch's flash-attention kernel is short.  The kernel's rounding of a row then depends on nothing
else in the call (tested).  Soft-capped scores (Gemma 2) are computed by explicit products, which
torch's kernel has no option for.

This module must never decide what a step computes (the plan does) and never run off the
runner's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from sfnode.engines.runners.kv import SlotKV
from sfnode.engines.scheduling.plan import ChunkRow, StepPlan

ATTENTION_BUCKET = 64
"""A query reads keys up to its position rounded up to a multiple of this (see
:func:`key_length`)."""

QUERY_BLOCK = 32
"""Query rows per block of torch's CPU flash-attention kernel when a call has fewer than
:data:`CALL_ROWS` rows."""

CALL_ROWS = 191
"""The most query rows of one attention call: from 192 rows on, the kernel cuts them into
larger blocks, which round differently."""

MIN_BLOCK_ROWS = 4
"""A block of fewer query rows than this is multiplied by other code paths (a matrix-vector
product for one row), which round differently; calls are padded so that none occurs."""


def key_length(position: int, window: int) -> int:
    """Keys the query at ``position`` reads: up to its position rounded up to a multiple of
    :data:`ATTENTION_BUCKET` (the positions past its own masked), within the window.

    A function of the position alone, so a query reads the same keys as a decode row, in any
    prompt chunk, and after a reused prefix (docs/engine.md section 4)."""
    return min(window, -(-(position + 1) // ATTENTION_BUCKET) * ATTENTION_BUCKET)


def padded_rows(rows: int) -> int:
    """The query rows of one attention call of ``rows`` rows (fewer than :data:`CALL_ROWS`)
    once padded so that each of the kernel's blocks of :data:`QUERY_BLOCK` rows holds at least
    :data:`MIN_BLOCK_ROWS` of them."""
    if rows < MIN_BLOCK_ROWS:
        return MIN_BLOCK_ROWS
    tail = rows % QUERY_BLOCK
    if tail and tail < MIN_BLOCK_ROWS:
        return rows + MIN_BLOCK_ROWS - tail
    return rows


def positions_per_call(groups: int) -> int:
    """How many consecutive positions of a prompt chunk one attention call takes (a power of
    two dividing :data:`ATTENTION_BUCKET`, so they share a key length), each position being
    ``groups`` query rows, padding included, fewer than :data:`CALL_ROWS`."""
    size = ATTENTION_BUCKET
    while size > 1 and size * groups + MIN_BLOCK_ROWS > CALL_ROWS:
        size //= 2
    return size


def pad_rows(q: torch.Tensor, rows: int) -> torch.Tensor:
    """``q`` with zero query rows appended along dimension 2 up to ``rows`` rows."""
    missing = rows - q.shape[2]
    if missing <= 0:
        return q
    return torch.cat([q, q.new_zeros(*q.shape[:2], missing, q.shape[3])], dim=2)


def decode_positions(plan: StepPlan) -> list[tuple[int, int]]:
    """``(slot, position)`` of every decode row of the pass: each decode row, then its draft's
    tokens at the next positions."""
    return [(row.slot, row.position + depth) for row in plan.decode for depth in range(row.rows)]


def _masks(
    positions: torch.Tensor, length: int, sliding: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which of ``length`` keys each query at ``positions`` reads: its own position and those
    before it; and, with a ``sliding`` window, only the last ``sliding`` of them."""
    columns = torch.arange(length, device=positions.device).unsqueeze(0)
    at = positions.unsqueeze(1)
    causal = columns <= at
    return causal, (causal & (columns > at - sliding)) if sliding is not None else None


@dataclass
class Masks:
    """A call's mask for full-attention layers and, where the model has sliding layers, for
    those."""

    full: torch.Tensor
    sliding: torch.Tensor | None

    def of(self, sliding: bool) -> torch.Tensor:
        if sliding and self.sliding is not None:
            return self.sliding
        return self.full


@dataclass
class DecodeGroup:
    """Decode rows attended in one call: their indices, their slots (a slice when
    consecutive), the key length and the masks."""

    members: list[int]
    where: Any
    length: int
    masks: Masks


@dataclass
class ChunkCall:
    """One attention call of a prompt chunk: its first and end row in the chunk, the key
    length and the masks."""

    first: int
    last: int
    length: int
    masks: Masks


class StepAttention:
    """Per-step attention inputs (see the module docstring): where each decode row's key and
    value go, which lanes are attended together, and each prompt chunk's calls."""

    def __init__(
        self, plan: StepPlan, *, groups: int, window: int, sliding: int | None, device: Any
    ) -> None:
        decode = decode_positions(plan)
        self.rows = len(decode)
        self.slot_index = torch.tensor([s for s, _ in decode], dtype=torch.long, device=device)
        self.position_index = torch.tensor([p for _, p in decode], dtype=torch.long, device=device)
        self.decode_rows = padded_rows(groups)
        """Query rows of each decoding lane's attention problem (its query heads, padded)."""
        self.groups: list[DecodeGroup] = []
        self.restore: torch.Tensor | None = None
        """Puts the groups' rows back in decode order, when grouping moved them."""
        self._group(decode, window, sliding, device)
        per_call = positions_per_call(groups)
        self.chunks: list[tuple[int, int, int, list[ChunkCall]]] = []
        """Per chunk: its slot, first position, length, and its calls."""
        for chunk in plan.chunks:
            calls = _chunk_calls(chunk, per_call, groups, window, sliding, device)
            self.chunks.append((chunk.slot, chunk.start, len(chunk.tokens), calls))
        self.longest = max(
            [group.length for group in self.groups]
            + [call.length for *_, calls in self.chunks for call in calls],
            default=0,
        )
        """The longest key length any call reads."""

    def _group(
        self, decode: list[tuple[int, int]], window: int, sliding: int | None, device: Any
    ) -> None:
        """Lanes whose key lengths are equal share a call (one problem per lane).  A drafted
        row is a decode row at its own position: it sees the keys written before it in this
        pass, no further, and is attended exactly as a decode row at that position."""
        buckets: dict[int, list[int]] = {}
        for index, (_, position) in enumerate(decode):
            buckets.setdefault(key_length(position, window), []).append(index)
        order: list[int] = []
        for length, members in sorted(buckets.items()):
            slots = [decode[i][0] for i in members]
            if slots == list(range(slots[0], slots[0] + len(slots))):
                where: Any = slice(slots[0], slots[0] + len(slots))
            else:
                where = torch.tensor(slots, dtype=torch.long, device=device)
            at = torch.tensor([decode[i][1] for i in members], device=device)
            full, slid = _masks(at, length, sliding)
            shape = (len(members), 1, 1, length)
            masks = Masks(full.view(shape), None if slid is None else slid.view(shape))
            self.groups.append(DecodeGroup(members, where, length, masks))
            order += members
        if order != list(range(self.rows)):
            inverse = [0] * self.rows
            for position, row in enumerate(order):
                inverse[row] = position
            self.restore = torch.tensor(inverse, dtype=torch.long, device=device)


def _chunk_calls(
    chunk: ChunkRow, per_call: int, groups: int, window: int, sliding: int | None, device: Any
) -> list[ChunkCall]:
    """A prompt chunk's attention calls, ``per_call`` positions each (they share a key
    length)."""
    n = len(chunk.tokens)
    calls = []
    first = chunk.start
    while first < chunk.start + n:
        end = min(chunk.start + n, (first // per_call + 1) * per_call)
        length = key_length(end - 1, window)
        rows = (end - first) * groups
        positions = torch.arange(first, end, device=device).repeat_interleave(groups)
        padding = padded_rows(rows) - rows
        if padding:
            positions = torch.cat([positions, positions.new_zeros(padding)])
        full, slid = _masks(positions, length, sliding)
        shape = (1, 1, -1, length)
        masks = Masks(full.view(shape), None if slid is None else slid.view(shape))
        calls.append(ChunkCall(first - chunk.start, end - chunk.start, length, masks))
        first = end
    return calls


def attention_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over the keys ``mask`` allows (or causally): torch's
    kernel, or with ``softcap`` the scores made ``cap * tanh(score / cap)`` first, as Gemma 2
    does, by explicit products."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale
        )
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        length = scores.shape[-1]
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(weights, v)


class Attender:
    """The attention of one layer's rows over the KV slots, as torch operators (see the module
    docstring); keys and values are written into the slots first."""

    def __init__(
        self, kv: SlotKV, *, heads: int, scale: float, softcap: float | None, cast: bool
    ) -> None:
        self.kv = kv
        self.heads = heads
        self.kv_heads = kv.kv_heads
        self.head_dim = kv.head_dim
        self.groups = heads // kv.kv_heads
        self.scale = scale
        self.softcap = softcap
        self.cast = cast
        """Whether keys and values are stored in another type than they are computed in."""

    def step(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention: StepAttention,
        sliding: bool,
    ) -> torch.Tensor:
        """Attention of every row of a step (see :class:`StepAttention` for how it is cut)."""
        keys, values = self.kv.keys[layer], self.kv.values[layer]
        parts: list[torch.Tensor] = []
        decode = attention.rows
        if decode:
            parts.append(self._decode(keys, values, query, key, value, attention, sliding))
        offset = decode
        for slot, start, n, calls in attention.chunks:
            end = start + n
            keys[slot, :, start:end] = key[offset : offset + n].transpose(0, 1)
            values[slot, :, start:end] = value[offset : offset + n].transpose(0, 1)
            chunk = query[offset : offset + n]
            parts.extend(self._chunk(keys, values, chunk, slot, calls, sliding))
            offset += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention: StepAttention,
        sliding: bool,
    ) -> torch.Tensor:
        """The decode rows' attention: their keys and values written into their slots first,
        lanes of equal key length in one call."""
        decode = attention.rows
        new_keys, new_values = key[:decode], value[:decode]
        if self.cast:
            new_keys, new_values = new_keys.to(keys.dtype), new_values.to(values.dtype)
        keys[attention.slot_index, :, attention.position_index] = new_keys
        values[attention.slot_index, :, attention.position_index] = new_values
        # Each key/value head answers its group of query heads: the group is laid out as
        # that head's "query positions", so no key or value is repeated.
        grouped = query[:decode].reshape(decode, self.kv_heads, self.groups, self.head_dim)
        grouped = pad_rows(grouped, attention.decode_rows)
        outs = []
        for group in attention.groups:
            where, length = group.where, group.length
            if isinstance(where, slice):
                k, v = keys[where, :, :length], values[where, :, :length]
            else:
                k = keys.index_select(0, where)[:, :, :length]
                v = values.index_select(0, where)[:, :, :length]
            q = grouped if len(group.members) == decode else grouped[group.members]
            if self.cast:
                k, v = k.to(q.dtype), v.to(q.dtype)
            outs.append(attention_call(q, k, v, group.masks.of(sliding), self.scale, self.softcap))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if attention.restore is not None:
            out = out.index_select(0, attention.restore)
        return out[:, :, : self.groups].reshape(decode, self.heads * self.head_dim)

    def _chunk(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        slot: int,
        calls: Sequence[ChunkCall],
        sliding: bool,
    ) -> list[torch.Tensor]:
        """A prompt chunk's attention, call by call, over its slot's keys (``query``: the
        chunk's rows)."""
        kv_heads, head_dim, groups = self.kv_heads, self.head_dim, self.groups
        parts = []
        for call in calls:
            rows = call.last - call.first
            # [rows, heads, dim] -> [1, kv_heads, rows * groups, dim], position-major.
            q = (
                query[call.first : call.last]
                .view(rows, kv_heads, groups, head_dim)
                .permute(1, 0, 2, 3)
                .reshape(1, kv_heads, rows * groups, head_dim)
            )
            k = keys[slot : slot + 1, :, : call.length]
            v = values[slot : slot + 1, :, : call.length]
            if self.cast:
                k, v = k.to(q.dtype), v.to(q.dtype)
            mask = call.masks.of(sliding)
            out = attention_call(pad_rows(q, mask.shape[2]), k, v, mask, self.scale, self.softcap)
            parts.append(
                out[0, :, : rows * groups]
                .view(kv_heads, rows, groups, head_dim)
                .permute(1, 0, 2, 3)
                .reshape(rows, self.heads * head_dim)
            )
        return parts

    def sequence(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sliding: int | None
    ) -> torch.Tensor:
        """Causal attention of one whole sequence, without a cache (a pipeline stage, a
        perplexity run); ``sliding``: the layer's window, if it has one."""
        n = query.shape[0]
        q = query.transpose(0, 1).unsqueeze(0)
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
        if self.groups > 1 and (sliding is not None or self.softcap is not None):
            k = k.repeat_interleave(self.groups, dim=1)
            v = v.repeat_interleave(self.groups, dim=1)
        if sliding is None and self.softcap is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.groups > 1
            )
        elif sliding is None:
            out = attention_call(q, k, v, None, self.scale, self.softcap, causal=True)
        else:
            _, mask = _masks(torch.arange(n, device=q.device), n, sliding)
            out = attention_call(q, k, v, mask, self.scale, self.softcap)
        return out[0].transpose(0, 1).reshape(n, -1)


__all__ = [
    "ATTENTION_BUCKET",
    "CALL_ROWS",
    "MIN_BLOCK_ROWS",
    "QUERY_BLOCK",
    "Attender",
    "StepAttention",
    "attention_call",
    "decode_positions",
    "key_length",
    "padded_rows",
    "positions_per_call",
]
