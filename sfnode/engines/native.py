"""sfnode's own AVX2 kernel for 4-bit weights with float32 activations, built at start with the
machine's C compiler and kept in a cache folder.

Why: on a CPU without AVX512-BF16 (most cloud VMs, many desktops; AVX2-only AMD EPYC machines
among them) bfloat16 arithmetic is emulated, so torch's int4 kernel, which wants bfloat16
activations, spends its time converting; with float32 activations it takes a path tens of times
slower still (docs/engine.md section 7).  This kernel does what llama.cpp does on such CPUs: each
activation row is quantized to int8 in blocks of 32 (one scale per block, the row alone decides
it), and each block of 32 4-bit weights (a GGUF Q4_1 block exactly: float16 scale ``d``, float16
minimum ``m``, 16 bytes of nibbles; ``w = d*q + m``) is multiplied with integer instructions
(``vpmaddubsw``), its sum scaled by ``d`` times the activation block's scale, plus ``m`` times the
activation block's sum.  A row's result depends on that row only, in the same order of operations
whatever else is in the call, so it is batch-invariant.  The output rows are split between the
OpenMP threads of the runtime torch itself uses (the library links the ``libgomp.so.1`` torch has
already loaded, so no second thread team appears; docs/engine.md section 6).

The library is compiled once per (source, compiler, flags) into ``cache_dir`` (atomically, so two
processes may race) and loaded with ctypes.  :func:`load` answers the library or the reason it
cannot: no C compiler, a CPU without AVX2/FMA/F16C, a failed compile; the caller then keeps torch's
kernels and logs that one reason.

This module must never run a kernel on a CPU whose flags it has not checked, never write a
half-built library where a later start would load it, and never touch a model or a thread.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sfnode.engines.quant import Precision

NEEDED_FLAGS = frozenset({"avx2", "fma", "f16c"})
"""CPU flags (as /proc/cpuinfo spells them) the kernel's instructions need."""

BLOCK = 32
BLOCK_BYTES = 20
"""A Q4_1 block: float16 d, float16 m, 16 bytes holding 32 nibbles."""

COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define QK 32
#define BLOCK_BYTES 20
#define MAX_BLOCKS 1024
#define QMAX 32767.0f

/* One activation row in int16 per block of 32: q = round(x / d), d = amax / 32767; s = d * sum(q),
   what the weights' block minimum multiplies.  Depends on the row alone. */
static void quantize_row(const float *x, int K, int16_t *qx, float *d, float *s) {
    const int nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < nb; b++) {
        const float *v = x + b * QK;
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < QK; j += 8)
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float mx = _mm_cvtss_f32(m4);
        const float id = mx > 0.0f ? QMAX / mx : 0.0f;
        const __m256 mul = _mm256_set1_ps(id);
        __m256i r[4];
        for (int j = 0; j < 4; j++)
            r[j] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), mul),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]),
                                              _mm256_add_epi32(r[2], r[3]));
        __m128i s2 = _mm_add_epi32(_mm256_extracti128_si256(sum4, 1),
                                   _mm256_castsi256_si128(sum4));
        s2 = _mm_hadd_epi32(s2, s2);
        s2 = _mm_hadd_epi32(s2, s2);
        /* packs interleave 128-bit lanes; put the values back in order */
        const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8);
        const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xD8);
        _mm256_storeu_si256((__m256i *)(qx + b * QK), p01);
        _mm256_storeu_si256((__m256i *)(qx + b * QK + 16), p23);
        d[b] = mx / QMAX;
        s[b] = d[b] * (float)_mm_cvtsi128_si32(s2);
    }
}

static inline float hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

typedef struct { int16_t *q; float *d; float *s; } rows_t;

static int quantize_rows(const float *x, int M, int K, rows_t *out) {
    const int nb = K / QK;
    out->q = (int16_t *)malloc(sizeof(int16_t) * ((size_t)M * K + 32));
    out->d = (float *)malloc(sizeof(float) * ((size_t)M * nb + 1));
    out->s = (float *)malloc(sizeof(float) * ((size_t)M * nb + 1));
    if (!out->q || !out->d || !out->s) return 0;
    for (int m = 0; m < M; m++)
        quantize_row(x + (size_t)m * K, K, out->q + (size_t)m * K, out->d + m * nb,
                     out->s + m * nb);
    return 1;
}

