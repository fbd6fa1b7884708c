/* Rows of float32 or bfloat16 activations times a matrix of their dtype stored as column panels
 * (pypto_kernels.native.panel_linear): every linear layer's product on the CPUs where it beat oneDNN's
 * packed copies at the row counts a decode step runs (docs/benchmarks.md).
 *
 * Layout: a [n, k] matrix (out x in) is held as ceil(n / 64) panels; one panel row is 256 bytes, the
 * 64 weights of outputs 64p .. 64p + 63 (outputs past n are zero): for float32 one input's, so a
 * panel is [k, 64]; for bfloat16 one pair of inputs' (2i, 2i + 1 side by side for each output, k
 * even), so a panel is [k / 2, 64, 2], the operand layout of AVX512-BF16's dot product. A panel row is
 * four 16-lane vectors, so a tile of up to MR activation rows keeps its 64 outputs in MR x 4 float32
 * accumulators while the panel streams past once, front to back: at one row that is a plain read of
 * the matrix (what a concurrency-1 step's products are limited by), at MR rows each weight vector
 * feeds MR multiply-adds (what a 64-row step's are limited by).
 *
 * Order: each float32 output is one chain of fused multiply-adds over kk = 0, 1, ..., k - 1 from zero,
 * the bias added last. A bfloat16 output is one chain of the CPU's bfloat16 pair dot products
 * (VDPBF16PS: its two products added to the sum) over the input pairs in order, plus the bias in
 * float32, rounded once to bfloat16 (to nearest, ties to even, as torch's). Partial sums stored
 * between blocks of KC rows are reloaded exactly, so no blocking, tile height or thread split changes
 * a bit of the result: a row's output depends only on that row, whatever the batch and the threads.
 *
 * Work: (panel, block of MC rows) items, panel by panel. A product of TAIL_MIN items or more splits
 * its first three quarters in contiguous ranges over the threads and hands the rest out in chunks (a
 * guided schedule: each claim a 2 x team-th of what is left) to whichever thread is free; a smaller
 * one splits all of its items so. A thread that loses its core for a while (to the engine's work
 * between steps, to a neighbour's burst too short to shed the core for) then delays the product by
 * about half of that time instead of all of it: a 64-row Qwen3-shaped head beside a process busy 1 ms
 * in every 16 took 11.7-11.8 ms on average instead of 12.0-13.0 (11.2 alone) on the Zen 4 EPYC of
 * docs/benchmarks.md. Each thread claims its next item before computing the current one, and takes
 * its items in increasing order, so each row's maximum over the threads' bests is the largest at its
 * lowest index (merge_bests) whoever took which item.
 * Within an item, the panel's block of KC rows stays in the core's L2 across the block's tiles. A block of
 * four or more tiles prefetches the next block's bytes (the panel's next KC rows, or the panel of the
 * item the thread computes next) while it computes, a quarter or an eighth of them
 * by each of its first four or eight tiles, a line every iteration or every other: the demand on
 * memory stays spread over the whole block. Prefetched in one burst by the first tile (as a block of one
 * to three tiles still does, PANEL_PREFETCH bytes ahead of itself), a core asked for 32 KiB within
 * ~1 µs, more lines than it can have in flight, and that tile waited: on the Zen 4 EPYC of
 * docs/benchmarks.md spreading the prefetches made 64-row bfloat16 products 1.07-1.11x faster (a
 * Qwen3-shaped 151,936-word head with 256 inputs 381 -> 417 GFLOP/s on two threads), 32-row ones
 * 1.1-1.2x, 256 rows and more 1.01-1.02x. A product of up to MR rows (one tile, the panel's only
 * block: a decode step of a few requests, the one row of a concurrency-1 step), or of up to 3 MR rows
 * over panels of LONG_PANEL bytes or more, is one forward stream over each panel, which the hardware
 * prefetchers follow: its tiles prefetch nothing. On that EPYC, prefetches of their own (four lines
 * 32 KiB ahead into L2; at one row four lines 4 KiB ahead non-temporally) took 1.10-1.12x the time of
 * none at 2-6 rows over Qwen3-0.6B's layer matrices and 1.06-1.12x at 8-16 rows (its 151,936-row head
 * at 8 and 14 rows 1.08-1.10x), and at one row held a Qwen3-0.6B bfloat16 token's layers at 1.21x a
 * plain read of their panels in the fast memory state, 1.09x without (1.10x and 1.08x in the slow
 * one). Any other block of one to three tiles keeps its first tile's prefetches PANEL_PREFETCH bytes
 * ahead: without them 8- and 14-row products over 256 inputs (32 KiB panels) took 1.06x as long. A
 * thread's
 * consecutive items are one panel's row blocks, so a prefill chunk of several blocks reads each panel
 * from memory once, not once per block (row block by row block, 256- and 512-row products ran
 * 0.88-0.95x oneDNN's on two threads, panel by panel 0.94-1.00x). The 16-lane vectors are one
 * AVX-512 register each; 24 accumulators need its 32 registers. */
