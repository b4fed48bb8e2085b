"""Pipeline stages that keep their KV (docs/protocol.md section 12.8) for the decoder runner.

A :class:`DecoderStages` holds KV slots of its own, apart from the lanes' (a stage node may
serve generations too), and computes a stage session's rows exactly as the runner computes a
prompt chunk of a lane: the same layer code, the same attention over a slot, the same native
step where the runner has one.  So a row's keys, values and hidden state are those a full node
computes at that position, bit for bit, however the context is cut into requests
(docs/engine.md section 4), and a split pipeline gives one node's tokens.

This module must never be called from two threads at once (it runs on the engine's worker
thread, between steps), never decide which slot a session has (the loop's
:class:`~sfnode.engines.scheduling.stages.StageSessions` does), and never touch the lanes' KV.
"""

from __future__ import annotations

import copy

import torch

from sfnode.engines.runners.attention import Attender, StepAttention
from sfnode.engines.runners.decoder import DecoderRunner
from sfnode.engines.runners.hidden import decode_hidden, encode_hidden
from sfnode.engines.runners.kv import SlotKV
from sfnode.engines.scheduling.plan import ChunkRow, StepPlan
from sfnode.engines.scheduling.stages import KeptRows
from sfnode.generation import StageForwardError, StageResult
from sfnode.linkf.wire import GenParams

_NO_PARAMS = GenParams()


class DecoderStages:
    """Kept stage sessions of one :class:`DecoderRunner` over ``slots`` slots of its window."""

    def __init__(self, runner: DecoderRunner, slots: int) -> None:
        self.slots = slots
        self._runner = runner
        spec = runner.spec
        self.kv = SlotKV(
            layers=spec.layers,
            slots=slots,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            window=runner.window,
            dtype=runner.kv.dtype,
            device=runner.device,
        )
        # The runner's layers, attending over these slots instead of the lanes'.
        self._view = copy.copy(runner)
        self._view.kv = self.kv
        self._view.attender = Attender(
            self.kv,
            heads=spec.heads,
            scale=spec.attention_scale,
            softcap=spec.attn_softcap,
            cast=runner.attender.cast,
        )

    def read_rows(self, blob: bytes) -> torch.Tensor:
        """A D5 blob of rows (docs/protocol.md section 7.6) as a tensor."""
        return decode_hidden(blob, self._runner.weights.hidden)

    def forward(self, rows: KeptRows) -> StageResult:
        """Layers ``[start, end)`` over the rows, keeping their keys and values in the slot;
        the stage that ends at the last layer answers the greedy token after the last row."""
        runner = self._runner
        w = runner.weights
        layers = len(w.layers)
        with torch.inference_mode():
            if rows.hidden is None:
                tokens = list(rows.tokens)
                if rows.start != 0 or not tokens:
                    raise StageForwardError("a first stage needs tokens and start_layer 0")
                if min(tokens) < 0 or max(tokens) >= w.vocab_size:
                    raise StageForwardError("a token id is outside the vocabulary")
                n = len(tokens)
            else:
                n = int(rows.hidden.shape[0])
            self.kv.ensure(rows.position + n)
            if runner.fused is not None:
                hidden = self._fused(rows, n)
            else:
                hidden = self._layers(rows, n)
            if rows.end < layers:
                return StageResult(hidden=encode_hidden(hidden))
            logits = runner._logits(hidden, [n - 1])[0]
            return StageResult(token=int(torch.argmax(logits).item()))

    def _fused(self, rows: KeptRows, n: int) -> torch.Tensor:
        fused = self._runner.fused
        assert fused is not None
        positions = range(rows.position, rows.position + n)
        slots = [rows.slot] * n
        if rows.hidden is None:
            return fused.forward(
                self.kv, positions, slots, tokens=list(rows.tokens), first=0, end=rows.end
            )
        # A copy in float32: the fused layers write into the hidden states in place.
        hidden = rows.hidden.to(dtype=torch.float32, copy=True)
        return fused.forward(
            self.kv, positions, slots, hidden=hidden, first=rows.start, end=rows.end
        )

    def _layers(self, rows: KeptRows, n: int) -> torch.Tensor:
        """The runner's torch layers over the rows, as one prompt chunk of the slot."""
        view = self._view
        chunk = ChunkRow(rows.slot, rows.position, (0,) * n, False, _NO_PARAMS, 0)
        spec = view.spec
        attention = StepAttention(
            StepPlan(chunks=(chunk,)),
            groups=spec.heads // spec.kv_heads,
            window=view.window,
            sliding=spec.sliding_window,
            device=view.device,
        )
        if rows.hidden is None:
            hidden = view._embed(list(rows.tokens))
        else:
            hidden = rows.hidden.to(device=view.device, dtype=view.weights.activations, copy=True)
        index = torch.arange(rows.position, rows.position + n, device=view.device)
        turns = view._turns(index)
        groups = view._row_groups(attention)
        for layer in range(rows.start, rows.end):
            hidden = view._layer(layer, hidden, turns[layer], attention, groups)
        return hidden
