/* The element-wise work between a decoder layer's matrix products, one pass each instead of a
 * dozen torch ops (pypto_kernels.rms_norm, add_rms_norm and qk_norm_rope_write_kv on the CPU):
 *
 * - pypto_rms_norm: the residual add (optional) and RMSNorm of each row.
 * - pypto_qk_norm_rope_write: a fused q/k/v projection's rows cut into heads, q and k RMS-normalised
 *   per head (Qwen3; optional) and rotated (HF's rotate_half layout), k and v written into the paged
 *   caches, q returned.
 * - pypto_silu_mul: SwiGLU on a fused gate/up projection's rows, silu(gate) * up.
 *
 * Every step rounds as the torch reference's ops do, in its order (no fused multiply-add: the file is
 * built with contraction off), so the results equal the reference's bitwise except the mean of
 * squares, summed here in 16 lanes combined pairwise (torch's vectorised sum has its own order), and
 * silu's exponential (exp_any: its product within 4 float32 ulps of torch's). A
 * bfloat16 tensor rounds after each op, as torch's bfloat16 ops do. A row's result depends only on
 * that row: rows are split over threads whole. */
#include "common.h"

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#else
#pragma GCC optimize("fp-contract=off")
#endif

/* The longest head the fused q/k pass takes (two rows of it live on the stack); kept equal to
 * pypto_kernels.native.MAX_HEAD_DIM. */
#define PYPTO_MAX_HEAD_DIM 512

/* LANES: the mean of squares' partial sums; GRAIN: elements from which rows are split over threads. */
enum { LANES = 16, GRAIN = 32768 };

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float load(const void *p, int kind, int64_t i) {
    return kind == ELEM_BF16 ? bf16_value(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

ALWAYS_INLINE void store(void *p, int kind, int64_t i, float v) {
    if (kind == ELEM_BF16)
        ((uint16_t *)p)[i] = bf16_round(v);
    else
        ((float *)p)[i] = v;
}

/* v as the kind holds it (a bfloat16 op's result is rounded to bfloat16). */
ALWAYS_INLINE float held(int kind, float v) { return kind == ELEM_BF16 ? bf16_value(bf16_round(v)) : v; }

/* 1 / sqrt(mean(x**2) + eps) of d values of the kind: squares rounded to float32, summed in LANES
 * lanes, the lanes combined pairwise, divided by d (torch's mean), then torch's rsqrt (1 / sqrt). */
ALWAYS_INLINE float inverse_rms(const void *x, int kind, int64_t d, float eps) {
    float acc[LANES] = {0.0f};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) {
            float v = load(x, kind, i + j), sq = v * v;
            acc[j] = acc[j] + sq;
        }
    for (int j = 0; i < d; i++, j++) {
        float v = load(x, kind, i), sq = v * v;
        acc[j] = acc[j] + sq;
    }
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) acc[j] = acc[j] + acc[j + width];
    float variance = acc[0] / (float)d;
    return 1.0f / sqrtf(variance + eps);
}

/* One row: sum = x + residual (when residual is given; held in the kind), out = w * held(h * inv). */
ALWAYS_INLINE void norm_row(const void *x, const void *residual, const void *w, int kind, int64_t d, float eps,
                            void *out, void *sum) {
    const void *h = x;
    if (residual != NULL) {
        for (int64_t i = 0; i < d; i++) store(sum, kind, i, load(x, kind, i) + load(residual, kind, i));
        h = sum;
    }
    float inv = inverse_rms(h, kind, d, eps);
    for (int64_t i = 0; i < d; i++) {
        float scaled = held(kind, load(h, kind, i) * inv);
        store(out, kind, i, load(w, kind, i) * scaled);
    }
}

/* x [n, d] rows of stride xs (elements), residual the same with stride rs or NULL, weight [d]; all
 * of the kind. Writes out [n, d] (row stride os) and, with a residual, sum [n, d] (row stride ss). */
