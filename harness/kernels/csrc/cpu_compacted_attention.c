/* Decode attention over compacted slots on a CPU, and an evicting cache's whole decode step around it.
 *
 * A C++ translation unit of the kernels' extension (harness/kernels/extension.py), the operators
 * harness_kernels::compacted_decode_attention and evicting_decode_step_ (ops_compacted.cpp); used by
 * `eviction` (strategies/caches/eviction.py) for its decode steps on a CPU in fp32.
 *
 * Slots: each (sequence, KV head) pair keeps its tokens in rows 0..fill-1 of its own slot table, in
 * no order (an evicted token's row is overwritten by a later one), with a fill count of its own, so
 * pairs of different fills (ragged batches, heads keeping different tokens) cost what they hold and
 * no more. Attention over slots is attention over a table of `fill` rows: this file adds no attention
 * loop of its own. fp32 slots go through the exact decode kernel (cpu_decode_attention.c: its blocking,
 * 8-segment reads, vectors and threading), int8/int4/fp8 slots through the quantized kernel
 * (cpu_quantized_attention.c: codes decoded in registers), each with its taps (kernels.h): every
 * key's scaled score kept as the kernel computes it, and each pair settled in the task that attended
 * it, while its logits are still in cache.
 *
 * Settling a pair: the policy's step weights, softmax(score) averaged over the pair's G query heads,
 * added to its score table (H2O) or written over it (TOVA), from the logits and the softmax's max and
 * sum (no second read of the keys, no logits tensor in torch); then, in a step, once the pair holds
 * more than the budget, the slot of lowest score among the unprotected ones becomes the one its next
 * token is written to (torch's argmin: the first of equals; none unprotected: slot 0).
 *
 * A step (evicting_decode_step) first writes the new token of each pair into its next slot (a free
 * row while the pair fills, then the slot its last step freed), with its position and its entry
 * score (quantized slots: quantize_rows, bit for bit strategies/caches/quantization.py's quantizer),
 * and, for StreamingLLM's in-cache positions, the sinks' keys rotated forward by the tokens evicted;
 * then attends and settles. What the torch backend of strategies/caches/eviction.py does in ~10 torch
 * operations a layer is one call here.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define WEIGHT_CHUNK 64 /* slots whose weights are summed over the group at once (a buffer on the stack) */

typedef struct { /* what settling a pair needs of a call (pair_taps.context) */
    int64_t n_kv, group;
    eviction_state state;
    int evict;       /* choose the next slot of pairs over the budget (a step), or only score (attention alone) */
    int64_t newest;  /* the step's token's position: protection counts back from it */
} Settling;

/* A pair's step weights into its score table, and its next slot where it holds more than the budget
 * (the module comment). */
static void settle(const pair_taps *taps, int64_t pair, const float *row_max, const float *row_sum) {
    const Settling *s = (const Settling *)taps->context;
    const eviction_state *state = &s->state;
    const int64_t n = taps->fill[pair], b = pair / s->n_kv, h = pair % s->n_kv, group = s->group;
    float *score = state->scores + b * state->score_strides[0] + h * state->score_strides[1];
    if (state->step_weights != STEP_WEIGHTS_IGNORE) {
        const float *logits = taps->logits + pair * group * taps->logit_row;
        float inverse[MAX_GROUP]; /* 1 / (sum * G): a row's weights, averaged over the group */
        for (int64_t g = 0; g < group; g++) inverse[g] = 1.0f / (row_sum[g] * (float)group);
        for (int64_t j0 = 0; j0 < n; j0 += WEIGHT_CHUNK) {
            int64_t m = n - j0 < WEIGHT_CHUNK ? n - j0 : WEIGHT_CHUNK;
            float weight[WEIGHT_CHUNK] = {0};
            for (int64_t g = 0; g < group; g++) {
                const float *row = logits + g * taps->logit_row + j0;
                float top = row_max[g], share = inverse[g];
#pragma omp simd
                for (int64_t j = 0; j < m; j++) weight[j] += expf(row[j] - top) * share;
            }
            if (state->step_weights == STEP_WEIGHTS_ACCUMULATE)
                for (int64_t j = 0; j < m; j++) score[j0 + j] += weight[j];
            else
                for (int64_t j = 0; j < m; j++) score[j0 + j] = weight[j];
        }
    }
    if (!s->evict || n <= state->budget) return;
    const int32_t *position = state->positions + b * state->position_strides[0] + h * state->position_strides[1];
    const int64_t first_dropped = state->protected_first, last_dropped = s->newest - state->protected_recent;
    int64_t lowest_at = 0;
    float lowest = FLT_MAX; /* finite: -ffast-math assumes no infinities */
    for (int64_t j = 0; j < n; j++)
        if (position[j] >= first_dropped && position[j] <= last_dropped && score[j] < lowest) lowest = score[j], lowest_at = j;
    state->free[pair] = lowest_at;
}

/* Attention over the slots with taps that settle each pair (logits kept where the policy takes step
 * weights). */