static void free_rows(rows_t *r) { free(r->q); free(r->d); free(r->s); }

/* R activation rows against one weight row given as 32 int16 weights a block (lo: 0..15,
   hi: 16..31) and a scale a block; each row's sum is formed in the same order whatever R is,
   so a row's result does not depend on the rows beside it. */
#define DOT_BLOCK(LO, HI, SCALE)                                                        \
    for (int r = 0; r < R; r++) {                                                       \
        const int16_t *xq = qx + (size_t)r * K + b * QK;                                \
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)xq);                     \
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 16));              \
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(LO, x0),                   \
                                           _mm256_madd_epi16(HI, x1));                  \
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps((SCALE) * dx[r * nb + b]),              \
                                 _mm256_cvtepi32_ps(p), acc[r]);                        \
    }

static inline __attribute__((always_inline)) void q4_rows(
    const int R, const uint8_t *w, int nb, const float *dw, const float *mw,
    const int16_t *qx, const float *dx, const float *sx, int K, float *out, int stride) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const __m128i t = _mm_loadu_si128((const __m128i *)(w + b * BLOCK_BYTES + 4));
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(t, low));
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(t, 4), low));
        DOT_BLOCK(lo, hi, dw[b])
    }
    for (int r = 0; r < R; r++) {
        float summ = 0.0f;
        for (int b = 0; b < nb; b++) summ += mw[b] * sx[r * nb + b];
        out[(size_t)r * stride] = hsum(acc[r]) + summ;
    }
}

static inline __attribute__((always_inline)) void q8_rows(
    const int R, const int8_t *w, int nb, float scale, const int16_t *qx, const float *dx,
    int K, float *out, int stride) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + b * QK)));
        const __m256i hi =
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + b * QK + 16)));
        DOT_BLOCK(lo, hi, 1.0f)
    }
    for (int r = 0; r < R; r++) out[(size_t)r * stride] = hsum(acc[r]) * scale;
}

#define TILES(CALL)                                                                      \
    int m = 0;                                                                           \
    for (; m + 4 <= M; m += 4) { const int R4 = 4; CALL(R4); }                           \
    switch (M - m) {                                                                     \
    case 3: CALL(3); break;                                                              \
    case 2: CALL(2); break;                                                              \
    case 1: CALL(1); break;                                                              \
    default: break;                                                                      \
    }

/* y[M, N] = x[M, K] @ W^T for W as N rows of K/32 Q4_1 blocks (float16 d, float16 m, 16 bytes:
   byte j holds weight j in its low nibble and weight j + 16 in its high one; w = d * q + m). */
int sf_q4_1_linear(const float *x, int M, int K, const uint8_t *w, int N, float *y,
                   int threads) {
    if (K % QK || K / QK > MAX_BLOCKS) return 1;
    const int nb = K / QK;
    rows_t a;
    if (!quantize_rows(x, M, K, &a)) { free_rows(&a); return 2; }
    const size_t row_bytes = (size_t)nb * BLOCK_BYTES;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + n * row_bytes;
        float dw[MAX_BLOCKS], mw[MAX_BLOCKS];
        for (int b = 0; b < nb; b++) {
            uint16_t h[2];
            memcpy(h, wr + b * BLOCK_BYTES, 4);
            dw[b] = _cvtsh_ss(h[0]);
            mw[b] = _cvtsh_ss(h[1]);
        }
#define Q4_CALL(RR) q4_rows(RR, wr, nb, dw, mw, a.q + (size_t)m * K, a.d + m * nb,             \
                            a.s + m * nb, K, y + (size_t)m * N + n, N)
        TILES(Q4_CALL)
    }
    free_rows(&a);
    return 0;
}

