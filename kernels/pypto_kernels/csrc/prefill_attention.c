/* Causal attention of long query runs (prefill chunks) over a paged K/V cache, read in place
 * (pypto_kernels.native.prefill_attention).
 *
 * A span is one request's run of n queries at positions hi - n .. hi - 1; query i sees the keys at
 * positions [max(lo, p_i - window + 1), p_i] of its request's block table (no window: from lo).
 * Work items are (span, KV head, tile of QT queries), spread over OpenMP threads (the process's
 * runtime, shared with torch's). A tile's M = QT x G query vectors (its queries times the G query
 * heads of the KV head, prescaled) run as one block, flash-attention style, over its keys in chunks
 * of KC positions: each chunk's keys are packed transposed and its values widened to float32 once
 * for all M vectors (of which only the queries at or after the chunk take part: causal), their
 * scores come from an outer-product loop held in registers (RB vectors x KC keys a block), an online
 * softmax (running maximum and denominator per vector) turns them into weights, and the weighted
 * values are added to M running outputs (RB vectors x 64 dims a block), divided by the denominators
 * at the end. A per-query-head sink logit, when given, starts each vector's maximum and denominator
 * (a logit with no value). Chunks of 64 keys with both products blocked over RB vectors, against
 * chunks of 16 whose weighted values ran a vector at a time (one load of the values per multiply-add),
 * ran a 4,096-token prompt's attention 1.42x as fast (Qwen3-shaped 4 query and 2 KV heads of 64 dims,
 * bfloat16 caches: 103 -> 146 GFLOP/s on the 2-core Zen 4 EPYC of docs/benchmarks.md) and a
 * 2,048-token one with 16 and 8 heads of 128 dims 1.46x (108 -> 158). Where the CPU has AVX512-BF16
 * and the queries and the keys are bfloat16, the scores are its pair dot products of the values as
 * they are (pair_scores_block), scaled after: 1.21-1.26x again (146 -> 187 and 146 -> 184 GFLOP/s).
 * There the values are pair dot products too (value_pairs_block): each weight rounded to bfloat16
 * (as transformers' eager attention rounds its bfloat16 softmax before the values' product; the
 * denominator sums the rounded weights), 32 at a time by VCVTNE2PS2BF16 (round_weights), the chunk's
 * values packed as pairs of keys and its keys as pairs of dims transposed 16 x 16 at a time
 * (pack_pairs_chunk); with the softmax's exponentials scaled by VSCALEFPS (vexp_nonpositive), 1.40x
 * and 1.43x again (4,096 tokens of the small heads 44.5 -> 31.8 ms, 2,048 of Qwen3-0.6B's 81.0 ->
 * 56.6 ms, 304 GFLOP/s). The float32 path's keys are transposed 16 x 16 at a time too (with the
 * exponentials 1.05-1.08x, the same bits).
 *
 * Chunks are aligned to absolute positions (multiples of KC) and every sum runs in a fixed order,
 * so a query's result depends only on its own inputs: not on the tiling, the batch or the threads.
 * Vectors are GCC/Clang vector extensions of 16 floats (one AVX-512 register, two AVX2 ones).
 *
 * The caches are [blocks, block_size, Hkv, D] with any strides whose last dimension is dense
 * (element strides sb, st, sh), float32 or bfloat16 (widened exactly to float32).
 */
