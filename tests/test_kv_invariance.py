"""A position's KV and logits do not depend on how its prompt was computed (docs/engine.md
section 4), in every weights mode of the Llama runner, with each kernel family (torch's, and
sfnode's native kernels with and without the fused step where this CPU can build them;
docs/engine.md sections 5.1 and 5.2).

- The runner alone, on a tiny random Llama: a prompt computed in one chunk, in chunks of other
  sizes beside other lanes' rows, a row at a time as decode rows (as a failover's new node
  recomputes tokens the first node decoded), and after a prefix copied from the block pool
  (whole blocks, and positions inside a block) leaves bit-identical keys and values in its slot
  and gives bit-identical logits for its next token.
- The engine: a seeded request (temperature 0.8) repeated with the prefix cache on (a cache
  hit), the same request on an engine without the cache and with another chunk size, a prompt
  that shares part of a block with an earlier one, and the request continued from the middle of
  its answer (a failover) give the same tokens.

Nothing here sleeps or downloads; the models are built from a config.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from twisted.internet import reactor
from twisted.trial import unittest

from sfnode.engines.config import EngineConfig
from sfnode.engines.kernels import native
from sfnode.engines.runners.attention import (
    CALL_ROWS,
    MIN_BLOCK_ROWS,
    QUERY_BLOCK,
    key_length,
    padded_rows,
    positions_per_call,
)
from sfnode.engines.runners.decoder import DecoderRunner
from sfnode.engines.scheduling.plan import BlockCopy, ChunkRow, DecodeRow, StepOutput, StepPlan
from sfnode.engines.transformers_engine import TransformersEngine
from sfnode.engines.weights.gather import gather_weights
from sfnode.generation import GenerationRequest, TokenLogprob
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS
from sfnode.linkf.wire import GenParams
from tests.test_engine import native_library_dir
from tests.tinymodel import TINY_VOCAB, tiny_llama

torch.set_num_threads(1)

MODES = ("float32", "bfloat16", "int8", "int4")
WINDOW = 1024
LOGITS = GenParams(logprobs=20)
"""Greedy with the 20 best logprobs: the softmax of the raw logits, compared float for float."""
SEEDED = GenParams(temperature=0.8, seed=1234)

_MODELS: dict[str, Any] = {}


def cases() -> list[tuple[str, str, bool]]:
    """(weights mode, kernel family, fused step) of every way the runner can compute: each mode
    with torch's kernels, and the modes sfnode's kernels serve, fused and not, when they build
    on this CPU."""
    found: list[tuple[str, str, bool]] = [(mode, "torch", False) for mode in MODES]
    if not isinstance(native.load(native_library_dir()), str):
        for mode in ("float32", "int8", "int4"):
            found += [(mode, "native", True), (mode, "native", False)]
    return found


def name(case: tuple[str, str, bool]) -> str:
    mode, kernels, fused = case
    return f"{mode} {kernels}{' fused' if fused else ''}"


def model() -> Any:
    """The tiny Llama with a window long enough to cross the kernel's 512-key blocks."""
    if "model" not in _MODELS:
        _MODELS["model"] = tiny_llama(window=WINDOW)
    return _MODELS["model"]


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


class LayoutTests(unittest.SynchronousTestCase):
    """The sizes of attention calls (docs/engine.md section 4)."""

    def test_key_length_is_the_position_rounded_up_within_the_window(self) -> None:
        """A query reads keys up to its position + 1 rounded up to 64, never past the window."""
        lengths = [key_length(p, 1000) for p in (0, 63, 64, 127, 960, 999)]
        self.assertEqual(lengths, [64, 64, 128, 128, 1000, 1000])

    def test_padded_rows_leave_no_short_block(self) -> None:
        """Padding leaves every 32-row block of a call with at least 4 rows."""
        for rows in range(1, CALL_ROWS - MIN_BLOCK_ROWS):
            padded = padded_rows(rows)
            self.assertGreaterEqual(padded, rows)
            self.assertLess(padded - rows, MIN_BLOCK_ROWS)
            tail = padded % QUERY_BLOCK
            self.assertTrue(tail == 0 or tail >= MIN_BLOCK_ROWS, rows)
            self.assertGreaterEqual(padded, MIN_BLOCK_ROWS)

    def test_positions_per_call_fit_one_call(self) -> None:
        """A call's positions share one key length and stay under CALL_ROWS rows, padded."""
        for groups in (1, 2, 3, 4, 7, 8, 16, 32):
            size = positions_per_call(groups)
            self.assertEqual(64 % size, 0)
            self.assertLess(padded_rows(size * groups), CALL_ROWS + 1)


