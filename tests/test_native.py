"""Tests of sfnode's native kernels, the per-CPU choice of kernel family and the fused layer step
(docs/engine.md sections 5.1 and 5.2).

The native library is really built with this machine's C compiler (into a temporary folder,
once per test class) and really run; a CPU of another kind is played by made-up flags and a
made-up timing function, since the choice is the same measurement on every CPU.  They must
never sleep and never assert a timing.
"""

from __future__ import annotations

import functools
import json
import random
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.trial import unittest

from sfnode.engines.kernels import native
from sfnode.engines.kernels.choice import Cpu, choose
from sfnode.engines.kernels.quant import (
    GROUP,
    GgufMatrix,
    Int8Linear,
    Linear,
    Precision,
    dequantize,
)
from sfnode.engines.runners.decoder import DecoderRunner
from sfnode.engines.scheduling.plan import ChunkRow, DecodeRow, StepPlan
from sfnode.engines.weights.gather import gather_weights
from sfnode.linkf.wire import GenParams
from tests.tinymodel import TINY_VOCAB, tiny_llama

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
"""An AMD EPYC of the kind this project is measured on: no AVX-512, no AVX512-BF16."""
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}
"""An Intel Xeon with AVX512-BF16 and AMX."""
NO_AVX2 = frozenset({"sse4_2", "avx"})

_library_dir = Path(tempfile.mkdtemp(prefix="sfnode-native-test-"))


def library() -> native.Library:
    """The native library, built once for these tests (the test fails if it cannot be)."""
    loaded = native.load(_library_dir)
    if isinstance(loaded, str):
        raise unittest.SkipTest(f"no native kernels on this machine: {loaded}")
    return loaded


