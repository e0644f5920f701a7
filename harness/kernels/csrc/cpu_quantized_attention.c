/* Decode attention over a quantized KV cache on a CPU (int8, int4, fp8 e4m3), fp32 compute, GQA.
 *
 * A C++ translation unit of the kernels' extension (harness/kernels/extension.py), the operators
 * harness_kernels::quantized_decode_attention and quantize_rows_ (ops.cpp); used by `quantized`
 * (strategies/caches/quantized.py) for its decode steps on a CPU in fp32.
 *
 * Why dequantize in the kernel: a quantized cache is worth having because a step reads 1 (int8, fp8)
 * or 0.5 (int4) bytes per cached element instead of 4. Dequantizing the prefix into an fp32 copy first
 * (the torch backend) reads the quantized bytes, then writes and reads 4 bytes per element: more
 * traffic than the fp32 cache it replaces. Here the codes are decoded in registers and used at once.
 *
 * Structure as cpu_decode_attention.c: one task per (sequence, KV head) over torch's OpenMP threads; per
 * task, blocks of keys with an online softmax so each row is read once. Two segments per task: the
 * quantized prefix, then the residual window's fp32 rows read in place. Reading 4-8x fewer bytes than
 * cpu_decode_attention.c, the kernel is bound by instructions as much as by DRAM, so its vector path
 * (AVX-512, else AVX2; head widths of multiples of 32) does the least per code it can (see "The vector
 * path" below): no dequantized tile, scales applied to the dot products and folded into the softmax
 * weights, int4 decoded by a permute from a 16-entry table, tiles of rows x heads whose sums share one
 * transposing reduction, its own vector exp, prefetch spread over the rows
 * (tests/benchmarks/test_quantized_targets.py times it against cpu_decode_attention.c's on the same
 * tokens). It computes with vector.h's vector type and operations, and the x86 intrinsics at that
 * width for the codes' conversions, which GCC's vector extensions do not express: AVX-512 (F, BW, VL),
 * or AVX2 with F16C and FMA (VECTOR_INTRINSICS), else the generic path runs. Other head widths and
 * int4 groups take the generic path: each block of tokens dequantized into a tile, then the fp32
 * kernels' block routines over it (attention_blocks.h). quantize_rows (at the end) is the write side:
 * a step's new rows quantized as strategies/caches/quantization.py does, bit for bit.
 *
 * Layout (strategies/caches/quantization.py): payload rows of one (sequence, head) at a byte stride; int8 and
 * fp8 one byte per channel; int4 channel 2i in the low nibble of byte i and 2i + 1 in the high one,
 * stored as code + 8. Token-axis scales: D / span fp32 per token (span = D but for int4's groups).
 * Channel-axis key scales (KIVI): D fp32 per block of key_block tokens.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_blocks.h" /* SOFTMAX_BLOCK, the online softmax and the fp32 block routines */
#include "kernels.h"          /* MAX_GROUP, MAX_DIM, the FORMAT_* codes */
#include "vector.h"           /* LANES, vec and its operations, VECTOR_INTRINSICS, sum_lanes, exp_nonpositive */

#define TILE_ROWS 32               /* tokens per block of the generic path: a dequantized tile (x D floats) stays in L1 */
#define QUANTIZED_PREFETCH_ROWS 64 /* rows prefetched ahead, K and V (16 leaves a block's short compute waiting on DRAM) */


/* e4m3fn by code: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0, exponent 0 subnormal
 * (m x 2^-9). 0x7f/0xff are NaN in e4m3fn: quantization clamps to +-448 and never writes them, and
 * -ffast-math assumes no NaN, so they decode as the bit pattern's 480. Built when the library loads. */
static float fp8_e4m3_values[256];

__attribute__((constructor)) static void build_fp8_e4m3_values(void) {
    for (int code = 0; code < 256; code++) {
        int exponent = (code >> 3) & 15, mantissa = code & 7;
        float magnitude = exponent == 0 ? ldexpf((float)mantissa, -9) : ldexpf(1.0f + mantissa / 8.0f, exponent - 7);
        fp8_e4m3_values[code] = (code & 128) ? -magnitude : magnitude;
    }
}

typedef struct { /* one quantized table (K or V) of one (sequence, KV head) */
    const uint8_t *payload; /* row of token t at payload + t * row */
    int64_t row;            /* bytes between tokens */
    const float *scales;    /* token axis: token t's at scales + t * scale_row; channel axis: block t / key_block's */
    int64_t scale_row;      /* floats between scale rows */
} QuantizedRows;

typedef struct { /* one (sequence, KV head): its quantized tables and its window */
    QuantizedRows keys, values;
    const float *k_window, *v_window; /* [R, D] fp32 rows at window_row floats apart; NULL without a window */
    int64_t length;                   /* its quantized tokens (the call's quantized_length, or its fill) */
    float *logits;                    /* [G, logit_row] its quantized keys' scaled scores; NULL: not kept */
    int64_t logit_row;
    float *row_max, *row_sum;         /* [G] its rows' softmax max and sum of weights; NULL: not kept */
} Task;

typedef struct { /* what every (sequence, KV head) of one call shares */
    int format;                                  /* FORMAT_* */
    int64_t span;                                /* channels per token-axis scale */
    int64_t key_block;                           /* tokens per channel-axis key scale; 0: keys scaled per token */
    int64_t window_length;                       /* tokens in the window, after each pair's quantized ones */
    int64_t window_row;                          /* floats between window rows */
    int64_t group, dim;                          /* query heads per KV head, head dimension */
    float scale;                                 /* softmax scale, 1 / sqrt(D) */
} Call;

