"""Tests of the GGUF block formats (``sfnode/engines/kernels/blocks.py``, the native library's
``sf_dequantize``) and of the tests' own K-quantizer (``tests/kquant.py``), docs/engine.md
section 5.4.

Bit for bit means the float32 bit patterns are equal, compared as integers; the reference is the
``gguf`` package's ``dequantize`` (ggml's own arithmetic written in NumPy).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference
from gguf.quants import quantize as reference_quantize
from twisted.trial import unittest

from sfnode.engines.kernels import blocks, native
from sfnode.engines.weights.loading import default_cache_dir
from tests import kquant


def _bits(values: Any) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(np.asarray(values, dtype=np.float32)).view(np.uint32)


def _reference(kind: str, raw: np.ndarray[Any, Any], cols: int) -> np.ndarray[Any, Any]:
    return reference(raw, GGMLQuantizationType[kind]).reshape(-1, cols)


def _random_rows(kind: str, rows: int, cols: int, seed: int) -> np.ndarray[Any, Any]:
    """Random valid rows of ``kind``: K-quants from random bytes, the others quantized by the
    reference from random floats."""
    rng = np.random.default_rng(seed)
    form = blocks.FORMATS[kind]
    if kind in blocks.K_QUANTS:
        return kquant.random_blocks(kind, rows * cols // form.weights, rng).reshape(rows, -1)
    floats = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = reference_quantize(floats, GGMLQuantizationType[kind])
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)


class NumpyDequantizeTests(unittest.SynchronousTestCase):
    def test_every_format_is_the_reference_bit_for_bit(self) -> None:
        """Each format sfnode reads dequantizes to the reference's float32 values exactly,
        over random valid blocks (random bytes with finite scales for the K-quants)."""
        for kind in blocks.FORMATS:
            with self.subTest(kind=kind):
                raw = _random_rows(kind, 8, 512, seed=len(kind))
                ours = blocks.dequantize(kind, raw, 512)
                self.assertEqual(ours.shape, (8, 512))
                np.testing.assert_array_equal(_bits(ours), _bits(_reference(kind, raw, 512)))

    def test_formats_match_ggml_sizes(self) -> None:
        """Each format's weights and bytes per block and type number are ggml's."""
        from gguf import GGML_QUANT_SIZES

        for form in blocks.FORMATS.values():
            kind = GGMLQuantizationType[form.name]
            self.assertEqual(int(kind), form.ggml_type, form.name)
            self.assertEqual(GGML_QUANT_SIZES[kind], (form.weights, form.size), form.name)

    def test_a_row_of_partial_blocks_is_refused(self) -> None:
        """A row length that is not whole blocks is refused with the format's name."""
        with self.assertRaises(ValueError) as caught:
            blocks.FORMATS["Q4_K"].row_bytes(300)
        self.assertIn("Q4_K", str(caught.exception))


class NativeDequantizeTests(unittest.TestCase):
    def setUp(self) -> None:
        # The folder where every test's engines keep the native kernels: built there once
        # (about 4 s), not once per test in a folder of its own.
        loaded = native.load(default_cache_dir().parent / "kernels")
        if isinstance(loaded, str):
            raise unittest.SkipTest(f"no native kernels on this machine: {loaded}")
        self.library = loaded

    def test_k_quants_are_the_reference_bit_for_bit(self) -> None:
        """``sf_dequantize`` gives ggml's values exactly for Q4_K, Q5_K and Q6_K, over 4,096
        random valid super-blocks each (no fused multiply-add may round differently)."""
        for kind in sorted(blocks.K_QUANTS):
            with self.subTest(kind=kind):
                rng = np.random.default_rng(7)
                raw = kquant.random_blocks(kind, 4096, rng)
                ours = native.dequantize_k(self.library, kind, raw).numpy()
                want = _reference(kind, raw, blocks.QK_K).reshape(-1)
                np.testing.assert_array_equal(_bits(ours), _bits(want))

    def test_other_kinds_are_refused(self) -> None:
        """A format that is not a K-quant is refused by name, not read as one."""
        with self.assertRaises(ValueError) as caught:
            native.dequantize_k(self.library, "Q8_0", np.zeros(34, np.uint8))
        self.assertIn("Q8_0", str(caught.exception))


class QuantizerTests(unittest.SynchronousTestCase):
    def test_k_quantizer_round_trips_within_its_step(self) -> None:
        """The tests' K-quantizer writes blocks that the reference reads back close to the
        weights: within the step of the format (a wrong bit layout would be far off)."""
        rng = np.random.default_rng(3)
        weights = rng.standard_normal((4, 1024)).astype(np.float32) * 0.1
        for kind, tolerance in (("Q4_K", 0.035), ("Q5_K", 0.02), ("Q6_K", 0.01)):
            with self.subTest(kind=kind):
                raw = kquant.quantize(kind, weights)
                back = _reference(kind, raw, 1024)
                error = float(np.abs(back - weights).max())
                self.assertLess(error, tolerance)
                self.assertGreater(float(np.abs(back).max()), 0.2)

    def test_q4_k_m_mix(self) -> None:
        """The Q4_K_M mix: the head and some layers' value and down matrices in Q6_K."""
        kinds = [kquant.q4_k_m_kind("attn_v", layer, 8) for layer in range(8)]
        self.assertEqual(kinds, ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"])
        self.assertEqual(kquant.q4_k_m_kind("output", None, 8), "Q6_K")
        self.assertEqual(kquant.q4_k_m_kind("attn_q", 0, 8), "Q4_K")
