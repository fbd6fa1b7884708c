/* A decode step's decoder layers in one call (pypto_kernels.NativeDecoder): the same kernels,
 * with the same arguments, that the eager CPU forward calls one by one from Python, so its results
 * are those of that forward bit for bit, without the interpreter between them. At concurrency 1 the
 * Python around a layer's nine kernel calls took longer than their C on Qwen3-0.6B (about 8 of a
 * token's 38-46 ms on the Zen 4 EPYC of docs/benchmarks.md), and its data was evicted by the weights
 * streaming through between calls.
 *
 * Each layer, for r query rows (row i a query of request requests[i] at position ends[i] - 1: a decode
 * step's one row a request, or a few a request verifying drafted tokens):
 *   normed = RMSNorm(hidden + residual)           (layer 0: RMSNorm(hidden), residual = hidden)
 *   qkv = normed x W_qkv (+ bias)                  panels
 *   q = q/k head norms and RoPE, k and v written to the caches
 *   attended = paged attention of q over the caches (the layer's window)
 *   o = attended x W_o                             panels
 *   normed = RMSNorm(o + residual)
 *   hidden = silu_mul(normed x W_gate_up) x W_down panels
 *         or, in a mixture of experts' layer, the routed block of normed (moe.c's pypto_moe_block)
 * and the last layer's hidden and residual are returned (their sum is the final hidden state). */
#include "common.h"

#ifdef PYPTO_DECODE_TIMERS
/* A profiling build's (benchmarks/decode_phases.py: -DPYPTO_DECODE_TIMERS) seconds per phase of the
 * layers, summed over the calls of more than 16 rows (a batch's decode steps), then that call count:
 * RMSNorm, QKV, q/k norms + RoPE + cache write, attention, O, RMSNorm, gate-up, SwiGLU, down. */