#include <omp.h>

#include "common.h"

enum { NR = 64, MR = 6, MC = 96, KC = 512, PANEL_PREFETCH = 32768, ROW_BYTES = 256, LONG_PANEL = 131072 };
/* A product's last quarter of items is claimed rather than split in advance (fixed_items, claim),
 * where it has TAIL_MIN items or more */
enum { TAIL_MIN = 64 };
/* What a tile prefetches each iteration (one panel row): nothing; four lines PANEL_PREFETCH ahead into
 * L2 (the first tile of a block of one to three tiles, unless the block is the panel's only one and
 * has one tile or a panel of LONG_PANEL bytes or more; into L1 too, 32 KiB ahead, they evicted the
 * lines the tile was reading, and 2-16-row products ran 1.04-1.28x slower on the Zen 4 EPYC of
 * docs/benchmarks.md, a routed block of 8 rows an expert 1.14-1.19x); one line, or one every other
 * iteration, of its share of the next block from pfp (the first four or eight tiles of a larger
 * block). */
enum { PF_NONE, PF_AHEAD, PF_LINE, PF_HALF_LINE, PF_KINDS };
/* How a tile stores its finished sums: as float32 (0), rounded to bfloat16, or rounded to bfloat16
 * and stored widened to float32. */
enum { NARROW = 1, WIDE = 2 };

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* 16 float32 values to 64-byte-aligned dst past the caches (a non-temporal store, AVX-512 builds;
 * elsewhere a plain store): an output projection's logits are written once and read only after the
 * whole product, and at 64 rows of a 151,936-word vocabulary they outgrow every cache level. On the
 * Zen 4 EPYC of docs/benchmarks.md Qwen3-shaped 64-row heads ran 1.02-1.06x faster so (no read of
 * each output line before its write, no eviction of the panels). */
static inline void stream16(float *dst, vf v) {
#if defined(__AVX512F__)
    __m512 m;
    memcpy(&m, &v, sizeof m);
    _mm512_stream_ps(dst, m);
#else
    vstore(dst, v);
#endif
}

static inline void store16(float *dst, vf v, int nt_store) {
    if (nt_store)
        stream16(dst, v);
    else
        vstore(dst, v);
}

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

/* a[j] += the pair dot product of the bfloat16 pair at b (two inputs of one row) and the pairs in wj
 * (16 outputs' weights for those two inputs), for the four vectors of one panel row. With AVX512-BF16
 * one VDPBF16PS per vector, the pair broadcast by its load; elsewhere the same products widened to
 * float32 (exact) and added odd input first, as the instruction's definition does. */
static inline __attribute__((always_inline)) void row_dot(vf a[4], const uint16_t *b, vf w0, vf w1, vf w2, vf w3) {
#ifdef __AVX512BF16__
    typedef uint32_t __attribute__((may_alias)) pair_t;
    __asm__("vdpbf16ps %4%{1to16%}, %5, %0\n\t"
            "vdpbf16ps %4%{1to16%}, %6, %1\n\t"
            "vdpbf16ps %4%{1to16%}, %7, %2\n\t"
            "vdpbf16ps %4%{1to16%}, %8, %3"
            : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3])
            : "m"(*(const pair_t *)b), "v"(w0), "v"(w1), "v"(w2), "v"(w3));
