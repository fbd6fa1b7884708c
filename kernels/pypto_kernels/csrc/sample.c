/* Sampled rows' tokens from float32 logits in host memory (pypto_kernels.native.sample_rows): the
 * sampler's draw (pypto_serving.sampler) in a few passes over each row, with no sort of the
 * vocabulary and no temporaries of its size beyond one thread's weights. Through torch's ops a
 * 151,936-word row took 0.8-1.1 ms with a temperature alone and 24-28 ms with top-p alone (a sort of
 * the whole row where the 256 best tokens hold less than top-p of the mass), 64 such rows 40-900 ms,
 * passes over fresh [rows, vocabulary] tensors and the sort (docs/benchmarks.md).
 *
 * Each row r (the rule the torch draw follows, so both give the same token but where a rounding
 * moves the uniform across a boundary):
 *   v = x / temperature (float32), weights w = e**(v - max v) (float32, exp_nonpositive's polynomial);
 *   the tokens ranked by logit, ties by lower id first (-0 counts as +0);
 *   kept: the top_k best (0: all), then of those the best whose mass strictly ahead of them is at most
 *   top_p of the mass of the top_k (or of the whole row; the best always stays), less any whose v is
 *   below max v + log(min_p);
 *   the token: where u times the kept weights' total falls in their cumulative sum in id order (the
 *   first whose cumulative weight exceeds it), summed in float64 over blocks of DRAW_BLOCK tokens and
 *   then inside the block found, as the rejection sampler's _inverse_cdf searches (a goal past a
 *   block's own cumulative takes its last kept token).
 * A row the sampler reports as an error (NaN or +inf logits, every token banned) gets an index of its
 * own: its first maximum's (ignoring NaN), or with top-k its best-ranked token's.
 *
 * Top-k takes the k best with a heap over a pass and weighs only them; top-p without top-k finds the token where the mass
 * ranked ahead crosses top_p by a histogram of the weights' mass over the logits' ordered bits
 * (DRAW_RADIX_BITS of the key at a time: the boundary's bucket, then its sub-buckets, then its ties),
 * never ordering more than the boundary's ties. Rows go to the threads (one row: one thread). */
#include <omp.h>

#include "common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { DRAW_BLOCK = 128, RADIX_BITS = 11, RADIX = 1 << RADIX_BITS };

/* A logit's rank key: larger floats have larger keys (NaN above +inf); -0 keyed as +0. */
static inline uint32_t order_key(float f) {
    if (f == 0.0f) f = 0.0f;
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

/* Rank of token i with key k: larger is better (a larger key, or the same key and a lower id). */
static inline uint64_t rank_of(uint32_t key, int64_t i) { return (uint64_t)key << 32 | (uint32_t)(0xFFFFFFFFu - (uint32_t)i); }

static inline int64_t id_of(uint64_t rank) { return (int64_t)(0xFFFFFFFFu - (uint32_t)rank); }

/* exp_nonpositive (common.h) on 16 lanes: e**x for x <= 0, 0 at or below -87, for -inf and NaN. */
static inline vf vexp_weights(vf x) {
    vi live = x > -87.0f; /* false for NaN and -inf */
    vf c = (vf)((vi)x & live);
    vf n = (c * 1.44269504f + 12582912.0f) - 12582912.0f;
    vf f = c - n * 0.693145752f - n * 1.42860677e-06f;
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666672f + f * (0.0416666679f + f * (0.00833333377f + f * 0.00138888892f)))));
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)bits) & live);
}

/* One thread's scratch for rows of v tokens. */
typedef struct {
    float *w;           /* [v] weights (0 where not kept, once the kept set is known) */
    double *blocks;     /* [v / DRAW_BLOCK + 1] weight a block */
    int64_t *ids;       /* [v] a boundary bucket's tokens, then their ranks */
    uint64_t *heap;     /* [k_cap] the top_k best's ranks */
    double mass[RADIX];     /* a histogram level's weight a bucket */
    double part[4][RADIX];  /* the first level's, four histograms (no chain of adds to one bucket) */
} Scratch;

typedef double vd __attribute__((vector_size(64)));

static inline vf vsplat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* order_key of 16 lanes. */
static inline vu vkey(vf x) {
    vu b;
    memcpy(&b, &x, sizeof b);
    b &= ~(vu)(x == 0.0f);
    return b ^ ((vu)((vi)b >> 31) | 0x80000000u);
}