#include "common.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* KC keys a chunk (KV vectors of 16), QT queries a tile; RB query vectors share each load of a chunk's
 * keys or values (RB x KV accumulators: 24 of AVX-512's 32 registers; 12 vectors, 24 AVX2 ones, without). */
enum { KC = 64, KV = KC / 16, QT = 64 };
_Static_assert(KV == 4, "softmax_step sums a chunk's four weight vectors");
#ifdef __AVX512F__
enum { RB = 6 };
#else
enum { RB = 3 };
#endif

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline float widen(const void *base, int kind, int64_t index) {
    return kind == ELEM_F32 ? ((const float *)base)[index] : bf16_value(((const uint16_t *)base)[index]);
}

typedef struct {
    int64_t group, dim, dim_v, block_size, window;
    float scale;
    int pairs; /* scores as bfloat16 pair dot products (pair_scores_block) */
} Shape;

/* Query or output rows: float32 or bfloat16 elements, row and head strides in elements. */
typedef struct {
    void *base;
    int kind;
    int64_t row_stride, head_stride;
} Rows;

/* A thread's working memory for one tile. */
typedef struct {
    float *q;      /* [M, dim] the tile's query vectors times the scale */
    float *s;      /* [M, KC] scores, then weights */
    float *o;      /* [M, dim_v] running outputs */
    float *top;    /* [M] running maxima */
    float *total;  /* [M] running denominators */
    float *kt;     /* [dim, KC] the chunk's keys, transposed */
    float *vc;     /* [KC, dim_v] the chunk's values */
} Scratch;

/* The cache rows of positions [pos0, pos0 + KC) for KV head h into krow / vrow (elements of the
 * caches' kind); NULL for positions outside [from, to), which are never read (blocks before a window
 * may be gone) and pack as zeros. */
static void chunk_rows(const Cache *k, const Cache *v, const int64_t *table, const Shape *sh, int64_t h,
                       int64_t pos0, int64_t from, int64_t to, const char *krow[KC], const char *vrow[KC]) {
    int64_t size = k->kind == ELEM_F32 ? 4 : 2;
    for (int64_t j = 0; j < KC; j++) {
        int64_t pos = pos0 + j, block = pos < from || pos >= to ? -1 : table[pos / sh->block_size];
        int64_t off = pos % sh->block_size;
        krow[j] = block < 0 ? NULL : (const char *)k->base + (block * k->sb + off * k->st + h * k->sh) * size;
        vrow[j] = block < 0 ? NULL : (const char *)v->base + (block * v->sb + off * v->st + h * v->sh) * size;
    }
}

/* 16 elements of a cache row from element d as 32-bit lanes: float32 bits, or bfloat16 widened
 * (exactly); zeros for a NULL row. */
static inline vu row16(const char *row, int kind, int64_t d) {
    if (row == NULL) return (vu){0};
    if (kind == ELEM_BF16) {
        vf f = vload_bf16((const uint16_t *)row + d);
        vu u;
        memcpy(&u, &f, sizeof u);
        return u;
    }
    vu u;
    memcpy(&u, (const float *)row + d, sizeof u);
    return u;
}

/* A 16 x 16 matrix of 32-bit lanes, held as 16 row vectors, transposed in place: the off-diagonal
 * W x W blocks of each 2W x 2W block swapped, for W = 8, 4, 2 and 1 (LO and HI: the lanes of rows i
 * and i + W after the swap, as indices into rows i and i + W before it). */
#define LANES(...) __VA_ARGS__
#define SWAP_BLOCKS(W, LO, HI)                                                                                \
    for (int i = 0; i < 16; i++)                                                                              \
        if (!(i & (W))) {                                                                                     \
            vu a = m[i], b = m[i + (W)];                                                                      \
            m[i] = __builtin_shufflevector(a, b, LANES LO);                                                   \
            m[i + (W)] = __builtin_shufflevector(a, b, LANES HI);                                             \
        }
static inline void transpose16(vu m[16]) {
    SWAP_BLOCKS(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
    SWAP_BLOCKS(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
    SWAP_BLOCKS(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
    SWAP_BLOCKS(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
}
#undef SWAP_BLOCKS
#undef LANES

/* Keys and values of positions [pos0, pos0 + KC) into kt ([dim, KC], transposed 16 x 16 at a time) and
 * vc ([KC, dim_v]), widened to float32; positions outside [from, to) are zeros. */
static void pack_chunk(const Cache *k, const Cache *v, const int64_t *table, const Shape *sh, int64_t h,
                       int64_t pos0, int64_t from, int64_t to, float *kt, float *vc) {
    const char *krow[KC], *vrow[KC];
    chunk_rows(k, v, table, sh, h, pos0, from, to, krow, vrow);
    int64_t full = sh->dim / 16 * 16;
    for (int64_t j0 = 0; j0 < KC; j0 += 16)
        for (int64_t c = 0; c < full; c += 16) {
            vu m[16];
            for (int i = 0; i < 16; i++) m[i] = row16(krow[j0 + i], k->kind, c);
            transpose16(m);
            for (int i = 0; i < 16; i++) memcpy(kt + (c + i) * KC + j0, &m[i], sizeof m[i]);
        }
    for (int64_t j = 0; j < KC; j++) { /* the dims past the last 16 */
        for (int64_t d = full; d < sh->dim; d++)
            kt[d * KC + j] = krow[j] ? widen(krow[j], k->kind, d) : 0.0f;
        for (int64_t d = 0; d < sh->dim_v; d += 16) { /* dim_v is a multiple of 16 */
            vu u = row16(vrow[j], v->kind, d);
            memcpy(vc + j * sh->dim_v + d, &u, sizeof u);
        }
    }
}

/* pack_chunk for sh->pairs: the keys' bfloat16 values as pairs of dims, transposed ([dim / 2, KC] of
 * 32 bits: 16 keys x 16 pairs at a time as one 16 x 16 transposition), and the values as pairs of keys
 * ([KC / 2, dim_v] of 32 bits: key 2t's value in the low half, key 2t + 1's in the high one). */
static void pack_pairs_chunk(const Cache *k, const Cache *v, const int64_t *table, const Shape *sh, int64_t h,
                             int64_t pos0, int64_t from, int64_t to, uint32_t *kt, uint32_t *vc) {
    const char *krow[KC], *vrow[KC];
    chunk_rows(k, v, table, sh, h, pos0, from, to, krow, vrow);
    int64_t pairs = sh->dim / 2, full = pairs / 16 * 16;
    for (int64_t j0 = 0; j0 < KC; j0 += 16)
        for (int64_t c = 0; c < full; c += 16) {
            vu m[16];
            for (int i = 0; i < 16; i++)
                if (krow[j0 + i]) memcpy(&m[i], (const uint16_t *)krow[j0 + i] + 2 * c, sizeof m[i]);
                else m[i] = (vu){0};
            transpose16(m);
            for (int i = 0; i < 16; i++) memcpy(kt + (c + i) * KC + j0, &m[i], sizeof m[i]);
        }
    for (int64_t j = 0; j < KC; j++) /* the pairs past the last 16 */
        for (int64_t c = full; c < pairs; c++)
            if (krow[j]) memcpy(kt + c * KC + j, (const uint16_t *)krow[j] + 2 * c, sizeof(uint32_t));
            else kt[c * KC + j] = 0;
    for (int64_t t = 0; t < KC / 2; t++)
        for (int64_t d = 0; d < sh->dim_v; d += 16) {
            vh even = {0}, odd = {0};
            if (vrow[2 * t]) memcpy(&even, (const uint16_t *)vrow[2 * t] + d, sizeof even);
            if (vrow[2 * t + 1]) memcpy(&odd, (const uint16_t *)vrow[2 * t + 1] + d, sizeof odd);
            vu pair = __builtin_convertvector(even, vu) | __builtin_convertvector(odd, vu) << 16;
            memcpy(vc + t * sh->dim_v + d, &pair, sizeof pair);
        }
}

/* c[r][0 .. 16 nb) (row stride ldc) = sum over k < depth of a[r * lda + k] b[k * ldb + 0 .. 16 nb),
 * added to c's values where accumulate, else from zero, for ``rows`` rows (rows and nb constants
 * where inlined): each output one chain of multiply-adds over k in order, each load of b's row k
 * shared by the rows (RB x KV accumulators in registers). The scores (a the query vectors, b the
 * chunk's keys transposed) and the weighted values (a the weights, b the chunk's values) are both. */
static inline __attribute__((always_inline)) void outer_block(float *c, int64_t ldc, int accumulate, const float *a,
                                                              int64_t lda, const float *b, int64_t ldb, int64_t depth,
                                                              const int rows, const int nb) {
    vf acc[RB][KV];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nb; v++) acc[r][v] = accumulate ? vload(c + r * ldc + 16 * v) : splat(0.0f);
    for (int64_t k = 0; k < depth; k++) {
        vf bk[KV];
        for (int v = 0; v < nb; v++) bk[v] = vload(b + k * ldb + 16 * v);
        for (int r = 0; r < rows; r++) {
            vf ak = splat(a[r * lda + k]);
            for (int v = 0; v < nb; v++) acc[r][v] += ak * bk[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nb; v++) vstore(c + r * ldc + 16 * v, acc[r][v]);
}

/* s[r] = q[r] . kt for ``rows`` query vectors: each of a vector's KC scores one chain over the dims in
 * order, from zero. */
static inline __attribute__((always_inline)) void scores_block(const float *q, const float *kt, int64_t dim,
                                                               float *s, const int rows) {
    outer_block(s, KC, 0, q, dim, kt, KC, dim, rows, KV);
}

#ifdef __AVX512BF16__
/* scores_block for bfloat16 queries and keys (sh->pairs): q holds the rows' unscaled bfloat16 values
 * and kt the chunk's keys as pairs of dims ([dim / 2, KC] of two bfloat16 each); each score one chain
 * of AVX512-BF16 pair dot products (VDPBF16PS: the odd dim's exact product added first, then the even
 * one's; subnormals flushed) over the pairs in order, from zero, then times the scale: half the
 * instructions of widening each key and query to float32. */
static inline __attribute__((always_inline)) void pair_scores_block(const uint16_t *q, const uint32_t *kt,
                                                                    int64_t dim, float scale, float *s,
                                                                    const int rows) {
    __m512 acc[RB][KV];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < KV; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim / 2; d++) {
        __m512i kd[KV];
        for (int b = 0; b < KV; b++) kd[b] = _mm512_loadu_si512(kt + d * KC + 16 * b);
        for (int r = 0; r < rows; r++) {
            uint32_t pair;
            memcpy(&pair, q + r * dim + 2 * d, sizeof pair);
            __m512bh qd = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int b = 0; b < KV; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qd, (__m512bh)kd[b]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < KV; b++) _mm512_storeu_ps(s + r * KC + 16 * b, _mm512_mul_ps(acc[r][b], _mm512_set1_ps(scale)));
}
#endif

static void scores(const Scratch *w, const Shape *sh, int64_t m, int64_t m_count) {
    int64_t dim = sh->dim;
#ifdef __AVX512BF16__
    if (sh->pairs) {
        const uint16_t *q = (const uint16_t *)w->q;
        const uint32_t *kt = (const uint32_t *)w->kt;
        for (; m + RB <= m_count; m += RB) pair_scores_block(q + m * dim, kt, dim, sh->scale, w->s + m * KC, RB);
        for (; m < m_count; m++) pair_scores_block(q + m * dim, kt, dim, sh->scale, w->s + m * KC, 1);
        return;
    }
#endif
    for (; m + RB <= m_count; m += RB) scores_block(w->q + m * dim, w->kt, dim, w->s + m * KC, RB);
    for (; m < m_count; m++) scores_block(w->q + m * dim, w->kt, dim, w->s + m * KC, 1);
}

/* Lanes of mask set take a, the others b. */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp_nonpositive (common.h) lane by lane, the same operations in the same order, except that the
 * product x log2(e) is fused into the rounding's addition (so at a product within an ulp of a half
 * n may differ from the scalar's, with the same value to the polynomial's error): written with
 * vectors because GCC leaves that loop scalar. */
static inline vf vexp_nonpositive(vf x) {
#ifdef __AVX512F__
    /* The same values in fewer instructions: n rounded as below (x log2(e) + 1.5 2**23, one fused
     * multiply-add, less 1.5 2**23), then p 2**n by VSCALEFPS (rounded as the multiply by 2**n rounds
     * it; n >= -126 wherever x > -87) and zeroed by a mask where x <= -87 (-inf too, whose lanes
     * compute NaN): 1.07x a long prompt's bfloat16 attention. */
    __m512 v, p;
    memcpy(&v, &x, sizeof v);
    const __m512 shift = _mm512_set1_ps(12582912.0f);
    __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504f), shift), shift);
    vf nv;
    memcpy(&nv, &n, sizeof nv);
    vf f = x - nv * 0.693145752f - nv * 1.42860677e-06f;
    vf poly = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666672f + f * (0.0416666679f + f * (0.00833333377f + f * 0.00138888892f)))));
    memcpy(&p, &poly, sizeof p);
    __m512 r = _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), p, n);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
