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
 * The router's product is pypto_grouped_gemv's; the experts' too over plain matrices, or
 * pypto_grouped_panel_gemm's over experts packed as panels (the form that reaches the FLOP peak with a
 * few rows an expert). Each sums every output for its row alone: a row's result depends only on that
 * row, not on the others in the call or the threads. */
#include "common.h"

int pypto_grouped_gemv(const void *w, int kind, int64_t es, int64_t ws, const float *x, float *out,
                       const int64_t *ends, int64_t experts, int64_t n, int64_t in, int round_bf16, int threads);
int pypto_grouped_panel_gemm(int kind, const void *x, int64_t xs, const void *panels, int64_t es, void *out,
                             int64_t os, const int64_t *ends, int64_t experts, int64_t n, int64_t k, int threads);

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
    return floats * 4 + 8 + ints * 8 + routes * (inter + hidden) * 4 + 64;
}

/* The block's scratch, carved from pypto_moe_scratch_bytes: float rows of x, the router's logits and
 * probabilities, the routes' weights, their rows of x, gate-up outputs, activations and down outputs
 * (float32), the routes' experts and their order, and room for the activations and down outputs in
 * the kind. */
typedef struct {
    float *xf, *logits, *p, *w, *rows, *gu, *act, *y;
    int64_t *ids, *ends, *sorted;
    void *act_kind, *y_kind;
} Scratch;

static Scratch carve(void *scratch, int64_t r, int64_t hidden, int64_t experts, int64_t routes, int64_t inter) {
    Scratch s;
    s.xf = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63), s.logits = s.xf + r * hidden;
    s.p = s.logits + r * experts, s.w = s.p + r * experts, s.rows = s.w + routes, s.gu = s.rows + routes * hidden;
    s.act = s.gu + routes * 2 * inter, s.y = s.act + routes * inter;
    s.ids = (int64_t *)(((uintptr_t)(s.y + routes * hidden) + 7) & ~(uintptr_t)7);
    s.ends = s.ids + routes, s.sorted = s.ends + experts;
    s.act_kind = s.sorted + routes + experts, s.y_kind = (char *)s.act_kind + routes * inter * 4;
    return s;
}

/* Both expert products over plain matrices (pypto_grouped_gemv, float32 rows in and out, bfloat16 ones
 * rounded): s->y, the down outputs as float32. */
static int plain_experts(const Scratch *s, int kind, const void *gate_up, int64_t gs, const void *down, int64_t ds,
                         int64_t routes, int64_t top_k, int64_t experts, int64_t hidden, int64_t inter, int many,
                         int threads) {
    int rb = kind == ELEM_BF16;
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t j = 0; j < routes; j++) memcpy(s->rows + j * hidden, s->xf + s->sorted[j] / top_k * hidden, hidden * 4);
    if (pypto_grouped_gemv(gate_up, kind, gs, hidden, s->rows, s->gu, s->ends, experts, 2 * inter, hidden, rb, threads))
        return -1;
    if (kind == ELEM_BF16) { /* exact: the products were rounded to bfloat16 */
        uint16_t *g = (uint16_t *)s->act; /* gu's bfloat16 bits, in act's room (it is not yet written) */
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
        for (int64_t j = 0; j < routes * 2 * inter; j++) g[j] = bf16_round(s->gu[j]);
        pypto_silu_mul(g, 2 * inter, ELEM_BF16, routes, inter, s->act_kind, inter, threads);
    } else {
        pypto_silu_mul(s->gu, 2 * inter, ELEM_F32, routes, inter, s->act_kind, inter, threads);
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t j = 0; j < routes * inter; j++) s->act[j] = kind_load(s->act_kind, kind, j);
    return pypto_grouped_gemv(down, kind, ds, inter, s->act, s->y, s->ends, experts, hidden, inter, rb, threads);
}

/* Both expert products over panels (pypto_grouped_panel_gemm, rows in the kind; gs and ds: bytes
 * between experts' panels): s->y, the down outputs widened to float32. */