/* The task's rows' softmax max and sum, where it keeps them. */
static inline void keep_rows(const Task *task, const float *running_max, const float *running_sum, int64_t group) {
    if (task->row_max == NULL) return;
    for (int64_t g = 0; g < group; g++) task->row_max[g] = running_max[g], task->row_sum[g] = running_sum[g];
}

/* out[d] = x_hat[d] of one row, any dim and span: scales[d / span] (channel axis: span 1). */
static void dequantize_row_generic(int format, const uint8_t *codes, const float *scales, int64_t dim,
                                   int64_t span, float *out) {
    for (int64_t d = 0; d < dim; d++) {
        float code = format == FORMAT_INT8   ? (float)((const int8_t *)codes)[d]
                     : format == FORMAT_INT4 ? (float)((int)((codes[d / 2] >> (4 * (d & 1))) & 15) - 8)
                                             : fp8_e4m3_values[codes[d]];
        out[d] = scales[d / span] * code;
    }
}

/* tile[j * dim + d] = x_hat of token start + j, j < n (the generic path). */
static void dequantize_block(int format, QuantizedRows rows, int64_t start, int64_t n, int64_t dim, int64_t span,
                             int64_t key_block, float *tile) {
    for (int64_t j = 0; j < n; j++) {
        int64_t t = start + j;
        const float *scales = rows.scales + (key_block ? t / key_block : t) * rows.scale_row;
        dequantize_row_generic(format, rows.payload + t * rows.row, scales, dim, key_block ? 1 : span, tile + j * dim);
    }
}

/* Prefetch the payload and scales of rows t .. t + n - 1: one range per stream, since a (sequence,
 * head)'s rows are consecutive (a prefetch past a table's end is a hint that never faults). */
static void prefetch_rows(QuantizedRows rows, int64_t t, int64_t n, int64_t key_block) {
    const uint8_t *payload = rows.payload + t * rows.row;
    for (int64_t offset = 0; offset < n * rows.row; offset += 64) __builtin_prefetch(payload + offset);
    if (key_block) return; /* channel scales: one row of D floats per key_block tokens, reused */
    const uint8_t *scales = (const uint8_t *)(rows.scales + t * rows.scale_row);
    for (int64_t offset = 0; offset < n * rows.scale_row * 4; offset += 64) __builtin_prefetch(scales + offset);
}

#if VECTOR_INTRINSICS
/* ---- The vector path (head_dim a multiple of 32; int4: groups too): no dequantized tile. ----
 *
 * A chunk is CH = 2 * LANES channels of a row decoded into two vectors in registers and used at once
 * by every query head. Keys: the dot product runs on the codes and the row's scale is applied to the
 * sum (score = scale * s_k * (q . code)); int4 decodes through a 16-entry table of its scaled values
 * (one permute per vector: the table is the row's scale times -8..7, built once per chunk). Values:
 * acc += (p * s_v) * code, the probability and the scale folded into one broadcast per row and head.
 * int4's nibbles are not interleaved back into channel order: the low nibbles of a chunk's bytes are
 * its even channels and the high ones its odd channels, so the query (and the value accumulators) are
 * kept in that order instead and put back once per task. Dot products: R = LANES / H rows times H
 * heads, LANES accumulators whose sums are formed together by a transposing reduction (~3
 * instructions per score instead of ~6 for each horizontal sum). */
#define CH (2 * LANES)
#define SROW (SOFTMAX_BLOCK + LANES) /* a score row: a partial tile's lanes past the block land in the margin */
enum { FORMAT_F32 = 3 };     /* the residual window's rows, through the same tiles */

/* Codes to vectors: int8 sign-extended; fp8 e4m3's 7 magnitude bits put under an fp16 exponent (bits
 * 13..7) with the sign at bit 15 are, as fp16, the e4m3 value / 2^8, subnormals included, which F16C
 * converts exactly (the 2^8 applied with the scale); int4 through int4_table. */
