/* DeepSeek-V4's hyper-connection mixing weights after the projection (pypto_kernels.hc_sinkhorn_mix):
 * per token, from the M = N * (N + 2) projected logits, the pre weights (sigmoid), the post weights
 * (2 sigmoid), the N x N mixing matrix (a row softmax, then Sinkhorn's alternating column and row
 * normalisation) and the pre-weighted sum of the N streams. In torch that is about 80 ops on tensors
 * of a few values each, so a call costs their dispatch; here it is one pass per token, tokens split
 * over threads. Every operation follows the torch reference's order (sums left to right, "+ eps" after
 * the sum, division, no fused multiply-add: the file is built with -ffp-contract=off semantics by
 * writing each rounding step out), so the results differ from it only where expf does from torch's
 * vectorised exponential (a few ulp in the sigmoids and the softmax). */
#include "common.h"

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#else
#pragma GCC optimize("fp-contract=off")
#endif

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* One token's post [n], comb [n, n] and the float32 weights pre [n] of its stream sum. */
static void mix_weights(const float *mixes, int64_t n, const float *base, const float *scale, int iters, float eps,
                        float *pre, float *post, float *comb) {
    for (int64_t i = 0; i < n; i++) {
        float a = mixes[i] * scale[0], b = mixes[n + i] * scale[1];
        pre[i] = sigmoid(a + base[i]) + eps;
        post[i] = 2.0f * sigmoid(b + base[n + i]);
    }
    const float *logits = mixes + 2 * n, *bias = base + 2 * n;
    for (int64_t r = 0; r < n; r++) {
        float *row = comb + r * n, top = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < n; c++) {
            float v = logits[r * n + c] * scale[2];
            row[c] = v + bias[r * n + c];
            top = row[c] > top ? row[c] : top;
        }
        for (int64_t c = 0; c < n; c++) {
            row[c] = expf(row[c] - top);
            total += row[c];
        }
        for (int64_t c = 0; c < n; c++) row[c] = row[c] / total + eps;
    }
    /* Columns first, then (iters - 1) rounds of rows and columns. */
    for (int round = 0; round < 2 * iters - 1; round++) {
        int columns = round % 2 == 0;
        for (int64_t a = 0; a < n; a++) {
            float sum = 0.0f;
            for (int64_t b = 0; b < n; b++) sum += columns ? comb[b * n + a] : comb[a * n + b];
            sum = sum + eps;
            for (int64_t b = 0; b < n; b++) {
                float *v = columns ? &comb[b * n + a] : &comb[a * n + b];
                *v = *v / sum;
            }
        }
    }
}

/* mixes [t, n * (n + 2)] float32 (rows of stride ms); streams [t, n, d] (token stride ss, stream
 * stride sn, elements dense) of kind ELEM_F32 or ELEM_BF16; base [n * (n + 2)], scale [3] float32.
 * Writes post [t, n] and comb [t, n, n] (float32, dense) and collapsed [t, d] (dense, the streams'
 * kind). Returns 0, or 1 for an n above 16. */
int pypto_hc_sinkhorn_mix(const float *mixes, int64_t ms, const void *streams, int kind, int64_t ss, int64_t sn,
                          int64_t t, int64_t n, int64_t d, const float *base, const float *scale, int iters,
                          float eps, float *post, float *comb, void *collapsed, int threads) {
    if (n > 16) return 1;
    enum { GRAIN = 8, BLOCK = 64 };
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= 2 * GRAIN && threads > 1)
    for (int64_t i = 0; i < t; i++) {
        float pre[16];
        mix_weights(mixes + i * ms, n, base, scale, iters, eps, pre, post + i * n, comb + i * n * n);
        /* The weighted sum of the streams, BLOCK elements at a time: stream 0 first, as torch's sum. */
        for (int64_t e0 = 0; e0 < d; e0 += BLOCK) {
            int64_t width = d - e0 < BLOCK ? d - e0 : BLOCK;
            float acc[BLOCK] = {0.0f};
            for (int64_t j = 0; j < n; j++) {
                int64_t at = i * ss + j * sn + e0;
                if (kind == ELEM_BF16) {
                    const uint16_t *x = (const uint16_t *)streams + at;
                    for (int64_t e = 0; e < width; e++) {
                        float p = pre[j] * bf16_value(x[e]);
                        acc[e] = acc[e] + p;
                    }
                } else {
                    const float *x = (const float *)streams + at;
                    for (int64_t e = 0; e < width; e++) {
                        float p = pre[j] * x[e];
                        acc[e] = acc[e] + p;
                    }
                }
            }
            if (kind == ELEM_BF16)
                for (int64_t e = 0; e < width; e++) ((uint16_t *)collapsed)[i * d + e0 + e] = bf16_round(acc[e]);
            else
                memcpy((float *)collapsed + i * d + e0, acc, (size_t)width * sizeof(float));
        }
    }
    return 0;
}
