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
 * `visible` masks keys visible..length-1 (their weight is exactly 0) while still reading them: the
 * static_full layout, which attends over its whole preallocated table every step.
 */
#include <stdint.h>

#include "cpu_attention.h" /* attend_pair */
#include "kernels.h"

/* q, out: [B, n_kv, G, D] contiguous. k, v: [B, n_kv, S, D] cache tables with element strides
 * k_strides/v_strides (3 each; the last dimension contiguous); keys 0..length-1 are read and keys
 * visible..length-1 are masked (visible = length: none). */
void decode_attention(const float *q, const float *k, const int64_t *k_strides, const float *v,
                      const int64_t *v_strides, float *out, int64_t batch, int64_t n_kv, int64_t group,
                      int64_t length, int64_t visible, int64_t dim, float scale, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < batch * n_kv; task++) {
        int64_t b = task / n_kv, h = task % n_kv;
        kv_rows rows = {k + b * k_strides[0] + h * k_strides[1], v + b * v_strides[0] + h * v_strides[1],
                        k_strides[2], v_strides[2], NULL, 0, 0, 0};
        attend_pair(q + task * group * dim, &rows, out + task * group * dim, group, length, visible, dim, scale);
    }
}