#else
    float even = bf16_value(b[0]), odd = bf16_value(b[1]);
    vf w[4] = {w0, w1, w2, w3};
    for (int j = 0; j < 4; j++) {
        vu bits;
        memcpy(&bits, &w[j], sizeof bits);
        vu lo = bits << 16, hi = bits & 0xffff0000u;
        vf we, wo;
        memcpy(&we, &lo, sizeof we);
        memcpy(&wo, &hi, sizeof wo);
        a[j] = (a[j] + wo * odd) + we * even;
    }
#endif
}

/* Where a logits product takes each row's maximum as it writes the logits (NULL: it does not): the
 * rows' bests so far (value bv, index bi; bi < 0: none yet), indexed by the product's row. */
typedef struct {
    float *bv;
    int64_t *bi;
} Fold;

/* Folds a window of a row's logits (n values from column c0, in column order) into its best: a value
 * replaces the best where it is greater, or is a NaN where the best is not, so over windows taken in
 * column order the best is the row's maximum at its lowest index, or its first NaN (torch.argmax's
 * result, and what amax propagates). */
static void fold_scan(const float *x, int64_t n, int64_t c0, float *bv, int64_t *bi) {
    if (*bi >= 0 && *bv != *bv) return; /* the row's first NaN is found: nothing later replaces it */
    for (int64_t j = 0; j < n; j++) {
        float v = x[j];
        if (*bi < 0 || v != v || v > *bv) {
            *bv = v;
            *bi = c0 + j;
            if (v != v) return;
        }
    }
}

/* fold_scan of a full window held in four vectors: compared at once, scanned only where the window
 * holds a NaN or beats the best (a few windows of a row). round: the window's values are rounded to
 * bfloat16 (and widened) first, the logits a bfloat16 product leaves unstored: only the window's
 * maximum is rounded for the comparison, since rounding never reverses an order (the rounded window's
 * maximum is the rounded maximum), and the whole window only where it is scanned. */
static inline __attribute__((always_inline)) void fold_window(const vf o[4], int round, int64_t c0, float *bv,
                                                              int64_t *bi) {
    if (*bi >= 0 && *bv != *bv) return; /* as fold_scan */
    int scan = *bi < 0;
#if defined(__AVX512F__)
    if (!scan) {
        __m512 v[4];
        memcpy(v, o, sizeof v);
        /* unordered: a NaN in either operand (the maxima below drop NaNs) */
        __mmask16 nan = _mm512_cmp_ps_mask(v[0], v[1], _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v[2], v[3], _CMP_UNORD_Q);
        __m512 top = _mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3]));
        if (round) {
            vf t;
            memcpy(&t, &top, sizeof t);
            t = wide_bf16x16(t);
            memcpy(&top, &t, sizeof top);
        }
        scan = nan || _mm512_cmp_ps_mask(top, _mm512_set1_ps(*bv), _CMP_GT_OQ);
    }
#else
    scan = 1;
#endif
    if (scan) {
        float x[NR];
        for (int j = 0; j < 4; j++) { /* the window's values as the logits would be stored */
            vf w = round ? wide_bf16x16(o[j]) : o[j];
            memcpy(x + 16 * j, &w, sizeof w);
        }
        fold_scan(x, NR, c0, bv, bi);
    }
}