def q4_1_rows(rows: int, cols: int, seed: int) -> GgufMatrix:
    """A Q4_1 matrix of random blocks, as a GGUF file would hold it."""
    rng = random.Random(seed)
    data = b""
    for _ in range(rows):
        for _ in range(cols // GROUP):
            q = [rng.randrange(16) for _ in range(GROUP)]
            d = rng.uniform(0.001, 0.05)
            data += struct.pack("<ee", d, -8 * d + rng.uniform(-0.01, 0.01))
            data += bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    array = np.frombuffer(data, dtype=np.uint8).reshape(rows, -1)
    return GgufMatrix("Q4_1", rows, cols, array)


class KernelTests(unittest.SynchronousTestCase):
    """The native products multiply by the weights they hold, one row independently of the
    others."""

    def setUp(self) -> None:
        self.library = library()
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(13, 96, generator=generator)

    def check(self, layer: Linear, weight: torch.Tensor) -> None:
        got = layer(self.x)
        want = self.x @ weight.t()
        # Activations are held in 16 bits per block of 32 inside the kernel.
        error = float((got - want).abs().max()) / float(want.abs().max())
        self.assertLess(error, 1e-3)
        for rows in (1, 3, 4, 5, 8):
            for start in range(0, 13 - rows + 1, 4):
                alone = layer(self.x[start : start + rows])
                self.assertTrue(torch.equal(alone, got[start : start + rows]), (rows, start))

    def test_q4_from_gguf_blocks(self) -> None:
        """A Q4_1 matrix served from its own bytes multiplies by the weights the file means,
        and a row's result is bit for bit the same alone or beside 1 to 12 others."""
        m = q4_1_rows(40, 96, seed=1)
        layer = native.Q4Linear(native.gguf_blocks([m]), 96, self.library)
        self.assertTrue(torch.equal(native.blocks_weight(layer.blocks, 96), dequantize(m)))
        self.check(layer, dequantize(m))

    def test_blocks_as_stored(self) -> None:
        """Q8_0, Q5_0 and Q5_1 rows (what llama-quantize writes for a K-quant mix's matrices
        whose rows are not whole super-blocks) multiply, in their blocks (Q5_0 and Q8_0 laid
        out in tiles), by the weights the file means, a row's result the same alone or beside
        others, and each weight row's the same alone or beside the others (alone: a tile of
        one row)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as reference_quantize

        floats = np.random.default_rng(5).standard_normal((40, 96)).astype(np.float32) * 0.1
        for kind in ("Q8_0", "Q5_0", "Q5_1"):
            with self.subTest(kind=kind):
                raw = reference_quantize(floats, GGMLQuantizationType[kind])
                data = np.ascontiguousarray(raw).view(np.uint8).reshape(40, -1)
                layer = native.BlockLinear(kind, data, 96, self.library)
                self.check(layer, layer.weight())
                # Weight rows multiplied two at a time give what each gives alone.
                got = layer(self.x)
                for n in range(40):
                    alone = native.BlockLinear(kind, data[n : n + 1], 96, self.library)
                    self.assertTrue(torch.equal(alone(self.x)[:, 0], got[:, n]), (kind, n))

    def test_tiles_hold_the_files_blocks(self) -> None:
        """Q5_0, Q8_0, Q4_K and Q6_K rows are laid out in tiles of 8 output rows at load: the
        tiles give back the file's blocks byte for byte (13 rows: a last tile of 5; random
        K-quant super-blocks, every bit of their scales used), rows past the matrix are never
        written out, and the tiles hold no more than the blocks and 7 rows."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as reference_quantize

        from tests import kquant

        rng = np.random.default_rng(7)
        floats = rng.standard_normal((13, 512)).astype(np.float32)
        tile_of_8 = {"Q5_0": 8 * 22, "Q8_0": 8 * 34, "Q4_K": 8 * 144, "Q6_K": 8 * 210}
        for kind, tile in tile_of_8.items():
            with self.subTest(kind=kind):
                if kind in ("Q4_K", "Q6_K"):
                    data = kquant.random_blocks(kind, 13 * 2, rng).reshape(13, -1)
                else:
                    raw = reference_quantize(floats, GGMLQuantizationType[kind])
                    data = np.ascontiguousarray(raw).view(np.uint8).reshape(13, -1)
                layer = native.BlockLinear(kind, data, 512, self.library)
                self.assertTrue(layer.tiled)
                self.assertEqual(layer.blocks().tobytes(), data.tobytes())
                blocks_a_row = 512 // (256 if kind in ("Q4_K", "Q6_K") else 32)
                self.assertEqual(layer.held.nbytes, 2 * blocks_a_row * tile)
                self.assertEqual(tuple(layer(torch.zeros(2, 512)).shape), (2, 13))

    def test_k_quant_blocks_as_stored(self) -> None:
        """Q4_K, Q5_K and Q6_K rows multiply (Q4_K and Q6_K laid out in tiles, Q5_K as stored)
        by the weights the file means (int16 activations), a row's result is bit for bit the
        same alone or in a pass of 8 rows or fewer beside others, and each weight row's the
        same alone (a tile of one row) or beside the others."""
        from tests import kquant

        generator = torch.Generator().manual_seed(4)
        x = torch.randn(13, 512, generator=generator)
        floats = np.random.default_rng(6).standard_normal((24, 512)).astype(np.float32) * 0.1
        for kind in ("Q4_K", "Q5_K", "Q6_K"):
            with self.subTest(kind=kind):
                layer = native.BlockLinear(kind, kquant.quantize(kind, floats), 512, self.library)
                got = layer(x)
                want = x @ layer.weight().t()
                error = float((got - want).abs().max()) / float(want.abs().max())
                self.assertLess(error, 1e-3)
                for rows in (1, 3, 4, 5, 8):
                    for start in range(0, 13 - rows + 1):
                        alone = layer(x[start : start + rows])
                        same = torch.equal(alone, got[start : start + rows])
                        self.assertTrue(same, (kind, rows, start))
                self.assertEqual(layer.tiled, kind != "Q5_K")
                for n in range(0, 24, 5):
                    row = kquant.quantize(kind, floats[n : n + 1])
                    alone_row = native.BlockLinear(kind, row, 512, self.library)(x)[:, 0]
                    self.assertTrue(torch.equal(alone_row, got[:, n]), (kind, n))

    def test_tile_loops_fused_form_equals_avx2_form(self) -> None:
        """Every tiled kind (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) gives bit for bit the same results in
        the tile loops' vpdpwssd form (where the CPU has AVX512-VNNI) as in their AVX2 form,
        for passes of 8 rows and of 1 to 7 (two int32 sums a row), over ragged last tiles, and
        as the float reference within the activations' rounding."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as reference_quantize

        from tests import kquant

        rng = np.random.default_rng(11)
        floats = rng.standard_normal((37, 512)).astype(np.float32) * 0.1
        q4_1 = native.gguf_blocks([q4_1_rows(37, 512, seed=2)])
        layers: dict[str, Any] = {"Q4_1": native.Q4Linear(q4_1, 512, self.library)}
        for kind in ("Q5_0", "Q8_0"):
            raw = reference_quantize(floats, GGMLQuantizationType[kind])
            data = np.ascontiguousarray(raw).view(np.uint8).reshape(37, -1)
            layers[kind] = native.BlockLinear(kind, data, 512, self.library)
        for kind in ("Q4_K", "Q6_K"):
            data = kquant.random_blocks(kind, 37 * 2, rng).reshape(37, -1)
            layers[kind] = native.BlockLinear(kind, data, 512, self.library)
        x = torch.randn(21, 512, generator=torch.Generator().manual_seed(12)) * 3
        for kind, layer in layers.items():
            with self.subTest(kind=kind):
                for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 21):
                    got = layer(x[:rows])
                    self.assertTrue(torch.equal(got, native.avx2_form(layer, x[:rows])), rows)
                    self.assertTrue(torch.equal(got, layer(x)[:rows]), rows)
                if kind in ("Q4_1", "Q5_0", "Q8_0"):
                    weight = native.blocks_weight(q4_1, 512) if kind == "Q4_1" else layer.weight()
                    want = x @ weight.t()
                    error = float((layer(x) - want).abs().max()) / float(want.abs().max())
                    self.assertLess(error, 1e-3)

    def test_q4_of_a_float_matrix_and_q8(self) -> None:
        """Float weights packed into Q4_1 blocks, and int8 rows with a scale each, multiply by
        the weights they hold (the kernel family's self-check uses the same)."""
        from sfnode.engines.kernels.choice import family_layer

        weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(4)) * 0.1
        for precision in (Precision.INT4, Precision.INT8):
            layer = family_layer("native", weight, precision, self.library)
            self.assertEqual(layer.activations, torch.float32)
            from sfnode.engines.kernels.quant import effective_weight

            held = effective_weight(layer)
            if precision is Precision.INT8:
                # The same int8 rows and scales as torch's int8 kernel would hold.
                self.assertTrue(torch.equal(held, effective_weight(Int8Linear.quantize(weight))))
            self.check(layer, held)

    def test_a_cpu_without_avx2_or_a_compiler_gets_no_library(self) -> None:
        """The library is refused, with the reason, on a CPU without AVX2 and where no C
        compiler is found."""
        reason = native.load(_library_dir, NO_AVX2)
        self.assertIsInstance(reason, str)
        self.assertIn("avx2", str(reason))
        self.patch(native, "compiler", lambda: None)
        self.patch(native, "shipped_library", lambda: None)
        native._loaded.clear()
        reason = native.load(Path(tempfile.mkdtemp(prefix="sfnode-native-none-")), AVX2_ONLY)
        self.assertIsInstance(reason, str)
        self.assertIn("no C compiler", str(reason))

    def test_without_a_compiler_the_shipped_build_is_loaded(self) -> None:
        """Where no C compiler is found, the build a wheel ships is loaded (nothing is
        compiled into the cache), marked as shipped, and its products are the compiled
        library's, bit for bit."""
        shipped = Path(tempfile.mkdtemp(prefix="sfnode-native-shipped-")) / "shipped.so"
        shipped.write_bytes(self.library.path.read_bytes())
        self.patch(native, "compiler", lambda: None)
        self.patch(native, "shipped_library", lambda: shipped)
        cache = Path(tempfile.mkdtemp(prefix="sfnode-native-none-"))
        loaded = native.load(cache, AVX2_ONLY)
        assert isinstance(loaded, native.Library), loaded
        self.assertEqual((loaded.path, loaded.shipped, loaded.built_seconds), (shipped, True, 0.0))
        self.assertEqual(list(cache.iterdir()), [])
        m = q4_1_rows(40, 96, seed=2)
        ours, theirs = (
            native.Q4Linear(native.gguf_blocks([m]), 96, lib) for lib in (loaded, self.library)
        )
        self.assertTrue(torch.equal(ours(self.x), theirs(self.x)))

    def test_neither_a_compiler_nor_a_shipped_build_warns_once(self) -> None:
        """With no C compiler and no shipped build on a CPU that could run the kernels, one
        WARNING names the cause and what the node does instead (torch's kernels); a second
        load does not repeat it, and a CPU without AVX2 is no cause for a warning."""
        self.patch(native, "compiler", lambda: None)
        self.patch(native, "shipped_library", lambda: None)
        self.patch(native, "_warned", set())
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        cache = Path(tempfile.mkdtemp(prefix="sfnode-native-none-"))
        for flags in (AVX2_ONLY, AVX2_ONLY, NO_AVX2):
            self.assertIsInstance(native.load(cache, flags), str)
        warnings = [e for e in events if e.get("log_level") == LogLevel.warn]
        self.assertEqual(len(warnings), 1, warnings)
        text = formatEvent(warnings[0])
        self.assertIn("no C compiler found", text)
        self.assertIn("ships no prebuilt native library", text)
        self.assertIn("falls back to torch's kernels", text)
        self.assertIn("docs/engine.md section 5.1", text)


