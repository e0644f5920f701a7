/* The decode attention both fp32 kernels share (cpu_decode_attention.c for contiguous tables,
 * cpu_paged_attention.c for paged pools): attend_pair takes one (sequence, KV head) through the
 * fixed-width path of cpu_attention_fixed.h at head dimensions 64 and 128, and through the generic path
 * below at any other.
 *
 * The generic path: a task walks `lanes` (sequence, KV head) pairs in step, each found through its kv_rows: a block of
 * SOFTMAX_BLOCK consecutive keys at a time, row j of every lane, then row j + 1, each row read from
 * memory once; the G scores of a key row in one pass over it; values accumulated 16 columns at a time
 * in registers; software prefetch GENERIC_PREFETCH_ROWS rows ahead, following each lane's rows (in
 * another block of a paged pool at a block boundary). The contiguous kernel runs one lane a task; the
 * paged kernel runs several (why: cpu_paged_attention.c). Each (pair, query) row is computed in the
 * same order whatever the lanes, so outputs do not depend on how the pairs are split among threads.
 * `visible` masks keys visible..length-1 (weight exactly 0) while still reading them: static_full.
 *
 * attend_pair_scored is attend_pair for the kernels over compacted slots and pruned keys
 * (cpu_decode_attention.c's taps): keys of fewer channels than the values (the query gathered at
 * them first), each key's logits stored, and the softmax's max and sum handed back.
 */
#ifndef CPU_ATTENTION_H
#define CPU_ATTENTION_H

#include "attention_blocks.h"    /* SOFTMAX_BLOCK, MASKED, the block routines, kv_rows, locate_run */
#include "cpu_attention_fixed.h" /* attend_fixed */

#define GENERIC_PREFETCH_ROWS 8 /* rows ahead (per lane) whose keys are prefetched: 4 to 12 read alike */
#define MAX_LANES 8             /* most (sequence, KV head) pairs a task walks in step */
#define RESOLVED (SOFTMAX_BLOCK + GENERIC_PREFETCH_ROWS) /* rows of a lane located per block: it and the prefetch's */

/* The generic path over `lanes` pairs (the module comment). `contiguous` (a constant where it is
 * inlined): the rows are one contiguous table's (one lane, pages NULL), found by their stride; else
 * each block's rows are located through the lanes' tables first. Keys are key_dim wide (the head
 * dimension dim, or fewer channels), as are q's rows. With `logits` (NULL: none), row r's scaled score
 * of key j is stored at logits[r * logit_row + j], and with row_max/row_sum (NULL: none) each row's
 * softmax max and sum of weights. */
static inline __attribute__((always_inline)) void walk_lanes(const float *q, const kv_rows *lane_rows, int64_t lanes,
                                                             float *out, int64_t group, int64_t length, int64_t visible,
                                                             int64_t dim, int64_t key_dim, float scale,
                                                             const int contiguous, float *logits, int64_t logit_row,
                                                             float *row_max, float *row_sum) {
    int64_t rows = lanes * group;
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], p[MAX_GROUP][SOFTMAX_BLOCK], acc[MAX_GROUP][MAX_DIM];
    const float *keys[MAX_LANES][RESOLVED], *values[MAX_LANES][RESOLVED];
    float weight_mask[SOFTMAX_BLOCK]; /* 1 for a visible key, 0 for a masked one */
    start_rows(running_max, running_sum, acc, rows, dim);
    for (int64_t start = 0; start < length; start += SOFTMAX_BLOCK) {
        int64_t n = length - start < SOFTMAX_BLOCK ? length - start : SOFTMAX_BLOCK;
        int64_t ahead = length - start < RESOLVED ? length - start : RESOLVED; /* never past length */
        const float *first_value = lane_rows->v + start * lane_rows->v_row; /* contiguous: row j is v_row further */
        if (!contiguous)
            for (int64_t l = 0; l < lanes; l++) locate_run(&lane_rows[l], start, ahead, NULL, keys[l], values[l], NULL);
        for (int64_t j = 0; j < n; j++) {
            /* Prefetch key row j + GENERIC_PREFETCH_ROWS of every lane (past the rows located: row j) and
             * value row j, a 64-byte line at a time (a prefetch past a table's end never faults). */
            for (int64_t l = 0; l < lanes; l++) {
                const float *key = contiguous ? lane_rows->k + (start + j) * lane_rows->k_row : keys[l][j];
                const float *next_key = contiguous ? key + GENERIC_PREFETCH_ROWS * lane_rows->k_row
                                        : j + GENERIC_PREFETCH_ROWS < ahead ? keys[l][j + GENERIC_PREFETCH_ROWS] : key;
                const float *value = contiguous ? first_value + j * lane_rows->v_row : values[l][j];
                for (int64_t line = 0; line < key_dim; line += 16) __builtin_prefetch(next_key + line);
                for (int64_t line = 0; line < dim; line += 16) __builtin_prefetch(value + line);
            }
            for (int64_t l = 0; l < lanes; l++) {
                const float *key = contiguous ? lane_rows->k + (start + j) * lane_rows->k_row : keys[l][j];
                key_scores(q + l * group * key_dim, key, group, key_dim, scale, p + l * group, j);
            }
        }
        int masked = start + n > visible;
        if (masked) {
            for (int64_t j = 0; j < n; j++) weight_mask[j] = start + j < visible ? 1.0f : 0.0f;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = visible - start < 0 ? 0 : visible - start; j < n; j++) p[r][j] = MASKED;
        }
        if (logits != NULL)
            for (int64_t r = 0; r < rows; r++) memcpy(logits + r * logit_row + start, p[r], sizeof(float) * n);
        softmax_rows(p, n, rows, dim, running_max, running_sum, acc, masked ? weight_mask : NULL);
        for (int64_t r = 0; r < rows; r++)
            accumulate_values(contiguous ? NULL : values[r / group], first_value, lane_rows->v_row, n, p[r], dim, acc[r]);
    }
    if (row_max != NULL)
        for (int64_t r = 0; r < rows; r++) row_max[r] = running_max[r], row_sum[r] = running_sum[r];
    finish_rows(running_sum, acc, rows, dim, out);
}

