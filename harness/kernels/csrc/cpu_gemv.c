/* The small-batch linear of a decode step on a CPU in fp32: out[r, n] = sum_k x[r, k] w[n, k] for a
 * few rows r (the batch) against a whole weight matrix w [N, K], row-major, as nn.Linear stores it;
 * and, at the end, a decoder block's few-row calls built from it: the RMSNorm, RoPE, SwiGLU's activation
 * and the residual adds between its linears, in two parallel regions a block.
 *
 * A C++ translation unit of the kernels' extension (harness/kernels/extension.py), the operators
 * harness_kernels::gemv, rms_norm, attention_input and attention_output_and_ffn_ (ops.cpp); called by
 * harness/model/cpu_gemv.py. Why it is shaped this way (scripts/step_kernels_ab.py measures the
 * alternatives on the machine at hand, the 33 linears of a cpu_small step in a row):
 * - A decode step's linears are a weight read: each weight float meets only `rows` inputs. MKL's sgemv
 *   (aten) and oneDNN's packed kernel read the few-MB matrices of a small model well below what the
 *   same cores read in parallel streams, and one core reading one stream reads markedly slower than
 *   one reading 4 or more interleaved streams. So a thread's rows are split into WEIGHT_STREAMS equal
 *   segments and it walks them in lockstep: one vector of row i of every segment in turn, each row a
 *   stream of its own.
 * - Each weight vector is loaded once per tile of up to TILE input rows and multiplied into a register
 *   accumulator per (stream, input row): 6 x 4 = 24 vectors, which with the 4 inputs and the weight fit
 *   AVX-512's 32 registers (8 x 4 spills); 6 x 4 was also among the fastest splits in an AVX2 build
 *   (16 registers). More input rows are further tiles over the same weight rows, which are then in L1
 *   or L2.
 * - The WEIGHT_STREAMS x TILE horizontal sums go LANES at a time through vector.h's transpose tree, which
 *   beats a scalar chain per output at 1-4 rows.
 * - Each output is one thread's sum in a fixed order, so the result does not depend on the thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "kernels.h"
#include "vector.h" /* LANES, vec, load_vec, sum_lanes */

#define WEIGHT_STREAMS 6 /* weight rows read in lockstep per thread (one stream reads markedly slower) */
#define TILE 4 /* input rows per pass over the weight rows: WEIGHT_STREAMS x TILE accumulators in registers */
#define ACTIVATION_BLOCK 256 /* SwiGLU activation values a thread takes at a time */


/* out[r, row[s]] (or out += it, with accumulate) for weight rows row[0..n_rows-1] and input rows
 * r < n_inputs (<= TILE); n_rows and n_inputs are constants where it is inlined, so the accumulators
 * are registers. */
static inline __attribute__((always_inline)) void dot_rows(const float *x, const float *w, float *out, int64_t k_len,
                                                          int64_t n_len, const int64_t *row, const int n_rows,
                                                          const int n_inputs, const int accumulate) {
    vec acc[WEIGHT_STREAMS][TILE];
    for (int s = 0; s < n_rows; s++)
        for (int r = 0; r < n_inputs; r++) acc[s][r] = (vec){0};
    const int64_t k_vec = k_len / LANES * LANES;
    for (int64_t k = 0; k < k_vec; k += LANES) {
        vec inputs[TILE];
        for (int r = 0; r < n_inputs; r++) inputs[r] = load_vec(x + r * k_len + k);
        for (int s = 0; s < n_rows; s++) {
            vec weights = load_vec(w + row[s] * k_len + k);
            for (int r = 0; r < n_inputs; r++) acc[s][r] += weights * inputs[r];
        }
    }
    /* The n_rows x n_inputs horizontal sums, LANES at a time through the transpose tree: a chain of
     * LANES scalar adds per output cost more than the dot product itself at in_features 256-512. */
    const int count = n_rows * n_inputs;
    for (int first = 0; first < count; first += LANES) {
        vec part[LANES];
        for (int j = 0; j < LANES; j++)
            part[j] = first + j < count ? acc[(first + j) / n_inputs][(first + j) % n_inputs] : (vec){0};
        const vec sums = sum_lanes(part);
        for (int j = 0; j < LANES && first + j < count; j++) {
            const int s = (first + j) / n_inputs, r = (first + j) % n_inputs;
            float sum = sums[j];
            for (int64_t k = k_vec; k < k_len; k++) sum += x[r * k_len + k] * w[row[s] * k_len + k];
            /* accumulate: the residual add of wo and w2 (x += x_in @ w^T), the same fp32 sum x.add_ makes */
            out[r * n_len + row[s]] = accumulate ? out[r * n_len + row[s]] + sum : sum;
        }
    }
}