/* Bit l set where lane l of the mask m is. */
static inline uint32_t lane_bits(vi m) {
#if defined(__AVX512F__)
    __m512i v;
    memcpy(&v, &m, sizeof v);
    return _mm512_test_epi32_mask(v, v);
#else
    uint32_t bits = 0;
    for (int l = 0; l < 16; l++) bits |= (uint32_t)(m[l] != 0) << l;
    return bits;
#endif
}

/* The float64 sum of 16 float32 values added to two 8-lane accumulators. */
static inline void add_wide(vd *lo, vd *hi, vf e) {
    typedef float v8 __attribute__((vector_size(32)));
    *lo += __builtin_convertvector(__builtin_shufflevector(e, e, 0, 1, 2, 3, 4, 5, 6, 7), vd);
    *hi += __builtin_convertvector(__builtin_shufflevector(e, e, 8, 9, 10, 11, 12, 13, 14, 15), vd);
    (void)sizeof(v8);
}

static inline double sum_wide(vd lo, vd hi) {
    vd s = lo + hi;
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* Row maximum (NaN ignored: the sampler reports a row with one) and its first index. */
static float row_max(const float *x, int64_t v, int64_t *at) {
    vf vm = vsplat(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= v; i += 16) {
        vf a = vload(x + i);
        vi more = a > vm;
        vm = (vf)(((vi)a & more) | ((vi)vm & ~more));
    }
    float m = -INFINITY;
    for (int l = 0; l < 16; l++) m = vm[l] > m ? vm[l] : m;
    for (; i < v; i++) m = x[i] > m ? x[i] : m;
    for (i = 0; i < v && x[i] != m; i++) {
    }
    *at = i < v ? i : 0;
    return m;
}

/* Block [lo, hi)'s weights into w (w[0]: token lo), 0 where v is below vmin, returning their float64
 * sum: the one computation of a block's weights, so a block weighed again has the same bits. */
static double block_weights(const float *x, int64_t lo, int64_t hi, float t, float vmax, float vmin, float *w) {
    vd a = {0}, b = {0};
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        vf v = vload(x + i) / t;
        vf e = (vf)((vi)vexp_weights(v - vmax) & ~(v < vmin));
        vstore(w + (i - lo), e);
        add_wide(&a, &b, e);
    }
    double sum = sum_wide(a, b);
    for (; i < hi; i++) {
        float v = x[i] / t, d = v - vmax;
        float e = d > -87.0f && !(v < vmin) ? exp_nonpositive(d) : 0.0f;
        w[i - lo] = e;
        sum += e;
    }
    return sum;
}

/* The row's weights (0 below vmin) summed a block into s->blocks, returning the total; with store,
 * each weight kept in s->w (top-p reads them), and with hist too their mass over the key's top bits. */
static double weights(const float *x, int64_t v, float t, float vmax, float vmin, Scratch *s, int store) {
    double total = 0.0;
    float block[DRAW_BLOCK];
    for (int64_t lo = 0; lo < v; lo += DRAW_BLOCK) {
        int64_t hi = lo + DRAW_BLOCK < v ? lo + DRAW_BLOCK : v;
        double sum = block_weights(x, lo, hi, t, vmax, vmin, store ? s->w + lo : block);
        s->blocks[lo / DRAW_BLOCK] = sum;
        total += sum;
    }
    if (store) { /* tokens i, i + 4, ... into histogram i % 4, merged in that order */
        memset(s->part, 0, sizeof s->part);
        int64_t i = 0;
        for (; i + 16 <= v; i += 16) {
            vu bucket = vkey(vload(x + i)) >> (32 - RADIX_BITS);
            for (int l = 0; l < 16; l++) s->part[l & 3][bucket[l]] += s->w[i + l];
        }
        for (; i < v; i++) s->part[i & 3][order_key(x[i]) >> (32 - RADIX_BITS)] += s->w[i];
        for (int b = 0; b < RADIX; b++) s->mass[b] = (s->part[0][b] + s->part[1][b]) + (s->part[2][b] + s->part[3][b]);
    }
    return total;
}

/* Pushes rank r into the min-heap of n < cap entries (the worst at the root). */
static void heap_push(uint64_t *h, int64_t n, uint64_t r) {
    int64_t i = n;
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (h[up] <= r) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = r;
}

/* Replaces the heap's root (the worst of n) by r, sifting it down. */
static void heap_replace(uint64_t *h, int64_t n, uint64_t r) {
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (h[c] >= r) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = r;
}

/* Offers token i (key) to the heap of the k best (n of them so far); returns the new count. */
static inline int64_t offer(uint64_t *heap, int64_t n, int64_t k, uint32_t key, int64_t i) {
    uint64_t r = rank_of(key, i);
    if (n < k)
        heap_push(heap, n++, r);
    else if (r > heap[0])
        heap_replace(heap, n, r);
    return n;
}