/* y[M, N] = x[M, K] @ W^T for W int8 [N, K] with one scale per row (w = scale * q). */
int sf_q8_linear(const float *x, int M, int K, const int8_t *w, const float *scales, int N,
                 float *y, int threads) {
    if (K % QK || K / QK > MAX_BLOCKS) return 1;
    const int nb = K / QK;
    rows_t a;
    if (!quantize_rows(x, M, K, &a)) { free_rows(&a); return 2; }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const int8_t *wr = w + (size_t)n * K;
#define Q8_CALL(RR) q8_rows(RR, wr, nb, scales[n], a.q + (size_t)m * K, a.d + m * nb, K,        \
                            y + (size_t)m * N + n, N)
        TILES(Q8_CALL)
    }
    free_rows(&a);
    return 0;
}

static inline __attribute__((always_inline)) void f32_rows(
    const int R, const float *w, int K, const float *x, float *out, int stride) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = _mm256_loadu_ps(w + k);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)r * K + k), acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float sum = hsum(acc[r]);
        for (int j = k; j < K; j++) sum += w[j] * x[(size_t)r * K + j];
        out[(size_t)r * stride] = sum;
    }
}

/* Two weight rows at once (each activation load serves both); every sum is formed exactly as
   f32_rows forms it. */
static inline __attribute__((always_inline)) void f32_rows2(
    const int R, const float *w, int K, const float *x, float *out, int stride) {
    __m256 a0[4], a1[4];
    for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    const float *w1 = w + K;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(w + k), v1 = _mm256_loadu_ps(w1 + k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)r * K + k);
            a0[r] = _mm256_fmadd_ps(v0, xv, a0[r]);
            a1[r] = _mm256_fmadd_ps(v1, xv, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s0 = hsum(a0[r]), s1 = hsum(a1[r]);
        for (int j = k; j < K; j++) {
            s0 += w[j] * x[(size_t)r * K + j];
            s1 += w1[j] * x[(size_t)r * K + j];
        }
        out[(size_t)r * stride] = s0;
        out[(size_t)r * stride + 1] = s1;
    }
}

/* y[M, N] = x[M, K] @ W^T for float32 W [N, K]: each row's sums in the same order whatever M
   is (8 lanes along K, then their sum, then the tail). */
int sf_f32_linear(const float *x, int M, int K, const float *w, int N, float *y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int pair = 0; pair < N / 2; pair++) {
        const int n = 2 * pair;
        const float *wr = w + (size_t)n * K;
#define F32_CALL2(RR) f32_rows2(RR, wr, K, x + (size_t)m * K, y + (size_t)m * N + n, N)
        TILES(F32_CALL2)
    }
    if (N % 2) {
        const int n = N - 1;
        const float *wr = w + (size_t)n * K;
#define F32_CALL(RR) f32_rows(RR, wr, K, x + (size_t)m * K, y + (size_t)m * N + n, N)
        TILES(F32_CALL)
    }
    return 0;
}

/* -- a decoder layer's per-token work around its products, fused (docs/engine.md section 5.2) -- */

typedef struct {
    int32_t kind; /* 0: Q4_1 blocks; 1: int8 rows with a float32 scale each; 2: float32 */
    int32_t K, N;
    const void *w;
    const float *scales;
} sf_matrix;

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    const float *input_norm, *post_norm;
    sf_matrix qkv, o, gate_up, down;
} sf_layer;

static int matmul(const sf_matrix *mat, const float *x, int M, float *y, int threads) {
    if (mat->kind == 0) return sf_q4_1_linear(x, M, mat->K, (const uint8_t *)mat->w, mat->N, y,
                                              threads);
    if (mat->kind == 1) return sf_q8_linear(x, M, mat->K, (const int8_t *)mat->w, mat->scales,
                                            mat->N, y, threads);
    if (mat->kind == 2) return sf_f32_linear(x, M, mat->K, (const float *)mat->w, mat->N, y,
                                             threads);
    return 3;
}