#define DOT_ROWS(n_rows, n_inputs) dot_rows(x_tile, w, out_tile, k_len, n_len, row, n_rows, n_inputs, accumulate)

/* Every input row against weight rows row[0..n_rows-1] (n_rows is WEIGHT_STREAMS or 1), a tile at a time. */
static void dot_all_inputs(const float *x, const float *w, float *out, int64_t n_inputs, int64_t k_len,
                           int64_t n_len, const int64_t *row, int n_rows, int accumulate) {
    for (int64_t first = 0; first < n_inputs; first += TILE) {
        const float *x_tile = x + first * k_len;
        float *out_tile = out + first * n_len;
        int64_t tile = n_inputs - first < TILE ? n_inputs - first : TILE;
        if (n_rows == WEIGHT_STREAMS) {
            switch (tile) {
            case 1: DOT_ROWS(WEIGHT_STREAMS, 1); break;
            case 2: DOT_ROWS(WEIGHT_STREAMS, 2); break;
            case 3: DOT_ROWS(WEIGHT_STREAMS, 3); break;
            default: DOT_ROWS(WEIGHT_STREAMS, TILE); break;
            }
        } else {
            switch (tile) {
            case 1: DOT_ROWS(1, 1); break;
            case 2: DOT_ROWS(1, 2); break;
            case 3: DOT_ROWS(1, 3); break;
            default: DOT_ROWS(1, TILE); break;
            }
        }
    }
}

/* One thread's share of out = x @ w^T (out += x @ w^T with accumulate), called inside a parallel
 * region: x [n_inputs, k_len], w [n_len, k_len], out [n_inputs, n_len], all contiguous. Each thread
 * takes an equal range of weight rows; the rows a range leaves after its WEIGHT_STREAMS equal segments go one
 * by one. */
static void gemv_share(const float *x, const float *w, float *out, int64_t n_inputs, int64_t k_len, int64_t n_len,
                       int accumulate) {
    const int thread = omp_get_thread_num(), n_threads = omp_get_num_threads();
    const int64_t first = n_len * thread / n_threads, end = n_len * (thread + 1) / n_threads;
    const int64_t segment = (end - first) / WEIGHT_STREAMS;
    int64_t row[WEIGHT_STREAMS];
    for (int64_t i = 0; i < segment; i++) {
        for (int s = 0; s < WEIGHT_STREAMS; s++) row[s] = first + s * segment + i;
        dot_all_inputs(x, w, out, n_inputs, k_len, n_len, row, WEIGHT_STREAMS, accumulate);
    }
    for (int64_t r = first + segment * WEIGHT_STREAMS; r < end; r++) {
        row[0] = r;
        dot_all_inputs(x, w, out, n_inputs, k_len, n_len, row, 1, accumulate);
    }
}

/* out = x @ w^T on `threads` threads: x [n_inputs, k_len], w [n_len, k_len], out [n_inputs, n_len]. */
void gemv(const float *x, const float *w, float *out, int64_t n_inputs, int64_t k_len, int64_t n_len, int threads) {
#pragma omp parallel num_threads(threads)
    gemv_share(x, w, out, n_inputs, k_len, n_len, 0);
}

/* out[r] = x[r] * weight / sqrt(mean(x[r]^2) + eps) for rows r < n_inputs of width k_len, on one thread:
 * the block's two norms (inside its calls below) and the final norm before the output head. Through
 * torch (F.rms_norm, a composite of seven operators on a CPU) each of a step's norms runs cold after a
 * weight read, in several operators where this is one loop. */
void rms_norm_rows(const float *x, const float *weight, float eps, float *out, int64_t n_inputs, int64_t k_len) {
    for (int64_t r = 0; r < n_inputs; r++) {
        const float *row = x + r * k_len;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t k = 0; k < k_len; k++) squares += row[k] * row[k];
        const float scale = 1.0f / sqrtf(squares / (float)k_len + eps);
#pragma omp simd
        for (int64_t k = 0; k < k_len; k++) out[r * k_len + k] = row[k] * scale * weight[k];
    }
}

