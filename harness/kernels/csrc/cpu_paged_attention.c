/* Decode attention over a paged fp32 KV cache on a CPU: one query position per sequence, GQA, keys and
 * values read in place through each sequence's block table (no gather copy).
 *
 * A C++ translation unit of the kernels' extension (harness/kernels/extension.py), the operator
 * harness_kernels::paged_decode_attention (ops.cpp); used by `paged` for its decode steps on a CPU in
 * fp32 (strategy.backend=auto|c).
 *
 * Layout: head-major pools [n_blocks, n_kv, block_size, D] for K and for V (vLLM's CUDA kernel keeps K
 * head-major too; `paged` keeps flash_attn's token-major pools only for flash_attn), passed with their
 * element strides (block, head, row), and a table [B, max_blocks] of int32 block ids: logical position
 * p of sequence b, head h is row p % block_size of head h in block table[b][p / block_size]. Only the
 * blocks covering positions 0..length-1 are read, and within the last one only the rows below length.
 *
 * Head dimensions 64 and 128 (Llama 3's is 128) take cpu_attention_fixed.h, the path the contiguous
 * kernel takes too, with rows found through the table: one task per (sequence, KV head) reading 8
 * segments of its sequence in lockstep, so 8 streams are in flight per core (keys, then values),
 * each run of consecutive keys resolved through the table once. What a paged read costs beyond the
 * contiguous kernel's is the scatter (below), and on 4 KiB pages page walks: each block of a shuffled
 * pool is a page of its own whose table entry is scattered too; on 2 MiB pages most of the gap goes
 * (prefetching the next blocks ahead does not help: it needs the same walks). scripts/kernel_read_rate.py
 * measures the ratios to the contiguous kernel, by block size and page size, on the machine at hand.
 *
 * Any other head dimension: the structure of cpu_decode_attention.c's generic path: an online softmax over
 * chunks of CHUNK keys, each key and value row read from memory once; the G dot products of a key row
 * in one pass (a fast path for Llama 3's G = 4); values accumulated 16 columns at a time in registers;
 * software prefetch a few rows ahead. What changes:
 * - How a row is found: a chunk's row addresses are resolved through the table first (one division
 *   per chunk, then a running block/offset cursor, one table lookup per block), so a chunk may span
 *   several blocks and the per-chunk softmax cost does not grow as blocks shrink, down to block_size 1.
 *   The prefetch follows the table: the next logical row, in another block at a block boundary.
 * - A task takes a run of `lanes` (sequence, KV head) pairs, consecutive in b * n_kv + h order (so
 *   a run may cross sequences), and walks them in step: row j of every lane, then row j + 1. Each
 *   lane streams its own blocks. What costs is the scatter, not the table: with blocks in pool
 *   order (an identity table) a task per sequence matched the contiguous kernel, and through a
 *   shuffled table every block is a jump to another page, where the hardware prefetchers (which
 *   stay within 4 KiB pages) start over and the TLB misses (2 MiB pages took about half the gap
 *   away); more streams in flight per core hide the restarts. Against one task per pair (the contiguous
 *   kernel's split, one K and one V stream per core), runs of 2 and 4 lanes read a shuffled pool
 *   faster and runs of 8 slower again (each lane's chunk of values is in flight in L1 at once); for
 *   example, on a 2-core Xeon VM at B=16, n_kv=2, G=2, D=64, 8192 tokens (scripts/kernel_read_rate.py): 1.19-1.26x
 *   the contiguous kernel's time at block 16 for one lane, 1.06-1.10x for 4, 1.21-1.24x for 8. Rows of
 *   D=128 are twice as wide: LANE_FLOATS caps the floats a step of all lanes reads (4 lanes at D=64, 2
 *   at 128).
 *   The run is as long as the threads allow (lanes_per_task). Each (pair, query) row is computed in
 *   the same order whatever the run, so outputs do not depend on the thread count.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h" /* MAX_GROUP (here also the most query rows of a task: G per lane), MAX_DIM */

#define CHUNK 64        /* keys per online-softmax step: a chunk's scores (MAX_GROUP x CHUNK floats) stay in L1 */
#define MAX_LANES 8     /* most (sequence, KV head) pairs a task walks in step */
#define LANE_FLOATS 256 /* a task's lanes read at most this many floats per row step (4 lanes of D=64) */
#define PREFETCH 8      /* rows ahead (per lane) whose keys are prefetched: 4 to 12 read alike */

#include "cpu_attention_fixed.h" /* the fixed-width path (head dimensions 64 and 128), shared with contiguous */

