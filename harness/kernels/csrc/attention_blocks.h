/* What every attention kernel does with a block of keys, written once: the online softmax
 * (FlashAttention's running max and sum, so each key and value row is read from memory once), a key
 * row's G scores, a block's values accumulated into the G output rows, and where a (sequence, KV
 * head)'s rows are in a contiguous table or a paged pool.
 *
 * Included by cpu_attention_fixed.h and cpu_attention_generic.h (the fp32 kernels' two paths) and by
 * cpu_quantized_attention.c (its generic path, over dequantized tiles). kernels.h defines MAX_GROUP
 * and MAX_DIM.
 */
#ifndef HARNESS_ATTENTION_BLOCKS_H
#define HARNESS_ATTENTION_BLOCKS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define SOFTMAX_BLOCK 64  /* keys per online-softmax block: its scores (MAX_GROUP x SOFTMAX_BLOCK floats) stay in L1 */
#define MASKED (-FLT_MAX) /* a masked key's score: finite, as -ffast-math assumes no infinities */

/* `rows` query rows before their first block: no key seen, nothing accumulated. */
static inline void start_rows(float *running_max, float *running_sum, float acc[][MAX_DIM], int64_t rows,
                              int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        running_max[r] = -FLT_MAX; /* finite: -ffast-math assumes no infinities */
        running_sum[r] = 0.0f;
        memset(acc[r], 0, sizeof(float) * dim);
    }
}

/* out[r * dim + d] = acc[r][d] / running_sum[r]: the rows' attention outputs once every key is in. */
static inline void finish_rows(const float *running_sum, float acc[][MAX_DIM], int64_t rows, int64_t dim,
                               float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float inverse = 1.0f / running_sum[r];
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = acc[r][d] * inverse;
    }
}

/* One block of an online softmax for one query row: the n scores become weights exp(score - max) in
 * place, and the running max and sum take the block in. Returns the factor the output accumulated so
 * far must be scaled by (the old max against the new). weight_mask (NULL: none) is 1 for a visible key
 * and 0 for a masked one, whose score was MASKED. */
static inline float online_softmax(float *scores, int64_t n, float *running_max, float *running_sum,
                                   const float *weight_mask) {
    float block_max = *running_max;
    for (int64_t j = 0; j < n; j++) block_max = scores[j] > block_max ? scores[j] : block_max;
    float correction = expf(*running_max - block_max), block_sum = 0.0f;
    *running_max = block_max;
    if (weight_mask != NULL) {
        /* A masked weight is exactly 0. Its exponent is clamped first: libmvec's vector expf leaves for
         * a scalar fallback on arguments far below its range, which is slower. */
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = 0; j < n; j++) {
            scores[j] = weight_mask[j] * expf(fmaxf(scores[j] - block_max, -87.0f));
            block_sum += scores[j];
        }
    } else {
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = 0; j < n; j++) {
            scores[j] = expf(scores[j] - block_max);
            block_sum += scores[j];
        }
    }
    *running_sum = *running_sum * correction + block_sum;
    return correction;
}

/* online_softmax over the n scores of each of `rows` query rows, and each row's accumulated output
 * rescaled to its new max. */
static inline void softmax_rows(float p[][SOFTMAX_BLOCK], int64_t n, int64_t rows, int64_t dim, float *running_max,
                                float *running_sum, float acc[][MAX_DIM], const float *weight_mask) {
    for (int64_t r = 0; r < rows; r++) {
        float correction = online_softmax(p[r], n, &running_max[r], &running_sum[r], weight_mask);
        for (int64_t d = 0; d < dim; d++) acc[r][d] *= correction;
    }
}

/* scores[g][j] = scale * q[g] . key for the G query rows of q (stride dim): the key row is loaded once
 * for all G dot products. */
static inline void key_scores(const float *q, const float *key, int64_t group, int64_t dim, float scale,
                              float scores[][SOFTMAX_BLOCK], int64_t j) {
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
        return;
    }
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * dim;
        float s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; d++) s += qg[d] * key[d];
        scores[g][j] = s * scale;
    }
}

/* acc[:] += sum_j p[j] * row_j[:] over the n value rows of one block for one query row, 16 columns at a
 * time, so the partial sums stay in registers across the block instead of going through memory for
 * every row. Row j is rows[j], or, where rows is NULL (a constant where it is inlined), first + j * stride. */
static inline __attribute__((always_inline)) void accumulate_values(const float *const *rows, const float *first,
                                                                    int64_t stride, int64_t n, const float *p,
                                                                    int64_t dim, float *acc) {
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        if (d0 + 16 > dim) { /* a head dimension that is not a multiple of 16: the tail row by row */
            for (int64_t j = 0; j < n; j++) {
                const float *row = rows ? rows[j] : first + j * stride;
                for (int64_t d = d0; d < dim; d++) acc[d] += p[j] * row[d];
            }
            break;
        }
        float a[16];
        for (int c = 0; c < 16; c++) a[c] = acc[d0 + c];
        for (int64_t j = 0; j < n; j++) {
            const float *value = (rows ? rows[j] : first + j * stride) + d0;
            float pj = p[j];
#pragma omp simd
            for (int c = 0; c < 16; c++) a[c] += pj * value[c];
        }
        for (int c = 0; c < 16; c++) acc[d0 + c] = a[c];
    }
}

/* Where one (sequence, KV head)'s rows are: row p of a contiguous table at k + p * k_row, or, paged,
 * row p % block_size of block pages[p / block_size], each block block_stride elements from the last. */
typedef struct {
    const float *k, *v;    /* the table (or the pool) at this KV head */
    int64_t k_row, v_row;  /* elements from one row to the next */
    const int32_t *pages;  /* paged: this sequence's block ids; NULL: a contiguous table */
    int64_t block_size, k_block, v_block; /* paged: rows per block, elements from one block to the next */
} kv_rows;

/* Rows first .. first + count - 1 into key_rows/value_rows/keys at positions at[0], at[1], ... (at NULL:
 * 0, 1, ...; keys NULL: no key numbers): one division per run, then a cursor that steps to the next
 * block at a block boundary. */
static inline void locate_run(const kv_rows *rows, int64_t first, int64_t count, const int64_t *at,
                              const float **key_rows, const float **value_rows, int64_t *keys) {
    if (rows->pages == NULL) {
        for (int64_t i = 0; i < count; i++) {
            int64_t slot = at ? at[i] : i;
            key_rows[slot] = rows->k + (first + i) * rows->k_row;
            value_rows[slot] = rows->v + (first + i) * rows->v_row;
            if (keys) keys[slot] = first + i;
        }
        return;
    }
    int64_t page = first / rows->block_size, offset = first % rows->block_size;
    for (int64_t i = 0; i < count; i++) {
        int64_t block = rows->pages[page], slot = at ? at[i] : i;
        key_rows[slot] = rows->k + block * rows->k_block + offset * rows->k_row;
        value_rows[slot] = rows->v + block * rows->v_block + offset * rows->v_row;
        if (keys) keys[slot] = first + i;
        if (++offset == rows->block_size) { /* a lookup of the next id happens only when a row needs it */
            offset = 0;
            page++;
        }
    }
}

#endif
