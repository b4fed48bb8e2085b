"""The block formats a GGUF file stores its tensors in, and their meaning in float32 (NumPy).

A GGUF tensor is a run of rows; each row is whole *blocks* of one format (docs/engine.md
section 5.4).  The formats read here:

- ``F32``, ``F16``, ``BF16``: one value a "block";
- ``Q8_0`` (32 weights: float16 d, 32 int8 q; w = d*q), ``Q4_0`` (float16 d, 16 bytes of
  nibbles; w = d*(q - 8)), ``Q4_1`` (float16 d and m; w = d*q + m);
- the K-quants, 256 weights a *super-block*:

  - ``Q4_K`` (144 bytes): float16 d, float16 dmin, 12 bytes of eight 6-bit scales and eight
    6-bit mins, 128 bytes of nibbles; sub-block j (32 weights) has w = d*sc[j]*q - dmin*m[j];
  - ``Q5_K`` (176 bytes): as Q4_K with 32 bytes of fifth bits (``qh``) before the nibbles;
  - ``Q6_K`` (210 bytes): 128 bytes of low nibbles (``ql``), 64 bytes of high 2-bit pairs
    (``qh``), sixteen int8 scales, float16 d; sub-block j (16 weights) has
    w = d*scale[j]*(q - 32).

:func:`dequantize` gives the float32 weights of whole blocks with the same float operations, in
the same order, as ggml's reference (``gguf.quants.dequantize``): bit for bit the same numbers,
which the tests check on random blocks.  The native library does the same a block at a time
(``sf_dequantize`` in ``native.c``) for the kernels.

Pure NumPy: this module never imports torch, never reads a file and never copies more than the
blocks it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

QK_K = 256
"""Weights per K-quant super-block."""
K_SCALE_SIZE = 12
"""Bytes of packed 6-bit scales and mins in a Q4_K or Q5_K super-block."""

Bytes = np.ndarray[Any, np.dtype[np.uint8]]
Floats = np.ndarray[Any, np.dtype[np.float32]]


@dataclass(frozen=True)
class BlockFormat:
    """One storage format: its ggml type number, weights per block, bytes per block."""

    name: str
    ggml_type: int
    weights: int
    size: int

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` weights (which must be whole blocks)."""
        if cols % self.weights:
            raise ValueError(f"a row of {cols} weights is not whole {self.name} blocks")
        return cols // self.weights * self.size


FORMATS = {
    f.name: f
    for f in (
        BlockFormat("F32", 0, 1, 4),
        BlockFormat("F16", 1, 1, 2),
        BlockFormat("Q4_0", 2, 32, 18),
        BlockFormat("Q4_1", 3, 32, 20),
        BlockFormat("Q5_0", 6, 32, 22),
        BlockFormat("Q5_1", 7, 32, 24),
        BlockFormat("Q8_0", 8, 32, 34),
        BlockFormat("Q4_K", 12, QK_K, 144),
        BlockFormat("Q5_K", 13, QK_K, 176),
        BlockFormat("Q6_K", 14, QK_K, 210),
        BlockFormat("BF16", 30, 1, 2),
    )
}
"""The formats sfnode reads, by name."""
BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}
"""The same, by ggml type number (what a GGUF tensor table holds)."""
K_QUANTS = frozenset({"Q4_K", "Q5_K", "Q6_K"})


def _halves(raw: Bytes) -> Floats:
    """Little-endian float16 from ``[n, 2]`` bytes, as ``[n, 1]`` float32."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _split(blocks: Bytes, *sizes: int) -> list[Bytes]:
    """The byte fields of each block, in order."""
    edges = np.cumsum(sizes[:-1]).tolist() if len(sizes) > 1 else []
    return [np.ascontiguousarray(part) for part in np.hsplit(blocks, edges)]


def k_scales_mins(scales: Bytes) -> tuple[Bytes, Bytes]:
    """The eight 6-bit scales and eight 6-bit mins packed in a Q4_K/Q5_K super-block's 12 bytes
    (``[n, 12]`` -> two ``[n, 8]``).  Bytes 0-3 hold scales 0-3 (low 6 bits) and the top two
    bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the low four bits of scales
    4-7 (low nibble) and of mins 4-7 (high nibble)."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mins.reshape(n, 8)


def _nibbles(qs: Bytes, groups: int, width: int) -> Bytes:
    """Low then high nibbles of each ``width``-byte group: ``[n, groups * 2 * width]``."""
    n = qs.shape[0]
    shifted = qs.reshape(n, groups, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(0x0F)).reshape(n, groups * 2 * width)


