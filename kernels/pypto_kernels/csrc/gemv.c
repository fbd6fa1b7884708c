/* One activation row times a plain float32 [out, in] matrix (pypto_kernels.native.gemv): the
 * output projection of a concurrency-1 decode step, a pass over the whole matrix that only memory
 * bandwidth should limit.
 *
 * Each thread streams one contiguous range of the matrix's rows, ROWS rows at a time, with software
 * prefetches PREFETCH bytes ahead (the hardware prefetcher alone left oneDNN's packed GEMV at 0.6-0.7x
 * of a plain read of the matrix on the AVX-512 AMD EPYC of docs/benchmarks.md). Each output is its
 * row's products summed in 16 lanes over the row (ascending), the lanes added pairwise, then the
 * products of a row's last in % 16 values in order: a fixed order, so an output depends only on its
 * row and the activation, not on the threads or on which rows share a block.
 * Vectors are GCC/Clang vector extensions of 16 floats (one AVX-512 register, two AVX2 ones). */
#include <omp.h>

#include "common.h"

enum { ROWS = 2, LANES = 16, PREFETCH = 32768 };

typedef float vf __attribute__((vector_size(64)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef int32_t vi __attribute__((vector_size(64)));

#ifdef __clang__
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (vi){__VA_ARGS__})
#endif

/* The 16 lanes added pairwise (lane j + lane j + 8, then + 4, + 2, + 1), in registers. */
static inline float lanes_sum(vf v) {
    v += SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
    v += SHUFFLE(v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
    v += SHUFFLE(v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    v += SHUFFLE(v, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
    return v[0];
}

/* Outputs o0 .. o0 + COUNT - 1, their rows interleaved (COUNT a constant where inlined, so the
 * accumulators stay in registers). */
static inline __attribute__((always_inline)) void rows_dot(const float *w, int64_t ws, const float *x, int64_t in,
                                                           int64_t o0, int COUNT, float *out) {
    vf acc[ROWS];
    const float *row[ROWS];
    for (int r = 0; r < COUNT; r++) {
        acc[r] = (vf){0};
        row[r] = w + (o0 + r) * ws;
    }
    const char *ahead = (const char *)row[0] + PREFETCH;
    for (int64_t off = 0; off < (int64_t)sizeof(float) * COUNT * ws; off += 64) __builtin_prefetch(ahead + off, 0, 3);
    int64_t body = in - in % LANES;
    for (int64_t i = 0; i < body; i += LANES) {
        vf xv = vload(x + i);
        for (int r = 0; r < COUNT; r++) acc[r] += vload(row[r] + i) * xv;
    }
    for (int r = 0; r < COUNT; r++) {
        float total = lanes_sum(acc[r]);
        for (int64_t i = body; i < in; i++) total += row[r][i] * x[i];
        out[o0 + r] = total;
    }
}

/* out [n] = w [n, in] (row stride ws elements, rows dense) times x [in]. */
void pypto_gemv(const float *w, int64_t ws, const float *x, float *out, int64_t n, int64_t in, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t share = (n + team - 1) / team, lo = me * share, hi = lo + share < n ? lo + share : n;
        int64_t o = lo;
        for (; o + ROWS <= hi; o += ROWS) rows_dot(w, ws, x, in, o, ROWS, out);
        for (; o < hi; o++) rows_dot(w, ws, x, in, o, 1, out);
    }
}