#else
    const vf floor = splat(-87.0f);
    x = vselect(x < floor, floor, x);
    vf y = x * 1.44269504f;
    vf n = (y + 12582912.0f) - 12582912.0f; /* rint: round to nearest even, |y| <= 126 */
    vf f = x - n * 0.693145752f - n * 1.42860677e-06f;
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666672f + f * (0.0416666679f + f * (0.00833333377f + f * 0.00138888892f)))));
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return vselect(x <= floor, splat(0.0f), p * (vf)bits);
#endif
}

/* The largest of a vector's 16 lanes, folding lane i + 8, then i + 4, i + 2 and i + 1 onto lane i. */
static inline float vmax_lanes(vf v) {
    vf h = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
    v = vselect(h > v, h, v);
    h = __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
    v = vselect(h > v, h, v);
    h = __builtin_shufflevector(v, v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    v = vselect(h > v, h, v);
    return v[1] > v[0] ? v[1] : v[0];
}

/* A chunk's KC weights (KV vectors) rounded to bfloat16 (to nearest, ties to even; they are finite,
 * and 0 or at least e**-87, never subnormal) into dst, and e made those rounded values. */
static inline void round_weights(vf e[KV], uint16_t *dst) {
#ifdef __AVX512BF16__
    for (int b = 0; b < KV; b += 2) {
        __m512 lo, hi;
        memcpy(&lo, &e[b], sizeof lo);
        memcpy(&hi, &e[b + 1], sizeof hi);
        __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* lo's 16 values, then hi's */
        _mm512_storeu_si512(dst + 16 * b, pair);
        __m512 wlo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(pair)), 16));
        __m512 whi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pair, 1)), 16));
        memcpy(&e[b], &wlo, sizeof wlo);
        memcpy(&e[b + 1], &whi, sizeof whi);
    }
