/* Decode attention over a quantized KV cache on a CPU (int8, int4, fp8 e4m3), fp32 compute, GQA.
 *
 * Built and loaded by strategies/cpu_kernel.py's CKernel (same flags as cpu_decode_attention.c); used
 * by `quantized` (strategies/quantized.py) for its decode steps on a CPU in fp32.
 *
 * Why dequantize in the kernel: a quantized cache is worth having because a step reads 1 (int8, fp8)
 * or 0.5 (int4) bytes per cached element instead of 4. Dequantizing the prefix into an fp32 copy first
 * (the torch backend) reads the quantized bytes, then writes and reads 4 bytes per element: more
 * traffic than the fp32 cache it replaces. Here each block of BLOCK rows is dequantized into a tile
 * that stays in L1 and is consumed at once.
 *
 * Structure as cpu_decode_attention.c: one task per (sequence, KV head) over torch's OpenMP threads; per
 * task, blocks of keys with an online softmax so each row is read once. Two segments per task: the
 * quantized prefix, dequantized block by block, then the residual window's fp32 rows read in place.
 * Where cpu_decode_attention.c is limited by DRAM, this kernel reads 4-8x fewer bytes and is limited
 * by instructions, so its vector path (AVX-512, else AVX2) differs where that mattered, measured on the
 * 2-core Xeon here: eight key rows' dot products share their horizontal sums, and the value sums keep
 * 8 accumulators in flight (with two, as there, the loop ran at the FMA's latency). Other head widths
 * and group sizes take the generic path (cpu_decode_attention.c's block routines, copied: each kernel
 * is one source, and its build key hashes that source alone). Measured there at B=16, n_kv=2, G=2,
 * D=64, 4096 tokens: int8 2.4-2.7 ms against fp32's 4.1-4.3 ms (1.6-1.8x), int4 1.3-1.6x, fp8 1.4-1.7x;
 * still instruction-bound (7 GB/s of quantized bytes), so int4's halved bytes buy little more.
 *
 * Layout (strategies/quantization.py): payload rows of one (sequence, head) at a byte stride; int8 and
 * fp8 one byte per channel; int4 channel 2i in the low nibble of byte i and 2i + 1 in the high one,
 * stored as code + 8. Token-axis scales: D / span fp32 per token (span = D but for int4's groups).
 * Channel-axis key scales (KIVI): D fp32 per block of key_block tokens.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32      /* rows per block: a dequantized tile (BLOCK x D floats) stays in L1 at D <= 256 */
#define MAX_GROUP 32  /* most query heads per KV head, as cpu_decode_attention.c */
#define MAX_DIM 512   /* largest head dimension, as cpu_decode_attention.c */
#define PREFETCH 64   /* rows to prefetch ahead, K and V (16 left a block's short compute waiting on DRAM) */
#define CHUNK 32      /* channels the vector path dequantizes at a time: head_dim and int4 groups multiples of it */

enum { FORMAT_INT8 = 0, FORMAT_INT4 = 1, FORMAT_FP8_E4M3 = 2 }; /* strategies/quantized.py FORMAT_CODES */

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

/* ---- Vector primitives: LANES floats per vector. Codes to floats: int8 sign-extended; int4 nibbles
 * (biased 0..15, the -8 applied with the scale); fp8 e4m3's 7 magnitude bits put under an fp16
 * exponent (bits 13..7) with the sign at bit 15 are, as fp16, the e4m3 value / 2^8, subnormals
 * included, which F16C converts exactly (the 2^8 applied with the scale). ---- */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vfloat;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VADD _mm512_add_ps
#define VZERO _mm512_setzero_ps
static inline vfloat from_int8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vfloat from_fp8(const uint8_t *p) {
    __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16((short)0xBF80)));
}
static inline void from_nibbles(__m128i codes, vfloat *out) { /* 16 codes, one per byte */
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
}
static inline __m256 fold(vfloat a) { /* 16 lanes -> 8, summing pairs */
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vfloat;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VADD _mm256_add_ps
#define VZERO _mm256_setzero_ps
static inline vfloat from_int8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vfloat from_fp8(const uint8_t *p) {
    __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16((short)0xBF80)));
}
static inline void from_nibbles(__m128i codes, vfloat *out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(codes, codes)));
}
static inline __m256 fold(vfloat a) { return a; }
#endif

#ifdef LANES
#define CHUNK_VECTORS (CHUNK / LANES)