class Timing:
    """A made-up measurement: as a CPU with native bfloat16 (bfloat16 products fast) or one
    that emulates it (float32 products fast); records what was measured."""

    def __init__(self, fast: torch.dtype) -> None:
        self.fast = fast
        self.measured: list[torch.dtype] = []

    def __call__(self, layer: Linear, x: torch.Tensor) -> float:
        self.measured.append(x.dtype)
        return 0.001 if x.dtype == self.fast else 0.003


def refuse(layer: Linear, x: torch.Tensor) -> float:
    raise AssertionError("measured again although the choice was kept")


class ChoiceTests(unittest.SynchronousTestCase):
    """The kernel family is the faster on layer 0 for this CPU, and is kept per CPU flags."""

    def setUp(self) -> None:
        self.library = library()
        generator = torch.Generator().manual_seed(8)
        self.samples = {
            "qkv": (torch.randn(128, 64, generator=generator) * 0.1, Precision.INT4),
            "down": (torch.randn(64, 128, generator=generator) * 0.1, Precision.INT4),
        }
        self.cache = Path(tempfile.mkdtemp(prefix="sfnode-choice-")) / "kernel-choice.json"

    def test_each_kind_of_cpu_keeps_its_own_measured_choice(self) -> None:
        """An AVX2-only CPU that measures float32 faster gets the native kernels; a CPU with
        AVX512-BF16 that measures bfloat16 faster keeps torch's; both are kept in one file under
        their own flags and read back without measuring again."""
        avx2, xeon = Cpu(AVX2_ONLY), Cpu(AVX512_BF16)
        emulated, native_bf16 = Timing(torch.float32), Timing(torch.bfloat16)
        pick = functools.partial(
            choose, self.samples, library_dir=_library_dir, cache_file=self.cache
        )
        first = pick(cpu=avx2, measure=emulated)
        self.assertEqual((first.family, first.activations), ("native", torch.float32))
        self.assertIsNotNone(first.library)
        self.assertEqual(set(emulated.measured), {torch.float32, torch.bfloat16})
        second = pick(cpu=xeon, measure=native_bf16)
        self.assertEqual((second.family, second.activations), ("torch", torch.bfloat16))
        self.assertEqual(set(native_bf16.measured), {torch.float32, torch.bfloat16})
        kept = json.loads(self.cache.read_text())["choices"]
        families = sorted(entry["family"] for entry in kept.values())
        self.assertEqual(families, ["native", "torch"])
        again = [
            choose(self.samples, cpu=c, library_dir=_library_dir, cache_file=self.cache,
                   measure=refuse).family
            for c in (avx2, xeon)
        ]  # fmt: skip
        self.assertEqual(again, ["native", "torch"])

    def test_a_cpu_without_avx2_keeps_torch_kernels_and_says_why(self) -> None:
        """Without AVX2 only torch's kernels are measured, and the reason is in the choice."""
        timing = Timing(torch.float32)
        choice = choose(
            self.samples,
            cpu=Cpu(NO_AVX2),
            library_dir=_library_dir,
            cache_file=self.cache,
            measure=timing,
        )
        self.assertEqual(choice.family, "torch")
        self.assertEqual(set(timing.measured), {torch.bfloat16})
        self.assertIn("lacks avx2", choice.why)

    def test_a_family_that_fails_its_check_is_never_chosen(self) -> None:
        """A native kernel answering wrongly is dropped however fast it measures."""

        class Wrong(native.Q4Linear):
            def __call__(self, x: torch.Tensor) -> torch.Tensor:
                return super().__call__(x) * 1.5

        self.patch(native, "Q4Linear", Wrong)
        choice = choose(
            self.samples,
            cpu=Cpu(AVX2_ONLY),
            library_dir=_library_dir,
            cache_file=self.cache,
            measure=Timing(torch.float32),
        )
        self.assertEqual(choice.family, "torch")
        self.assertIn("native failed its check", choice.why)

    def test_the_engine_weights_follow_the_choice_and_log_it_once(self) -> None:
        """gather_weights serves a model's int4 matrices with the family the measurement
        chose, computes in its activation type, and logs the choice with the CPU's extensions
        in one line."""
        model = tiny_llama()
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        for flags, fast, activations in (
            (AVX2_ONLY, torch.float32, torch.float32),
            (AVX512_BF16, torch.bfloat16, torch.bfloat16),
        ):
            weights = gather_weights(
                model,
                "int4",
                dense_copies=False,
                cpu=Cpu(flags),
                measure=Timing(fast),
                library_dir=_library_dir,
            )
            self.assertEqual((weights.mode, weights.activations), ("int4", activations))
            self.assertEqual(weights.describe(), "int4 x 13")
        lines = [e for e in events if "multiply with the" in e.get("log_format", "")]
        self.assertEqual([e["family"] for e in lines], ["native", "torch"])
        self.assertIn("no avx512f", lines[0]["cpu"])
        self.assertIn("avx512_bf16", lines[1]["cpu"])