/* RoPE in place on one head of `dim` floats: h = h * cos + swap_halves(h) * sin
 * (harness.model.decoder.RotaryTable's rotate-half form, the pair's sign folded into sin). */
static void rope_head(float *head, const float *cos, const float *sin, int64_t dim) {
    const int64_t half = dim / 2;
    float original[dim];
    for (int64_t i = 0; i < dim; i++) original[i] = head[i];
#pragma omp simd
    for (int64_t i = 0; i < half; i++) head[i] = original[i] * cos[i] + original[i + half] * sin[i];
#pragma omp simd
    for (int64_t i = half; i < dim; i++) head[i] = original[i] * cos[i] + original[i - half] * sin[i];
}

/* The two halves of a decoder block for a decode step's few rows (harness.model.cpu_gemv.GemvBlock),
 * each one call and one parallel region: between a layer's weight reads nothing returns to Python, so
 * no operator runs cold after a read and no call pays the interpreter. Threads
 * share each product's weight rows (gemv_share); the norm runs on one thread, RoPE and the activation
 * on all; a barrier separates each stage from the next.
 *
 * attention_input: qkv [batch, tokens, heads, dim] = rms_norm(x) @ wqkv^T, then RoPE in place on its
 * first rotated_heads heads (queries, then keys; the values after them stay as projected). cos and sin
 * point at the table rows of the tokens' first position; normed is scratch [rows, d_model]. */
void attention_input(const float *x, const float *norm_weight, float eps, const float *wqkv, const float *cos,
                     const float *sin, float *normed, float *qkv, int64_t batch, int64_t tokens, int64_t d_model,
                     int64_t heads, int64_t rotated_heads, int64_t dim, int threads) {
    const int64_t rows = batch * tokens;
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
        rms_norm_rows(x, norm_weight, eps, normed, rows, d_model); /* its implicit barrier publishes normed */
        gemv_share(normed, wqkv, qkv, rows, d_model, heads * dim, 0);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * rotated_heads; i++) {
            const int64_t row = i / rotated_heads, token = row % tokens;
            rope_head(qkv + row * heads * dim + (i % rotated_heads) * dim, cos + token * dim, sin + token * dim, dim);
        }
    }
}

/* attention_output_and_ffn: the rest of the block, in place on the residual stream x [rows, d_model]:
 * x += attention @ wo^T; x += (silu(gate) * up) @ w2^T with gate, up = rms_norm(x) @ w13^T (w13 stacks
 * the gate's rows, then the up projection's). normed [rows, d_model], gate_up [rows, 2 ffn] and hidden
 * [rows, ffn] are scratch. */
void attention_output_and_ffn(const float *attention, const float *wo, float *x, const float *norm_weight, float eps,
                              const float *w13, const float *w2, float *normed, float *gate_up, float *hidden,
                              int64_t rows, int64_t d_model, int64_t attention_width, int64_t ffn, int threads) {
#pragma omp parallel num_threads(threads)
    {
        gemv_share(attention, wo, x, rows, attention_width, d_model, 1);
#pragma omp barrier
#pragma omp single
        rms_norm_rows(x, norm_weight, eps, normed, rows, d_model);
        gemv_share(normed, w13, gate_up, rows, d_model, 2 * ffn, 0);
#pragma omp barrier
        /* Fixed blocks of ACTIVATION_BLOCK values, whichever thread takes one: the vectorised expf and its
         * scalar edges then meet the same values at any thread count, so the result does not depend on it. */
        const int64_t blocks_per_row = (ffn + ACTIVATION_BLOCK - 1) / ACTIVATION_BLOCK;
#pragma omp for schedule(static)
        for (int64_t block = 0; block < rows * blocks_per_row; block++) {
            const int64_t r = block / blocks_per_row, first = block % blocks_per_row * ACTIVATION_BLOCK;
            const int64_t end = first + ACTIVATION_BLOCK < ffn ? first + ACTIVATION_BLOCK : ffn;
            const float *gate = gate_up + r * 2 * ffn, *up = gate + ffn;
#pragma omp simd
            for (int64_t i = first; i < end; i++) hidden[r * ffn + i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        }
        gemv_share(hidden, w2, x, rows, ffn, d_model, 1);
    }
}
