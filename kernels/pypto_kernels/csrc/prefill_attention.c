/* Causal attention of long query runs (prefill chunks) over a paged K/V cache, read in place
 * (pypto_kernels.native.prefill_attention).
 *
 * A span is one request's run of n queries at positions hi - n .. hi - 1; query i sees the keys at
 * positions [max(lo, p_i - window + 1), p_i] of its request's block table (no window: from lo).
 * Work items are (span, KV head, tile of QT queries), spread over OpenMP threads (the process's
 * runtime, shared with torch's). A tile's M = QT x G query vectors (its queries times the G query
 * heads of the KV head) run as one block, flash-attention style, over its keys in chunks of KC
 * positions: each chunk's keys are packed transposed and its values widened to float32 once for all
 * M vectors (of which only the queries at or after the chunk take part: causal). The vectors are
 * taken GL = 16 at a time, one to a lane (a lane group, their dims transposed once a tile): a group's
 * scores come out transposed (one vector a key, its lanes the group's vectors; scores_t, JB keys'
 * accumulators at a time), so the online softmax (each vector's running maximum and denominator) is
 * lane-wise work on whole vectors, with no maximum or sum across a vector's lanes and no scalar state
 * a vector, and the weights stay where the weighted values read them, a vector's in its lane. The
 * weighted values are added to M running outputs (RB vectors x 64 dims a block, each weight
 * broadcast from its lane), divided by the denominators at the end. A per-query-head sink logit,
 * when given, starts each vector's maximum and denominator (a logit with no value).
 *
 * Where the CPU has AVX512-BF16 and the queries and the keys are bfloat16, the scores are its pair
 * dot products of the values as they are (pair_scores_t), scaled after, and the weighted values are
 * pair dot products too (value_pairs_block): each weight rounded to bfloat16 (as transformers' eager
 * attention rounds its bfloat16 softmax before the values' product; the denominator sums the rounded
 * weights), two keys' at a time by VCVTNE2PS2BF16 and interleaved into pairs (round_pair), the
 * chunk's values packed as pairs of keys and its keys as pairs of dims transposed 16 x 16 at a time
 * (pack_pairs_chunk), the exponentials scaled by VSCALEFPS (vexp_nonpositive).
 *
 * On the 2-core Zen 4 EPYC of docs/benchmarks.md, a 4,096-token prompt's attention with Qwen3-shaped
 * 4 query and 2 KV heads of 64 dims in bfloat16: chunks of 64 keys with both products blocked (against
 * chunks of 16 and the weighted values a vector at a time) 103 -> 146 GFLOP/s; pair dot products for
 * the scores 187, for the values too 270; lane groups (the softmax a vector at a time took a quarter of
 * the time: its reductions across lanes, its scalar state, a comparison chain through the chunk)
 * 269 -> 309 (1.15x), 2,048 tokens of Qwen3-0.6B's 16 and 8 heads of 128 dims 303 -> 331 (1.09x),
 * float32 1.04-1.07x, short prompts 1.02-1.12x, the same bits.
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

#ifdef __AVX512BW__
/* Word indices that interleave two vectors of 32 bfloat16 values a and b (indices 32 .. 63: b's) as
 * pairs a[i], b[i]: the first 16 pairs, then the last 16. */
static const int16_t INTERLEAVE[64] = {
    0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
    11, 43, 12, 44, 13, 45, 14, 46, 15, 47, 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
    22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
#endif

/* KC keys a chunk (KV vectors of 16), QT queries a tile; RB query vectors share each load of a chunk's
 * keys or values (RB x KV accumulators: 24 of AVX-512's 32 registers; 12 vectors, 24 AVX2 ones, without). */
enum { KC = 64, KV = KC / 16, QT = 64 };
_Static_assert(KV == 4, "weights_and_sums adds a chunk's four runs of 16 keys");
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
    int pairs; /* scores and weighted values as bfloat16 pair dot products (pair_scores_t, value_pairs_block) */
} Shape;

/* Query or output rows: float32 or bfloat16 elements, row and head strides in elements. */
typedef struct {
    void *base;
    int kind;
    int64_t row_stride, head_stride;
} Rows;