/* out = x / sqrt(mean(x^2) + eps) * w, row by row */
static void rmsnorm_rows(const float *x, int M, int H, const float *w, float eps, float *out) {
    for (int m = 0; m < M; m++) {
        const float *v = x + (size_t)m * H;
        __m256 acc = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= H; i += 8) {
            const __m256 t = _mm256_loadu_ps(v + i);
            acc = _mm256_fmadd_ps(t, t, acc);
        }
        float sum = hsum(acc);
        for (; i < H; i++) sum += v[i] * v[i];
        const float scale = 1.0f / sqrtf(sum / (float)H + eps);
        const __m256 sc = _mm256_set1_ps(scale);
        float *o = out + (size_t)m * H;
        for (i = 0; i + 8 <= H; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), sc),
                                                  _mm256_loadu_ps(w + i)));
        for (; i < H; i++) o[i] = v[i] * scale * w[i];
    }
}

/* e^x for 8 floats (Cephes' polynomial; relative error about 2e-7) */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* qkv = rmsnorm(hidden) @ Wqkv^T, then queries and keys turned by the rotary embedding of each
   row's position: v * cos + rotate_half(v) * sin, with rotate_half's sign folded into sin. */
int sf_layer_pre(const sf_layer *L, const float *hidden, int M, const float *cos,
                 const float *sin, const int64_t *positions, float *qkv, int threads) {
    const int H = L->hidden, hd = L->head_dim, half = hd / 2;
    const int turned = L->heads + L->kv_heads, width = L->qkv.N;
    if (hd > 1024) return 1;
    float *x = (float *)malloc(sizeof(float) * (size_t)M * H);
    if (!x) return 2;
    rmsnorm_rows(hidden, M, H, L->input_norm, L->eps, x);
    const int status = matmul(&L->qkv, x, M, qkv, threads);
    free(x);
    if (status) return status;
    for (int m = 0; m < M; m++) {
        const float *c = cos + (size_t)positions[m] * hd;
        const float *sn = sin + (size_t)positions[m] * hd;
        for (int h = 0; h < turned; h++) {
            float *v = qkv + (size_t)m * width + (size_t)h * hd;
            float t[1024];
            memcpy(t, v, sizeof(float) * hd);
            for (int i = 0; i < hd; i++) v[i] = t[i] * c[i] + t[(i + half) % hd] * sn[i];
        }
    }
    return 0;
}

/* hidden += attended @ Wo^T; then hidden += (silu(gate) * up) @ Wdown^T, where gate and up are
   rmsnorm(hidden) @ Wgate_up^T's two halves.  In place on hidden. */