#if LANES == 16
static inline vec from_int8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vec from_fp8(const uint8_t *p) {
    __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16((short)0xBF80)));
}
static inline vec int4_table(float s) { /* lane i: s * (i - 8), rounded once as x_hat = code * scale */
    return _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7) * splat(s);
}
static inline void from_int4(const uint8_t *p, vec table, vec x[2]) { /* 16 bytes: 32 channels */
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    x[0] = _mm512_permutexvar_ps(bytes, table); /* the index's low 4 bits: the low nibble */
    x[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
/* dst[h * stride + r] = lane h * R + r, R = 16 / H (H = 3: R = 5, lane 15 unused). */
static inline void store_tile(int heads, vec v, float *dst, int64_t stride) {
    if (heads == 1) {
        store_vec(dst, v);
    } else if (heads == 3) {
        float lanes[LANES];
        store_vec(lanes, v);
        for (int h = 0; h < 3; h++) memcpy(dst + h * stride, lanes + 5 * h, 5 * sizeof(float));
    } else if (heads == 2) {
        _mm256_storeu_ps(dst, _mm512_castps512_ps256(v));
        _mm256_storeu_ps(dst + stride, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    } else {
        _mm_storeu_ps(dst, _mm512_castps512_ps128(v));
        _mm_storeu_ps(dst + stride, _mm512_extractf32x4_ps(v, 1));
        _mm_storeu_ps(dst + 2 * stride, _mm512_extractf32x4_ps(v, 2));
        _mm_storeu_ps(dst + 3 * stride, _mm512_extractf32x4_ps(v, 3));
    }
}
#else
static inline vec from_int8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vec from_fp8(const uint8_t *p) {
    __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16((short)0xBF80)));
}
static inline vec int4_table(float s) { return splat(s); } /* AVX2: the scale, applied after converting */
static inline void from_int4(const uint8_t *p, vec scale, vec x[2]) { /* 8 bytes: 16 channels */
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), bias = _mm256_set1_epi32(8);
    __m256i low = _mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), bias);
    x[0] = _mm256_cvtepi32_ps(low) * scale;
    x[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), bias)) * scale;
}
static inline void store_tile(int heads, vec v, float *dst, int64_t stride) {
    __m128 low = _mm256_castps256_ps128(v), high = _mm256_extractf128_ps(v, 1);
    if (heads == 1) {
        store_vec(dst, v);
    } else if (heads == 2) {
        _mm_storeu_ps(dst, low);
        _mm_storeu_ps(dst + stride, high);
    } else {
        _mm_storel_pi((__m64 *)dst, low);
        _mm_storeh_pi((__m64 *)(dst + stride), low);
        _mm_storel_pi((__m64 *)(dst + 2 * stride), high);
        _mm_storeh_pi((__m64 *)(dst + 3 * stride), high);
    }
}
#endif
#define MAX_ACCUMULATORS (VECTOR_REGISTERS / 2) /* value accumulators held in registers */
/* Key tiles of 3 query heads x 5 rows (GQA groups of 3, 9, ...: SmolLM2's 9 heads over 3): each row
 * decoded once for the group instead of once per head. At 16 lanes only: at 8 a tile of 3 heads would
 * hold 2 rows. */
#define THREE_HEAD_TILES (LANES == 16)

/* The chunk of channels c0 .. c0 + CH - 1 of one row as two vectors (int4: its even channels, then its
 * odd ones; `table` from int4_table). int8 and fp8 unscaled (fp8: the value / 256); f32: a window row. */
static inline __attribute__((always_inline)) void decode(int format, const uint8_t *row, int64_t c0, vec table,
                                                         vec x[2]) {
    if (format == FORMAT_INT4) {
        from_int4(row + c0 / 2, table, x);
    } else if (format == FORMAT_F32) {
        x[0] = load_vec((const float *)row + c0), x[1] = load_vec((const float *)row + c0 + LANES);
    } else {
        for (int i = 0; i < 2; i++)
            x[i] = format == FORMAT_INT8 ? from_int8(row + c0 + LANES * i) : from_fp8(row + c0 + LANES * i);
    }
}

typedef struct { /* rows of one segment (a quantized table's, or the window's) as the tiles read them */
    const uint8_t *payload;
    int64_t row;          /* bytes between rows */
    const float *scales;  /* int4 on the token axis: a row's group scales (the tables scale the codes) */
    int64_t scale_row;    /* floats between token scale rows (0: none to prefetch) */
    int64_t span;         /* channels per int4 scale */
} Rows;

/* Prefetch rows t + QUANTIZED_PREFETCH_ROWS .. t + QUANTIZED_PREFETCH_ROWS + n - 1 (payload and token scales), a few lines at a time
 * as the rows before them are computed on. */
static inline __attribute__((always_inline)) void prefetch_ahead(Rows rows, int64_t t, int64_t n) {
    const uint8_t *payload = rows.payload + (t + QUANTIZED_PREFETCH_ROWS) * rows.row;
    for (int64_t offset = 0; offset < n * rows.row; offset += 64) __builtin_prefetch(payload + offset);
    if (rows.scale_row) {
        const uint8_t *scales = (const uint8_t *)(rows.scales + (t + QUANTIZED_PREFETCH_ROWS) * rows.scale_row);
        for (int64_t offset = 0; offset < n * rows.scale_row * 4; offset += 64) __builtin_prefetch(scales + offset);
    }
}

/* scores[h][r] = q[h] . x_(first + r) for rows first .. first + n - 1 (n <= LANES / heads, rounded
 * down) and the `heads` query rows of q (stride dim). Rows past n repeat the last one (their lanes are
 * not read); with 3 heads the 16th accumulator stays 0. */
static inline __attribute__((always_inline)) void dot_tile(int format, int heads, int scaled, Rows rows,
                                                           int64_t first, int64_t n, const float *q,
                                                           int64_t dim, int prefetch, float *scores) {
    enum { MAX_HEADS = 4 };
    const int R = LANES / heads;
    const uint8_t *payload = rows.payload + first * rows.row;
    const float *scales = rows.scales + first * rows.scale_row;
    if (prefetch) prefetch_ahead(rows, first, R);
    vec acc[LANES];
#pragma GCC unroll 16
    for (int a = 0; a < LANES; a++) acc[a] = (vec){0};
    for (int64_t c0 = 0, group = 0, group_end = rows.span; c0 < dim; c0 += CH) {
        vec q0[MAX_HEADS], q1[MAX_HEADS];
#pragma GCC unroll 4
        for (int h = 0; h < heads; h++) q0[h] = load_vec(q + h * dim + c0), q1[h] = load_vec(q + h * dim + c0 + LANES);
        if (format == FORMAT_INT4 && scaled && c0 == group_end) group++, group_end += rows.span;
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            int64_t at = r < n ? r : n - 1; /* past n: the last row again */
            vec x[2], table = (vec){0};
            if (format == FORMAT_INT4) table = int4_table(scaled ? scales[at * rows.scale_row + group] : 1.0f);
            decode(format, payload + at * rows.row, c0, table, x);
#pragma GCC unroll 4
            for (int h = 0; h < heads; h++) acc[h * R + r] = fma_vec(x[1], q1[h], fma_vec(x[0], q0[h], acc[h * R + r]));
        }
    }
    store_tile(heads, sum_lanes(acc), scores, SROW);
}

