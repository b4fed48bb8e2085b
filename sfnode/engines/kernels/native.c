/* sfnode's native kernels and decode step: C with AVX2, FMA and F16C intrinsics and OpenMP,
   compiled once at start by sfnode/engines/kernels/native.py (docs/engine.md sections 5.1 and 5.2).

   Products (y = x @ W^T, float32 in and out):
   - kind 0, 4-bit weights: GGUF Q4_1 blocks (32 weights, float16 d and m, w = d*q + m) laid
     out for the kernel in tiles of 8 output rows by one block (see sf_tile_q4); each activation
     row is quantized by itself to int16 per block of 32 (one scale a block), the products are
     integer multiply-adds (vpmaddwd) summed exactly in int32 per block, then scaled in float;
   - kind 1, int8 weights with one float32 scale per output row, the same int16 activations;
   - kind 2, float32 weights, float32 products summed in a fixed order per row;
   - kinds 3 to 8, blocks as a GGUF file stores them (Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1);
   - kinds 9 and 10, GGUF Q5_0 and Q8_0 blocks laid out in tiles of 8 output rows by one block
     (sf_tile_q5, sf_tile_q8), as kind 0's, with the same int16 activations and exact int32
     sums per block;
   - kinds 11 and 12, GGUF Q4_K and Q6_K super-blocks laid out in tiles of 8 output rows by one
     super-block of 256 inputs (sf_tile_q4k, sf_tile_q6k), likewise.
   Every row's result is computed by itself, in the same order of operations whatever else is in
   the call, so the products are batch-invariant (a row's result never depends on the others).

   The step (sf_forward, sf_logits): every layer of a Llama-family model over any set of rows
   (decoding lanes and prompt chunks alike) in one call: RMS norms, the products, the rotary
   embedding, the keys and values written into the lanes' KV slots, attention of each row over
   its own slot up to its position, the SiLU-gated MLP and the residual adds; then the final
   norm, the output head, and the best logits of each row computed again from the head's float
   rows.  Each row's attention reads its own slot, in a fixed order, so a position's keys and
   values do not depend on how its prompt was cut into steps or which rows share the step.
   One OpenMP parallel region a call; the threads split each product's output columns and each
   attention's (row, query head) items, and meet at barriers between the parts.

   This file must never keep state between calls, never allocate what it does not free before
   returning, and never read past the rows, slots and positions it is given. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define QK 32
#define TILE_BYTES 160 /* 8 float16 d, 8 float16 m, 128 bytes of nibbles */
#define Q5_TILE_BYTES 176 /* 8 float16 d, 32 bytes of fifth bits, 128 bytes of nibbles */
#define Q8_TILE_BYTES 272 /* 8 float16 d, 256 int8 weights */
#define QMAX 32767.0f
#define MAX_HEAD_DIM 256
#define PREFETCH_BYTES (TILE_BYTES * 16)
#define PREFETCH_FLOATS 1024

typedef struct {
    int32_t kind; /* 0: Q4_1 tiles; 1: int8 rows with a float32 scale each; 2: float32 rows;
                     as the file stores them, rows of: 3 Q8_0, 4 Q4_K, 5 Q5_K, 6 Q6_K,
                     7 Q5_0, 8 Q5_1 blocks; 9: Q5_0 tiles (sf_tile_q5); 10: Q8_0 tiles
                     (sf_tile_q8); 11: Q4_K tiles (sf_tile_q4k); 12: Q6_K tiles
                     (sf_tile_q6k) */
    int32_t K, N;
    const void *w;
    const float *scales;
} sf_part;

#define MAX_PARTS 3

/* A matrix whose rows are one or more parts stacked (a fused projection whose parts are held
   in different formats: query, key and value; gate and up). */
typedef struct {
    int32_t parts;
    int32_t K, N; /* N: the parts' rows together */
    sf_part part[MAX_PARTS];
} sf_matrix;

typedef struct {
    const float *input_norm, *post_norm;
    sf_matrix qkv, o, gate_up, down;
    /* the layer's rope: [window, rope_dims] tables (sin with rotate_half's sign folded in);
       the first rope_dims of each head turn, the rest pass through */
    const float *cos, *sin;
    int32_t rope_dims;
    int32_t window; /* keys a query reads, its own included (a sliding window); 0: all */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* NULL: none */
    const float *q_norm, *k_norm; /* RMS norms over each query and key head; NULL: none */
    /* norms of each half's output before its residual add (Gemma's); NULL: none */
    const float *attn_post_norm, *mlp_post_norm;
} sf_layer;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
    float eps, attention_scale;
    const sf_layer *layer;
    int32_t embed_type; /* the ggml type of the table's rows (0: float32 [vocab, hidden]) */
    const void *embed;
    const float *final_norm;
    sf_matrix head;
    int32_t refine_type; /* -1: none; else the ggml type of the head's float rows */
    const void *refine;
    float attn_softcap;  /* attention scores become cap * tanh(score / cap); 0: none */
    float final_softcap; /* logits likewise; 0: none */
    float embed_scale;   /* what an embedded row is multiplied by; 0: nothing */
    int32_t activation;  /* the gated MLP's: 0 SiLU, 1 GELU (tanh) */
    /* >= 0: the embedding's (the refine rows') rows are read with pread from this file, row 0
       at embed_at (refine_at), not through `embed` (`refine`): a read through the map maps
       the pages around the row with it, a pread leaves them in the page cache */
    int32_t embed_fd;
    int64_t embed_at;
    int32_t refine_fd;
    int64_t refine_at;
} sf_model;

typedef struct {
    int32_t half;     /* 1: float16 keys and values; 0: float32 */
    int32_t capacity; /* positions a slot holds */
    void *const *keys, *const *values; /* per layer: [slots, kv_heads, capacity, head_dim] */
} sf_kv;

/* ---------------------------------------------------------------------------------------- */
/* small helpers                                                                            */

static inline float hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
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

/* tanh of 8 floats, as 1 - 2 / (e^2x + 1) */
static inline __m256 tanh256(__m256 x) {
    const __m256 e = exp256(_mm256_add_ps(x, x));
    return _mm256_sub_ps(_mm256_set1_ps(1.0f),
                         _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
}

#define GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_K1 0.044715f

/* The gated MLP's activation of one row: act(gate) * up into o, SiLU or GELU (tanh). */
static void gated_row(const float *gate, const float *up, int I, int gelu, float *o) {
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= I; i += 8) {
        const __m256 a = _mm256_loadu_ps(gate + i);
        __m256 act;
        if (gelu) {
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(a, a), a);
            const __m256 inner = _mm256_mul_ps(
                _mm256_set1_ps(GELU_K0), _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(GELU_K1), cube)));
            act = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), a),
                                _mm256_add_ps(one, tanh256(inner)));
        } else {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
            act = _mm256_div_ps(a, _mm256_add_ps(one, e));
        }
        _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
    }
    for (; i < I; i++) {
        const float a = gate[i];
        const float act = gelu ? 0.5f * a * (1.0f + tanhf(GELU_K0 * (a + GELU_K1 * a * a * a)))
                               : a / (1.0f + expf(-a));
        o[i] = act * up[i];
    }
}

/* [lo, hi) of total items for part index of parts */
static inline void share(int total, int parts, int index, int *lo, int *hi) {
    const int base = total / parts, extra = total % parts;
    *lo = index * base + (index < extra ? index : extra);
    *hi = *lo + base + (index < extra ? 1 : 0);
}

/* ---------------------------------------------------------------------------------------- */
/* GGUF blocks, dequantized a block at a time                                               */
/* (sfnode/engines/kernels/blocks.py holds the layouts; the results are bit for bit ggml's   */
/* reference: the same float products and differences in the same order, never fused into   */
/* one rounding, hence fp-contract off for these functions)                                 */

#define QK_K 256
#if defined(__clang__)
#define SF_EXACT
#define SF_EXACT_BODY _Pragma("clang fp contract(off)")
#else
#define SF_EXACT __attribute__((optimize("fp-contract=off")))
#define SF_EXACT_BODY
#endif

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Scale j and min j (0..7) of a Q4_K/Q5_K super-block's 12 packed bytes. */
static inline void k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K (144 bytes): d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles. */
SF_EXACT static inline void dequantize_q4_k(const uint8_t *b, float *y) {
    SF_EXACT_BODY
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0; j < 8; j += 2, q += 32) {
        uint8_t sc, m;
        k_scale_min(j, scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        k_scale_min(j + 1, scales, &sc, &m);
        const float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
    }
}

/* Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits before the nibbles. */
SF_EXACT static inline void dequantize_q5_k(const uint8_t *b, float *y) {
    SF_EXACT_BODY
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < 8; j += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
        uint8_t sc, m;
        k_scale_min(j, scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        k_scale_min(j + 1, scales, &sc, &m);
        const float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++)
            *y++ = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++)
            *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
}

/* Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d. */
SF_EXACT static inline void dequantize_q6_k(const uint8_t *b, float *y) {
    SF_EXACT_BODY
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_at(b + 208);
    for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = (d * (float)sc[is + 0]) * (float)q1;
            y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
            y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
            y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
        }
    }
}

/* The float32 weights of `blocks` super-blocks of ggml type `kind` (12 Q4_K, 13 Q5_K,
   14 Q6_K) at `data`, QK_K a block, into `out`; 1 for a kind it does not know. */
int sf_dequantize(int kind, const uint8_t *data, int64_t blocks, float *out) {
    void (*one)(const uint8_t *, float *);
    size_t size;
    switch (kind) {
    case 12: one = dequantize_q4_k; size = 144; break;
    case 13: one = dequantize_q5_k; size = 176; break;
    case 14: one = dequantize_q6_k; size = 210; break;
    default: return 1;
    }
    for (int64_t i = 0; i < blocks; i++) one(data + (size_t)i * size, out + (size_t)i * QK_K);
    return 0;
}

/* Bytes of one row of K weights of ggml type `type` (0 for a type this file does not read). */
static size_t row_bytes(int type, int K) {
    switch (type) {
    case 0: return (size_t)K * 4;
    case 1: case 30: return (size_t)K * 2;
    case 2: return (size_t)K / QK * 18;
    case 3: return (size_t)K / QK * 20;
    case 6: return (size_t)K / QK * 22;
    case 7: return (size_t)K / QK * 24;
    case 8: return (size_t)K / QK * 34;
    case 12: return (size_t)K / QK_K * 144;
    case 13: return (size_t)K / QK_K * 176;
    case 14: return (size_t)K / QK_K * 210;
    default: return 0;
    }
}

/* The float32 weights of one row of K weights of ggml type `type` (F32, F16, Q4_0, Q4_1, Q5_0,
   Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16): what blocks.py's dequantize gives, bit for bit. */
