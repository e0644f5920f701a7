/* The CPU kernels' entry points and the limits they share: what ops.cpp registers as torch operators,
 * and the one definition of every constant Python reads (through the op harness_kernels::constants).
 *
 * Each kernel source (cpu_decode_attention.c, cpu_paged_attention.c, cpu_quantized_attention.c,
 * cpu_compacted_attention.c, cpu_pruned_attention.c, cpu_gemv.c) is plain C in the subset C++ also
 * compiles, includes no torch header, and is built as a C++ translation unit of the one extension
 * (harness/kernels/extension.py), so it compiles in seconds. The entry points have C linkage: any C
 * or C++ compiler builds the same symbols. Pointers are to fp32 unless said; strides are in elements
 * (the quantized payloads' in bytes); every kernel takes its thread count and runs one OpenMP parallel
 * region on torch's runtime.
 */
#ifndef HARNESS_KERNELS_H
#define HARNESS_KERNELS_H

#include <stdint.h>

#define MAX_GROUP 32 /* most query heads per KV head any attention kernel takes (Llama 3: 4 at 8B, 8 at 70B, 16 at 405B) */
#define MAX_DIM 512  /* largest head dimension any attention kernel takes (Llama 3: 128) */

/* The quantized cache's payload formats (strategies/caches/quantization.py names them int8, int4, fp8_e4m3). */
enum { FORMAT_INT8 = 0, FORMAT_INT4 = 1, FORMAT_FP8_E4M3 = 2 };
/* Compacted slots held in fp32, beside the formats above (cpu_compacted_attention.c). */
enum { SLOTS_FP32 = -1 };
/* What a decode step does with its attention weights for an evicting cache's policy
 * (strategies/caches/eviction_policies.py's StepWeights): nothing, add them to its scores, replace them. */
enum { STEP_WEIGHTS_IGNORE = 0, STEP_WEIGHTS_ACCUMULATE = 1, STEP_WEIGHTS_REPLACE = 2 };

/* What the kernels over compacted slots and pruned keys (cpu_compacted_attention.c,
 * cpu_pruned_attention.c) ask of the fp32 and quantized attention kernels beyond their output: taps on
 * each (sequence, KV head) pair p = b * n_kv + h as its attention runs, in the task that runs it. */
typedef struct pair_taps {
    const int32_t *fill;     /* [pairs] keys each pair attends over (its filled slots); NULL: the call's length */
    int64_t key_dim;         /* floats of a key row: the head dimension, or fewer for keys pruned to some channels */
    const int64_t *channels; /* [pairs, key_dim] the query channels a pruned key row holds; NULL: whole keys */
    float *logits;           /* [pairs, G, logit_row] each key's scaled score per query row; NULL: not kept */
    int64_t logit_row;       /* floats between two query rows' logits (at least the most keys a pair holds) */
    /* Called once a pair's output is in (NULL: nothing), with its G query rows' softmax max and sum of
     * exp(score - max): what turns its logits into weights. */
    void (*finish)(const struct pair_taps *taps, int64_t pair, const float *row_max, const float *row_sum);
    const void *context; /* the caller's, for finish */
} pair_taps;