#else
    for (int b = 0; b < KV; b++) e[b] = wide_bf16x16(e[b]);
    for (int b = 0; b < KV; b++) store_bf16x16(dst + 16 * b, e[b]);
#endif
}

/* Masks vector m's scores to its visible positions [first, last], folds them into its running maximum
 * and denominator (the chunk's weights summed as (e0 + e1) + (e2 + e3) over its four vectors, then
 * their lanes by sum_lanes), rescales its output, and leaves its weights in s; where it sees none of
 * the chunk, zero weights and its state as it was. */
static void softmax_step(const Scratch *w, int64_t m, int64_t pos0, int64_t first, int64_t last, int64_t dim_v,
                         int pairs) {
    float *s = w->s + m * KC;
    vf x[KV];
    for (int b = 0; b < KV; b++) x[b] = vload(s + 16 * b);
    if (pos0 < first || pos0 + KC - 1 > last) {
        const vi lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        for (int b = 0; b < KV; b++) {
            vi pos = lanes + (int32_t)(pos0 + 16 * b - first); /* relative to first: fits in 32 bits */
            x[b] = vselect((pos < 0) | (pos > (int32_t)(last - first)), splat(-INFINITY), x[b]);
        }
    }
    vf most = x[0];
    for (int b = 1; b < KV; b++) most = vselect(x[b] > most, x[b], most);
    float chunk_top = vmax_lanes(most);
    if (chunk_top == -INFINITY) {
        memset(s, 0, sizeof(float) * KC);
        return;
    }
    float top = w->top[m] > chunk_top ? w->top[m] : chunk_top;
    float keep = top == w->top[m] ? 1.0f : exp_nonpositive(w->top[m] - top); /* exp_nonpositive(0) is 1 */
    vf e[KV];
    for (int b = 0; b < KV; b++) e[b] = vexp_nonpositive(x[b] - splat(top));
    if (pairs) { /* the weights rounded to bfloat16, stored as such over the row's first half (value_pairs) */
        round_weights(e, (uint16_t *)s);
    } else {
        for (int b = 0; b < KV; b++) vstore(s + 16 * b, e[b]);
    }
    w->top[m] = top;
    w->total[m] = w->total[m] * keep + sum_lanes((e[0] + e[1]) + (e[2] + e[3]));
    if (keep != 1.0f) {
        float *o = w->o + m * dim_v;
#pragma omp simd
        for (int64_t d = 0; d < dim_v; d++) o[d] *= keep;
    }
}

