/* A mixture of experts' routed block in one call (pypto_kernels.routed_moe on the CPU, and the MoE
 * layers of pypto_kernels.NativeDecoder): the router's product, softmax routing, both expert products
 * and the weighted sum, for r rows. At one token a Qwen3-MoE layer's block was a dozen torch ops and
 * their Python (the routers' MKL products alone 104 us each, docs/benchmarks.md) around two native
 * products that take about as long; here it is the products and a few microseconds of C.
 *
 * For each row x (HF Qwen-MoE's arithmetic, each value rounded where the model's dtype rounds it):
 *   logits = x W_router^T                      (in the kind: bfloat16 rounds them)
 *   p = softmax(logits) in float32             (maximum taken off, expf, summed in expert order)
 *   ids = the top_k largest p, ties to the lower expert; w = p[ids], divided by their sum (summed in
 *         rank order) when norm_topk; then rounded to the kind
 *   out = sum over its experts in expert order of down_e(silu(g) * u, where [g u] = gate_up_e x) * w_e,
 *         each product and each partial sum rounded to the kind (torch's index_add_ in bfloat16)
 * Every product is pypto_grouped_gemv's, which sums each output for its row alone: a row's result
 * depends only on that row, not on the others in the call or the threads. */
#include "common.h"

int pypto_grouped_gemv(const void *w, int kind, int64_t es, int64_t ws, const float *x, float *out,
                       const int64_t *ends, int64_t experts, int64_t n, int64_t in, int round_bf16, int threads);

static inline float kind_round(int kind, float v) { return kind == ELEM_BF16 ? bf16_value(bf16_round(v)) : v; }

static inline float kind_load(const void *p, int kind, int64_t i) {
    return kind == ELEM_BF16 ? bf16_value(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Values a pass over the routes' rows splits over the threads from (fewer: one thread, a decode
 * step's few routes). */
#define MANY 65536

/* A probability's mark once its expert is picked (probabilities are in [0, 1] or NaN). */
#define TAKEN (-2.0f)

/* Row's top_k experts by probability (ties to the lower index) and their weights, from its logits. */
static void route_row(const float *logits, int64_t experts, int64_t top_k, int norm_topk, int kind, float *p,
                      int64_t *ids, float *w) {
    float peak = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < experts; e++) peak = logits[e] > peak ? logits[e] : peak;
    for (int64_t e = 0; e < experts; e++) sum += p[e] = expf(logits[e] - peak);
    for (int64_t e = 0; e < experts; e++) p[e] /= sum;
    for (int64_t j = 0; j < top_k; j++) { /* k passes: k and the experts are a few dozen */
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++) /* a NaN row (never a finite one) takes the first untaken */
            if (p[e] != TAKEN && (best < 0 || p[e] > p[best])) best = e;
        ids[j] = best, w[j] = p[best], p[best] = TAKEN;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < top_k; j++) total += w[j];
    for (int64_t j = 0; j < top_k; j++) w[j] = kind_round(kind, norm_topk ? w[j] / total : w[j]);
}

/* The routes (row, rank) sorted by expert, stably: sorted[ends[e - 1] .. ends[e]) are expert e's in row
 * order. */
static void sort_routes(const int64_t *ids, int64_t routes, int64_t experts, int64_t *ends, int64_t *sorted) {
    memset(ends, 0, sizeof(int64_t) * (size_t)experts);
    for (int64_t i = 0; i < routes; i++) ends[ids[i]]++;
    for (int64_t e = 1; e < experts; e++) ends[e] += ends[e - 1];
    int64_t *next = sorted + routes; /* each expert's next place, scratch after the routes */
    for (int64_t e = 0; e < experts; e++) next[e] = e ? ends[e - 1] : 0;
    for (int64_t i = 0; i < routes; i++) sorted[next[ids[i]]++] = i;
}

/* acc[c] += v[c] * weight for c in [c0, c1), the product and the sum each rounded to the kind. */
static void weigh_into(float *acc, const float *v, float weight, int64_t c0, int64_t c1, int kind) {
    if (kind == ELEM_BF16)
        for (int64_t c = c0; c < c1; c++) acc[c] = kind_round(ELEM_BF16, acc[c] + kind_round(ELEM_BF16, v[c] * weight));
    else
        for (int64_t c = c0; c < c1; c++) acc[c] += v[c] * weight;
}

