/* Paged attention of query rows over a paged K/V cache, read in place (pypto_kernels.native).
 *
 * Each query row r attends, for every KV head h, the keys at positions [lo[r], lo[r] + count[r])
 * of its request's block table with the G = Hq / Hkv query heads of that KV head: scores q . k
 * times the scale, a float32 softmax (with a per-query-head sink logit in the denominator when
 * sinks is given), and the probability-weighted sum of the value rows. Work items are (row, KV
 * head) pairs, split over OpenMP threads (the process's runtime, shared with torch's) in contiguous
 * ranges of about equal keys; each reads its keys and values once, where they lie, with no copy of
 * the cache, prefetching the rows ahead (the next block's too) and the next item's first rows. On
 * the 2-core Zen 4 EPYC of docs/benchmarks.md that lookahead across items read 64 decode rows' bfloat16
 * caches 13-17 % faster (small shape; Qwen3-0.6B 11 %) than items taken one at a time, dynamically,
 * each starting on rows no prefetch had reached.
 *
 * The caches are [blocks, block_size, Hkv, D] with any strides whose last dimension is dense
 * (element strides sb, st, sh), float32 or bfloat16 (widened exactly to float32 as they are read).
 * Sums run in float32, each in a fixed order (the vectorised loops'), so a call's result depends
 * only on its inputs, never on the threads. Two sets of passes: per key (any dims, any x86 or other
 * build) and blocked (AVX-512 builds, a key dim that is a multiple of 16 and a value dim of 32:
 * 16 keys' scores at once, the value sums in registers; 1.2-2x the per-key passes' speed).
 */
#include <omp.h>

#include "common.h"

/* q . row and acc += p * row over a cache row at element ``index``, its values widened to float32 in
 * the loop itself (a bfloat16 value is the high half of a float32's bits). */
static inline float dot(const float *q, const void *base, int64_t index, int kind, int64_t n) {
    float s = 0.0f;
    if (kind == ELEM_F32) {
        const float *row = (const float *)base + index;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < n; d++) s += q[d] * row[d];
    } else {
        const uint16_t *row = (const uint16_t *)base + index;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < n; d++) s += q[d] * bf16_value(row[d]);
    }
    return s;
}

static inline void add_scaled(float *acc, float p, const void *base, int64_t index, int kind, int64_t n) {
    if (kind == ELEM_F32) {
        const float *row = (const float *)base + index;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) acc[d] += p * row[d];
    } else {
        const uint16_t *row = (const uint16_t *)base + index;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) acc[d] += p * bf16_value(row[d]);
    }
}

/* Softmax of each query head's scores in place (the sink, when given, only in the denominator). */
static void softmax_rows(float *scores, int64_t group, int64_t count, const float *sinks) {
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * count;
        float top = sinks ? sinks[g] : -INFINITY;
        for (int64_t t = 0; t < count; t++) top = sg[t] > top ? sg[t] : top;
        float total = sinks ? exp_nonpositive(sinks[g] - top) : 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < count; t++) {
            sg[t] = exp_nonpositive(sg[t] - top);
            total += sg[t];
        }
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma omp simd
        for (int64_t t = 0; t < count; t++) sg[t] *= inv;
    }
}

typedef struct {
    const float *q;     /* the row's first query head of this KV head */
    const uint16_t *qb; /* the same in bfloat16, for the bfloat16 dot product (NULL: not used) */
    int64_t q_head_stride, group, dim, dim_v, block_size;
    float scale;
    int blocked;  /* the blocked passes (where built and the dims allow) instead of the per-key ones */
    int out_kind; /* the output's elements: ELEM_F32, or ELEM_BF16 rounded as bf16_round */
} Item;

/* 16 outputs at element ``at`` of out, in its kind. */
static inline void put16(void *out, int kind, int64_t at, vf v) {
    if (kind == ELEM_F32)
        vstore((float *)out + at, v);
    else
        store_bf16x16((uint16_t *)out + at, v);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
/* q . row of bfloat16 values with AVX512-BF16's pairwise dot product (exact products, float32 sums;
 * n a multiple of 32), before its lanes are summed: where the query is bfloat16 too, half the
 * instructions of widening each key. */
static inline __m512 dot_bf16_lanes(const uint16_t *q, const uint16_t *row, int64_t n) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 64 <= n; d += 64) {
        even = _mm512_dpbf16_ps(even, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(row + d));
        odd = _mm512_dpbf16_ps(odd, (__m512bh)_mm512_loadu_si512(q + d + 32),
                               (__m512bh)_mm512_loadu_si512(row + d + 32));
    }
    if (d < n) even = _mm512_dpbf16_ps(even, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(row + d));
    return _mm512_add_ps(even, odd);
}
#else
#define HAVE_BF16_DOT 0
#endif

