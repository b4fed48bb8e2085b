"""The weights modes alone: GGUF blocks, the int4/int8/bfloat16 kernels, self-checks and fallback,
and the packed-weights file (docs/engine.md section 5).

Blocks are built byte by byte here from known values, so the decoding is checked against the
GGUF format itself, not against another decoder.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial import unittest

from sfnode.engines.kernels.quant import (
    GROUP,
    Bfloat16Linear,
    GgufMatrix,
    Int4Linear,
    Int8Linear,
    Precision,
    Projection,
    dequantize,
    effective_weight,
    from_gguf,
    kernel_works,
    q4_parts,
    quantize,
)
from sfnode.engines.weights.gather import gather_weights
from sfnode.engines.weights.stored import unpermute_order
from tests.tinymodel import tiny_llama


def q4_1_block(scale: float, minimum: float, q: list[int]) -> bytes:
    """One Q4_1 block: f16 d, f16 m, then weight j in the low nibble of byte j and weight
    j + 16 in its high nibble."""
    assert len(q) == GROUP
    packed = bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    return struct.pack("<ee", scale, minimum) + packed


def q4_0_block(scale: float, q: list[int]) -> bytes:
    packed = bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    return struct.pack("<e", scale) + packed


def q8_0_block(scale: float, q: list[int]) -> bytes:
    return struct.pack("<e", scale) + struct.pack("<32b", *q)


def matrix(kind: str, rows: list[bytes], cols: int) -> GgufMatrix:
    data = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), -1)
    return GgufMatrix(kind, len(rows), cols, data)


class GgufBlockTests(unittest.SynchronousTestCase):
    """Each block type decodes to what the format says its bytes mean."""

    def test_q4_1(self) -> None:
        """Q4_1: w = d * q + m, nibbles in GGUF's order."""
        q = list(range(16)) + list(range(15, -1, -1))
        block = q4_1_block(0.5, -2.0, q)
        m = matrix("Q4_1", [block, block], GROUP)
        expected = torch.tensor([0.5 * v - 2.0 for v in q])
        self.assertTrue(torch.equal(dequantize(m)[0], expected))
        values, scale, minimum = q4_parts(m)
        self.assertEqual(values[0].tolist(), q)
        self.assertEqual((scale[0, 0].item(), minimum[0, 0].item()), (0.5, -2.0))

    def test_q4_0(self) -> None:
        """Q4_0: w = d * (q - 8)."""
        q = [(3 * j) % 16 for j in range(GROUP)]
        m = matrix("Q4_0", [q4_0_block(0.25, q)], GROUP)
        self.assertEqual(dequantize(m)[0].tolist(), [0.25 * (v - 8) for v in q])

    def test_q8_0(self) -> None:
        """Q8_0: w = d * q with signed q."""
        q = [j - 16 for j in range(GROUP)]
        m = matrix("Q8_0", [q8_0_block(0.125, q), q8_0_block(-1.0, q)], GROUP)
        self.assertEqual(dequantize(m)[0].tolist(), [0.125 * v for v in q])
        self.assertEqual(dequantize(m)[1].tolist(), [-1.0 * v for v in q])

    def test_rows_of_several_blocks(self) -> None:
        """A row's blocks follow each other along the row."""
        first, second = [1] * GROUP, [2] * GROUP
        row = q4_1_block(1.0, 0.0, first) + q4_1_block(1.0, 0.0, second)
        self.assertEqual(dequantize(matrix("Q4_1", [row], 2 * GROUP))[0].tolist(), first + second)

    def test_a_short_row_is_refused(self) -> None:
        """Bytes that do not match the stated shape raise ValueError."""
        block = q4_1_block(1.0, 0.0, [0] * GROUP)
        with self.assertRaises(ValueError):
            dequantize(matrix("Q4_1", [block], 2 * GROUP))

    def test_unpermute_order_interleaves_the_rotary_halves_back(self) -> None:
        """GGUF's query/key rows (each head's two rotary halves interleaved) go back to
        transformers' order (halves apart)."""
        # One head of 8 rows: GGUF holds pairs (i, i + 4) next to each other.
        gguf_rows = [0, 4, 1, 5, 2, 6, 3, 7]  # transformers row held at each GGUF row
        order = unpermute_order(8, 1)
        self.assertEqual([gguf_rows[i] for i in order], list(range(8)))

    def test_the_gguf_reader_gives_the_gguf_librarys_matrices(self) -> None:
        """read_gguf (sfnode's own walk of the tensor table and memory maps) gives the matrices
        the gguf library's reader gives, kind, shape and bytes, query and key rows reordered
        alike, for every quantized tensor of the bundled model (skipped when it is not
        installed)."""
        from gguf import GGUFReader

        from sfnode.engines.weights.loading import ModelLoadError, default_gguf
        from sfnode.engines.weights.stored import read_gguf

        try:
            path = default_gguf()
        except ModelLoadError as e:
            raise unittest.SkipTest(str(e)) from e
        parts = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o"}
        parts.update({"ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"})
        ours = read_gguf(path).tensors
        theirs: dict[str, GgufMatrix] = {}
        for tensor in GGUFReader(str(path)).tensors:
            if tensor.tensor_type.name not in ("Q4_0", "Q4_1", "Q8_0"):
                continue
            rows = int(tensor.data.shape[0])
            cols = int(tensor.n_elements) // rows
            matrix = GgufMatrix(tensor.tensor_type.name, rows, cols, np.asarray(tensor.data))
            name = tensor.name.removesuffix(".weight")
            if name in ("token_embd", "output"):
                theirs["embed" if name == "token_embd" else "lm_head"] = matrix
                continue
            _, index, part = name.split(".", 2)
            short = parts[part]
            if short in ("q", "k"):
                matrix = matrix.take_rows(unpermute_order(rows, 9 if short == "q" else 3))
            theirs[f"{int(index)}.{short}"] = matrix
        self.assertEqual(sorted(n for n, t in ours.items() if t.kind != "F32"), sorted(theirs))
        for name, matrix in theirs.items():
            mine = ours[name]
            self.assertEqual((mine.kind, mine.shape), (matrix.kind, (matrix.rows, matrix.cols)))
            self.assertTrue(np.array_equal(mine.data, matrix.data), name)


