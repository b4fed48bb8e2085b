"""A small K-quantizer for tests: float32 rows into valid Q4_K, Q5_K and Q6_K super-blocks.

The ``gguf`` package dequantizes K-quants but cannot make them, so the tests' GGUF files get
their K-quant tensors from here: a plain round-to-nearest per sub-block (the scale and minimum
of each sub-block quantized to 6 bits against the super-block's own float16 scales), not
llama.cpp's search for the best scales, so the blocks are valid and close to the weights but
not the bytes llama-quantize would write.  :data:`Q4_K_M` is the mix llama.cpp names so:
Q6_K for the output head and for the value and down matrices of some layers, Q4_K elsewhere.

This module must never be imported by sfnode; it reads nothing and writes nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sfnode.engines.kernels.blocks import QK_K

Floats = np.ndarray[Any, np.dtype[np.float32]]
Bytes = np.ndarray[Any, np.dtype[np.uint8]]


def _half(values: Floats) -> Bytes:
    return np.ascontiguousarray(values.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _six_bits(values: Floats, top: Floats) -> tuple[Floats, Bytes]:
    """Super-block scale (float16-rounded) and 6-bit multiples of it for ``values`` >= 0."""
    d = (top / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.rint(values / d), 0)
    return d, np.clip(q, 0, 63).astype(np.uint8)


def pack_scales(sc: Bytes, mins: Bytes) -> Bytes:
    """Eight 6-bit scales and mins per super-block (``[n, 8]`` each) into Q4_K's 12 bytes."""
    n = sc.shape[0]
    out = np.zeros((n, 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mins[:, 0:4] & 63) | ((mins[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mins[:, 4:8] & 0xF) << 4)
    return out


def _k_common(x: Floats, levels: int) -> tuple[Bytes, Bytes, Bytes]:
    """Q4_K/Q5_K: the d/dmin bytes, the packed scales and the quantized values (0..levels)."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)
    scale = (sub.max(axis=-1) - low) / levels
    d, sc = _six_bits(scale, scale.max(axis=-1, keepdims=True))
    dmin, mins = _six_bits(-low, (-low).max(axis=-1, keepdims=True))
    step = d * sc.astype(np.float32)
    offset = dmin * mins.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((sub + offset[..., None]) / step[..., None]), 0)
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(n, QK_K)
    head = np.concatenate([_half(d), _half(dmin)], axis=-1)
    return head, pack_scales(sc, mins), q


def _nibble_pairs(q: Bytes) -> Bytes:
    """Sub-blocks (2i, 2i+1) of 32 values into 32 bytes: low nibble 2i, high nibble 2i+1."""
    n = q.shape[0]
    pairs = q.reshape(n, 4, 2, 32) & 0xF
    return (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(n, 128)


def quantize_q4_k(x: Floats) -> Bytes:
    head, scales, q = _k_common(x.reshape(-1, QK_K).astype(np.float32), 15)
    return np.concatenate([head, scales, _nibble_pairs(q)], axis=-1)


def quantize_q5_k(x: Floats) -> Bytes:
    head, scales, q = _k_common(x.reshape(-1, QK_K).astype(np.float32), 31)
    n = q.shape[0]
    fifth = (q.reshape(n, 8, 32) >> 4) & 1
    qh = np.zeros((n, 32), np.uint8)
    for j in range(8):
        qh |= (fifth[:, j, :] << j).astype(np.uint8)
    return np.concatenate([head, scales, qh, _nibble_pairs(q)], axis=-1)


def quantize_q6_k(x: Floats) -> Bytes:
    blocks = x.reshape(-1, QK_K).astype(np.float32)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0
    d = (scale.max(axis=-1, keepdims=True) / 127.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.rint(scale / d), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    step = d * sc.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] != 0, np.rint(sub / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 8, 32)
    ql = np.zeros((n, 128), np.uint8)
    qh = np.zeros((n, 64), np.uint8)
    for g in range(8):
        half, nibble, part = g // 4, (g % 4) // 2, g % 2
        at = half * 64 + part * 32
        ql[:, at : at + 32] |= ((q[:, g, :] & 0xF) << (4 * nibble)).astype(np.uint8)
        qh[:, half * 32 : half * 32 + 32] |= ((q[:, g, :] >> 4) << (2 * (g % 4))).astype(np.uint8)
    return np.concatenate([ql, qh, sc.view(np.uint8), _half(d.reshape(-1))], axis=-1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(kind: str, weights: Floats) -> Bytes:
    """``weights`` ``[rows, cols]`` (cols a multiple of 256) as rows of ``kind`` blocks."""
    return QUANTIZERS[kind](weights).reshape(weights.shape[0], -1)


def q4_k_m_kind(name: str, layer: int | None, layers: int) -> str:
    """The block format llama.cpp's Q4_K_M mix gives tensor ``name`` (a GGUF name without
    ``blk.N.`` and ``.weight``) of layer ``layer``: Q6_K for the output head, and for the value
    and down matrices of the first and last eighth of the layers and every third between them;
    Q4_K otherwise."""
    if name == "output":
        return "Q6_K"
    if name in ("attn_v", "ffn_down") and layer is not None:
        more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        return "Q6_K" if more else "Q4_K"
    return "Q4_K"


def random_blocks(kind: str, count: int, rng: np.random.Generator) -> Bytes:
    """``count`` random valid super-blocks of ``kind``: random bytes with finite float16
    scales (any bit pattern of the other fields is a valid block)."""
    from sfnode.engines.kernels.blocks import FORMATS

    size = FORMATS[kind].size
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    halves = (rng.standard_normal((count, 2)) * 0.05).astype("<f2").view(np.uint8)
    if kind == "Q6_K":
        raw[:, 208:210] = halves[:, 0:2]
    else:
        raw[:, 0:4] = halves
    return raw
