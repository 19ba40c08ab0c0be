/* S17: paged attention on the CPU, reading the KV pool in place through the block tables.
 *
 * One call computes a whole layer's attention for a ragged batch (decodes and prompt chunks
 * alike): token n of request b, which has T_b new tokens and a context of S_b positions after
 * this step, sees positions 0 .. S_b - T_b + i (i: its index among b's new tokens). Position p
 * of request b lives in block block_tables[b][p / block_size] at offset p % block_size of the
 * pool (num_blocks, block_size, Hkv, D). Each block is one tile of FlashAttention's online
 * softmax: its scores are computed, the running max and sum rescaled once, its values added.
 * No key is copied and no score row longer than a block is ever stored.
 *
 * Work unit: one (token, KV head) pair, the G = H / Hkv query heads that share the KV head
 * together, so each key and value is loaded once for G heads (grouped-query attention).
 * float32 only; unit stride along D; q and out addressed through strides, so the runner passes
 * its (H, N, D) tensors without a copy. Built by code/s17_cpu.py with gcc -O3 (OpenMP over the
 * work units when the compiler has it).
 *
 * Two things made it 2 to 4 times faster than a first version that called expf per score
 * with a run-time head size (measured on this course's 2-core CPU): the exponentials are 2^x
 * by a short polynomial the compiler vectorises (FlashAttention-2 works in base 2 too; here
 * the factor log2(e) is folded into q once), where the C library's expf is one call per
 * score; and the common head sizes are compiled as constants (the `switch` at the bottom),
 * so each dot product is a few vector instructions with no loop around them. Not -ffast-math: with gcc 12 a shared library
 * built with it switches the whole process to flush-to-zero when it is loaded (measured: torch
 * then returned 0 for 1e-39 * 1.0), and it assumes no value is infinite.
 *
 * References: Dao et al., FlashAttention (2022), Algorithm 1; Kwon et al., PagedAttention
 * (SOSP 2023). Written for this course.
 */
#include <math.h>
#include <stdint.h>
#include <float.h>
#include <string.h>

#define LOG2E 1.4426950408889634f

/* 2^x for x <= 0, relative error at most 2.5e-7 (measured against double exp2 over every
 * float in [-126, 0]; float32's own rounding is 6e-8): x = i + f with i an
 * integer and |f| <= 1/2; 2^i is put straight into a float's exponent bits, 2^f is the Taylor
 * series of e^(f ln 2) to degree 6. Below -126 the result would be a denormal: 2^-126 is
 * returned, a weight of 1e-38 next to a running sum >= 1. */
static inline float exp2_nonpositive(float x) {
    x = x < -126.0f ? -126.0f : x;
    const float i = rintf(x), f = x - i;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)i + 127) << 23;
    float two_i;
    memcpy(&two_i, &bits, sizeof two_i);
    return p * two_i;
}

static int64_t request_of(const int64_t *query_start_loc, int64_t num_seqs, int64_t n) {
    /* the b with query_start_loc[b] <= n < query_start_loc[b + 1] (binary search) */
    int64_t lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (query_start_loc[mid] <= n) lo = mid; else hi = mid;
    }
    return lo;
}

/* One token's G query heads of KV head g against its first `visible` positions. */
static inline __attribute__((always_inline)) void work_unit(
        const float *q, int64_t q_stride_h, const float *k_cache, const float *v_cache,
        const int64_t *table, int64_t visible, int64_t G, int64_t g, int64_t num_kv_heads,
        const int64_t D, int64_t bs, float scale, float *out, int64_t out_stride_h) {
    const int64_t row = num_kv_heads * D;       /* floats from one slot to the next */
    float m[G], l[G], acc[G * D], qs[G * D], p[G * bs];   /* running max, sum, output */
    for (int64_t h = 0; h < G; ++h) {           /* m starts at the lowest float, not -inf */
        m[h] = -FLT_MAX; l[h] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
            acc[h * D + d] = 0.0f;
            qs[h * D + d] = q[(g * G + h) * q_stride_h + d] * (scale * LOG2E);
        }
    }
    for (int64_t start = 0; start < visible; start += bs) {
        const int64_t count = visible - start < bs ? visible - start : bs;
        const int64_t base = (table[start / bs] * bs * num_kv_heads + g) * D;
        const float *keys = k_cache + base, *values = v_cache + base;
        for (int64_t s = 0; s < count; ++s) {   /* the block's scores, in base 2 */
            const float *ks = keys + s * row;
            for (int64_t h = 0; h < G; ++h) {
                float dot = 0.0f;
                for (int64_t d = 0; d < D; ++d) dot += qs[h * D + d] * ks[d];
                p[h * bs + s] = dot;
            }
        }
        for (int64_t h = 0; h < G; ++h) {       /* new max; rescale the old state once */
            float *ph = p + h * bs;
            float top = m[h];
            for (int64_t s = 0; s < count; ++s) top = ph[s] > top ? ph[s] : top;
            const float alpha = exp2_nonpositive(m[h] - top);
            float sum = 0.0f;
            for (int64_t s = 0; s < count; ++s) {
                ph[s] = exp2_nonpositive(ph[s] - top);
                sum += ph[s];
            }
            l[h] = l[h] * alpha + sum;
            m[h] = top;
            for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= alpha;
        }
        for (int64_t s = 0; s < count; ++s) {   /* add the block's weighted values */
            const float *vs = values + s * row;
            for (int64_t h = 0; h < G; ++h) {
                const float w = p[h * bs + s];
                for (int64_t d = 0; d < D; ++d) acc[h * D + d] += w * vs[d];
            }
        }
    }
    for (int64_t h = 0; h < G; ++h) {
        float *o = out + (g * G + h) * out_stride_h;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] * inv;
    }
}

void paged_attention_f32(
        const float *q, int64_t q_stride_n, int64_t q_stride_h,
        const float *k_cache, const float *v_cache,
        const int64_t *block_tables, int64_t table_stride,
        const int64_t *query_start_loc, const int64_t *seq_lens, int64_t num_seqs,
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
        float scale, float *out, int64_t out_stride_n, int64_t out_stride_h,
        int num_threads) {
    const int64_t G = num_heads / num_kv_heads;
    const int64_t num_tokens = query_start_loc[num_seqs];
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads)
    for (int64_t work = 0; work < num_tokens * num_kv_heads; ++work) {
        const int64_t n = work / num_kv_heads, g = work % num_kv_heads;
        const int64_t b = request_of(query_start_loc, num_seqs, n);
        const int64_t t_len = query_start_loc[b + 1] - query_start_loc[b];
        const int64_t visible = seq_lens[b] - t_len + (n - query_start_loc[b]) + 1;
        const int64_t *table = block_tables + b * table_stride;
        const float *qn = q + n * q_stride_n;
        float *on = out + n * out_stride_n;
#define UNIT(D) work_unit(qn, q_stride_h, k_cache, v_cache, table, visible, G, g, \
                        num_kv_heads, (D), block_size, scale, on, out_stride_h)
        switch (head_dim) {     /* common head sizes as constants: see the top of the file */
        case 32: UNIT(32); break;
        case 64: UNIT(64); break;
        case 128: UNIT(128); break;
        default: UNIT(head_dim);
        }
#undef UNIT
    }
}