#if defined(__AVX512F__)
#define HAVE_BLOCKED 1
#endif

#if HAVE_BF16_DOT
static inline float dot_bf16(const uint16_t *q, const uint16_t *row, int64_t n) {
    return sum_lanes(dot_bf16_lanes(q, row, n));
}
#else
static inline float dot_bf16(const uint16_t *q, const uint16_t *row, int64_t n) {
    (void)q, (void)row, (void)n;
    return 0.0f; /* never called: pypto_bf16_dot() is 0, so the caller passes no bfloat16 query */
}
#endif

/* 1 where this build has the bfloat16 dot product (the compiling CPU has AVX512-BF16), else 0. */
int pypto_bf16_dot(void) { return HAVE_BF16_DOT; }

#ifndef HAVE_BLOCKED
#define HAVE_BLOCKED 0
#endif
/* 1 where this build has the blocked passes (the compiling CPU has AVX-512), else 0. */
int pypto_attention_blocked(void) { return HAVE_BLOCKED; }

/* Bytes a pass reads ahead of the row it computes, into L2 (not L1): far enough to cover a memory
 * access's latency across the jumps between blocks, which hardware prefetchers do not follow. Into L1
 * the prefetches waited for its few miss buffers: 64 decode rows of Qwen3-0.6B's heads, 200 keys each,
 * on the 2-core Zen 4 EPYC read 14-16 GB/s of float32 cache so (8 KiB ahead) and 20-24 GB/s into L2
 * (4 KiB ahead; 8-12 KiB were no better), against about 31 GB/s for a plain read. Locality 1 is
 * prefetcht2 on x86; not measured on an Intel CPU. */
#define PREFETCH_BYTES 4096

static inline int64_t rows_ahead(int kind, int64_t n) {
    int64_t ahead = PREFETCH_BYTES / (n * (kind == ELEM_F32 ? 4 : 2));
    return ahead < 1 ? 1 : ahead;
}

static inline void prefetch_row(const void *base, int64_t index, int kind, int64_t n) {
    const char *p = (const char *)base + index * (kind == ELEM_F32 ? 4 : 2);
    for (int64_t b = 0; b < n * (kind == ELEM_F32 ? 4 : 2); b += 64) __builtin_prefetch(p + b, 0, 1);
}

/* The element offsets of head h's rows of the keys [lo, lo + count) in a cache: the table is read
 * (and the position divided) once a block. */
static void row_offsets(const Cache *c, const int64_t *table, int64_t lo, int64_t count, int64_t bs, int64_t h,
                        int64_t *index) {
    int64_t t = 0;
    for (int64_t pos = lo, end = lo + count; pos < end;) {
        int64_t off = pos % bs, run = bs - off < end - pos ? bs - off : end - pos;
        int64_t base = table[pos / bs] * c->sb + off * c->st + h * c->sh;
        for (int64_t j = 0; j < run; j++) index[t++] = base + j * c->st;
        pos += run;
    }
}

static void scores_pass(const Item *it, const Cache *k, const int64_t *index, int64_t count, float *scores) {
    int64_t ahead = rows_ahead(k->kind, it->dim);
    for (int64_t t = 0; t < count; t++) {
        if (t + ahead < count) prefetch_row(k->base, index[t + ahead], k->kind, it->dim);
        for (int64_t g = 0; g < it->group; g++) {
            float s = it->qb ? dot_bf16(it->qb + g * it->q_head_stride, (const uint16_t *)k->base + index[t], it->dim)
                             : dot(it->q + g * it->q_head_stride, k->base, index[t], k->kind, it->dim);
            scores[g * count + t] = s * it->scale;
        }
    }
}

static void values_pass(const Item *it, const Cache *v, const int64_t *index, int64_t count, const float *probs,
                        float *acc) {
    int64_t ahead = rows_ahead(v->kind, it->dim_v);
    for (int64_t t = 0; t < count; t++) {
        if (t + ahead < count) prefetch_row(v->base, index[t + ahead], v->kind, it->dim_v);
        for (int64_t g = 0; g < it->group; g++)
            add_scaled(acc + g * it->dim_v, probs[g * count + t], v->base, index[t], v->kind, it->dim_v);
    }
}