/* CHUNK channels' codes from c0 as floats (scaled as the comment above says). */
static inline __attribute__((always_inline)) void decode_chunk(int format, const uint8_t *codes, int64_t c0,
                                                               vfloat out[CHUNK_VECTORS]) {
    if (format == FORMAT_INT4) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + c0 / 2)), nibble = _mm_set1_epi8(15);
        __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        from_nibbles(_mm_unpacklo_epi8(low, high), out); /* channels c0 .. c0 + 15 in order */
        from_nibbles(_mm_unpackhi_epi8(low, high), out + CHUNK_VECTORS / 2); /* c0 + 16 .. c0 + 31 */
    } else {
        for (int i = 0; i < CHUNK_VECTORS; i++)
            out[i] = format == FORMAT_INT8 ? from_int8(codes + c0 + LANES * i) : from_fp8(codes + c0 + LANES * i);
    }
}

static const float CODE_FACTOR[3] = {1.0f, 1.0f, 256.0f}; /* x_hat = scale * FACTOR * (decoded + BIAS) */
static const float CODE_BIAS[3] = {0.0f, -8.0f, 0.0f};

/* out = x_hat of one row, token-axis scales: one per `span` channels (a multiple of CHUNK). */
static inline __attribute__((always_inline)) void dequantize_row_token(int format, const uint8_t *codes,
                                                                       const float *scales, int64_t dim,
                                                                       int64_t span, float *out) {
    for (int64_t c0 = 0, group = 0; c0 < dim; group++) {
        float s = scales[group] * CODE_FACTOR[format];
        vfloat scale = VSET1(s), shift = VSET1(s * CODE_BIAS[format]);
        for (int64_t end = c0 + span; c0 < end; c0 += CHUNK) {
            vfloat v[CHUNK_VECTORS];
            decode_chunk(format, codes, c0, v);
            for (int i = 0; i < CHUNK_VECTORS; i++) VSTORE(out + c0 + LANES * i, VFMA(v[i], scale, shift));
        }
    }
}

/* out = x_hat of one key row, channel-axis scales (one per channel). */
static inline __attribute__((always_inline)) void dequantize_row_channel(int format, const uint8_t *codes,
                                                                         const float *scales, int64_t dim,
                                                                         float *out) {
    vfloat factor = VSET1(CODE_FACTOR[format]), bias = VSET1(CODE_BIAS[format]);
    for (int64_t c0 = 0; c0 < dim; c0 += CHUNK) {
        vfloat v[CHUNK_VECTORS];
        decode_chunk(format, codes, c0, v);
        for (int i = 0; i < CHUNK_VECTORS; i++)
            VSTORE(out + c0 + LANES * i, VMUL(VADD(v[i], bias), VMUL(VLOAD(scales + c0 + LANES * i), factor)));
    }
}

/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in ~9 instructions instead of ~6 each. */
static inline __m256 sum8(const vfloat a[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(fold(a[0]), fold(a[1])), _mm256_hadd_ps(fold(a[2]), fold(a[3])));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(fold(a[4]), fold(a[5])), _mm256_hadd_ps(fold(a[6]), fold(a[7])));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

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

/* tile[j * dim + d] = x_hat of token start + j, j < n; `vector`: dim and span multiples of CHUNK. */
static inline __attribute__((always_inline)) void dequantize_rows(int format, int vector, QuantizedRows rows,
                                                                  int64_t start, int64_t n, int64_t dim,
                                                                  int64_t span, int64_t key_block, float *tile) {
    for (int64_t j = 0; j < n; j++) {
        int64_t t = start + j;
        const uint8_t *codes = rows.payload + t * rows.row;
        const float *scales = rows.scales + (key_block ? t / key_block : t) * rows.scale_row;
#ifdef LANES
        if (vector) {
            if (key_block) dequantize_row_channel(format, codes, scales, dim, tile + j * dim);
            else dequantize_row_token(format, codes, scales, dim, span, tile + j * dim);
            continue;
        }
#endif
        dequantize_row_generic(format, codes, scales, dim, key_block ? 1 : span, tile + j * dim);
    }
}

/* dequantize_rows with the format as a constant, so each format compiles to its own loop. */
static void dequantize_block(int format, int vector, QuantizedRows rows, int64_t start, int64_t n, int64_t dim,
                             int64_t span, int64_t key_block, float *tile) {
#define ROWS(FORMAT, VECTOR) dequantize_rows(FORMAT, VECTOR, rows, start, n, dim, span, key_block, tile)
    if (!vector) ROWS(format, 0);
    else if (format == FORMAT_INT8) ROWS(FORMAT_INT8, 1);
    else if (format == FORMAT_INT4) ROWS(FORMAT_INT4, 1);
    else ROWS(FORMAT_FP8_E4M3, 1);
#undef ROWS
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

/* scores[g][j] = scale * q[g] . key_j for the n fp32 key rows of one block. */
static void block_scores(const float *q, const float *k, int64_t k_row, int64_t n, int64_t group, int64_t dim,
                         float scale, float scores[MAX_GROUP][BLOCK]) {
    int64_t j = 0;
#ifdef LANES
    if (dim % LANES == 0) { /* eight rows at a time, their horizontal sums shared */
        for (; j + 8 <= n; j += 8) {
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * dim;
                vfloat acc[8];
                for (int r = 0; r < 8; r++) acc[r] = VZERO();
                for (int64_t d = 0; d < dim; d += LANES) {
                    vfloat qd = VLOAD(qg + d);
                    for (int r = 0; r < 8; r++) acc[r] = VFMA(qd, VLOAD(k + (j + r) * k_row + d), acc[r]);
                }
                _mm256_storeu_ps(&scores[g][j], _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
            }
        }
    }
#endif
    for (; j < n; j++) { /* the generic path (cpu_decode_attention.c's, less its group-of-4 case) */
        const float *key = k + j * k_row;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            float s = 0;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; d++) s += qg[d] * key[d];
            scores[g][j] = s * scale;
        }
    }
}