int sf_layer_post(const sf_layer *L, float *hidden, const float *attended, int M, int threads) {
    const int H = L->hidden, I = L->intermediate;
    float *t = (float *)malloc(sizeof(float) * (size_t)M * H);
    float *x = (float *)malloc(sizeof(float) * (size_t)M * H);
    float *gu = (float *)malloc(sizeof(float) * (size_t)M * 2 * I);
    float *g = (float *)malloc(sizeof(float) * (size_t)M * I);
    int status = (!t || !x || !gu || !g) ? 2 : 0;
    if (!status) status = matmul(&L->o, attended, M, t, threads);
    if (!status) {
        for (size_t i = 0; i < (size_t)M * H; i++) hidden[i] += t[i];
        rmsnorm_rows(hidden, M, H, L->post_norm, L->eps, x);
        status = matmul(&L->gate_up, x, M, gu, threads);
    }
    if (!status) {
        for (int m = 0; m < M; m++) {
            const float *gate = gu + (size_t)m * 2 * I, *up = gate + I;
            float *o = g + (size_t)m * I;
            int i = 0;
            for (; i + 8 <= I; i += 8) {
                const __m256 a = _mm256_loadu_ps(gate + i);
                const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
                const __m256 silu = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
            }
            for (; i < I; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        }
        status = matmul(&L->down, g, M, t, threads);
    }
    if (!status)
        for (size_t i = 0; i < (size_t)M * H; i++) hidden[i] += t[i];
    free(t); free(x); free(gu); free(g);
    return status;
}
"""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's flags as the kernel lists them (empty where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, Python's own, ``cc``, ``gcc`` or ``clang``."""
    candidates = [os.environ.get("CC", ""), str(sysconfig.get_config_var("CC") or "")]
    candidates += ["cc", "gcc", "clang"]
    for candidate in candidates:
        name = candidate.split()[0] if candidate.strip() else ""
        if name and shutil.which(name):
            return name
    return None


def _torch_openmp() -> Path | None:
    """The OpenMP runtime file torch ships (its ``lib`` folder), if any."""
    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return found[0] if found else None


@dataclass(frozen=True)
class Library:
    """A loaded kernel library and where it came from."""

    path: Path
    built_seconds: float
    """Seconds spent compiling it at this start (0.0: it was in the cache)."""
    handle: Any


_loaded: dict[Path, Library] = {}


def library_name(cc: str) -> str:
    """The cache file name for this source built by ``cc`` (its version included)."""
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    key = "\n".join([SOURCE, " ".join(COMPILE_FLAGS), *version, torch.__version__])
    return f"sfnode-q4-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def load(cache_dir: Path, flags: frozenset[str] | None = None) -> Library | str:
    """The kernel library (compiled into ``cache_dir`` first if it is not there), or why not."""
    flags = cpu_flags() if flags is None else flags
    missing = sorted(NEEDED_FLAGS - flags)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    cc = compiler()
    if cc is None:
        return "no C compiler found (set CC, or install gcc)"
    path = cache_dir / library_name(cc)
    if path in _loaded:
        # Loaded already in this process: nothing was built for this call.
        return dataclasses.replace(_loaded[path], built_seconds=0.0)
    built = 0.0
    if not path.is_file():
        started = time.monotonic()
        reason = _compile(cc, path)
        if reason is not None:
            return reason
        built = time.monotonic() - started
    try:
        handle = ctypes.CDLL(str(path))
        q4, q8 = handle.sf_q4_1_linear, handle.sf_q8_linear
        pre, post = handle.sf_layer_pre, handle.sf_layer_post
        f32 = handle.sf_f32_linear
    except (OSError, AttributeError) as e:
        return f"cannot load {path}: {e}"
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    q4.argtypes = [pointer, integer, integer, pointer, integer, pointer, integer]
    q8.argtypes = [pointer, integer, integer, pointer, pointer, integer, pointer, integer]
    f32.argtypes = [pointer, integer, integer, pointer, integer, pointer, integer]
    f32.restype = ctypes.c_int
    pre.argtypes = [pointer, pointer, integer, pointer, pointer, pointer, pointer, integer]
    post.argtypes = [pointer, pointer, pointer, integer, integer]
    q4.restype = q8.restype = pre.restype = post.restype = ctypes.c_int
    library = Library(path, built, handle)
    _loaded[path] = library
    return library


def _compile(cc: str, path: Path) -> str | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".sfnode-q4-", dir=path.parent))
    try:
        source = work / "q4.c"
        source.write_text(SOURCE)
        output = work / path.name
        command = [cc, *COMPILE_FLAGS, str(source), "-o", str(output), "-lm"]
        openmp = _torch_openmp()
        if openmp is not None:
            # Link the runtime torch already has loaded (same soname): one OpenMP team.
            command += [f"-L{openmp.parent}", f"-Wl,-rpath,{openmp.parent}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{cc} failed to run: {e}"
        if done.returncode != 0 or not output.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"{cc} could not build the kernel: {last}"
        os.replace(output, path)
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- weights ----------------------------------------------------------------------------------


def pack_blocks(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks ``[rows, cols / 32 * 20]`` (uint8) of ``w = scale * q + minimum`` per group.

    ``q`` is ``[rows, cols]`` in 0..15; ``scale`` and ``minimum`` ``[rows, groups]`` (held as
    float16, as in a GGUF file).
    """
    rows, cols = q.shape
    groups = cols // BLOCK
    nibbles = q.to(torch.uint8).reshape(rows, groups, BLOCK).numpy()
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    d = scale.to(torch.float32).numpy().astype(np.float16).view(np.uint8)
    m = minimum.to(torch.float32).numpy().astype(np.float16).view(np.uint8)
    blocks = np.concatenate(
        [d.reshape(rows, groups, 2), m.reshape(rows, groups, 2), packed.astype(np.uint8)], axis=-1
    )
    return torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, groups * BLOCK_BYTES)))


def gguf_blocks(matrices: list[Any]) -> torch.Tensor:
    """Q4_1 blocks of GGUF 4-bit matrices stacked along their rows (a fused projection): a Q4_1
    file's own bytes, a Q4_0 matrix rewritten with its minimum ``-8 d``."""
    from sfnode.engines.quant import q4_parts

    parts = []
    for matrix in matrices:
        if matrix.kind == "Q4_1":
            parts.append(torch.from_numpy(np.array(matrix.data, dtype=np.uint8, copy=True)))
        else:
            parts.append(pack_blocks(*q4_parts(matrix)))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def blocks_weight(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """The float32 weights Q4_1 ``blocks`` mean (``d*q + m``), ``[rows, cols]``."""
    rows = blocks.shape[0]
    raw = blocks.numpy().reshape(rows, cols // BLOCK, BLOCK_BYTES)
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    m = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    packed = raw[..., 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)
    w = q * d[..., None] + m[..., None]
    return torch.from_numpy(w.reshape(rows, cols))


class Q4Linear:
    """4-bit weights in Q4_1 blocks multiplied by :data:`SOURCE`'s kernel, float32 activations.

    Its precision is int4 (what the weights hold); it computes in float32 between matrices.
    """

    precision = Precision.INT4
    activations = torch.float32
    kernel_name = "sfnode q4 x q8 (avx2)"

    def __init__(self, blocks: torch.Tensor, in_features: int, library: Library) -> None:
        if in_features % BLOCK:
            raise ValueError(f"Q4_1 blocks need in_features divisible by {BLOCK}")
        self.blocks = blocks.contiguous()
        self.in_features = in_features
        self.out_features = int(blocks.shape[0])
        self.library = library
        self._function = library.handle.sf_q4_1_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        status = self._function(
            x.data_ptr(),
            rows,
            self.in_features,
            self.blocks.data_ptr(),
            self.out_features,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"the q4 kernel refused the problem (status {status})")
        return out

    def state(self) -> dict[str, torch.Tensor]:
        return {"blocks": self.blocks, "in_features": torch.tensor(self.in_features)}


class Q8Linear:
    """Int8 weights with one float32 scale per output row, multiplied by :data:`SOURCE`'s kernel
    (activations quantized per block of 32 as for :class:`Q4Linear`); float32 activations."""

    precision = Precision.INT8
    activations = torch.float32
    kernel_name = "sfnode q8 x q8 (avx2)"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, library: Library) -> None:
        self.weight = weight.to(torch.int8).contiguous()
        self.scales = scales.to(torch.float32).contiguous()
        self.out_features, self.in_features = self.weight.shape
        if self.in_features % BLOCK:
            raise ValueError(f"the q8 kernel needs in_features divisible by {BLOCK}")
        self.library = library
        self._function = library.handle.sf_q8_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        status = self._function(
            x.data_ptr(),
            rows,
            self.in_features,
            self.weight.data_ptr(),
            self.scales.data_ptr(),
            self.out_features,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"the q8 kernel refused the problem (status {status})")
        return out

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scales": self.scales}


class F32Linear:
    """Float32 weights multiplied by :data:`SOURCE`'s kernel: float32 products summed in a fixed
    order per row (8 lanes along the row, then their sum), so a row's result does not depend on
    the rows beside it."""

    precision = Precision.FLOAT32
    activations = torch.float32
    kernel_name = "sfnode float32 (avx2)"

    def __init__(self, weight: torch.Tensor, library: Library) -> None:
        self.weight = weight.to(torch.float32).contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.library = library
        self._function = library.handle.sf_f32_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        self._function(
            x.data_ptr(),
            rows,
            self.in_features,
            self.weight.data_ptr(),
            self.out_features,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}


class _Matrix(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("N", ctypes.c_int32),
        ("w", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Matrix),
        ("o", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
    ]


def _matrix(layer: Any) -> _Matrix:
    if isinstance(layer, Q4Linear):
        return _Matrix(0, layer.in_features, layer.out_features, layer.blocks.data_ptr(), None)
    if isinstance(layer, Q8Linear):
        return _Matrix(
            1,
            layer.in_features,
            layer.out_features,
            layer.weight.data_ptr(),
            layer.scales.data_ptr(),
        )
    if isinstance(layer, F32Linear):
        return _Matrix(2, layer.in_features, layer.out_features, layer.weight.data_ptr(), None)
    raise TypeError(f"no fused kernel for {type(layer).__name__}")


def fusable(weights: Any) -> str | None:
    """None when every decoder layer of ``weights`` (a ``LlamaWeights``) can run through
    :class:`FusedLayers`, else why not."""
    if weights.activations != torch.float32:
        return f"activations are {str(weights.activations).removeprefix('torch.')}"
    if weights.head_dim > 1024 or weights.head_dim % 2:
        return f"head_dim {weights.head_dim} is not supported"
    for layer in weights.layers:
        for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not isinstance(projection.kernel, Q4Linear | Q8Linear | F32Linear):
                return f"a {projection.kernel.precision.value} matrix has no native kernel"
            if projection.bias is not None or projection.dense is not None:
                return "a projection has a bias or a dense copy"
    return None


class FusedLayers:
    """Each decoder layer's work outside attention as two calls into the native library:
    :meth:`pre` (input norm, query/key/value product, rotary embedding) and :meth:`post` (output
    product, residual, post-attention norm, gate/up product, SiLU gate, down product, residual).

    Rows are computed independently of each other, so it is batch-invariant like the kernels.
    The layers' tensors must outlive this object (it holds their addresses; ``weights`` keeps
    them).
    """

    def __init__(self, weights: Any, library: Library) -> None:
        reason = fusable(weights)
        if reason is not None:
            raise ValueError(reason)
        self._weights = weights
        self._norms: list[torch.Tensor] = []
        self._layers: list[_Layer] = []
        intermediate = weights.layers[0].gate_up.out_features // 2
        for layer in weights.layers:
            norms = (
                layer.input_norm.to(torch.float32).contiguous(),
                layer.post_norm.to(torch.float32).contiguous(),
            )
            self._norms.extend(norms)
            self._layers.append(
                _Layer(
                    int(weights.embed.shape[1]),
                    weights.heads,
                    weights.kv_heads,
                    weights.head_dim,
                    intermediate,
                    weights.eps,
                    norms[0].data_ptr(),
                    norms[1].data_ptr(),
                    _matrix(layer.qkv.kernel),
                    _matrix(layer.o.kernel),
                    _matrix(layer.gate_up.kernel),
                    _matrix(layer.down.kernel),
                )
            )
        self._addresses = [ctypes.addressof(layer) for layer in self._layers]
        self._width = weights.layers[0].qkv.out_features
        self._pre = library.handle.sf_layer_pre
        self._post = library.handle.sf_layer_post

    def pre(
        self,
        index: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """``[rows, (heads + 2 kv_heads) * head_dim]``: queries and keys turned, then values.
        ``cos`` and ``sin`` are the runner's whole tables, ``positions`` (int64) each row's."""
        rows = hidden.shape[0]
        out = torch.empty((rows, self._width), dtype=torch.float32)
        status = self._pre(
            self._addresses[index],
            hidden.data_ptr(),
            rows,
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"the fused layer refused the problem (status {status})")
        return out

    def post(self, index: int, hidden: torch.Tensor, attended: torch.Tensor) -> None:
        """The rest of layer ``index``, in place on ``hidden`` (contiguous float32)."""
        attended = attended.contiguous()
        status = self._post(
            self._addresses[index],
            hidden.data_ptr(),
            attended.data_ptr(),
            hidden.shape[0],
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"the fused layer refused the problem (status {status})")


__all__ = [
    "NEEDED_FLAGS",
    "F32Linear",
    "FusedLayers",
    "Library",
    "Q4Linear",
    "Q8Linear",
    "blocks_weight",
    "compiler",
    "cpu_flags",
    "fusable",
    "gguf_blocks",
    "load",
    "pack_blocks",
]
