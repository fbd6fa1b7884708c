/* Rows of float32 activations times a float32 matrix stored as column panels
 * (pypto_kernels.native.panel_linear): every linear layer's product on the CPUs where it beat oneDNN's
 * packed copies at the row counts a decode step runs (docs/benchmarks.md).
 *
 * Layout: a [n, k] matrix (out x in) is held as ceil(n / 64) panels of [k, 64]: panel p, row kk holds
 * the 64 weights of outputs 64p .. 64p + 63 for input kk (outputs past n are zero). One panel row is
 * four 16-float vectors, so a tile of up to MR activation rows keeps its 64 outputs in MR x 4
 * accumulators while the panel streams past once, front to back: at one row that is a plain read of
 * the matrix (what a concurrency-1 step's products are limited by), at MR rows each weight vector
 * feeds MR fused multiply-adds (what a 64-row step's are limited by).
 *
 * Order: each output is one chain of fused multiply-adds over kk = 0, 1, ..., k - 1 from zero, the
 * bias added last. Partial sums stored between blocks of KC inputs are reloaded exactly, so no
 * blocking, tile height or thread split changes a bit of the result: a row's output depends only on
 * that row, whatever the batch and the number of threads.
 *
 * Work: (panel, block of MC rows) items, split in contiguous ranges over the threads; within one, the
 * panel's block of KC inputs stays in the core's L2 across the block's tiles, and the first tile
 * prefetches it PREFETCH bytes ahead (the next panel follows in memory). Vectors are GCC/Clang vector
 * extensions of 16 floats (one AVX-512 register; 24 accumulators need its 32 registers). */
#include <omp.h>

#include "common.h"

enum { NR = 64, MR = 6, MC = 96, KC = 512, PANEL_PREFETCH = 32768 };

typedef float vf __attribute__((vector_size(64)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* a[j] += *b * wj, fused, for the four vectors of one panel row. With AVX-512 the activation is
 * broadcast by each multiply-add's load ({1to16}) rather than by a separate broadcast: on the Zen 4
 * EPYC a broadcast takes a slot of the floating-point pipes the multiply-adds need (64-row products
 * 1.08-1.14x faster so); the result is the same fused multiply-add either way. */
static inline __attribute__((always_inline)) void row_fma(vf a[4], const float *b, vf w0, vf w1, vf w2, vf w3) {
#ifdef __AVX512F__
    __asm__("vfmadd231ps %4%{1to16%}, %5, %0\n\t"
            "vfmadd231ps %4%{1to16%}, %6, %1\n\t"
            "vfmadd231ps %4%{1to16%}, %7, %2\n\t"
            "vfmadd231ps %4%{1to16%}, %8, %3"
            : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3])
            : "m"(*b), "v"(w0), "v"(w1), "v"(w2), "v"(w3));
#else
    a[0] += *b * w0;
    a[1] += *b * w1;
    a[2] += *b * w2;
    a[3] += *b * w3;
#endif
}

/* Rows 0 .. mr - 1 of x (row stride xs) times the panel w's inputs k0 .. k1 - 1: the sums continue from
 * src (row stride NR; NULL: from zero) and go to dst (row stride ds), plus bias (64 values) if given.
 * mr and pf are constants in each specialisation below, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(int mr, int pf, const float *x, int64_t xs, const float *w,
                                                       int64_t k0, int64_t k1, const float *src, float *dst,
                                                       int64_t ds, const float *bias) {
    vf a[MR][4];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            if (r < mr) a[r][j] = src ? vload(src + r * NR + 16 * j) : (vf){0};
    const float *wk = w + k0 * NR;
#pragma GCC unroll 4
    for (int64_t kk = k0; kk < k1; kk++, wk += NR) {
        if (pf)
            for (int line = 0; line < 4; line++) __builtin_prefetch((const char *)wk + PANEL_PREFETCH + 64 * line, 0, 3);
        vf w0 = vload(wk), w1 = vload(wk + 16), w2 = vload(wk + 32), w3 = vload(wk + 48);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++)
            if (r < mr) row_fma(a[r], x + r * xs + kk, w0, w1, w2, w3);
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            if (r < mr) vstore(dst + r * ds + 16 * j, bias ? a[r][j] + vload(bias + 16 * j) : a[r][j]);
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, const float *, float *, int64_t,
                        const float *);

#define TILE(mr, pf)                                                                                           \
    static void tile_##mr##_##pf(const float *x, int64_t xs, const float *w, int64_t k0, int64_t k1,          \
                                 const float *src, float *dst, int64_t ds, const float *bias) {                \
        tile(mr, pf, x, xs, w, k0, k1, src, dst, ds, bias);                                                    \
    }
TILE(1, 0) TILE(2, 0) TILE(3, 0) TILE(4, 0) TILE(5, 0) TILE(6, 0)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)
static const tile_fn TILES[2][MR + 1] = {
    {0, tile_1_0, tile_2_0, tile_3_0, tile_4_0, tile_5_0, tile_6_0},
    {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1},
};

/* Rows r0 .. r1 - 1 of the product's panel p (its cols <= NR outputs from c0); buf holds MC x NR partial sums. */
static void panel_block(const float *x, int64_t xs, const float *w, const float *bias, float *out, int64_t os,
                        int64_t r0, int64_t r1, int64_t c0, int64_t cols, int64_t k, float *buf) {
    for (int64_t k0 = 0; k0 < k || k0 == 0; k0 += KC) {
        int64_t k1 = k0 + KC < k ? k0 + KC : k;
        int last = k1 == k, direct = last && cols == NR;
        for (int64_t r = r0; r < r1; r += MR) {
            int mr = r1 - r < MR ? (int)(r1 - r) : MR;
            float *part = buf + (r - r0) * NR;
            float *dst = direct ? out + r * os + c0 : part;
            const float *b = direct && bias ? bias + c0 : NULL;
            TILES[r == r0][mr](x + r * xs, xs, w, k0, k1, k0 ? part : NULL, dst, direct ? os : NR, b);
            if (last && !direct) /* the last, partial panel: only its real outputs are written */
                for (int i = 0; i < mr; i++)
                    for (int64_t j = 0; j < cols; j++)
                        out[(r + i) * os + c0 + j] = bias ? part[i * NR + j] + bias[c0 + j] : part[i * NR + j];
        }
    }
}

/* out [m, n] (row stride os) = x [m, k] (row stride xs) times the panels [ceil(n / 64), k, 64] of the
 * [n, k] matrix, plus bias [n] if given. */
void pypto_panel_gemm(const float *x, int64_t xs, const float *panels, const float *bias, float *out, int64_t os,
                      int64_t m, int64_t n, int64_t k, int threads) {
    int64_t count = (n + NR - 1) / NR, blocks = (m + MC - 1) / MC, items = count * blocks;
#pragma omp parallel num_threads(threads)
    {
        float buf[MC * NR] __attribute__((aligned(64)));
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t share = (items + team - 1) / team, lo = me * share, hi = lo + share < items ? lo + share : items;
        for (int64_t item = lo; item < hi; item++) {
            int64_t p = item % count, r0 = item / count * MC, r1 = r0 + MC < m ? r0 + MC : m;
            int64_t c0 = p * NR, cols = n - c0 < NR ? n - c0 : NR;
            panel_block(x, xs, panels + p * k * NR, bias, out, os, r0, r1, c0, cols, k, buf);
        }
    }
}
