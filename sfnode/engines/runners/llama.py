"""The model runner for Llama-family models: executes a
:class:`~sfnode.engines.scheduling.plan.StepPlan`.

One step is one pass over the weights for every row it carries: each decoding lane's next token
and the prompt chunks riding along, all through the same matrix products (reading the weights is
most of what a step costs on a CPU, whatever the row count).  Decoding lanes attend to their own
slots of :class:`~sfnode.engines.runners.kv.SlotKV` (query heads grouped onto their key/value
heads), lanes of similar length in one call; each prompt chunk attends to its own slot, a few
positions per call.  A row is computed the same way wherever it is (a decode row, any chunk, after a
reused prefix), so a position's KV and logits depend on its lane's tokens only, bit for bit
(:class:`_Attention`, :func:`_multiply`; docs/engine.md section 4).

The arithmetic is the model's (RMSNorm, rotary embedding, grouped-query attention, SiLU-gated
MLP), done with few, large operators instead of transformers' modules: the query/key/value and
the gate/up projections are one matrix each, both rotary halves of queries and keys turn in one
operation, and the norms are ``torch.nn.functional.rms_norm``.  In float32 the tokens are those of
the model's own ``generate()`` (tested); the logits agree to float32 rounding, not bit for bit.
The quantized modes compute in bfloat16 between their matrices (docs/engine.md section 5).

A decode row with a draft (docs/engine.md section 3.1) takes one row of the pass per token it
feeds: its own token and each drafted one at the next positions, each attended exactly as a
decode row at that position would be (its keys read to its own length, rounded to the same
bucket), so a drafted position computes what the step that would have fed that token computes.
The sampler then walks each lane's rows in order: the first row's token is drawn as always, and
the next row's only while the token drawn equals the drafted one fed there; the lane's stage
(its grammar and penalties) has then advanced by exactly the tokens drawn, and its grammar's
masks for the drafted rows were computed beside the pass with the drafted tokens consumed and
taken back (:mod:`sfnode.engines.runners.masks`).

The runner also runs pipeline stages (docs/protocol.md, STAGE_FORWARD): layers ``[start, end)``
over a whole token sequence, without a cache.

This module must never be called from two threads at once (the engine gives it one worker thread),
never decide what a step does (the plan says), and never sample with a random generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from sfnode.decoding.sampler import allowed_rows, sample_with_stages
from sfnode.engines.kernels.native import NativeStep, fusable
from sfnode.engines.kernels.quant import Float32Linear, Linear, Projection
from sfnode.engines.runners.kv import BlockPool, SlotKV
from sfnode.engines.runners.masks import MaskWorker
from sfnode.engines.scheduling.plan import ChunkRow, DecodeRow, StepOutput, StepPlan
from sfnode.engines.weights.llama import LlamaWeights
from sfnode.generation import StageForwardError, StageResult, TokenLogprob
from sfnode.linkf.wire import GenParams

_MASK64 = (1 << 64) - 1

_LLAMA_TYPES = ("llama",)
_STOCK_LAYER_PARTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def _has(module: Any, dotted: str) -> bool:
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


def llama_unsupported(model: Any) -> str | None:
    """None when :class:`LlamaRunner` computes ``model`` faithfully, else the reason it cannot."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None:
        return "not a transformers causal LM"
    if getattr(config, "model_type", None) not in _LLAMA_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not a plain Llama"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope.get('rope_type')!r} is not supported"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not SiLU"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1 is not supported"
    layers = getattr(inner, "layers", None)
    if not layers or not all(_has(layer, p) for layer in layers for p in _STOCK_LAYER_PARTS):
        return "the layers are not the stock Llama modules"
    if not (hasattr(inner, "rotary_emb") and hasattr(inner, "norm") and hasattr(model, "lm_head")):
        return "the model lacks rotary_emb, norm or lm_head"
    return None


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

REFINED = 128
"""Logits per row computed again in float32 (see :meth:`LlamaRunner._logits`)."""

Groups = list[tuple[int, int, bool]]
"""Row ranges of a step and whether they use the dense copies (``(start, end, dense)``)."""


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