void pypto_rms_norm(const void *x, int64_t xs, const void *residual, int64_t rs, const void *weight, int kind,
                    int64_t n, int64_t d, float eps, void *out, int64_t os, void *sum, int64_t ss, int threads) {
    size_t size = kind == ELEM_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n * d >= GRAIN)
    for (int64_t r = 0; r < n; r++) {
        const char *xr = (const char *)x + (size_t)(r * xs) * size;
        const char *rr = residual ? (const char *)residual + (size_t)(r * rs) * size : NULL;
        char *outr = (char *)out + (size_t)(r * os) * size;
        char *sumr = residual ? (char *)sum + (size_t)(r * ss) * size : NULL;
        if (kind == ELEM_BF16)
            norm_row(xr, rr, weight, ELEM_BF16, d, eps, outr, sumr);
        else
            norm_row(xr, rr, weight, ELEM_F32, d, eps, outr, sumr);
    }
}

/* One head of d values (at x, of the kind) normalised by w (NULL: not normalised) and rotated over
 * its first `rotary` values by cos/sin (of the kind), into h (float32 holding the kind's values). */
ALWAYS_INLINE void head_rows(const void *x, int kind, int64_t d, const void *w, float eps, const void *cos,
                             const void *sin, int64_t rotary, float *h, float *normed) {
    if (w != NULL) {
        float inv = inverse_rms(x, kind, d, eps);
        for (int64_t j = 0; j < d; j++) normed[j] = held(kind, load(w, kind, j) * held(kind, load(x, kind, j) * inv));
    } else {
        for (int64_t j = 0; j < d; j++) normed[j] = load(x, kind, j);
    }
    int64_t half = rotary / 2;
    /* x cos, then x2 sin taken from the first half and x1 sin added to the second (HF's formula). */
    for (int64_t j = 0; j < half; j++) {
        float c = held(kind, normed[j] * load(cos, kind, j));
        float s = held(kind, normed[j + half] * load(sin, kind, j));
        h[j] = held(kind, c - s);
    }
    for (int64_t j = half; j < rotary; j++) {
        float c = held(kind, normed[j] * load(cos, kind, j));
        float s = held(kind, normed[j - half] * load(sin, kind, j));
        h[j] = held(kind, c + s);
    }
    for (int64_t j = rotary; j < d; j++) h[j] = normed[j];
}

static void to_cache(void *cache, int cache_kind, const int64_t *strides, int64_t block, int64_t offset, int64_t head,
                     const float *h, int64_t d) {
    int64_t at = block * strides[0] + offset * strides[1] + head * strides[2];
    for (int64_t j = 0; j < d; j++) store(cache, cache_kind, at + j, h[j]);
}

ALWAYS_INLINE void token(const void *row, int kind, int64_t hq, int64_t hkv, int64_t d, const void *q_norm,
                         const void *k_norm, float eps, const void *cos, const void *sin, int64_t rotary, void *q_out,
                         void *key_cache, void *value_cache, int cache_kind, const int64_t *ks, const int64_t *vs,
                         int64_t block, int64_t offset) {
    float h[PYPTO_MAX_HEAD_DIM], normed[PYPTO_MAX_HEAD_DIM];
    size_t size = kind == ELEM_BF16 ? 2 : 4;
    for (int64_t head = 0; head < hq; head++) {
        head_rows((const char *)row + (size_t)(head * d) * size, kind, d, q_norm, eps, cos, sin, rotary, h, normed);
        for (int64_t j = 0; j < d; j++) store(q_out, kind, head * d + j, h[j]);
    }
    for (int64_t head = 0; head < hkv; head++) {
        const char *k = (const char *)row + (size_t)((hq + head) * d) * size;
        head_rows(k, kind, d, k_norm, eps, cos, sin, rotary, h, normed);
        to_cache(key_cache, cache_kind, ks, block, offset, head, h, d);
        const char *v = (const char *)row + (size_t)((hq + hkv + head) * d) * size;
        for (int64_t j = 0; j < d; j++) h[j] = load(v, kind, j);
        to_cache(value_cache, cache_kind, vs, block, offset, head, h, d);
    }
}