SF_EXACT static void dequantize_row(int type, const uint8_t *row, int K, float *out) {
    SF_EXACT_BODY
    if (type == 0) { memcpy(out, row, sizeof(float) * K); return; }
    if (type == 1 || type == 30) {
        for (int k = 0; k < K; k++) {
            uint16_t h;
            memcpy(&h, row + 2 * k, 2);
            if (type == 1) { out[k] = _cvtsh_ss(h); continue; }
            const uint32_t bits = (uint32_t)h << 16;
            memcpy(out + k, &bits, 4);
        }
        return;
    }
    if (type >= 12) {
        void (*one)(const uint8_t *, float *) =
            type == 12 ? dequantize_q4_k : type == 13 ? dequantize_q5_k : dequantize_q6_k;
        const size_t size = row_bytes(type, QK_K);
        for (int b = 0; b < K / QK_K; b++) one(row + b * size, out + b * QK_K);
        return;
    }
    const size_t size = row_bytes(type, QK);
    for (int b = 0; b < K / QK; b++, out += QK) {
        const uint8_t *blk = row + b * size;
        const float d = half_at(blk);
        if (type == 8) {
            const __m256 dv = _mm256_set1_ps(d);
            for (int j = 0; j < QK; j += 8) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + j)));
                _mm256_storeu_ps(out + j, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(q)));
            }
        } else if (type == 2) {
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)((int)(blk[2 + j] & 0xF) - 8);
                out[j + 16] = d * (float)((int)(blk[2 + j] >> 4) - 8);
            }
        } else if (type == 6 || type == 7) {
            const int with_min = type == 7;
            const float m = with_min ? half_at(blk + 2) : 0.0f;
            uint32_t qh;
            memcpy(&qh, blk + 2 + 2 * with_min, 4);
            const uint8_t *qs = blk + 6 + 2 * with_min;
            for (int j = 0; j < QK; j++) {
                const int low = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
                const int q = low | (int)(((qh >> j) & 1) << 4);
                out[j] = with_min ? d * (float)q + m : d * (float)(q - 16);
            }
        } else {
            const float m = half_at(blk + 2);
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)(blk[4 + j] & 0xF) + m;
                out[j + 16] = d * (float)(blk[4 + j] >> 4) + m;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* activations                                                                              */

typedef struct {
    const float *f; /* float32 rows [M, K] */
    int16_t *q;     /* int16 rows [M, K] */
    float *d, *s;   /* per row and block: scale, scale * sum(q) */
    int K;
    int32_t *o;     /* per row and 16 inputs: -32 * sum(q), Q6_K's offset times them */
    int32_t avx2_only; /* 1: the tile loops' AVX2 form even where the CPU has AVX512-VNNI */
} acts;

/* One row in int16 per block of 32: q = round(x / d), d = amax / 32767; s = d * sum(q), what
   the weights' block minimum multiplies; o = -32 times the sum of each 16 q, what a Q6_K
   weight's offset of -32 multiplies (exact int32s).  Depends on the row alone. */
static void quantize_row(const float *x, int K, int16_t *qx, float *d, float *s, int32_t *o) {
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
        const __m256i s01 = _mm256_add_epi32(r[0], r[1]), s23 = _mm256_add_epi32(r[2], r[3]);
        /* lanes 0 and 1: the sums of inputs 0-15 and 16-31; one more hadd: the block's */
        __m128i s2 = _mm_hadd_epi32(
            _mm_add_epi32(_mm256_extracti128_si256(s01, 1), _mm256_castsi256_si128(s01)),
            _mm_add_epi32(_mm256_extracti128_si256(s23, 1), _mm256_castsi256_si128(s23)));
        s2 = _mm_hadd_epi32(s2, s2);
        o[2 * b] = -32 * _mm_cvtsi128_si32(s2);
        o[2 * b + 1] = -32 * _mm_extract_epi32(s2, 1);
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

static inline int quantized_part(const sf_part *p) { return p->kind != 2; }

/* whether a product by mat wants the activations quantized (any part is) */
static inline int quantized(const sf_matrix *mat) {
    for (int p = 0; p < mat->parts; p++)
        if (quantized_part(&mat->part[p])) return 1;
    return 0;
}

/* rows [m0, m1) of a */
static void quantize_rows(acts *a, int m0, int m1) {
    const int nb = a->K / QK;
    for (int m = m0; m < m1; m++)
        quantize_row(a->f + (size_t)m * a->K, a->K, a->q + (size_t)m * a->K, a->d + m * nb,
                     a->s + m * nb, a->o + (size_t)m * (a->K / 16));
}

/* out = x / sqrt(mean(x^2) + eps) * w, one row */
static void rmsnorm_row(const float *v, int H, const float *w, float eps, float *o) {
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
    for (i = 0; i + 8 <= H; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), sc),
                                              _mm256_loadu_ps(w + i)));
    for (; i < H; i++) o[i] = v[i] * scale * w[i];
}

/* ---------------------------------------------------------------------------------------- */
/* products                                                                                 */

/* Q4_1 tiles: for each group g of 8 output rows and each block b of 32 inputs, TILE_BYTES at
   (g * blocks + b) * TILE_BYTES: the 8 rows' float16 d, their 8 float16 m, then 4 quarters of
   32 bytes.  Read as 16 little-endian 16-bit lanes, lane j = 2r + k of quarter q holds in its
   nibble s (bits 4s to 4s + 3) row 8g + r's weight for input 2c + k of the block, c = 4q + s.
   So a shift and a mask give, for each pair c of inputs, the 8 rows' int16 weights in the
   order vpmaddwd multiplies them by the activation pair broadcast to all 8 (no lane-crossing
   conversion), summing each row's two products. */

#define BCAST_PAIR(p) _mm256_castps_si256(_mm256_broadcast_ss((const float *)(p)))

/* The R rows' 8 outputs of a tile column (cols of them real) into y, or added to it. */
static inline void tile_store(const int R, const __m256 *af, float *y, int ldy, int cols,
                              int accumulate) {
    for (int r = 0; r < R; r++) {
        float *out = y + (size_t)r * ldy;
        if (cols == 8 && !accumulate) {
            _mm256_storeu_ps(out, af[r]);
        } else if (cols == 8) {
            _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), af[r]));
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, af[r]);
            for (int j = 0; j < cols; j++) out[j] = accumulate ? out[j] + tmp[j] : tmp[j];
        }
    }
}

/* The tile loops come in two forms, the same int32 sums bit for bit: V = 0, AVX2's vpmaddwd
   and vpaddd; V = 1, where the CPU has AVX512-VNNI and AVX512-VL, vpdpwssd (the two fused,
   its activation pair broadcast from memory), in passes of up to 8 activation rows, and with
   two int32 sums a row where a pass has 4 rows or fewer (vpdpwssd's latency would otherwise
   hold a short pass).  The V = 1 form is compiled only into functions built for those
   extensions (tile_units_vnni) and run only where the CPU has them (product). */

/* acc plus the 8 rows' int32 sums of a pair of inputs: w, the 8 rows' int16 weight pairs,
   times the activation pair at xp. */
static inline __attribute__((always_inline)) __m256i dot_add(const int V, __m256i acc,
                                                             __m256i w, const int16_t *xp) {
    if (V) {
        __asm__("vpdpwssd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)xp));
        return acc;
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, BCAST_PAIR(xp)));
}

/* A quarter of a tile (4 pairs of inputs) times the activations xp[0..7]: the 8 rows' int32
   sums of its 8 products. */
static inline __attribute__((always_inline)) __m256i quarter_dot(__m256i w0, __m256i w1,
                                                                    __m256i w2, __m256i w3,
                                                                    const int16_t *xp) {
    const __m256i p01 = _mm256_add_epi32(_mm256_madd_epi16(w0, BCAST_PAIR(xp)),
                                         _mm256_madd_epi16(w1, BCAST_PAIR(xp + 2)));
    const __m256i p23 = _mm256_add_epi32(_mm256_madd_epi16(w2, BCAST_PAIR(xp + 4)),
                                         _mm256_madd_epi16(w3, BCAST_PAIR(xp + 6)));
    return _mm256_add_epi32(p01, p23);
}

/* A quarter's sums added to a row's int32 sums: *a (V = 0, or V = 1 with one sum a row), or
   *a and *b (V = 1 with two: the first and third pairs into *a, the others into *b). */
static inline __attribute__((always_inline)) void quarter_add(const int V, const int two,
                                                              __m256i *a, __m256i *b,
                                                              __m256i w0, __m256i w1,
                                                              __m256i w2, __m256i w3,
                                                              const int16_t *xp) {
    if (!V) {
        *a = _mm256_add_epi32(*a, quarter_dot(w0, w1, w2, w3, xp));
        return;
    }
    __m256i *odd = two ? b : a;
    *a = dot_add(1, *a, w0, xp);
    *odd = dot_add(1, *odd, w1, xp + 2);
    *a = dot_add(1, *a, w2, xp + 4);
    *odd = dot_add(1, *odd, w3, xp + 6);
}

/* Whether V's loops keep two int32 sums a row in a pass of R rows. */
#define TWO_SUMS(V, R) ((V) && (R) <= 4)

/* The 8 rows' int32 sums of 128 bytes of nibbles laid out as a Q4_1 tile's 4 quarters times
   the 32 activations at qx + offset of each of R rows (rows K apart), into ai[0..R-1]. */
static inline __attribute__((always_inline)) void nibble_sums(const int V, const int R,
                                                              const uint8_t *nibbles,
                                                              const int16_t *qx, int K,
                                                              int offset, __m256i *ai) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    const int two = TWO_SUMS(V, R);
    __m256i bi[4];
    for (int r = 0; r < R; r++) ai[r] = _mm256_setzero_si256();
    if (two)
        for (int r = 0; r < R; r++) bi[r] = _mm256_setzero_si256();
    for (int q = 0; q < 4; q++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(nibbles + 32 * q));
        const __m256i w0 = _mm256_and_si256(v, low);
        const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(v, 8), low);
        const __m256i w3 = _mm256_srli_epi16(v, 12);
        for (int r = 0; r < R; r++)
            quarter_add(V, two, &ai[r], &bi[r & 3], w0, w1, w2, w3,
                        qx + (size_t)r * K + offset + 8 * q);
    }
    if (two)
        for (int r = 0; r < R; r++) ai[r] = _mm256_add_epi32(ai[r], bi[r]);
}

/* R activation rows (R <= 4; V = 1: R <= 8) against one tile column (8 output rows); each
   row's int32 sum per block is exact, and its float steps are the same whatever R and V are. */
static inline __attribute__((always_inline)) void q4_tile_rows(
    const int V, const int R, const uint8_t *w, int nb, const int16_t *qx, const float *dx,
    const float *sx, int K, float *y, int ldy, int cols, int accumulate) {
    __m256 af[8];
    for (int r = 0; r < R; r++) af[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = w + (size_t)b * TILE_BYTES;
        _mm_prefetch((const char *)(t + PREFETCH_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char *)(t + PREFETCH_BYTES + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(t + PREFETCH_BYTES + 128), _MM_HINT_T0);
        __m256i ai[8];
        nibble_sums(V, R, t + 32, qx, K, b * QK, ai);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16)));
        for (int r = 0; r < R; r++) {
            af[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r]),
                                    _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * nb + b])), af[r]);
            af[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[r * nb + b]), af[r]);
        }
    }
    tile_store(R, af, y, ldy, cols, accumulate);
}

/* Q5_0 tiles: for each group g of 8 output rows and each block b of 32 inputs, Q5_TILE_BYTES
   at (g * blocks + b) * Q5_TILE_BYTES: the 8 rows' float16 d, 32 bytes of fifth bits, then the
   nibbles laid out as a Q4_1 tile's 4 quarters.  The fifth bits are read as 16 little-endian
   16-bit lanes: bit c of lane j = 2r + k is the complement of row 8g + r's fifth bit for input
   2c + k, so that the int16 weight q - 16 of a pair is its nibble minus that bit times 16 (a
   shift, a mask and a subtraction, no widening). */

/* One pair of inputs' int16 weights q - 16 of a Q5_0 tile quarter: nibble s of v less the
   complemented fifth bit, bit 4q + s of h, times 16 (one shift of h: by an immediate, since a
   shift by a register count costs more). */
