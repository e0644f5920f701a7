/* The fixed-width decode attention both fp32 kernels share (cpu_decode_attention.c for contiguous
 * tables, cpu_paged_attention.c for paged pools), for head dimensions 64 and 128; other widths take
 * cpu_attention_generic.h.
 *
 * Included by those sources (kernels.h defines MAX_GROUP and MAX_DIM). Why it is shaped this way
 * (scripts/kernel_read_rate.py measures it on the machine at hand):
 * - Compute. Rows are handled as register-wide vectors (LANES floats) in loops of a constant trip
 *   count, and the dot products of LANES keys are reduced together by a transpose tree instead of one
 *   horizontal sum per key and query head: kernels with a horizontal sum per key were compute-bound
 *   on a cache-resident table, in AVX-512 and AVX2 builds alike.
 * - Memory-level parallelism. One core reading one stream reads markedly slower than one reading 4 or
 *   more streams interleaved every <= 1 KB, and software prefetch does not close that gap. So a block
 *   is not SOFTMAX_BLOCK consecutive keys: the keys are split into KEY_SEGMENTS equal segments and a
 *   block takes PER_SEGMENT keys from each, in chunks of CHUNK_BYTES that alternate between the
 *   segments (8 segments of 512 B chunks read faster than 4 of 1 KB, 2 segments slower). Softmax does not care in
 *   which order keys are summed, so this changes only the rounding (~1e-7).
 * - A row is found through kv_rows: a contiguous table, or a paged pool and its block table, resolved
 *   once per run of consecutive keys (one division, then a cursor).
 * `visible` masks keys visible..length-1 (weight exactly 0) while still reading them: static_full.
 * Keys narrower than the values (pruned to their kept channels, cpu_pruned_attention.c) take this path
 * too: a key row is read at the values' width, into the rows after it, against a query whose lanes past
 * the key's width are 0, so the table's bytes are read once, in order, and the extra lanes add 0.
 */
#ifndef CPU_ATTENTION_FIXED_H
#define CPU_ATTENTION_FIXED_H

#include "attention_blocks.h" /* SOFTMAX_BLOCK, MASKED, online_softmax, kv_rows, locate_run */
#include "vector.h"           /* LANES, vec, load_vec, store_vec, sum_lanes */

#define KEY_SEGMENTS 8  /* segments of a table read in lockstep: a core reads 4 or more streams faster than one */
#define PER_SEGMENT (SOFTMAX_BLOCK / KEY_SEGMENTS) /* keys a block takes from each segment */
#define CHUNK_BYTES 512 /* bytes read from one segment before the next (4 KB chunks lost the gain) */

/* The rows of block `index` (n of them, in the order they are read) and their key numbers. The first
 * `interleaved` blocks take PER_SEGMENT keys from each of KEY_SEGMENTS equal segments, `chunk` consecutive
 * keys at a time; the blocks after them are consecutive keys from `tail_start` on. */
static inline void block_rows(const kv_rows *rows, int64_t index, int64_t interleaved, int64_t segment,
                              int64_t tail_start, int64_t n, int64_t chunk, const float **key_rows,
                              const float **value_rows, int64_t keys[SOFTMAX_BLOCK]) {
    int64_t at[SOFTMAX_BLOCK];
    if (index < interleaved) {
        for (int64_t stream = 0; stream < KEY_SEGMENTS; stream++) {
            for (int64_t within = 0; within < PER_SEGMENT; within++)
                at[within] = (within / chunk) * chunk * KEY_SEGMENTS + stream * chunk + within % chunk;
            locate_run(rows, stream * segment + index * PER_SEGMENT, PER_SEGMENT, at, key_rows, value_rows, keys);
        }
    } else {
        for (int64_t j = 0; j < n; j++) at[j] = j;
        locate_run(rows, tail_start + (index - interleaved) * SOFTMAX_BLOCK, n, at, key_rows, value_rows, keys);
    }
}

/* One (sequence, KV head) with head dimension LANES * lines: out[g] = softmax(scale * q[g] . K^T) V.
 * With `part_max` and `part_sum` (NULL where it is inlined without them), each query row's running max
 * and sum of weights are stored too: what it takes to merge outputs over parts of one table
 * (cpu_decode_attention.c), or to turn logits into weights. With `logits` (NULL: none), each key's
 * scaled score for query row g is stored at logits[g * logit_row + key]: the weights a policy scores
 * by, without a second read of the keys (cpu_compacted_attention.c). */