/* o[r][d .. d + 16 nb) += sum_j p[r][j] vc[j][d .. d + 16 nb) for ``rows`` vectors: each output one
 * chain over the chunk's keys in order. */
static inline __attribute__((always_inline)) void values_block(float *o, const float *p, const float *vc,
                                                               int64_t dim_v, const int rows, const int nb) {
    outer_block(o, dim_v, 1, p, KC, vc, dim_v, KC, rows, nb);
}

#ifdef __AVX512BF16__
/* values_block for bfloat16 weights and values (sh->pairs): p holds each row's KC weights as bfloat16,
 * vc the chunk's values as pairs of keys ([KC / 2, dim_v] of two bfloat16 each: key 2t's value, then
 * key 2t + 1's); each output one chain of AVX512-BF16 pair dot products over the key pairs in order
 * (the odd key's exact product added first, then the even one's; subnormals flushed), added to o.
 * Half the instructions of widening each value to float32 and multiplying it by a float32 weight;
 * transformers' eager attention also rounds its bfloat16 weights before the values' product. */
static inline __attribute__((always_inline)) void value_pairs_block(float *o, const float *p, const uint32_t *pairs,
                                                                    int64_t dim_v, const int rows, const int nb) {
    __m512 acc[RB][KV];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) acc[r][b] = _mm512_loadu_ps(o + r * dim_v + 16 * b);
    for (int64_t t = 0; t < KC / 2; t++) {
        __m512i vt[KV];
        for (int b = 0; b < nb; b++) vt[b] = _mm512_loadu_si512(pairs + t * dim_v + 16 * b);
        for (int r = 0; r < rows; r++) {
            uint32_t pair;
            memcpy(&pair, (const uint16_t *)(p + r * KC) + 2 * t, sizeof pair);
            __m512bh pt = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int b = 0; b < nb; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], pt, (__m512bh)vt[b]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) _mm512_storeu_ps(o + r * dim_v + 16 * b, acc[r][b]);
}