/* rows[j] = address of logical row start + j (j < count) of one lane: `pool` already points at the
 * lane's KV head, `pages` at its sequence's block ids. */
static void resolve_rows(const float *pool, int64_t block_stride, int64_t row_stride, const int32_t *pages,
                         int64_t block_size, int64_t start, int64_t count, const float **rows) {
    int64_t page = start / block_size, offset = start % block_size;
    const float *block = pool + (int64_t)pages[page] * block_stride;
    for (int64_t j = 0; j < count; j++) {
        rows[j] = block + offset * row_stride;
        if (++offset == block_size && j + 1 < count) { /* the next block; never a lookup past `count` */
            offset = 0;
            block = pool + (int64_t)pages[++page] * block_stride;
        }
    }
}

typedef const float *row_list[CHUNK + PREFETCH]; /* one lane's rows of a chunk, and the prefetch's beyond */

/* scores[r][j] = scale * q[r] . key of row j, for the n rows of one chunk, where r = l * group + g is
 * query g of lane l. keys[l] holds `ahead` >= n rows so the prefetch PREFETCH rows ahead follows the
 * table; value row j is prefetched for chunk_values. */
static void chunk_scores(const float *q, row_list *keys, row_list *values, int64_t ahead, int64_t n,
                         int64_t lanes, int64_t group, int64_t dim, float scale, float scores[MAX_GROUP][CHUNK]) {
    for (int64_t j = 0; j < n; j++) {
        for (int64_t l = 0; l < lanes; l++) {
            const float *next_key = j + PREFETCH < ahead ? keys[l][j + PREFETCH] : keys[l][j];
            for (int64_t line = 0; line < dim; line += 16) { /* 16 floats: one 64-byte cache line */
                __builtin_prefetch(next_key + line);
                __builtin_prefetch(values[l][j] + line);
            }
        }
        for (int64_t l = 0; l < lanes; l++) {
            const float *key = keys[l][j], *ql = q + l * group * dim;
            float(*s)[CHUNK] = scores + l * group; /* this lane's G rows */
            if (group == 4) { /* Llama 3 8B's group: four independent sums, one pass over the key */
                const float *q0 = ql, *q1 = ql + dim, *q2 = ql + 2 * dim, *q3 = ql + 3 * dim;
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
                    const float *qg = ql + g * dim;
                    float sum = 0;
#pragma omp simd reduction(+ : sum)
                    for (int64_t d = 0; d < dim; d++) sum += qg[d] * key[d];
                    s[g][j] = sum * scale;
                }
            }
        }
    }
}

/* acc[r][:] += sum_j p[r][j] * value of row j (lane r / group), over the n rows of one chunk, 16
 * columns at a time so the partial sums stay in registers across the chunk. */
static void chunk_values(row_list *values, int64_t n, int64_t lanes, int64_t group, int64_t dim,
                         float p[MAX_GROUP][CHUNK], float acc[MAX_GROUP][MAX_DIM]) {
    for (int64_t r = 0; r < lanes * group; r++) {
        const float **rows = values[r / group];
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
            if (d0 + 16 > dim) { /* a head dimension that is not a multiple of 16: the tail row by row */
                for (int64_t j = 0; j < n; j++)
                    for (int64_t d = d0; d < dim; d++) acc[r][d] += p[r][j] * rows[j][d];
                break;
            }
            float a[16];
            for (int c = 0; c < 16; c++) a[c] = acc[r][d0 + c];
            for (int64_t j = 0; j < n; j++) {
                const float *value = rows[j] + d0;
                float pj = p[r][j];
#pragma omp simd
                for (int c = 0; c < 16; c++) a[c] += pj * value[c];
            }
            for (int c = 0; c < 16; c++) acc[r][d0 + c] = a[c];
        }
    }
}

/* Pairs first .. first + lanes - 1 (pair t: sequence t / n_kv, KV head t % n_kv): out[r] =
 * softmax(scale * q[r] . K^T) V over logical keys 0..length-1 of lane r / group, for the lanes * group
 * query rows r, which are consecutive in q and out. */