static inline __attribute__((always_inline)) __m256i q5_pair(__m256i v, __m256i h, int q, int s) {
    const __m256i low = _mm256_set1_epi16(0x0F), fifth = _mm256_set1_epi16(0x10);
    const __m256i n = s == 0   ? _mm256_and_si256(v, low)
                      : s == 3 ? _mm256_srli_epi16(v, 12)
                               : _mm256_and_si256(_mm256_srli_epi16(v, 4 * s), low);
    const int left = 4 - s - 4 * q;
    const __m256i hs = left > 0   ? _mm256_slli_epi16(h, left)
                       : left < 0 ? _mm256_srli_epi16(h, -left)
                                  : h;
    return _mm256_sub_epi16(n, _mm256_and_si256(hs, fifth));
}

/* R activation rows (R <= 8) against one Q5_0 tile column (8 output rows): each pair's weights
   are taken out once for the R rows; each row's int32 sum per block is exact, scaled by the
   row's d times the activations' block scale; its float steps are the same whatever R is. */
static inline __attribute__((always_inline)) void q5_tile_rows(
    const int V, const int R, const uint8_t *w, int nb, const int16_t *qx, const float *dx, int K,
    float *y, int ldy, int cols, int accumulate) {
    const int two = TWO_SUMS(V, R);
    __m256 af[8];
    for (int r = 0; r < R; r++) af[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = w + (size_t)b * Q5_TILE_BYTES;
        _mm_prefetch((const char *)(t + 16 * Q5_TILE_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char *)(t + 16 * Q5_TILE_BYTES + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(t + 16 * Q5_TILE_BYTES + 128), _MM_HINT_T0);
        const __m256i h = _mm256_loadu_si256((const __m256i *)(t + 16));
        const int16_t *xb = qx + b * QK;
        __m256i ai[8];
        for (int r = 0; r < (two ? 2 * R : R); r++) ai[r] = _mm256_setzero_si256();
        for (int q = 0; q < 4; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(t + 48 + 32 * q));
            for (int s = 0; s < 4; s++) {
                const __m256i wp = q5_pair(v, h, q, s);
                /* with two sums a row, the odd pairs' go to ai[R + r] */
                const int set = two && (s & 1) ? R : 0;
                for (int r = 0; r < R; r++)
                    ai[set + r] =
                        dot_add(V, ai[set + r], wp, xb + (size_t)r * K + 8 * q + 2 * s);
            }
        }
        if (two)
            for (int r = 0; r < R; r++) ai[r] = _mm256_add_epi32(ai[r], ai[R + r]);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        for (int r = 0; r < R; r++)
            af[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r]),
                                    _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * nb + b])), af[r]);
    }
    tile_store(R, af, y, ldy, cols, accumulate);
}

/* Q8_0 tiles: for each group g of 8 output rows and each block b of 32 inputs, Q8_TILE_BYTES
   at (g * blocks + b) * Q8_TILE_BYTES: the 8 rows' float16 d, then 8 chunks of 32 bytes.  Read
   as 16 little-endian 16-bit lanes, lane j = 2r + k of chunk h holds in its low byte row
   8g + r's int8 weight for input 4h + k and in its high byte the one for input 4h + 2 + k, so
   two arithmetic shifts give two pairs' int16 weights in vpmaddwd's order. */

/* R activation rows (R <= 4; V = 1: R <= 8) against one Q8_0 tile column, as q5_tile_rows. */
static inline __attribute__((always_inline)) void q8_tile_rows(
    const int V, const int R, const uint8_t *w, int nb, const int16_t *qx, const float *dx, int K,
    float *y, int ldy, int cols, int accumulate) {
    const int two = TWO_SUMS(V, R);
    __m256 af[8];
    for (int r = 0; r < R; r++) af[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = w + (size_t)b * Q8_TILE_BYTES;
        for (int p = 0; p < Q8_TILE_BYTES; p += 64)
            _mm_prefetch((const char *)(t + 12 * Q8_TILE_BYTES + p), _MM_HINT_T0);
        __m256i ai[8];
        for (int r = 0; r < (two ? 2 * R : R); r++) ai[r] = _mm256_setzero_si256();
        for (int h = 0; h < 8; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(t + 16 + 32 * h));
            const __m256i wa = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
            const __m256i wb = _mm256_srai_epi16(v, 8);
            for (int r = 0; r < R; r++) {
                const int16_t *xp = qx + (size_t)r * K + b * QK + 4 * h;
                if (!V) {
                    ai[r] = _mm256_add_epi32(
                        ai[r], _mm256_add_epi32(_mm256_madd_epi16(wa, BCAST_PAIR(xp)),
                                                _mm256_madd_epi16(wb, BCAST_PAIR(xp + 2))));
                } else {
                    ai[r] = dot_add(1, ai[r], wa, xp);
                    ai[two ? R + r : r] = dot_add(1, ai[two ? R + r : r], wb, xp + 2);
                }
            }
        }
        if (two)
            for (int r = 0; r < R; r++) ai[r] = _mm256_add_epi32(ai[r], ai[R + r]);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        for (int r = 0; r < R; r++)
            af[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r]),
                                    _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * nb + b])), af[r]);
    }
    tile_store(R, af, y, ldy, cols, accumulate);
}

/* Q4_K tiles: for each group g of 8 output rows and each super-block s of 256 inputs,
   Q4K_TILE_BYTES at (g * super-blocks + s) * Q4K_TILE_BYTES (the bytes of its 8 blocks): the
   8 rows' float16 d, their 8 float16 dmin, 96 bytes of the 6-bit scales and minimums, then
   sub-block j's nibbles at 128 + 128j, laid out as a Q4_1 tile's 4 quarters.  Scale and
   minimum i = 8j + r (sub-block j of 32 inputs, row r): their low 4 bits in nibble i / 32 of
   bytes 32 + i % 32 and 64 + i % 32, their high 2 bits at bits 2 (i / 32) and 4 + 2 (i / 32)
   of byte 96 + i % 32.  Row r's weight is d*sc*q - dmin*m, as the file's block means it. */
#define Q4K_TILE_BYTES 1152
/* Q6_K tiles: the 8 rows' float16 d, the int8 scale of inputs 16i..16i+15 of row r at byte
   16 + 8i + r, then for sub-block j (32 inputs) at 144 + 192j: its low nibbles laid out as a
   Q4_1 tile's 4 quarters, then 2 x 32 bytes of high bit pairs: read as 16-bit lanes, bits
   2(c % 8) and 2(c % 8) + 1 of lane 2r + k of the (c / 8)th hold row r's two high bits of input
   2c + k.  Row r's weight is d*scale*(q - 32). */
#define Q6K_TILE_BYTES 1680
#define K_PREFETCH 2048

/* A Q4_K tile's 64 scales (byte 8j + r) and 64 minimums (64 + 8j + r) as bytes. */
static inline void q4k_scales(const uint8_t *t, uint8_t *out) {
    const __m256i four = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    const __m256i sc = _mm256_loadu_si256((const __m256i *)(t + 32));
    const __m256i m = _mm256_loadu_si256((const __m256i *)(t + 64));
    const __m256i high = _mm256_loadu_si256((const __m256i *)(t + 96));
    const __m256i lows[4] = {sc, _mm256_srli_epi16(sc, 4), m, _mm256_srli_epi16(m, 4)};
    for (int i = 0; i < 4; i++) {
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(high, 2 * i), two);
        _mm256_storeu_si256((__m256i *)(out + 32 * i),
                            _mm256_or_si256(_mm256_and_si256(lows[i], four),
                                            _mm256_slli_epi16(top, 4)));
    }
}

/* The 8 rows' float scales d * sc of 8 bytes of unsigned (or signed) 8-bit scales. */
static inline __m256 tile_scales(__m256 d, const uint8_t *bytes, int is_signed) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)bytes);
    const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(wide));
}

/* R activation rows (R <= 4; V = 1: R <= 8) against one Q4_K tile column (8 output rows):
   each row's int32 sum per sub-block is exact, scaled by the row's d * sc times the
   activations' block scale, less d_min * m times the activations' s; its float steps are the
   same whatever R and V are. */
static inline __attribute__((always_inline)) void q4k_tile_rows(
    const int V, const int R, const uint8_t *w, int nsb, const int16_t *qx, const float *dx,
    const float *sx, int K, float *y, int ldy, int cols, int accumulate) {
    const int nb = K / QK;
    __m256 af[8];
    for (int r = 0; r < R; r++) af[r] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *t = w + (size_t)sb * Q4K_TILE_BYTES;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16)));
        uint8_t scales[128];
        q4k_scales(t, scales);
        for (int j = 0; j < 8; j++) {
            const uint8_t *nibbles = t + 128 + 128 * j;
            _mm_prefetch((const char *)(nibbles + K_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(nibbles + K_PREFETCH + 64), _MM_HINT_T0);
            const int b = sb * 8 + j;
            __m256i ai[8];
            nibble_sums(V, R, nibbles, qx, K, b * QK, ai);
            const __m256 ds = tile_scales(d, scales + 8 * j, 0);
            const __m256 dm = tile_scales(dmin, scales + 64 + 8 * j, 0);
            for (int r = 0; r < R; r++) {
                af[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r]),
                                        _mm256_mul_ps(ds, _mm256_set1_ps(dx[r * nb + b])), af[r]);
                af[r] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(sx[r * nb + b]), af[r]);
            }
        }
    }
    tile_store(R, af, y, ldy, cols, accumulate);
}

/* R activation rows (R <= 4; V = 1: R <= 8) against one Q6_K tile column (8 output rows):
   each row's int32 sum per 16 inputs is exact, scaled by the row's d * scale times the
   activations' block scale; its float steps are the same whatever R and V are.  The weights are taken out as q (0..63)
   and each sum starts at the activations' -32 * sum(q) of those 16 inputs (ox, made when they
   were quantized): the same int32 as the sum of x * (q - 32), one subtraction less a pair. */
static inline __attribute__((always_inline)) void q6k_tile_rows(
    const int V, const int R, const uint8_t *w, int nsb, const int16_t *qx, const float *dx,
    const int32_t *ox, int K, float *y, int ldy, int cols, int accumulate) {
    const int nb = K / QK;
    const int two = TWO_SUMS(V, R);
    __m256 af[8];
    for (int r = 0; r < R; r++) af[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi16(0x0F), top = _mm256_set1_epi16(0x30);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *t = w + (size_t)sb * Q6K_TILE_BYTES;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        for (int j = 0; j < 8; j++) {
            const uint8_t *p = t + 144 + 192 * j;
            _mm_prefetch((const char *)(p + K_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + K_PREFETCH + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + K_PREFETCH + 128), _MM_HINT_T0);
            const int b = sb * 8 + j;
            /* unrolled: 5% faster at 8 rows (measured, gcc 12) */
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
                /* each sum starts at the offset's share, -32 * sum(q): the weights stay 0..63 */
                __m256i ai[8], bi[4];
                for (int r = 0; r < R; r++)
                    ai[r] = _mm256_set1_epi32(ox[(size_t)r * (K / 16) + 2 * b + half]);
                if (two)
                    for (int r = 0; r < R; r++) bi[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int qq = 0; qq < 2; qq++) {
                    const int q = 2 * half + qq;
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * q));
                    const __m256i hq = qq ? _mm256_srli_epi16(h, 8) : h;
                    const __m256i w0 = _mm256_or_si256(
                        _mm256_and_si256(v, low),
                        _mm256_and_si256(_mm256_slli_epi16(hq, 4), top));
                    const __m256i w1 = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                        _mm256_and_si256(_mm256_slli_epi16(hq, 2), top));
                    const __m256i w2 = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(v, 8), low),
                        _mm256_and_si256(hq, top));
                    const __m256i w3 = _mm256_or_si256(
                        _mm256_srli_epi16(v, 12),
                        _mm256_and_si256(_mm256_srli_epi16(hq, 2), top));
                    for (int r = 0; r < R; r++)
                        quarter_add(V, two, &ai[r], &bi[r & 3], w0, w1, w2, w3,
                                    qx + (size_t)r * K + b * QK + 8 * q);
                }
                if (two)
                    for (int r = 0; r < R; r++) ai[r] = _mm256_add_epi32(ai[r], bi[r]);
                const __m256 s = tile_scales(d, t + 16 + 8 * (2 * j + half), 1);
                for (int r = 0; r < R; r++)
                    af[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r]),
                                            _mm256_mul_ps(s, _mm256_set1_ps(dx[r * nb + b])),
                                            af[r]);
            }
        }
    }
    tile_store(R, af, y, ldy, cols, accumulate);
}