/* The k best tokens' ranks, best first, in s->heap. Once the heap is full only a key above its worst
 * one can enter (an equal key has a higher id than every token in it), so 16 keys at a time are
 * compared with that one and only those above it offered. */
static void top_k_ranks(const float *x, int64_t v, int64_t k, Scratch *s) {
    int64_t n = 0, i = 0;
    for (; i + 16 <= v; i += 16) {
        vu key = vkey(vload(x + i));
        uint32_t bits = n < k ? 0xFFFFu : lane_bits((vi)(key > (uint32_t)(s->heap[0] >> 32)));
        for (; bits; bits &= bits - 1) {
            int l = __builtin_ctz(bits);
            n = offer(s->heap, n, k, key[l], i + l);
        }
    }
    for (; i < v; i++) n = offer(s->heap, n, k, order_key(x[i]), i);
    for (int64_t end = n - 1; end > 0; end--) { /* heap sort: the worst moves to the end */
        uint64_t worst = s->heap[0];
        heap_replace(s->heap, end, s->heap[end]);
        s->heap[end] = worst;
    }
}

/* Of tokens ranked best first (ranks[0 .. n)), the last that top-p keeps: the mass ahead of it at
 * most bound, starting from ahead (the mass ranked before ranks[0]). */
static uint64_t walk_kept(const uint64_t *ranks, int64_t n, const float *w, double ahead, double bound) {
    uint64_t last = ranks[0];
    for (int64_t j = 0; j < n; j++) {
        if (j && ahead > bound) break;
        last = ranks[j];
        ahead += w[id_of(ranks[j])];
    }
    return last;
}

/* Insertion sort of a few ranks, best first. */
static void sort_ranks(uint64_t *r, int64_t n) {
    for (int64_t i = 1; i < n; i++) {
        uint64_t x = r[i];
        int64_t j = i;
        for (; j > 0 && r[j - 1] < x; j--) r[j] = r[j - 1];
        r[j] = x;
    }
}

/* Top-p over the whole row (its weights in s->w, their histogram over the key's top bits in
 * s->mass): the rank of the last token it keeps, or 0 (every token) where the rounding leaves the
 * whole row within bound. */
static uint64_t top_p_rank(const float *x, int64_t v, double bound, Scratch *s) {
    double ahead = 0.0;
    int64_t n = 0;
    int shift = 32 - RADIX_BITS;
    uint32_t prefix = 0; /* the boundary's key bits from shift up */
    for (int level = 0;; level++) {
        int64_t b = RADIX - 1;
        for (; b >= 0 && ahead + s->mass[b] <= bound; b--) ahead += s->mass[b];
        if (b < 0) return 0;
        prefix |= (uint32_t)b << shift;
        uint32_t high = ~0u << shift; /* shift < 32 */
        int64_t m = 0; /* the boundary bucket's tokens, in id order */
        if (!level) {
            int64_t i = 0;
            for (; i + 16 <= v; i += 16)
                for (uint32_t bits = lane_bits((vi)((vkey(vload(x + i)) & high) == prefix)); bits; bits &= bits - 1)
                    s->ids[m++] = i + __builtin_ctz(bits);
            for (; i < v; i++)
                if ((order_key(x[i]) & high) == prefix) s->ids[m++] = i;
        } else {
            for (int64_t j = 0; j < n; j++)
                if ((order_key(x[s->ids[j]]) & high) == prefix) s->ids[m++] = s->ids[j];
        }
        n = m;
        if (!shift || n <= 32) break;
        shift = shift > RADIX_BITS ? shift - RADIX_BITS : 0;
        memset(s->mass, 0, sizeof s->mass);
        for (int64_t j = 0; j < n; j++)
            s->mass[(order_key(x[s->ids[j]]) >> shift) & (RADIX - 1)] += s->w[s->ids[j]];
    }
    if (!n) return 0;
    /* their ranks, best first: sorted where few, else ties of one key, already in id order */
    uint64_t *ranks = (uint64_t *)s->ids;
    for (int64_t j = 0; j < n; j++) ranks[j] = rank_of(order_key(x[s->ids[j]]), s->ids[j]);
    if (n <= 32) sort_ranks(ranks, n);
    return walk_kept(ranks, n, s->w, ahead, bound);
}

/* Zeroes the weights of the tokens not kept (rank below least where least, v below vmin) and sums
 * the rest a block into s->blocks, returning the total. */