/* Rows 0 .. mr - 1 of x (kind ELEM_F32 or ELEM_BF16, row stride xs elements) times the panel w's rows
 * k0 .. k1 - 1 (inputs, or bfloat16 input pairs): the sums continue from src (row stride NR; NULL:
 * from zero) and go to dst (row stride ds), plus bias (64 values) if given, stored as narrow says (0:
 * float32; NARROW, WIDE: bfloat16 sums and bias, rounded), non-temporally where nt_store (float32
 * stores only; dst 64-byte aligned). pf: one of PF_* (pfp: where PF_LINE and PF_HALF_LINE start).
 * kind, mr and pf are constants in each specialisation below, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(int kind, int mr, int pf, const void *x, int64_t xs,
                                                       const void *w, int64_t k0, int64_t k1, const float *src,
                                                       void *dst, int64_t ds, const void *bias, int narrow,
                                                       int nt_store, const Fold *fold, int64_t row, int64_t c0,
                                                       const char *pfp) {
    vf a[MR][4];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            if (r < mr) a[r][j] = src ? vload(src + r * NR + 16 * j) : (vf){0};
    const char *wk = (const char *)w + k0 * ROW_BYTES;
#pragma GCC unroll 4
    for (int64_t kk = k0; kk < k1; kk++, wk += ROW_BYTES) {
        if (pf == PF_AHEAD)
            for (int line = 0; line < 4; line++) __builtin_prefetch(wk + PANEL_PREFETCH + 64 * line, 0, 2);
        else if (pf == PF_LINE)
            __builtin_prefetch(pfp + (kk - k0) * 64, 0, 3);
        else if (pf == PF_HALF_LINE && !((kk - k0) & 1))
            __builtin_prefetch(pfp + (kk - k0) * 32, 0, 3);
        const float *row = (const float *)wk;
        vf w0 = vload(row), w1 = vload(row + 16), w2 = vload(row + 32), w3 = vload(row + 48);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            if (r < mr && kind == ELEM_BF16)
                row_dot(a[r], (const uint16_t *)x + r * xs + 2 * kk, w0, w1, w2, w3);
            else if (r < mr)
                row_fma(a[r], (const float *)x + r * xs + kk, w0, w1, w2, w3);
        }
    }
    if (narrow) { /* the sums plus the bfloat16 bias (or zero), rounded once, as row_to_bf16 */
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            if (r >= mr) continue;
            vf o[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                vf v = a[r][j] + (bias ? vload_bf16((const uint16_t *)bias + 16 * j) : (vf){0});
                if (narrow == WIDE && !dst)
                    o[j] = v; /* unstored: fold_window rounds what it compares */
                else if (narrow == WIDE) {
                    o[j] = wide_bf16x16(v);
                    store16((float *)dst + r * ds + 16 * j, o[j], nt_store);
                } else
                    store_bf16x16((uint16_t *)dst + r * ds + 16 * j, v);
            }
            if (fold && narrow == WIDE) fold_window(o, !dst, c0, fold->bv + row + r, fold->bi + row + r);
        }
        return;
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        if (r >= mr) continue;
        vf o[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            o[j] = bias ? a[r][j] + vload((const float *)bias + 16 * j) : a[r][j];
            if (dst) store16((float *)dst + r * ds + 16 * j, o[j], nt_store);
        }
        if (fold) fold_window(o, 0, c0, fold->bv + row + r, fold->bi + row + r);
    }
}

typedef void (*tile_fn)(const void *, int64_t, const void *, int64_t, int64_t, const float *, void *, int64_t,
                        const void *, int, int, const Fold *, int64_t, int64_t, const char *);

#define TILE(kind, mr, pf)                                                                                     \
    static void tile_##kind##_##mr##_##pf(const void *x, int64_t xs, const void *w, int64_t k0, int64_t k1,   \
                                          const float *src, void *dst, int64_t ds, const void *bias,           \
                                          int narrow, int nt_store, const Fold *fold, int64_t row,             \
                                          int64_t c0, const char *pfp) {                                       \
        tile(kind, mr, pf, x, xs, w, k0, k1, src, dst, ds, bias, narrow, nt_store, fold, row, c0, pfp);        \
    }
#define TILES_WITH(kind, pf)                                                                                   \
    TILE(kind, 1, pf) TILE(kind, 2, pf) TILE(kind, 3, pf) TILE(kind, 4, pf) TILE(kind, 5, pf) TILE(kind, 6, pf)
#define TILES_OF(kind)                                                                                         \
    TILES_WITH(kind, 0) TILES_WITH(kind, 1) TILES_WITH(kind, 2) TILES_WITH(kind, 3)
TILES_OF(0)
TILES_OF(1)
/* The specialisations are named by the literal pf values 0 .. 3 (token pasting takes no enum): they
 * must be the PF_* values, in order. */
_Static_assert(PF_NONE == 0 && PF_AHEAD == 1 && PF_LINE == 2 && PF_HALF_LINE == 3 && PF_KINDS == 4,
               "tile specialisations are named by the PF_* values");