#ifdef LANES
/* acc[g][c0 .. c0 + LANES * VECTORS) += sum_j p[g][j] * value_j there: even and odd rows into separate
 * accumulators, so at least 8 FMA chains are in flight whatever the head width. */
#define VALUES_CHUNK(VECTORS)                                                                              \
    for (int64_t g = 0; g < group; g++) {                                                                  \
        vfloat even[VECTORS], odd[VECTORS];                                                                \
        for (int i = 0; i < VECTORS; i++) even[i] = VLOAD(&acc[g][c0 + LANES * i]), odd[i] = VZERO();     \
        int64_t j = 0;                                                                                     \
        for (; j + 2 <= n; j += 2) {                                                                       \
            vfloat p0 = VSET1(p[g][j]), p1 = VSET1(p[g][j + 1]);                                           \
            const float *v0 = v + j * v_row + c0, *v1 = v0 + v_row;                                        \
            for (int i = 0; i < VECTORS; i++) {                                                            \
                even[i] = VFMA(p0, VLOAD(v0 + LANES * i), even[i]);                                       \
                odd[i] = VFMA(p1, VLOAD(v1 + LANES * i), odd[i]);                                         \
            }                                                                                              \
        }                                                                                                  \
        if (j < n) {                                                                                       \
            vfloat last = VSET1(p[g][j]);                                                                  \
            for (int i = 0; i < VECTORS; i++) even[i] = VFMA(last, VLOAD(v + j * v_row + c0 + LANES * i), even[i]); \
        }                                                                                                  \
        for (int i = 0; i < VECTORS; i++) VSTORE(&acc[g][c0 + LANES * i], VADD(even[i], odd[i]));          \
    }
#endif

/* acc[g][:] += sum_j p[g][j] * value_j over the n fp32 value rows of one block. */
static void block_values(const float *v, int64_t v_row, int64_t n, int64_t group, int64_t dim,
                         float p[MAX_GROUP][BLOCK], float acc[MAX_GROUP][MAX_DIM]) {
#ifdef LANES
    if (dim % LANES == 0) {
        int64_t c0 = 0;
        for (; c0 + 4 * LANES <= dim; c0 += 4 * LANES) VALUES_CHUNK(4)
        for (; c0 < dim; c0 += LANES) VALUES_CHUNK(1)
        return;
    }
#endif
    for (int64_t d0 = 0; d0 < dim; d0 += 16) { /* the generic path: cpu_decode_attention.c's */
        if (d0 + 16 > dim) {
            for (int64_t g = 0; g < group; g++)
                for (int64_t j = 0; j < n; j++)
                    for (int64_t d = d0; d < dim; d++) acc[g][d] += p[g][j] * v[j * v_row + d];
            break;
        }
        for (int64_t g = 0; g < group; g++) {
            float a[16];
            for (int c = 0; c < 16; c++) a[c] = acc[g][d0 + c];
            for (int64_t j = 0; j < n; j++) {
                const float *value = v + j * v_row + d0;
                float pj = p[g][j];
#pragma omp simd
                for (int c = 0; c < 16; c++) a[c] += pj * value[c];
            }
            for (int c = 0; c < 16; c++) acc[g][d0 + c] = a[c];
        }
    }
}

/* Online softmax over one block's scores: rescale what came before to the new running max, turn the
 * scores into p = exp(score - max) in place, add them to the running sums. */
static void softmax_update(float p[MAX_GROUP][BLOCK], int64_t n, int64_t group, int64_t dim, float *running_max,
                           float *running_sum, float acc[MAX_GROUP][MAX_DIM]) {
    for (int64_t g = 0; g < group; g++) {
        float block_max = running_max[g];
        for (int64_t j = 0; j < n; j++) block_max = p[g][j] > block_max ? p[g][j] : block_max;
        float correction = expf(running_max[g] - block_max);
        running_max[g] = block_max;
        running_sum[g] *= correction;
        for (int64_t d = 0; d < dim; d++) acc[g][d] *= correction;
        float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = 0; j < n; j++) {
            p[g][j] = expf(p[g][j] - block_max);
            block_sum += p[g][j];
        }
        running_sum[g] += block_sum;
    }
}