#if HAVE_BLOCKED
/* The blocked passes (AVX-512; a key dim that is a multiple of 16 and a value dim of 32): the scores
 * of 16 keys at a time, their 16 sums of lanes taken together, and the weighted values summed in
 * registers. The per-key passes above spent most of their time in a horizontal sum per score and in
 * loading and storing the value accumulators (and widening each bfloat16 value row once per query
 * head) for every key. Every score and every output is the same sum in the same order whichever key
 * of a block it is, so a result still depends only on the row's own inputs. */

enum { SCORE_F32 = 0, SCORE_BF16_WIDENED = 1, SCORE_BF16_DOT = 2 };

/* 16 bfloat16 values widened (exactly) to float32. */
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Query head g's products with a key row, summed over the dims into 16 lanes. */
static inline __attribute__((always_inline)) __m512 score_lanes(const Item *it, int64_t g, const void *base,
                                                                int64_t index, const int mode) {
    int64_t n = it->dim, d = 0;
#if HAVE_BF16_DOT
    if (mode == SCORE_BF16_DOT) return dot_bf16_lanes(it->qb + g * it->q_head_stride, (const uint16_t *)base + index, n);
#endif
    const float *q = it->q + g * it->q_head_stride;
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    if (mode == SCORE_F32) {
        const float *row = (const float *)base + index;
        for (; d + 32 <= n; d += 32) {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(row + d), a);
            b = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), _mm512_loadu_ps(row + d + 16), b);
        }
        if (d < n) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(row + d), a);
    } else {
        const uint16_t *row = (const uint16_t *)base + index;
        for (; d + 32 <= n; d += 32) {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), widen16(row + d), a);
            b = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), widen16(row + d + 16), b);
        }
        if (d < n) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), widen16(row + d), a);
    }
    return _mm512_add_ps(a, b);
}

/* The 16 lane sums of v[0..15] as one vector, each by sum_lanes's tree (common.h; so bitwise its result):
 * lane 4k + m is the sum of v[4m + k] (callers store key j at v[4 (j % 4) + j / 4]). Four rounds
 * of shuffles halve the lanes of every vector at once instead of one vector at a time. */
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int p = 0; p < 8; p++) /* lanes i + 8: two vectors' eight sums per result */
        w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++) /* lanes i + 4: four vectors' four sums per result */
        x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++) /* lanes i + 2 */
        y[p] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * p], x[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * p], x[2 * p + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD)); /* i + 1 */
}

/* The scores pass prefetches the value rows too, beside the key rows and as many rows ahead as the
 * per-key passes (PREFETCH_BYTES of each), interleaved with the keys' products: the values pass finds
 * its rows in L2. On the 2-core Zen 4 EPYC, 64 decode rows of Qwen3-0.6B's heads in a bfloat16 cache
 * (evicted before each call) read 27-29 GB/s so, 23 GB/s with the values prefetched in their own
 * pass, 25-27 GB/s with half the distance, and 21-22 GB/s in the per-key passes; prefetches issued 16
 * rows at a time at a block's start slowed a float32 cache's. */
static inline __attribute__((always_inline)) void scores_blocked_as(const Item *it, const Cache *k,
                                                                   const int64_t *index, const Cache *v,
                                                                   const int64_t *vindex, int64_t count,
                                                                   float *scores, const int mode) {
    int64_t ahead = rows_ahead(k->kind, it->dim > it->dim_v ? it->dim : it->dim_v), t = 0;
    __m512 scale = _mm512_set1_ps(it->scale);
    for (int64_t j = 0; j < ahead && j < count; j++) { /* the first rows, all at once */
        prefetch_row(k->base, index[j], k->kind, it->dim);
        prefetch_row(v->base, vindex[j], v->kind, it->dim_v);
    }
    for (; t + 16 <= count; t += 16) {
        for (int64_t g = 0; g < it->group; g++) { /* the block's rows stay in L1 for the next heads */
            __m512 vs[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                if (g == 0 && t + j + ahead < count) {
                    prefetch_row(k->base, index[t + j + ahead], k->kind, it->dim);
                    prefetch_row(v->base, vindex[t + j + ahead], v->kind, it->dim_v);
                }
                vs[4 * (j % 4) + j / 4] = score_lanes(it, g, k->base, index[t + j], mode);
            }
            _mm512_storeu_ps(scores + g * count + t, _mm512_mul_ps(sum_lanes16(vs), scale));
        }
    }
    for (; t < count; t++) {
        if (t + ahead < count) {
            prefetch_row(k->base, index[t + ahead], k->kind, it->dim);
            prefetch_row(v->base, vindex[t + ahead], v->kind, it->dim_v);
        }
        for (int64_t g = 0; g < it->group; g++)
            scores[g * count + t] = sum_lanes(score_lanes(it, g, k->base, index[t], mode)) * it->scale;
    }
}