static void attend_slots(const float *q, compacted_slots slots, const int32_t *fill, const Settling *settling,
                         float *out, int64_t batch, int64_t n_kv, int64_t group, int64_t dim, float scale,
                         int threads) {
    const int64_t pairs = batch * n_kv;
    int64_t longest = 1;
    for (int64_t pair = 0; pair < pairs; pair++) longest = fill[pair] > longest ? fill[pair] : longest;
    const int weighted = settling->state.step_weights != STEP_WEIGHTS_IGNORE;
    float *logits = weighted ? (float *)malloc(sizeof(float) * pairs * group * longest) : NULL;
    const pair_taps taps = {fill, dim, NULL, logits, longest, weighted || settling->evict ? settle : NULL, settling};
    if (slots.format == SLOTS_FP32) {
        decode_attention_tapped(q, (const float *)slots.k, slots.k_strides, (const float *)slots.v, slots.v_strides,
                                out, batch, n_kv, group, longest, dim, scale, threads, &taps);
    } else {
        const quantized_table keys = {(const uint8_t *)slots.k, slots.k_strides, slots.k_scales, slots.k_scale_strides};
        const quantized_table values = {(const uint8_t *)slots.v, slots.v_strides, slots.v_scales,
                                        slots.v_scale_strides};
        quantized_decode_attention_tapped(q, keys, values, out, batch, n_kv, group, longest, dim, slots.format,
                                          slots.span, scale, threads, &taps);
    }
    free(logits);
}

void compacted_decode_attention(const float *q, compacted_slots slots, const int32_t *fill, eviction_state scoring,
                                float *out, int64_t batch, int64_t n_kv, int64_t group, int64_t dim, float scale,
                                int threads) {
    const Settling settling = {n_kv, group, scoring, 0, 0};
    attend_slots(q, slots, fill, &settling, out, batch, n_kv, group, dim, scale, threads);
}

/* Row `slot` of a pair's table (fp32 rows, or a format's codes and scales) := the new row x [D]. */
static void write_row(const compacted_slots *slots, int keys, int64_t b, int64_t h, int64_t slot, const float *x,
                      int64_t dim) {
    const int64_t *strides = keys ? slots->k_strides : slots->v_strides;
    if (slots->format == SLOTS_FP32) {
        float *table = (float *)(keys ? slots->k : slots->v);
        memcpy(table + b * strides[0] + h * strides[1] + slot * strides[2], x, sizeof(float) * dim);
        return;
    }
    const int64_t *scale_strides = keys ? slots->k_scale_strides : slots->v_scale_strides;
    uint8_t *payload = (uint8_t *)(keys ? slots->k : slots->v) + b * strides[0] + h * strides[1];
    float *scales = (keys ? slots->k_scales : slots->v_scales) + b * scale_strides[0] + h * scale_strides[1];
    const int64_t row_strides[3] = {0, 0, dim};
    quantize_rows(x, row_strides, 1, 1, 1, dim, slots->format, slots->span, payload, strides, scales, scale_strides,
                  slot);
}

/* Keys of the first sinks slots := the sinks' keys as first computed, rotated by RoPE's cos/sin row for
 * `evicted` positions: (x * cos + (x2, x1) * sin), as strategies/caches/eviction.py's torch backend does. */
static void rotate_sinks(const compacted_slots *slots, const sink_rotation *sinks, int64_t pair, int64_t b, int64_t h,
                         int64_t count, int64_t evicted, int64_t dim) {
    const float *cos = sinks->cos + evicted * dim, *sin = sinks->sin + evicted * dim;
    const int64_t half = dim / 2;
    for (int64_t s = 0; s < count; s++) {
        const float *x = sinks->keys + (pair * sinks->count + s) * dim;
        float *key = (float *)slots->k + b * slots->k_strides[0] + h * slots->k_strides[1] + s * slots->k_strides[2];
        for (int64_t d = 0; d < dim; d++) key[d] = x[d] * cos[d] + x[d < half ? d + half : d - half] * sin[d];
    }
}

void evicting_decode_step(const float *q, const float *k_new, const float *v_new, compacted_slots slots, int32_t *fill,
                          eviction_state state, int64_t position, float entry_score, const sink_rotation *sinks,
                          float *out, int64_t batch, int64_t n_kv, int64_t group, int64_t slot_count, int64_t dim,
                          float scale, int threads) {
    for (int64_t pair = 0; pair < batch * n_kv; pair++) { /* the new token into each pair's next slot */
        int64_t b = pair / n_kv, h = pair % n_kv, slot = fill[pair] < slot_count ? fill[pair]++ : state.free[pair];
        write_row(&slots, 1, b, h, slot, k_new + pair * dim, dim);
        write_row(&slots, 0, b, h, slot, v_new + pair * dim, dim);
        state.positions[b * state.position_strides[0] + h * state.position_strides[1] + slot] = (int32_t)position;
        state.scores[b * state.score_strides[0] + h * state.score_strides[1] + slot] = entry_score;
        if (sinks == NULL) continue;
        if (position < sinks->count) memcpy(sinks->keys + (pair * sinks->count + position) * dim, k_new + pair * dim,
                                            sizeof(float) * dim);
        int64_t count = sinks->count < fill[pair] ? sinks->count : fill[pair];
        rotate_sinks(&slots, sinks, pair, b, h, count, position + 1 - fill[pair], dim);
    }
    const Settling settling = {n_kv, group, state, 1, position};
    attend_slots(q, slots, fill, &settling, out, batch, n_kv, group, dim, scale, threads);
}