class RunnerInvarianceTests(unittest.SynchronousTestCase):
    """The runner alone: keys, values and logits of a prompt however it is computed."""

    def runner(
        self, mode: str, slots: int = 4, kernels: str = "torch", fused: bool = False
    ) -> DecoderRunner:
        weights = gather_weights(
            model(),
            mode,
            dense_copies=False,
            kernels=kernels,
            library_dir=native_library_dir(),
            fused_step=fused,
        )
        self.assertEqual(weights.mode, mode)
        runner = DecoderRunner(weights, slots=slots, window=WINDOW, pool_blocks=64, fused=fused)
        self.assertEqual(runner.fused is not None, fused, runner.fused_reason)
        return runner

    def kv(self, runner: DecoderRunner, slot: int, n: int) -> list[torch.Tensor]:
        """Copies of the slot's keys and values of positions 0 .. n-1, every layer."""
        kv = runner.kv
        return [t[slot, :, :n].clone() for t in kv.keys] + [
            t[slot, :, :n].clone() for t in kv.values
        ]

    def assert_same(
        self,
        got: tuple[list[torch.Tensor], TokenLogprob | None],
        want: tuple[list[torch.Tensor], TokenLogprob | None],
        how: str,
    ) -> None:
        for index, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
            if not torch.equal(a, b):
                differ = int((a != b).any(dim=-1).any(dim=0).nonzero()[0])
                self.fail(f"{how}: tensor {index} differs first at position {differ}")
        self.assertIsNotNone(want[1])
        self.assertEqual(got[1], want[1], how)

    def one_chunk(self, runner: DecoderRunner, slot: int, prompt: Sequence[int]) -> Any:
        out = runner.run(StepPlan(chunks=(ChunkRow(slot, 0, tuple(prompt), True, LOGITS, 0),)))
        return self.kv(runner, slot, len(prompt)), out.chunk_logprobs[0]

    def chunked(
        self, runner: DecoderRunner, slot: int, prompt: Sequence[int], size: int, other: int
    ) -> Any:
        """``prompt`` in chunks of ``size`` (block multiples), each step also carrying a decode
        row and a prompt chunk of another lane in slot ``other``."""
        neighbour = ids(300, seed=size)
        runner.run(StepPlan(chunks=(ChunkRow(other, 0, tuple(neighbour[:40]), True, LOGITS, 0),)))
        position = 40
        start = 0
        out = StepOutput()
        while start < len(prompt):
            end = min(len(prompt), start + size)
            plan = StepPlan(
                decode=(DecodeRow(other, neighbour[position], position, LOGITS, 0),),
                chunks=(
                    ChunkRow(slot, start, tuple(prompt[start:end]), end == len(prompt), LOGITS, 0),
                ),
            )
            out = runner.run(plan)
            position += 1
            start = end
        return self.kv(runner, slot, len(prompt)), out.chunk_logprobs[0]

    def decoded(self, runner: DecoderRunner, slot: int, prompt: Sequence[int], split: int) -> Any:
        """The first ``split`` tokens as one chunk, then the rest a row at a time as decode rows,
        beside another lane's decode row: what a failover's first node computed."""
        runner.run(StepPlan(chunks=(ChunkRow(slot, 0, tuple(prompt[:split]), False, LOGITS, 0),)))
        runner.run(StepPlan(chunks=(ChunkRow(3, 0, tuple(ids(70, seed=3)), True, LOGITS, 0),)))
        out = StepOutput()
        for position in range(split, len(prompt)):
            plan = StepPlan(
                decode=(
                    DecodeRow(slot, prompt[position], position, LOGITS, 0),
                    DecodeRow(3, 5, 70 + position - split, LOGITS, 0),
                )
            )
            out = runner.run(plan)
        return self.kv(runner, slot, len(prompt)), out.decode_logprobs[0]

    def reused(
        self, runner: DecoderRunner, slot: int, prompt: Sequence[int], blocks: int, tail: int
    ) -> Any:
        """``prompt`` computed in slot 0, its first ``blocks`` blocks (the last only ``tail``
        positions) copied through the pool into ``slot``, the rest computed there."""
        self.one_chunk(runner, 0, prompt)
        pool = tuple(range(10, 10 + blocks))
        runner.run(StepPlan(saves=(BlockCopy(0, 0, pool),)))
        reused = (blocks - 1) * KV_BLOCK_TOKENS + tail
        plan = StepPlan(
            loads=(BlockCopy(slot, 0, pool, tail),),
            chunks=(ChunkRow(slot, reused, tuple(prompt[reused:]), True, LOGITS, 0),),
        )
        out = runner.run(plan)
        return self.kv(runner, slot, len(prompt)), out.chunk_logprobs[0]

    def test_the_start_up_check_passes_in_every_mode(self) -> None:
        """The check the engine runs at start finds nothing that differs, in every mode, with
        each kernel family."""
        for case in cases():
            mode, kernels, fused = case
            runner = self.runner(mode, kernels=kernels, fused=fused)
            self.assertIsNone(runner.check_exactness(), name(case))

    def test_the_start_up_check_finds_a_kernel_that_depends_on_the_chunk(self) -> None:
        """With dense copies for chunks of two rows or more (so a prompt's rows and decode rows
        multiply by different kernels), the start-up check says what differs, on a runner of
        one slot too."""
        runner = self.runner("int4", slots=1, kernels="torch")
        weights = runner.weights
        for layer in weights.layers:
            layer.qkv, layer.o = layer.qkv.with_dense(), layer.o.with_dense()
            layer.gate_up, layer.down = layer.gate_up.with_dense(), layer.down.with_dense()
        weights.dense_rows = 2
        problem = runner.check_exactness()
        assert problem is not None
        self.assertIn("differ", problem)

    def test_every_way_of_computing_a_prompt_gives_the_same_kv_and_logits(self) -> None:
        """In every weights mode, with each kernel family, a 700-token prompt leaves the same
        keys and values (every layer, every position) and the same next-token logits computed in
        one chunk, in chunks of 16, 48, 256 and 512 beside another lane, with its last 90 tokens
        fed as decode rows, and after 40 whole blocks or 43 blocks and 5 positions reused from
        the pool."""
        prompt = ids(700, seed=7)
        for case in cases():
            mode, kernels, fused = case
            runner = self.runner(mode, kernels=kernels, fused=fused)
            how = name(case)
            want = self.one_chunk(runner, 1, prompt)
            for size in (16, 48, 256, 512):
                self.assert_same(self.chunked(runner, 1, prompt, size, 2), want, f"{how} {size}")
            self.assert_same(self.decoded(runner, 2, prompt, 610), want, f"{how} decoded")
            self.assert_same(self.reused(runner, 1, prompt, 40, 16), want, f"{how} blocks")
            self.assert_same(self.reused(runner, 2, prompt, 44, 5), want, f"{how} inside")