static void scores_blocked(const Item *it, const Cache *k, const int64_t *index, const Cache *v,
                           const int64_t *vindex, int64_t count, float *scores) {
    if (it->qb)
        scores_blocked_as(it, k, index, v, vindex, count, scores, SCORE_BF16_DOT);
    else if (k->kind == ELEM_F32)
        scores_blocked_as(it, k, index, v, vindex, count, scores, SCORE_F32);
    else
        scores_blocked_as(it, k, index, v, vindex, count, scores, SCORE_BF16_WIDENED);
}

/* Query heads [g0, g0 + GC) of the weighted sum of the value rows over dims [d0, d0 + 16 NV), the GC x
 * NV accumulators in registers for all the keys, written to out. A bfloat16 row's 32 values are
 * widened by two instructions into its even and its odd dims (the accumulators hold them so, and are
 * interleaved back on the way out). */
static inline __attribute__((always_inline)) void values_tile(const Item *it, const Cache *v, const int64_t *index,
                                                             int64_t count, const float *probs, int64_t g0,
                                                             int64_t d0, void *out,
                                                             int64_t out_head_stride, const int kind, const int GC,
                                                             const int NV) {
    __m512 acc[4][8], x[8]; /* fixed sizes (a variable-length array stays in memory); GC <= 4, NV <= 8 */
#pragma GCC unroll 4
    for (int g = 0; g < GC; g++)
#pragma GCC unroll 8
        for (int u = 0; u < NV; u++) acc[g][u] = _mm512_setzero_ps();
    for (int64_t t = 0; t < count; t++) {
        if (kind == ELEM_F32) {
            const float *row = (const float *)v->base + index[t] + d0;
#pragma GCC unroll 8
            for (int u = 0; u < NV; u++) x[u] = _mm512_loadu_ps(row + 16 * u);
        } else {
            const uint16_t *row = (const uint16_t *)v->base + index[t] + d0;
#pragma GCC unroll 4
            for (int u = 0; u < NV / 2; u++) {
                __m512i r = _mm512_loadu_si512(row + 32 * u);
                x[2 * u] = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
                x[2 * u + 1] = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < GC; g++) {
            __m512 p = _mm512_set1_ps(probs[(g0 + g) * count + t]);
#pragma GCC unroll 8
            for (int u = 0; u < NV; u++) acc[g][u] = _mm512_fmadd_ps(p, x[u], acc[g][u]);
        }
    }
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
#pragma GCC unroll 4
    for (int g = 0; g < GC; g++) {
        int64_t at = (g0 + g) * out_head_stride + d0;
        if (kind == ELEM_F32) {
#pragma GCC unroll 8
            for (int u = 0; u < NV; u++) put16(out, it->out_kind, at + 16 * u, acc[g][u]);
        } else {
#pragma GCC unroll 4
            for (int u = 0; u < NV; u += 2) {
                put16(out, it->out_kind, at + 16 * u, _mm512_permutex2var_ps(acc[g][u], lo, acc[g][u + 1]));
                put16(out, it->out_kind, at + 16 * u + 16, _mm512_permutex2var_ps(acc[g][u], hi, acc[g][u + 1]));
            }
        }
    }
}

#define VALUES_TILE(KIND, GC, NV)                                                                                 \
    static void values_tile_##KIND##_##GC##_##NV(const Item *it, const Cache *v, const int64_t *index,          \
                                                 int64_t count, const float *probs, int64_t g0, int64_t d0,     \
                                                 void *out, int64_t out_head_stride) {                          \
        values_tile(it, v, index, count, probs, g0, d0, out, out_head_stride, KIND, GC, NV);                     \
    }
VALUES_TILE(0, 1, 2) VALUES_TILE(0, 1, 4) VALUES_TILE(0, 1, 8)
VALUES_TILE(0, 2, 2) VALUES_TILE(0, 2, 4) VALUES_TILE(0, 2, 8)
VALUES_TILE(0, 4, 2) VALUES_TILE(0, 4, 4)
VALUES_TILE(1, 1, 2) VALUES_TILE(1, 1, 4) VALUES_TILE(1, 1, 8)
VALUES_TILE(1, 2, 2) VALUES_TILE(1, 2, 4) VALUES_TILE(1, 2, 8)
VALUES_TILE(1, 4, 2) VALUES_TILE(1, 4, 4)