#include <time.h>
double pypto_decode_phase_seconds[10];
static double phase_clock(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define PHASE(i)                                                                                                \
    do {                                                                                                       \
        double now_ = phase_clock();                                                                           \
        if (r > 16) pypto_decode_phase_seconds[i] += now_ - mark;                                             \
        mark = now_;                                                                                           \
    } while (0)
#else
#define PHASE(i) ((void)0)
#endif

/* One decoder layer's weights (pypto_kernels.native.pack_panels' layouts, the step's element kind)
 * and its caches. */
typedef struct {
    const void *input_norm, *post_norm; /* [hidden] */
    const void *qkv, *qkv_bias;         /* panels of [(heads + 2 kv_heads) head_dim, hidden]; bias or NULL */
    const void *q_norm, *k_norm;        /* [head_dim] each, or both NULL */
    const void *o;                      /* panels of [hidden, heads head_dim] */
    const void *gate_up, *down;         /* panels of [2 inter, hidden] and [hidden, inter], or NULL: */
    const void *router;                 /* a mixture of experts' [experts, hidden], rows dense, and */
    const void *experts_gate_up, *experts_down; /* [experts][2 moe_inter, hidden], [experts][hidden, moe_inter] */
    int64_t expert_strides[2];          /* from one expert's matrix to the next: elements, or bytes */
    int64_t expert_panels;              /* where the experts are panels (moe.c's pypto_moe_block) */
    void *key_cache, *value_cache;      /* [blocks, block_size, kv_heads, head_dim], cache_kind */
    int64_t k_strides[3], v_strides[3]; /* block, token and head strides in elements */
    int64_t window;                     /* keys a query sees (its own and those before), 0: all */
} DecoderLayer;

/* What every layer shares. */
typedef struct {
    int kind, cache_kind; /* the activations' and weights' elements, the caches' */
    int bf16_dot;         /* attention reads the bfloat16 query as it is (pypto_bf16_dot, head_dim % 32 == 0) */
    int64_t hidden, heads, kv_heads, head_dim, inter, rotary, block_size, num_slots;
    float eps, scale;
    int64_t experts, top_k, moe_inter; /* every mixture of experts' layer's (experts 0: none) */
    int norm_topk;
} DecoderShape;

int64_t pypto_moe_scratch_bytes(int64_t r, int64_t hidden, int64_t experts, int64_t top_k, int64_t inter);
int pypto_moe_block(int kind, const void *x, int64_t xs, const void *router, const void *gate_up, int64_t gs,
                    const void *down, int64_t ds, int panels, int64_t r, int64_t hidden, int64_t experts,
                    int64_t top_k, int64_t inter, int norm_topk, void *out, int64_t os, void *scratch, int threads);

/* Bytes of the layers' own scratch for r rows; the routed blocks' follows it. */
static int64_t layer_scratch_bytes(const DecoderShape *s, int64_t r) {
    int64_t size = s->kind == ELEM_BF16 ? 2 : 4, q = s->heads * s->head_dim;
    int64_t elements = s->hidden * 2 + (q + 2 * s->kv_heads * s->head_dim) + q * 2 + s->inter * 3;
    return r * (elements * size + q * 4 + 3 * 8) + 64;
}

/* Bytes of scratch pypto_decode_layers needs for r rows. */
int64_t pypto_decode_scratch_bytes(const DecoderShape *s, int64_t r) {
    int64_t moe = s->experts ? pypto_moe_scratch_bytes(r, s->hidden, s->experts, s->top_k, s->moe_inter) : 0;
    return layer_scratch_bytes(s, r) + moe;
}

/* hidden [r, hidden] (dense, the kind): the step's embeddings in, the last layer's output out;
 * residual [r, hidden]: written. cos, sin [r, rotary] rows of stride cs; slots [r]; tables [requests,
 * table stride]; requests [r] (each row's row of tables); ends [r] (the keys each row sees, itself the
 * last, at most its table's); scratch: at least pypto_decode_scratch_bytes. Returns 0; 1 when a slot
 * is outside the caches (found at the first layer's cache write: nothing is written); -1 when
 * attention's per-thread scratch or the routed products' could not be allocated. */
int pypto_decode_layers(const DecoderLayer *layers, int64_t count, const DecoderShape *s, void *hidden, void *residual,
                        int64_t r, const void *cos, const void *sin, int64_t cs, const int64_t *slots,
                        const int64_t *tables, int64_t table_stride, const int64_t *requests, const int64_t *ends,
                        void *scratch, int threads) {
    int64_t size = s->kind == ELEM_BF16 ? 2 : 4, h = s->hidden, d = s->head_dim, q_width = s->heads * d;
    int64_t qkv_width = q_width + 2 * s->kv_heads * d;
    char *at = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int64_t *rows = (int64_t *)at, *firsts = rows + r, *counts = firsts + r;
    char *normed = (char *)(counts + r), *qkv = normed + r * h * size, *q = qkv + r * qkv_width * size;
    char *attended = q + r * q_width * size, *o = attended + r * q_width * size, *gate_up = o + r * h * size;
    char *act = gate_up + r * 2 * s->inter * size;
    float *q_f32 = (float *)(act + r * s->inter * size);
    void *moe_scratch = (char *)scratch + layer_scratch_bytes(s, r);
    for (int64_t i = 0; i < r; i++) rows[i] = i;
    memcpy(residual, hidden, (size_t)(r * h * size));
#ifdef PYPTO_DECODE_TIMERS
    double mark = phase_clock();
    if (r > 16) pypto_decode_phase_seconds[9] += 1;
#endif
    for (int64_t l = 0; l < count; l++) {
        const DecoderLayer *L = &layers[l];
        pypto_rms_norm(hidden, h, l ? residual : NULL, h, L->input_norm, s->kind, r, h, s->eps, normed, h, residual,
                       h, threads);
        PHASE(0);
        pypto_panel_gemm(s->kind, normed, h, L->qkv, L->qkv_bias, qkv, qkv_width, r, qkv_width, h, threads);
        PHASE(1);
        if (pypto_qk_norm_rope_write(qkv, qkv_width, s->kind, r, s->heads, s->kv_heads, d, L->q_norm, L->k_norm, s->eps,
                                     cos, sin, cs, s->rotary, q, L->key_cache, L->value_cache, s->cache_kind,
                                     L->k_strides, L->v_strides, s->block_size, s->num_slots, slots, threads))
            return 1;
        PHASE(2);
        for (int64_t i = 0; i < r; i++) {
            int64_t lo = L->window && ends[i] > L->window ? ends[i] - L->window : 0;
            firsts[i] = lo;
            counts[i] = ends[i] - lo;
        }
        const uint16_t *q_bf16 = s->bf16_dot ? (const uint16_t *)q : NULL;
        const float *q_float = (const float *)q;
        if (!s->bf16_dot && s->kind == ELEM_BF16) { /* the query widened, as the wrapper's .to(float32) */
            for (int64_t j = 0; j < r * q_width; j++) q_f32[j] = bf16_value(((const uint16_t *)q)[j]);
            q_float = q_f32;
        }
        memset(attended, 0, (size_t)(r * q_width * size));
        if (pypto_paged_attention(q_bf16 ? NULL : q_float, q_width, d, L->key_cache, L->value_cache, s->cache_kind,
                                  L->k_strides, L->v_strides, tables, table_stride, rows, requests, firsts, counts, r,
                                  s->heads, s->kv_heads, d, d, s->block_size, s->scale, NULL, attended, s->kind,
                                  q_width, d, q_bf16, 0, threads))
            return -1;
        PHASE(3);
        pypto_panel_gemm(s->kind, attended, q_width, L->o, NULL, o, h, r, h, q_width, threads);
        PHASE(4);
        pypto_rms_norm(o, h, residual, h, L->post_norm, s->kind, r, h, s->eps, normed, h, residual, h, threads);
        PHASE(5);
        if (L->router) {
            if (pypto_moe_block(s->kind, normed, h, L->router, L->experts_gate_up, L->expert_strides[0],
                                L->experts_down, L->expert_strides[1], (int)L->expert_panels, r, h, s->experts,
                                s->top_k, s->moe_inter,
                                s->norm_topk, hidden, h, moe_scratch, threads))
                return -1;
            continue;
        }
        pypto_panel_gemm(s->kind, normed, h, L->gate_up, NULL, gate_up, 2 * s->inter, r, 2 * s->inter, h, threads);
        PHASE(6);
        pypto_silu_mul(gate_up, 2 * s->inter, s->kind, r, s->inter, act, s->inter, threads);
        PHASE(7);
        pypto_panel_gemm(s->kind, act, s->inter, L->down, NULL, hidden, h, r, h, s->inter, threads);
        PHASE(8);
    }
    return 0;
}

/* What pypto_greedy_run reads around the layers, of the layers' kind (pypto_kernels.GreedyTail). */
typedef struct {
    const void *embed, *norm, *head; /* [vocab, hidden] rows of stride embed_stride; [hidden]; the panels
                                        (panel_gemm.c) of the [head_rows, hidden] output projection */
    int64_t embed_stride, head_rows;
    const void *cos, *sin; /* [positions, rotary] rows of stride cos_stride */
    int64_t cos_stride;
    float eps;
} GreedyTail;

/* What one pypto_greedy_run writes: the layers' in/out row and residual, the final norm's output and
 * sum ([hidden] each, of the kind). */
typedef struct {
    void *hidden, *residual, *normed, *summed;
} GreedyBuffers;

void pypto_panel_gemm_logits(int kind, const void *x, int64_t xs, const void *panels, const void *bias, float *out,
                             int64_t os, int64_t m, int64_t n, int64_t k, float *row_max, int64_t *row_arg,
                             int threads);
void *pypto_sample_scratch(int64_t v, int64_t k_cap);
void pypto_sample_free(void *scratch);
int64_t pypto_sample_draw(const float *x, int64_t v, float temperature, int64_t top_k, float top_p, float min_p,
                          double u, void *scratch);
double pypto_sample_uniform(int64_t seed, int64_t index);

/* A sampled request's draw (pypto_kernels.SampledRun): each forward's logits are stored in logits
 * ([head_rows] float32, as the eager forward stores them) and its token drawn from them by
 * pypto_sample_draw with the uniform of (seed, index + the forward's number): the sampler's draw of
 * the request's next output. */
typedef struct {
    float temperature, top_p, min_p;
    int64_t top_k, seed, index;
    float *logits;
} SampledRun;

/* pypto_greedy_run's forwards (drawing: draw's scratch from pypto_sample_scratch, or NULL). */
static int64_t greedy_forwards(const DecoderLayer *layers, int64_t count, const DecoderShape *s,
                               const GreedyTail *tail, const GreedyBuffers *b, const int64_t *table,
                               int64_t table_len, int64_t token, int64_t position, int64_t steps, const int64_t *stop,
                               int64_t num_stop, const int32_t *interrupt, int32_t seen, const SampledRun *draw,
                               void *drawing, void *scratch, int64_t *tokens, int *status, int threads) {
    int64_t size = s->kind == ELEM_BF16 ? 2 : 4, h = s->hidden, bs = s->block_size, n = 0, request = 0;
    for (int64_t pos = position; pos < position + steps; pos++) {
        int64_t slot = table[pos / bs] * bs + pos % bs, end = pos + 1;
        memcpy(b->hidden, (const char *)tail->embed + token * tail->embed_stride * size, (size_t)(h * size));
        const char *cos = (const char *)tail->cos + pos * tail->cos_stride * size;
        const char *sin = (const char *)tail->sin + pos * tail->cos_stride * size;
        *status = pypto_decode_layers(layers, count, s, b->hidden, b->residual, 1, cos, sin, tail->cos_stride, &slot,
                                      table, table_len, &request, &end, scratch, threads);
        if (*status) return n;
        pypto_rms_norm(b->hidden, h, b->residual, h, tail->norm, s->kind, 1, h, tail->eps, b->normed, h, b->summed,
                       h, threads);
        float peak = 0.0f;
        int64_t index = -1, rows = tail->head_rows;
        pypto_panel_gemm_logits(s->kind, b->normed, h, tail->head, NULL, draw ? draw->logits : NULL, rows, 1, rows, h,
                                &peak, &index, threads);
        if (index < 0) { /* the product's scratch could not be allocated: no maximum was taken */
            *status = -2;
            return n;
        }
        if (!(peak < INFINITY)) return n;
        if (draw) {
            double u = pypto_sample_uniform(draw->seed, draw->index + n);
            index = pypto_sample_draw(draw->logits, rows, draw->temperature, draw->top_k, draw->top_p, draw->min_p, u,
                                      drawing);
        }
        tokens[n++] = token = index;
        for (int64_t j = 0; j < num_stop; j++)
            if (stop[j] == token) return n;
        if (interrupt && __atomic_load_n(interrupt, __ATOMIC_RELAXED) != seen) return n;
    }
    return n;
}

/* Up to steps decode forwards of one request back to back (NativeDecoder.greedy_run), with no
 * interpreter between them: each forward is the token's embedding row, pypto_decode_layers, the final
 * pypto_rms_norm over their output and residual, and the output projection's panels product of that
 * one row taking its maximum without storing the logits (pypto_panel_gemm_logits), the same calls on
 * the same values as the eager forward's, and the next forward's token is that maximum's index; with
 * draw (not NULL), the product stores the logits too and the token is drawn from them (SampledRun). The
 * head's panels sum each logit in the order they do in any batch, so a request's tokens alone are
 * those it gets among others. Between ctypes calls of each kernel the interpreter takes 0.2-0.3 ms a
 * forward on the Zen 4 EPYC of docs/benchmarks.md, most of it after the head's product (its data
 * evicted by the matrix streaming past), 8 % of a small-shape token. The run stops after a token in
 * stop[0 .. num_stop), before keeping a token whose maximum logit is not finite (NaN or infinite),
 * after any forward where *interrupt (when not NULL) differs from seen (another thread or process
 * counts arrivals there: an atomic read, so each forward sees its latest value), or after steps.
 * table: the request's blocks (table_len of them, covering the run's positions: the caller checks).
 * Writes the tokens to tokens and returns how many; *status: 0, or as pypto_decode_layers' (1: a slot
 * outside the caches, -1: attention's scratch) or -2 (the head product's scratch) for the forward
 * after them (-2 too where draw's scratch could not be allocated: nothing ran). */
int64_t pypto_greedy_run(const DecoderLayer *layers, int64_t count, const DecoderShape *s, const GreedyTail *tail,
                         const GreedyBuffers *b, const int64_t *table, int64_t table_len, int64_t token,
                         int64_t position, int64_t steps, const int64_t *stop, int64_t num_stop,
                         const int32_t *interrupt, int32_t seen, const SampledRun *draw, void *scratch,
                         int64_t *tokens, int *status, int threads) {
    *status = 0;
    void *drawing = draw ? pypto_sample_scratch(tail->head_rows, draw->top_k) : NULL;
    if (draw && !drawing) {
        *status = -2;
        return 0;
    }
    int64_t n = greedy_forwards(layers, count, s, tail, b, table, table_len, token, position, steps, stop, num_stop,
                                interrupt, seen, draw, drawing, scratch, tokens, status, threads);
    pypto_sample_free(drawing);
    return n;
}
