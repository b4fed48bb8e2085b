"""The start-up check of exactness (docs/engine.md section 4), cut into pieces that steps may
run between.

A prompt computed in one chunk and the same prompt whose last tokens are fed as decode rows must
leave the same keys and values and give the same logits, here, with these kernels.  The check
runs on a runner of its own (:class:`~sfnode.engines.runners.decoder.DecoderRunner` over the
same weights and kernels, one slot of a few dozen positions), so the lanes' slots are never
touched and a node serves while it runs: the engine's worker runs one piece at a time, and a
step sent meanwhile runs between two pieces (docs/engine.md section 4.1).

The check also names what it computed (:attr:`ExactnessCheck.digest`: the whole prompt's keys,
values and next-token logits); the engine keeps that name beside the packed weights at the first
start and compares it at the next ones, so packed weights that changed on disk, or an engine
that computes otherwise, fail the check instead of serving.

This module must never touch the lanes' KV slots, nor run anything but on the thread that runs
the runner's steps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from sfnode.engines.runners.kv import SlotKV
from sfnode.engines.scheduling.plan import ChunkRow, DecodeRow, StepOutput, StepPlan
from sfnode.linkf.wire import GenParams

__all__ = ["ExactnessCheck"]


class Checked(Protocol):
    """What the check needs of a runner (:class:`~sfnode.engines.runners.decoder.DecoderRunner`):
    its window, its weights, a runner of one slot of its own over them, and steps."""

    window: int
    weights: Any
    kv: SlotKV

    def check_runner(self, positions: int) -> Checked: ...

    def run(self, plan: StepPlan) -> StepOutput: ...


class ExactnessCheck:
    """One start-up check over ``runner``'s weights: :attr:`pieces` run in order (each one a
    job of the worker thread), then :meth:`verdict`."""

    def __init__(self, runner: Checked, length: int = 80, decoded: int = 10) -> None:
        length = min(length, runner.window - 1)
        self.decoded = min(decoded, length - 1)
        vocab = runner.weights.vocab_size
        self.prompt = tuple(3 + (i * 7919) % max(1, vocab - 3) for i in range(length))
        self._params = GenParams(logprobs=20)
        # The same weights, kernels and step as the lanes', over a slot of its own.
        self._runner = runner.check_runner(length + 1)
        self._whole = StepOutput()
        self._kept: list[torch.Tensor] = []
        self._fed = StepOutput()
        self.digest = ""
        """The whole prompt's keys, values and logits, hashed (set by the first piece)."""

    @property
    def pieces(self) -> tuple[Callable[[], None], ...]:
        return (self._compute_whole, self._compute_split, self._feed)

    def run_all(self) -> str | None:
        """Every piece, then the verdict (tests and benchmarks: on the calling thread)."""
        for piece in self.pieces:
            piece()
        return self.verdict()

    def _compute_whole(self) -> None:
        run = self._runner
        length = len(self.prompt)
        whole = ChunkRow(0, 0, self.prompt, True, self._params, 0)
        self._whole = run.run(StepPlan(chunks=(whole,)))
        self._kept = [t[0, :, :length].clone() for t in run.kv.keys + run.kv.values]
        digest = hashlib.sha256(repr(self._whole.chunk_logprobs).encode())
        for tensor in self._kept:
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        self.digest = digest.hexdigest()

    def _compute_split(self) -> None:
        split = len(self.prompt) - self.decoded
        chunk = ChunkRow(0, 0, self.prompt[:split], False, self._params, 0)
        self._runner.run(StepPlan(chunks=(chunk,)))

    def _feed(self) -> None:
        for position in range(len(self.prompt) - self.decoded, len(self.prompt)):
            row = DecodeRow(0, self.prompt[position], position, self._params, 0)
            self._fed = self._runner.run(StepPlan(decode=(row,)))

    def verdict(self) -> str | None:
        """None when the split computation left the whole one's keys and values and gave its
        logits; else what differed."""
        kv = self._runner.kv
        layers = len(kv.keys)
        length = len(self.prompt)
        for index, tensor in enumerate(kv.keys + kv.values):
            if not torch.equal(tensor[0, :, :length], self._kept[index]):
                name = "keys" if index < layers else "values"
                return f"the {name} of layer {index % layers} differ"
        if self._whole.chunk_logprobs != self._fed.decode_logprobs:
            return "the logits of the next token differ"
        return None
