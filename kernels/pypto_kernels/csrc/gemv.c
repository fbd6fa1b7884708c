/* One activation row times a plain float32 or bfloat16 [out, in] matrix (pypto_kernels.native.gemv): a
 * tied output projection's concurrency-1 product beside oneDNN's packed copy (beside the panels one row
 * runs the panels, whose sums are a row's in any batch), a pass over the whole matrix that only memory
 * bandwidth should limit.
 *
 * Each thread streams one contiguous range of the first three quarters of the matrix's rows (with
 * TAIL_MIN x CHUNK rows or more; else of all of them), then claims chunks of the rest as it finishes
 * (claim, common.h), a row at a time, with software prefetches into L2 8 KiB ahead of it, one every
 * PREFETCH_EVERY bytes of the row: the hardware prefetcher alone left oneDNN's packed GEMV at 0.6-0.7x
 * of a plain read of the matrix on the AVX-512 AMD EPYC of docs/benchmarks.md (interleaving two or four
 * rows was slower there; prefetches into L1 32 KiB ahead cost a small-shape token 5 % against
 * non-temporal ones 4 KiB ahead). On the 2-core Zen 4 EPYC of docs/benchmarks.md, against those
 * non-temporal prefetches, a float32 matrix read 1.04-1.24x as fast on one thread (a core shed to a
 * neighbour) and 1.04-1.12x on two; a prefetch every 256 bytes instead of every 64-byte line then read
 * a float32 matrix 1.07-1.33x as fast again, as fast as torch's sum of it (where a prefetch of every
 * line held one thread to 0.8x that sum's rate), a bfloat16 one 1.00-1.06x as fast, and took a
 * small-shape float32 concurrency-1 token to 0.87x. A bfloat16 row is summed as the CPU's bfloat16
 * pair dot products (pair_dots: one VDPBF16PS per 32 values where the CPU has AVX512-BF16, the panel
 * products' arithmetic), against the activation rounded once to bfloat16 (exact: it holds bfloat16
 * values). Widening the row to float32 first (a shift for the even values, a mask for the odd ones, two
 * multiply-adds per 32 values) took twice the instructions a row's bytes need: on the Zen 4 EPYC of
 * docs/benchmarks.md that read a 151,936 x 256 matrix at 0.90x a float32 sum of as many bytes on two
 * threads and 0.81x on one, the pair dot products at 0.99x and 0.97x (a 1,024-wide one level on two
 * threads, 1.07x as fast on one); a small-shape bfloat16 concurrency-1 token 0.95-0.98x as long, the
 * mid shape's level, in the slow memory state. Each output's products are summed in a
 * fixed order (row_dot), so an output depends only on its row and the activation, not on the threads.
 * Vectors are GCC/Clang vector extensions; a row's 16-lane sums are held in PARTS of PART lanes. */
#include <omp.h>

#include "common.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

enum { LANES = 16, PREFETCH = 8192, PREFETCH_EVERY = 256, CHUNK = 64, TAIL_MIN = 64 };