class FallbackTests(unittest.SynchronousTestCase):
    """Without a C compiler (or on a CPU without AVX2) the engine runs torch's kernels and its
    layers as torch operators, and one log line says why."""

    def test_no_compiler_means_torch_kernels_and_the_eager_step(self) -> None:
        """With no compiler found, int4 weights use torch's kernel in bfloat16, the runner has
        no fused step, and the choice's log line names the missing compiler."""
        self.patch(native, "compiler", lambda: None)
        self.patch(native, "shipped_library", lambda: None)
        self.patch(native, "_loaded", {})
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        model = tiny_llama()
        weights = gather_weights(
            model,
            "int4",
            dense_copies=False,
            cpu=Cpu(AVX2_ONLY),
            measure=Timing(torch.float32),
            library_dir=Path(tempfile.mkdtemp(prefix="sfnode-native-none-")),
        )
        self.assertEqual(weights.activations, torch.bfloat16)
        runner = DecoderRunner(weights, slots=1, window=64)
        self.assertIsNone(runner.fused)
        self.assertEqual(runner.fused_reason, "activations are bfloat16")
        lines = [e for e in events if "multiply with the" in e.get("log_format", "")]
        self.assertEqual(len(lines), 1)
        self.assertIn("no C compiler found", lines[0]["why"])


