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

/* The keys pair `pair` attends over: its fill with taps that give one, else the call's length. */
static inline int64_t pair_length(const pair_taps *taps, int64_t pair, int64_t length) {
    return taps != NULL && taps->fill != NULL ? taps->fill[pair] : length;
}

/* decode_attention's body, with taps (a constant NULL where the plain kernel inlines it: the taps'
 * code is then left out). With taps every key is visible, each pair attends over its own fill (the
 * split into parts is decided on the longest, and a part of no keys contributes nothing), and a split
 * pair's rows are finished once its parts are merged. */
static inline __attribute__((always_inline)) void attend_pairs(
        const float *q, const float *k, const int64_t *k_strides, const float *v, const int64_t *v_strides,
        float *out, int64_t batch, int64_t n_kv, int64_t group, int64_t length, int64_t visible, int64_t dim,
        float scale, int threads, const pair_taps *taps) {
    const int64_t pairs = batch * n_kv, parts = parts_of(pairs, length, visible, dim);
    if (parts == 1) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t task = 0; task < pairs; task++) {
            int64_t b = task / n_kv, h = task % n_kv;
            kv_rows rows = {k + b * k_strides[0] + h * k_strides[1], v + b * v_strides[0] + h * v_strides[1],
                            k_strides[2], v_strides[2], NULL, 0, 0, 0};
            if (taps == NULL) {
                attend_pair(q + task * group * dim, &rows, out + task * group * dim, group, length, visible, dim,
                            scale);
                continue;
            }
            float row_max[MAX_GROUP], row_sum[MAX_GROUP];
            attend_pair_scored(q + task * group * dim, &rows, out + task * group * dim, group,
                               pair_length(taps, task, length), dim, taps->key_dim,
                               taps->channels ? taps->channels + task * taps->key_dim : NULL, scale,
                               taps->logits ? taps->logits + task * group * taps->logit_row : NULL, taps->logit_row,
                               row_max, row_sum);
            if (taps->finish != NULL) taps->finish(taps, task, row_max, row_sum);
        }
        return;
    }
    /* Task (pair, part): its part's normalized output rows and their running max and sum of weights. */
    const int64_t tasks = pairs * parts;
    float *partial = (float *)malloc(sizeof(float) * (tasks * group * (dim + 2) + 2 * pairs * group));
    float *maxes = partial + tasks * group * dim, *sums = maxes + tasks * group;
    float *row_max = sums + tasks * group, *row_sum = row_max + pairs * group; /* each row's, once merged */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t pair = task / parts, part = task % parts, b = pair / n_kv, h = pair % n_kv;
            int64_t keys = pair_length(taps, pair, length);
            int64_t first = part * keys / parts, count = (part + 1) * keys / parts - first;
            float *into = partial + task * group * dim;
            if (count == 0) { /* a pair of fewer keys than parts: this part weighs nothing in the merge */
                for (int64_t g = 0; g < group; g++) maxes[task * group + g] = -FLT_MAX, sums[task * group + g] = 0.0f;
                continue;
            }
            kv_rows rows = {k + b * k_strides[0] + h * k_strides[1] + first * k_strides[2],
                            v + b * v_strides[0] + h * v_strides[1] + first * v_strides[2],
                            k_strides[2], v_strides[2], NULL, 0, 0, 0};
            const float *query = q + pair * group * dim;
            if (taps != NULL) {
                attend_pair_scored(query, &rows, into, group, count, dim, taps->key_dim,
                                   taps->channels ? taps->channels + pair * taps->key_dim : NULL, scale,
                                   taps->logits ? taps->logits + pair * group * taps->logit_row + first : NULL,
                                   taps->logit_row, maxes + task * group, sums + task * group);
            } else if (dim == 64) {
                attend_fixed(query, &rows, into, group, count, count, scale, 64 / LANES, maxes + task * group,
                             sums + task * group, NULL, 0);
            } else {
                attend_fixed(query, &rows, into, group, count, count, scale, 128 / LANES, maxes + task * group,
                             sums + task * group, NULL, 0);
            }
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
                weight[part] = sums[at] > 0.0f ? sums[at] * expf(maxes[at] - top) : 0.0f;
                total += weight[part];
            }
            float *o = out + row * dim;
            for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
            for (int64_t part = 0; part < parts; part++) {
                const float *from = partial + ((pair * parts + part) * group + g) * dim;
                float share = weight[part] / total;
                if (share == 0.0f) continue; /* an empty part's rows were never written */
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) o[d] += share * from[d];
            }
            row_max[row] = top, row_sum[row] = total;
        }
        if (taps != NULL && taps->finish != NULL) {
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < pairs; pair++)
                taps->finish(taps, pair, row_max + pair * group, row_sum + pair * group);
        }
    }
    free(partial);
}

/* q, out: [B, n_kv, G, D] contiguous. k, v: [B, n_kv, S, D] cache tables with element strides
 * k_strides/v_strides (3 each; the last dimension contiguous); keys 0..length-1 are read and keys
 * visible..length-1 are masked (visible = length: none). */
void decode_attention(const float *q, const float *k, const int64_t *k_strides, const float *v,
                      const int64_t *v_strides, float *out, int64_t batch, int64_t n_kv, int64_t group,
                      int64_t length, int64_t visible, int64_t dim, float scale, int threads) {
    attend_pairs(q, k, k_strides, v, v_strides, out, batch, n_kv, group, length, visible, dim, scale, threads, NULL);
}

/* decode_attention with taps (kernels.h): `length` is the longest a pair attends over. */
void decode_attention_tapped(const float *q, const float *k, const int64_t *k_strides, const float *v,
                             const int64_t *v_strides, float *out, int64_t batch, int64_t n_kv, int64_t group,
                             int64_t length, int64_t dim, float scale, int threads, const pair_taps *taps) {
    attend_pairs(q, k, k_strides, v, v_strides, out, batch, n_kv, group, length, length, dim, scale, threads, taps);
}