/* scores[g][j] = q[g] . x_(first + j), j < n, g < group: tiles of `heads` query rows. */
static inline __attribute__((always_inline)) void dot_rows(int format, int heads, int scaled, Rows rows,
                                                           int64_t first, int64_t n, const float *q,
                                                           int64_t group, int64_t dim, float scores[][SROW]) {
    const int R = LANES / heads;
    for (int64_t g = 0; g < group; g += heads) {
        int prefetch = g == 0 && format != FORMAT_F32;
        int64_t j = 0;
        for (; j + R <= n; j += R) dot_tile(format, heads, scaled, rows, first + j, R, q + g * dim, dim, prefetch, &scores[g][j]);
        if (j < n) dot_tile(format, heads, scaled, rows, first + j, n - j, q + g * dim, dim, prefetch, &scores[g][j]);
    }
}

static void scores_block(int format, int scaled, Rows rows, int64_t first, int64_t n, const float *q,
                         int64_t group, int64_t dim, float scores[][SROW]) {
#define DOT(FORMAT, SCALED)                                                                         \
    do {                                                                                            \
        if (group % 4 == 0) dot_rows(FORMAT, 4, SCALED, rows, first, n, q, group, dim, scores);     \
        else if (group % 2 == 0) dot_rows(FORMAT, 2, SCALED, rows, first, n, q, group, dim, scores); \
        else if (THREE_HEAD_TILES && group % 3 == 0)                                                \
            dot_rows(FORMAT, 3, SCALED, rows, first, n, q, group, dim, scores);                     \
        else dot_rows(FORMAT, 1, SCALED, rows, first, n, q, group, dim, scores);                    \
    } while (0)
    if (format == FORMAT_INT8) DOT(FORMAT_INT8, 0);
    else if (format == FORMAT_FP8_E4M3) DOT(FORMAT_FP8_E4M3, 0);
    else if (format == FORMAT_F32) DOT(FORMAT_F32, 0);
    else if (scaled) DOT(FORMAT_INT4, 1);
    else DOT(FORMAT_INT4, 0);
#undef DOT
}

/* acc[h][c0 ..] += sum_j p[h][j] * x_(first + j) over chunks c0 .. c0 + CH * chunks of `heads` heads,
 * held in registers over the n rows. */
static inline __attribute__((always_inline)) void values_slice(int format, int heads, int chunks, Rows rows,
                                                               int64_t first, int64_t n, int64_t c0, int prefetch,
                                                               float p[][SROW], float acc[][MAX_DIM]) {
    vec sum[MAX_ACCUMULATORS];
    int64_t group[4]; /* int4: each chunk's scale */
    for (int c = 0; c < chunks; c++) group[c] = format == FORMAT_INT4 ? (c0 + CH * c) / rows.span : 0;
#pragma GCC unroll 16
    for (int h = 0; h < heads; h++)
#pragma GCC unroll 16
        for (int i = 0; i < 2 * chunks; i++) sum[h * 2 * chunks + i] = load_vec(&acc[h][c0 + LANES * i]);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = rows.payload + (first + j) * rows.row;
        if (prefetch && j % 4 == 0) prefetch_ahead(rows, first + j, 4);
        vec x[2 * 4];
#pragma GCC unroll 4
        for (int c = 0; c < chunks; c++) {
            vec table = format == FORMAT_INT4 ? int4_table(rows.scales[(first + j) * rows.scale_row + group[c]])
                                                 : (vec){0};
            decode(format, row, c0 + CH * c, table, &x[2 * c]);
        }
#pragma GCC unroll 16
        for (int h = 0; h < heads; h++) {
            vec weight = splat(p[h][j]);
#pragma GCC unroll 16
            for (int i = 0; i < 2 * chunks; i++) sum[h * 2 * chunks + i] = fma_vec(weight, x[i], sum[h * 2 * chunks + i]);
        }
    }
#pragma GCC unroll 16
    for (int h = 0; h < heads; h++)
#pragma GCC unroll 16
        for (int i = 0; i < 2 * chunks; i++) store_vec(&acc[h][c0 + LANES * i], sum[h * 2 * chunks + i]);
}

/* `heads` heads from g0 over all channels: slices of `chunks` chunks. */
static inline __attribute__((always_inline)) void values_heads(int format, int heads, int chunks, Rows rows,
                                                               int64_t first, int64_t n, int64_t dim,
                                                               float p[][SROW], float acc[][MAX_DIM],
                                                               float top[][MAX_DIM]) {
    for (int64_t c0 = 0; c0 < dim; c0 += CH * chunks)
        values_slice(format, heads, chunks, rows, first, n, c0, c0 == 0 && acc == top && format != FORMAT_F32, p, acc);
}