def _pad_rows(q: torch.Tensor, rows: int) -> torch.Tensor:
    """``q`` with zero query rows appended along dimension 2 up to ``rows`` rows."""
    missing = rows - q.shape[2]
    if missing <= 0:
        return q
    return torch.cat([q, q.new_zeros(*q.shape[:2], missing, q.shape[3])], dim=2)


def _multiply(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; a lone float32 row goes through as two.

    oneDNN multiplies a single row with a matrix-vector kernel and two rows or more with a
    matrix kernel, and the two round differently; with every row through the matrix kernel, a
    row's product does not depend on how many rows share the call (docs/engine.md section 4).
    The quantized and bfloat16 kernels, and sfnode's own float32 kernel, do not need it.
    """
    if x.shape[0] == 1 and isinstance(layer, Float32Linear):
        return layer(torch.cat([x, x]))[:1]
    return layer(x)


def _project(projection: Projection, x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``x @ W^T`` with each row group's kernel: decode rows and short chunks multiply by the
    quantized kernel, long prompt chunks by the dense copy when the engine keeps dense copies
    (the same rows always get the same kernel, whatever else shares the step)."""
    if projection.dense is None or len(groups) == 1:
        if x.shape[0] == 1 and isinstance(projection.kernel, Float32Linear):
            return projection(torch.cat([x, x]))[:1]  # see _multiply
        return projection(x, dense=groups[0][2])
    return torch.cat([projection(x[a:b], dense=use_dense) for a, b, use_dense in groups])


def _output(
    plan: StepPlan,
    tokens: Sequence[int],
    logprobs: Sequence[TokenLogprob | None],
    drafted: Sequence[tuple[int, ...]] = (),
    drafted_logprobs: Sequence[tuple[TokenLogprob | None, ...]] = (),
) -> StepOutput:
    """Tokens (and logprobs, when any row asked) sampled for the decode rows, then for the
    chunks that ended a prompt, as a :class:`StepOutput`; ``drafted`` the tokens drawn after
    each decode row's accepted draft tokens."""
    rows = len(plan.decode)
    firsts = iter(range(rows, len(tokens)))
    chunk_rows = [next(firsts) if chunk.last else None for chunk in plan.chunks]
    asked = any(row.params.logprobs for row in plan.decode)
    return StepOutput(
        decode=tuple(tokens[:rows]),
        chunks=tuple(None if r is None else tokens[r] for r in chunk_rows),
        decode_logprobs=tuple(logprobs[:rows]) if logprobs else (),
        chunk_logprobs=(
            tuple(None if r is None else logprobs[r] for r in chunk_rows) if logprobs else ()
        ),
        drafted=tuple(drafted),
        drafted_logprobs=tuple(drafted_logprobs) if asked and drafted else (),
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding: ``x * cos + rotate_half(x) * sin``.

    ``rotate_half(x)`` is ``[-x2, x1]`` for the halves ``x1, x2`` of the last dimension, which is
    ``x`` rolled by half its length with the first half's sign flipped; the flip is folded into
    ``signed_sin`` once per step, so a layer does a roll and a fused multiply-add.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def _decode_positions(plan: StepPlan) -> list[tuple[int, int]]:
    """``(slot, position)`` of every decode row of the pass: each decode row, then its draft's
    tokens at the next positions."""
    return [(row.slot, row.position + depth) for row in plan.decode for depth in range(row.rows)]


def _sample(plan: StepPlan, logits: torch.Tensor, allowed: torch.Tensor | None) -> StepOutput:
    """The tokens of a pass whose sampled rows' logits are ``logits`` (decode rows with their
    drafted rows, then the chunks that end a prompt), drawn by the sampler's own rule.

    Each lane's first row is drawn as in any step.  A drafted row is drawn only when the
    token drawn at the row before it is the drafted token it was fed, with the draw counter of
    its position; the lane's stage advances by each token drawn, so the penalties and the
    grammar of the next row see exactly the tokens before it (docs/engine.md section 3.1).
    """
    starts: list[int] = []
    offset = 0
    for row in plan.decode:
        starts.append(offset)
        offset += row.rows
    firsts = starts + list(range(offset, logits.shape[0]))
    params = [row.params for row in plan.decode]
    draws = [row.draw for row in plan.decode]
    stages = [row.stage for row in plan.decode]
    for chunk in plan.chunks:
        if chunk.last:
            params.append(chunk.params)
            draws.append(chunk.draw)
            stages.append(chunk.stage)
    if offset == len(plan.decode):
        tokens, logprobs = sample_with_stages(logits, params, draws, stages, allowed)
        return _output(plan, tokens, logprobs)
    index = torch.tensor(firsts, dtype=torch.long, device=logits.device)
    tokens, logprobs = sample_with_stages(
        logits[index], params, draws, stages, None if allowed is None else allowed[index]
    )
    drafted, drafted_logprobs = _drafted(plan, logits, allowed, tokens, starts)
    return _output(plan, tokens, logprobs, drafted, drafted_logprobs)


def _drafted(
    plan: StepPlan,
    logits: torch.Tensor,
    allowed: torch.Tensor | None,
    tokens: Sequence[int],
    starts: Sequence[int],
) -> tuple[list[tuple[int, ...]], list[tuple[TokenLogprob | None, ...]]]:
    """Per decode row, the tokens drawn at the rows its accepted draft opened (and their
    logprobs): a row's drafted rows are walked while the token drawn is the one drafted next
    (``tokens``: each row's first token; ``starts``: where its rows start in ``logits``)."""
    drafted: list[list[int]] = [[] for _ in plan.decode]
    drafted_logprobs: list[list[TokenLogprob | None]] = [[] for _ in plan.decode]
    alive = [r for r, row in enumerate(plan.decode) if row.draft and tokens[r] == row.draft[0]]
    depth = 1
    while alive:
        rows = [plan.decode[r] for r in alive]
        index = torch.tensor([starts[r] + depth for r in alive], dtype=torch.long)
        sampled, sampled_logprobs = sample_with_stages(
            logits[index],
            [row.params for row in rows],
            [(row.draw + depth) & _MASK64 for row in rows],
            [row.stage for row in rows],
            None if allowed is None else allowed[index],
        )
        following: list[int] = []
        for r, row, token, logprob in zip(
            alive, rows, sampled, sampled_logprobs or [None] * len(rows), strict=True
        ):
            drafted[r].append(token)
            drafted_logprobs[r].append(logprob)
            if depth < len(row.draft) and token == row.draft[depth]:
                following.append(r)
        alive = following
        depth += 1
    return [tuple(more) for more in drafted], [tuple(more) for more in drafted_logprobs]


class _Attention:
    """Per-step attention inputs: where each decode row's key and value go, which lanes are
    attended together, and each prompt chunk's attention calls.

    Every query row is attended the same way wherever it comes from (a decode row, any prompt
    chunk, a prompt after a reused prefix), so that its result, and the KV the next layers
    compute from it, depend on its lane's tokens only (docs/engine.md section 4): it reads the
    keys up to :func:`key_length` of its position, the positions past its own masked; the
    query heads that share a key/value head are laid out as that head's query rows; and the
    call it is in has fewer than :data:`CALL_ROWS` rows, padded (:func:`padded_rows`) so that no
    block of the kernel is short.  The kernel's rounding of a row then depends on nothing else
    in the call (tested).
    """

    def __init__(self, runner: LlamaRunner, plan: StepPlan) -> None:
        device = runner.device
        window = runner.window
        groups = runner._groups
        decode = _decode_positions(plan)
        self.rows = len(decode)
        self.slot_index = torch.tensor(
            [slot for slot, _ in decode], dtype=torch.long, device=device
        )
        self.position_index = torch.tensor(
            [position for _, position in decode], dtype=torch.long, device=device
        )
        self.decode_rows = padded_rows(groups)
        """Query rows of each decoding lane's attention problem (its query heads, padded)."""
        self.groups: list[tuple[list[int], Any, int, torch.Tensor]] = []
        """Per group: its decode rows, their slots (a slice when consecutive), key length,
        mask."""
        self.restore: torch.Tensor | None = None
        """Puts the groups' rows back in decode order, when grouping moved them."""
        self._group(decode, window, device)
        per_call = positions_per_call(groups)
        self.chunks: list[tuple[int, int, int, list[tuple[int, int, int, torch.Tensor]]]] = []
        """Per chunk: its slot, first position, length, and its calls: (first and end row in
        the chunk, key length, mask)."""
        for chunk in plan.chunks:
            calls = _chunk_calls(chunk, per_call, groups, window, device)
            self.chunks.append((chunk.slot, chunk.start, len(chunk.tokens), calls))
        self.longest = max(
            [length for _, _, length, _ in self.groups]
            + [call[2] for *_, calls in self.chunks for call in calls],
            default=0,
        )
        """The longest key length any call reads."""

    def _group(self, decode: list[tuple[int, int]], window: int, device: torch.device) -> None:
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
            lengths = torch.tensor([decode[i][1] + 1 for i in members], device=device)
            valid = torch.arange(length, device=device).unsqueeze(0) < lengths.unsqueeze(1)
            self.groups.append((members, where, length, valid.view(len(members), 1, 1, length)))
            order += members
        if order != list(range(self.rows)):
            inverse = [0] * self.rows
            for position, row in enumerate(order):
                inverse[row] = position
            self.restore = torch.tensor(inverse, dtype=torch.long, device=device)


def _chunk_calls(
    chunk: ChunkRow, per_call: int, groups: int, window: int, device: torch.device
) -> list[tuple[int, int, int, torch.Tensor]]:
    """A prompt chunk's attention calls, ``per_call`` positions each (they share a key
    length): (first and end row in the chunk, key length, mask)."""
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
        columns = torch.arange(length, device=device)
        mask = (columns.unsqueeze(0) <= positions.unsqueeze(1)).view(1, 1, -1, length)
        calls.append((first - chunk.start, end - chunk.start, length, mask))
        first = end
    return calls


class LlamaRunner:
    """Runs steps of one Llama model over ``slots`` KV slots (see the module docstring)."""

    def __init__(
        self,
        weights: LlamaWeights,
        *,
        slots: int,
        window: int,
        device: torch.device,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        pool_blocks: int = 0,
        fused: bool = True,
        masks: MaskWorker | None = None,
    ) -> None:
        """``fused`` runs the whole step through the native library
        (:class:`~sfnode.engines.kernels.native.NativeStep`) where the weights allow it;
        :attr:`fused_reason` says why not otherwise."""
        self.weights = weights
        self.device = device
        self.masks = masks
        """Computes constrained rows' grammar masks while the forward pass runs."""
        self.window = window
        w = weights
        self._hidden = int(w.embed.shape[1])
        self._heads, self._kv_heads, self._head_dim = w.heads, w.kv_heads, w.head_dim
        self._groups = w.heads // w.kv_heads
        self._scaling = w.head_dim**-0.5
        self._intermediate = w.layers[0].gate_up.out_features // 2
        self.kv = SlotKV(
            layers=len(w.layers),
            slots=slots,
            kv_heads=w.kv_heads,
            head_dim=w.head_dim,
            window=window,
            dtype=w.kv_dtype or w.activations,
            device=device,
        )
        self._kv_cast = self.kv.dtype != w.activations
        """Whether keys and values are stored in another type than they are computed in."""
        self.pool = BlockPool(self.kv, pool_blocks) if pool_blocks > 0 else None
        # cos/sin of every position, computed as transformers' rotary embedding computes them.
        positions = torch.arange(window, dtype=torch.float32, device=device)
        freqs = positions.unsqueeze(1) * inv_freq.to(device=device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * attention_scaling).to(w.activations)
        half = emb.shape[-1] // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(device)
        self._sin = (emb.sin() * attention_scaling * sign).to(w.activations)
        """sin with the sign of rotate_half folded in (see :func:`_rotate`)."""
        self.fused: NativeStep | None = None
        library = w.family.library if w.family is not None else None
        self.fused_reason = "turned off" if not fused else fusable(w)
        if self.fused_reason is None and library is None:
            self.fused_reason = "the native kernels are not in use"
        if self.fused_reason is None and library is not None:
            self.fused = NativeStep(w, library, self._cos, self._sin)

    @classmethod
    def for_model(
        cls,
        model: Any,
        weights: LlamaWeights,
        *,
        slots: int,
        window: int,
        pool_blocks: int = 0,
        fused: bool = True,
        masks: MaskWorker | None = None,
    ) -> LlamaRunner:
        rotary = model.model.rotary_emb
        return cls(
            weights,
            slots=slots,
            window=window,
            device=next(model.parameters()).device,
            inv_freq=rotary.inv_freq,
            attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
            pool_blocks=pool_blocks,
            fused=fused,
            masks=masks,
        )

    # -- steps ------------------------------------------------------------------------------------

    def run(self, plan: StepPlan) -> StepOutput:
        """Execute ``plan``: block saves, block loads, then one pass; sample what it asks for."""
        with torch.inference_mode():
            if self.pool is not None:
                for save in plan.saves:
                    self.pool.save(save.slot, save.first, save.blocks)
                for load in plan.loads:
                    self.pool.load(load.slot, load.first, load.blocks, load.tail)
            if not plan.decode and not plan.chunks:
                return StepOutput()
            decode = _decode_positions(plan)
            attention = _Attention(self, plan)
            self.kv.ensure(attention.longest)
            ids: list[int] = [token for row in plan.decode for token in (row.token, *row.draft)]
            positions: list[int] = [position for _, position in decode]
            for chunk in plan.chunks:
                ids.extend(chunk.tokens)
                positions.extend(range(chunk.start, chunk.start + len(chunk.tokens)))
            # Logits only where a token may be sampled: every decode row (drafted ones too), a
            # prompt's last position.  Per such row, the stage and the drafted tokens its
            # grammar mask must have consumed first.
            wanted = list(range(len(decode)))
            stages = [row.stage for row in plan.decode for _ in range(row.rows)]
            prefixes = [row.draft[:depth] for row in plan.decode for depth in range(row.rows)]
            offset = len(decode)
            for chunk in plan.chunks:
                offset += len(chunk.tokens)
                if chunk.last:
                    wanted.append(offset - 1)
                    stages.append(chunk.stage)
                    prefixes.append(())
            # The constrained rows' masks are computed while the forward pass runs.
            pending = self.masks.start(stages, prefixes) if self.masks is not None else None
            try:
                if self.fused is not None:
                    slots = [slot for slot, _ in decode]
                    for chunk in plan.chunks:
                        slots.extend([chunk.slot] * len(chunk.tokens))
                    hidden = self.fused.forward(self.kv, positions, slots, tokens=ids)
                else:
                    hidden = self._forward(ids, positions, attention)
            finally:
                masks = pending.wait() if pending is not None else None
            if not wanted:
                return StepOutput(chunks=tuple(None for _ in plan.chunks))
            allowed = None if masks is None else allowed_rows(masks, self.weights.vocab_size)
            if self.fused is not None:
                if len(wanted) != hidden.shape[0]:
                    hidden = hidden[torch.tensor(wanted, dtype=torch.long)]
                logits = self.fused.logits(hidden, masks, REFINED)
            else:
                logits = self._logits(hidden, wanted, allowed)
            return _sample(plan, logits, allowed)

    def _logits(
        self, hidden: torch.Tensor, rows: Sequence[int], allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Float32 logits of ``rows`` of ``hidden``.

        A bfloat16 logit near 25 is rounded to steps of 0.125, coarser than the gap between a
        small model's two best tokens can be (SmolLM2 answers "The capital..." over "L'..." by
        0.08).  So the best ``REFINED`` logits of each row are computed again in float32 from
        the head's float weights, which decides greedy choices and the most likely draws as a
        float32 head would; the rest keep their bfloat16 values (an int4 head's error then costs
        the bundled model under 1% of perplexity).

        With ``allowed`` (a grammar's mask of each row, docs/engine.md section 2.4) the tokens
        it forbids are -inf, and the refined ones are the best allowed ones.
        """
        w = self.weights
        if len(rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        if self.fused is not None:
            return self.fused.logits(hidden, None, REFINED)
        normed = F.rms_norm(hidden, (self._hidden,), w.final_norm, w.eps)
        logits = _multiply(w.lm_head, normed).to(torch.float32)
        if allowed is not None:
            logits.masked_fill_(~allowed, float("-inf"))
        if w.lm_head_float is None:
            return logits
        exact = F.rms_norm(hidden.to(torch.float32), (self._hidden,), w.final_norm_float, w.eps)
        best = torch.topk(logits, min(REFINED, logits.shape[1]), dim=1).indices
        rows_of = w.lm_head_float[best]  # [rows, REFINED, hidden]
        # A product and a sum along each row, not a batched matmul: its rounding then does not
        # depend on how many rows share the step.
        refined = (rows_of * exact.unsqueeze(1)).sum(-1)
        logits.scatter_(1, best, refined)
        if allowed is not None:
            # A row with fewer than REFINED allowed tokens had forbidden ones refined too.
            logits.masked_fill_(~allowed, float("-inf"))
        return logits

    def _forward(
        self, ids: Sequence[int], positions: Sequence[int], attention: _Attention
    ) -> torch.Tensor:
        w = self.weights
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = w.embed[torch.tensor(ids, dtype=torch.long, device=self.device)]
        cos = self._cos[index].unsqueeze(1)
        sin = self._sin[index].unsqueeze(1)
        groups = self._row_groups(attention)
        for layer_index in range(len(w.layers)):
            hidden = self._layer(layer_index, hidden, cos, sin, attention, groups, index)
        return hidden

    def _row_groups(self, attention: _Attention) -> Groups:
        """Decode rows use the kernels; a prompt chunk uses the dense copies when it is long."""
        threshold = self.weights.dense_rows
        spans = [(0, attention.rows, False)] if attention.rows else []
        offset = attention.rows
        for _, _, n, _ in attention.chunks:
            spans.append((offset, offset + n, threshold is not None and n >= threshold))
            offset += n
        groups: Groups = []
        for start, end, dense in spans:
            if groups and groups[-1][2] == dense:
                groups[-1] = (groups[-1][0], end, dense)
            else:
                groups.append((start, end, dense))
        return groups

    def _layer(
        self,
        index: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: _Attention | None,
        groups: Groups,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """One decoder layer over ``hidden`` rows at ``positions``; ``attention`` None means one
        causal sequence without a cache (a pipeline stage)."""
        w = self.weights
        layer = w.layers[index]
        rows = hidden.shape[0]
        heads, kv_heads, head_dim = self._heads, self._kv_heads, self._head_dim
        x = F.rms_norm(hidden, (self._hidden,), layer.input_norm, w.eps)
        qkv = _project(layer.qkv, x, groups)
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
        value = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
        qk = _rotate(qk, cos, sin)
        query, key = qk[:, :heads], qk[:, heads:]
        if attention is None:
            attended = self._sequence_attention(query, key, value)
        else:
            attended = self._attend(index, query, key, value, attention)
        hidden = hidden + _project(layer.o, attended, groups)
        x = F.rms_norm(hidden, (self._hidden,), layer.post_norm, w.eps)
        gate_up = _project(layer.gate_up, x, groups)
        gated = F.silu(gate_up[:, : self._intermediate]) * gate_up[:, self._intermediate :]
        return hidden + _project(layer.down, gated, groups)

    def _attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention: _Attention,
    ) -> torch.Tensor:
        """Attention of every row of a step (see :class:`_Attention` for how it is cut)."""
        keys, values = self.kv.keys[layer], self.kv.values[layer]
        parts: list[torch.Tensor] = []
        decode = attention.rows
        if decode:
            parts.append(self._attend_decode(keys, values, query, key, value, attention))
        offset = decode
        for slot, start, n, calls in attention.chunks:
            end = start + n
            keys[slot, :, start:end] = key[offset : offset + n].transpose(0, 1)
            values[slot, :, start:end] = value[offset : offset + n].transpose(0, 1)
            parts.extend(self._attend_chunk(keys, values, query[offset : offset + n], slot, calls))
            offset += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _attend_decode(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention: _Attention,
    ) -> torch.Tensor:
        """The decode rows' attention: their keys and values written into their slots first,
        lanes of equal key length in one call."""
        kv_heads, head_dim, groups = self._kv_heads, self._head_dim, self._groups
        decode = attention.rows
        new_keys, new_values = key[:decode], value[:decode]
        if self._kv_cast:
            new_keys, new_values = new_keys.to(keys.dtype), new_values.to(values.dtype)
        keys[attention.slot_index, :, attention.position_index] = new_keys
        values[attention.slot_index, :, attention.position_index] = new_values
        # Each key/value head answers its group of query heads: the group is laid out as
        # that head's "query positions", so no key or value is repeated.
        grouped = query[:decode].reshape(decode, kv_heads, groups, head_dim)
        grouped = _pad_rows(grouped, attention.decode_rows)
        outs = []
        for members, where, length, valid in attention.groups:
            if isinstance(where, slice):
                k, v = keys[where, :, :length], values[where, :, :length]
            else:
                k = keys.index_select(0, where)[:, :, :length]
                v = values.index_select(0, where)[:, :, :length]
            q = grouped if len(members) == decode else grouped[members]
            if self._kv_cast:
                k, v = k.to(q.dtype), v.to(q.dtype)
            outs.append(
                F.scaled_dot_product_attention(q, k, v, attn_mask=valid, scale=self._scaling)
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if attention.restore is not None:
            out = out.index_select(0, attention.restore)
        return out[:, :, :groups].reshape(decode, self._heads * head_dim)

    def _attend_chunk(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        slot: int,
        calls: list[tuple[int, int, int, torch.Tensor]],
    ) -> list[torch.Tensor]:
        """A prompt chunk's attention, call by call, over its slot's keys (``query``: the
        chunk's rows)."""
        kv_heads, head_dim, groups = self._kv_heads, self._head_dim, self._groups
        parts = []
        for first, last, length, mask in calls:
            rows = last - first
            # [rows, heads, dim] -> [1, kv_heads, rows * groups, dim], position-major.
            q = (
                query[first:last]
                .view(rows, kv_heads, groups, head_dim)
                .permute(1, 0, 2, 3)
                .reshape(1, kv_heads, rows * groups, head_dim)
            )
            k, v = keys[slot : slot + 1, :, :length], values[slot : slot + 1, :, :length]
            if self._kv_cast:
                k, v = k.to(q.dtype), v.to(q.dtype)
            out = F.scaled_dot_product_attention(
                _pad_rows(q, mask.shape[2]),
                k,
                v,
                attn_mask=mask,
                scale=self._scaling,
            )
            parts.append(
                out[0, :, : rows * groups]
                .view(kv_heads, rows, groups, head_dim)
                .permute(1, 0, 2, 3)
                .reshape(rows, self._heads * head_dim)
            )
        return parts

    def _sequence_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        n = query.shape[0]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=self._scaling,
            enable_gqa=self._groups > 1,
        )
        return out[0].transpose(0, 1).reshape(n, -1)

    def sequence_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Float32 logits ``[len(tokens), vocab]`` of every position of one causal sequence,
        without touching the KV slots (for measuring a weights mode, e.g. its perplexity)."""
        w = self.weights
        n = len(tokens)
        if self.fused is not None:
            with torch.inference_mode():
                hidden = self.fused.forward(
                    self._scratch_kv(n), range(n), [0] * n, tokens=list(tokens)
                )
                return self._logits(hidden, range(n))
        with torch.inference_mode():
            hidden = w.embed[torch.tensor(list(tokens), dtype=torch.long, device=self.device)]
            cos = self._cos[:n].unsqueeze(1)
            sin = self._sin[:n].unsqueeze(1)
            groups = [(0, n, w.dense_rows is not None and n >= w.dense_rows)]
            positions = torch.arange(n, device=self.device)
            for index in range(len(w.layers)):
                hidden = self._layer(index, hidden, cos, sin, None, groups, positions)
            return self._logits(hidden, range(n))

    def check_exactness(self, length: int = 80, decoded: int = 10) -> str | None:
        """None when a prompt computed in one chunk and the same prompt whose last ``decoded``
        tokens are fed as decode rows leave the same keys and values and give the same logits,
        here, with these kernels; else what differed.  Run at start, before any lane holds a
        slot (it uses slot 0); docs/engine.md section 4 says what depends on it."""
        length = min(length, self.window - 1)
        decoded = min(decoded, length - 1)
        vocab = self.weights.vocab_size
        prompt = tuple(3 + (i * 7919) % max(1, vocab - 3) for i in range(length))
        params = GenParams(logprobs=20)
        whole = self.run(StepPlan(chunks=(ChunkRow(0, 0, prompt, True, params, 0),)))
        kept = [t[0, :, :length].clone() for t in self.kv.keys + self.kv.values]
        split = length - decoded
        self.run(StepPlan(chunks=(ChunkRow(0, 0, prompt[:split], False, params, 0),)))
        fed = StepOutput()
        for position in range(split, length):
            fed = self.run(StepPlan(decode=(DecodeRow(0, prompt[position], position, params, 0),)))
        layers = len(self.kv.keys)
        for index, tensor in enumerate(self.kv.keys + self.kv.values):
            if not torch.equal(tensor[0, :, :length], kept[index]):
                name = "keys" if index < layers else "values"
                return f"the {name} of layer {index % layers} differ"
        if whole.chunk_logprobs != fed.decode_logprobs:
            return "the logits of the next token differ"
        return None

    def _scratch_kv(self, positions: int) -> SlotKV:
        """One KV slot of ``positions`` positions, apart from the lanes' (a pipeline stage or a
        whole sequence computed without touching them), in float32 as the per-operator layers
        attend a sequence."""
        kv = SlotKV(
            layers=len(self.weights.layers),
            slots=1,
            kv_heads=self._kv_heads,
            head_dim=self._head_dim,
            window=positions,
            dtype=torch.float32,
            device=self.device,
        )
        kv.ensure(positions)
        return kv

    # -- pipeline stages --------------------------------------------------------------------------

    def stage(
        self, tokens: Sequence[int], start: int, end: int, hidden_in: torch.Tensor | None
    ) -> StageResult:
        """Layers ``[start, end)`` over ``tokens`` (first stage) or ``hidden_in``; the stage that
        ends at the last layer answers the greedy next token of the sequence's last position."""
        from sfnode.engines.runners.hidden import encode_hidden

        w = self.weights
        layers = len(w.layers)
        if not 0 <= start <= end <= layers:
            raise StageForwardError(f"bad layer bounds [{start}, {end}) for {layers} layers")
        with torch.inference_mode():
            if hidden_in is None:
                if start != 0 or not tokens:
                    raise StageForwardError("a first stage needs tokens and start_layer 0")
                if min(tokens) < 0 or max(tokens) >= w.vocab_size:
                    raise StageForwardError("a token id is outside the vocabulary")
                hidden = w.embed[torch.tensor(list(tokens), dtype=torch.long, device=self.device)]
            else:
                # A copy: the fused layers write into the hidden states in place.
                hidden = hidden_in.to(device=self.device, dtype=w.activations, copy=True)
            n = hidden.shape[0]
            if n > self.window:
                raise StageForwardError(f"{n} tokens exceed the window of {self.window}")
            if self.fused is not None:
                hidden = self.fused.forward(
                    self._scratch_kv(n), range(n), [0] * n, hidden=hidden, first=start, end=end
                )
                if end < layers:
                    return StageResult(hidden=encode_hidden(hidden))
                logits = self._logits(hidden, [n - 1])[0]
                return StageResult(token=int(torch.argmax(logits).item()))
            cos = self._cos[:n].unsqueeze(1)
            sin = self._sin[:n].unsqueeze(1)
            threshold = w.dense_rows
            groups = [(0, n, threshold is not None and n >= threshold)]
            positions = torch.arange(n, device=self.device)
            for index in range(start, end):
                hidden = self._layer(index, hidden, cos, sin, None, groups, positions)
            if end < layers:
                return StageResult(hidden=encode_hidden(hidden))
            logits = self._logits(hidden, [n - 1])[0]
            return StageResult(token=int(torch.argmax(logits).item()))
