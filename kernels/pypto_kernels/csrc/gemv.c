/* One activation row times a plain float32 or bfloat16 [out, in] matrix (pypto_kernels.native.gemv): the
 * output projection of a concurrency-1 decode step, a pass over the whole matrix that only memory
 * bandwidth should limit.
 *
 * Each thread streams one contiguous range of the first three quarters of the matrix's rows (with
 * TAIL_MIN x CHUNK rows or more; else of all of them), then claims chunks of the rest as it finishes
 * (claim, common.h), a row at a time, with software
 * prefetches PREFETCH bytes ahead (the hardware prefetcher alone left oneDNN's packed GEMV at 0.6-0.7x
 * of a plain read of the matrix on the AVX-512 AMD EPYC of docs/benchmarks.md; interleaving two or
 * four rows was slower there). The prefetches are non-temporal: the matrix (the output projection,
 * 78-622 MB) is read once a step and would otherwise evict from L2 and L3 the decoder layers'
 * weights, activations and the interpreter's own data that the rest of the step reads next (on that
 * EPYC, a concurrency-1 decode token 5 % faster on the small shape, 9 % on Qwen3-0.6B bfloat16, and
 * the matrix itself read 0-19 % faster than with 32 KiB temporal prefetches). Each output's products
 * are summed in a fixed order (row_dot), so an output depends only on its row and the activation, not
 * on the threads.
 * A bfloat16 matrix is widened exactly to float32 as it is read (the activation comes as float32).
 * Vectors are GCC/Clang vector extensions of 16 floats (one AVX-512 register, two AVX2 ones). */
#include <omp.h>

#include "common.h"

enum { LANES = 16, PREFETCH = 4096, CHUNK = 64, TAIL_MIN = 64 };

/* 16 values of the matrix (kind ELEM_F32 or ELEM_BF16) from element index i of a row. */
static inline vf vload_kind(const void *row, int kind, int64_t i) {
    return kind == ELEM_BF16 ? vload_bf16((const uint16_t *)row + i) : vload((const float *)row + i);
}

static inline float scalar_kind(const void *row, int kind, int64_t i) {
    return kind == ELEM_BF16 ? bf16_value(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* Output o: its row's products in four accumulators (16-value chunks 0, 4, 8, ... in the first, 1,
 * 5, ... in the second, and so on; a last run of fewer than four chunks in the first), added as
 * (a0 + a1) + (a2 + a3), the lanes by sum_lanes (common.h), then the row's last in % 16 products in
 * order. Four chains of additions keep a wide row's sum from waiting on one. */
static inline __attribute__((always_inline)) float row_dot(const void *w, int kind, int64_t ws, const float *x,
                                                           int64_t in, int64_t o) {
    int64_t size = kind == ELEM_BF16 ? 2 : 4;
    const char *row = (const char *)w + o * ws * size, *ahead = row + PREFETCH;
    for (int64_t off = 0; off < size * ws; off += 64) __builtin_prefetch(ahead + off, 0, 0);
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t i = 0;
    for (; i + 4 * LANES <= in; i += 4 * LANES) {
        a0 += vload_kind(row, kind, i) * vload(x + i);
        a1 += vload_kind(row, kind, i + LANES) * vload(x + i + LANES);
        a2 += vload_kind(row, kind, i + 2 * LANES) * vload(x + i + 2 * LANES);
        a3 += vload_kind(row, kind, i + 3 * LANES) * vload(x + i + 3 * LANES);
    }
    for (; i + LANES <= in; i += LANES) a0 += vload_kind(row, kind, i) * vload(x + i);
    float total = sum_lanes((a0 + a1) + (a2 + a3));
    for (; i < in; i++) total += scalar_kind(row, kind, i) * x[i];
    return total;
}

/* Outputs [lo, hi): stored, rounded to bfloat16 and widened back where round_bf16, and folded into the
 * best (value bv, index bi; bi < 0: none) where bi is given: a value replaces the best where it is
 * greater, or is a NaN where the best is not, so over outputs in order the best is the maximum at its
 * lowest index, or the first NaN. */
static inline __attribute__((always_inline)) void outputs(const void *w, int kind, int64_t ws, const float *x,
                                                          int64_t in, float *out, int64_t lo, int64_t hi,
                                                          int round_bf16, float *bv, int64_t *bi) {
    for (int64_t o = lo; o < hi; o++) {
        float v = row_dot(w, kind, ws, x, in, o);
        out[o] = v = round_bf16 ? bf16_value(bf16_round(v)) : v;
        if (bi && (*bi < 0 || (*bv == *bv && (v != v || v > *bv)))) *bv = v, *bi = o;
    }
}

/* out [n] = w [n, in] (kind ELEM_F32 or ELEM_BF16, row stride ws elements, rows dense) times the
 * float32 x [in], into float32 out; round_bf16: each output rounded to bfloat16 (as torch rounds a
 * bfloat16 product's float32 sums) and stored widened, exactly. With row_max and row_arg (NULL: not
 * taken): the outputs' maximum and its first index (their first NaN where there is one), -1 where the
 * threads' scratch could not be allocated. */
void pypto_gemv(const void *w, int kind, int64_t ws, const float *x, float *out, int64_t n, int64_t in,
                int round_bf16, float *row_max, int64_t *row_arg, int threads) {
    int team_size = threads < 1 ? 1 : threads, used = 1;
    float *bests = row_arg ? malloc(sizeof(float) * team_size) : NULL;
    int64_t *where = row_arg ? malloc(sizeof(int64_t) * team_size) : NULL;
    if (row_arg && (!bests || !where)) {
        free(bests), free(where);
        bests = NULL, where = NULL;
        *row_arg = -1;
    }
    /* Chunks of CHUNK outputs: the last quarter of them claimed, where there are TAIL_MIN */
    int64_t chunks = (n + CHUNK - 1) / CHUNK, fixed = fixed_items(chunks, TAIL_MIN), claimed = fixed;
#pragma omp parallel num_threads(team_size)
    {
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t lo = fixed * me / team, hi = fixed * (me + 1) / team;
        float bv = 0.0f;
        int64_t bi = -1;
        if (me == 0) used = (int)team;
        while (lo < hi || claim(&claimed, chunks, team, &lo, &hi)) { /* chunks in increasing order */
            int64_t first = lo * CHUNK, last = hi * CHUNK < n ? hi * CHUNK : n;
            if (kind == ELEM_BF16)
                outputs(w, ELEM_BF16, ws, x, in, out, first, last, round_bf16, &bv, where ? &bi : NULL);
            else
                outputs(w, ELEM_F32, ws, x, in, out, first, last, round_bf16, &bv, where ? &bi : NULL);
            lo = hi;
        }
        if (where) bests[me] = bv, where[me] = bi;
    }
    if (!where) return;
    float bv = 0.0f;
    int64_t bi = -1;
    for (int t = 0; t < used; t++)
        if (better(bests[t], where[t], bv, bi)) bv = bests[t], bi = where[t];
    *row_max = bv;
    *row_arg = bi;
    free(bests), free(where);
}