def _q4_k(blocks: Bytes) -> Floats:
    n = blocks.shape[0]
    d, dmin, scales, qs = _split(blocks, 2, 2, K_SCALE_SIZE, 128)
    sc, mins = k_scales_mins(scales)
    scale = (_halves(d) * sc.astype(np.float32)).reshape(n, -1, 1)
    minimum = (_halves(dmin) * mins.astype(np.float32)).reshape(n, -1, 1)
    q = _nibbles(qs, 4, 32).reshape(n, -1, 32).astype(np.float32)
    result: Floats = (scale * q - minimum).reshape(n, QK_K)
    return result


def _q5_k(blocks: Bytes) -> Floats:
    n = blocks.shape[0]
    d, dmin, scales, qh, qs = _split(blocks, 2, 2, K_SCALE_SIZE, QK_K // 8, 128)
    sc, mins = k_scales_mins(scales)
    scale = (_halves(d) * sc.astype(np.float32)).reshape(n, -1, 1)
    minimum = (_halves(dmin) * mins.astype(np.float32)).reshape(n, -1, 1)
    low = _nibbles(qs, 4, 32).reshape(n, -1, 32)
    high = qh.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = (high & np.uint8(1)).reshape(n, -1, 32)
    q = (low | (high << np.uint8(4))).astype(np.float32)
    result: Floats = (scale * q - minimum).reshape(n, QK_K)
    return result


def _q6_k(blocks: Bytes) -> Floats:
    n = blocks.shape[0]
    ql, qh, scales, d = _split(blocks, QK_K // 2, QK_K // 4, QK_K // 16, 2)
    scale = (_halves(d) * scales.view(np.int8).astype(np.float32)).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 2, 64).reshape(n, -1, 32)
    high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(3)).reshape(n, -1, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    weights = q.reshape(n, QK_K // 16, -1).astype(np.float32)
    result: Floats = (scale * weights).reshape(n, QK_K)
    return result


def _q8_0(blocks: Bytes) -> Floats:
    d, q = _split(blocks, 2, 32)
    result: Floats = _halves(d) * q.view(np.int8).astype(np.float32)
    return result


def _q4_0(blocks: Bytes) -> Floats:
    d, qs = _split(blocks, 2, 16)
    q = (_nibbles(qs, 1, 16).astype(np.int8) - np.int8(8)).astype(np.float32)
    result: Floats = _halves(d) * q
    return result


def _q4_1(blocks: Bytes) -> Floats:
    d, m, qs = _split(blocks, 2, 2, 16)
    result: Floats = _halves(d) * _nibbles(qs, 1, 16).astype(np.float32) + _halves(m)
    return result


def _five_bits(qh: Bytes, qs: Bytes) -> Bytes:
    """The 32 five-bit q of Q5_0/Q5_1 blocks: weight j's low nibble is byte j's (j < 16) or
    byte j - 16's high one, its fifth bit bit j of the little-endian 32-bit ``qh``."""
    n = qh.shape[0]
    bits = np.ascontiguousarray(qh).view("<u4").reshape(n, 1) >> np.arange(32, dtype=np.uint32)
    high = (bits & np.uint32(1)).astype(np.uint8)
    result: Bytes = _nibbles(qs, 1, 16) | (high << np.uint8(4))
    return result


def _q5_0(blocks: Bytes) -> Floats:
    d, qh, qs = _split(blocks, 2, 4, 16)
    q = (_five_bits(qh, qs).astype(np.int8) - np.int8(16)).astype(np.float32)
    result: Floats = _halves(d) * q
    return result


def _q5_1(blocks: Bytes) -> Floats:
    d, m, qh, qs = _split(blocks, 2, 2, 4, 16)
    result: Floats = _halves(d) * _five_bits(qh, qs).astype(np.float32) + _halves(m)
    return result


def _f16(blocks: Bytes) -> Floats:
    return np.ascontiguousarray(blocks).view("<f2").astype(np.float32)


def _bf16(blocks: Bytes) -> Floats:
    widened = np.ascontiguousarray(blocks).view("<i2").astype(np.int32) << 16
    result: Floats = widened.view(np.float32)
    return result


def _f32(blocks: Bytes) -> Floats:
    return np.ascontiguousarray(blocks).view("<f4").astype(np.float32)


_DEQUANTIZE = {
    "F32": _f32,
    "F16": _f16,
    "BF16": _bf16,
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def dequantize(kind: str, data: Bytes, cols: int) -> Floats:
    """The float32 weights ``[rows, cols]`` of ``data`` (``[rows, row bytes]``, or flat) in
    format ``kind``."""
    form = FORMATS[kind]
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, form.size)
    values = _DEQUANTIZE[kind](raw)
    return values.reshape(-1, cols)


__all__ = [
    "BY_TYPE",
    "FORMATS",
    "K_QUANTS",
    "QK_K",
    "BlockFormat",
    "dequantize",
    "k_scales_mins",
]
