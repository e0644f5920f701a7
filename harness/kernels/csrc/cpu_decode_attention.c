/* Decode attention over a contiguous fp32 KV cache on a CPU: one query position per sequence, GQA.
 *
 * A C++ translation unit of the kernels' extension (harness/kernels/extension.py: -O3 -march=native
 * -ffast-math -fopenmp, linked without -ffast-math so loading it leaves the process's floating-point
 * mode alone), the operator harness_kernels::decode_attention (ops.cpp); used by `contiguous` and
 * `dynamic` for their decode steps on a CPU in fp32, and by `static_full` over its whole table with a
 * mask (strategy.backend=auto|c).
 *
 * Why a kernel of our own: with a GQA group of G query heads per KV head, decode attention does G
 * multiply-adds per cached value, 2 FLOP/B at G = 4, so reading the cache at DRAM speed needs tens of
 * GFLOP/s from G-row matrix products, which SDPA's CPU kernel (G-row GEMMs through the BLAS) does not
 * reach; scripts/kernel_read_rate.py measures the two kernels' read rates on the machine at hand.
 *
 * How: one task per (sequence, KV head), spread over torch's OpenMP threads. A task walks its keys in
 * blocks of BLOCK with an online softmax (FlashAttention's running max and sum), so each key and value
 * row is read from memory exactly once: the block's scores for all G queries, then the block's values
 * accumulated into G x D outputs. Head dimensions 64 and 128 take the fixed-width path of
 * cpu_attention_fixed.h (vectorised for those widths, and reading 8 segments of the table in lockstep:
 * its header says why); any other width takes the generic path below (consecutive keys, software
 * prefetch a few rows ahead).
 * -ffast-math lets the compiler vectorise the reductions and expf (glibc's libmvec); sums are
 * reassociated, so outputs match SDPA's to ~1e-7, not bit for bit.
 *
 * `visible` masks keys visible..length-1 (their weight is exactly 0) while still reading them: the
 * static_full layout, which attends over its whole preallocated table every step.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h" /* MAX_GROUP, MAX_DIM */

#define PREFETCH 16   /* key rows the generic path prefetches ahead (without it one core reads far slower) */

#include "cpu_attention_fixed.h" /* BLOCK, MASKED and the fixed-width path (head dimensions 64 and 128) */

/* scores[g][j] = scale * q[g] . key_j for the n keys of one block: each key row is loaded once for
 * all G dot products. The value row j and key row j + PREFETCH are prefetched (a prefetch past the
 * end of the table is a hint that never faults). */
static void block_scores(const float *q, const float *k, int64_t k_row, const float *v, int64_t v_row,
                         int64_t n, int64_t group, int64_t dim, float scale, float scores[MAX_GROUP][BLOCK]) {
    for (int64_t j = 0; j < n; j++) {
        const float *key = k + j * k_row;
        for (int64_t line = 0; line < dim; line += 16) { /* 16 floats: one 64-byte cache line */
            __builtin_prefetch(key + PREFETCH * k_row + line);
            __builtin_prefetch(v + j * v_row + line);
        }
        if (group == 4) { /* Llama 3 8B's group: four independent sums, one pass over the key */
            const float *q0 = q, *q1 = q + dim, *q2 = q + 2 * dim, *q3 = q + 3 * dim;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t d = 0; d < dim; d++) {
                float kd = key[d];
                s0 += q0[d] * kd;
                s1 += q1[d] * kd;
                s2 += q2[d] * kd;
                s3 += q3[d] * kd;
            }
            scores[0][j] = s0 * scale;
            scores[1][j] = s1 * scale;
            scores[2][j] = s2 * scale;
            scores[3][j] = s3 * scale;
        } else {
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * dim;
                float s = 0;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < dim; d++) s += qg[d] * key[d];
                scores[g][j] = s * scale;
            }
        }
    }
}

/* acc[g][:] += sum_j p[g][j] * value_j over the n values of one block, 16 columns at a time so the
 * partial sums stay in registers across the block instead of going through memory for every row. */