/* One (sequence, KV head): out[g] = softmax(scale * q[g] . K^T) V over the quantized tokens
 * 0..quantized_length-1, then the window's fp32 rows 0..window_length-1 (the tokens after them). */
static void attend_one(const float *q, QuantizedRows keys, QuantizedRows values, int format, int64_t span,
                       int64_t key_block, int64_t quantized_length, const float *k_window, const float *v_window,
                       int64_t window_row, int64_t window_length, float *out, int64_t group, int64_t dim,
                       float scale) {
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], p[MAX_GROUP][BLOCK], acc[MAX_GROUP][MAX_DIM];
    float tile[BLOCK * MAX_DIM]; /* one block of K, then of V, dequantized: BLOCK x dim floats used */
#ifdef LANES
    int vector = dim % CHUNK == 0 && (key_block || span % CHUNK == 0);
#else
    int vector = 0;
#endif
    for (int64_t g = 0; g < group; g++) {
        running_max[g] = -FLT_MAX; /* finite: -ffast-math assumes no infinities */
        running_sum[g] = 0.0f;
        memset(acc[g], 0, sizeof(float) * dim);
    }
    for (int64_t start = 0; start < quantized_length; start += BLOCK) {
        int64_t n = quantized_length - start < BLOCK ? quantized_length - start : BLOCK;
        prefetch_rows(keys, start + PREFETCH, BLOCK, key_block);
        prefetch_rows(values, start + PREFETCH, BLOCK, 0);
        dequantize_block(format, vector, keys, start, n, dim, span, key_block, tile);
        block_scores(q, tile, dim, n, group, dim, scale, p);
        softmax_update(p, n, group, dim, running_max, running_sum, acc);
        dequantize_block(format, vector, values, start, n, dim, span, 0, tile);
        block_values(tile, dim, n, group, dim, p, acc);
    }
    for (int64_t start = 0; start < window_length; start += BLOCK) {
        int64_t n = window_length - start < BLOCK ? window_length - start : BLOCK;
        block_scores(q, k_window + start * window_row, window_row, n, group, dim, scale, p);
        softmax_update(p, n, group, dim, running_max, running_sum, acc);
        block_values(v_window + start * window_row, window_row, n, group, dim, p, acc);
    }
    for (int64_t g = 0; g < group; g++) {
        float inverse = 1.0f / running_sum[g];
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g][d] * inverse;
    }
}

/* q, out: [B, n_kv, G, D] fp32 contiguous. Payloads: [B, n_kv, S, W] bytes with strides *_strides (3,
 * in bytes; rows contiguous). Scales: fp32 with strides *_scale_strides (3, in floats): token axis
 * [B, n_kv, S, D / span]; channel-axis keys (key_block > 0) [B, n_kv, S / key_block, D]. Windows:
 * [B, n_kv, R, D] fp32 with window_strides (3, in floats), rows 0..window_length-1 read (NULL when
 * window_length is 0). span: channels per token-axis scale (D for int8 and fp8, group_size for int4). */
void quantized_decode_attention(const float *q, const uint8_t *k_payload, const int64_t *k_strides,
                                const float *k_scales, const int64_t *k_scale_strides, const uint8_t *v_payload,
                                const int64_t *v_strides, const float *v_scales, const int64_t *v_scale_strides,
                                const float *k_window, const float *v_window, const int64_t *window_strides,
                                float *out, int64_t batch, int64_t n_kv, int64_t group, int64_t quantized_length,
                                int64_t window_length, int64_t dim, int format, int64_t span, int64_t key_block,
                                float scale, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < batch * n_kv; task++) {
        int64_t b = task / n_kv, h = task % n_kv;
        QuantizedRows keys = {k_payload + b * k_strides[0] + h * k_strides[1], k_strides[2],
                              k_scales + b * k_scale_strides[0] + h * k_scale_strides[1], k_scale_strides[2]};
        QuantizedRows values = {v_payload + b * v_strides[0] + h * v_strides[1], v_strides[2],
                                v_scales + b * v_scale_strides[0] + h * v_scale_strides[1], v_scale_strides[2]};
        int64_t window_offset = b * window_strides[0] + h * window_strides[1];
        attend_one(q + task * group * dim, keys, values, format, span, key_block, quantized_length,
                   window_length ? k_window + window_offset : NULL, window_length ? v_window + window_offset : NULL,
                   window_strides[2], window_length, out + task * group * dim, group, dim, scale);
    }
}
