/* Paged attention of query rows over a paged K/V cache, read in place (pypto_kernels.native).
 *
 * Each query row r attends, for every KV head h, the keys at positions [lo[r], lo[r] + count[r])
 * of its request's block table with the G = Hq / Hkv query heads of that KV head: scores q . k
 * times the scale, a float32 softmax (with a per-query-head sink logit in the denominator when
 * sinks is given), and the probability-weighted sum of the value rows. Work items are (row, KV
 * head) pairs spread over OpenMP threads (the process's runtime, shared with torch's); each reads
 * its keys and values once, where they lie, with no copy of the cache, prefetching the rows ahead
 * (the next block's too).
 *
 * The caches are [blocks, block_size, Hkv, D] with any strides whose last dimension is dense
 * (element strides sb, st, sh), float32 or bfloat16 (widened exactly to float32 as they are read).
 * Sums run in float32, each in a fixed order (the vectorised loops'), so a call's result depends
 * only on its inputs, never on the threads.
 */
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
} Item;

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
/* q . row of bfloat16 values with AVX512-BF16's pairwise dot product (exact products, float32 sums;
 * n a multiple of 32): where the query is bfloat16 too, half the instructions of widening each key. */
static inline float dot_bf16(const uint16_t *q, const uint16_t *row, int64_t n) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 64 <= n; d += 64) {
        even = _mm512_dpbf16_ps(even, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(row + d));
        odd = _mm512_dpbf16_ps(odd, (__m512bh)_mm512_loadu_si512(q + d + 32),
                               (__m512bh)_mm512_loadu_si512(row + d + 32));
    }
    if (d < n) even = _mm512_dpbf16_ps(even, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(row + d));
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
}
#else
#define HAVE_BF16_DOT 0
static inline float dot_bf16(const uint16_t *q, const uint16_t *row, int64_t n) {
    (void)q, (void)row, (void)n;
    return 0.0f; /* never called: pypto_bf16_dot() is 0, so the caller passes no bfloat16 query */
}
#endif

/* 1 where this build has the bfloat16 dot product (the compiling CPU has AVX512-BF16), else 0. */
int pypto_bf16_dot(void) { return HAVE_BF16_DOT; }

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

/* A thread's working memory, sized for the call's longest row. */
typedef struct {
    int64_t *index; /* the element offsets of the row's keys (then values) */
    float *scores;  /* [group, longest]: scores, then probabilities */
    float *acc;     /* [group, dim_v] */
} Scratch;

static void attend_one(const Item *it, const Cache *k, const Cache *v, const int64_t *table, int64_t lo,
                       int64_t count, int64_t h, const float *sinks, float *out, int64_t out_head_stride,
                       const Scratch *w) {
    row_offsets(k, table, lo, count, it->block_size, h, w->index);
    scores_pass(it, k, w->index, count, w->scores);
    softmax_rows(w->scores, it->group, count, sinks);
    memset(w->acc, 0, sizeof(float) * it->group * it->dim_v);
    row_offsets(v, table, lo, count, it->block_size, h, w->index);
    values_pass(it, v, w->index, count, w->scores, w->acc);
    for (int64_t g = 0; g < it->group; g++)
        memcpy(out + g * out_head_stride, w->acc + g * it->dim_v, sizeof(float) * it->dim_v);
}

/* Returns 0, or -1 when a thread's scratch could not be allocated (out is then incomplete).
 * query_bf16: the query in bfloat16 with q's strides, for bfloat16 caches of a dim that is a multiple
 * of 32 where pypto_bf16_dot() is 1 (NULL: the float32 query is used). */
int pypto_paged_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride, const void *key_cache,
                          const void *value_cache, int kind, const int64_t *k_strides, const int64_t *v_strides,
                          const int64_t *tables, int64_t table_stride, const int64_t *rows, const int64_t *requests,
                          const int64_t *los, const int64_t *counts, int64_t n, int64_t num_q_heads,
                          int64_t num_kv_heads, int64_t dim, int64_t dim_v, int64_t block_size, float scale,
                          const float *sinks, float *out, int64_t out_row_stride, int64_t out_head_stride,
                          const uint16_t *query_bf16, int threads) {
    Cache k = {key_cache, kind, k_strides[0], k_strides[1], k_strides[2]};
    Cache v = {value_cache, kind, v_strides[0], v_strides[1], v_strides[2]};
    int64_t group = num_q_heads / num_kv_heads, longest = 0;
    for (int64_t i = 0; i < n; i++) longest = counts[i] > longest ? counts[i] : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        Scratch w;
        w.index = malloc(sizeof(int64_t) * longest + sizeof(float) * group * (longest + dim_v));
        w.scores = (float *)(w.index + longest);
        w.acc = w.scores + group * longest;
        failed = w.index == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n * num_kv_heads; item++) {
            if (w.index == NULL) continue;
            int64_t i = item / num_kv_heads, h = item % num_kv_heads;
            int64_t first = rows[i] * q_row_stride + h * group * q_head_stride;
            Item it = {q + first, query_bf16 ? query_bf16 + first : NULL, q_head_stride, group, dim, dim_v, block_size,
                       scale};
            attend_one(&it, &k, &v, tables + requests[i] * table_stride, los[i], counts[i], h,
                       sinks ? sinks + h * group : NULL, out + rows[i] * out_row_stride + h * group * out_head_stride,
                       out_head_stride, &w);
        }
        free(w.index);
    }
    return failed ? -1 : 0;
}
