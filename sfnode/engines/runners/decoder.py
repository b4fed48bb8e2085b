"""The model runner of every family sfnode reads (docs/engine.md section 5.4): executes a
:class:`~sfnode.engines.scheduling.plan.StepPlan` over a model's
:class:`~sfnode.engines.weights.gather.ModelWeights`, as its
:class:`~sfnode.engines.families.spec.ModelSpec` says.

One step is one pass over the weights for every row it carries: each decoding lane's next token
and the prompt chunks riding along, all through the same matrix products (reading the weights is
most of what a step costs on a CPU, whatever the row count).  Decoding lanes attend to their own
slots of :class:`~sfnode.engines.runners.kv.SlotKV` (query heads grouped onto their key/value
heads), lanes of similar length in one call; each prompt chunk attends to its own slot, a few
positions per call (:mod:`sfnode.engines.runners.attention`).  A row is computed the same way
wherever it is (a decode row, any chunk, after a reused prefix), so a position's KV and logits
depend on its lane's tokens only, bit for bit (:func:`_multiply`; docs/engine.md section 4).

The arithmetic is the model's, with few, large operators instead of transformers' modules: RMS
norms (and, by the family, q/k norms and norms after each half of a layer), one query/key/value
product (with its bias where the family has one), the rotary embedding from tables computed once
per layer's rope (its scaling, its rotated dimensions), grouped-query attention (a sliding
window on the layers that have one, soft-capped scores), the gated MLP (SiLU or GELU), the
scaled embedding and the soft-capped logits; every difference between families is data of the
spec, none a branch on a family's name.  In float32 the tokens are those of the model's own
``generate()`` (tested for every family); the logits agree to float32 rounding, not bit for
bit.  The quantized modes compute in bfloat16 between their matrices with torch's kernels, in
float32 with sfnode's (docs/engine.md section 5).  Where sfnode's kernels serve every matrix, the
whole step runs in two native calls instead
(:class:`~sfnode.engines.kernels.native.NativeStep`, docs/engine.md section 5.2).

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

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F  # noqa: N812

from sfnode.decoding.sampler import allowed_rows, sample_with_stages
from sfnode.engines.families.rope import Rope
from sfnode.engines.kernels.native import NativeStep, fusable
from sfnode.engines.kernels.quant import Float32Linear, Linear, Projection
from sfnode.engines.runners.attention import Attender, StepAttention, decode_positions
from sfnode.engines.runners.kv import KV_GROWTH, BlockPool, SlotKV
from sfnode.engines.runners.masks import MaskWorker
from sfnode.engines.scheduling.plan import StepOutput, StepPlan
from sfnode.engines.weights.gather import ModelWeights
from sfnode.generation import StageForwardError, StageResult, TokenLogprob

_MASK64 = (1 << 64) - 1

REFINED = 128
"""Logits per row computed again in float32 (see :meth:`DecoderRunner._logits`)."""

Groups = list[tuple[int, int, bool]]
"""Row ranges of a step and whether they use the dense copies (``(start, end, dense)``)."""


def rope_tables(rope: Rope, window: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)`` ``[window, rope.dims]`` of every position, computed as
    transformers' rotary embedding computes them (:meth:`Rope.cos_sin`), ``sin`` with the sign
    of ``rotate_half`` folded in (see :func:`rotate`).  A ``dynamic`` rope within its own
    context is the plain one, and the window never exceeds the context."""
    cos, sin = rope.cos_sin(window)
    half = rope.dims // 2
    sign = torch.cat([-torch.ones(half), torch.ones(half)])
    return cos.to(dtype), (sin * sign).to(dtype)