#define ROW_TILES(CALL) ROW_TILES_FROM(0, CALL)
#define ROW_TILES_FROM(M0, CALL)                                                           \
    do {                                                                                   \
        int m = (M0);                                                                      \
        for (; m + 4 <= M; m += 4) CALL(4);                                                \
        switch (M - m) {                                                                   \
        case 3: CALL(3); break;                                                            \
        case 2: CALL(2); break;                                                            \
        case 1: CALL(1); break;                                                            \
        default: break;                                                                    \
        }                                                                                  \
    } while (0)

/* R activation rows against one int8 weight row (one scale): each row's sum in the same order
   whatever R is. */
static inline __attribute__((always_inline)) void q8_rows(
    const int R, const int8_t *w, int nb, float scale, const int16_t *qx, const float *dx, int K,
    float *out, int stride, int accumulate) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + b * QK)));
        const __m256i hi =
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + b * QK + 16)));
        for (int r = 0; r < R; r++) {
            const int16_t *xq = qx + (size_t)r * K + b * QK;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xq);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 16));
            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, x0),
                                               _mm256_madd_epi16(hi, x1));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx[r * nb + b]), _mm256_cvtepi32_ps(p),
                                     acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        const float v = hsum(acc[r]) * scale;
        out[(size_t)r * stride] = accumulate ? out[(size_t)r * stride] + v : v;
    }
}

/* R float32 rows against one float32 weight row: 8 lanes along the row, then their sum, then
   the tail; the same order whatever R is. */
static inline __attribute__((always_inline)) void f32_rows(
    const int R, const float *w, int K, const float *x, float *out, int stride, int accumulate) {
    __m256 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        if (!(k & 15)) _mm_prefetch((const char *)(w + k + PREFETCH_FLOATS), _MM_HINT_T0);
        const __m256 wv = _mm256_loadu_ps(w + k);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)r * K + k), acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float sum = hsum(acc[r]);
        for (int j = k; j < K; j++) sum += w[j] * x[(size_t)r * K + j];
        out[(size_t)r * stride] = accumulate ? out[(size_t)r * stride] + sum : sum;
    }
}

/* Two weight rows at once (each activation load serves both); every sum is formed exactly as
   f32_rows forms it. */
static inline __attribute__((always_inline)) void f32_rows2(
    const int R, const float *w, int K, const float *x, float *out, int stride, int accumulate) {
    __m256 a0[4], a1[4];
    for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    const float *w1 = w + K;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        if (!(k & 15)) {
            _mm_prefetch((const char *)(w + k + PREFETCH_FLOATS), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + k + PREFETCH_FLOATS), _MM_HINT_T0);
        }
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
        float *o = out + (size_t)r * stride;
        o[0] = accumulate ? o[0] + s0 : s0;
        o[1] = accumulate ? o[1] + s1 : s1;
    }
}

/* Blocks as the file stores them, multiplied without inflating them: each block of 32
   weights (a Q8_0 block, a K-quant sub-block) against the int16 activations of the same 32
   inputs gives an exact int32 sum, scaled in float by the block's scale and the activations'
   block scale; a K-quant block's minimum multiplies the activations' s = d * sum(q).  R
   activation rows (R <= 8) against one weight row, each row's steps the same whatever R is
   (explicit fused multiply-adds, so no compiler choice differs between the R variants). */

#define LOAD16(p) _mm256_loadu_si256((const __m256i *)(p))

/* 32 int16 weights in two halves times 32 int16 activations: 8 int32 partial sums */
static inline __m256i dot32(__m256i w0, __m256i w1, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, LOAD16(x)), _mm256_madd_epi16(w1, LOAD16(x + 16)));
}

static inline void store_rows(const int R, const __m256 *acc, const float *minus, float *out,
                              int stride, int accumulate) {
    for (int r = 0; r < R; r++) {
        const float v = hsum(acc[r]) - minus[r];
        out[(size_t)r * stride] = accumulate ? out[(size_t)r * stride] + v : v;
    }
}

/* Q8_0 (34 bytes: float16 d, 32 int8 q) */
static inline __attribute__((always_inline)) void q8b_rows(
    const int R, const uint8_t *w, int nb, const int16_t *qx, const float *dx, int K, float *out,
    int stride, int accumulate) {
    __m256 acc[8];
    float minus[8] = {0.0f};
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * 34;
        const float d = half_at(blk);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        for (int r = 0; r < R; r++) {
            const __m256i p = dot32(w0, w1, qx + (size_t)r * K + b * QK);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r * nb + b]), _mm256_cvtepi32_ps(p),
                                     acc[r]);
        }
    }
    store_rows(R, acc, minus, out, stride, accumulate);
}

/* The 32 weights' q of a Q5_0/Q5_1 block (0..31): nibbles of qs (low ones first), the fifth
   bit of weight j bit j of qh. */
static inline __m256i five_bits(const uint8_t *qh, const uint8_t *qs) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i set = _mm256_cmpeq_epi8(
        _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i nibbles = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

/* Q5_0 (22 bytes: float16 d, qh, 16 bytes of nibbles; w = d*(q - 16)) and Q5_1 (24 bytes:
   float16 d and m, qh, nibbles; w = d*q + m, the min multiplying the activations' s). */
static inline __attribute__((always_inline)) void q5_rows(
    const int R, const int with_min, const uint8_t *w, int nb, const int16_t *qx,
    const float *dx, const float *sx, int K, float *out, int stride, int accumulate) {
    const size_t size = with_min ? 24 : 22;
    __m256 acc[8];
    float minus[8] = {0.0f};
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * size;
        const float d = half_at(blk), m = with_min ? -half_at(blk + 2) : 0.0f;
        __m256i q = five_bits(blk + 2 + 2 * with_min, blk + 6 + 2 * with_min);
        if (!with_min) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        const __m256i w0 = with_min ? _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q))
                                    : _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        const __m256i w1 = with_min ? _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1))
                                    : _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
        for (int r = 0; r < R; r++) {
            const __m256i p = dot32(w0, w1, qx + (size_t)r * K + b * QK);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r * nb + b]), _mm256_cvtepi32_ps(p),
                                     acc[r]);
            if (with_min) minus[r] = fmaf(m, sx[r * nb + b], minus[r]);
        }
    }
    store_rows(R, acc, minus, out, stride, accumulate);
}

/* The eight scales and mins of a Q4_K/Q5_K super-block, times its d and dmin. */
static inline void k_scales(const uint8_t *blk, float *ds, float *dm) {
    const float d = half_at(blk), dmin = half_at(blk + 2);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        k_scale_min(j, blk + 4, &sc, &m);
        ds[j] = d * (float)sc;
        dm[j] = dmin * (float)m;
    }
}

/* Q4_K (144 bytes) and Q5_K (176 bytes, five_bits): sub-block j of 32 weights is
   d*sc[j]*q - dmin*m[j]; bytes 32c..32c+31 of the nibbles hold sub-blocks 2c (low nibbles)
   and 2c + 1 (high ones), and Q5_K's fifth bit of weight l of sub-block j is bit j of qh[l]. */
static inline __attribute__((always_inline)) void qk_rows(
    const int R, const int five_bits, const uint8_t *w, int nsb, const int16_t *qx,
    const float *dx, const float *sx, int K, float *out, int stride, int accumulate) {
    const int nb = K / QK;
    const size_t size = five_bits ? 176 : 144;
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[8];
    float minus[8] = {0.0f};
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = w + (size_t)sb * size;
        const uint8_t *qs = blk + (five_bits ? 48 : 16);
        float ds[8], dm[8];
        k_scales(blk, ds, dm);
        const __m256i qh = five_bits ? LOAD16(blk + 16) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = LOAD16(qs + 32 * c);
            __m256i lo = _mm256_and_si256(v, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (five_bits) {
                const __m256i b0 = _mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), one);
                const __m256i b1 = _mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c + 1)), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
            }
            const __m256i l0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
            const __m256i l1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
            const __m256i h0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
            const __m256i h1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
            const int b = sb * 8 + 2 * c;
            for (int r = 0; r < R; r++) {
                const int16_t *x = qx + (size_t)r * K + (size_t)b * QK;
                const float *d = dx + r * nb + b, *sm = sx + r * nb + b;
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * c] * d[0]),
                                         _mm256_cvtepi32_ps(dot32(l0, l1, x)), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * c + 1] * d[1]),
                                         _mm256_cvtepi32_ps(dot32(h0, h1, x + QK)), acc[r]);
                minus[r] = fmaf(dm[2 * c], sm[0], minus[r]);
                minus[r] = fmaf(dm[2 * c + 1], sm[1], minus[r]);
            }
        }
    }
    store_rows(R, acc, minus, out, stride, accumulate);
}

/* Q6_K (210 bytes: 128 of low nibbles, 64 of high bit pairs, 16 int8 scales, float16 d):
   each half of 128 weights is four groups of 32 (low nibbles of ql[0..31], of ql[32..63],
   high nibbles of ql[0..31], of ql[32..63]; their high bits the pairs 0, 2, 4, 6 of qh), each
   group's 16 and 16 weights with a scale of their own: w = d*scale*(q - 32). */
static inline __attribute__((always_inline)) void q6k_rows(
    const int R, const uint8_t *w, int nsb, const int16_t *qx, const float *dx, int K,
    float *out, int stride, int accumulate) {
    const int nb = K / QK;
    const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    const __m256i offset = _mm256_set1_epi8(32);
    __m256 acc[8];
    float minus[8] = {0.0f};
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = w + (size_t)sb * 210;
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d = half_at(blk + 208);
        for (int half = 0; half < 2; half++) {
            const __m256i ql0 = LOAD16(blk + 64 * half), ql1 = LOAD16(blk + 64 * half + 32);
            const __m256i qh = LOAD16(blk + 128 + 32 * half);
            for (int g = 0; g < 4; g++) {
                const __m256i src = g % 2 ? ql1 : ql0;
                const __m256i nib = _mm256_and_si256(g < 2 ? src : _mm256_srli_epi16(src, 4), low);
                const __m256i high = _mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), three);
                const __m256i q = _mm256_sub_epi8(
                    _mm256_or_si256(nib, _mm256_slli_epi16(high, 4)), offset);
                const __m256i q0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
                const __m256i q1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
                const float s0 = d * (float)scales[8 * half + 2 * g];
                const float s1 = d * (float)scales[8 * half + 2 * g + 1];
                const int b = sb * 8 + half * 4 + g;
                for (int r = 0; r < R; r++) {
                    const int16_t *x = qx + (size_t)r * K + (size_t)b * QK;
                    const float xd = dx[r * nb + b];
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * xd),
                        _mm256_cvtepi32_ps(_mm256_madd_epi16(q0, LOAD16(x))), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s1 * xd),
                        _mm256_cvtepi32_ps(_mm256_madd_epi16(q1, LOAD16(x + 16))), acc[r]);
                }
            }
        }
    }
    store_rows(R, acc, minus, out, stride, accumulate);
}

