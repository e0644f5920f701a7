/* Decode attention over keys pruned to a kept subset of their channels (ThinK), on a CPU in fp32.
 *
 * A C++ translation unit of the kernels' extension (harness/kernels/extension.py), the operator
 * harness_kernels::pruned_key_decode_attention_ (ops_compacted.cpp); used by `think`
 * (strategies/caches/think.py) for its decode steps on a CPU in fp32.
 *
 * The keys are stored at their kept width: a table [B, n_kv, S, key_dim] whose rows are key_dim floats
 * apart, and read at that width, so a step reads key_dim / D of the exact cache's key bytes. Each pair
 * keeps its own channels: the query's kept channels are picked inside the kernel (cpu_attention.h's
 * attend_pair_scored gathers them once a pair), and the values keep every channel. The attention is the
 * exact decode kernel's (cpu_decode_attention.c, through its taps): at head dimensions 64 and 128 its
 * fixed-width path reads each key row at the values' width, on into the next row, against a query
 * that is 0 past the kept channels, so the table needs D - key_dim floats after its last row
 * (strategies/caches/think.py allocates them); at other widths the generic path reads key_dim floats
 * a row. The scale stays 1 / sqrt(D), as ThinK's.
 *
 * Before attending, a step's new row is written at `position`: its key's kept channels and its whole
 * value, as the torch backend's gather and copies do.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

void pruned_key_decode_attention(const float *q, const float *k_new, const float *v_new, float *k,
                                 const int64_t *k_strides, float *v, const int64_t *v_strides, const int64_t *channels,
                                 float *out, int64_t batch, int64_t n_kv, int64_t group, int64_t position,
                                 int64_t key_dim, int64_t dim, float scale, int threads) {
    for (int64_t pair = 0; pair < batch * n_kv; pair++) {
        int64_t b = pair / n_kv, h = pair % n_kv;
        float *key = k + b * k_strides[0] + h * k_strides[1] + position * k_strides[2];
        const float *new_key = k_new + pair * dim;
        const int64_t *kept = channels + pair * key_dim;
        for (int64_t c = 0; c < key_dim; c++) key[c] = new_key[kept[c]];
        memcpy(v + b * v_strides[0] + h * v_strides[1] + position * v_strides[2], v_new + pair * dim,
               sizeof(float) * dim);
    }
    const pair_taps taps = {NULL, key_dim, channels, NULL, 0, NULL, NULL};
    decode_attention_tapped(q, k, k_strides, v, v_strides, out, batch, n_kv, group, position + 1, dim, scale, threads,
                            &taps);
}