class RopeTables:
    """Each layer's rotary tables ``(cos, signed_sin)`` (:func:`rope_tables`; layers of one
    rope share theirs) of the positions ``0 .. length - 1``: computed for the first
    :data:`~sfnode.engines.runners.kv.KV_GROWTH` positions, and again for more when a step
    needs them (doubling, a multiple of ``KV_GROWTH``, never beyond the window), as the keys
    and values grow.  A row of a table is a function of its position alone, whatever the
    table's length (tested), so growing changes nothing computed; the tables of a 32,768-position
    window (16 MB for Qwen2.5-0.5B's shape) are paid only by a node whose lanes get that long
    (docs/engine.md section 5.3)."""

    def __init__(self, ropes: Sequence[Rope], window: int, dtype: torch.dtype) -> None:
        self._ropes = list(ropes)
        self.window = window
        self._dtype = dtype
        self.length = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cover(1)

    def cover(self, positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's tables, of at least ``positions`` positions (at most the window)."""
        if positions > self.length and self.length < self.window:
            wanted = max(positions, 2 * self.length)
            length = min(self.window, -(-wanted // KV_GROWTH) * KV_GROWTH)
            tables: dict[Rope, tuple[torch.Tensor, torch.Tensor]] = {}
            for rope in self._ropes:
                if rope not in tables:
                    tables[rope] = rope_tables(rope, length, self._dtype)
            self.layers = [tables[rope] for rope in self._ropes]
            self.length = length
        return self.layers


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of the first ``cos.shape[-1]`` dimensions of each head:
    ``x * cos + rotate_half(x) * sin``, the rest passed through.

    ``rotate_half(x)`` is ``[-x2, x1]`` for the halves ``x1, x2`` of the rotated part, which is
    that part rolled by half its length with the first half's sign flipped; the flip is folded
    into ``signed_sin`` once, so a layer does a roll and a fused multiply-add.
    """
    dims = cos.shape[-1]
    if dims == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(dims // 2, dims=-1), signed_sin)
    turned = x[..., :dims]
    turned = torch.addcmul(turned * cos, turned.roll(dims // 2, dims=-1), signed_sin)
    return torch.cat([turned, x[..., dims:]], dim=-1)


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


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": _gelu_tanh,
}
"""The gated MLP's activation by the spec's name for it."""


class DecoderRunner:
    """Runs steps of one model over ``slots`` KV slots (see the module docstring)."""

    def __init__(
        self,
        weights: ModelWeights,
        *,
        slots: int,
        window: int,
        pool_blocks: int = 0,
        fused: bool = True,
        masks: MaskWorker | None = None,
    ) -> None:
        """``fused`` runs the whole step through the native library
        (:class:`~sfnode.engines.kernels.native.NativeStep`) where the weights allow it;
        :attr:`fused_reason` says why not otherwise."""
        self.weights = weights
        spec = self.spec = weights.spec
        self.device = weights.final_norm.device
        self.masks = masks
        """Computes constrained rows' grammar masks while the forward pass runs."""
        self.window = window
        self.kv = SlotKV(
            layers=spec.layers,
            slots=slots,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            window=window,
            dtype=weights.kv_dtype or weights.activations,
            device=self.device,
        )
        self.pool = BlockPool(self.kv, pool_blocks) if pool_blocks > 0 else None
        self.attender = Attender(
            self.kv,
            heads=spec.heads,
            scale=spec.attention_scale,
            softcap=spec.attn_softcap,
            cast=self.kv.dtype != weights.activations,
        )
        ropes = [spec.rope_of(layer) for layer in range(spec.layers)]
        self._rope = RopeTables(ropes, window, weights.activations)
        """Each layer's rotary tables (layers of one rope share them), grown as needed."""
        self._embed_scale = (
            None
            if spec.embed_scale is None
            else torch.tensor(spec.embed_scale, dtype=weights.activations, device=self.device)
        )
        self._activation = _ACTIVATIONS[spec.activation]
        self.fused: NativeStep | None = None
        library = weights.family.library if weights.family is not None else None
        self.fused_reason = "turned off" if not fused else fusable(weights)
        if self.fused_reason is None and library is None:
            self.fused_reason = "the native kernels are not in use"
        if self.fused_reason is None and library is not None:
            self.fused = NativeStep(weights, library, self._rope)

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
            return self._pass(plan)

    def _pass(self, plan: StepPlan) -> StepOutput:
        """One pass over the weights for every row of ``plan``, then the sampling."""
        decode = decode_positions(plan)
        attention = StepAttention(
            plan,
            groups=self.spec.heads // self.spec.kv_heads,
            window=self.window,
            sliding=self.spec.sliding_window,
            device=self.device,
        )
        self.kv.ensure(attention.longest)
        ids: list[int] = [token for row in plan.decode for token in (row.token, *row.draft)]
        positions: list[int] = [position for _, position in decode]
        slots = [slot for slot, _ in decode]
        for chunk in plan.chunks:
            ids.extend(chunk.tokens)
            positions.extend(range(chunk.start, chunk.start + len(chunk.tokens)))
            slots.extend([chunk.slot] * len(chunk.tokens))
        # Logits only where a token may be sampled: every decode row (drafted ones too), a
        # prompt's last position.  Per such row, the stage and the drafted tokens its grammar
        # mask must have consumed first.
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
        """Float32 logits of ``rows`` of ``hidden`` (soft-capped where the spec says so).

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
        normed = F.rms_norm(hidden, (w.hidden,), w.final_norm, w.eps)
        logits = _multiply(w.lm_head, normed).to(torch.float32)
        if allowed is not None:
            logits.masked_fill_(~allowed, float("-inf"))
        if w.lm_head_float is not None:
            exact = F.rms_norm(hidden.to(torch.float32), (w.hidden,), w.final_norm_float, w.eps)
            best = torch.topk(logits, min(REFINED, logits.shape[1]), dim=1).indices
            rows_of = w.lm_head_float[best]  # [rows, REFINED, hidden]
            # A product and a sum along each row, not a batched matmul: its rounding then does
            # not depend on how many rows share the step.
            refined = (rows_of * exact.unsqueeze(1)).sum(-1)
            logits.scatter_(1, best, refined)
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if allowed is not None:
            # A row with fewer than REFINED allowed tokens had forbidden ones refined (and every
            # forbidden one capped) too.
            logits.masked_fill_(~allowed, float("-inf"))
        return logits

    def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        """The rows of ``ids`` in the activations' type, scaled where the spec says so."""
        w = self.weights
        hidden = w.embed[torch.tensor(list(ids), dtype=torch.long, device=self.device)]
        hidden = hidden.to(w.activations)
        if self._embed_scale is not None:
            hidden = hidden * self._embed_scale
        return hidden

    def _turns(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's rotary rows at ``positions`` (each distinct table indexed once)."""
        tables = self._rope.cover(int(positions.max()) + 1 if positions.numel() else 0)
        picked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for cos, sin in tables:
            if id(cos) not in picked:
                picked[id(cos)] = (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
        return [picked[id(cos)] for cos, _ in tables]

    def _forward(
        self, ids: Sequence[int], positions: Sequence[int], attention: StepAttention
    ) -> torch.Tensor:
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self._embed(ids)
        turns = self._turns(index)
        groups = self._row_groups(attention)
        for layer in range(len(self.weights.layers)):
            hidden = self._layer(layer, hidden, turns[layer], attention, groups)
        return hidden

    def _row_groups(self, attention: StepAttention) -> Groups:
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

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.weights.eps)

    def _layer(
        self,
        index: int,
        hidden: torch.Tensor,
        turn: tuple[torch.Tensor, torch.Tensor],
        attention: StepAttention | None,
        groups: Groups,
    ) -> torch.Tensor:
        """One decoder layer over ``hidden`` rows turned by ``turn`` (their rotary rows);
        ``attention`` None means one causal sequence without a cache (a pipeline stage)."""
        spec, layer = self.spec, self.weights.layers[index]
        rows, heads, kv_heads, head_dim = hidden.shape[0], spec.heads, spec.kv_heads, spec.head_dim
        qkv = _project(layer.qkv, self._norm(hidden, layer.attn_norm), groups)
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
        value = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            qk = torch.cat(
                [self._norm(qk[:, :heads], layer.q_norm), self._norm(qk[:, heads:], layer.k_norm)],
                dim=1,
            )
        qk = rotate(qk, *turn)
        query, key = qk[:, :heads], qk[:, heads:]
        sliding = spec.is_sliding(index)
        if attention is None:
            window = spec.sliding_window if sliding else None
            attended = self.attender.sequence(query, key, value, window)
        else:
            attended = self.attender.step(index, query, key, value, attention, sliding)
        hidden = hidden + self._closed(_project(layer.o, attended, groups), layer.attn_post_norm)
        gate_up = _project(layer.gate_up, self._norm(hidden, layer.mlp_norm), groups)
        gated = self._activation(gate_up[:, : spec.intermediate]) * gate_up[:, spec.intermediate :]
        return hidden + self._closed(_project(layer.down, gated, groups), layer.mlp_post_norm)

    def _closed(self, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """A half of a layer's output, normed where the family norms it before the residual
        add (Gemma's sandwich norms)."""
        return out if norm is None else self._norm(out, norm)

    def _sequence(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Layers ``[start, end)`` over one whole causal sequence, as torch operators."""
        n = hidden.shape[0]
        threshold = self.weights.dense_rows
        groups = [(0, n, threshold is not None and n >= threshold)]
        turns = self._turns(torch.arange(n, device=self.device))
        for index in range(start, end):
            hidden = self._layer(index, hidden, turns[index], None, groups)
        return hidden

    def sequence_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Float32 logits ``[len(tokens), vocab]`` of every position of one causal sequence,
        without touching the KV slots (for measuring a weights mode, e.g. its perplexity)."""
        n = len(tokens)
        with torch.inference_mode():
            if self.fused is not None:
                hidden = self.fused.forward(
                    self._scratch_kv(n), range(n), [0] * n, tokens=list(tokens)
                )
            else:
                hidden = self._sequence(self._embed(tokens), 0, len(self.weights.layers))
            return self._logits(hidden, range(n))

    def check_exactness(self, length: int = 80, decoded: int = 10) -> str | None:
        """None when a prompt computed in one chunk and the same prompt whose last ``decoded``
        tokens are fed as decode rows leave the same keys and values and give the same logits,
        here, with these kernels; else what differed (on a slot of its own:
        :class:`~sfnode.engines.runners.exactness.ExactnessCheck`, whose pieces the engine runs
        between steps).  docs/engine.md section 4 says what depends on it."""
        from sfnode.engines.runners.exactness import ExactnessCheck

        return ExactnessCheck(self, length, decoded).run_all()

    def check_runner(self, positions: int) -> DecoderRunner:
        """A runner of one slot of ``positions`` over the same weights, kernels and step (the
        start-up check's: it never touches the lanes' slots)."""
        return DecoderRunner(self.weights, slots=1, window=positions, fused=self.fused is not None)

    def _scratch_kv(self, positions: int) -> SlotKV:
        """One KV slot of ``positions`` positions, apart from the lanes' (a pipeline stage or a
        whole sequence computed without touching them), in float32 as the per-operator layers
        attend a sequence."""
        kv = SlotKV(
            layers=len(self.weights.layers),
            slots=1,
            kv_heads=self.spec.kv_heads,
            head_dim=self.spec.head_dim,
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
                hidden = self._embed(tokens)
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
            else:
                hidden = self._sequence(hidden, start, end)
            if end < layers:
                return StageResult(hidden=encode_hidden(hidden))
            logits = self._logits(hidden, [n - 1])[0]
            return StageResult(token=int(torch.argmax(logits).item()))