/* acc[g][:] += sum_j p[g][j] * x_(first + j), j < n: heads in groups of a power of two or 3, chunks per slice
 * as many as the accumulators allow and the head width divides into. */
static void values_block(int format, Rows rows, int64_t first, int64_t n, int64_t group, int64_t dim,
                         float p[][SROW], float acc[][MAX_DIM]) {
    int64_t chunks_in_row = dim / CH;
#define SLICES(FORMAT, HEADS)                                                                          \
    do {                                                                                               \
        enum { MOST = MAX_ACCUMULATORS / (2 * HEADS) > 4 ? 4 : MAX_ACCUMULATORS / (2 * HEADS) };       \
        for (int64_t g = 0; g < group; g += HEADS) {                                                   \
            if (MOST >= 4 && chunks_in_row % 4 == 0)                                                   \
                values_heads(FORMAT, HEADS, MOST >= 4 ? 4 : 1, rows, first, n, dim, p + g, acc + g, acc);   \
            else if (MOST >= 2 && chunks_in_row % 2 == 0)                                              \
                values_heads(FORMAT, HEADS, MOST >= 2 ? 2 : 1, rows, first, n, dim, p + g, acc + g, acc);   \
            else                                                                                       \
                values_heads(FORMAT, HEADS, 1, rows, first, n, dim, p + g, acc + g, acc);                   \
        }                                                                                              \
    } while (0)
#define HEADS_OF(FORMAT)                                                                               \
    do {                                                                                               \
        if (MAX_ACCUMULATORS >= 16 && group % 8 == 0) SLICES(FORMAT, (MAX_ACCUMULATORS >= 16 ? 8 : 4)); \
        else if (group % 4 == 0) SLICES(FORMAT, 4);                                                    \
        else if (group % 2 == 0) SLICES(FORMAT, 2);                                                    \
        else if (group % 3 == 0) SLICES(FORMAT, 3);                                                    \
        else SLICES(FORMAT, 1);                                                                        \
    } while (0)
    if (format == FORMAT_INT8) HEADS_OF(FORMAT_INT8);
    else if (format == FORMAT_INT4) HEADS_OF(FORMAT_INT4);
    else if (format == FORMAT_FP8_E4M3) HEADS_OF(FORMAT_FP8_E4M3);
    else HEADS_OF(FORMAT_F32);
#undef HEADS_OF
#undef SLICES
}

/* Online softmax over one block: scores[g][j] * score_scale[j] -> p = exp(. - running max), the sums and
 * the accumulators rescaled where the max rose; then p[g][j] *= value_scale[j] (the value rows' scales).
 * Whole vectors: lanes past n (the rows' margin) are computed and left out of the max and the sum. The
 * scaled scores are also kept at logits[g * logit_row + j] where logits is given (NULL: not). */
static void softmax_block(float scores[][SROW], int64_t n, int64_t group, int64_t dim, const float *score_scale,
                          const float *value_scale, float *running_max, float *running_sum, float acc[][MAX_DIM],
                          float *logits, int64_t logit_row) {
    int64_t tail = n - (n - 1) / LANES * LANES; /* valid lanes of the last vector, 1..LANES */
    for (int64_t g = 0; g < group; g++) {
        float *s = scores[g];
        vec most = splat(running_max[g]);
        for (int64_t j = 0; j < n; j += LANES) {
            vec v = load_vec(s + j) * load_vec(score_scale + j);
            store_vec(s + j, v);
            most = max_vec(most, j + LANES <= n ? v : keep_lanes(v, tail, splat(-FLT_MAX)));
        }
        if (logits != NULL) memcpy(logits + g * logit_row, s, sizeof(float) * n);
        float block_max = max_of_lanes(most);
        if (block_max > running_max[g]) {
            float correction = expf(running_max[g] - block_max);
            running_max[g] = block_max;
            running_sum[g] *= correction;
            for (int64_t d = 0; d < dim; d++) acc[g][d] *= correction;
        }
        vec sum = (vec){0}, top = splat(block_max);
        for (int64_t j = 0; j < n; j += LANES) {
            vec e = exp_nonpositive(load_vec(s + j) - top);
            sum = sum + (j + LANES <= n ? e : keep_lanes(e, tail, (vec){0}));
            store_vec(s + j, e * load_vec(value_scale + j));
        }
        running_sum[g] += sum_of_lanes(sum);
    }
}

/* Channel order within each chunk of the int4 path: position i of a chunk holds channel 2i (i < LANES),
 * else 2(i - LANES) + 1. */
static inline int64_t chunk_channel(int64_t position) {
    int64_t base = position - position % CH, i = position % CH;
    return base + (i < LANES ? 2 * i : 2 * (i - LANES) + 1);
}

