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
 * Any other head dimension: the generic path of cpu_attention.h, which the contiguous kernel takes
 * too. A block of keys' row addresses are resolved through the table first (one division per block,
 * then a running block/offset cursor, one table lookup per block of the pool), so a block of keys may
 * span several blocks of the pool and the per-block softmax cost does not grow as they shrink, down to
 * block_size 1; the prefetch follows the table. What this kernel adds: a task takes a run of `lanes`
 * (sequence, KV head) pairs, consecutive in b * n_kv + h order (so a run may cross sequences), walked
 * in step: row j of every lane, then row j + 1, each lane streaming its own blocks. What costs is the
 * scatter, not the table: with blocks in pool order (an identity table) a task per sequence matched
 * the contiguous kernel, and through a shuffled table every block is a jump to another page, where the
 * hardware prefetchers (which stay within 4 KiB pages) start over and the TLB misses (2 MiB pages took
 * about half the gap away); more streams in flight per core hide the restarts. Against one task per
 * pair (the contiguous kernel's split, one K and one V stream per core), runs of 2 and 4 lanes read a
 * shuffled pool faster and runs of 8 slower again (each lane's block of values is in flight in L1 at
 * once); for example, on a 2-core Xeon VM at B=16, n_kv=2, G=2, D=64, 8192 tokens
 * (scripts/kernel_read_rate.py): 1.19-1.26x the contiguous kernel's time at block 16 for one lane,
 * 1.06-1.10x for 4, 1.21-1.24x for 8. Rows of D=128 are twice as wide: LANE_FLOATS caps the floats a
 * step of all lanes reads (4 lanes at D=64, 2 at 128). The run is as long as the threads allow
 * (lanes_per_task). Each (pair, query) row is computed in the same order whatever the run, so outputs
 * do not depend on the thread count.
 */
#include <stdint.h>

#include "cpu_attention.h" /* attend_pair, attend_generic, kv_rows, MAX_LANES */
#include "kernels.h"       /* MAX_GROUP (here also the most query rows of a task: G per lane) */

#define LANE_FLOATS 256 /* a task's lanes read at most this many floats per row step (4 lanes of D=64) */

/* Where pair t's rows are (sequence t / n_kv, KV head t % n_kv): its KV head in the pools, its
 * sequence's row of the block table. */
static inline kv_rows pair_rows(int64_t t, const float *k_pool, const int64_t *k_strides, const float *v_pool,
                                const int64_t *v_strides, const int32_t *block_table, int64_t table_stride,
                                int64_t n_kv, int64_t block_size) {
    int64_t b = t / n_kv, h = t % n_kv;
    kv_rows rows = {k_pool + h * k_strides[1], v_pool + h * v_strides[1], k_strides[2], v_strides[2],
                    block_table + b * table_stride, block_size, k_strides[0], v_strides[0]};
    return rows;
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
    int64_t pairs = batch * n_kv;
    if (dim == 64 || dim == 128) { /* a task per (sequence, KV head), its 8 segments in lockstep */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t task = 0; task < pairs; task++) {
            kv_rows rows = pair_rows(task, k_pool, k_strides, v_pool, v_strides, block_table, table_stride, n_kv,
                                     block_size);
            attend_pair(q + task * group * dim, &rows, out + task * group * dim, group, length, length, dim, scale);
        }
        return;
    }
    int64_t lanes = lanes_per_task(pairs, group, dim, threads), tasks = (pairs + lanes - 1) / lanes;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t first = task * lanes, count = pairs - first < lanes ? pairs - first : lanes; /* the last may be short */
        kv_rows rows[MAX_LANES];
        for (int64_t l = 0; l < count; l++)
            rows[l] = pair_rows(first + l, k_pool, k_strides, v_pool, v_strides, block_table, table_stride, n_kv,
                                block_size);
        attend_generic(q + first * group * dim, rows, count, out + first * group * dim, group, length, length, dim,
                       scale);
    }
}

/* A ragged batch over the pool (a serving pool, strategies/caches/paged.py): sequence b reads its
 * positions 0..lengths[b]-1 through its row of the block table. One task per (sequence, KV head)
 * through attend_pair (the fixed-width path at head dimensions 64 and 128, one lane of the generic
 * path at others), handed out one at a time, since the pairs' lengths differ. */
void ragged_paged_decode_attention(const float *q, const float *k_pool, const int64_t *k_strides, const float *v_pool,
                                   const int64_t *v_strides, const int32_t *block_table, int64_t table_stride,
                                   const int64_t *lengths, float *out, int64_t batch, int64_t n_kv, int64_t group,
                                   int64_t block_size, int64_t dim, float scale, int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < batch * n_kv; task++) {
        kv_rows rows = pair_rows(task, k_pool, k_strides, v_pool, v_strides, block_table, table_stride, n_kv,
                                 block_size);
        int64_t length = lengths[task / n_kv];
        attend_pair(q + task * group * dim, &rows, out + task * group * dim, group, length, length, dim, scale);
    }
}
