/* Decode attention over a paged fp32 KV cache on a CPU: one query position per sequence, GQA, keys and
 * values read in place through each sequence's block table (no gather copy).
 *
 * Built and loaded by strategies/cpu_kernel.py (CKernel: gcc -O3 -march=native -ffast-math -fopenmp,
 * linked without -ffast-math); used by `paged` for its decode steps on a CPU in fp32
 * (strategy.backend=auto|c).
 *
 * Layout (vLLM's and flash_attn_with_kvcache's): a pool [n_blocks, block_size, n_kv, D] per layer for K
 * and one for V, and a table [B, max_blocks] of int32 block ids; logical position p of sequence b lives
 * in block table[b][p / block_size] at row p % block_size. Only the blocks covering positions
 * 0..length-1 are read, and within the last one only the rows below length.
 *
 * How: the structure of cpu_decode_attention.c (read its header for why): an online softmax over
 * chunks of CHUNK keys, each key and value row read from memory once; the G dot products of a key row
 * in one pass (a fast path for Llama 3's G = 4); values accumulated 16 columns at a time in registers;
 * software prefetch PREFETCH rows ahead. Three things change:
 * - How a row is found: a chunk's row addresses are resolved through the table first (one division
 *   per chunk, then a running block/offset cursor), so a chunk may span several blocks and the
 *   per-chunk softmax cost does not grow as blocks shrink, down to block_size 1.
 * - The prefetch follows the table: the next logical row, in another block at a block boundary.
 * - A task takes a run of KV heads of one sequence, not one head: this layout puts a position's n_kv
 *   heads side by side, so one task per head (the contiguous kernel's split) reads every n_kv-th
 *   D-float segment of the pool, and measured 1.4-1.8x the contiguous kernel's time on the same
 *   cache; reading whole rows brought it to 1.1-1.3x (B=16, n_kv=2, G=2, D=64, 2k and 8k tokens,
 *   blocks of 16 and 64, 2 cores).
 *   The run is as long as the threads allow (heads_per_task). Each (head, query) row is computed in
 *   the same order whatever the run, so outputs do not depend on the thread count.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 64      /* keys per online-softmax step: a chunk's scores (MAX_GROUP x CHUNK floats) stay in L1 */
#define MAX_GROUP 32  /* most query heads per KV head (Llama 3: 4 at 8B, 8 at 70B, 16 at 405B) */
#define MAX_DIM 512   /* largest head dimension (Llama 3: 128) */
#define PREFETCH 16   /* key rows to prefetch ahead, as in cpu_decode_attention.c */

/* rows[j] = address of logical row start + j (j < count) of one sequence's first head of the task:
 * `pool` already points at that head, `pages` at the sequence's block ids. Head hh of the task is at
 * rows[j] + hh * head_stride. */
static void resolve_rows(const float *pool, int64_t block_stride, int64_t row_stride, const int32_t *pages,
                         int64_t block_size, int64_t start, int64_t count, const float **rows) {
    int64_t page = start / block_size, offset = start % block_size;
    for (int64_t j = 0; j < count; j++) {
        rows[j] = pool + (int64_t)pages[page] * block_stride + offset * row_stride;
        if (++offset == block_size) {
            offset = 0;
            page++;
        }
    }
}

/* scores[r][j] = scale * q[r] . key of row j, for the n rows of one chunk, where r = hh * group + g is
 * query g of the task's head hh: a row's `heads` segments are read together. keys[] holds `ahead` >= n
 * rows so the prefetch PREFETCH rows ahead follows the table; value row j is prefetched for
 * chunk_values. */
static void chunk_scores(const float *q, const float **keys, int64_t ahead, const float **values, int64_t n,
                         int64_t heads, int64_t head_stride, int64_t group, int64_t dim, float scale,
                         float scores[MAX_GROUP][CHUNK]) {
    for (int64_t j = 0; j < n; j++) {
        const float *next_key = j + PREFETCH < ahead ? keys[j + PREFETCH] : keys[j];
        for (int64_t hh = 0; hh < heads; hh++) {
            for (int64_t line = 0; line < dim; line += 16) { /* 16 floats: one 64-byte cache line */
                __builtin_prefetch(next_key + hh * head_stride + line);
                __builtin_prefetch(values[j] + hh * head_stride + line);
            }
        }
        for (int64_t hh = 0; hh < heads; hh++) {
            const float *key = keys[j] + hh * head_stride, *qh = q + hh * group * dim;
            float(*s)[CHUNK] = scores + hh * group; /* this head's G rows */
            if (group == 4) { /* Llama 3 8B's group: four independent sums, one pass over the key */
                const float *q0 = qh, *q1 = qh + dim, *q2 = qh + 2 * dim, *q3 = qh + 3 * dim;
                float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t d = 0; d < dim; d++) {
                    float kd = key[d];
                    s0 += q0[d] * kd;
                    s1 += q1[d] * kd;
                    s2 += q2[d] * kd;
                    s3 += q3[d] * kd;
                }
                s[0][j] = s0 * scale;
                s[1][j] = s1 * scale;
                s[2][j] = s2 * scale;
                s[3][j] = s3 * scale;
            } else {
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qh + g * dim;
                    float sum = 0;
#pragma omp simd reduction(+ : sum)
                    for (int64_t d = 0; d < dim; d++) sum += qg[d] * key[d];
                    s[g][j] = sum * scale;
                }
            }
        }
    }
}

/* acc[r][:] += sum_j p[r][j] * value of row j (head hh = r / group), over the n rows of one chunk,
 * 16 columns at a time so the partial sums stay in registers across the chunk. */