/* attend_one (below) on the vector path. */
static void attend_vector(const float *q, const Task *task, const Call *call, float *out) {
    const int format = call->format;
    const int64_t group = call->group, dim = call->dim, key_block = call->key_block, span = call->span;
    const float scale = call->scale;
    const QuantizedRows keys = task->keys, values = task->values;
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], scores[MAX_GROUP][SROW], acc[MAX_GROUP][MAX_DIM];
    float query[MAX_GROUP * MAX_DIM]; /* q in chunk order (int4) and scaled per channel (channel axis) */
    float score_scale[SROW] = {0}, value_scale[SROW] = {0}; /* the margin: read by whole vectors, unused */
    int permuted = format == FORMAT_INT4, scaled = !key_block; /* int4: tables scaled by token scales */
    float factor = format == FORMAT_FP8_E4M3 ? 256.0f : 1.0f;
    start_rows(running_max, running_sum, acc, group, dim);
    const float *key_query = q;
    if (permuted && !key_block) {
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < dim; d++) query[g * dim + d] = q[g * dim + chunk_channel(d)];
        key_query = query;
    }
    Rows key_rows = {keys.payload, keys.row, keys.scales, key_block ? 0 : keys.scale_row, span};
    Rows value_rows = {values.payload, values.row, values.scales, values.scale_row, span};
    for (int64_t start = 0; start < task->length; start += SOFTMAX_BLOCK) {
        int64_t n = task->length - start < SOFTMAX_BLOCK ? task->length - start : SOFTMAX_BLOCK;
        if (key_block) { /* runs of rows within one scale block: q scaled by its channels' scales */
            for (int64_t j = 0; j < n;) {
                int64_t t = start + j, block = t / key_block, run = (block + 1) * key_block - t;
                run = run < n - j ? run : n - j;
                const float *channel_scales = keys.scales + block * keys.scale_row;
                for (int64_t g = 0; g < group; g++)
                    for (int64_t d = 0; d < dim; d++) {
                        int64_t c = permuted ? chunk_channel(d) : d;
                        query[g * dim + d] = q[g * dim + c] * channel_scales[c] * factor * scale;
                    }
                float (*at)[SROW] = (float (*)[SROW]) & scores[0][j];
                scores_block(format, 0, key_rows, t, run, query, group, dim, at);
                j += run;
            }
            for (int64_t j = 0; j < n; j++) score_scale[j] = 1.0f;
        } else {
            scores_block(format, scaled, key_rows, start, n, key_query, group, dim, scores);
            for (int64_t j = 0; j < n; j++)
                score_scale[j] = permuted ? scale : keys.scales[(start + j) * keys.scale_row] * factor * scale;
        }
        for (int64_t j = 0; j < n; j++)
            value_scale[j] = permuted ? 1.0f : values.scales[(start + j) * values.scale_row] * factor;
        softmax_block(scores, n, group, dim, score_scale, value_scale, running_max, running_sum, acc,
                      task->logits ? task->logits + start : NULL, task->logit_row);
        values_block(format, value_rows, start, n, group, dim, scores, acc);
    }
    if (permuted) { /* the accumulators back in channel order */
        float row[MAX_DIM];
        for (int64_t g = 0; g < group; g++) {
            for (int64_t d = 0; d < dim; d++) row[chunk_channel(d)] = acc[g][d];
            memcpy(acc[g], row, sizeof(float) * dim);
        }
    }
    Rows k_rows = {(const uint8_t *)task->k_window, call->window_row * 4, NULL, 0, 1};
    Rows v_rows = {(const uint8_t *)task->v_window, call->window_row * 4, NULL, 0, 1};
    for (int64_t j = 0; j < SROW; j++) score_scale[j] = scale, value_scale[j] = 1.0f;
    for (int64_t start = 0; start < call->window_length; start += SOFTMAX_BLOCK) {
        int64_t n = call->window_length - start < SOFTMAX_BLOCK ? call->window_length - start : SOFTMAX_BLOCK;
        scores_block(FORMAT_F32, 0, k_rows, start, n, q, group, dim, scores);
        softmax_block(scores, n, group, dim, score_scale, value_scale, running_max, running_sum, acc, NULL, 0);
        values_block(FORMAT_F32, v_rows, start, n, group, dim, scores, acc);
    }
    keep_rows(task, running_max, running_sum, group);
    finish_rows(running_sum, acc, group, dim, out);
}
#endif

/* p[g][j] = the weight of fp32 key row j (first + j * stride: a dequantized tile's, or the window's) for
 * query g, j < n: the G scores of each row (kept at logits[g * logit_row + j] where logits is given),
 * then their online softmax, the accumulators rescaled (attention_blocks.h). */
static void weigh_rows(const float *q, const float *first, int64_t stride, int64_t n, const Call *call,
                       float p[][SOFTMAX_BLOCK], float *running_max, float *running_sum, float acc[][MAX_DIM],
                       float *logits, int64_t logit_row) {
    for (int64_t j = 0; j < n; j++) key_scores(q, first + j * stride, call->group, call->dim, call->scale, p, j);
    if (logits != NULL)
        for (int64_t g = 0; g < call->group; g++) memcpy(logits + g * logit_row, p[g], sizeof(float) * n);
    softmax_rows(p, n, call->group, call->dim, running_max, running_sum, acc, NULL);
}

/* attend_one (below) on the generic path: each block of TILE_ROWS tokens dequantized into a tile (its K,
 * weighed; then its V, accumulated), then the window's fp32 rows read in place. */