class CheckCacheTests(unittest.SynchronousTestCase):
    """The kernels' self-checks are kept beside the packed weights, per CPU kind."""

    def test_a_start_reads_the_kept_checks_and_rewrites_damaged_ones(self) -> None:
        """The first start runs the self-checks and keeps them; the next reads them without
        running any; a damaged file is run again and rewritten."""
        from sfnode.engines.weights import packed

        folder = Path(self.mktemp())
        folder.mkdir()
        runs: list[int] = []
        usable = packed.usable_precisions

        def counting() -> dict[Precision, str | None]:
            runs.append(1)
            return usable()

        self.patch(packed, "usable_precisions", counting)
        first = packed.cached_precisions(folder)
        self.assertEqual(len(runs), 1)
        self.assertEqual(packed.cached_precisions(folder), first)
        self.assertEqual(len(runs), 1)
        (folder / packed.CHECKS_FILE).write_text("{not json")
        self.assertEqual(packed.cached_precisions(folder), first)
        self.assertEqual(len(runs), 2)
        self.assertEqual(packed.cached_precisions(folder), first)
        self.assertEqual(len(runs), 2)


class KernelTests(unittest.SynchronousTestCase):
    """Each quantized kernel multiplies by the weights it stands for."""

    def setUp(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.weight = torch.randn(64, 96, generator=generator) * 0.1
        self.x = torch.randn(5, 96, generator=generator).to(torch.bfloat16)

    def reference(self, weight: torch.Tensor) -> torch.Tensor:
        return self.x.to(torch.float32) @ weight.t()

    def test_int4_from_gguf_blocks_is_the_blocks_weights(self) -> None:
        """An int4 layer made from Q4_1 blocks multiplies by the blocks' own weights: within
        bfloat16 rounding of its scale and zero, and of the activations' products."""
        generator = torch.Generator().manual_seed(5)
        rows = []
        for _ in range(64):
            blocks = b""
            for _ in range(3):
                q = torch.randint(0, 16, (GROUP,), generator=generator).tolist()
                d = float(torch.rand((), generator=generator)) * 0.05
                blocks += q4_1_block(d, -8 * d + 0.01, q)
            rows.append(blocks)
        m = matrix("Q4_1", rows, 96)
        layer = from_gguf([m], Precision.INT4)
        self.assertIsInstance(layer, Int4Linear)
        got = layer(self.x).to(torch.float32)
        want = self.reference(dequantize(m))
        self.assertTrue(torch.allclose(got, want, rtol=2e-2, atol=2e-2), (got - want).abs().max())

    def test_int4_of_a_float_matrix(self) -> None:
        """Int4 of a float matrix errs no more, group by group, than plain round-to-nearest over
        each group's full range (it may clip a group's range where that errs less), and the
        kernel multiplies by exactly the weights it stands for."""
        layer = Int4Linear.quantize(self.weight)
        ours = ((effective_weight(layer) - self.weight) ** 2).view(64, -1, GROUP).sum(-1)
        groups = self.weight.view(64, -1, GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        step = (high - low) / 15
        plain = torch.round((groups - low) / step) * step + low
        plain_error = ((plain - groups) ** 2).sum(-1)
        # bfloat16 holds the effective weights: allow its rounding on top of plain's error.
        self.assertTrue(bool((ours <= plain_error * 1.02 + 1e-5).all()))
        self.assertLess(float(ours.sum()), float(plain_error.sum()))
        got = layer(self.x).to(torch.float32)
        want = self.reference(effective_weight(layer))
        self.assertTrue(torch.allclose(got, want, rtol=2e-2, atol=2e-2))

    def test_int8_and_bfloat16(self) -> None:
        """int8 (one scale per row) and bfloat16 layers match a float reference."""
        for layer in (Int8Linear.quantize(self.weight), Bfloat16Linear(self.weight)):
            got = layer(self.x).to(torch.float32)
            self.assertTrue(
                torch.allclose(got, self.reference(self.weight), rtol=3e-2, atol=3e-2),
                layer.precision,
            )

    def test_rows_do_not_depend_on_each_other(self) -> None:
        """A row's product is the same alone or with other rows (so a lane's tokens do not
        depend on which lanes share its step)."""
        for precision in (Precision.INT4, Precision.INT8, Precision.BFLOAT16):
            layer = quantize(self.weight, precision)
            together = layer(self.x)
            for i in range(self.x.shape[0]):
                self.assertTrue(torch.equal(layer(self.x[i : i + 1]), together[i : i + 1]))

    def test_a_dense_copy_is_the_kernels_weights(self) -> None:
        """The dense copy long prompt chunks use holds the weights the kernel multiplies by."""
        projection = Projection(Int4Linear.quantize(self.weight)).with_dense()
        assert projection.dense is not None
        self.assertTrue(
            torch.allclose(
                projection.dense(self.x).to(torch.float32),
                projection(self.x).to(torch.float32),
                rtol=2e-2,
                atol=2e-2,
            )
        )

    def test_every_kernel_passes_its_self_check_here(self) -> None:
        """On this machine every kernel runs and agrees with its reference."""
        for precision in Precision:
            self.assertIsNone(kernel_works(precision), precision)


class FallbackTests(unittest.SynchronousTestCase):
    """A kernel that is missing or wrong is replaced, with one clear log line."""

    def test_a_failed_int4_check_falls_back_to_bfloat16(self) -> None:
        """With the int4 check failing, --weights int4 serves bfloat16 and logs why, once."""
        model = tiny_llama(hidden=64, layers=2)
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        checks = {p: None for p in Precision}
        checks[Precision.INT4] = "RuntimeError: no int4 kernel"
        weights = gather_weights(model, "int4", checks=checks, dense_copies=False, kernels="torch")
        self.assertEqual(weights.mode, "int4")
        self.assertEqual(weights.describe(), "bfloat16 x 9")
        warnings = [
            e
            for e in events
            if e.get("log_level") == LogLevel.warn and "not usable" in e.get("log_format", "")
        ]
        self.assertEqual(len(warnings), 1)
        self.assertEqual(warnings[0]["reason"], "RuntimeError: no int4 kernel")
        self.assertEqual(warnings[0]["fallback"], "bfloat16")


class PackedFileTests(unittest.SynchronousTestCase):
    """The packed weights are kept for the next start and read back intact."""

    def test_round_trip_gives_the_same_products_from_aligned_memory(self) -> None:
        """Weights read from the packed file give the products of the packed originals, and
        every tensor read back is 64-byte aligned (the int8 kernel crashed on the file's own
        8-byte aligned buffers)."""
        from sfnode.engines.weights import packed

        generator = torch.Generator().manual_seed(9)
        weight = torch.randn(96, 64, generator=generator)
        linears = {
            "a": Int4Linear.quantize(weight),
            "b": Int8Linear.quantize(weight),
            "lm_head": Bfloat16Linear(weight),
        }
        wanted = {name: layer.precision for name, layer in linears.items()}
        signature = {"format": "1", "torch": torch.__version__, "mode": "int4", "usable": "x"}
        path = Path(self.mktemp()) / "packed.safetensors"
        packed.save(path, signature, wanted, linears)  # type: ignore[arg-type]
        read = packed.load(path, wanted, signature)
        assert read is not None
        self.assertEqual(sorted(read), sorted(wanted))
        x = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
        for name, layer in linears.items():
            self.assertTrue(torch.equal(read[name](x), layer(x)), name)
            for tensor in read[name].state().values():
                if tensor.dim():
                    self.assertEqual(tensor.data_ptr() % 64, 0, name)
        self.assertIsNone(packed.load(path, wanted, {**signature, "mode": "int8"}))
        self.assertIsNone(packed.load(path, {**wanted, "a": Precision.INT8}, signature))