#endif

/* The weighted values of dims [d, d + 16 nb): value_pairs_block where pairs (vc then holds the
 * chunk's values as pairs of keys), else values_block. */
static inline __attribute__((always_inline)) void values_dims(float *o, const float *p, const float *vc, int64_t d,
                                                              int64_t dim_v, const int rows, const int nb,
                                                              const int pairs) {
#ifdef __AVX512BF16__
    if (pairs) {
        value_pairs_block(o + d, p, (const uint32_t *)vc + d, dim_v, rows, nb);
        return;
    }
#endif
    (void)pairs;
    values_block(o + d, p, vc + d, dim_v, rows, nb);
}

/* values_dims over dims [0, dim_v) (a multiple of 16) in blocks of KV vectors, then the last 1-3. */
static inline __attribute__((always_inline)) void values_rows(float *o, const float *p, const float *vc,
                                                              int64_t dim_v, const int rows, const int pairs) {
    int64_t d = 0;
    for (; d + 16 * KV <= dim_v; d += 16 * KV) values_dims(o, p, vc, d, dim_v, rows, KV, pairs);
    switch ((dim_v - d) / 16) {
    case 3: values_dims(o, p, vc, d, dim_v, rows, 3, pairs); break;
    case 2: values_dims(o, p, vc, d, dim_v, rows, 2, pairs); break;
    case 1: values_dims(o, p, vc, d, dim_v, rows, 1, pairs); break;
    default: break;
    }
}