static void attend_tiles(const float *q, const Task *task, const Call *call, float *out) {
    const int64_t group = call->group, dim = call->dim, window_row = call->window_row;
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], p[MAX_GROUP][SOFTMAX_BLOCK], acc[MAX_GROUP][MAX_DIM];
    float tile[TILE_ROWS * MAX_DIM]; /* one block of K, then of V, dequantized */
    start_rows(running_max, running_sum, acc, group, dim);
    for (int64_t start = 0; start < task->length; start += TILE_ROWS) {
        int64_t n = task->length - start < TILE_ROWS ? task->length - start : TILE_ROWS;
        prefetch_rows(task->keys, start + QUANTIZED_PREFETCH_ROWS, TILE_ROWS, call->key_block);
        prefetch_rows(task->values, start + QUANTIZED_PREFETCH_ROWS, TILE_ROWS, 0);
        dequantize_block(call->format, task->keys, start, n, dim, call->span, call->key_block, tile);
        weigh_rows(q, tile, dim, n, call, p, running_max, running_sum, acc,
                   task->logits ? task->logits + start : NULL, task->logit_row);
        dequantize_block(call->format, task->values, start, n, dim, call->span, 0, tile);
        for (int64_t g = 0; g < group; g++) accumulate_values(NULL, tile, dim, n, p[g], dim, acc[g]);
    }
    for (int64_t start = 0; start < call->window_length; start += TILE_ROWS) {
        int64_t n = call->window_length - start < TILE_ROWS ? call->window_length - start : TILE_ROWS;
        const float *k_rows = task->k_window + start * window_row, *v_rows = task->v_window + start * window_row;
        weigh_rows(q, k_rows, window_row, n, call, p, running_max, running_sum, acc, NULL, 0);
        for (int64_t g = 0; g < group; g++) accumulate_values(NULL, v_rows, window_row, n, p[g], dim, acc[g]);
    }
    keep_rows(task, running_max, running_sum, group);
    finish_rows(running_sum, acc, group, dim, out);
}

/* One (sequence, KV head): out[g] = softmax(scale * q[g] . K^T) V over the quantized tokens
 * 0..task->length-1, then the window's fp32 rows 0..window_length-1 (the tokens after them). The
 * vector path takes head widths of multiples of 32 (int4 with token scales: groups too). */
static void attend_one(const float *q, const Task *task, const Call *call, float *out) {
#if VECTOR_INTRINSICS
    if (call->dim % 32 == 0 && (call->format != FORMAT_INT4 || call->key_block || call->span % 32 == 0)) {
        attend_vector(q, task, call, out);
        return;
    }
#endif
    attend_tiles(q, task, call, out);
}

/* The rows of one (sequence, KV head) of a table: batch b, KV head h. */
static inline QuantizedRows rows_of(quantized_table table, int64_t b, int64_t h) {
    QuantizedRows rows = {table.payload + b * table.strides[0] + h * table.strides[1], table.strides[2],
                          table.scales + b * table.scale_strides[0] + h * table.scale_strides[1], table.scale_strides[2]};
    return rows;
}

/* quantized_decode_attention's body, with taps (a constant NULL where the plain kernel inlines it): with
 * taps, each pair attends over its own fill of quantized tokens, keeps its logits, and is finished in
 * its task (kernels.h). */