#define ROW_OF(kind, pf)                                                                                       \
    {0, tile_##kind##_1_##pf, tile_##kind##_2_##pf, tile_##kind##_3_##pf, tile_##kind##_4_##pf,                \
     tile_##kind##_5_##pf, tile_##kind##_6_##pf}
#define PREFETCHES_OF(kind) {ROW_OF(kind, 0), ROW_OF(kind, 1), ROW_OF(kind, 2), ROW_OF(kind, 3)}
/* TILES[kind][pf][rows] (pf: PF_NONE .. PF_HALF_LINE) */
static const tile_fn TILES[2][PF_KINDS][MR + 1] = {PREFETCHES_OF(0), PREFETCHES_OF(1)};

/* One row's first cols < NR float32 sums (+ bias, bfloat16, widened, or zero) rounded into bfloat16
 * outputs (wide: those stored as float32): the last panel's, where it is partial. */
static void row_to_bf16(void *out, int wide, const float *sums, const uint16_t *bias, int64_t cols) {
    for (int64_t j = 0; j < cols; j++) {
        uint16_t v = bf16_round(sums[j] + (bias ? bf16_value(bias[j]) : 0.0f));
        if (wide)
            ((float *)out)[j] = bf16_value(v);
        else
            ((uint16_t *)out)[j] = v;
    }
}

/* Rows r0 .. r1 - 1 of the product's panel w (its cols <= NR outputs from c0) over k panel rows
 * (alone: the panel's only block, of a product of at most MC rows; wide: the logits entry's float32
 * outputs, a bfloat16 product's rounded then widened, the full panels' stored non-temporally where
 * nt_store); buf holds MC x NR partial sums. A full panel's last block goes from the registers
 * straight to out, bias added (bfloat16: then rounded; through buf and a scalar pass the rounding took
 * about a fifth of a 6-row tile's time where the matrix has 256 inputs). */
static void panel_block(int kind, int wide, const void *x, int64_t xs, const void *w, const void *bias, void *out,
                        int64_t os, int64_t r0, int64_t r1, int64_t c0, int64_t cols, int64_t k, int alone,
                        int nt_store, const Fold *fold, float *buf, const char *after) {
    int64_t size = kind == ELEM_BF16 ? 2 : 4, out_size = wide ? 4 : size;
    int store = kind == ELEM_BF16 ? (wide ? WIDE : NARROW) : 0;
    int64_t tiles = (r1 - r0 + MR - 1) / MR, share = tiles >= 8 ? 8 : tiles >= 4 ? 4 : 1;
    /* one forward stream over the panel, which the hardware prefetchers follow (see the top) */
    int stream = alone && (tiles == 1 || k * ROW_BYTES >= LONG_PANEL);
    for (int64_t k0 = 0; k0 < k || k0 == 0; k0 += KC) {
        int64_t k1 = k0 + KC < k ? k0 + KC : k;
        int last = k1 == k, direct = last && cols == NR;
        /* the next block's bytes (the panel's next KC rows, or what the thread computes next):
         * tile t < share prefetches part t of them */
        const char *next = last ? after : (const char *)w + k1 * ROW_BYTES;
        for (int64_t r = r0; r < r1; r += MR) {
            int mr = r1 - r < MR ? (int)(r1 - r) : MR;
            int64_t t = (r - r0) / MR;
            int pf = t >= share || stream ? PF_NONE
                     : share == 1 ? PF_AHEAD
                     : !next      ? PF_NONE
                     : share == 8 ? PF_HALF_LINE
                                  : PF_LINE;
            float *part = buf + (r - r0) * NR;
            void *dst = !direct ? (void *)part : out ? (char *)out + (r * os + c0) * out_size : NULL;
            const void *b = direct && bias ? (const char *)bias + c0 * size : NULL;
            tile_fn fn = TILES[kind][pf][mr];
            int spread = pf == PF_LINE || pf == PF_HALF_LINE;
            const char *pfp = spread ? next + t * (k1 - k0) * ROW_BYTES / share : NULL;
            fn((const char *)x + r * xs * size, xs, w, k0, k1, k0 ? part : NULL, dst, direct ? os : NR, b,
               direct ? store : 0, direct && nt_store, direct ? fold : NULL, r, c0, pfp);
            if (!last || direct) continue;
            for (int i = 0; i < mr; i++) { /* the last partial panel's real outputs */
                float unstored[NR]; /* logits that are not stored: their maxima are taken from here */
                void *o = out ? (char *)out + ((r + i) * os + c0) * out_size : (void *)unstored;
                if (kind == ELEM_BF16) {
                    const uint16_t *bb = bias ? (const uint16_t *)bias + c0 : NULL;
                    row_to_bf16(o, wide, part + i * NR, bb, cols);
                } else {
                    for (int64_t j = 0; j < cols; j++)
                        ((float *)o)[j] = bias ? part[i * NR + j] + ((const float *)bias)[c0 + j] : part[i * NR + j];
                }
                if (fold) /* wide here: the row's float32 logits, just written */
                    fold_scan((const float *)o, cols, c0, fold->bv + r + i, fold->bi + r + i);
            }
        }
    }
}

/* Row r's best over the threads' bests (bests[t * m + r], index where[t * m + r], < 0: none): the
 * largest value at its lowest index, or the lowest-indexed NaN, whichever thread found it. */
static void merge_bests(const float *bests, const int64_t *where, int64_t m, int used, int64_t r, float *row_max,
                        int64_t *row_arg) {
    float bv = 0.0f;
    int64_t bi = -1;
    for (int t = 0; t < used; t++) {
        float v = bests[t * m + r];
        int64_t i = where[t * m + r];
        if (better(v, i, bv, bi)) bv = v, bi = i;
    }
    row_max[r] = bv;
    row_arg[r] = bi;
}

static void panel_gemm(int kind, int wide, const void *x, int64_t xs, const void *panels, const void *bias,
                       void *out, int64_t os, int64_t m, int64_t n, int64_t k, float *row_max, int64_t *row_arg,
                       int threads) {
    /* wide: float32 logits, stored non-temporally where every full panel's stores are 64-byte aligned */
    int nt_store = wide && out && (uintptr_t)out % 64 == 0 && os % 16 == 0;
    int64_t rows = kind == ELEM_BF16 ? k / 2 : k; /* panel rows */
    int64_t count = (n + NR - 1) / NR, blocks = (m + MC - 1) / MC, items = count * blocks;
    /* Each thread's best of every row over its items (taken in increasing order) */
    float *bests = NULL;
    int64_t *where = NULL;
    int team_size = threads < 1 ? 1 : threads;
    if (row_max) {
        bests = malloc(sizeof(float) * m * team_size);
        where = malloc(sizeof(int64_t) * m * team_size);
        if (!bests || !where) { /* no scratch: the maxima are left unset (-1 indices) for the caller */
            free(bests), free(where);
            for (int64_t r = 0; r < m; r++) row_arg[r] = -1;
            row_max = NULL;
        } else {
            for (int64_t i = 0; i < m * team_size; i++) where[i] = -1;
        }
    }
    int used = 1;
    /* The items past the threads' fixed ranges, claimed in chunks (claim) */
    int64_t fixed = fixed_items(items, TAIL_MIN), claimed = fixed;
#pragma omp parallel num_threads(team_size)
    {
        float buf[MC * NR] __attribute__((aligned(64)));
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t item = fixed * me / team, end = fixed * (me + 1) / team;
        if (me == 0) used = (int)team;
        Fold fold = {bests ? bests + me * m : NULL, where ? where + me * m : NULL};
        if (item >= end && !claim(&claimed, items, team, &item, &end)) item = -1;
        while (item >= 0) { /* the next item is claimed first: this one's last block prefetches it */
            int64_t after = item + 1, after_end = end;
            if (after >= end && !claim(&claimed, items, team, &after, &after_end)) after = -1;
            int64_t p = item / blocks, r0 = item % blocks * MC, r1 = r0 + MC < m ? r0 + MC : m;
            int64_t c0 = p * NR, cols = n - c0 < NR ? n - c0 : NR;
            const char *w = (const char *)panels + p * rows * ROW_BYTES;
            /* what to prefetch: the next item's panel, or the one after this panel where the next
             * item is another row block of this one (still in the core's caches) */
            int64_t q = after < 0 ? -1 : after / blocks == p ? (p + 1 < count ? p + 1 : -1) : after / blocks;
            const char *then = q < 0 ? NULL : (const char *)panels + q * rows * ROW_BYTES;
            panel_block(kind, wide, x, xs, w, bias, out, os, r0, r1, c0, cols, rows, m <= MC, nt_store,
                        row_max ? &fold : NULL, buf, then);
            item = after, end = after_end;
        }
#if defined(__AVX512F__)
        if (nt_store) _mm_sfence(); /* the non-temporal stores visible before the team's end */
#endif
    }
    if (row_max) {
        for (int64_t r = 0; r < m; r++) merge_bests(bests, where, m, used, r, row_max, row_arg);
        free(bests), free(where);
    }
}

/* out [m, n] (row stride os) = x [m, k] (row stride xs) times the panels of the [n, k] matrix, plus
 * bias [n] if given; x, panels, bias and out all of kind (ELEM_F32 or ELEM_BF16; bfloat16: k even). */
void pypto_panel_gemm(int kind, const void *x, int64_t xs, const void *panels, const void *bias, void *out,
                      int64_t os, int64_t m, int64_t n, int64_t k, int threads) {
    panel_gemm(kind, 0, x, xs, panels, bias, out, os, m, n, k, NULL, NULL, threads);
}

/* pypto_panel_gemm as an output projection's logits: out float32 whatever the kind (bfloat16: each
 * output rounded to bfloat16 as ever, stored widened, exactly; no widening pass after it), stored past
 * the caches (stream16) where its rows are 64-byte aligned. With row_max and row_arg (NULL: not
 * taken): each row's maximum logit and its first index (its first NaN where it has one), taken from
 * each window of logits in the registers as it is computed; out may then be NULL, and the logits are
 * not stored at all (a greedy step that reads nothing else of them: the stores took 3-4 % of a 64-row
 * Qwen3-shaped product with 256 inputs on the Zen 4 EPYC of docs/benchmarks.md). */
void pypto_panel_gemm_logits(int kind, const void *x, int64_t xs, const void *panels, const void *bias, float *out,
                             int64_t os, int64_t m, int64_t n, int64_t k, float *row_max, int64_t *row_arg,
                             int threads) {
    panel_gemm(kind, 1, x, xs, panels, bias, out, os, m, n, k, row_max, row_arg, threads);
}

/* Grouped products over panels (a mixture of experts' routed experts packed as panels): x [rows, k]
 * (row stride xs, the kind) sorted by expert, expert e's rows [ends[e - 1], ends[e]) (ends[-1] = 0)
 * times its [n, k] matrix's panels at panels + e * es bytes; out [rows, n] (row stride os, the kind).
 * Each output is pypto_panel_gemm's for its row alone, so it depends neither on the other rows routed to
 * its expert nor on the threads. The work is (expert, panel, block of MC rows) items, an expert's
 * panel by panel, split and claimed as pypto_panel_gemm's. Returns 0, or -1 without computing
 * anything where its item table could not be allocated. */
int pypto_grouped_panel_gemm(int kind, const void *x, int64_t xs, const void *panels, int64_t es, void *out,
                             int64_t os, const int64_t *ends, int64_t experts, int64_t n, int64_t k, int threads) {
    int64_t rows = kind == ELEM_BF16 ? k / 2 : k, count = (n + NR - 1) / NR;
    int64_t *first = malloc(sizeof(int64_t) * (experts + 1)); /* expert e's items [first[e], first[e + 1]) */
    if (!first) return -1;
    first[0] = 0;
    for (int64_t e = 0; e < experts; e++) {
        int64_t m = ends[e] - (e ? ends[e - 1] : 0);
        first[e + 1] = first[e] + count * ((m + MC - 1) / MC);
    }
    int64_t items = first[experts], fixed = fixed_items(items, TAIL_MIN), claimed = fixed;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        float buf[MC * NR] __attribute__((aligned(64)));
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t lo = fixed * me / team, hi = fixed * (me + 1) / team, e = 0;
        while (lo < hi || claim(&claimed, items, team, &lo, &hi)) {
            for (int64_t item = lo; item < hi; item++) {
                e = expert_of(first, item, e);
                int64_t start = e ? ends[e - 1] : 0, m = ends[e] - start, blocks = (m + MC - 1) / MC;
                int64_t p = (item - first[e]) / blocks, r0 = start + (item - first[e]) % blocks * MC;
                int64_t r1 = r0 + MC < ends[e] ? r0 + MC : ends[e], c0 = p * NR, cols = n - c0 < NR ? n - c0 : NR;
                const char *w = (const char *)panels + e * es + p * rows * ROW_BYTES;
                panel_block(kind, 0, x, xs, w, NULL, out, os, r0, r1, c0, cols, rows, m <= MC, 0, NULL, buf, NULL);
            }
            lo = hi;
        }
    }
    free(first);
    return 0;
}
