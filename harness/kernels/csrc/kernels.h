/* The CPU kernels' entry points and the limits they share: what ops.cpp registers as torch operators,
 * and the one definition of every constant Python reads (through the op harness_kernels::constants).
 *
 * Each kernel source (cpu_decode_attention.c, cpu_paged_attention.c, cpu_quantized_attention.c,
 * cpu_gemv.c) is plain C in the subset C++ also compiles, includes no torch header, and is built as a
 * C++ translation unit of the one extension (harness/kernels/extension.py), so it compiles in seconds. The
 * entry points have C linkage: any C or C++ compiler builds the same symbols. Pointers are to fp32
 * unless said; strides are in elements (the quantized payloads' in bytes); every kernel takes its
 * thread count and runs one OpenMP parallel region on torch's runtime.
 */
#ifndef HARNESS_KERNELS_H
#define HARNESS_KERNELS_H

#include <stdint.h>

#define MAX_GROUP 32 /* most query heads per KV head any attention kernel takes (Llama 3: 4 at 8B, 8 at 70B, 16 at 405B) */
#define MAX_DIM 512  /* largest head dimension any attention kernel takes (Llama 3: 128) */

/* The quantized cache's payload formats (strategies/caches/quantization.py names them int8, int4, fp8_e4m3). */
enum { FORMAT_INT8 = 0, FORMAT_INT4 = 1, FORMAT_FP8_E4M3 = 2 };

#ifdef __cplusplus
extern "C" {
#endif

/* cpu_decode_attention.c. q, out: [B, n_kv, G, D] contiguous. k, v: [B, n_kv, S, D] with strides
 * k_strides/v_strides (3 each; rows contiguous); keys 0..length-1 read, keys visible..length-1 weighted 0. */
void decode_attention(const float *q, const float *k, const int64_t *k_strides, const float *v,
                      const int64_t *v_strides, float *out, int64_t batch, int64_t n_kv, int64_t group,
                      int64_t length, int64_t visible, int64_t dim, float scale, int threads);

/* cpu_paged_attention.c. q, out: [B, n_kv, G, D] contiguous. k_pool, v_pool: head-major
 * [n_blocks, n_kv, block_size, D] with strides (block, head, row); block_table: [B, *] int32, row
 * stride table_stride. */
void paged_decode_attention(const float *q, const float *k_pool, const int64_t *k_strides, const float *v_pool,
                            const int64_t *v_strides, const int32_t *block_table, int64_t table_stride, float *out,
                            int64_t batch, int64_t n_kv, int64_t group, int64_t length, int64_t block_size,
                            int64_t dim, float scale, int threads);

/* Ragged batches (a serving pool's sequences, each at its own length): q, out [B, n_kv, G, D]. The
 * contiguous one reads one shared table k, v [n_kv, S, D] (strides: head, row), sequence b at rows
 * starts[b] .. starts[b] + lengths[b] - 1; the paged one reads lengths[b] positions through row b of
 * the block table. (The quantized one is declared below its table type.) */
void ragged_decode_attention(const float *q, const float *k, const int64_t *k_strides, const float *v,
                             const int64_t *v_strides, const int64_t *starts, const int64_t *lengths, float *out,
                             int64_t batch, int64_t n_kv, int64_t group, int64_t dim, float scale, int threads);
void ragged_paged_decode_attention(const float *q, const float *k_pool, const int64_t *k_strides, const float *v_pool,
                                   const int64_t *v_strides, const int32_t *block_table, int64_t table_stride,
                                   const int64_t *lengths, float *out, int64_t batch, int64_t n_kv, int64_t group,
                                   int64_t block_size, int64_t dim, float scale, int threads);

/* cpu_quantized_attention.c: attention over a quantized cache and its fp32 window, and the write side.
 * A quantized table (K or V) of every (sequence, KV head): */
typedef struct {
    const uint8_t *payload;       /* [B, n_kv, S, W] codes */
    const int64_t *strides;       /* its first three strides, in bytes (rows contiguous) */
    const float *scales;          /* fp32 scales, [B, n_kv, S, D / span] (channel-axis keys: [B, n_kv, S / key_block, D]) */
    const int64_t *scale_strides; /* their first three strides, in floats */
} quantized_table;
void quantized_decode_attention(const float *q, quantized_table keys, quantized_table values, const float *k_window,
                                const float *v_window, const int64_t *window_strides, float *out, int64_t batch,
                                int64_t n_kv, int64_t group, int64_t quantized_length, int64_t window_length,
                                int64_t dim, int format, int64_t span, int64_t key_block, float scale, int threads);
/* A ragged batch over one shared table [1, n_kv, S, W] (token-axis scales, no window): sequence b's
 * tokens are the rows starts[b] .. starts[b] + lengths[b] - 1. */
void ragged_quantized_decode_attention(const float *q, quantized_table keys, quantized_table values,
                                       const int64_t *starts, const int64_t *lengths, float *out, int64_t batch,
                                       int64_t n_kv, int64_t group, int64_t dim, int format, int64_t span, float scale,
                                       int threads);
void quantize_rows(const float *x, const int64_t *x_strides, int64_t batch, int64_t n_kv, int64_t n, int64_t dim,
                   int format, int64_t span, uint8_t *payload, const int64_t *payload_strides, float *scales,
                   const int64_t *scale_strides, int64_t start);

/* cpu_gemv.c: the small-batch linear, the RMSNorm, and a decoder block's two halves. */
void gemv(const float *x, const float *w, float *out, int64_t n_inputs, int64_t k_len, int64_t n_len, int threads);
void rms_norm_rows(const float *x, const float *weight, float eps, float *out, int64_t n_inputs, int64_t k_len);
void attention_input(const float *x, const float *norm_weight, float eps, const float *wqkv, const float *cos,
                     const float *sin, float *normed, float *qkv, int64_t batch, int64_t tokens, int64_t d_model,
                     int64_t heads, int64_t rotated_heads, int64_t dim, int threads);
void attention_output_and_ffn(const float *attention, const float *wo, float *x, const float *norm_weight, float eps,
                              const float *w13, const float *w2, float *normed, float *gate_up, float *hidden,
                              int64_t rows, int64_t d_model, int64_t attention_width, int64_t ffn, int threads);

#ifdef __cplusplus
}
#endif

#endif