typedef void (*ValuesTile)(const Item *, const Cache *, const int64_t *, int64_t, const float *, int64_t, int64_t,
                           void *, int64_t);

/* Tiles of at most 16 accumulators: query heads four, two or one at a time, value dims 128, 64 or 32
 * at a time (as many as the heads leave room for and divide the dim); the rows are in L2 (the scores
 * pass prefetched them). */
static void values_blocked(const Item *it, const Cache *v, const int64_t *index, int64_t count, const float *probs,
                           void *out, int64_t out_head_stride) {
    static const ValuesTile tiles[2][3][3] = {
        {{values_tile_0_1_2, values_tile_0_1_4, values_tile_0_1_8},
         {values_tile_0_2_2, values_tile_0_2_4, values_tile_0_2_8},
         {values_tile_0_4_2, values_tile_0_4_4, NULL}},
        {{values_tile_1_1_2, values_tile_1_1_4, values_tile_1_1_8},
         {values_tile_1_2_2, values_tile_1_2_4, values_tile_1_2_8},
         {values_tile_1_4_2, values_tile_1_4_4, NULL}},
    };
    int64_t vectors = it->dim_v / 16;
    for (int64_t g0 = 0, gc; g0 < it->group; g0 += gc) {
        gc = it->group - g0 >= 4 ? 4 : it->group - g0 >= 2 ? 2 : 1;
        int heads = gc == 4 ? 2 : gc == 2 ? 1 : 0;
        int width = 16 / gc >= 8 && vectors % 8 == 0 ? 2 : 16 / gc >= 4 && vectors % 4 == 0 ? 1 : 0;
        for (int64_t d0 = 0; d0 < it->dim_v; d0 += 32 << width)
            tiles[v->kind == ELEM_F32 ? 0 : 1][heads][width](it, v, index, count, probs, g0, d0, out, out_head_stride);
    }
}
#endif

/* A thread's working memory, sized for the call's longest row. */
typedef struct {
    int64_t *index;  /* the element offsets of the row's keys (then values) */
    int64_t *vindex; /* the element offsets of its values (the blocked passes) */
    float *scores;  /* [group, longest]: scores, then probabilities */
    float *acc;     /* [group, dim_v] */
} Scratch;

static void attend_one(const Item *it, const Cache *k, const Cache *v, const int64_t *table, int64_t lo,
                       int64_t count, int64_t h, const float *sinks, void *out, int64_t out_head_stride,
                       const Scratch *w) {
    row_offsets(k, table, lo, count, it->block_size, h, w->index);
#if HAVE_BLOCKED
    if (it->blocked) {
        row_offsets(v, table, lo, count, it->block_size, h, w->vindex);
        scores_blocked(it, k, w->index, v, w->vindex, count, w->scores);
        softmax_rows(w->scores, it->group, count, sinks);
        values_blocked(it, v, w->vindex, count, w->scores, out, out_head_stride);
        return;
    }
#endif
    scores_pass(it, k, w->index, count, w->scores);
    softmax_rows(w->scores, it->group, count, sinks);
    memset(w->acc, 0, sizeof(float) * it->group * it->dim_v);
    row_offsets(v, table, lo, count, it->block_size, h, w->index);
    values_pass(it, v, w->index, count, w->scores, w->acc);
    for (int64_t g = 0; g < it->group; g++) {
        const float *acc = w->acc + g * it->dim_v;
        if (it->out_kind == ELEM_F32)
            memcpy((float *)out + g * out_head_stride, acc, sizeof(float) * it->dim_v);
        else
            for (int64_t d = 0; d < it->dim_v; d++) ((uint16_t *)out)[g * out_head_stride + d] = bf16_round(acc[d]);
    }
}

/* The first rows of an item's keys and values (up to PREFETCH_BYTES of each), prefetched into L2 one
 * item ahead: they arrive while the item before is computed, where the item's own passes would
 * start on rows no prefetch has reached yet. */
static void prefetch_item_start(const Cache *k, const Cache *v, const int64_t *table, int64_t lo, int64_t count,
                                int64_t bs, int64_t h, int64_t dim, int64_t dim_v) {
    int64_t ahead = rows_ahead(k->kind, dim > dim_v ? dim : dim_v), n = count < ahead ? count : ahead;
    for (int64_t pos = lo; pos < lo + n; pos++) {
        int64_t block = table[pos / bs], off = pos % bs;
        prefetch_row(k->base, block * k->sb + off * k->st + h * k->sh, k->kind, dim);
        prefetch_row(v->base, block * v->sb + off * v->st + h * v->sh, v->kind, dim_v);
    }
}