class EngineInvarianceTests(unittest.TestCase):
    """The engine: seeded streams with the prefix cache on (docs/engine.md section 4)."""

    def engine(self, **kwargs: Any) -> TransformersEngine:
        kwargs.setdefault("interactive_lanes", 0)
        engine = TransformersEngine(model(), reactor, EngineConfig(max_lanes=3, **kwargs))
        engine.start()
        self.addCleanup(engine.stop)
        return engine

    async def run_one(
        self, engine: TransformersEngine, context: Sequence[int], max_new: int
    ) -> list[int]:
        request = GenerationRequest(list(context), SEEDED, max_new, 0)
        result = await engine.submit(request, lambda tokens, *_: None).result
        return list(result.tokens)

    async def test_seeded_streams_are_the_same_cold_reused_rechunked_and_continued(self) -> None:
        """In every weights mode, with each kernel family, a seeded request (temperature 0.8)
        with a 200-token prompt gives the same 48 tokens: on an engine without the prefix cache
        (chunks of 256); twice on one with it (chunks of 32; the repeat reuses its blocks); for
        a prompt sharing 181 tokens with it (11 blocks and part of the next) on the cached
        engine and on the cold one; and continued from its 20th token with those tokens in the
        context, on both."""
        prompt = ids(200, seed=11)
        other = prompt[:181] + ids(30, seed=12)
        for case in cases():
            mode, kernels, fused = case
            family = {"weights": mode, "kernels": kernels, "fused_step": fused}
            cold = self.engine(prefix_cache=False, prefill_chunk=256, **family)
            warm = self.engine(prefill_chunk=32, **family)
            how = name(case)
            self.assertEqual(warm.fused_step, fused, how)
            want = await self.run_one(cold, prompt, 48)
            self.assertEqual(await self.run_one(warm, prompt, 48), want, how)
            # The start-up check runs after an engine's first step (docs/engine.md 4.1).
            self.assertIsNone(await warm.exactness, how)
            self.assertEqual(await self.run_one(warm, prompt, 48), want, how)
            stats = warm.statistics().prefix
            assert stats is not None
            self.assertGreaterEqual(stats.reused_tokens, 192, how)
            self.assertEqual(
                await self.run_one(warm, other, 32), await self.run_one(cold, other, 32), how
            )
            continued = prompt + want[:20]
            self.assertEqual(await self.run_one(cold, continued, 28), want[20:], how)
            self.assertEqual(await self.run_one(warm, continued, 28), want[20:], how)