/* The work units a product splits between threads: tiles of 8 output rows (kinds 0, 9-12),
   output rows (the others). */
static inline int units(const sf_part *mat) {
    return mat->kind == 0 || mat->kind >= 9 ? (mat->N + 7) / 8 : mat->N;
}

/* Bytes of one tile of a part laid out in tiles (kinds 9 to 12), and the inputs it covers. */
static inline size_t tile_bytes(const sf_part *mat, int *inputs) {
    *inputs = mat->kind <= 10 ? QK : QK_K;
    switch (mat->kind) {
    case 9: return Q5_TILE_BYTES;
    case 10: return Q8_TILE_BYTES;
    case 11: return Q4K_TILE_BYTES;
    default: return Q6K_TILE_BYTES;
    }
}

/* Bytes of one weight row of a part stored as the file stores it (kinds 3 to 8). */
static inline size_t stored_row_bytes(const sf_part *mat) {
    static const int types[] = {8, 12, 13, 14, 6, 7};
    return row_bytes(types[mat->kind - 3], mat->K);
}

/* y[m, n] (+)= x[m] . W[n] for the rows of units [u0, u1) of a part stored as the file stores
   it; y's rows are ldy apart. */
static void stored_units(const sf_part *mat, const acts *a, int M, float *y, int ldy,
                         int accumulate, int u0, int u1) {
    const int K = mat->K, nb = K / QK, nsb = K / 256;
    const size_t bytes = stored_row_bytes(mat);
    for (int n = u0; n < u1; n++) {
        const uint8_t *wr = (const uint8_t *)mat->w + (size_t)n * bytes;
#define STORED_CALL(RR)                                                                        \
    do {                                                                                       \
        const int16_t *xq = a->q + (size_t)m * K;                                              \
        const float *xd = a->d + m * nb, *xs = a->s + m * nb;                                  \
        float *yo = y + (size_t)m * ldy + n;                                                   \
        if (mat->kind == 3) q8b_rows(RR, wr, nb, xq, xd, K, yo, ldy, accumulate);              \
        else if (mat->kind == 6) q6k_rows(RR, wr, nsb, xq, xd, K, yo, ldy, accumulate);        \
        else if (mat->kind >= 7) q5_rows(RR, mat->kind == 8, wr, nb, xq, xd, xs, K, yo, ldy,   \
                                         accumulate);                                          \
        else qk_rows(RR, mat->kind == 5, wr, nsb, xq, xd, xs, K, yo, ldy, accumulate);         \
    } while (0)
        /* 8 rows a pass: each weight row unpacked once for 8 activation rows */
        const int M8 = M - M % 8;
        for (int m = 0; m < M8; m += 8) STORED_CALL(8);
        ROW_TILES_FROM(M8, STORED_CALL);
#undef STORED_CALL
    }
}

/* y[m, n] (+)= x[m] . W[n] for the output rows of tiles [u0, u1) of a part laid out in tiles
   (kinds 0, 9 to 12), in V's form (see dot_add); y's rows are ldy apart. */
static inline __attribute__((always_inline)) void tile_units(const int V, const sf_part *mat,
                                                            const acts *a, int M, float *y,
                                                            int ldy, int accumulate, int u0,
                                                            int u1) {
    const int K = mat->K, N = mat->N, nb = K / QK;
    const uint8_t *w = (const uint8_t *)mat->w;
    int inputs = QK;
    const size_t tile = mat->kind == 0 ? TILE_BYTES : tile_bytes(mat, &inputs);
    const int tiles = K / inputs;
    for (int g = u0; g < u1; g++) {
        const uint8_t *wg = w + (size_t)g * tiles * tile;
        const int cols = N - 8 * g < 8 ? N - 8 * g : 8;
#define TILE_CALL(RR)                                                                          \
    do {                                                                                       \
        const int16_t *xq = a->q + (size_t)m * K;                                              \
        const float *xd = a->d + m * nb, *xs = a->s + m * nb;                                  \
        float *yo = y + (size_t)m * ldy + 8 * g;                                               \
        if (mat->kind == 0) q4_tile_rows(V, RR, wg, nb, xq, xd, xs, K, yo, ldy, cols,          \
                                         accumulate);                                          \
        else if (mat->kind == 9) q5_tile_rows(V, RR, wg, nb, xq, xd, K, yo, ldy, cols,         \
                                              accumulate);                                     \
        else if (mat->kind == 10) q8_tile_rows(V, RR, wg, nb, xq, xd, K, yo, ldy, cols,        \
                                               accumulate);                                    \
        else if (mat->kind == 11) q4k_tile_rows(V, RR, wg, tiles, xq, xd, xs, K, yo, ldy,      \
                                                cols, accumulate);                             \
        else q6k_tile_rows(V, RR, wg, tiles, xq, xd, a->o + (size_t)m * (K / 16), K, yo, ldy, \
                           cols, accumulate);                                                  \
    } while (0)
        /* 8 rows a pass where the pairs' weights are worth taking out once for 8 (Q5_0's cost
           3 instructions; with vpdpwssd every kind's), then 4 and fewer */
        int m8 = 0;
        if (V || mat->kind == 9)
            for (; m8 + 8 <= M; m8 += 8) {
                const int m = m8;
                TILE_CALL(8);
            }
        ROW_TILES_FROM(m8, TILE_CALL);
#undef TILE_CALL
    }
}

static void tile_units_avx2(const sf_part *mat, const acts *a, int M, float *y, int ldy,
                            int accumulate, int u0, int u1) {
    tile_units(0, mat, a, M, y, ldy, accumulate, u0, u1);
}

__attribute__((target("avx512f,avx512vl,avx512vnni"))) static void tile_units_vnni(
    const sf_part *mat, const acts *a, int M, float *y, int ldy, int accumulate, int u0, int u1) {
    tile_units(1, mat, a, M, y, ldy, accumulate, u0, u1);
}

/* Whether the CPU runs vpdpwssd on 256-bit vectors (AVX512-VNNI with AVX512-VL). */
static inline int cpu_has_vnni(void) {
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
}

/* y[m, n] (+)= x[m] . W[n] for the output rows of units [u0, u1); y's rows are ldy apart. */
static void product_units(const sf_part *mat, const acts *a, int M, float *y, int ldy,
                          int accumulate, int u0, int u1) {
    const int K = mat->K, nb = K / QK;
    if (mat->kind == 0 || mat->kind >= 9) {
        if (!a->avx2_only && cpu_has_vnni())
            tile_units_vnni(mat, a, M, y, ldy, accumulate, u0, u1);
        else
            tile_units_avx2(mat, a, M, y, ldy, accumulate, u0, u1);
    } else if (mat->kind >= 3) {
        stored_units(mat, a, M, y, ldy, accumulate, u0, u1);
    } else if (mat->kind == 1) {
        const int8_t *w = (const int8_t *)mat->w;
        for (int n = u0; n < u1; n++) {
            const int8_t *wr = w + (size_t)n * K;
#define Q8_CALL(RR)                                                                            \
    q8_rows(RR, wr, nb, mat->scales[n], a->q + (size_t)m * K, a->d + m * nb, K,                \
            y + (size_t)m * ldy + n, ldy, accumulate)
            ROW_TILES(Q8_CALL);
#undef Q8_CALL
        }
    } else {
        const float *w = (const float *)mat->w;
        /* Rows 8 at a time against one weight row (each weight row read once for them all),
           the rest as below; every row's sum is formed as f32_rows forms it. */
        const int M8 = M - M % 8;
        for (int n = u0; n < u1 && M8; n++)
            for (int m = 0; m < M8; m += 8)
                f32_rows(8, w + (size_t)n * K, K, a->f + (size_t)m * K, y + (size_t)m * ldy + n,
                         ldy, accumulate);
        int n = u0;
        for (; n + 2 <= u1; n += 2) {
            const float *wr = w + (size_t)n * K;
#define F32_CALL2(RR)                                                                          \
    f32_rows2(RR, wr, K, a->f + (size_t)m * K, y + (size_t)m * ldy + n, ldy, accumulate)
            ROW_TILES_FROM(M8, F32_CALL2);
#undef F32_CALL2
        }
        for (; n < u1; n++) {
            const float *wr = w + (size_t)n * K;
#define F32_CALL(RR)                                                                           \
    f32_rows(RR, wr, K, a->f + (size_t)m * K, y + (size_t)m * ldy + n, ldy, accumulate)
            ROW_TILES_FROM(M8, F32_CALL);
#undef F32_CALL
        }
    }
}

/* This thread's share of a product (inside a parallel region): each part's rows split between
   the threads, its outputs in its own columns of y (no barrier between the parts). */
static void product(const sf_matrix *mat, const acts *a, int M, float *y, int ldy,
                    int accumulate) {
    int column = 0;
    for (int p = 0; p < mat->parts; p++) {
        const sf_part *part = &mat->part[p];
        int u0, u1;
        share(units(part), omp_get_num_threads(), omp_get_thread_num(), &u0, &u1);
        product_units(part, a, M, y + column, ldy, accumulate, u0, u1);
        column += part->N;
    }
}

static int part_ok(const sf_part *mat) {
    if (mat->kind < 0 || mat->kind > 12 || mat->K <= 0 || mat->N <= 0) return 0;
    if (quantized_part(mat) && mat->K % QK) return 0;
    if (((mat->kind >= 4 && mat->kind <= 6) || mat->kind >= 11) && mat->K % QK_K) return 0;
    return 1;
}

static int matrix_ok(const sf_matrix *mat) {
    if (mat->parts < 1 || mat->parts > MAX_PARTS || mat->K <= 0) return 0;
    int rows = 0;
    for (int p = 0; p < mat->parts; p++) {
        if (!part_ok(&mat->part[p]) || mat->part[p].K != mat->K) return 0;
        rows += mat->part[p].N;
    }
    return rows == mat->N;
}

/* Whether the tile loops run in their vpdpwssd form on this CPU (see dot_add). */
int sf_vnni(void) { return cpu_has_vnni(); }

/* y[M, N] = x[M, K] @ W^T, one product in a parallel region of its own; with avx2_only the
   tile loops' AVX2 form whatever the CPU (the same results: the tests compare the two). */
int sf_linear_form(const sf_matrix *mat, const float *x, int M, float *y, int threads,
                   int avx2_only) {
    if (!matrix_ok(mat)) return 1;
    const int K = mat->K;
    acts a = {x, NULL, NULL, NULL, K, NULL, avx2_only};
    if (quantized(mat)) {
        a.q = (int16_t *)malloc(sizeof(int16_t) * ((size_t)M * K + 16));
        a.d = (float *)malloc(sizeof(float) * ((size_t)M * (K / QK) + 1));
        a.s = (float *)malloc(sizeof(float) * ((size_t)M * (K / QK) + 1));
        a.o = (int32_t *)malloc(sizeof(int32_t) * ((size_t)M * (K / 16) + 1));
        if (!a.q || !a.d || !a.s || !a.o) {
            free(a.q); free(a.d); free(a.s); free(a.o);
            return 2;
        }
    }
#pragma omp parallel num_threads(threads)
    {
        if (quantized(mat)) {
            int m0, m1;
            share(M, omp_get_num_threads(), omp_get_thread_num(), &m0, &m1);
            quantize_rows(&a, m0, m1);
#pragma omp barrier
        }
        product(mat, &a, M, y, mat->N, 0);
    }
    free(a.q); free(a.d); free(a.s); free(a.o);
    return 0;
}

/* y[M, N] = x[M, K] @ W^T, the tile loops in the CPU's fastest form. */
int sf_linear(const sf_matrix *mat, const float *x, int M, float *y, int threads) {
    return sf_linear_form(mat, x, M, y, threads, 0);
}