/* o[m] += sum_j s[m, j] vc[j] for vectors [m, m_count) (a vector that sees none of the chunk has zero
 * weights: its outputs, never -0, stay as they are). */
static void weighted_values(const Scratch *w, const Shape *sh, int64_t m, int64_t m_count) {
    int64_t dim_v = sh->dim_v;
    if (sh->pairs) {
        for (; m + RB <= m_count; m += RB) values_rows(w->o + m * dim_v, w->s + m * KC, w->vc, dim_v, RB, 1);
        for (; m < m_count; m++) values_rows(w->o + m * dim_v, w->s + m * KC, w->vc, dim_v, 1, 1);
        return;
    }
    for (; m + RB <= m_count; m += RB) values_rows(w->o + m * dim_v, w->s + m * KC, w->vc, dim_v, RB, 0);
    for (; m < m_count; m++) values_rows(w->o + m * dim_v, w->s + m * KC, w->vc, dim_v, 1, 0);
}

/* One tile: queries [i0, i0 + rows) of a span whose query 0 sits at position p0, for KV head h. */
static void attend_tile(const Rows *q, const Cache *k, const Cache *v, const int64_t *table, const Shape *sh,
                        int64_t lo, int64_t p0, int64_t i0, int64_t rows, int64_t h, const float *sinks,
                        const Rows *out, const Scratch *w) {
    int64_t g_count = sh->group, m_count = rows * g_count;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t g = 0; g < g_count; g++) {
            int64_t src = (i0 + i) * q->row_stride + (h * g_count + g) * q->head_stride;
            float *dst = w->q + (i * g_count + g) * sh->dim;
            if (sh->pairs) /* the bfloat16 values as they are, scaled after their dot products */
                memcpy((uint16_t *)w->q + (i * g_count + g) * sh->dim, (const uint16_t *)q->base + src,
                       sizeof(uint16_t) * sh->dim);
            else
                for (int64_t d = 0; d < sh->dim; d++) dst[d] = widen(q->base, q->kind, src + d) * sh->scale;
            int64_t m = i * g_count + g;
            w->top[m] = sinks ? sinks[h * g_count + g] : -INFINITY;
            w->total[m] = sinks ? 1.0f : 0.0f;
        }
    memset(w->o, 0, sizeof(float) * m_count * sh->dim_v);
    int64_t first_pos = p0 + i0, last_pos = p0 + i0 + rows - 1;
    int64_t from = sh->window > 0 && first_pos - sh->window + 1 > lo ? first_pos - sh->window + 1 : lo;
    for (int64_t pos0 = from - from % KC; pos0 <= last_pos; pos0 += KC) {
        if (sh->pairs)
            pack_pairs_chunk(k, v, table, sh, h, pos0, from, last_pos + 1, (uint32_t *)w->kt, (uint32_t *)w->vc);
        else
            pack_chunk(k, v, table, sh, h, pos0, from, last_pos + 1, w->kt, w->vc);
        /* Queries before the chunk see none of it: only the tile's later vectors take part. */
        int64_t m_first = pos0 > first_pos ? (pos0 - first_pos) * g_count : 0;
        scores(w, sh, m_first, m_count);
        for (int64_t m = m_first; m < m_count; m++) {
            int64_t p = first_pos + m / g_count;
            int64_t first = sh->window > 0 && p - sh->window + 1 > lo ? p - sh->window + 1 : lo;
            softmax_step(w, m, pos0, first, p, sh->dim_v, sh->pairs);
        }
        weighted_values(w, sh, m_first, m_count);
    }
    for (int64_t m = 0; m < m_count; m++) {
        int64_t i = m / g_count, g = m % g_count;
        float inv = w->total[m] > 0.0f ? 1.0f / w->total[m] : 0.0f;
        int64_t dst = (i0 + i) * out->row_stride + (h * g_count + g) * out->head_stride;
        const float *o = w->o + m * sh->dim_v;
        if (out->kind == ELEM_F32) {
            for (int64_t d = 0; d < sh->dim_v; d++) ((float *)out->base)[dst + d] = o[d] * inv;
        } else {
            for (int64_t d = 0; d < sh->dim_v; d++) ((uint16_t *)out->base)[dst + d] = bf16_round(o[d] * inv);
        }
    }
}