static void chunk_values(const float **values, int64_t n, int64_t heads, int64_t head_stride, int64_t group,
                         int64_t dim, float p[MAX_GROUP][CHUNK], float acc[MAX_GROUP][MAX_DIM]) {
    for (int64_t r = 0; r < heads * group; r++) {
        int64_t head_offset = (r / group) * head_stride;
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
            if (d0 + 16 > dim) { /* a head dimension that is not a multiple of 16: the tail row by row */
                for (int64_t j = 0; j < n; j++)
                    for (int64_t d = d0; d < dim; d++) acc[r][d] += p[r][j] * values[j][head_offset + d];
                break;
            }
            float a[16];
            for (int c = 0; c < 16; c++) a[c] = acc[r][d0 + c];
            for (int64_t j = 0; j < n; j++) {
                const float *value = values[j] + head_offset + d0;
                float pj = p[r][j];
#pragma omp simd
                for (int c = 0; c < 16; c++) a[c] += pj * value[c];
            }
            for (int c = 0; c < 16; c++) acc[r][d0 + c] = a[c];
        }
    }
}

/* One sequence's run of `heads` KV heads: out[r] = softmax(scale * q[r] . K^T) V over logical keys
 * 0..length-1 of head r / group, for the heads * group query rows r. */
static void attend_heads(const float *q, const float *k, const int64_t *k_strides, const float *v,
                         const int64_t *v_strides, const int32_t *pages, int64_t block_size, float *out,
                         int64_t heads, int64_t group, int64_t length, int64_t dim, float scale) {
    int64_t rows = heads * group; /* <= MAX_GROUP: heads_per_task sees to it */
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], p[MAX_GROUP][CHUNK], acc[MAX_GROUP][MAX_DIM];
    const float *keys[CHUNK + PREFETCH], *values[CHUNK];
    for (int64_t r = 0; r < rows; r++) {
        running_max[r] = -FLT_MAX; /* finite: -ffast-math assumes no infinities */
        running_sum[r] = 0.0f;
        memset(acc[r], 0, sizeof(float) * dim);
    }
    for (int64_t start = 0; start < length; start += CHUNK) {
        int64_t n = length - start < CHUNK ? length - start : CHUNK;
        int64_t ahead = length - start < CHUNK + PREFETCH ? length - start : CHUNK + PREFETCH; /* never past length */
        resolve_rows(k, k_strides[0], k_strides[1], pages, block_size, start, ahead, keys);
        resolve_rows(v, v_strides[0], v_strides[1], pages, block_size, start, n, values);
        chunk_scores(q, keys, ahead, values, n, heads, k_strides[2], group, dim, scale, p);
        for (int64_t r = 0; r < rows; r++) { /* online softmax: rescale what came before to the new max */
            float chunk_max = running_max[r];
            for (int64_t j = 0; j < n; j++) chunk_max = p[r][j] > chunk_max ? p[r][j] : chunk_max;
            float correction = expf(running_max[r] - chunk_max);
            running_max[r] = chunk_max;
            running_sum[r] *= correction;
            for (int64_t d = 0; d < dim; d++) acc[r][d] *= correction;
            float chunk_sum = 0.0f;
#pragma omp simd reduction(+ : chunk_sum)
            for (int64_t j = 0; j < n; j++) {
                p[r][j] = expf(p[r][j] - chunk_max);
                chunk_sum += p[r][j];
            }
            running_sum[r] += chunk_sum;
        }
        chunk_values(values, n, heads, v_strides[2], group, dim, p, acc);
    }
    for (int64_t r = 0; r < rows; r++) {
        float inverse = 1.0f / running_sum[r];
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = acc[r][d] * inverse;
    }
}

/* KV heads per task: the divisor of n_kv that finishes first on `threads` threads, counting a task's
 * time as its heads (the longest thread runs ceil(tasks / threads) tasks); among equals the longest
 * run, whose rows are read whole. Its query rows must fit the MAX_GROUP rows of a task's state. */
static int64_t heads_per_task(int64_t batch, int64_t n_kv, int64_t group, int threads) {
    int64_t best = 1, best_time = INT64_MAX;
    if (threads < 1) threads = 1;
    for (int64_t heads = 1; heads <= n_kv && heads * group <= MAX_GROUP; heads++) {
        if (n_kv % heads) continue;
        int64_t tasks = batch * (n_kv / heads), time = (tasks + threads - 1) / threads * heads;
        if (time <= best_time) {
            best = heads;
            best_time = time;
        }
    }
    return best;
}

/* q, out: [B, n_kv, G, D] contiguous. k_pool, v_pool: [n_blocks, block_size, n_kv, D] with element
 * strides k_strides/v_strides (block, row, head; the last dimension contiguous). block_table: [B, *]
 * int32 with row stride table_stride; its first ceil(length / block_size) entries per sequence are read. */
void paged_decode_attention(const float *q, const float *k_pool, const int64_t *k_strides, const float *v_pool,
                            const int64_t *v_strides, const int32_t *block_table, int64_t table_stride, float *out,
                            int64_t batch, int64_t n_kv, int64_t group, int64_t length, int64_t block_size,
                            int64_t dim, float scale, int threads) {
    int64_t heads = heads_per_task(batch, n_kv, group, threads), runs = n_kv / heads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < batch * runs; task++) {
        int64_t b = task / runs, h = task % runs * heads; /* sequence b, heads h .. h + heads - 1 */
        int64_t first_row = (b * n_kv + h) * group * dim;
        attend_heads(q + first_row, k_pool + h * k_strides[2], k_strides, v_pool + h * v_strides[2], v_strides,
                     block_table + b * table_stride, block_size, out + first_row, heads, group, length, dim, scale);
    }
}
