/* What the native kernels share: element kinds, 16-lane vectors, bfloat16 widening, the softmax's
 * exponential and a paged cache's description. */
#ifndef PYPTO_NATIVE_COMMON_H
#define PYPTO_NATIVE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ELEM_F32 = 0, ELEM_BF16 = 1 };

/* 16-lane vectors (GCC/Clang vector extensions: one AVX-512 register, two AVX2 ones) and unaligned
 * loads and stores of float ones. */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* The sum of a vector's 16 lanes in a fixed tree: lane i + 8 onto lane i, then i + 4, i + 2 and
 * i + 1 (the order of GCC's _mm512_reduce_add_ps). */
static inline float sum_lanes(vf v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return v[0] + v[1];
}

/* 16 bfloat16 values widened (exactly) to float32: their bits in the upper half. */
static inline vf vload_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_value(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 to bfloat16, rounded to nearest with ties to even, as torch's .to(bfloat16); NaN to torch's NaN. */
static inline uint16_t bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* torch's NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even, as torch's .to(bfloat16) */
    return (uint16_t)(bits >> 16);
}

/* The bfloat16 bits of 16 float32 values (to nearest, ties to even; NaN to torch's NaN), as bf16_round. */
static inline vu bf16_bits16(vf v) {
    vu bits;
    memcpy(&bits, &v, sizeof bits);
    vu nan = (bits & 0x7fffffffu) > 0x7f800000u;
    vu r = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (r & ~nan) | (nan & 0x7fc0u);
}

/* 16 float32 values rounded to bfloat16, stored as bfloat16. */
static inline void store_bf16x16(uint16_t *dst, vf v) {
    vh h = __builtin_convertvector(bf16_bits16(v), vh);
    memcpy(dst, &h, sizeof h);
}

/* 16 float32 values rounded to bfloat16 and widened back to float32 (exact): what torch's
 * .to(bfloat16).float() gives, without the bfloat16 tensor between. */
static inline vf wide_bf16x16(vf v) {
    vu bits = bf16_bits16(v) << 16;
    vf wide;
    memcpy(&wide, &bits, sizeof wide);
    return wide;
}

/* e**x for x <= 0 (softmax arguments after the maximum is taken off), written to vectorise:
 * x = n ln2 + f with |f| <= ln2 / 2, e**f by a degree-6 Taylor polynomial (relative error under
 * 2e-7), times 2**n built in the exponent bits; 0 below -87 (where float32 underflows) and for -inf. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504f);
    float f = x - n * 0.693145752f - n * 1.42860677e-06f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666672f + f * (0.0416666679f + f * (0.00833333377f + f * 0.00138888892f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x <= -87.0f ? 0.0f : p * scale;
}

/* How many of a product's items are split in advance: all of fewer than at_least, else the first
 * three quarters (the rest claimed). */
static inline int64_t fixed_items(int64_t items, int64_t at_least) {
    return items < at_least ? items : items - items / 4;
}

/* Claims the next chunk of items from *next on (a 2 x team-th of those left below items, at least
 * one, as OpenMP's guided schedule sizes them) into [*lo, *hi); 0 when none is left. The products
 * split most of their work in advance and claim the rest so: a thread that loses its core for a while
 * then delays the product by about half of that time instead of all of it. */

static inline int claim(int64_t *next, int64_t items, int64_t team, int64_t *lo, int64_t *hi) {
    int64_t cur = __atomic_load_n(next, __ATOMIC_RELAXED), size;
    do {
        if (cur >= items) return 0;
        size = (items - cur) / (2 * team);
        size = size < 1 ? 1 : size;
    } while (!__atomic_compare_exchange_n(next, &cur, cur + size, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    *lo = cur, *hi = cur + size;
    return 1;
}

/* The expert whose items [first[e], first[e + 1]) hold item, searched from e: a thread takes its items
 * in increasing order, so from the expert of its item before (the grouped products' item tables). */
static inline int64_t expert_of(const int64_t *first, int64_t item, int64_t e) {
    while (first[e + 1] <= item) e++;
    while (first[e] > item) e--;
    return e;
}

/* Whether a thread's best (v at index i) replaces the best so far (bv at bi; bi < 0: none) when the
 * threads' bests are merged in any order: the largest value at its lowest index, or the lowest-indexed
 * NaN, wins. */
static inline int better(float v, int64_t i, float bv, int64_t bi) {
    if (i < 0) return 0;
    return bi < 0 || (v != v ? bv == bv || i < bi : bv == bv && (v > bv || (v == bv && i < bi)));
}

typedef struct {
    const void *base;
    int kind;
    int64_t sb, st, sh;
} Cache;

/* The kernels decode_layers.c calls in sequence (each documented where it is defined). */
void pypto_rms_norm(const void *x, int64_t xs, const void *residual, int64_t rs, const void *weight, int kind,
                    int64_t n, int64_t d, float eps, void *out, int64_t os, void *sum, int64_t ss, int threads);
int pypto_qk_norm_rope_write(const void *qkv, int64_t qs, int kind, int64_t t, int64_t hq, int64_t hkv, int64_t d,
                             const void *q_norm, const void *k_norm, float eps, const void *cos, const void *sin,
                             int64_t cs, int64_t rotary, void *q_out, void *key_cache, void *value_cache,
                             int cache_kind, const int64_t *ks, const int64_t *vs, int64_t block_size,
                             int64_t num_slots, const int64_t *slots, int threads);
void pypto_silu_mul(const void *x, int64_t xs, int kind, int64_t n, int64_t i, void *out, int64_t os, int threads);
void pypto_panel_gemm(int kind, const void *x, int64_t xs, const void *panels, const void *bias, void *out,
                      int64_t os, int64_t m, int64_t n, int64_t k, int threads);
void pypto_panel_gemm_logits(int kind, const void *x, int64_t xs, const void *panels, const void *bias, float *out,
                             int64_t os, int64_t m, int64_t n, int64_t k, float *row_max, int64_t *row_arg,
                             int threads);
int pypto_gemv(const void *w, int kind, int64_t ws, const float *x, float *out, int64_t n, int64_t in,
               int round_bf16, float *row_max, int64_t *row_arg, int threads);
int pypto_paged_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride, const void *key_cache,
                          const void *value_cache, int kind, const int64_t *k_strides, const int64_t *v_strides,
                          const int64_t *tables, int64_t table_stride, const int64_t *rows, const int64_t *requests,
                          const int64_t *los, const int64_t *counts, int64_t n, int64_t num_q_heads,
                          int64_t num_kv_heads, int64_t dim, int64_t dim_v, int64_t block_size, float scale,
                          const float *sinks, void *out, int out_kind, int64_t out_row_stride,
                          int64_t out_head_stride, const uint16_t *query_bf16, int per_key, int threads);

#endif