/* Returns 0, or -1 when a thread's scratch could not be allocated (out is then incomplete).
 * spans: int64 [n, 5] row-major, per span its first query row, its request (row of tables), its
 * query count, the first key position any of its queries sees (lo) and one past its last (hi).
 * window: 0 for none. dim_v must be a multiple of 16. q_kind, out_kind: the query's and the output's
 * element kinds (ELEM_F32 or ELEM_BF16; a bfloat16 output is rounded to nearest, ties to even, as
 * torch's .to(bfloat16)). */
int pypto_prefill_attention(const void *q, int q_kind, int64_t q_row_stride, int64_t q_head_stride,
                            const void *key_cache, const void *value_cache, int kind, const int64_t *k_strides,
                            const int64_t *v_strides, const int64_t *tables, int64_t table_stride, const int64_t *spans,
                            int64_t n, int64_t num_q_heads, int64_t num_kv_heads, int64_t dim, int64_t dim_v,
                            int64_t block_size, int64_t window, float scale, const float *sinks, void *out,
                            int out_kind, int64_t out_row_stride, int64_t out_head_stride, int threads) {
    Cache k = {key_cache, kind, k_strides[0], k_strides[1], k_strides[2]};
    Cache v = {value_cache, kind, v_strides[0], v_strides[1], v_strides[2]};
    Shape sh = {num_q_heads / num_kv_heads, dim, dim_v, block_size, window, scale, 0};
#ifdef __AVX512BF16__
    sh.pairs = q_kind == ELEM_BF16 && kind == ELEM_BF16 && dim % 2 == 0;
#endif
    int64_t *starts = malloc(sizeof(int64_t) * (n + 1));
    if (starts == NULL) return -1;
    starts[0] = 0; /* the first work item of each span: its tiles times the KV heads */
    for (int64_t s = 0; s < n; s++) starts[s + 1] = starts[s] + (spans[s * 5 + 2] + QT - 1) / QT * num_kv_heads;
    int64_t m_max = QT * sh.group, items = starts[n];
    size_t floats = (size_t)(m_max * (dim + KC + dim_v + 2) + dim * KC + KC * dim_v);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        Scratch w;
        w.q = malloc(sizeof(float) * floats);
        failed = w.q == NULL;
        if (w.q != NULL) {
            w.s = w.q + m_max * dim;
            w.o = w.s + m_max * KC;
            w.top = w.o + m_max * dim_v;
            w.total = w.top + m_max;
            w.kt = w.total + m_max;
            w.vc = w.kt + dim * KC;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (w.q == NULL) continue;
            int64_t s = 0;
            while (starts[s + 1] <= item) s++;
            const int64_t *span = spans + s * 5;
            int64_t local = item - starts[s], tile = local / num_kv_heads, h = local % num_kv_heads;
            int64_t i0 = tile * QT, rows = span[2] - i0 < QT ? span[2] - i0 : QT;
            Rows qs = {(char *)q + span[0] * q_row_stride * (q_kind == ELEM_F32 ? 4 : 2), q_kind, q_row_stride,
                       q_head_stride};
            Rows os = {(char *)out + span[0] * out_row_stride * (out_kind == ELEM_F32 ? 4 : 2), out_kind,
                       out_row_stride, out_head_stride};
            attend_tile(&qs, &k, &v, tables + span[1] * table_stride, &sh, span[3], span[4] - span[2], i0, rows, h,
                        sinks, &os, &w);
        }
        free(w.q);
    }
    free(starts);
    return failed ? -1 : 0;
}
