"""Pipeline stages that keep their KV (docs/protocol.md section 12.8) for the decoder runner.

A :class:`DecoderStages` holds KV slots of its own, apart from the lanes' (a stage node may
serve generations too), and computes a stage session's rows exactly as the runner computes a
prompt chunk of a lane: the same layer code, the same attention over a slot, the same native
step where the runner has one.  So a row's keys, values and hidden state are those a full node
computes at that position, bit for bit, however the context is cut into requests
(docs/engine.md section 4), and a split pipeline gives one node's tokens.  Blocks of earlier
sessions' rows are reused as a full node's prefix cache reuses its blocks
(:mod:`sfnode.engines.runners.stage_prefixes`).

This module must never be called from two threads at once (it runs on the engine's worker
thread, between steps), never decide which slot a session has (the loop's
:class:`~sfnode.engines.scheduling.stages.StageSessions` does), and never touch the lanes' KV.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import torch

from sfnode.engines.runners.attention import Attender, StepAttention
from sfnode.engines.runners.decoder import DecoderRunner
from sfnode.engines.runners.hidden import decode_hidden, encode_hidden
from sfnode.engines.runners.kv import SlotKV
from sfnode.engines.runners.stage_prefixes import StagePrefixes, row_inputs
from sfnode.engines.scheduling.plan import ChunkRow, StepPlan
from sfnode.engines.scheduling.stages import KeptRows
from sfnode.generation import PrefixFigures, StageForwardError, StageResult
from sfnode.linkf.wire import GenParams

_NO_PARAMS = GenParams()
PREFIX_RANGES = 2
"""Layer ranges whose prefix pools a stage keeps, the most recently run."""


class DecoderStages:
    """Kept stage sessions of one :class:`DecoderRunner` over ``slots`` slots of its window,
    reusing up to ``prefix_blocks`` blocks of earlier sessions' rows (0: none) named with
    ``salt`` (the model and its weights mode)."""

    def __init__(
        self, runner: DecoderRunner, slots: int, prefix_blocks: int = 0, salt: bytes = b""
    ) -> None:
        self.slots = slots
        self._runner = runner
        self._prefix_blocks = prefix_blocks
        self._salt = salt
        self.prefixes: OrderedDict[tuple[int, int], StagePrefixes] = OrderedDict()
        """A prefix pool per layer range run, the :data:`PREFIX_RANGES` run last (a pipeline
        gives a node one range; a head that splits the layers again, another)."""
        self.prefix_figures = PrefixFigures() if prefix_blocks else None
        """The pools' figures summed, those of pools dropped since included (their blocks
        not): replaced after each forward, for the node's ``/metrics``."""
        self._dropped = PrefixFigures()
        """The cumulative figures of the pools dropped so far."""
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

    def forward(self, batch: Sequence[KeptRows]) -> list[StageResult | StageForwardError]:
        """Each request's rows through its layers, keeping their keys and values in its slot;
        a stage that ends at the last layer answers the greedy token after a request's last
        row.  Requests of one layer range and one kind (tokens or hidden states) share one
        pass over the weights; a request that cannot run gets its error, the others run."""
        answers: list[StageResult | StageForwardError] = []
        groups: dict[tuple[int, int, bool], list[int]] = {}
        for index, rows in enumerate(batch):
            try:
                self._check(rows)
            except StageForwardError as e:
                answers.append(e)
                continue
            answers.append(StageResult())
            groups.setdefault((rows.start, rows.end, rows.hidden is None), []).append(index)
        with torch.inference_mode():
            for members in groups.values():
                group = [batch[i] for i in members]
                for i, answer in zip(members, self._group(group), strict=True):
                    answers[i] = answer
        if self.prefix_figures is not None:
            total = self._dropped
            for prefixes in self.prefixes.values():
                total += prefixes.index.stats
            self.prefix_figures = total
        return answers

    def _check(self, rows: KeptRows) -> None:
        w = self._runner.weights
        if rows.hidden is None:
            tokens = list(rows.tokens)
            if rows.start != 0 or not tokens:
                raise StageForwardError("a first stage needs tokens and start_layer 0")
            if min(tokens) < 0 or max(tokens) >= w.vocab_size:
                raise StageForwardError("a token id is outside the vocabulary")

    def _group(self, group: Sequence[KeptRows]) -> list[StageResult]:
        """One pass for requests of one layer range and kind: each request's cached blocks
        taken from the prefix pool, the rest computed (and its full blocks kept)."""
        runner = self._runner
        first = group[0]
        last = first.end == len(runner.weights.layers)
        self.kv.ensure(max(rows.position + _rows(rows) for rows in group))
        prefixes = self._prefixes_of(first.start, first.end, last)
        tokens = first.hidden is None
        taken: list[tuple[int, torch.Tensor | None]] = [(0, None)] * len(group)
        inputs: list[list[bytes]] = []
        if prefixes is not None:
            inputs = [row_inputs(rows.tokens, rows.hidden) for rows in group]
            taken = [
                prefixes.take(rows.slot, rows.position, rows_in, tokens)
                for rows, rows_in in zip(group, inputs, strict=True)
            ]
        left = [_after(rows, n) for rows, (n, _) in zip(group, taken, strict=True)]
        counts = [_rows(rows) for rows in left]
        if runner.fused is not None:
            hidden = self._fused(left, counts)
        else:
            hidden = self._layers(left, counts)
        ends = list(itertools.accumulate(counts))
        starts = [0, *ends[:-1]]
        if prefixes is not None:
            for rows, rows_in, (n, _), a, b in zip(left, inputs, taken, starts, ends, strict=True):
                outputs = None if last else hidden[a:b]
                prefixes.keep(rows.slot, rows.position, rows_in[n:], outputs, tokens)
        if not last:
            return [
                StageResult(hidden=encode_hidden(_joined(reused, hidden[a:b])))
                for (_, reused), a, b in zip(taken, starts, ends, strict=True)
            ]
        logits = runner._logits(hidden, [end - 1 for end in ends])
        return [StageResult(token=int(t)) for t in torch.argmax(logits, dim=1).tolist()]

    def _prefixes_of(self, start: int, end: int, last: bool) -> StagePrefixes | None:
        """The prefix pool of layers ``[start, end)``; None when the stage reuses nothing."""
        if not self._prefix_blocks:
            return None
        pools = self.prefixes
        prefixes = pools.get((start, end))
        if prefixes is None:
            prefixes = StagePrefixes(self.kv, self._prefix_blocks, start, end, last, self._salt)
            pools[start, end] = prefixes
            while len(pools) > PREFIX_RANGES:
                _, dropped = pools.popitem(last=False)
                stats = dropped.index.stats
                self._dropped += replace(stats, cached_blocks=0)
        pools.move_to_end((start, end))
        return prefixes

    def _fused(self, group: Sequence[KeptRows], counts: Sequence[int]) -> torch.Tensor:
        fused = self._runner.fused
        assert fused is not None
        positions = [p for rows, n in zip(group, counts, strict=True) for p in _span(rows, n)]
        slots = [rows.slot for rows, n in zip(group, counts, strict=True) for _ in range(n)]
        first = group[0]
        if first.hidden is None:
            tokens = [int(t) for rows in group for t in rows.tokens]
            return fused.forward(self.kv, positions, slots, tokens=tokens, first=0, end=first.end)
        # A copy in float32: the fused layers write into the hidden states in place.
        hidden = torch.cat([rows.hidden for rows in group]).to(dtype=torch.float32, copy=True)
        return fused.forward(
            self.kv, positions, slots, hidden=hidden, first=first.start, end=first.end
        )

    def _layers(self, group: Sequence[KeptRows], counts: Sequence[int]) -> torch.Tensor:
        """The runner's torch layers over the rows, each request one prompt chunk of its
        slot."""
        view = self._view
        chunks = tuple(
            ChunkRow(rows.slot, rows.position, (0,) * n, False, _NO_PARAMS, 0)
            for rows, n in zip(group, counts, strict=True)
        )
        spec = view.spec
        attention = StepAttention(
            StepPlan(chunks=chunks),
            groups=spec.heads // spec.kv_heads,
            window=view.window,
            sliding=spec.sliding_window,
            device=view.device,
        )
        first = group[0]
        if first.hidden is None:
            hidden = view._embed([int(t) for rows in group for t in rows.tokens])
        else:
            hidden = torch.cat([rows.hidden for rows in group]).to(
                device=view.device, dtype=view.weights.activations, copy=True
            )
        positions = [p for rows, n in zip(group, counts, strict=True) for p in _span(rows, n)]
        turns = view._turns(torch.tensor(positions, dtype=torch.long, device=view.device))
        groups = view._row_groups(attention)
        for layer in range(first.start, first.end):
            hidden = view._layer(layer, hidden, turns[layer], attention, groups)
        return hidden


def _after(rows: KeptRows, reused: int) -> KeptRows:
    """``rows`` without its first ``reused`` rows (taken from the prefix pool)."""
    if not reused:
        return rows
    if rows.hidden is None:
        return replace(rows, position=rows.position + reused, tokens=rows.tokens[reused:])
    return replace(rows, position=rows.position + reused, hidden=rows.hidden[reused:])


def _joined(reused: torch.Tensor | None, computed: torch.Tensor) -> torch.Tensor:
    """A request's output rows: those taken from the pool, then those computed."""
    return computed if reused is None else torch.cat([reused.to(computed.dtype), computed])


def _rows(rows: KeptRows) -> int:
    return len(rows.tokens) if rows.hidden is None else int(rows.hidden.shape[0])


def _span(rows: KeptRows, n: int) -> range:
    return range(rows.position, rows.position + n)