#ifdef __cplusplus
extern "C" {
#endif

/* cpu_decode_attention.c. q, out: [B, n_kv, G, D] contiguous. k, v: [B, n_kv, S, D] with strides
 * k_strides/v_strides (3 each; rows contiguous); keys 0..length-1 read, keys visible..length-1 weighted 0. */
void decode_attention(const float *q, const float *k, const int64_t *k_strides, const float *v,
                      const int64_t *v_strides, float *out, int64_t batch, int64_t n_kv, int64_t group,
                      int64_t length, int64_t visible, int64_t dim, float scale, int threads);
/* decode_attention with taps (every key visible): each pair over its own fill, keys of taps->key_dim
 * floats a row (k_strides[2] apart), logits kept, finish called. */
void decode_attention_tapped(const float *q, const float *k, const int64_t *k_strides, const float *v,
                             const int64_t *v_strides, float *out, int64_t batch, int64_t n_kv, int64_t group,
                             int64_t length, int64_t dim, float scale, int threads, const pair_taps *taps);

/* cpu_paged_attention.c. q, out: [B, n_kv, G, D] contiguous. k_pool, v_pool: head-major
 * [n_blocks, n_kv, block_size, D] with strides (block, head, row); block_table: [B, *] int32, row
 * stride table_stride. */
void paged_decode_attention(const float *q, const float *k_pool, const int64_t *k_strides, const float *v_pool,
                            const int64_t *v_strides, const int32_t *block_table, int64_t table_stride, float *out,
                            int64_t batch, int64_t n_kv, int64_t group, int64_t length, int64_t block_size,
                            int64_t dim, float scale, int threads);

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
/* quantized_decode_attention over token-axis tables alone, with taps (each pair over its own fill). */
void quantized_decode_attention_tapped(const float *q, quantized_table keys, quantized_table values, float *out,
                                       int64_t batch, int64_t n_kv, int64_t group, int64_t length, int64_t dim,
                                       int format, int64_t span, float scale, int threads, const pair_taps *taps);
void quantize_rows(const float *x, const int64_t *x_strides, int64_t batch, int64_t n_kv, int64_t n, int64_t dim,
                   int format, int64_t span, uint8_t *payload, const int64_t *payload_strides, float *scales,
                   const int64_t *scale_strides, int64_t start);

/* cpu_compacted_attention.c: attention over compacted slots (rows 0..fill-1 of each pair's table,
 * fill[b * n_kv + h] >= 1 each), and an evicting cache's decode step. */
typedef struct {
    int format;                          /* SLOTS_FP32, or a FORMAT_* of quantized slots */
    int64_t span;                        /* quantized: channels per scale */
    void *k, *v;                         /* [B, n_kv, S, D] fp32 rows, or [B, n_kv, S, W] codes */
    const int64_t *k_strides, *v_strides; /* their first three strides: in floats (fp32), in bytes (codes) */
    float *k_scales, *v_scales;          /* quantized: [B, n_kv, S, D / span] fp32 */
    const int64_t *k_scale_strides, *v_scale_strides; /* their first three strides, in floats */
} compacted_slots;
typedef struct {                          /* an evicting cache's policy state, [B, n_kv, S] with contiguous slots */
    float *scores;                        /* each slot's score */
    const int64_t *score_strides;         /* its first two strides, in floats */
    int step_weights;                     /* STEP_WEIGHTS_*: what a step's attention weights do to the scores */
    int32_t *positions;                   /* each slot's token position (a step: written, and read for protection) */
    const int64_t *position_strides;
    int64_t *free;                        /* [B * n_kv] the slot a full pair writes its next token to */
    int64_t budget;                       /* tokens a pair keeps between steps */
    int64_t protected_first, protected_recent; /* positions < first and the last `recent` are never freed */
} eviction_state;
typedef struct {           /* StreamingLLM's in-cache positions: fp32 slots whose first `count` hold the sinks */
    float *keys;           /* [B * n_kv, count, D] the sinks' keys as first computed */
    int64_t count;
    const float *cos, *sin; /* [max_len, D] RoPE's tables */
} sink_rotation;
/* q, out: [B, n_kv, G, D] fp32 contiguous. The scores take the step's weights (scoring.step_weights);
 * no slot is freed. */
void compacted_decode_attention(const float *q, compacted_slots slots, const int32_t *fill, eviction_state scoring,
                                float *out, int64_t batch, int64_t n_kv, int64_t group, int64_t dim, float scale,
                                int threads);
/* One step: k_new, v_new [B, n_kv, D] written at `position` into each pair's next slot of slot_count
 * (fill counted up to it), entry_score its score, sinks rotated (NULL: none); attention; each pair over
 * the budget frees its lowest-scored unprotected slot. */
void evicting_decode_step(const float *q, const float *k_new, const float *v_new, compacted_slots slots, int32_t *fill,
                          eviction_state state, int64_t position, float entry_score, const sink_rotation *sinks,
                          float *out, int64_t batch, int64_t n_kv, int64_t group, int64_t slot_count, int64_t dim,
                          float scale, int threads);

/* cpu_pruned_attention.c: decode attention over keys pruned to key_dim channels per pair (channels
 * [B * n_kv, key_dim]); the new row at `position` written first (k_new [B, n_kv, D] pruned here). */
void pruned_key_decode_attention(const float *q, const float *k_new, const float *v_new, float *k,
                                 const int64_t *k_strides, float *v, const int64_t *v_strides, const int64_t *channels,
                                 float *out, int64_t batch, int64_t n_kv, int64_t group, int64_t position,
                                 int64_t key_dim, int64_t dim, float scale, int threads);

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