static double keep_only(const float *x, int64_t v, float t, float vmin, uint64_t least, Scratch *s) {
    uint32_t lkey = (uint32_t)(least >> 32);
    int64_t lid = least ? id_of(least) : v;
    vi lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    double total = 0.0;
    for (int64_t lo = 0; lo < v; lo += DRAW_BLOCK) {
        int64_t hi = lo + DRAW_BLOCK < v ? lo + DRAW_BLOCK : v, i = lo;
        vd a = {0}, b = {0};
        for (; i + 16 <= hi; i += 16) {
            vf xs = vload(x + i);
            vu key = vkey(xs);
            vi ids = lanes + (int32_t)i;
            vi kept = (vi)(key > lkey) | ((vi)(key == lkey) & (ids <= (int32_t)lid));
            if (!least) kept = ~(vi){0};
            kept &= ~(xs / t < vmin);
            vf e = (vf)((vi)vload(s->w + i) & kept);
            vstore(s->w + i, e);
            add_wide(&a, &b, e);
        }
        double sum = sum_wide(a, b);
        for (; i < hi; i++) {
            int kept = (!least || rank_of(order_key(x[i]), i) >= least) && !(x[i] / t < vmin);
            if (!kept) s->w[i] = 0.0f;
            sum += s->w[i];
        }
        s->blocks[lo / DRAW_BLOCK] = sum;
        total += sum;
    }
    return total;
}

/* Where u times the total falls in the weights' cumulative sum (their block sums s->blocks; the
 * weights s->w where stored, else the found block's weighed again, 0 below vmin): the first token
 * whose cumulative weight exceeds it; fallback where nothing weighs. */
static int64_t search(const float *x, int64_t v, float t, float vmax, float vmin, double total, double u,
                      const Scratch *s, int stored, int64_t fallback) {
    if (!(total > 0.0) || !(total < INFINITY)) return fallback;
    int64_t nb = (v + DRAW_BLOCK - 1) / DRAW_BLOCK, b = 0;
    double goal = u * total, before = 0.0;
    for (; b < nb - 1 && before + s->blocks[b] <= goal; b++) before += s->blocks[b];
    int64_t lo = b * DRAW_BLOCK, hi = lo + DRAW_BLOCK < v ? lo + DRAW_BLOCK : v, last = -1;
    float block[DRAW_BLOCK];
    const float *w = stored ? s->w + lo : block;
    if (!stored) block_weights(x, lo, hi, t, vmax, vmin, block);
    for (int64_t i = lo; i < hi; i++) {
        if (!(w[i - lo] > 0.0f)) continue;
        before += w[i - lo];
        last = i;
        if (before > goal) return i;
    }
    return last >= 0 ? last : fallback; /* the block's cumulative short of its sum by a rounding */
}