/* The 32 q of a block's 16 bytes of nibbles (input j the low nibble of byte j, input j + 16
   its high one), and back. */
static void split_nibbles(const uint8_t *qs, uint8_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = qs[j] & 0x0F;
        q[j + 16] = qs[j] >> 4;
    }
}

static void join_nibbles(const uint8_t *q, uint8_t *qs) {
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)(q[j] | (q[j + 16] << 4));
}

/* Row r's 32 q into a tile's 128 bytes of nibbles (see q4_tile_rows): input i = 2c + k,
   c = 4 qu + s, is nibble s of lane 2r + k of quarter qu; and back. */
static void nibbles_in(uint8_t *nibbles, int r, const uint8_t *q) {
    for (int k = 0; k < 2; k++)
        for (int qu = 0; qu < 4; qu++) {
            const uint8_t *x = q + 8 * qu + k;
            uint8_t *o = nibbles + 32 * qu + 2 * (2 * r + k);
            o[0] = (uint8_t)(x[0] | (x[2] << 4));
            o[1] = (uint8_t)(x[4] | (x[6] << 4));
        }
}

static void nibbles_out(const uint8_t *nibbles, int r, uint8_t *q) {
    for (int k = 0; k < 2; k++)
        for (int qu = 0; qu < 4; qu++) {
            uint8_t *x = q + 8 * qu + k;
            const uint8_t *o = nibbles + 32 * qu + 2 * (2 * r + k);
            x[0] = o[0] & 0x0F;
            x[2] = o[0] >> 4;
            x[4] = o[1] & 0x0F;
            x[6] = o[1] >> 4;
        }
}

/* One row's block b of a tile (row r of its 8) from the row's stored block, or back. */
typedef void (*tile_row_fn)(uint8_t *tile, int r, uint8_t *block, int back);

/* Q4_1 (20 bytes: float16 d and m, 16 bytes of nibbles) <-> a Q4_1 tile (see q4_tile_rows). */
static void q4_tile_row(uint8_t *t, int r, uint8_t *blk, int back) {
    uint8_t q[QK];
    if (back) {
        memcpy(blk, t + 2 * r, 2);
        memcpy(blk + 2, t + 16 + 2 * r, 2);
        nibbles_out(t + 32, r, q);
        join_nibbles(q, blk + 4);
        return;
    }
    memcpy(t + 2 * r, blk, 2);
    memcpy(t + 16 + 2 * r, blk + 2, 2);
    split_nibbles(blk + 4, q);
    nibbles_in(t + 32, r, q);
}

/* Q5_0 (22 bytes: float16 d, 32 fifth bits, 16 bytes of nibbles) <-> a Q5_0 tile (see
   q5_tile_rows): input i = 2c + k's fifth bit is bit c of lane 2r + k's, complemented. */
static void q5_tile_row(uint8_t *t, int r, uint8_t *blk, int back) {
    uint8_t q[QK];
    uint32_t qh = 0;
    if (back) {
        memcpy(blk, t + 2 * r, 2);
        for (int i = 0; i < QK; i++) {
            const int c = i / 2, lane = 2 * r + i % 2;
            if (!((t[16 + 2 * lane + c / 8] >> (c % 8)) & 1)) qh |= 1u << i;
        }
        memcpy(blk + 2, &qh, 4);
        nibbles_out(t + 48, r, q);
        join_nibbles(q, blk + 6);
        return;
    }
    memcpy(t + 2 * r, blk, 2);
    memcpy(&qh, blk + 2, 4);
    split_nibbles(blk + 6, q);
    nibbles_in(t + 48, r, q);
    for (int k = 0; k < 2; k++) {
        uint16_t high = 0;
        for (int c = 0; c < 16; c++) high |= (uint16_t)((~qh >> (2 * c + k) & 1) << c);
        memcpy(t + 16 + 2 * (2 * r + k), &high, 2);
    }
}

/* Q8_0 (34 bytes: float16 d, 32 int8 weights) <-> a Q8_0 tile (see q8_tile_rows): input
   i = 4h + 2u + k is byte u of lane 2r + k of chunk h. */
static void q8_tile_row(uint8_t *t, int r, uint8_t *blk, int back) {
    memcpy(back ? blk : t + 2 * r, back ? t + 2 * r : blk, 2);
    for (int i = 0; i < QK; i++) {
        uint8_t *at = t + 16 + 32 * (i / 4) + 2 * (2 * r + i % 2) + (i / 2) % 2;
        if (back) blk[2 + i] = *at;
        else *at = blk[2 + i];
    }
}

/* Q4_K (144 bytes: float16 d and dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of
   nibbles) <-> a Q4_K tile (see q4k_tile_rows): sub-block j's q are the low (j even) or high
   (j odd) nibbles of bytes 32 (j / 2) .. 32 (j / 2) + 31. */
static void q4k_tile_row(uint8_t *t, int r, uint8_t *blk, int back) {
    uint8_t q[QK];
    if (back) {
        memcpy(blk, t + 2 * r, 2);
        memcpy(blk + 2, t + 16 + 2 * r, 2);
        uint8_t sc[8], m[8];
        for (int j = 0; j < 8; j++) {
            const int i = 8 * j + r, at = i % 32, low = 4 * (i / 32), high = 2 * (i / 32);
            sc[j] = (uint8_t)((t[32 + at] >> low & 0xF) | (t[96 + at] >> high & 3) << 4);
            m[j] = (uint8_t)((t[64 + at] >> low & 0xF) | (t[96 + at] >> (4 + high) & 3) << 4);
        }
        for (int j = 0; j < 4; j++) {
            blk[4 + j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
            blk[8 + j] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
            blk[12 + j] = (uint8_t)((sc[j + 4] & 0xF) | (m[j + 4] & 0xF) << 4);
        }
        for (int j = 0; j < 8; j++) {
            nibbles_out(t + 128 + 128 * j, r, q);
            uint8_t *qs = blk + 16 + 32 * (j / 2);
            for (int l = 0; l < QK; l++) qs[l] = j % 2 ? (uint8_t)(qs[l] | q[l] << 4) : q[l];
        }
        return;
    }
    memcpy(t + 2 * r, blk, 2);
    memcpy(t + 16 + 2 * r, blk + 2, 2);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        k_scale_min(j, blk + 4, &sc, &m);
        const int i = 8 * j + r, at = i % 32, low = 4 * (i / 32), high = 2 * (i / 32);
        t[32 + at] |= (uint8_t)((sc & 0xF) << low);
        t[64 + at] |= (uint8_t)((m & 0xF) << low);
        t[96 + at] |= (uint8_t)((sc >> 4) << high | (m >> 4) << (4 + high));
        const uint8_t *qs = blk + 16 + 32 * (j / 2);
        for (int l = 0; l < QK; l++) q[l] = (qs[l] >> 4 * (j % 2)) & 0x0F;
        nibbles_in(t + 128 + 128 * j, r, q);
    }
}

/* Q6_K (210 bytes, see q6k_rows) <-> a Q6_K tile (see q6k_tile_rows): sub-block j = 4 h + g
   (h: which 128 weights) holds its q's low nibbles in the low (g < 2) or high nibbles of
   ql[64h + 32 (g % 2) + l] and its high bits in bits 2g, 2g + 1 of qh[32h + l]. */
static void q6k_tile_row(uint8_t *t, int r, uint8_t *blk, int back) {
    uint8_t q[QK];
    memcpy(back ? blk + 208 : t + 2 * r, back ? t + 2 * r : blk + 208, 2);
    for (int i = 0; i < 16; i++) {
        if (back) blk[192 + i] = t[16 + 8 * i + r];
        else t[16 + 8 * i + r] = blk[192 + i];
    }
    if (back) memset(blk, 0, 192);
    for (int j = 0; j < 8; j++) {
        const int h = j / 4, g = j % 4;
        uint8_t *ql = blk + 64 * h + 32 * (g % 2), *qh = blk + 128 + 32 * h;
        uint8_t *p = t + 144 + 192 * j;
        if (back) nibbles_out(p, r, q);
        for (int l = 0; l < QK; l++) {
            const int c = l / 2;
            uint8_t *lane = p + 128 + 32 * (c / 8) + 2 * (2 * r + l % 2) + (c % 8) / 4;
            const int bit = 2 * (c % 4);
            if (back) {
                ql[l] |= (uint8_t)(q[l] << 4 * (g / 2));
                qh[l] |= (uint8_t)(((*lane >> bit) & 3) << 2 * g);
            } else {
                q[l] = (ql[l] >> 4 * (g / 2)) & 0x0F;
                *lane |= (uint8_t)(((qh[l] >> 2 * g) & 3) << bit);
            }
        }
        if (!back) nibbles_in(p, r, q);
    }
}

/* N rows of stored blocks of block_bytes each (inputs weights a block) <-> tiles of tile_bytes
   (a row of tiles per 8 rows, ceil(N / 8) * K / inputs * tile_bytes bytes; rows past N are
   zero), one row's block at a time by row_fn; back: from the tiles. */
static int lay_out(uint8_t *blocks, int N, int K, uint8_t *tiles, int inputs, size_t block_bytes,
                   size_t tile_bytes, tile_row_fn row_fn, int back) {
    if (K % inputs) return 1;
    const int nb = K / inputs;
    if (!back) memset(tiles, 0, (size_t)((N + 7) / 8) * nb * tile_bytes);
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++)
            row_fn(tiles + ((size_t)(n / 8) * nb + b) * tile_bytes, n % 8,
                   blocks + ((size_t)n * nb + b) * block_bytes, back);
    return 0;
}

/* GGUF rows of blocks laid out as the kernels' tiles (sf_tile_NAME), and back
   (sf_untile_NAME): Q4_1, Q5_0 and Q8_0 blocks of 32 weights, Q4_K and Q6_K super-blocks of
   256. */
#define TILED_FORMAT(NAME, INPUTS, BLOCK_BYTES, TILE, ROW_FN)                                 \
    int sf_tile_##NAME(const uint8_t *blocks, int N, int K, uint8_t *tiles) {                  \
        return lay_out((uint8_t *)blocks, N, K, tiles, INPUTS, BLOCK_BYTES, TILE, ROW_FN, 0);  \
    }                                                                                          \
    int sf_untile_##NAME(const uint8_t *tiles, int N, int K, uint8_t *blocks) {                \
        return lay_out(blocks, N, K, (uint8_t *)tiles, INPUTS, BLOCK_BYTES, TILE, ROW_FN, 1);  \
    }

TILED_FORMAT(q4, QK, 20, TILE_BYTES, q4_tile_row)
TILED_FORMAT(q5, QK, 22, Q5_TILE_BYTES, q5_tile_row)
TILED_FORMAT(q8, QK, 34, Q8_TILE_BYTES, q8_tile_row)
TILED_FORMAT(q4k, QK_K, 144, Q4K_TILE_BYTES, q4k_tile_row)
TILED_FORMAT(q6k, QK_K, 210, Q6K_TILE_BYTES, q6k_tile_row)

/* ---------------------------------------------------------------------------------------- */
/* the step                                                                                 */

/* Row `index` of a table of rows of `bytes` each: from the map at `table`, or (fd >= 0) read
   with pread from the file at `at` into `buffer`; NULL where the read comes back short. */
static const uint8_t *table_row(const void *table, int fd, int64_t at, size_t bytes,
                                int64_t index, uint8_t *buffer) {
    if (fd < 0) return (const uint8_t *)table + (size_t)index * bytes;
    size_t done = 0;
    while (done < bytes) {
        const ssize_t got = pread(fd, buffer + done, bytes - done,
                                  (off_t)(at + index * (int64_t)bytes + (int64_t)done));
        if (got <= 0) return NULL;
        done += (size_t)got;
    }
    return buffer;
}