/* A thread's working memory for one tile of M query vectors, M_pad of them padded to whole lane
 * groups of GL: the query vectors and weights by lane group, a group's lane l holding vector
 * GL g + l's. */
typedef struct {
    float *q;              /* [M_pad / GL][dim][GL] queries times the scale, or [][dim / 2][GL] bfloat16 pairs */
    float *st;             /* [KC][GL] one group's scores, transposed */
    float *wt;             /* [M_pad / GL][KC][GL] weights, or [][KC / 2][GL] pairs of bfloat16 weights */
    float *o;              /* [M, dim_v] running outputs */
    float *top;            /* [M_pad] running maxima */
    float *total;          /* [M_pad] running denominators */
    int32_t *first, *last; /* [M_pad] visible positions' bounds, relative to the tile's first position */
    float *kt;             /* [dim, KC] the chunk's keys, transposed */
    float *vc;             /* [KC, dim_v] the chunk's values */
} Scratch;

/* The cache rows of positions [pos0, pos0 + KC) for KV head h into krow / vrow (elements of the
 * caches' kind); NULL for positions outside [from, to), which are never read (blocks before a window
 * may be gone) and pack as zeros. */
static void chunk_rows(const Cache *k, const Cache *v, const int64_t *table, const Shape *sh, int64_t h,
                       int64_t pos0, int64_t from, int64_t to, const char *krow[KC], const char *vrow[KC]) {
    int64_t size = k->kind == ELEM_F32 ? 4 : 2, entry = pos0 / sh->block_size, off = pos0 % sh->block_size;
    for (int64_t j = 0; j < KC; j++, off++) { /* the table walked entry by entry: no division a key */
        if (off == sh->block_size) entry++, off = 0;
        int64_t pos = pos0 + j, block = pos < from || pos >= to ? -1 : table[entry];
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
    for (int64_t t = 0; t < KC / 2; t++) {
        int64_t d = 0;
#ifdef __AVX512BW__
        /* 32 dims of both keys at a time, interleaved by two permutations of their 64 values */
        const uint16_t *ev = (const uint16_t *)vrow[2 * t], *od = (const uint16_t *)vrow[2 * t + 1];
        for (; d + 32 <= sh->dim_v; d += 32) {
            __m512i even = ev ? _mm512_loadu_si512(ev + d) : _mm512_setzero_si512();
            __m512i odd = od ? _mm512_loadu_si512(od + d) : _mm512_setzero_si512();
            __m512i first = _mm512_loadu_si512(INTERLEAVE), last = _mm512_loadu_si512(INTERLEAVE + 32);
            _mm512_storeu_si512(vc + t * sh->dim_v + d, _mm512_permutex2var_epi16(even, first, odd));
            _mm512_storeu_si512(vc + t * sh->dim_v + d + 16, _mm512_permutex2var_epi16(even, last, odd));
        }
#endif
        for (; d < sh->dim_v; d += 16) {
            vh even = {0}, odd = {0};
            if (vrow[2 * t]) memcpy(&even, (const uint16_t *)vrow[2 * t] + d, sizeof even);
            if (vrow[2 * t + 1]) memcpy(&odd, (const uint16_t *)vrow[2 * t + 1] + d, sizeof odd);
            vu pair = __builtin_convertvector(even, vu) | __builtin_convertvector(odd, vu) << 16;
            memcpy(vc + t * sh->dim_v + d, &pair, sizeof pair);
        }
    }
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

/* Query vectors are taken GL at a time, one to a lane (a lane group): the scores of a group come out
 * transposed (one vector a key, holding its score for each of the group's query vectors), so that
 * the softmax's maxima, exponentials, roundings and sums are lane-wise work on whole vectors, with no
 * sum or maximum across the lanes of a vector and no scalar state a vector. Each lane computes what
 * the per-vector order computed (every score one chain over the dims, the same exponential, the
 * denominator's additions in the same tree), so the results are the same bits. */
enum { GL = 16, JB = 16 };
_Static_assert(KC % JB == 0 && JB == 16, "a group's scores are computed JB keys at a time");

/* A group's KC scores, one chain over the dims in order from zero for each key and lane: JB keys' x
 * GL lanes' accumulators at a time, each load of the group's transposed query dims shared by the JB
 * keys, each key's value broadcast. Float32: qg [dim][GL] (the queries times the scale), kt [dim][KC];
 * into st [KC][GL]. */
static void scores_t(const float *qg, const float *kt, int64_t dim, float *st) {
    for (int64_t j0 = 0; j0 < KC; j0 += JB) {
        vf acc[JB];
        for (int j = 0; j < JB; j++) acc[j] = splat(0.0f);
        for (int64_t d = 0; d < dim; d++) {
            vf qv = vload(qg + d * GL);
            for (int j = 0; j < JB; j++) acc[j] += qv * kt[d * KC + j0 + j];
        }
        for (int j = 0; j < JB; j++) vstore(st + (j0 + j) * GL, acc[j]);
    }
}

#ifdef __AVX512BF16__
/* acc + the pair dot products of q's pairs and the bfloat16 pair at k, broadcast to every lane by the
 * instruction's own load ({1to16}): one VDPBF16PS, each lane's odd product added first, then its even
 * one (products exact, subnormals flushed). */
static inline __attribute__((always_inline)) __m512 dot_bcast(__m512 acc, __m512i q, const uint32_t *k) {
    typedef uint32_t __attribute__((may_alias)) pair_t;
    __asm__("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const pair_t *)k), "v"(q));
    return acc;
}

/* scores_t for bfloat16 queries and keys (sh->pairs): qg [dim / 2][GL] pairs of the queries' unscaled
 * bfloat16 values, kt [dim / 2][KC] the chunk's keys as pairs of dims; each score one chain of pair
 * dot products over the pairs in order from zero, then times the scale. */
static void pair_scores_t(const uint32_t *qg, const uint32_t *kt, int64_t pairs, float scale, float *st) {
    for (int64_t j0 = 0; j0 < KC; j0 += JB) {
        __m512 acc[JB];
        for (int j = 0; j < JB; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < pairs; d++) {
            __m512i qv = _mm512_loadu_si512(qg + d * GL);
            for (int j = 0; j < JB; j++) acc[j] = dot_bcast(acc[j], qv, kt + d * KC + j0 + j);
        }
        for (int j = 0; j < JB; j++) _mm512_storeu_ps(st + (j0 + j) * GL, _mm512_mul_ps(acc[j], _mm512_set1_ps(scale)));
    }
}

/* Keys 2t and 2t + 1's weights of the group's lanes (lo, hi) rounded to bfloat16 (to nearest, ties to
 * even; they are finite, and 0 or at least e**-87, never subnormal), stored as one pair a lane (key
 * 2t's in the low half, as value_pairs_block reads a pair), and lo, hi made the rounded values. */
static inline void round_pair(vf *lo, vf *hi, uint32_t *dst) {
    static const int16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    __m512 l, h;
    memcpy(&l, lo, sizeof l);
    memcpy(&h, hi, sizeof h);
    __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(h, l); /* lo's 16 values, then hi's */
    __m512i pairs = _mm512_permutexvar_epi16(_mm512_loadu_si512(interleave), halves);
    _mm512_storeu_si512(dst, pairs);
    __m512 wl = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    __m512 wh = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
    memcpy(lo, &wl, sizeof wl);
    memcpy(hi, &wh, sizeof wh);
}
#endif

/* Keys l and l + 1's weights of each of the chunk's four runs of 16 keys (e[2q], e[2q + 1]: keys 16q + l,
 * 16q + l + 1) into the group's weights wg: rounded to bfloat16 in pairs where pairs (wg [KC / 2][GL]),
 * else as they are (wg [KC][GL]); e made the values stored. */
static inline void store_weights(vf e[8], int64_t l, float *wg, int pairs) {
#ifdef __AVX512BF16__
    if (pairs) {
        for (int q = 0; q < 4; q++) round_pair(&e[2 * q], &e[2 * q + 1], (uint32_t *)wg + (16 * q + l) / 2 * GL);
        return;
    }
#endif
    (void)pairs;
    for (int q = 0; q < 4; q++) {
        vstore(wg + (16 * q + l) * GL, e[2 * q]);
        vstore(wg + (16 * q + l + 1) * GL, e[2 * q + 1]);
    }
}

/* Score j of the group (st) masked to each lane's visible keys (where masked: -inf outside
 * lo <= j <= hi, stored back). */
static inline vf masked_at(float *st, int j, vi lo, vi hi, int masked) {
    vf x = vload(st + j * GL);
    if (masked) {
        vi at = {j, j, j, j, j, j, j, j, j, j, j, j, j, j, j, j};
        x = vselect((at < lo) | (at > hi), splat(-INFINITY), x);
        vstore(st + j * GL, x);
    }
    return x;
}

/* The group's scores (st) masked to each lane's visible keys (key j visible where lo <= j <= hi, its
 * offsets from the chunk's first position; masked: some lane does not see every key); returns each
 * lane's largest (of finite scores: any order of the comparisons gives it). Four independent chains of
 * comparisons: one chain waited on each comparison's latency, a tenth of a long prompt's attention. */
static vf mask_and_max(float *st, vi lo, vi hi, int masked) {
    vf m0 = splat(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    for (int j = 0; j < KC; j += 4) {
        vf x0 = masked_at(st, j, lo, hi, masked), x1 = masked_at(st, j + 1, lo, hi, masked);
        vf x2 = masked_at(st, j + 2, lo, hi, masked), x3 = masked_at(st, j + 3, lo, hi, masked);
        m0 = vselect(x0 > m0, x0, m0), m1 = vselect(x1 > m1, x1, m1);
        m2 = vselect(x2 > m2, x2, m2), m3 = vselect(x3 > m3, x3, m3);
    }
    m0 = vselect(m1 > m0, m1, m0), m2 = vselect(m3 > m2, m3, m2);
    return vselect(m2 > m0, m2, m0);
}

/* The group's weights e**(score - top) (top: each lane's new running maximum; a lane that has seen no
 * key yet has only zero weights) into wg (store_weights), returning each lane's sum of them, added in
 * sum_lanes' tree over its four runs of 16 keys as the per-vector order added them:
 * ((e0 + e1) + (e2 + e3)) a lane position, then positions l and l + 8, l and l + 4, l and l + 2, 0 and 1. */
static vf weights_and_sums(const float *st, vf top, float *wg, int pairs) {
    vf safe = vselect(top == splat(-INFINITY), splat(0.0f), top), t[16];
    for (int64_t l = 0; l < 16; l += 2) {
        vf e[8];
        for (int q = 0; q < 4; q++) {
            e[2 * q] = vexp_nonpositive(vload(st + (16 * q + l) * GL) - safe);
            e[2 * q + 1] = vexp_nonpositive(vload(st + (16 * q + l + 1) * GL) - safe);
        }
        store_weights(e, l, wg, pairs);
        t[l] = (e[0] + e[2]) + (e[4] + e[6]);
        t[l + 1] = (e[1] + e[3]) + (e[5] + e[7]);
    }
    for (int width = 8; width >= 2; width /= 2)
        for (int l = 0; l < width; l++) t[l] = t[l] + t[l + width];
    return t[0] + t[1];
}

/* One group's softmax over the chunk (its scores in w->st, its lanes' visible offsets lo and hi):
 * folds them into the lanes' running maxima and denominators, rescales the outputs of the vectors
 * whose maximum grew, and leaves the weights in the group's part of w->wt. A lane that sees none of
 * the chunk gets zero weights and keeps its state. */
static void softmax_group(const Scratch *w, const Shape *sh, int64_t g, vi lo, vi hi, int masked) {
    vf top = vload(w->top + g * GL), most = mask_and_max(w->st, lo, hi, masked);
    vf grown = vselect(top > most, top, most), keep = splat(1.0f);
    float *wg = w->wt + g * GL * (sh->pairs ? KC / 2 : KC);
    vf sums = weights_and_sums(w->st, grown, wg, sh->pairs);
    for (int l = 0; l < GL; l++) /* a maximum grows in few chunks: the scalar exponential there */
        if (grown[l] != top[l]) keep[l] = exp_nonpositive(top[l] - grown[l]);
    vstore(w->total + g * GL, vload(w->total + g * GL) * keep + sums);
    vstore(w->top + g * GL, grown);
    for (int l = 0; l < GL; l++)
        if (keep[l] != 1.0f) {
            float *o = w->o + (g * GL + l) * sh->dim_v;
#pragma omp simd
            for (int64_t d = 0; d < sh->dim_v; d++) o[d] *= keep[l];
        }
}

/* c[r][0 .. 16 nb) (row stride ldc) += sum over k < KC of a[r][k * GL] b[k * ldb + 0 .. 16 nb) for
 * ``rows`` rows (rows and nb constants where inlined): each output one chain of multiply-adds over k
 * in order, from its value, each load of b's row k shared by the rows (RB x KV accumulators in
 * registers). The weighted values: a a vector's weights in its lane of its group's, b the chunk's
 * values. */
static inline __attribute__((always_inline)) void values_block(float *c, int64_t ldc, const float *const *a,
                                                               const float *b, int64_t ldb, const int rows,
                                                               const int nb) {
    vf acc[RB][KV];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nb; v++) acc[r][v] = vload(c + r * ldc + 16 * v);
    for (int64_t k = 0; k < KC; k++) {
        vf bk[KV];
        for (int v = 0; v < nb; v++) bk[v] = vload(b + k * ldb + 16 * v);
        for (int r = 0; r < rows; r++) {
            vf ak = splat(a[r][k * GL]);
            for (int v = 0; v < nb; v++) acc[r][v] += ak * bk[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nb; v++) vstore(c + r * ldc + 16 * v, acc[r][v]);
}

#ifdef __AVX512BF16__
/* values_block for bfloat16 weights and values (sh->pairs): a[r] a vector's weight pairs in its lane
 * of its group's ([KC / 2][GL]), pairs the chunk's values as pairs of keys ([KC / 2, dim_v] of two
 * bfloat16 each: key 2t's value, then key 2t + 1's); each output one chain of AVX512-BF16 pair dot
 * products over the key pairs in order (the odd key's exact product added first, then the even one's;
 * subnormals flushed), added to c. Half the instructions of widening each value to float32 and
 * multiplying it by a float32 weight; transformers' eager attention also rounds its bfloat16 weights
 * before the values' product. */
static inline __attribute__((always_inline)) void value_pairs_block(float *c, int64_t ldc, const float *const *a,
                                                                    const uint32_t *pairs, const int rows,
                                                                    const int nb) {
    __m512 acc[RB][KV];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) acc[r][b] = _mm512_loadu_ps(c + r * ldc + 16 * b);
    for (int64_t t = 0; t < KC / 2; t++) {
        __m512i vt[KV];
        for (int b = 0; b < nb; b++) vt[b] = _mm512_loadu_si512(pairs + t * ldc + 16 * b);
        for (int r = 0; r < rows; r++) {
            __m512bh pt = (__m512bh)_mm512_set1_epi32(((const int32_t *)a[r])[t * GL]);
            for (int b = 0; b < nb; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], pt, (__m512bh)vt[b]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) _mm512_storeu_ps(c + r * ldc + 16 * b, acc[r][b]);
}
#endif

/* The weighted values of dims [d, d + 16 nb): value_pairs_block where pairs (vc then holds the
 * chunk's values as pairs of keys), else values_block. */
static inline __attribute__((always_inline)) void values_dims(float *o, const float *const *a, const float *vc,
                                                              int64_t d, int64_t dim_v, const int rows, const int nb,
                                                              const int pairs) {
#ifdef __AVX512BF16__
    if (pairs) {
        value_pairs_block(o + d, dim_v, a, (const uint32_t *)vc + d, rows, nb);
        return;
    }
#endif
    (void)pairs;
    values_block(o + d, dim_v, a, vc + d, dim_v, rows, nb);
}

/* values_dims over dims [0, dim_v) (a multiple of 16) in blocks of KV vectors, then the last 1-3. */
static inline __attribute__((always_inline)) void values_rows(float *o, const float *const *a, const float *vc,
                                                              int64_t dim_v, const int rows, const int pairs) {
    int64_t d = 0;
    for (; d + 16 * KV <= dim_v; d += 16 * KV) values_dims(o, a, vc, d, dim_v, rows, KV, pairs);
    switch ((dim_v - d) / 16) {
    case 3: values_dims(o, a, vc, d, dim_v, rows, 3, pairs); break;
    case 2: values_dims(o, a, vc, d, dim_v, rows, 2, pairs); break;
    case 1: values_dims(o, a, vc, d, dim_v, rows, 1, pairs); break;
    default: break;
    }
}

/* o[m] += sum_j weight[m, j] vc[j] for vectors [m, m_count) (a vector that sees none of the chunk has
 * zero weights: its outputs, never -0, stay as they are), RB vectors a block. */
static void weighted_values(const Scratch *w, const Shape *sh, int64_t m, int64_t m_count) {
    int64_t dim_v = sh->dim_v, per = sh->pairs ? KC / 2 : KC;
    for (; m < m_count; m += RB) {
        const float *a[RB];
        int rows = m_count - m < RB ? (int)(m_count - m) : RB;
        for (int r = 0; r < rows; r++) a[r] = w->wt + (m + r) / GL * GL * per + (m + r) % GL;
        float *o = w->o + m * dim_v;
        if (rows == RB && sh->pairs) values_rows(o, a, w->vc, dim_v, RB, 1);
        else if (rows == RB) values_rows(o, a, w->vc, dim_v, RB, 0);
        else if (sh->pairs)
            for (int r = 0; r < rows; r++) values_rows(o + r * dim_v, a + r, w->vc, dim_v, 1, 1);
        else
            for (int r = 0; r < rows; r++) values_rows(o + r * dim_v, a + r, w->vc, dim_v, 1, 0);
    }
}

/* 16 units of a query vector from unit u (src: its first element): float32 values times the scale,
 * or with pairs 16 pairs of bfloat16 values as they are; zeros for a padding lane (src < 0). */
static inline vu query16(const Rows *q, const Shape *sh, int64_t src, int64_t u) {
    vu bits = {0};
    if (src < 0) return bits;
    if (sh->pairs) {
        memcpy(&bits, (const uint16_t *)q->base + src + 2 * u, sizeof bits);
        return bits;
    }
    vf x = q->kind == ELEM_F32 ? vload((const float *)q->base + src + u)
                               : vload_bf16((const uint16_t *)q->base + src + u);
    x *= sh->scale;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

/* The tile's query vectors (queries [i0, i0 + rows) of q, KV head h) into w->q transposed by lane
 * group (query16's units), the lanes past the last vector zero: 16 x 16 blocks transposed in
 * registers (a unit at a time, each vector's units went to as many cache lines), the last units of a
 * width not divisible by 16 one by one. Each vector's running maximum and denominator set (a sink
 * logit, when given, as a logit with no value), and its visible positions' bounds relative to the
 * tile's first position (first[m] .. last[m]; none for the padding lanes). */
static void start_tile(const Rows *q, const Shape *sh, int64_t lo, int64_t first_pos, int64_t i0, int64_t rows,
                       int64_t h, const float *sinks, const Scratch *w) {
    int64_t g_count = sh->group, m_count = rows * g_count, m_pad = (m_count + GL - 1) / GL * GL;
    int64_t width = sh->pairs ? sh->dim / 2 : sh->dim, full = width / 16 * 16, src[GL];
    for (int64_t m0 = 0; m0 < m_pad; m0 += GL) {
        uint32_t *group = (uint32_t *)w->q + m0 * width;
        for (int64_t l = 0; l < GL; l++) {
            int64_t m = m0 + l, i = m / g_count, g = m % g_count, p = first_pos + i;
            int64_t first = sh->window > 0 && p - sh->window + 1 > lo ? p - sh->window + 1 : lo;
            src[l] = m < m_count ? (i0 + i) * q->row_stride + (h * g_count + g) * q->head_stride : -1;
            for (int64_t u = full; u < width; u++) { /* query16's unit u alone */
                uint32_t *unit = group + u * GL + l;
                if (src[l] >= 0 && sh->pairs) {
                    memcpy(unit, (const uint16_t *)q->base + src[l] + 2 * u, sizeof *unit);
                } else {
                    float x = src[l] < 0 ? 0.0f : widen(q->base, q->kind, src[l] + u) * sh->scale;
                    memcpy(unit, &x, sizeof x);
                }
            }
            w->top[m] = m < m_count && sinks ? sinks[h * g_count + g] : -INFINITY;
            w->total[m] = m < m_count && sinks ? 1.0f : 0.0f;
            w->first[m] = m < m_count ? (int32_t)(first - first_pos) : INT32_MAX / 2;
            w->last[m] = m < m_count ? (int32_t)i : -INT32_MAX / 2;
        }
        for (int64_t u = 0; u < full; u += 16) {
            vu block[16];
            for (int l = 0; l < GL; l++) block[l] = query16(q, sh, src[l], u);
            transpose16(block);
            for (int j = 0; j < 16; j++) memcpy(group + (u + j) * GL, &block[j], sizeof block[j]);
        }
    }
    memset(w->o, 0, sizeof(float) * m_count * sh->dim_v);
}

/* Each group's scores and softmax over the chunk at pos0 (offset rel from the tile's first position),
 * from the group holding vector m_first (the tile's first vector the chunk can be visible to). */
static void groups_softmax(const Scratch *w, const Shape *sh, int64_t m_first, int64_t m_count, int64_t rel) {
    int64_t width = sh->pairs ? sh->dim / 2 : sh->dim;
    for (int64_t g = m_first / GL; g * GL < m_count; g++) {
        const float *qg = w->q + g * GL * width;
#ifdef __AVX512BF16__
        if (sh->pairs) pair_scores_t((const uint32_t *)qg, (const uint32_t *)w->kt, width, sh->scale, w->st);
        else
#endif
            scores_t(qg, w->kt, width, w->st);
        vi lo, hi, offset = {0};
        memcpy(&lo, w->first + g * GL, sizeof lo);
        memcpy(&hi, w->last + g * GL, sizeof hi);
        offset += (int32_t)rel;
        lo -= offset, hi -= offset;
        vi full = (lo > 0) | (hi < KC - 1); /* some lane does not see every key */
        int masked = 0;
        for (int l = 0; l < GL; l++) masked |= full[l] != 0;
        softmax_group(w, sh, g, lo, hi, masked);
    }
}

/* One tile: queries [i0, i0 + rows) of a span whose query 0 sits at position p0, for KV head h. */
static void attend_tile(const Rows *q, const Cache *k, const Cache *v, const int64_t *table, const Shape *sh,
                        int64_t lo, int64_t p0, int64_t i0, int64_t rows, int64_t h, const float *sinks,
                        const Rows *out, const Scratch *w) {
    int64_t g_count = sh->group, m_count = rows * g_count;
    int64_t first_pos = p0 + i0, last_pos = p0 + i0 + rows - 1;
    start_tile(q, sh, lo, first_pos, i0, rows, h, sinks, w);
    int64_t from = sh->window > 0 && first_pos - sh->window + 1 > lo ? first_pos - sh->window + 1 : lo;
    for (int64_t pos0 = from - from % KC; pos0 <= last_pos; pos0 += KC) {
        if (sh->pairs)
            pack_pairs_chunk(k, v, table, sh, h, pos0, from, last_pos + 1, (uint32_t *)w->kt, (uint32_t *)w->vc);
        else
            pack_chunk(k, v, table, sh, h, pos0, from, last_pos + 1, w->kt, w->vc);
        /* Queries before the chunk see none of it: only the tile's later vectors take part. */
        int64_t m_first = pos0 > first_pos ? (pos0 - first_pos) * g_count : 0;
        groups_softmax(w, sh, m_first, m_count, pos0 - first_pos);
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
    int64_t m_max = QT * sh.group, m_pad = (m_max + GL - 1) / GL * GL, items = starts[n];
    size_t floats = (size_t)(m_pad * (dim + KC + 4) + KC * GL + m_max * dim_v + dim * KC + KC * dim_v);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        Scratch w;
        w.q = malloc(sizeof(float) * floats);
        failed = w.q == NULL;
        if (w.q != NULL) {
            w.st = w.q + m_pad * dim;
            w.wt = w.st + KC * GL;
            w.o = w.wt + m_pad * KC;
            w.top = w.o + m_max * dim_v;
            w.total = w.top + m_pad;
            w.first = (int32_t *)(w.total + m_pad);
            w.last = w.first + m_pad;
            w.kt = (float *)(w.last + m_pad);
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