static inline __attribute__((always_inline)) void attend_quantized_pairs(
        const float *q, quantized_table keys, quantized_table values, const float *k_window, const float *v_window,
        const int64_t *window_strides, float *out, int64_t batch, int64_t n_kv, int64_t group,
        int64_t quantized_length, int64_t window_length, int64_t dim, int format, int64_t span, int64_t key_block,
        float scale, int threads, const pair_taps *taps) {
    const Call call = {format, span, key_block, window_length, window_strides[2], group, dim, scale};
    /* Tasks handed out one at a time: equal work, but on a shared machine one core is often slowed for a
     * while, and a static split then waits for it. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t pair = 0; pair < batch * n_kv; pair++) {
        int64_t b = pair / n_kv, h = pair % n_kv, window_offset = b * window_strides[0] + h * window_strides[1];
        float row_max[MAX_GROUP], row_sum[MAX_GROUP];
        const int scored = taps != NULL;
        const Task task = {rows_of(keys, b, h), rows_of(values, b, h), window_length ? k_window + window_offset : NULL,
                           window_length ? v_window + window_offset : NULL,
                           scored && taps->fill ? taps->fill[pair] : quantized_length,
                           scored && taps->logits ? taps->logits + pair * group * taps->logit_row : NULL,
                           scored ? taps->logit_row : 0, scored ? row_max : NULL, scored ? row_sum : NULL};
        attend_one(q + pair * group * dim, &task, &call, out + pair * group * dim);
        if (scored && taps->finish != NULL) taps->finish(taps, pair, row_max, row_sum);
    }
}

/* q, out: [B, n_kv, G, D] fp32 contiguous. Payloads: [B, n_kv, S, W] bytes with strides (3, in bytes;
 * rows contiguous). Scales: fp32 with scale_strides (3, in floats): token axis [B, n_kv, S, D / span];
 * channel-axis keys (key_block > 0) [B, n_kv, S / key_block, D]. Windows: [B, n_kv, R, D] fp32 with
 * window_strides (3, in floats), rows 0..window_length-1 read (NULL when window_length is 0). span:
 * channels per token-axis scale (D for int8 and fp8, group_size for int4). */
void quantized_decode_attention(const float *q, quantized_table keys, quantized_table values, const float *k_window,
                                const float *v_window, const int64_t *window_strides, float *out, int64_t batch,
                                int64_t n_kv, int64_t group, int64_t quantized_length, int64_t window_length,
                                int64_t dim, int format, int64_t span, int64_t key_block, float scale, int threads) {
    attend_quantized_pairs(q, keys, values, k_window, v_window, window_strides, out, batch, n_kv, group,
                           quantized_length, window_length, dim, format, span, key_block, scale, threads, NULL);
}

/* quantized_decode_attention over token-axis tables alone (no window) with taps (kernels.h): each pair
 * over its own fill, `length` the most any holds. */
void quantized_decode_attention_tapped(const float *q, quantized_table keys, quantized_table values, float *out,
                                       int64_t batch, int64_t n_kv, int64_t group, int64_t length, int64_t dim,
                                       int format, int64_t span, float scale, int threads, const pair_taps *taps) {
    const int64_t no_window[3] = {0, 0, 0};
    attend_quantized_pairs(q, keys, values, NULL, NULL, no_window, out, batch, n_kv, group, length, 0, dim, format,
                           span, 0, scale, threads, taps);
}

/* ---- Quantizing a step's new rows (QuantizedLayerCache._store, token-axis scales): what
 * strategies/caches/quantization.py's quantize_per_token computes, bit for bit, in one call instead of ~12
 * torch ops per table. Compiled without -ffast-math: x / s and amax / max
 * are IEEE divisions (as torch's), not products with a reciprocal. ---- */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

/* x / s in [-448, 448] -> e4m3fn, round to nearest even (as torch's float8_e4m3fn conversion). */
static uint8_t to_e4m3(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float magnitude = fabsf(x);
    if (magnitude < 0.015625f) return sign | (uint8_t)nearbyintf(magnitude * 512.0f); /* below 2^-6: m x 2^-9 */
    uint32_t rest = bits & 0x7FFFFFFFu;
    rest = (rest + 0x7FFFFu + ((rest >> 20) & 1)) & ~0xFFFFFu; /* 3 mantissa bits, ties to even */
    return sign | (uint8_t)((((rest >> 23) - 120) << 3) | ((rest >> 20) & 7));
}

/* Rows t of x [B, n_kv, n, D] (fp32, strides x_strides in floats, channels contiguous) quantized into
 * table rows start + t: payload [B, n_kv, S, W] (byte strides), scales [B, n_kv, S, D / span] (float
 * strides). Scale s = amax / code_max over each span (0 kept; divided by the smallest normal instead). */
void quantize_rows(const float *x, const int64_t *x_strides, int64_t batch, int64_t n_kv, int64_t n, int64_t dim,
                   int format, int64_t span, uint8_t *payload, const int64_t *payload_strides, float *scales,
                   const int64_t *scale_strides, int64_t start) {
    const float code_max = format == FORMAT_INT8 ? 127.0f : format == FORMAT_INT4 ? 7.0f : 448.0f;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < n_kv; h++)
            for (int64_t t = 0; t < n; t++) {
                const float *row = x + b * x_strides[0] + h * x_strides[1] + t * x_strides[2];
                uint8_t *out = payload + b * payload_strides[0] + h * payload_strides[1] +
                               (start + t) * payload_strides[2];
                float *scale = scales + b * scale_strides[0] + h * scale_strides[1] + (start + t) * scale_strides[2];
                for (int64_t c0 = 0; c0 < dim; c0 += span) {
                    float amax = 0.0f;
                    for (int64_t d = c0; d < c0 + span; d++) amax = fabsf(row[d]) > amax ? fabsf(row[d]) : amax;
                    float s = amax / code_max, divisor = s > FLT_MIN ? s : FLT_MIN;
                    scale[c0 / span] = s;
                    for (int64_t d = c0; d < c0 + span; d++) {
                        float q = row[d] / divisor;
                        q = q < -code_max ? -code_max : q > code_max ? code_max : q;
                        if (format == FORMAT_FP8_E4M3) {
                            out[d] = to_e4m3(q);
                        } else {
                            int code = (int)nearbyintf(q);
                            if (format == FORMAT_INT8) out[d] = (uint8_t)(int8_t)code;
                            else if (d % 2 == 0) out[d / 2] = (uint8_t)(code + 8);
                            else out[d / 2] |= (uint8_t)((code + 8) << 4);
                        }
                    }
                }
            }
}
#pragma GCC pop_options

/* A ragged batch over one shared quantized table (a serving pool's arena, strategies/caches/quantized.py;
 * token-axis scales, no window): q, out [B, n_kv, G, D] fp32 contiguous; payloads [1, n_kv, S, W] and
 * scales [1, n_kv, S, D / span] with strides as above; sequence b's tokens are the rows starts[b] ..
 * starts[b] + lengths[b] - 1. Each (sequence, KV head) through attend_one, as the batched kernel's. */
void ragged_quantized_decode_attention(const float *q, quantized_table keys, quantized_table values,
                                       const int64_t *starts, const int64_t *lengths, float *out, int64_t batch,
                                       int64_t n_kv, int64_t group, int64_t dim, int format, int64_t span, float scale,
                                       int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t pair = 0; pair < batch * n_kv; pair++) {
        int64_t b = pair / n_kv, h = pair % n_kv;
        Task task = {rows_of(keys, 0, h), rows_of(values, 0, h), NULL, NULL, lengths[b], NULL, 0, NULL, NULL};
        QuantizedRows *tables[2] = {&task.keys, &task.values};
        for (int t = 0; t < 2; t++) {
            tables[t]->payload += starts[b] * tables[t]->row;
            tables[t]->scales += starts[b] * tables[t]->scale_row;
        }
        const Call call = {format, span, 0, 0, 0, group, dim, scale};
        attend_one(q + pair * group * dim, &task, &call, out + pair * group * dim);
    }
}