/* One row of the embedding table, float32 (as the file means it, from its own blocks); `buffer`
   holds a stored row where the rows are read from the file.  0, or 6 where the read failed. */
static int embed_row(const sf_model *md, int64_t token, float *out, uint8_t *buffer) {
    const int H = md->hidden;
    const size_t bytes = row_bytes(md->embed_type, H);
    const uint8_t *stored = table_row(md->embed, md->embed_fd, md->embed_at, bytes, token, buffer);
    if (!stored) return 6;
    dequantize_row(md->embed_type, stored, H, out);
    return 0;
}

static inline __m256 load8(const void *base, size_t index, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + index)));
    return _mm256_loadu_ps((const float *)base + index);
}

/* Attention of one query head of one row over positions [0, length) of its slot's keys and
   values (head_dim hd, a multiple of 8, at most MAX_HEAD_DIM): softmax of the scaled dot
   products, then the weighted sum of the values, each in a fixed order. */
static void attend(const float *q, const void *keys, const void *values, int half, int length,
                   int hd, float scale, float softcap, float *scores, float *out) {
    const int nv = hd / 8;
    __m256 qv[MAX_HEAD_DIM / 8];
    for (int i = 0; i < nv; i++) qv[i] = _mm256_loadu_ps(q + 8 * i);
    float best = -INFINITY;
    for (int t = 0; t < length; t++) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < nv; i++)
            acc = _mm256_fmadd_ps(qv[i], load8(keys, (size_t)t * hd + 8 * i, half), acc);
        float s = hsum(acc) * scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        scores[t] = s;
        best = s > best ? s : best;
    }
    const __m256 top = _mm256_set1_ps(best);
    __m256 total = _mm256_setzero_ps();
    int t = 0;
    for (; t + 8 <= length; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t), top));
        _mm256_storeu_ps(scores + t, e);
        total = _mm256_add_ps(total, e);
    }
    if (t < length) {
        float tail[8] = {0};
        for (int j = 0; t + j < length; j++) tail[j] = scores[t + j];
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(tail), top));
        _mm256_storeu_ps(tail, e);
        for (int j = 0; j < 8; j++) {
            if (t + j < length) scores[t + j] = tail[j];
            else tail[j] = 0.0f;
        }
        total = _mm256_add_ps(total, _mm256_loadu_ps(tail));
    }
    const float inv = 1.0f / hsum(total);
    __m256 acc[MAX_HEAD_DIM / 8];
    for (int i = 0; i < nv; i++) acc[i] = _mm256_setzero_ps();
    for (t = 0; t < length; t++) {
        const __m256 p = _mm256_set1_ps(scores[t]);
        for (int i = 0; i < nv; i++)
            acc[i] = _mm256_fmadd_ps(p, load8(values, (size_t)t * hd + 8 * i, half), acc[i]);
    }
    const __m256 norm = _mm256_set1_ps(inv);
    for (int i = 0; i < nv; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], norm));
}

/* The key (turned already) and the value of kv head h of one row into its slot's position. */
static void write_kv(const sf_kv *kv, int l, size_t slot_stride, int64_t slot, int64_t position,
                     int h, int hd, const float *row, int heads, int kvh) {
    const size_t at = (size_t)slot * slot_stride + ((size_t)h * kv->capacity + position) * hd;
    const float *k = row + (size_t)(heads + h) * hd;
    const float *v = row + (size_t)(heads + kvh + h) * hd;
    if (kv->half) {
        uint16_t *kd = (uint16_t *)kv->keys[l] + at, *vd = (uint16_t *)kv->values[l] + at;
        for (int j = 0; j < hd; j += 8) {
            _mm_storeu_si128((__m128i *)(kd + j),
                             _mm256_cvtps_ph(_mm256_loadu_ps(k + j), _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(vd + j),
                             _mm256_cvtps_ph(_mm256_loadu_ps(v + j), _MM_FROUND_TO_NEAREST_INT));
        }
    } else {
        memcpy((float *)kv->keys[l] + at, k, sizeof(float) * hd);
        memcpy((float *)kv->values[l] + at, v, sizeof(float) * hd);
    }
}

/* What every thread of one sf_forward call shares: the model, the rows, and the buffers. */
typedef struct {
    const sf_model *md;
    const sf_kv *kv;
    int M, width, attended;
    const int64_t *positions, *slots;
    float *hidden, *xf, *qkv, *gu, *out, *scores;
    int16_t *xq;
    float *xd, *xs;
    int32_t *xo;
    int longest;
    size_t slot_stride;
} step_state;

/* rows [m0, m1) of y [M, N] += bias */
static void add_bias(float *y, int N, const float *bias, int m0, int m1) {
    for (int m = m0; m < m1; m++) {
        float *row = y + (size_t)m * N;
        for (int n = 0; n < N; n++) row[n] += bias[n];
    }
}

/* A half of a layer closed into the residual stream: hidden += x @ W^T (+ bias), normed
   first where the layer norms it (Gemma's norms after each half).  With a bias or a norm the
   product goes to st->out first, so that the sum is formed as the per-operator layers form it
   (hidden + norm(product + bias)); without either it accumulates into hidden directly. */
static void close_half(const step_state *st, const sf_matrix *mat, const acts *a,
                       const float *bias, const float *norm, int m0, int m1) {
    const int H = st->md->hidden;
    if (!bias && !norm) {
        product(mat, a, st->M, st->hidden, H, 1);
        return;
    }
    product(mat, a, st->M, st->out, H, 0);
#pragma omp barrier
    for (int m = m0; m < m1; m++) {
        float *y = st->out + (size_t)m * H, *h = st->hidden + (size_t)m * H;
        if (bias)
            for (int n = 0; n < H; n++) y[n] += bias[n];
        if (norm) rmsnorm_row(y, H, norm, st->md->eps, y);
        for (int n = 0; n < H; n++) h[n] += y[n];
    }
}

/* Queries and keys of one row: q/k norms where the layer has them, then the rotary turn of
   the first rope_dims of each head; each key head, and its value, into the row's slot. */
static void turn_heads(const step_state *st, const sf_layer *L, int l, int nt, int me) {
    const sf_model *md = st->md;
    const int hd = md->head_dim, heads = md->heads, kvh = md->kv_heads;
    int i0, i1;
    share(st->M * (heads + kvh), nt, me, &i0, &i1);
    for (int i = i0; i < i1; i++) {
        const int m = i / (heads + kvh), h = i % (heads + kvh);
        const int rd = L->rope_dims, rh = rd / 2;
        const float *c = L->cos + (size_t)st->positions[m] * rd;
        const float *sn = L->sin + (size_t)st->positions[m] * rd;
        float *v = st->qkv + (size_t)m * st->width + (size_t)h * hd;
        const float *norm = h < heads ? L->q_norm : L->k_norm;
        if (norm) rmsnorm_row(v, hd, norm, md->eps, v);
        float t[MAX_HEAD_DIM];
        memcpy(t, v, sizeof(float) * rd);
        for (int j = 0; j < rd; j++) v[j] = t[j] * c[j] + t[(j + rh) % rd] * sn[j];
        if (h < heads) continue;
        /* a key head, turned: it and its value into the slot */
        write_kv(st->kv, l, st->slot_stride, st->slots[m], st->positions[m], h - heads, hd,
                 st->qkv + (size_t)m * st->width, heads, kvh);
    }
}

/* Attention of each (row, query head), by one thread each, over the keys of its slot from
   the start of its window (the layer's, when it slides) to its own position. */
static void attend_heads(const step_state *st, const sf_layer *L, int l, int nt, int me) {
    const sf_model *md = st->md;
    const sf_kv *kv = st->kv;
    const int hd = md->head_dim, heads = md->heads, groups = heads / md->kv_heads;
    float *scores = st->scores + (size_t)me * (st->longest + 8);
    int i0, i1;
    share(st->M * heads, nt, me, &i0, &i1);
    for (int i = i0; i < i1; i++) {
        const int m = i / heads, h = i % heads, g = h / groups;
        const int length = (int)st->positions[m] + 1;
        const int start = L->window > 0 && length > L->window ? length - L->window : 0;
        const size_t base = (size_t)st->slots[m] * st->slot_stride +
                            ((size_t)g * kv->capacity + start) * hd;
        const void *keys = kv->half ? (const void *)((const uint16_t *)kv->keys[l] + base)
                                    : (const void *)((const float *)kv->keys[l] + base);
        const void *values = kv->half ? (const void *)((const uint16_t *)kv->values[l] + base)
                                      : (const void *)((const float *)kv->values[l] + base);
        attend(st->qkv + (size_t)m * st->width + (size_t)h * hd, keys, values, kv->half,
               length - start, hd, md->attention_scale, md->attn_softcap, scores,
               st->xf + (size_t)m * st->attended + (size_t)h * hd);
    }
}

/* The attention half of layer l: its norm, the query/key/value product, the turn, attention,
   the output product closed into the residual stream. */
static void attention_half(const step_state *st, const sf_layer *L, int l, int nt, int me,
                           int m0, int m1) {
    const sf_model *md = st->md;
    const int H = md->hidden;
    acts in_h = {st->xf, st->xq, st->xd, st->xs, H, st->xo, 0};
    acts in_a = {st->xf, st->xq, st->xd, st->xs, st->attended, st->xo, 0};
    for (int m = m0; m < m1; m++)
        rmsnorm_row(st->hidden + (size_t)m * H, H, L->input_norm, md->eps, st->xf + (size_t)m * H);
    if (quantized(&L->qkv)) quantize_rows(&in_h, m0, m1);
#pragma omp barrier
    product(&L->qkv, &in_h, st->M, st->qkv, st->width, 0);
#pragma omp barrier
    if (L->qkv_bias) {
        add_bias(st->qkv, st->width, L->qkv_bias, m0, m1);
#pragma omp barrier
    }
    turn_heads(st, L, l, nt, me);
#pragma omp barrier
    attend_heads(st, L, l, nt, me);
#pragma omp barrier
    if (quantized(&L->o)) {
        quantize_rows(&in_a, m0, m1);
#pragma omp barrier
    }
    close_half(st, &L->o, &in_a, L->o_bias, L->attn_post_norm, m0, m1);
#pragma omp barrier
}

/* The MLP half of layer l: its norm, the gate/up product, the SiLU gate, the down product
   closed into the residual stream. */
static void mlp_half(const step_state *st, const sf_layer *L, int m0, int m1) {
    const sf_model *md = st->md;
    const int H = md->hidden, I = md->intermediate;
    acts in_h = {st->xf, st->xq, st->xd, st->xs, H, st->xo, 0};
    acts in_i = {st->xf, st->xq, st->xd, st->xs, I, st->xo, 0};
    for (int m = m0; m < m1; m++)
        rmsnorm_row(st->hidden + (size_t)m * H, H, L->post_norm, md->eps, st->xf + (size_t)m * H);
    if (quantized(&L->gate_up)) quantize_rows(&in_h, m0, m1);
#pragma omp barrier
    product(&L->gate_up, &in_h, st->M, st->gu, 2 * I, 0);
#pragma omp barrier
    if (L->gate_up_bias) add_bias(st->gu, 2 * I, L->gate_up_bias, m0, m1);
    for (int m = m0; m < m1; m++) {
        const float *gate = st->gu + (size_t)m * 2 * I;
        gated_row(gate, gate + I, I, md->activation == 1, st->xf + (size_t)m * I);
    }
    if (quantized(&L->down)) quantize_rows(&in_i, m0, m1);
#pragma omp barrier
    close_half(st, &L->down, &in_i, L->down_bias, L->mlp_post_norm, m0, m1);
#pragma omp barrier
}

/* Whether layer L fits the model: its products' shapes, its rope, its window. */
static int layer_ok(const sf_model *md, const sf_layer *L) {
    const int H = md->hidden, hd = md->head_dim, I = md->intermediate;
    const int width = (md->heads + 2 * md->kv_heads) * hd;
    return matrix_ok(&L->qkv) && matrix_ok(&L->o) && matrix_ok(&L->gate_up) &&
           matrix_ok(&L->down) && L->qkv.N == width && L->o.N == H && L->gate_up.N == 2 * I &&
           L->down.N == H && L->rope_dims % 2 == 0 && L->rope_dims > 0 && L->rope_dims <= hd &&
           L->window >= 0;
}

/* Rows [0, M) at positions[m] of slots[m]: layers [first, end) over hidden (in place; when
   tokens is not NULL the rows are first the tokens' embeddings).  Each row's key and value are
   written at its position of its slot, then each row attends to positions [0, position] of its
   slot (the last `window` of them in a sliding-window layer): rows of one prompt chunk see each
   other causally, and a decode row sees its lane. */
int sf_forward(const sf_model *md, const sf_kv *kv, int M, const int64_t *tokens,
               const int64_t *positions, const int64_t *slots, float *hidden, int first, int end,
               int threads) {
    const int H = md->hidden, hd = md->head_dim, heads = md->heads, kvh = md->kv_heads;
    const int I = md->intermediate;
    const int width = (heads + 2 * kvh) * hd, attended = heads * hd;
    if (M <= 0) return 0;
    if (hd % 8 || hd > MAX_HEAD_DIM || heads % kvh || H % QK || attended % QK || I % QK)
        return 1;
    for (int l = first; l < end; l++)
        if (!layer_ok(md, &md->layer[l])) return 1;
    if (tokens && row_bytes(md->embed_type, H) == 0) return 1;
    int longest = 0;
    for (int m = 0; m < M; m++) {
        if (positions[m] < 0 || positions[m] >= kv->capacity) return 4;
        if (positions[m] + 1 > longest) longest = (int)positions[m] + 1;
    }
    const int widest = I > H ? (I > attended ? I : attended) : (H > attended ? H : attended);
    const size_t rows = (size_t)M;
    step_state st = {md, kv, M, width, attended, positions, slots, hidden, NULL, NULL, NULL,
                     NULL, NULL, NULL, NULL, NULL, NULL, longest, (size_t)kvh * kv->capacity * hd};
    st.xf = (float *)malloc(sizeof(float) * rows * widest);
    st.xq = (int16_t *)malloc(sizeof(int16_t) * (rows * widest + 16));
    st.xd = (float *)malloc(sizeof(float) * (rows * (widest / QK) + 1));
    st.xs = (float *)malloc(sizeof(float) * (rows * (widest / QK) + 1));
    st.xo = (int32_t *)malloc(sizeof(int32_t) * (rows * (widest / 16) + 1));
    st.qkv = (float *)malloc(sizeof(float) * rows * width);
    st.gu = (float *)malloc(sizeof(float) * rows * 2 * I);
    st.out = (float *)malloc(sizeof(float) * rows * H);
    st.scores = (float *)malloc(sizeof(float) * ((size_t)threads * (longest + 8) + 8));
    uint8_t *stored_row =
        tokens && md->embed_fd >= 0 ? (uint8_t *)malloc(row_bytes(md->embed_type, H)) : NULL;
    int status =
        (!st.xf || !st.xq || !st.xd || !st.xs || !st.xo || !st.qkv || !st.gu || !st.out ||
         !st.scores || (tokens && md->embed_fd >= 0 && !stored_row))
            ? 2 : 0;
    if (!status && tokens)
        for (int m = 0; m < M; m++) {
            if (tokens[m] < 0 || tokens[m] >= md->vocab) { status = 5; break; }
            float *row = hidden + (size_t)m * H;
            status = embed_row(md, tokens[m], row, stored_row);
            if (status) break;
            if (md->embed_scale != 0.0f)
                for (int k = 0; k < H; k++) row[k] *= md->embed_scale;
        }
    if (!status) {
#pragma omp parallel num_threads(threads)
        {
            const int nt = omp_get_num_threads(), me = omp_get_thread_num();
            int m0, m1;
            share(M, nt, me, &m0, &m1);
            for (int l = first; l < end; l++) {
                attention_half(&st, &md->layer[l], l, nt, me, m0, m1);
                mlp_half(&st, &md->layer[l], m0, m1);
            }
        }
    }
    free(st.xf); free(st.xq); free(st.xd); free(st.xs); free(st.xo); free(st.qkv); free(st.gu);
    free(st.out); free(st.scores); free(stored_row);
    return status;
}

/* The best `count` of logits[0, vocab) (larger first; of equal ones, the lower index), into
   best[0, count) as indices; a min-heap of the kept ones. */
static void top_indices(const float *logits, int vocab, int count, int32_t *best) {
    int n = 0;
    /* heap of indices; the root is the worst kept: the smallest value, of equal values the
       larger index */
#define WORSE(a, b) (logits[a] < logits[b] || (logits[a] == logits[b] && (a) > (b)))
    for (int t = 0; t < vocab; t++) {
        if (n < count) {
            int i = n++;
            best[i] = t;
            while (i > 0) {
                const int p = (i - 1) / 2;
                if (!WORSE(best[i], best[p])) break;
                const int32_t x = best[i]; best[i] = best[p]; best[p] = x;
                i = p;
            }
        } else if (WORSE(best[0], t)) {
            best[0] = t;
            int i = 0;
            for (;;) {
                const int l = 2 * i + 1, r = l + 1;
                int w = i;
                if (l < n && WORSE(best[l], best[w])) w = l;
                if (r < n && WORSE(best[r], best[w])) w = r;
                if (w == i) break;
                const int32_t x = best[i]; best[i] = best[w]; best[w] = x;
                i = w;
            }
        }
    }
#undef WORSE
}

static inline int allowed(const int32_t *mask, int t) {
    return (int)(((uint32_t)mask[t >> 5] >> (t & 31)) & 1u);
}

/* The best `refined` logits of one row (the final norm's output x) computed again from the
   head's float rows (read from their own blocks into `w`, H floats; a stored row read from the
   file into `buffer`), forbidden ones -inf; `best` holds `refined` indices.  0, or 6 where a
   read from the file failed. */
static int refine_row(const sf_model *md, const float *x, float *row, const int32_t *mask,
                      int refined, int32_t *best, float *w, uint8_t *buffer) {
    const int H = md->hidden;
    const size_t bytes = row_bytes(md->refine_type, H);
    top_indices(row, md->vocab, refined, best);
    for (int j = 0; j < refined; j++) {
        const int t = best[j];
        const uint8_t *stored =
            table_row(md->refine, md->refine_fd, md->refine_at, bytes, t, buffer);
        if (!stored) return 6;
        __m256 acc = _mm256_setzero_ps();
        if (md->refine_type == 8) {
            /* Q8_0 (a tied Q8_0 embedding): each weight d * q formed on the way, as
               dequantize_row forms it */
            for (int k = 0; k < H; k += 8) {
                const uint8_t *blk = stored + (size_t)(k / QK) * 34;
                const __m256i q = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(blk + 2 + k % QK)));
                const __m256 wv = _mm256_mul_ps(_mm256_set1_ps(half_at(blk)), _mm256_cvtepi32_ps(q));
                acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + k), acc);
            }
        } else {
            const float *wr = (const float *)stored;
            if (md->refine_type != 0) {
                dequantize_row(md->refine_type, stored, H, w);
                wr = w;
            }
            for (int k = 0; k < H; k += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k), _mm256_loadu_ps(x + k), acc);
        }
        row[t] = (mask && !allowed(mask, t)) ? -INFINITY : hsum(acc);
    }
    return 0;
}