static inline __attribute__((always_inline)) void attend_fixed(
        const float *q, const kv_rows *rows, float *out, int64_t group, int64_t length, int64_t visible, float scale,
        const int lines, float *part_max, float *part_sum, float *logits, int64_t logit_row) {
    const int64_t dim = LANES * lines;
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], p[MAX_GROUP][SOFTMAX_BLOCK];
    vec acc[MAX_GROUP][MAX_DIM / LANES];
    for (int64_t g = 0; g < group; g++) {
        running_max[g] = -FLT_MAX;
        running_sum[g] = 0.0f;
        for (int c = 0; c < lines; c++) acc[g][c] = (vec){0};
    }
    int64_t chunk = CHUNK_BYTES / (int64_t)(sizeof(float) * dim); /* keys read from a segment in a row */
    int64_t interleaved = length / SOFTMAX_BLOCK, segment = interleaved * PER_SEGMENT;
    int64_t tail_start = KEY_SEGMENTS * segment;
    int64_t blocks = interleaved + (length - tail_start + SOFTMAX_BLOCK - 1) / SOFTMAX_BLOCK;
    int64_t keys[SOFTMAX_BLOCK];
    const float *key_rows[SOFTMAX_BLOCK], *value_rows[SOFTMAX_BLOCK];
    float weight_mask[SOFTMAX_BLOCK]; /* 1 for a visible key, 0 for a masked one */
    for (int64_t index = 0; index < blocks; index++) {
        int64_t n = index < interleaved ? SOFTMAX_BLOCK : length - tail_start - (index - interleaved) * SOFTMAX_BLOCK;
        if (n > SOFTMAX_BLOCK) n = SOFTMAX_BLOCK;
        block_rows(rows, index, interleaved, segment, tail_start, n, chunk, key_rows, value_rows, keys);
        int masked = 0;
        for (int64_t j = 0; j < n; j++) {
            weight_mask[j] = keys[j] < visible ? 1.0f : 0.0f;
            masked |= keys[j] >= visible;
        }
        for (int64_t g = 0; g < group; g++) {
            vec qg[MAX_DIM / LANES];
#pragma GCC unroll 16
            for (int c = 0; c < lines; c++) qg[c] = load_vec(q + g * dim + LANES * c) * scale;
            int64_t j = 0;
            for (; j + LANES <= n; j += LANES) {
                vec part[LANES];
#pragma GCC unroll 16
                for (int r = 0; r < LANES; r++) {
                    const float *key = key_rows[j + r];
                    vec s = qg[0] * load_vec(key);
#pragma GCC unroll 16
                    for (int c = 1; c < lines; c++) s += qg[c] * load_vec(key + LANES * c);
                    part[r] = s;
                }
                store_vec(&p[g][j], sum_lanes(part));
            }
            for (; j < n; j++) { /* the last block's remainder */
                const float *key = key_rows[j];
                vec s = qg[0] * load_vec(key);
#pragma GCC unroll 16
                for (int c = 1; c < lines; c++) s += qg[c] * load_vec(key + LANES * c);
                float total = 0;
                for (int l = 0; l < LANES; l++) total += s[l];
                p[g][j] = total;
            }
            if (masked)
                for (int64_t i = 0; i < n; i++)
                    if (keys[i] >= visible) p[g][i] = MASKED;
            if (logits != NULL)
                for (int64_t i = 0; i < n; i++) logits[g * logit_row + keys[i]] = p[g][i];
        }
        for (int64_t g = 0; g < group; g++) {
            float correction = online_softmax(p[g], n, &running_max[g], &running_sum[g], masked ? weight_mask : NULL);
            vec a[MAX_DIM / LANES]; /* this query head's output row, in registers across the block */
#pragma GCC unroll 16
            for (int c = 0; c < lines; c++) a[c] = acc[g][c] * correction;
            for (int64_t j = 0; j < n; j++) {
                const float *value = value_rows[j];
                float weight = p[g][j];
#pragma GCC unroll 16
                for (int c = 0; c < lines; c++) a[c] += weight * load_vec(value + LANES * c);
            }
#pragma GCC unroll 16
            for (int c = 0; c < lines; c++) acc[g][c] = a[c];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float inverse = 1.0f / running_sum[g];
#pragma GCC unroll 16
        for (int c = 0; c < lines; c++) store_vec(out + g * dim + LANES * c, acc[g][c] * inverse);
        if (part_max != NULL) {
            part_max[g] = running_max[g];
            part_sum[g] = running_sum[g];
        }
    }
}

#endif