static void block_values(const float *v, int64_t v_row, int64_t n, int64_t group, int64_t dim,
                         float p[MAX_GROUP][BLOCK], float acc[MAX_GROUP][MAX_DIM]) {
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        if (d0 + 16 > dim) { /* a head dimension that is not a multiple of 16: the tail row by row */
            for (int64_t g = 0; g < group; g++)
                for (int64_t j = 0; j < n; j++)
                    for (int64_t d = d0; d < dim; d++) acc[g][d] += p[g][j] * v[j * v_row + d];
            break;
        }
        for (int64_t g = 0; g < group; g++) {
            float a[16];
            for (int c = 0; c < 16; c++) a[c] = acc[g][d0 + c];
            for (int64_t j = 0; j < n; j++) {
                const float *value = v + j * v_row + d0;
                float pj = p[g][j];
#pragma omp simd
                for (int c = 0; c < 16; c++) a[c] += pj * value[c];
            }
            for (int c = 0; c < 16; c++) acc[g][d0 + c] = a[c];
        }
    }
}

/* The generic path, any head dimension: one (sequence, KV head), out[g] = softmax(scale * q[g] . K^T) V
 * over keys 0..length-1, keys visible.. masked. Blocks are consecutive keys. */
static void attend_one(const float *q, const float *k, int64_t k_row, const float *v, int64_t v_row, float *out,
                       int64_t group, int64_t length, int64_t visible, int64_t dim, float scale) {
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], p[MAX_GROUP][BLOCK], acc[MAX_GROUP][MAX_DIM];
    for (int64_t g = 0; g < group; g++) {
        running_max[g] = -FLT_MAX; /* finite: -ffast-math assumes no infinities */
        running_sum[g] = 0.0f;
        memset(acc[g], 0, sizeof(float) * dim);
    }
    for (int64_t start = 0; start < length; start += BLOCK) {
        int64_t n = length - start < BLOCK ? length - start : BLOCK;
        block_scores(q, k + start * k_row, k_row, v + start * v_row, v_row, n, group, dim, scale, p);
        float weight_mask[BLOCK]; /* 1 for a visible key, 0 for a masked one */
        int masked = start + n > visible;
        for (int64_t j = 0; j < n; j++) weight_mask[j] = start + j < visible ? 1.0f : 0.0f;
        for (int64_t g = 0; g < group; g++) {
            if (masked)
                for (int64_t j = visible - start < 0 ? 0 : visible - start; j < n; j++) p[g][j] = MASKED;
            float correction = online_softmax(p[g], n, &running_max[g], &running_sum[g], masked ? weight_mask : NULL);
            for (int64_t d = 0; d < dim; d++) acc[g][d] *= correction;
        }
        block_values(v + start * v_row, v_row, n, group, dim, p, acc);
    }
    for (int64_t g = 0; g < group; g++) {
        float inverse = 1.0f / running_sum[g];
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g][d] * inverse;
    }
}


/* q, out: [B, n_kv, G, D] contiguous. k, v: [B, n_kv, S, D] cache tables with element strides
 * k_strides/v_strides (3 each; the last dimension contiguous); keys 0..length-1 are read and keys
 * visible..length-1 are masked (visible = length: none). */
void decode_attention(const float *q, const float *k, const int64_t *k_strides, const float *v,
                      const int64_t *v_strides, float *out, int64_t batch, int64_t n_kv, int64_t group,
                      int64_t length, int64_t visible, int64_t dim, float scale, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < batch * n_kv; task++) {
        int64_t b = task / n_kv, h = task % n_kv;
        const float *q_task = q + task * group * dim;
        const float *k_task = k + b * k_strides[0] + h * k_strides[1], *v_task = v + b * v_strides[0] + h * v_strides[1];
        float *out_task = out + task * group * dim;
        kv_rows rows = {k_task, v_task, k_strides[2], v_strides[2], NULL, 0, 0, 0};
        if (dim == 64)
            attend_fixed(q_task, &rows, out_task, group, length, visible, scale, 64 / LANES);
        else if (dim == 128)
            attend_fixed(q_task, &rows, out_task, group, length, visible, scale, 128 / LANES);
        else
            attend_one(q_task, k_task, k_strides[2], v_task, v_strides[2], out_task, group, length, visible, dim, scale);
    }
}