/* out[r] = softmax(scale * q[r] . K^T) V over keys 0..length-1 of lane r / group (keys visible..
 * weighted 0), for the lanes * group query rows r (<= MAX_GROUP), consecutive in q and out. A function
 * of its own (noinline): merged into its caller beside the fixed-width path, its loops lost registers to
 * spills and ran ~4% slower at head_dim 16. */
static __attribute__((noinline)) void attend_generic(const float *q, const kv_rows *lane_rows, int64_t lanes, float *out, int64_t group,
                           int64_t length, int64_t visible, int64_t dim, float scale) {
    if (lanes == 1 && lane_rows->pages == NULL)
        walk_lanes(q, lane_rows, 1, out, group, length, visible, dim, dim, scale, 1, NULL, 0, NULL, NULL);
    else
        walk_lanes(q, lane_rows, lanes, out, group, length, visible, dim, dim, scale, 0, NULL, 0, NULL, NULL);
}

/* attend_generic over one contiguous lane with key_dim-wide keys, logits, max and sum (walk_lanes). */
static __attribute__((noinline, unused)) void attend_generic_scored(const float *q, const kv_rows *rows, float *out,
                                                                    int64_t group, int64_t length, int64_t dim,
                                                                    int64_t key_dim, float scale, float *logits,
                                                                    int64_t logit_row, float *row_max, float *row_sum) {
    walk_lanes(q, rows, 1, out, group, length, length, dim, key_dim, scale, 1, logits, logit_row, row_max, row_sum);
}

/* One (sequence, KV head), its rows found through `rows`: out[g] = softmax(scale * q[g] . K^T) V over
 * keys 0..length-1, keys visible.. weighted 0. Inlined into the kernels' task loops: an out-of-line call
 * measured 1-3% slower at head_dim 64. */
static inline __attribute__((always_inline)) void attend_pair(const float *q, const kv_rows *rows, float *out, int64_t group, int64_t length,
                               int64_t visible, int64_t dim, float scale) {
    if (dim == 64)
        attend_fixed(q, rows, out, group, length, visible, scale, 64 / LANES, NULL, NULL, NULL, 0);
    else if (dim == 128)
        attend_fixed(q, rows, out, group, length, visible, scale, 128 / LANES, NULL, NULL, NULL, 0);
    else
        attend_generic(q, rows, 1, out, group, length, visible, dim, scale);
}

/* attend_pair over all `length` keys, each of its G query rows' logits kept where `logits` is given
 * ([G, logit_row]) and its softmax max and sum stored in row_max/row_sum ([G]). Keys hold key_dim of
 * the dim channels: `channels` (NULL where key_dim is dim) names the query's channels they hold, which
 * are gathered here: at dim floats a row, zeros past key_dim, for the fixed-width path (its module
 * comment: the key rows are then read past their end, so their table needs dim - key_dim floats after
 * its last row); at key_dim floats a row for the generic path. */
static inline __attribute__((always_inline)) void attend_pair_scored(const float *q, const kv_rows *rows, float *out,
                                                                     int64_t group, int64_t length, int64_t dim,
                                                                     int64_t key_dim, const int64_t *channels,
                                                                     float scale, float *logits, int64_t logit_row,
                                                                     float *row_max, float *row_sum) {
    float gathered[MAX_GROUP * MAX_DIM];
    const int fixed = dim == 64 || dim == 128;
    if (channels != NULL) {
        int64_t stride = fixed ? dim : key_dim;
        for (int64_t g = 0; g < group; g++) {
            for (int64_t c = 0; c < key_dim; c++) gathered[g * stride + c] = q[g * dim + channels[c]];
            for (int64_t c = key_dim; c < stride; c++) gathered[g * stride + c] = 0.0f;
        }
        q = gathered;
    }
    if (dim == 64)
        attend_fixed(q, rows, out, group, length, length, scale, 64 / LANES, row_max, row_sum, logits, logit_row);
    else if (dim == 128)
        attend_fixed(q, rows, out, group, length, length, scale, 128 / LANES, row_max, row_sum, logits, logit_row);
    else
        attend_generic_scored(q, rows, out, group, length, dim, key_dim, scale, logits, logit_row, row_max, row_sum);
}

#endif
