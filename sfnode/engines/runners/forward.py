"""The model runner for any causal LM: executes a :class:`~sfnode.engines.scheduling.plan.StepPlan`
through the model's own forward and transformers' cache classes.

Used for ``--stock-kernels``: a transformers model object's own forward (every family sfnode
reads is otherwise served by :class:`~sfnode.engines.runners.decoder.DecoderRunner`).  Decoding
lanes share one batch cache whose rows are left-padded to a common length (a 2D attention mask
and explicit position ids make the padding invisible); a prompt is
computed chunk by chunk into a cache of its own and merged into the batch when its first token is
out; a lane that the plan no longer decodes has left, and its row is dropped (with the padding
every remaining row shares).  The cache of a prompt that ended half computed stays until its slot
starts a new prompt (at most one per slot).  Prompt chunks and the decode step are separate
forwards.  It keeps no prefix cache and verifies no drafts: a plan given to it never has block
loads or saves, nor a decode row with a draft.

This module must never be called from two threads at once, and never sample with a random
generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sfnode.decoding.sampler import allowed_rows, sample_with_stages
from sfnode.engines.kernels.torch_ops import lane_cache, onednn_on_this_thread, use_onednn_linear
from sfnode.engines.runners.hidden import encode_hidden
from sfnode.engines.runners.masks import MaskWorker
from sfnode.engines.scheduling.plan import ChunkRow, StepOutput, StepPlan
from sfnode.generation import StageForwardError, StageResult, TokenLogprob


class ModelForwardRunner:
    """Runs steps through ``model(...)``; ``onednn`` routes float32 linear layers to oneDNN."""

    def __init__(self, model: Any, *, onednn: bool, masks: MaskWorker | None = None) -> None:
        self._model = model
        self.masks = masks
        """Computes constrained rows' grammar masks while the forward pass runs."""
        self._config = model.config
        self.device: torch.device = next(model.parameters()).device
        self.onednn_layers = use_onednn_linear(model) if onednn else 0
        self._own: dict[int, Any] = {}
        """Caches of lanes whose prompt is being computed, by slot."""
        self._cache: Any = None
        self._rows: list[int] = []
        """Slot of each row of the batch cache."""
        self._pad: list[int] = []

    def prepare_thread(self) -> None:
        """Called first on the worker thread: let it use the oneDNN routing."""
        onednn_on_this_thread(self.onednn_layers > 0)

    def run(self, plan: StepPlan) -> StepOutput:
        if plan.loads or plan.saves:
            raise ValueError("the model-forward runner keeps no prefix cache")
        if any(row.draft for row in plan.decode):
            raise ValueError("the model-forward runner does not verify drafts")
        with torch.inference_mode():
            decoding = [row.slot for row in plan.decode]
            self._drop([slot for slot in self._rows if slot not in set(decoding)])
            decoded: list[int] = []
            decoded_logprobs: list[TokenLogprob | None] = []
            if plan.decode:
                order = {slot: row for row, slot in enumerate(self._rows)}
                missing = [slot for slot in decoding if slot not in order]
                if missing:
                    raise RuntimeError(f"slots {missing} decode without a computed prompt")
                stages = [row.stage for row in plan.decode]
                pending = self.masks.start(stages) if self.masks is not None else None
                try:
                    logits = self._decode_step(plan)
                finally:
                    masks = pending.wait() if pending is not None else None
                rows = [order[row.slot] for row in plan.decode]
                by_row = logits[torch.tensor(rows, dtype=torch.long, device=self.device)]
                by_row = by_row.to(torch.float32)
                params = [row.params for row in plan.decode]
                decoded, decoded_logprobs = sample_with_stages(
                    by_row,
                    params,
                    [row.draw for row in plan.decode],
                    stages,
                    None if masks is None else allowed_rows(masks, by_row.shape[-1]),
                )
            firsts: list[tuple[int, TokenLogprob | None] | None] = []
            for chunk in plan.chunks:
                firsts.append(self._chunk(chunk))
        asked = any(chunk.params.logprobs for chunk in plan.chunks)
        return StepOutput(
            decode=tuple(decoded),
            chunks=tuple(None if f is None else f[0] for f in firsts),
            decode_logprobs=tuple(decoded_logprobs),
            chunk_logprobs=tuple(None if f is None else f[1] for f in firsts) if asked else (),
        )

    def _chunk(self, chunk: ChunkRow) -> tuple[int, TokenLogprob | None] | None:
        if chunk.start == 0:
            self._own[chunk.slot] = lane_cache(self._config)
            if chunk.slot in self._rows:
                self._drop([chunk.slot])
        cache = self._own.get(chunk.slot)
        if cache is None or cache.get_seq_length() != chunk.start:
            raise RuntimeError(f"slot {chunk.slot} has no cache at position {chunk.start}")
        end = chunk.start + len(chunk.tokens)
        ids = torch.tensor([list(chunk.tokens)], dtype=torch.long, device=self.device)
        positions = torch.arange(chunk.start, end, dtype=torch.long, device=self.device)
        stages = [chunk.stage] if chunk.last else []
        pending = self.masks.start(stages) if self.masks is not None else None
        try:
            out = self._model(
                input_ids=ids,
                attention_mask=torch.ones((1, end), dtype=torch.long, device=self.device),
                position_ids=positions.unsqueeze(0),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        except Exception:
            self._own.pop(chunk.slot, None)
            raise
        finally:
            masks = pending.wait() if pending is not None else None
        if not chunk.last:
            return None
        logits = out.logits[:, -1, :].to(torch.float32)
        allowed = None if masks is None else allowed_rows(masks, logits.shape[-1])
        tokens, logprobs = sample_with_stages(
            logits, [chunk.params], [chunk.draw], [chunk.stage], allowed
        )
        token, logprob = tokens[0], (logprobs[0] if logprobs else None)
        self._join(chunk.slot, self._own.pop(chunk.slot))
        return token, logprob

    def _join(self, slot: int, own: Any) -> None:
        """Merge a lane's cache into the batch cache (left padding to a common length)."""
        if self._cache is None or not self._rows:
            self._cache, self._rows, self._pad = own, [slot], [0]
            return
        n = own.get_seq_length()
        length = self._cache.get_seq_length()
        new_length = max(n, length)
        rows = len(self._rows)
        for mine, theirs in zip(self._cache.layers, own.layers, strict=True):
            for attr in ("keys", "values"):
                old: torch.Tensor = getattr(mine, attr)
                add: torch.Tensor = getattr(theirs, attr)
                merged = old.new_zeros((rows + 1, old.shape[1], new_length, old.shape[3]))
                merged[:rows, :, new_length - length :, :] = old
                merged[rows, :, new_length - n :, :] = add[0]
                setattr(mine, attr, merged)
        self._pad = [p + new_length - length for p in self._pad] + [new_length - n]
        self._rows.append(slot)

    def _drop(self, slots: Sequence[int]) -> None:
        """Remove rows from the batch cache and trim the padding every remaining row shares."""
        if not slots:
            return
        keep = [i for i, slot in enumerate(self._rows) if slot not in set(slots)]
        if not keep:
            self._cache, self._rows, self._pad = None, [], []
            return
        trim = min(self._pad[i] for i in keep)
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, trim:, :]
            layer.values = layer.values.index_select(0, index)[:, :, trim:, :]
        self._rows = [self._rows[i] for i in keep]
        self._pad = [self._pad[i] - trim for i in keep]

    def _decode_step(self, plan: StepPlan) -> torch.Tensor:
        """One forward over the batch cache's rows; logits ``[rows, vocab]`` in row order."""
        by_slot = {row.slot: row for row in plan.decode}
        rows = [by_slot[slot] for slot in self._rows]
        device = self.device
        ids = torch.tensor([[row.token] for row in rows], dtype=torch.long, device=device)
        positions = torch.tensor([[row.position] for row in rows], dtype=torch.long, device=device)
        pad = torch.tensor(self._pad, dtype=torch.long, device=device)
        length = self._cache.get_seq_length() + 1
        columns = torch.arange(length, device=device).unsqueeze(0)
        try:
            out = self._model(
                input_ids=ids,
                attention_mask=(columns >= pad.unsqueeze(1)).to(torch.long),
                position_ids=positions,
                cache=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        except Exception:
            # The batch cache may be half written: every row goes (the step's lanes fail).
            self._cache, self._rows, self._pad = None, [], []
            raise
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    # -- pipeline stages --------------------------------------------------------------------------

    def stage(
        self, tokens: Sequence[int], start: int, end: int, hidden_in: torch.Tensor | None
    ) -> StageResult:
        """Layers ``[start, end)`` of a Llama-family model through its own modules."""
        model = self._model
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or not hasattr(inner, "rotary_emb"):
            raise StageForwardError("stage forward needs a Llama-family model")
        n_layers = len(layers)
        if not 0 <= start <= end <= n_layers:
            raise StageForwardError(f"bad layer bounds [{start}, {end}) for {n_layers} layers")
        from transformers.masking_utils import create_causal_mask

        dtype = next(model.parameters()).dtype
        with torch.inference_mode():
            if hidden_in is None:
                if start != 0 or not tokens:
                    raise StageForwardError("a first stage needs tokens and start_layer 0")
                ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
                if int(ids.min()) < 0 or int(ids.max()) >= int(self._config.vocab_size):
                    raise StageForwardError("a token id is outside the vocabulary")
                hidden = inner.embed_tokens(ids)
            else:
                hidden = hidden_in.to(device=self.device, dtype=dtype).unsqueeze(0)
            n = hidden.shape[1]
            positions = torch.arange(n, dtype=torch.long, device=self.device).unsqueeze(0)
            mask = create_causal_mask(
                config=self._config,
                inputs_embeds=hidden,
                attention_mask=None,
                cache=None,
                position_ids=positions,
            )
            rotary = inner.rotary_emb(hidden, position_ids=positions)
            for layer in layers[start:end]:
                hidden = layer(
                    hidden,
                    attention_mask=mask,
                    position_embeddings=rotary,
                    position_ids=positions,
                    cache=None,
                    use_cache=False,
                )
            if end < n_layers:
                return StageResult(hidden=encode_hidden(hidden[0]))
            last = inner.norm(hidden[:, -1:, :])
            logits = model.lm_head(last)[0, -1, :].to(torch.float32)
            return StageResult(token=int(torch.argmax(logits).item()))