/* Logits [M, vocab] of hidden rows [M, hidden] (after the last layer): the final norm, the
   head's product, then (when the model has refine rows) the best `refined` logits of each row
   computed again in float32 from the head's float rows.  With masks (mask_words int32 words a
   row, bit t % 32 of word t / 32 allowing token t) forbidden tokens are -inf, and the refined
   ones are the best allowed ones. */
int sf_logits(const sf_model *md, int M, const float *hidden, const int32_t *masks,
              int mask_words, int refined, float *logits, int threads) {
    const int H = md->hidden, V = md->vocab;
    if (M <= 0) return 0;
    if (!matrix_ok(&md->head) || md->head.N != V || md->head.K != H) return 1;
    if (masks && mask_words * 32 < V) return 1;
    if (refined > V) refined = V;
    float *xf = (float *)malloc(sizeof(float) * (size_t)M * H);
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * ((size_t)M * H + 16));
    float *xd = (float *)malloc(sizeof(float) * ((size_t)M * (H / QK) + 1));
    float *xs = (float *)malloc(sizeof(float) * ((size_t)M * (H / QK) + 1));
    int32_t *xo = (int32_t *)malloc(sizeof(int32_t) * ((size_t)M * (H / 16) + 1));
    int32_t *best = (int32_t *)malloc(sizeof(int32_t) * ((size_t)M * (refined > 0 ? refined : 1)));
    float *rows_read = (float *)malloc(sizeof(float) * (size_t)threads * H);
    if (md->refine_type >= 0 && row_bytes(md->refine_type, H) == 0) refined = 0;
    const size_t stored_bytes = md->refine_type >= 0 ? row_bytes(md->refine_type, H) : 0;
    uint8_t *stored_rows = md->refine_type >= 0 && md->refine_fd >= 0 && refined > 0
                               ? (uint8_t *)malloc(stored_bytes * (size_t)threads)
                               : NULL;
    if (!xf || !xq || !xd || !xs || !xo || !best || !rows_read ||
        (md->refine_type >= 0 && md->refine_fd >= 0 && refined > 0 && !stored_rows)) {
        free(xf); free(xq); free(xd); free(xs); free(xo); free(best); free(rows_read);
        free(stored_rows);
        return 2;
    }
    int status = 0;
    acts a = {xf, xq, xd, xs, H, xo, 0};
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        int m0, m1;
        share(M, nt, me, &m0, &m1);
        for (int m = m0; m < m1; m++)
            rmsnorm_row(hidden + (size_t)m * H, H, md->final_norm, md->eps, xf + (size_t)m * H);
        if (quantized(&md->head)) quantize_rows(&a, m0, m1);
#pragma omp barrier
        product(&md->head, &a, M, logits, V, 0);
#pragma omp barrier
        for (int m = m0; m < m1; m++) {
            float *row = logits + (size_t)m * V;
            const int32_t *mask = masks ? masks + (size_t)m * mask_words : NULL;
            if (mask)
                for (int t = 0; t < V; t++)
                    if (!allowed(mask, t)) row[t] = -INFINITY;
            if (md->refine_type >= 0 && refined > 0 &&
                refine_row(md, xf + (size_t)m * H, row, mask, refined, best + (size_t)m * refined,
                           rows_read + (size_t)me * H,
                           stored_rows ? stored_rows + stored_bytes * (size_t)me : NULL)) {
#pragma omp atomic write
                status = 6;
            }
            if (md->final_softcap > 0.0f) {
                /* after the refinement, as the per-operator head caps them; masked ones stay
                   -inf */
                const float cap = md->final_softcap;
                for (int t = 0; t < V; t++)
                    if (row[t] != -INFINITY) row[t] = cap * tanhf(row[t] / cap);
            }
        }
    }
    free(xf); free(xq); free(xd); free(xs); free(xo); free(best); free(rows_read);
    free(stored_rows);
    return status;
}