/* Bytes of scratch pypto_moe_block needs. */
int64_t pypto_moe_scratch_bytes(int64_t r, int64_t hidden, int64_t experts, int64_t top_k, int64_t inter) {
    int64_t routes = r * top_k;
    int64_t floats = r * hidden + r * experts * 2 + routes + routes * (hidden + 3 * inter) + routes * hidden;
    int64_t ints = routes + experts + routes + experts;
    return floats * 4 + 8 + ints * 8 + routes * inter * 4 + 64;
}

/* x [r, hidden] rows of stride xs, the kind (ELEM_F32 or ELEM_BF16) of every matrix and of out;
 * router [experts, hidden] rows dense; gate_up [experts][2 inter, hidden] and down [experts][hidden,
 * inter], rows dense, experts gs and ds elements apart; out [r, hidden] rows of stride os (may be x);
 * scratch: at least pypto_moe_scratch_bytes. Returns 0, or -1 when a product could not allocate its own
 * scratch (out then partly written). */
int pypto_moe_block(int kind, const void *x, int64_t xs, const void *router, const void *gate_up, int64_t gs,
                    const void *down, int64_t ds, int64_t r, int64_t hidden, int64_t experts, int64_t top_k,
                    int64_t inter, int norm_topk, void *out, int64_t os, void *scratch, int threads) {
    int64_t routes = r * top_k, size = kind == ELEM_BF16 ? 2 : 4, rb = kind == ELEM_BF16;
    float *xf = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63), *logits = xf + r * hidden;
    float *p = logits + r * experts, *w = p + r * experts, *rows = w + routes, *gu = rows + routes * hidden;
    float *act = gu + routes * 2 * inter, *y = act + routes * inter;
    int64_t *ids = (int64_t *)(((uintptr_t)(y + routes * hidden) + 7) & ~(uintptr_t)7), *ends = ids + routes, *sorted = ends + experts;
    void *act_kind = sorted + routes + experts; /* the activation in the kind, as pypto_silu_mul writes it */
    for (int64_t i = 0; i < r; i++)
        for (int64_t c = 0; c < hidden; c++) xf[i * hidden + c] = kind_load((const char *)x + i * xs * size, kind, c);
    int64_t one = r;
    if (pypto_grouped_gemv(router, kind, 0, hidden, xf, logits, &one, 1, experts, hidden, (int)rb, threads)) return -1;
    for (int64_t i = 0; i < r; i++)
        route_row(logits + i * experts, experts, top_k, norm_topk, kind, p + i * experts, ids + i * top_k,
                  w + i * top_k);
    sort_routes(ids, routes, experts, ends, sorted);
    int many = threads > 1 && routes * hidden >= MANY; /* rows worth splitting over the threads */
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t j = 0; j < routes; j++) memcpy(rows + j * hidden, xf + sorted[j] / top_k * hidden, hidden * 4);
    if (pypto_grouped_gemv(gate_up, kind, gs, hidden, rows, gu, ends, experts, 2 * inter, hidden, (int)rb, threads))
        return -1;
    if (kind == ELEM_BF16) { /* exact: the products were rounded to bfloat16 */
        uint16_t *g = (uint16_t *)act; /* gu's bfloat16 bits, in act's room (it is not yet written) */
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
        for (int64_t j = 0; j < routes * 2 * inter; j++) g[j] = bf16_round(gu[j]);
        pypto_silu_mul(g, 2 * inter, ELEM_BF16, routes, inter, act_kind, inter, threads);
    } else {
        pypto_silu_mul(gu, 2 * inter, ELEM_F32, routes, inter, act_kind, inter, threads);
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t j = 0; j < routes * inter; j++) act[j] = kind_load(act_kind, kind, j);
    if (pypto_grouped_gemv(down, kind, ds, inter, act, y, ends, experts, hidden, inter, (int)rb, threads)) return -1;
    /* The weighted sum, route by route in expert order (each row meets its experts in that order). */
    float *sum = xf; /* x's float rows are read for the last time above */
    memset(sum, 0, sizeof(float) * (size_t)(r * hidden));
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t c0 = 0; c0 < hidden; c0 += 64) {
        int64_t c1 = c0 + 64 < hidden ? c0 + 64 : hidden;
        for (int64_t j = 0; j < routes; j++)
            weigh_into(sum + sorted[j] / top_k * hidden, y + j * hidden, w[sorted[j]], c0, c1, kind);
    }
    for (int64_t i = 0; i < r; i++) {
        char *o = (char *)out + i * os * size;
        for (int64_t c = 0; c < hidden; c++) {
            if (kind == ELEM_BF16) ((uint16_t *)o)[c] = bf16_round(sum[i * hidden + c]);
            else ((float *)o)[c] = sum[i * hidden + c];
        }
    }
    return 0;
}