/* qkv [t, (hq + 2 hkv) d] rows of stride qs (q heads, then k, then v), of the kind; q_norm, k_norm
 * [d] or NULL; cos, sin [t, rotary] rows of stride cs, of the kind. Writes q_out [t, hq, d] (dense,
 * the kind) and token i's k and v heads into slot slots[i] of the caches (cache_kind, strides of
 * block, token and head in elements; head dim dense). Returns 0, or 1 (nothing written) when a slot
 * is outside [0, num_slots) or d exceeds PYPTO_MAX_HEAD_DIM. */
int pypto_qk_norm_rope_write(const void *qkv, int64_t qs, int kind, int64_t t, int64_t hq, int64_t hkv, int64_t d,
                             const void *q_norm, const void *k_norm, float eps, const void *cos, const void *sin,
                             int64_t cs, int64_t rotary, void *q_out, void *key_cache, void *value_cache,
                             int cache_kind, const int64_t *ks, const int64_t *vs, int64_t block_size,
                             int64_t num_slots, const int64_t *slots, int threads) {
    if (d > PYPTO_MAX_HEAD_DIM) return 1;
    for (int64_t i = 0; i < t; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return 1;
    size_t size = kind == ELEM_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && t * (hq + 2 * hkv) * d >= GRAIN)
    for (int64_t i = 0; i < t; i++) {
        const char *row = (const char *)qkv + (size_t)(i * qs) * size;
        const char *c = (const char *)cos + (size_t)(i * cs) * size, *s = (const char *)sin + (size_t)(i * cs) * size;
        char *q = (char *)q_out + (size_t)(i * hq * d) * size;
        int64_t block = slots[i] / block_size, offset = slots[i] % block_size;
        if (kind == ELEM_BF16)
            token(row, ELEM_BF16, hq, hkv, d, q_norm, k_norm, eps, c, s, rotary, q, key_cache, value_cache, cache_kind,
                  ks, vs, block, offset);
        else
            token(row, ELEM_F32, hq, hkv, d, q_norm, k_norm, eps, c, s, rotary, q, key_cache, value_cache, cache_kind,
                  ks, vs, block, offset);
    }
    return 0;
}

/* e**x for any float32 x, written to vectorise: x = n ln2 + f with |f| <= ln2 / 2, e**f by
 * common.h's degree-6 polynomial (relative error under 2e-7), times 2**n built in the exponent bits;
 * 0 below -87 and +inf above 88 (where torch's is 1e-38 or already 1.6e38 or more: silu's quotient is
 * then 0 or -0 within 1e-36 of torch's). common.h's exp_nonpositive written out again for positive
 * arguments rather than shared: a header function is defined before this file's contraction pragma,
 * and GCC does not inline across differing optimize attributes. */
ALWAYS_INLINE float exp_any(float x) {
    float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_rintf(c * 1.44269504f);
    float f = c - n * 0.693145752f - n * 1.42860677e-06f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666672f + f * (0.0416666679f + f * (0.00833333377f + f * 0.00138888892f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : (x > 88.0f ? __builtin_inff() : p * scale);
}

/* One row of SwiGLU, torch's F.silu(gate) * up: silu as gate / (1 + e**-gate) in float32, held in the
 * kind, times up, held. */
ALWAYS_INLINE void silu_mul_row(const void *gate, const void *up, int kind, int64_t i, void *out) {
    for (int64_t j = 0; j < i; j++) {
        float g = load(gate, kind, j);
        float silu = held(kind, g / (1.0f + exp_any(-g)));
        store(out, kind, j, silu * load(up, kind, j));
    }
}

/* x [n, 2 i] rows of stride xs (the gate's i values, then the up's), of the kind; writes out [n, i]
 * (row stride os, the kind). A row's result depends only on that row. */
void pypto_silu_mul(const void *x, int64_t xs, int kind, int64_t n, int64_t i, void *out, int64_t os, int threads) {
    size_t size = kind == ELEM_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n * i >= GRAIN)
    for (int64_t r = 0; r < n; r++) {
        const char *row = (const char *)x + (size_t)(r * xs) * size;
        char *o = (char *)out + (size_t)(r * os) * size;
        if (kind == ELEM_BF16)
            silu_mul_row(row, row + (size_t)i * size, ELEM_BF16, i, o);
        else
            silu_mul_row(row, row + (size_t)i * size, ELEM_F32, i, o);
    }
}