static void attend_lanes(const float *q, float *out, int64_t first, int64_t lanes, const float *k_pool,
                         const int64_t *k_strides, const float *v_pool, const int64_t *v_strides,
                         const int32_t *table, int64_t table_stride, int64_t n_kv, int64_t block_size,
                         int64_t group, int64_t length, int64_t dim, float scale) {
    int64_t rows = lanes * group; /* <= MAX_GROUP: lanes_per_task sees to it */
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], p[MAX_GROUP][CHUNK], acc[MAX_GROUP][MAX_DIM];
    row_list keys[MAX_LANES], values[MAX_LANES];
    const float *k_head[MAX_LANES], *v_head[MAX_LANES];
    const int32_t *pages[MAX_LANES];
    for (int64_t l = 0; l < lanes; l++) {
        int64_t b = (first + l) / n_kv, h = (first + l) % n_kv;
        k_head[l] = k_pool + h * k_strides[1];
        v_head[l] = v_pool + h * v_strides[1];
        pages[l] = table + b * table_stride;
    }
    q += first * group * dim;
    out += first * group * dim;
    for (int64_t r = 0; r < rows; r++) {
        running_max[r] = -FLT_MAX; /* finite: -ffast-math assumes no infinities */
        running_sum[r] = 0.0f;
        memset(acc[r], 0, sizeof(float) * dim);
    }
    for (int64_t start = 0; start < length; start += CHUNK) {
        int64_t n = length - start < CHUNK ? length - start : CHUNK;
        int64_t ahead = length - start < CHUNK + PREFETCH ? length - start : CHUNK + PREFETCH; /* never past length */
        for (int64_t l = 0; l < lanes; l++) {
            resolve_rows(k_head[l], k_strides[0], k_strides[2], pages[l], block_size, start, ahead, keys[l]);
            resolve_rows(v_head[l], v_strides[0], v_strides[2], pages[l], block_size, start, n, values[l]);
        }
        chunk_scores(q, keys, values, ahead, n, lanes, group, dim, scale, p);
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
        chunk_values(values, n, lanes, group, dim, p, acc);
    }
    for (int64_t r = 0; r < rows; r++) {
        float inverse = 1.0f / running_sum[r];
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = acc[r][d] * inverse;
    }
}

/* Lanes per task: among runs of 1 .. the cap (LANE_FLOATS / dim lanes, MAX_LANES, and MAX_GROUP query
 * rows), the one that finishes first on `threads` threads, counting a task's time as its lanes (the
 * longest thread runs ceil(tasks / threads) tasks); among equals the longest run. */
static int64_t lanes_per_task(int64_t pairs, int64_t group, int64_t dim, int threads) {
    int64_t cap = LANE_FLOATS / dim, best = 1, best_time = INT64_MAX;
    if (threads < 1) threads = 1;
    for (int64_t lanes = 1; lanes <= cap && lanes <= MAX_LANES && lanes * group <= MAX_GROUP; lanes++) {
        int64_t tasks = (pairs + lanes - 1) / lanes, time = (tasks + threads - 1) / threads * lanes;
        if (time <= best_time) {
            best = lanes;
            best_time = time;
        }
    }
    return best;
}

/* q, out: [B, n_kv, G, D] contiguous. k_pool, v_pool: [n_blocks, n_kv, block_size, D] with element
 * strides k_strides/v_strides (block, head, row; the last dimension contiguous). block_table: [B, *]
 * int32 with row stride table_stride; its first ceil(length / block_size) entries per sequence are read. */
void paged_decode_attention(const float *q, const float *k_pool, const int64_t *k_strides, const float *v_pool,
                            const int64_t *v_strides, const int32_t *block_table, int64_t table_stride, float *out,
                            int64_t batch, int64_t n_kv, int64_t group, int64_t length, int64_t block_size,
                            int64_t dim, float scale, int threads) {
    if (dim == 64 || dim == 128) { /* a task per (sequence, KV head), its 8 segments in lockstep */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t task = 0; task < batch * n_kv; task++) {
            int64_t b = task / n_kv, h = task % n_kv;
            kv_rows rows = {k_pool + h * k_strides[1], v_pool + h * v_strides[1], k_strides[2], v_strides[2],
                            block_table + b * table_stride, block_size, k_strides[0], v_strides[0]};
            const float *q_task = q + task * group * dim;
            float *out_task = out + task * group * dim;
            if (dim == 64)
                attend_fixed(q_task, &rows, out_task, group, length, length, scale, 64 / LANES);
            else
                attend_fixed(q_task, &rows, out_task, group, length, length, scale, 128 / LANES);
        }
        return;
    }
    int64_t pairs = batch * n_kv, lanes = lanes_per_task(pairs, group, dim, threads);
    int64_t tasks = (pairs + lanes - 1) / lanes;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t first = task * lanes, count = pairs - first < lanes ? pairs - first : lanes; /* the last may be short */
        attend_lanes(q, out, first, count, k_pool, k_strides, v_pool, v_strides, block_table, table_stride, n_kv,
                     block_size, group, length, dim, scale);
    }
}