def greedy_run(
    runner: DecoderRunner, prompt: list[int], new: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of ``prompt`` in slot 0, and the last step's hidden-state logits."""
    params = GenParams()
    out = runner.run(StepPlan(chunks=(ChunkRow(0, 0, tuple(prompt), True, params, 0),)))
    tokens = [out.chunks[0]]
    for i in range(new - 1):
        row = DecodeRow(0, tokens[-1], len(prompt) + i, params, 0)
        tokens.append(runner.run(StepPlan(decode=(row,))).decode[0])
    return [t for t in tokens if t is not None], runner.sequence_logits(prompt + tokens[:-1])


class FusedStepTests(unittest.SynchronousTestCase):
    """The native step computes what the per-operator layers compute (docs/engine.md
    section 5.2), in every mode that has them (int4, int8 and float32 with the native
    kernels)."""

    def setUp(self) -> None:
        self.library = library()
        self.model = tiny_llama()

    def weights(self, mode: str) -> Any:
        return gather_weights(
            self.model, mode, dense_copies=False, kernels="native", library_dir=_library_dir
        )

    def test_fused_equals_eager_per_mode(self) -> None:
        """For int4, int8 and float32, the native step gives the greedy tokens of the
        per-operator runner on the same weights, and each position's best logits within 0.1% of
        its own (the norms, attention and the SiLU gate are computed in another order, and the
        products round activations to 16 bits; the best logits are the ones both compute again
        in float32, while a logit near the 128th may be refined by one and not the other)."""
        rng = random.Random(5)
        for mode in ("int4", "int8", "float32"):
            weights = self.weights(mode)
            fused = DecoderRunner(weights, slots=1, window=256)
            eager = DecoderRunner(weights, slots=1, window=256, fused=False)
            self.assertIsNotNone(fused.fused, fused.fused_reason)
            self.assertIsNone(eager.fused)
            for n in (1, 9, 40):
                prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(n)]
                a_tokens, a_logits = greedy_run(fused, prompt, 12)
                b_tokens, b_logits = greedy_run(eager, prompt, 12)
                self.assertEqual(a_tokens, b_tokens, (mode, n))
                best = b_logits.topk(16, dim=1).indices
                a_best, b_best = a_logits.gather(1, best), b_logits.gather(1, best)
                error = float((a_best - b_best).abs().max() / b_best.abs().max())
                self.assertLess(error, 1e-3, mode)

    def test_the_rotary_tables_grow_with_the_lanes(self) -> None:
        """A runner holds rotary tables of the positions its lanes reach, not of its window:
        256 for a short answer, and more once a lane passes them (the keys and values grew);
        the native step then reads the grown tables, and every token and logit is the one a
        runner whose tables covered the whole window from the start computes."""
        rng = random.Random(6)
        weights = self.weights("int4")
        grown = DecoderRunner(weights, slots=1, window=1024)
        whole = DecoderRunner(weights, slots=1, window=1024)
        whole._rope.cover(1024)
        self.assertIsNotNone(grown.fused, grown.fused_reason)
        self.assertEqual(grown._rope.length, 256)
        prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(250)]
        a_tokens, a_logits = greedy_run(grown, prompt, 20)
        b_tokens, b_logits = greedy_run(whole, prompt, 20)
        self.assertEqual(grown._rope.length, 512)
        self.assertEqual(a_tokens, b_tokens)
        torch.testing.assert_close(a_logits, b_logits, rtol=0, atol=0)

    def test_keys_and_values_do_not_depend_on_chunking_or_neighbours(self) -> None:
        """In int4 and int8 the native step writes bit-identical keys and values for a prompt
        computed in one chunk in slot 0 and in chunks of 7 in slot 1 beside another lane's
        decode rows, and the next decode step gives both lanes bit-identical logits
        (docs/engine.md section 5.2: a prefix-cache hit continues the same stream)."""
        rng = random.Random(8)
        for mode in ("int4", "int8"):
            weights = self.weights(mode)
            runner = DecoderRunner(weights, slots=3, window=256)
            self.assertIsNotNone(runner.fused, runner.fused_reason)
            params = GenParams()
            prompt = tuple(rng.randrange(3, TINY_VOCAB) for _ in range(40))
            other = tuple(rng.randrange(3, TINY_VOCAB) for _ in range(5))
            runner.run(StepPlan(chunks=(ChunkRow(0, 0, prompt, True, params, 0),)))
            runner.run(StepPlan(chunks=(ChunkRow(2, 0, other, True, params, 0),)))
            for start in range(0, len(prompt), 7):
                piece = prompt[start : start + 7]
                last = start + 7 >= len(prompt)
                neighbour = DecodeRow(2, 11, len(other) + start // 7, params, 0)
                runner.run(
                    StepPlan(
                        decode=(neighbour,),
                        chunks=(ChunkRow(1, start, piece, last, params, 0),),
                    )
                )
            n = len(prompt)
            for layer in range(len(runner.kv.keys)):
                for table in (runner.kv.keys[layer], runner.kv.values[layer]):
                    self.assertTrue(torch.equal(table[0, :, :n], table[1, :, :n]), (mode, layer))
            hidden = runner.fused.forward(runner.kv, [n, n], [0, 1], tokens=[7, 7])
            logits = runner.fused.logits(hidden, None, 128)
            self.assertTrue(torch.equal(logits[0], logits[1]), mode)

    def test_float32_native_greedy_equals_generate(self) -> None:
        """--weights float32 with sfnode's kernels, fused step: greedy tokens equal
        transformers' generate() (the float32 mode's promise, docs/engine.md section 2.2)."""
        weights = self.weights("float32")
        runner = DecoderRunner(weights, slots=1, window=256)
        self.assertIsNotNone(runner.fused, runner.fused_reason)
        self.assertEqual(weights.describe(), "float32 x 13")
        rng = random.Random(6)
        for n in (1, 9, 40):
            prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(n)]
            tokens, _ = greedy_run(runner, prompt, 12)
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=12,
                    do_sample=False,
                    attention_mask=torch.ones(1, n, dtype=torch.long),
                    pad_token_id=0,
                    eos_token_id=None,
                )
            self.assertEqual(tokens, out[0, n:].tolist(), n)

    def test_fused_stage_forward_leaves_its_input_alone(self) -> None:
        """A later pipeline stage (hidden states in) through the fused layers does not write
        into the caller's tensor, and splitting the layers gives the one-stage token."""
        weights = self.weights("int4")
        runner = DecoderRunner(weights, slots=1, window=256)
        tokens = list(range(3, 40))
        whole = runner.stage(tokens, 0, 3, None).token
        first = runner.stage(tokens, 0, 1, None)
        from sfnode.engines.runners.hidden import decode_hidden

        assert first.hidden is not None
        hidden = decode_hidden(first.hidden, 64)
        kept = hidden.clone()
        self.assertEqual(runner.stage([], 1, 3, hidden).token, whole)
        self.assertTrue(torch.equal(hidden, kept))