static inline float scalar_kind(const void *row, int kind, int64_t i) {
    return kind == ELEM_BF16 ? bf16_value(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* The activation as a bfloat16 row's pair dot products read it (pair_dots), rounded to bfloat16 (exact
 * for the callers, whose activations are bfloat16 values widened). With AVX512-BF16: the rounded
 * values' bits, in order, as uint16_t over xs. Elsewhere, per chunk of 32 values, the even then the
 * odd values, widened back to float32; values past the last whole chunk unset. */
static void split_pairs(const float *x, int64_t in, float *xs) {
#ifdef __AVX512BF16__
    for (int64_t i = 0; i < in; i++) ((uint16_t *)xs)[i] = bf16_round(x[i]);
#else
    for (int64_t c = 0; c + 2 * LANES <= in; c += 2 * LANES)
        for (int64_t j = 0; j < LANES; j++) {
            xs[c + j] = bf16_value(bf16_round(x[c + 2 * j]));
            xs[c + LANES + j] = bf16_value(bf16_round(x[c + 2 * j + 1]));
        }
#endif
}

/* A row's 16-lane accumulators are held as PARTS vectors of PART lanes: one AVX-512 register, or two
 * 8-lane halves elsewhere, where GCC keeps a 16-lane vector in memory (an AVX2 build of the 16-lane
 * loop read a bfloat16 matrix at a third of a plain read's rate, a float32 one at three quarters).
 * Lane j of part p is lane p * PART + j of the 16, and sum_parts adds the lanes as sum_lanes does,
 * so holding them in parts changes no result. */
#ifdef __AVX512F__
enum { PART = 16 };
#else
enum { PART = 8 };
#endif
enum { PARTS = LANES / PART };
typedef float pf __attribute__((vector_size(PART * 4)));
typedef uint32_t pu __attribute__((vector_size(PART * 4)));

static inline pf pload(const float *p) {
    pf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline pf as_floats(pu u) {
    pf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* sum_lanes (common.h) of the 16 lanes held in parts: the same additions in the same order. */
static inline float sum_parts(const pf v[PARTS]) {
#ifdef __AVX512F__
    return sum_lanes(v[0]);
#else
    pf t = v[0] + v[1];
    t += __builtin_shufflevector(t, t, 4, 5, 6, 7, 4, 5, 6, 7);
    t += __builtin_shufflevector(t, t, 2, 3, 2, 3, 2, 3, 2, 3);
    return t[0] + t[1];
#endif
}

/* acc += the pair dot products of the bfloat16 row's 32 values at i (16 input pairs, one a lane) and
 * the activation's (split_pairs): in each lane the odd input's product added first, then the even
 * one's, as AVX512-BF16's VDPBF16PS defines its sum (each product exact in float32, each addition
 * rounded to nearest). Built for a CPU with that instruction, it is one per chunk (which also flushes
 * subnormal inputs and sums to zero; values that small do not occur in a model's weights and
 * activations); elsewhere the pairs are widened by a shift and a mask and the two products added in
 * that order. */
static inline __attribute__((always_inline)) void pair_dots(pf acc[PARTS], const uint16_t *row, const float *xs,
                                                            int64_t i) {
#ifdef __AVX512BF16__
    __m512 a, xv, wv;
    memcpy(&a, &acc[0], sizeof a);
    xv = _mm512_loadu_ps((const uint16_t *)xs + i); /* 32 bfloat16 values */
    wv = _mm512_loadu_ps(row + i);
    a = _mm512_dpbf16_ps(a, (__m512bh)xv, (__m512bh)wv);
    memcpy(&acc[0], &a, sizeof a);
#else
    for (int p = 0; p < PARTS; p++) {
        pu pair;
        memcpy(&pair, row + i + 2 * PART * p, sizeof pair);
        acc[p] = (acc[p] + as_floats(pair & 0xffff0000u) * pload(xs + i + LANES + PART * p)) +
                 as_floats(pair << 16) * pload(xs + i + PART * p);
    }
#endif
}

/* Output o: its row's products in four 16-lane accumulators, added as (a0 + a1) + (a2 + a3), the lanes
 * by sum_lanes (common.h), then the row's last products (fewer than 16 of a float32 row, fewer than 32
 * of a bfloat16 one) in order. A float32 row's 16-value chunks 0, 4, 8, ... go to the first, 1, 5, ...
 * to the second, and so on; a bfloat16 row's 32-value chunks likewise, each as pair_dots; a last run
 * of fewer than four chunks goes to the first. Four chains of additions keep a wide row's sum from
 * waiting on one. rows_dot takes those sums of nr <= ROWS activation rows at once (x and xs row r at
 * r * stride), each the same additions in the same order as its row's alone, the matrix row read once
 * for all of them; row_dot is its one-row case. */
enum { ROWS = 4 };

static inline __attribute__((always_inline)) void rows_dot(const void *w, int kind, int64_t ws, const float *x,
                                                           const float *xs, int64_t stride, int64_t in, int64_t o,
                                                           int nr, float *res) {
    int64_t size = kind == ELEM_BF16 ? 2 : 4;
    const char *row = (const char *)w + o * ws * size;
    for (int64_t off = 0; off < size * in; off += PREFETCH_EVERY) __builtin_prefetch(row + PREFETCH + off, 0, 2);
    pf a[ROWS][4][PARTS] = {{{{0}}}};
    int64_t i = 0;
    if (kind == ELEM_BF16) {
        for (; i + 8 * LANES <= in; i += 8 * LANES)
            for (int c = 0; c < 4; c++)
                for (int r = 0; r < nr; r++) pair_dots(a[r][c], (const uint16_t *)row, xs + r * stride, i + 2 * LANES * c);
        for (; i + 2 * LANES <= in; i += 2 * LANES)
            for (int r = 0; r < nr; r++) pair_dots(a[r][0], (const uint16_t *)row, xs + r * stride, i);
    } else {
        const float *wf = (const float *)row;
        for (; i + 4 * LANES <= in; i += 4 * LANES)
            for (int c = 0; c < 4; c++)
                for (int p = 0; p < PARTS; p++) {
                    pf wv = pload(wf + i + LANES * c + PART * p);
                    for (int r = 0; r < nr; r++) a[r][c][p] += wv * pload(x + r * stride + i + LANES * c + PART * p);
                }
        for (; i + LANES <= in; i += LANES)
            for (int p = 0; p < PARTS; p++) {
                pf wv = pload(wf + i + PART * p);
                for (int r = 0; r < nr; r++) a[r][0][p] += wv * pload(x + r * stride + i + PART * p);
            }
    }
    for (int r = 0; r < nr; r++) {
        pf v[PARTS];
        for (int p = 0; p < PARTS; p++) v[p] = (a[r][0][p] + a[r][1][p]) + (a[r][2][p] + a[r][3][p]);
        float total = sum_parts(v);
        const float *xr = x + r * stride;
        for (int64_t j = i; j < in; j++)
            total += scalar_kind(row, kind, j) * (kind == ELEM_BF16 ? bf16_value(bf16_round(xr[j])) : xr[j]);
        res[r] = total;
    }
}

static inline __attribute__((always_inline)) float row_dot(const void *w, int kind, int64_t ws, const float *x,
                                                           const float *xs, int64_t in, int64_t o) {
    float total;
    rows_dot(w, kind, ws, x, xs, in, in, o, 1, &total);
    return total;
}

/* Output o's value v stored (rounded to bfloat16 and widened back where round_bf16) and folded into
 * the best (value bv, index bi; bi < 0: none) where bi is given: a value replaces the best where it
 * is greater, or is a NaN where the best is not, so over outputs in order the best is the maximum at
 * its lowest index, or the first NaN. */
static inline __attribute__((always_inline)) void keep(float *out, int64_t o, float v, int round_bf16, float *bv,
                                                       int64_t *bi) {
    out[o] = v = round_bf16 ? bf16_value(bf16_round(v)) : v;
    if (bi && (*bi < 0 || (*bv == *bv && (v != v || v > *bv)))) *bv = v, *bi = o;
}

/* A bfloat16 matrix's rows against an activation of NV whole chunks of 32 values (NV a multiple of 4,
 * up to HELD), held in registers for all of a thread's rows where the CPU has AVX512-BF16: row_dot
 * loads the activation again for every row, as many loads as the row's own. On one core of the Zen 4
 * EPYC of docs/benchmarks.md row_dot read a 256-input matrix already in the caches at 50-67 GB/s (held:
 * 62-81; a plain sum of it 65-92), and on two threads one streamed from memory (151,936 rows,
 * alternated call by call) in 1.00x the time of a sum of it in the slow state and 1.12x in the mid one
 * (held: 0.89x and 0.98x).
 * A float32 one read 1.05-1.07x slower from memory held and is left to row_dot. Each output is
 * row_dot's sum, the same additions in the same order (chunk j into accumulator j % 4). */
enum { HELD = 16 };

static inline int held_applies(int kind, int64_t in) {
    int64_t nv = in / 32;
    return kind == ELEM_BF16 && in % 32 == 0 && nv % 4 == 0 && nv >= 4 && nv <= HELD;
}

#ifdef __AVX512BF16__
#define HAVE_HELD 1
static inline __attribute__((always_inline)) void outputs_held(const uint16_t *w, int64_t ws, const float *xs,
                                                               float *out, int64_t lo, int64_t hi, int round_bf16,
                                                               float *bv, int64_t *bi, const int nv) {
    __m512 xv[HELD];
#pragma GCC unroll 16
    for (int j = 0; j < nv; j++) xv[j] = _mm512_loadu_ps((const uint16_t *)xs + 32 * j);
    for (int64_t o = lo; o < hi; o++) {
        const uint16_t *row = w + o * ws;
        for (int64_t off = 0; off < 64 * nv; off += PREFETCH_EVERY) __builtin_prefetch((const char *)row + PREFETCH + off, 0, 2);
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
        for (int j = 0; j < nv; j++) a[j % 4] = _mm512_dpbf16_ps(a[j % 4], (__m512bh)xv[j], (__m512bh)_mm512_loadu_ps(row + 32 * j));
        __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
        pf v[PARTS];
        memcpy(&v[0], &sum, sizeof sum);
        keep(out, o, sum_parts(v), round_bf16, bv, bi);
    }
}
#else
#define HAVE_HELD 0
#endif

/* Outputs [lo, hi), each kept (keep) in order: a bfloat16 matrix's with the activation held in
 * registers where it fits (outputs_held), else row by row (row_dot). */
static inline __attribute__((always_inline)) void outputs(const void *w, int kind, int64_t ws, const float *x,
                                                          const float *xs, int64_t in, float *out, int64_t lo, int64_t hi,
                                                          int round_bf16, float *bv, int64_t *bi) {
#if HAVE_HELD
    if (held_applies(kind, in)) {
        const uint16_t *m = w;
        int64_t nv = in / 32;
        if (nv == 4) outputs_held(m, ws, xs, out, lo, hi, round_bf16, bv, bi, 4);
        else if (nv == 8) outputs_held(m, ws, xs, out, lo, hi, round_bf16, bv, bi, 8);
        else if (nv == 12) outputs_held(m, ws, xs, out, lo, hi, round_bf16, bv, bi, 12);
        else outputs_held(m, ws, xs, out, lo, hi, round_bf16, bv, bi, 16);
        return;
    }
#endif
    for (int64_t o = lo; o < hi; o++) keep(out, o, row_dot(w, kind, ws, x, xs, in, o), round_bf16, bv, bi);
}

/* 1 where pypto_gemv holds the activation in registers (outputs_held) for a matrix of this kind and
 * number of inputs, else 0. */
int pypto_gemv_held(int kind, int64_t in) { return HAVE_HELD && held_applies(kind, in); }

/* out [n] = w [n, in] (kind ELEM_F32 or ELEM_BF16, row stride ws elements, rows dense) times the
 * float32 x [in] (for a bfloat16 matrix, rounded to bfloat16 first), into float32 out; round_bf16:
 * each output rounded to bfloat16 (as torch rounds a bfloat16 product's float32 sums) and stored
 * widened, exactly. With row_max and row_arg (NULL: not
 * taken): the outputs' maximum and its first index (their first NaN where there is one). Returns 0, or
 * -1 without computing anything where its scratch (the threads' maxima, the split activation) could
 * not be allocated. */
int pypto_gemv(const void *w, int kind, int64_t ws, const float *x, float *out, int64_t n, int64_t in,
               int round_bf16, float *row_max, int64_t *row_arg, int threads) {
    int team_size = threads < 1 ? 1 : threads, used = 1;
    float *bests = row_arg ? malloc(sizeof(float) * team_size) : NULL;
    int64_t *where = row_arg ? malloc(sizeof(int64_t) * team_size) : NULL;
    float *xs = kind == ELEM_BF16 ? malloc(sizeof(float) * (in > 0 ? in : 1)) : NULL;
    if ((row_arg && (!bests || !where)) || (kind == ELEM_BF16 && !xs)) {
        free(bests), free(where), free(xs);
        return -1;
    }
    if (xs) split_pairs(x, in, xs);
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
                outputs(w, ELEM_BF16, ws, x, xs, in, out, first, last, round_bf16, &bv, where ? &bi : NULL);
            else
                outputs(w, ELEM_F32, ws, x, xs, in, out, first, last, round_bf16, &bv, where ? &bi : NULL);
            lo = hi;
        }
        if (where) bests[me] = bv, where[me] = bi;
    }
    free(xs);
    if (!where) return 0;
    float bv = 0.0f;
    int64_t bi = -1;
    for (int t = 0; t < used; t++)
        if (better(bests[t], where[t], bv, bi)) bv = bests[t], bi = where[t];
    *row_max = bv;
    *row_arg = bi;
    free(bests), free(where);
    return 0;
}

/* rows_dot for one of its row counts, the count a constant in each copy (so its accumulators stay in
 * registers). */
static inline __attribute__((always_inline)) void rows_dot_n(const void *w, int kind, int64_t ws, const float *x,
                                                             const float *xs, int64_t in, int64_t o, int nr,
                                                             float *res) {
    if (nr == 4) rows_dot(w, kind, ws, x, xs, in, in, o, 4, res);
    else if (nr == 3) rows_dot(w, kind, ws, x, xs, in, in, o, 3, res);
    else if (nr == 2) rows_dot(w, kind, ws, x, xs, in, in, o, 2, res);
    else rows_dot(w, kind, ws, x, xs, in, in, o, 1, res);
}

/* Outputs [lo, hi) of activation rows [r0, r1) against one matrix, stored (rounded to bfloat16 and
 * widened back where round_bf16) at out + row * n + output: ROWS rows at a time over all the outputs,
 * so that those rows stay in L1 while the outputs' matrix rows (CHUNK of them) are read from memory
 * once and from L2 for the next ROWS rows (the other order, every row per output, read the rows back
 * from L2 and ran 1.5x slower at 8 rows an expert). */
static void rows_outputs(const void *w, int kind, int64_t ws, const float *x, const float *xs, int64_t in,
                         float *out, int64_t n, int64_t r0, int64_t r1, int64_t lo, int64_t hi, int round_bf16) {
    float res[ROWS];
    for (int64_t r = r0; r < r1; r += ROWS) {
        int nr = r1 - r < ROWS ? (int)(r1 - r) : ROWS;
        const float *xr = x + r * in, *sr = xs ? xs + r * in : NULL;
        for (int64_t o = lo; o < hi; o++) {
            if (kind == ELEM_BF16)
                rows_dot_n(w, ELEM_BF16, ws, xr, sr, in, o, nr, res);
            else
                rows_dot_n(w, ELEM_F32, ws, xr, sr, in, o, nr, res);
            for (int k = 0; k < nr; k++) out[(r + k) * n + o] = round_bf16 ? bf16_value(bf16_round(res[k])) : res[k];
        }
    }
}

/* Grouped products (the routed experts of a mixture of experts): activation rows sorted by expert,
 * expert e's rows [ends[e - 1], ends[e]) (ends[-1] = 0) times its [n, in] matrix at w + e * es elements
 * (kind ELEM_F32 or ELEM_BF16, row stride ws, rows dense); x [rows, in] float32 (for a bfloat16
 * matrix, rounded to bfloat16 first), out [rows, n] float32, rows = ends[experts - 1]; round_bf16 as
 * pypto_gemv's. Each output is row_dot's sum for its row alone (pypto_gemv's): it depends only on its row and its
 * expert's matrix, not on the other rows routed there or the threads. The work is split into items of
 * CHUNK outputs of one expert (for all its rows), most of them in advance, the last quarter claimed.
 * Returns 0, or -1 without computing anything where its scratch could not be allocated. */
int pypto_grouped_gemv(const void *w, int kind, int64_t es, int64_t ws, const float *x, float *out,
                       const int64_t *ends, int64_t experts, int64_t n, int64_t in, int round_bf16, int threads) {
    int64_t rows = experts > 0 ? ends[experts - 1] : 0, per = (n + CHUNK - 1) / CHUNK;
    int64_t *first = malloc(sizeof(int64_t) * (experts + 1));
    float *xs = kind == ELEM_BF16 ? malloc(sizeof(float) * (rows * in > 0 ? rows * in : 1)) : NULL;
    if (!first || (kind == ELEM_BF16 && !xs)) {
        free(first), free(xs);
        return -1;
    }
    first[0] = 0; /* expert e's items [first[e], first[e + 1]) */
    for (int64_t e = 0; e < experts; e++) first[e + 1] = first[e] + (ends[e] > (e ? ends[e - 1] : 0) ? per : 0);
    if (xs)
        for (int64_t r = 0; r < rows; r++) split_pairs(x + r * in, in, xs + r * in);
    int64_t items = first[experts], fixed = fixed_items(items, TAIL_MIN), claimed = fixed;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t lo = fixed * me / team, hi = fixed * (me + 1) / team, e = 0;
        while (lo < hi || claim(&claimed, items, team, &lo, &hi)) {
            for (int64_t item = lo; item < hi; item++) {
                e = expert_of(first, item, e);
                int64_t r0 = e ? ends[e - 1] : 0, o0 = (item - first[e]) * CHUNK;
                int64_t o1 = o0 + CHUNK < n ? o0 + CHUNK : n;
                rows_outputs((const char *)w + e * es * (kind == ELEM_BF16 ? 2 : 4), kind, ws, x, xs, in, out, n, r0,
                             ends[e], o0, o1, round_bf16);
            }
            lo = hi;
        }
    }
    free(first), free(xs);
    return 0;
}