/* An item's fixed work (its offsets, softmax, output) counted as this many keys when splitting. */
enum { ITEM_KEYS = 32 };

/* Thread me's items [*lo, *hi) of team: contiguous, split where the keys read (plus ITEM_KEYS an
 * item) cross each thread's share, so a thread knows its next item and the work is balanced. */
static void item_range(const int64_t *counts, int64_t n, int64_t heads, int64_t team, int64_t me, int64_t *lo,
                       int64_t *hi) {
    int64_t total = 0, items = n * heads;
    for (int64_t i = 0; i < n; i++) total += (counts[i] + ITEM_KEYS) * heads;
    *lo = *hi = items;
    for (int64_t item = 0, cost = 0; item < items; cost += counts[item / heads] + ITEM_KEYS, item++) {
        int64_t owner = total ? cost * team / total : 0; /* the thread whose share this item starts in */
        if (owner == me && *lo == items) *lo = item;
        if (owner > me) {
            *hi = item;
            return;
        }
    }
}

/* Returns 0, or -1 when a thread's scratch could not be allocated (out is then incomplete).
 * query_bf16: the query in bfloat16 with q's strides, for bfloat16 caches of a dim that is a multiple
 * of 32 where pypto_bf16_dot() is 1 (NULL: the float32 query q is used; q may be NULL when it is
 * not). per_key: 1 for the per-key passes even where the blocked ones apply (a head dim that is a
 * multiple of 16, a value dim of 32, a build where pypto_attention_blocked() is 1). out_kind: the
 * output's elements (ELEM_F32, or ELEM_BF16 rounded as bf16_round). */
int pypto_paged_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride, const void *key_cache,
                          const void *value_cache, int kind, const int64_t *k_strides, const int64_t *v_strides,
                          const int64_t *tables, int64_t table_stride, const int64_t *rows, const int64_t *requests,
                          const int64_t *los, const int64_t *counts, int64_t n, int64_t num_q_heads,
                          int64_t num_kv_heads, int64_t dim, int64_t dim_v, int64_t block_size, float scale,
                          const float *sinks, void *out, int out_kind, int64_t out_row_stride,
                          int64_t out_head_stride, const uint16_t *query_bf16, int per_key, int threads) {
    Cache k = {key_cache, kind, k_strides[0], k_strides[1], k_strides[2]};
    Cache v = {value_cache, kind, v_strides[0], v_strides[1], v_strides[2]};
    int64_t group = num_q_heads / num_kv_heads, longest = 0;
    int blocked = HAVE_BLOCKED && !per_key && dim % 16 == 0 && dim_v % 32 == 0;
    for (int64_t i = 0; i < n; i++) longest = counts[i] > longest ? counts[i] : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        Scratch w;
        w.index = malloc(sizeof(int64_t) * 2 * longest + sizeof(float) * group * (longest + dim_v));
        w.vindex = w.index + longest;
        w.scores = (float *)(w.vindex + longest);
        w.acc = w.scores + group * longest;
        failed = w.index == NULL;
        int64_t lo = 0, hi = 0;
        item_range(counts, n, num_kv_heads, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        for (int64_t item = lo; item < hi && w.index != NULL; item++) {
            if (item + 1 < hi) {
                int64_t j = (item + 1) / num_kv_heads;
                prefetch_item_start(&k, &v, tables + requests[j] * table_stride, los[j], counts[j], block_size,
                                    (item + 1) % num_kv_heads, dim, dim_v);
            }
            int64_t i = item / num_kv_heads, h = item % num_kv_heads;
            int64_t first = rows[i] * q_row_stride + h * group * q_head_stride;
            Item it = {q ? q + first : NULL, query_bf16 ? query_bf16 + first : NULL, q_head_stride, group, dim, dim_v,
                       block_size, scale, blocked, out_kind};
            attend_one(&it, &k, &v, tables + requests[i] * table_stride, los[i], counts[i], h,
                       sinks ? sinks + h * group : NULL,
                       (char *)out + (rows[i] * out_row_stride + h * group * out_head_stride) * (out_kind == ELEM_F32 ? 4 : 2),
                       out_head_stride, &w);
        }
        free(w.index);
    }
    return failed ? -1 : 0;
}
