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
 * blocks of SOFTMAX_BLOCK with an online softmax (FlashAttention's running max and sum,
 * attention_blocks.h), so each key and value row is read from memory exactly once: the block's scores
 * for all G queries, then the block's values accumulated into G x D outputs. Head dimensions 64 and
 * 128 take the fixed-width path of cpu_attention_fixed.h (vectorised for those widths, and reading 8
 * segments of the table in lockstep: its header says why); any other width takes the generic path of
 * cpu_attention.h (consecutive keys, software prefetch a few rows ahead). The paged kernel
 * takes the same two paths, its rows found through a block table instead.
 * -ffast-math lets the compiler vectorise the reductions and expf (glibc's libmvec); sums are
 * reassociated, so outputs match SDPA's to ~1e-7, not bit for bit.
 *
 * Few (sequence, KV head) pairs over a long table (batch 1 of a model with 3 KV heads: 3 tasks for 2
 * threads, one of them idle for a third of the call) split each pair's keys into parts: tasks of
 * (pair, part), each part's output, running max and sum kept, then merged per query row as the online
 * softmax merges blocks (FlashDecoding's split-K). How many parts depends on the pairs and the length
 * only (`parts_of`), never on the thread count, so outputs still do not depend on it.
 *
 * `visible` masks keys visible..length-1 (their weight is exactly 0) while still reading them: the
 * static_full layout, which attends over its whole preallocated table every step (never split).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_attention.h" /* attend_pair, attend_fixed */
#include "kernels.h"

#define SPLIT_TASKS 12     /* fewer (sequence, KV head) pairs than this are split, into about this many tasks */
#define SPLIT_MIN_KEYS 512 /* fewest keys a part reads: a shorter one's merge costs more than its balance gains */
#define MAX_PARTS 16       /* most parts a pair's keys are split into */

/* Parts each pair's keys are split into: 1 for a masked call (static_full), a width off the fixed-width
 * path, or enough pairs; else enough parts for about SPLIT_TASKS tasks, each of at least SPLIT_MIN_KEYS
 * keys. Never the thread count: the split, and so the rounding, is the same whoever runs it. */
static int64_t parts_of(int64_t pairs, int64_t length, int64_t visible, int64_t dim) {
    if (visible != length || (dim != 64 && dim != 128) || pairs >= SPLIT_TASKS) return 1;
    int64_t wanted = (SPLIT_TASKS + pairs - 1) / pairs, most = length / SPLIT_MIN_KEYS;
    int64_t parts = wanted < most ? wanted : most;
    return parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
}

/* q, out: [B, n_kv, G, D] contiguous. k, v: [B, n_kv, S, D] cache tables with element strides
 * k_strides/v_strides (3 each; the last dimension contiguous); keys 0..length-1 are read and keys
 * visible..length-1 are masked (visible = length: none). */
void decode_attention(const float *q, const float *k, const int64_t *k_strides, const float *v,
                      const int64_t *v_strides, float *out, int64_t batch, int64_t n_kv, int64_t group,
                      int64_t length, int64_t visible, int64_t dim, float scale, int threads) {
    const int64_t pairs = batch * n_kv, parts = parts_of(pairs, length, visible, dim);
    if (parts == 1) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t task = 0; task < pairs; task++) {
            int64_t b = task / n_kv, h = task % n_kv;
            kv_rows rows = {k + b * k_strides[0] + h * k_strides[1], v + b * v_strides[0] + h * v_strides[1],
                            k_strides[2], v_strides[2], NULL, 0, 0, 0};
            attend_pair(q + task * group * dim, &rows, out + task * group * dim, group, length, visible, dim, scale);
        }
        return;
    }
    /* Task (pair, part): its part's normalized output rows and their running max and sum of weights. */
    const int64_t tasks = pairs * parts;
    float *partial = (float *)malloc(sizeof(float) * tasks * group * (dim + 2));
    float *maxes = partial + tasks * group * dim, *sums = maxes + tasks * group;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t pair = task / parts, part = task % parts, b = pair / n_kv, h = pair % n_kv;
            int64_t first = part * length / parts, count = (part + 1) * length / parts - first;
            kv_rows rows = {k + b * k_strides[0] + h * k_strides[1] + first * k_strides[2],
                            v + b * v_strides[0] + h * v_strides[1] + first * v_strides[2],
                            k_strides[2], v_strides[2], NULL, 0, 0, 0};
            const float *query = q + pair * group * dim;
            float *into = partial + task * group * dim;
            if (dim == 64)
                attend_fixed(query, &rows, into, group, count, count, scale, 64 / LANES, maxes + task * group,
                             sums + task * group);
            else
                attend_fixed(query, &rows, into, group, count, count, scale, 128 / LANES, maxes + task * group,
                             sums + task * group);
        }
        /* Each query row: its parts' outputs weighted by their share of the softmax's total, in part order. */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < pairs * group; row++) {
            int64_t pair = row / group, g = row % group;
            float top = -FLT_MAX, weight[MAX_PARTS], total = 0.0f;
            for (int64_t part = 0; part < parts; part++) {
                float m = maxes[(pair * parts + part) * group + g];
                top = m > top ? m : top;
            }
            for (int64_t part = 0; part < parts; part++) {
                int64_t at = (pair * parts + part) * group + g;
                weight[part] = sums[at] * expf(maxes[at] - top);
                total += weight[part];
            }
            float *o = out + row * dim;
            for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
            for (int64_t part = 0; part < parts; part++) {
                const float *from = partial + ((pair * parts + part) * group + g) * dim;
                float share = weight[part] / total;
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) o[d] += share * from[d];
            }
        }
    }
    free(partial);
}

/* A ragged batch over one shared table (a serving pool's arena, strategies/caches/contiguous.py): each
 * sequence at its own length. q, out: [B, n_kv, G, D] contiguous. k, v: [n_kv, S, D] with element
 * strides k_strides/v_strides (2 each: head, row; rows contiguous); sequence b's keys are the rows
 * starts[b] .. starts[b] + lengths[b] - 1. One task per (sequence, KV head), as the batched kernel's,
 * through the same attend_pair; never split (each pair's rows in one pass, whatever the batch), and
 * handed out one at a time, since the pairs' lengths differ. */
void ragged_decode_attention(const float *q, const float *k, const int64_t *k_strides, const float *v,
                             const int64_t *v_strides, const int64_t *starts, const int64_t *lengths, float *out,
                             int64_t batch, int64_t n_kv, int64_t group, int64_t dim, float scale, int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < batch * n_kv; task++) {
        int64_t b = task / n_kv, h = task % n_kv;
        kv_rows rows = {k + h * k_strides[0] + starts[b] * k_strides[1], v + h * v_strides[0] + starts[b] * v_strides[1],
                        k_strides[1], v_strides[1], NULL, 0, 0, 0};
        attend_pair(q + task * group * dim, &rows, out + task * group * dim, group, lengths[b], lengths[b], dim, scale);
    }
}