static int compare_ids(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* A top-k row: only its k best are weighed (top-p over their mass, min-p), and the kept ones are
 * drawn in id order; one pass over the row (the heap's). */
static int64_t draw_top_k(const float *x, int64_t v, float t, int64_t k, float p, float mp, double u, Scratch *s) {
    top_k_ranks(x, v, k, s);
    int64_t best = id_of(s->heap[0]), n = k, m = 0;
    float vmax = x[best] / t;
    if (!(vmax > -INFINITY && vmax < INFINITY)) return best; /* NaN or +inf ranks first; all -inf */
    double mass = 0.0, ahead = 0.0, total = 0.0;
    for (int64_t j = 0; j < k; j++) {
        int64_t i = id_of(s->heap[j]);
        float d = x[i] / t - vmax;
        s->w[i] = d > -87.0f ? exp_nonpositive(d) : 0.0f;
        mass += s->w[i];
    }
    if (p < 1.0f)
        for (n = 0; n < k && (!n || ahead <= (double)p * mass); n++) ahead += s->w[id_of(s->heap[n])];
    float vmin = mp > 0.0f ? vmax + logf(mp) : -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        int64_t i = id_of(s->heap[j]);
        if (s->w[i] > 0.0f && !(x[i] / t < vmin)) s->ids[m++] = i;
    }
    if (m <= 32) {
        for (int64_t a = 1; a < m; a++)
            for (int64_t b = a; b > 0 && s->ids[b - 1] > s->ids[b]; b--) {
                int64_t swap = s->ids[b];
                s->ids[b] = s->ids[b - 1], s->ids[b - 1] = swap;
            }
    } else {
        qsort(s->ids, (size_t)m, sizeof *s->ids, compare_ids);
    }
    for (int64_t j = 0; j < m; j++) total += s->w[s->ids[j]];
    double goal = u * total, before = 0.0;
    for (int64_t j = 0; j < m; j++) {
        before += s->w[s->ids[j]];
        if (before > goal) return s->ids[j];
    }
    return m ? s->ids[m - 1] : best;
}

static int64_t draw_row(const float *x, int64_t v, float t, int64_t k, float p, float mp, double u, Scratch *s) {
    if (k > 0 && k < v) return draw_top_k(x, v, t, k, p, mp, u, s);
    int64_t first;
    float m = row_max(x, v, &first);
    float vmax = m / t;
    if (!(vmax > -INFINITY && vmax < INFINITY)) return first; /* +inf, or every token banned */
    float vmin = mp > 0.0f ? vmax + logf(mp) : -INFINITY;
    if (!(p < 1.0f)) /* one pass weighs the row, min-p applied; the search weighs its block again */
        return search(x, v, t, vmax, vmin, weights(x, v, t, vmax, vmin, s, 0), u, s, 0, first);
    /* top-p ranks by the whole row's mass, min-p apart: the weights kept, then masked by both */
    double total = weights(x, v, t, vmax, -INFINITY, s, 1);
    uint64_t least = top_p_rank(x, v, (double)p * total, s); /* the worst kept rank (0: all) */
    return search(x, v, t, vmax, vmin, keep_only(x, v, t, vmin, least, s), u, s, 1, first);
}

void pypto_sample_free(void *scratch);

/* One thread's scratch for rows of v tokens with top_k up to k_cap (freed by pypto_sample_free);
 * NULL where it cannot be allocated. */
void *pypto_sample_scratch(int64_t v, int64_t k_cap) {
    Scratch *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->w = malloc(sizeof(float) * (size_t)(v > 0 ? v : 1));
    s->blocks = malloc(sizeof(double) * (size_t)(v / DRAW_BLOCK + 1));
    s->ids = malloc(sizeof(int64_t) * (size_t)(v > 0 ? v : 1));
    s->heap = malloc(sizeof(uint64_t) * (size_t)(k_cap > 1 ? k_cap : 1));
    if (s->w && s->blocks && s->ids && s->heap) return s;
    pypto_sample_free(s);
    return NULL;
}

void pypto_sample_free(void *scratch) {
    Scratch *s = scratch;
    if (s) free(s->w), free(s->blocks), free(s->ids), free(s->heap);
    free(s);
}

/* One row's token (pypto_sample_rows' rule) with a scratch from pypto_sample_scratch(v, k or more). */
int64_t pypto_sample_draw(const float *x, int64_t v, float temperature, int64_t top_k, float top_p, float min_p,
                          double u, void *scratch) {
    return draw_row(x, v, temperature, top_k, top_p, min_p, u, scratch);
}

static inline uint64_t mix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* pypto_serving.sampler.uniforms of one (seed, output index): splitmix64's finaliser of the finalised
 * seed plus (index + 1) times the golden ratio's constant, its top 32 bits over 2**32. */
double pypto_sample_uniform(int64_t seed, int64_t index) {
    uint64_t z = mix64(mix64((uint64_t)seed) + ((uint64_t)index + 1u) * 0x9E3779B97F4A7C15ull);
    return (double)(z >> 32) * 0x1p-32;
}

/* tokens[r] for rows x [n, v] (row stride xs, float32; v < 2**31), row r being x's row rows[r] (rows
 * NULL: row r), with temperature[r] > 0, top_k[r] (0 or v and more: none), top_p[r] (1: none),
 * min_p[r] (0: none) and the uniform u[r] in [0, 1). Returns 0, or -1 where no thread's scratch could
 * be allocated (tokens then unset). */
int pypto_sample_rows(const float *x, int64_t xs, const int64_t *rows, int64_t n, int64_t v, const float *temperature,
                      const int64_t *top_k, const float *top_p, const float *min_p, const double *u, int64_t *tokens,
                      int threads) {
    int64_t k_cap = 1, next = 0;
    for (int64_t r = 0; r < n; r++)
        if (top_k[r] > k_cap && top_k[r] < v) k_cap = top_k[r];
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) if (threads > 1 && n > 1)
    {
        void *s = pypto_sample_scratch(v, k_cap);
        if (s) /* rows claimed by whichever thread has scratch */
            for (int64_t r; (r = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < n;) {
                const float *row = x + (rows ? rows[r] : r) * xs;
                tokens[r] = draw_row(row, v, temperature[r], top_k[r], top_p[r], min_p[r], u[r], s);
            }
        pypto_sample_free(s);
    }
    return n && !next ? -1 : 0;
}