static int panel_experts(const Scratch *s, int kind, const void *x, int64_t xs, const void *gate_up, int64_t gs,
                         const void *down, int64_t ds, int64_t routes, int64_t top_k, int64_t experts,
                         int64_t hidden, int64_t inter, int many, int threads) {
    int64_t size = kind == ELEM_BF16 ? 2 : 4;
    char *rows = (char *)s->rows, *gu = (char *)s->gu; /* in the kind, in the float32 areas' room */
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t j = 0; j < routes; j++)
        memcpy(rows + j * hidden * size, (const char *)x + s->sorted[j] / top_k * xs * size, hidden * size);
    if (pypto_grouped_panel_gemm(kind, rows, hidden, gate_up, gs, gu, 2 * inter, s->ends, experts, 2 * inter, hidden,
                                 threads))
        return -1;
    pypto_silu_mul(gu, 2 * inter, kind, routes, inter, s->act_kind, inter, threads);
    if (pypto_grouped_panel_gemm(kind, s->act_kind, inter, down, ds, s->y_kind, hidden, s->ends, experts, hidden,
                                 inter, threads))
        return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t j = 0; j < routes * hidden; j++) s->y[j] = kind_load(s->y_kind, kind, j);
    return 0;
}

/* x [r, hidden] rows of stride xs, the kind (ELEM_F32 or ELEM_BF16) of every matrix and of out;
 * router [experts, hidden] rows dense; gate_up [experts][2 inter, hidden] and down [experts][hidden,
 * inter]: plain matrices with rows dense, experts gs and ds elements apart, or (panels) each expert's
 * matrices as pypto_panel_gemm's panels, experts gs and ds bytes apart; out [r, hidden] rows of stride
 * os (may be x); scratch: at least pypto_moe_scratch_bytes. Returns 0, or -1 when a product could not
 * allocate its own scratch (out then partly written). */
int pypto_moe_block(int kind, const void *x, int64_t xs, const void *router, const void *gate_up, int64_t gs,
                    const void *down, int64_t ds, int panels, int64_t r, int64_t hidden, int64_t experts,
                    int64_t top_k, int64_t inter, int norm_topk, void *out, int64_t os, void *scratch, int threads) {
    int64_t routes = r * top_k, size = kind == ELEM_BF16 ? 2 : 4, one = r;
    Scratch s = carve(scratch, r, hidden, experts, routes, inter);
    for (int64_t i = 0; i < r; i++)
        for (int64_t c = 0; c < hidden; c++) s.xf[i * hidden + c] = kind_load((const char *)x + i * xs * size, kind, c);
    if (pypto_grouped_gemv(router, kind, 0, hidden, s.xf, s.logits, &one, 1, experts, hidden, kind == ELEM_BF16,
                           threads))
        return -1;
    for (int64_t i = 0; i < r; i++)
        route_row(s.logits + i * experts, experts, top_k, norm_topk, kind, s.p + i * experts, s.ids + i * top_k,
                  s.w + i * top_k);
    sort_routes(s.ids, routes, experts, s.ends, s.sorted);
    int many = threads > 1 && routes * hidden >= MANY; /* rows worth splitting over the threads */
    if (panels ? panel_experts(&s, kind, x, xs, gate_up, gs, down, ds, routes, top_k, experts, hidden, inter, many,
                               threads)
               : plain_experts(&s, kind, gate_up, gs, down, ds, routes, top_k, experts, hidden, inter, many, threads))
        return -1;
    /* The weighted sum, route by route in expert order (each row meets its experts in that order). */
    float *sum = s.xf; /* x's float rows are read for the last time above */
    memset(sum, 0, sizeof(float) * (size_t)(r * hidden));
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t c0 = 0; c0 < hidden; c0 += 64) {
        int64_t c1 = c0 + 64 < hidden ? c0 + 64 : hidden;
        for (int64_t j = 0; j < routes; j++)
            weigh_into(sum + s.sorted[j] / top_k * hidden, s.y + j * hidden, s.w[s.sorted[j]], c0, c1, kind);
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
