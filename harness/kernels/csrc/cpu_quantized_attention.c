/* Decode attention over a quantized KV cache on a CPU (int8, int4, fp8 e4m3), fp32 compute, GQA.
 *
 * A C++ translation unit of the kernels' extension (harness/kernels/extension.py), the operators
 * harness_kernels::quantized_decode_attention and quantize_rows_ (ops.cpp); used by `quantized`
 * (strategies/quantized.py) for its decode steps on a CPU in fp32.
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
 * (tests/benchmarks/test_quantized_targets.py times it against cpu_decode_attention.c's on the same tokens). Other head widths and int4 groups
 * take the generic path: block routines of the same structure as cpu_decode_attention.c's generic
 * path, with a dequantized tile in between; its vector primitives are this file's own (intrinsics
 * for the codes' conversions, which GCC's vector extensions in vector.h do not express), and need
 * AVX2 with F16C and FMA, else the generic path runs. quantize_rows (at the end) is the write side: a
 * step's new rows quantized as strategies/quantization.py does, bit for bit.
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

#include "kernels.h" /* MAX_GROUP, MAX_DIM, the FORMAT_* codes */

#define BLOCK 64          /* rows per block of the vector path (scores: MAX_GROUP x BLOCK floats, in L1) */
#define GENERIC_BLOCK 32  /* rows per block of the generic path: a dequantized tile (x D floats) stays in L1 */
#define PREFETCH 64       /* rows to prefetch ahead, K and V (16 leaves a block's short compute waiting on DRAM) */


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

/* ---- Vector primitives: LANES floats per vector. Codes to floats: int8 sign-extended (int4: in the
 * vector path below); fp8 e4m3's 7 magnitude bits put under an fp16
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
static inline __m256 fold(vfloat a) { return a; }
#endif

#ifdef LANES
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

/* scores[g][j] = scale * q[g] . key_j for the n fp32 key rows of one block. */
static void block_scores(const float *q, const float *k, int64_t k_row, int64_t n, int64_t group, int64_t dim,
                         float scale, float scores[MAX_GROUP][GENERIC_BLOCK]) {
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
                         float p[MAX_GROUP][GENERIC_BLOCK], float acc[MAX_GROUP][MAX_DIM]) {
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
static void softmax_update(float p[MAX_GROUP][GENERIC_BLOCK], int64_t n, int64_t group, int64_t dim, float *running_max,
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

#ifdef LANES
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
#define SROW (BLOCK + LANES) /* a score row: a partial tile's lanes past the block land in the margin */
enum { FORMAT_F32 = 3 };     /* the residual window's rows, through the same tiles */

#if LANES == 16
#define VMAX _mm512_max_ps
#define VSUB _mm512_sub_ps
#define VFNMA _mm512_fnmadd_ps
#define VROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VEXP2(y, n) _mm512_scalef_ps(y, n)
#define VHMAX _mm512_reduce_max_ps
#define VHSUM _mm512_reduce_add_ps
#define VKEEP(v, lanes, fill) _mm512_mask_blend_ps((__mmask16)((1u << (lanes)) - 1), fill, v) /* lanes < n: v */
static inline vfloat int4_table(float s) { /* lane i: s * (i - 8), rounded once as x_hat = code * scale */
    return VMUL(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), VSET1(s));
}
static inline void from_int4(const uint8_t *p, vfloat table, vfloat x[2]) { /* 16 bytes: 32 channels */
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    x[0] = _mm512_permutexvar_ps(bytes, table); /* the index's low 4 bits: the low nibble */
    x[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
/* Lane l = sum(a[l]) of 16 vectors: four rounds halving the partial sums per row, two shuffles and an
 * add per pair; a[] is taken in the order the rounds leave their rows in (an involution). */
static inline __attribute__((always_inline)) vfloat reduce_lanes(const vfloat a[16]) {
#define PAIR(X, Y) VADD(_mm512_shuffle_f32x4(a[X], a[Y], 0x44), _mm512_shuffle_f32x4(a[X], a[Y], 0xEE))
    vfloat b[8] = {PAIR(0, 4), PAIR(2, 6), PAIR(1, 5), PAIR(3, 7), PAIR(8, 12), PAIR(10, 14), PAIR(9, 13), PAIR(11, 15)};
#undef PAIR
    vfloat c[4], d[2];
    for (int i = 0; i < 4; i++)
        c[i] = VADD(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = VADD(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
    return VADD(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}
/* dst[h * stride + r] = lane h * R + r, R = 16 / H. */
static inline void store_tile(int heads, vfloat v, float *dst, int64_t stride) {
    if (heads == 1) {
        VSTORE(dst, v);
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
#define MAX_ACCUMULATORS 16 /* value accumulators in registers (of 32) */
#else
#define VMAX _mm256_max_ps
#define VSUB _mm256_sub_ps
#define VFNMA _mm256_fnmadd_ps
#define VROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VEXP2(y, n) VMUL(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), \
                                                                                _mm256_set1_epi32(127)), 23)))
static inline float VHMAX(vfloat v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float VHSUM(vfloat v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
static inline vfloat VKEEP(vfloat v, int64_t lanes, vfloat fill) { /* lanes < n: v */
    __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(fill, v, _mm256_castsi256_ps(keep));
}
static inline vfloat int4_table(float s) { return VSET1(s); } /* AVX2: the scale, applied after converting */
static inline void from_int4(const uint8_t *p, vfloat scale, vfloat x[2]) { /* 8 bytes: 16 channels */
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), bias = _mm256_set1_epi32(8);
    __m256i low = _mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), bias);
    x[0] = VMUL(_mm256_cvtepi32_ps(low), scale);
    x[1] = VMUL(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), bias)), scale);
}
static inline __attribute__((always_inline)) vfloat reduce_lanes(const vfloat a[8]) { /* as the AVX-512 one */
#define PAIR(X, Y) VADD(_mm256_permute2f128_ps(a[X], a[Y], 0x20), _mm256_permute2f128_ps(a[X], a[Y], 0x31))
    vfloat b[4] = {PAIR(0, 4), PAIR(2, 6), PAIR(1, 5), PAIR(3, 7)}, c[2];
#undef PAIR
    for (int i = 0; i < 2; i++)
        c[i] = VADD(_mm256_shuffle_ps(b[i], b[i + 2], 0x44), _mm256_shuffle_ps(b[i], b[i + 2], 0xEE));
    return VADD(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
}
static inline void store_tile(int heads, vfloat v, float *dst, int64_t stride) {
    __m128 low = _mm256_castps256_ps128(v), high = _mm256_extractf128_ps(v, 1);
    if (heads == 1) {
        VSTORE(dst, v);
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
#define MAX_ACCUMULATORS 8 /* of 16 registers */
#endif

/* The chunk of channels c0 .. c0 + CH - 1 of one row as two vectors (int4: its even channels, then its
 * odd ones; `table` from int4_table). int8 and fp8 unscaled (fp8: the value / 256); f32: a window row. */
static inline __attribute__((always_inline)) void decode(int format, const uint8_t *row, int64_t c0, vfloat table,
                                                         vfloat x[2]) {
    if (format == FORMAT_INT4) {
        from_int4(row + c0 / 2, table, x);
    } else if (format == FORMAT_F32) {
        x[0] = VLOAD((const float *)row + c0), x[1] = VLOAD((const float *)row + c0 + LANES);
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

/* Prefetch rows t + PREFETCH .. t + PREFETCH + n - 1 (payload and token scales), a few lines at a time
 * as the rows before them are computed on. */
static inline __attribute__((always_inline)) void prefetch_ahead(Rows rows, int64_t t, int64_t n) {
    const uint8_t *payload = rows.payload + (t + PREFETCH) * rows.row;
    for (int64_t offset = 0; offset < n * rows.row; offset += 64) __builtin_prefetch(payload + offset);
    if (rows.scale_row) {
        const uint8_t *scales = (const uint8_t *)(rows.scales + (t + PREFETCH) * rows.scale_row);
        for (int64_t offset = 0; offset < n * rows.scale_row * 4; offset += 64) __builtin_prefetch(scales + offset);
    }
}

/* scores[h][r] = q[h] . x_(first + r) for rows first .. first + n - 1 (n <= LANES / heads) and the
 * `heads` query rows of q (stride dim). Rows past n repeat the last one (their lanes are not read). */
static inline __attribute__((always_inline)) void dot_tile(int format, int heads, int scaled, Rows rows,
                                                           int64_t first, int64_t n, const float *q,
                                                           int64_t dim, int prefetch, float *scores) {
    enum { MAX_HEADS = 4 };
    const int R = LANES / heads;
    const uint8_t *payload = rows.payload + first * rows.row;
    const float *scales = rows.scales + first * rows.scale_row;
    if (prefetch) prefetch_ahead(rows, first, R);
    vfloat acc[LANES];
#pragma GCC unroll 16
    for (int a = 0; a < LANES; a++) acc[a] = VZERO();
    for (int64_t c0 = 0, group = 0, group_end = rows.span; c0 < dim; c0 += CH) {
        vfloat q0[MAX_HEADS], q1[MAX_HEADS];
#pragma GCC unroll 4
        for (int h = 0; h < heads; h++) q0[h] = VLOAD(q + h * dim + c0), q1[h] = VLOAD(q + h * dim + c0 + LANES);
        if (format == FORMAT_INT4 && scaled && c0 == group_end) group++, group_end += rows.span;
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            int64_t at = r < n ? r : n - 1; /* past n: the last row again */
            vfloat x[2], table = VZERO();
            if (format == FORMAT_INT4) table = int4_table(scaled ? scales[at * rows.scale_row + group] : 1.0f);
            decode(format, payload + at * rows.row, c0, table, x);
#pragma GCC unroll 4
            for (int h = 0; h < heads; h++) acc[h * R + r] = VFMA(x[1], q1[h], VFMA(x[0], q0[h], acc[h * R + r]));
        }
    }
    store_tile(heads, reduce_lanes(acc), scores, SROW);
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
    vfloat sum[MAX_ACCUMULATORS];
    int64_t group[4]; /* int4: each chunk's scale */
    for (int c = 0; c < chunks; c++) group[c] = format == FORMAT_INT4 ? (c0 + CH * c) / rows.span : 0;
#pragma GCC unroll 16
    for (int h = 0; h < heads; h++)
#pragma GCC unroll 16
        for (int i = 0; i < 2 * chunks; i++) sum[h * 2 * chunks + i] = VLOAD(&acc[h][c0 + LANES * i]);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = rows.payload + (first + j) * rows.row;
        if (prefetch && j % 4 == 0) prefetch_ahead(rows, first + j, 4);
        vfloat x[2 * 4];
#pragma GCC unroll 4
        for (int c = 0; c < chunks; c++) {
            vfloat table = format == FORMAT_INT4 ? int4_table(rows.scales[(first + j) * rows.scale_row + group[c]])
                                                 : VZERO();
            decode(format, row, c0 + CH * c, table, &x[2 * c]);
        }
#pragma GCC unroll 16
        for (int h = 0; h < heads; h++) {
            vfloat weight = VSET1(p[h][j]);
#pragma GCC unroll 16
            for (int i = 0; i < 2 * chunks; i++) sum[h * 2 * chunks + i] = VFMA(weight, x[i], sum[h * 2 * chunks + i]);
        }
    }
#pragma GCC unroll 16
    for (int h = 0; h < heads; h++)
#pragma GCC unroll 16
        for (int i = 0; i < 2 * chunks; i++) VSTORE(&acc[h][c0 + LANES * i], sum[h * 2 * chunks + i]);
}

/* `heads` heads from g0 over all channels: slices of `chunks` chunks. */
static inline __attribute__((always_inline)) void values_heads(int format, int heads, int chunks, Rows rows,
                                                               int64_t first, int64_t n, int64_t dim,
                                                               float p[][SROW], float acc[][MAX_DIM],
                                                               float top[][MAX_DIM]) {
    for (int64_t c0 = 0; c0 < dim; c0 += CH * chunks)
        values_slice(format, heads, chunks, rows, first, n, c0, c0 == 0 && acc == top && format != FORMAT_F32, p, acc);
}

/* acc[g][:] += sum_j p[g][j] * x_(first + j), j < n: heads in groups of a power of two, chunks per slice
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
        else SLICES(FORMAT, 1);                                                                        \
    } while (0)
    if (format == FORMAT_INT8) HEADS_OF(FORMAT_INT8);
    else if (format == FORMAT_INT4) HEADS_OF(FORMAT_INT4);
    else if (format == FORMAT_FP8_E4M3) HEADS_OF(FORMAT_FP8_E4M3);
    else HEADS_OF(FORMAT_F32);
#undef HEADS_OF
#undef SLICES
}

/* exp(x) for x <= 0 (softmax's arguments), within ~2 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a
 * degree-5 polynomial for exp(r) - 1 - r, times 2^n); x below -87 gives exp(-87), which no sum notices.
 * glibc's vector expf called through libmvec cost more than the dot products here. */
static inline vfloat exp_nonpositive(vfloat x) {
    x = VMAX(x, VSET1(-87.0f));
    vfloat n = VROUND(VMUL(x, VSET1(1.44269504088896341f)));
    vfloat r = VFNMA(n, VSET1(0.693359375f), x);
    r = VFNMA(n, VSET1(-2.12194440e-4f), r);
    vfloat y = VSET1(1.9875691500e-4f);
    y = VFMA(y, r, VSET1(1.3981999507e-3f));
    y = VFMA(y, r, VSET1(8.3334519073e-3f));
    y = VFMA(y, r, VSET1(4.1665795894e-2f));
    y = VFMA(y, r, VSET1(1.6666665459e-1f));
    y = VFMA(y, r, VSET1(5.0000001201e-1f));
    y = VFMA(y, VMUL(r, r), VADD(r, VSET1(1.0f)));
    return VEXP2(y, n);
}

/* Online softmax over one block: scores[g][j] * score_scale[j] -> p = exp(. - running max), the sums and
 * the accumulators rescaled where the max rose; then p[g][j] *= value_scale[j] (the value rows' scales).
 * Whole vectors: lanes past n (the rows' margin) are computed and left out of the max and the sum. */
static void softmax_block(float scores[][SROW], int64_t n, int64_t group, int64_t dim, const float *score_scale,
                          const float *value_scale, float *running_max, float *running_sum, float acc[][MAX_DIM]) {
    int64_t tail = n - (n - 1) / LANES * LANES; /* valid lanes of the last vector, 1..LANES */
    for (int64_t g = 0; g < group; g++) {
        float *s = scores[g];
        vfloat most = VSET1(running_max[g]);
        for (int64_t j = 0; j < n; j += LANES) {
            vfloat v = VMUL(VLOAD(s + j), VLOAD(score_scale + j));
            VSTORE(s + j, v);
            most = VMAX(most, j + LANES <= n ? v : VKEEP(v, tail, VSET1(-FLT_MAX)));
        }
        float block_max = VHMAX(most);
        if (block_max > running_max[g]) {
            float correction = expf(running_max[g] - block_max);
            running_max[g] = block_max;
            running_sum[g] *= correction;
            for (int64_t d = 0; d < dim; d++) acc[g][d] *= correction;
        }
        vfloat sum = VZERO(), top = VSET1(block_max);
        for (int64_t j = 0; j < n; j += LANES) {
            vfloat e = exp_nonpositive(VSUB(VLOAD(s + j), top));
            sum = VADD(sum, j + LANES <= n ? e : VKEEP(e, tail, VZERO()));
            VSTORE(s + j, VMUL(e, VLOAD(value_scale + j)));
        }
        running_sum[g] += VHSUM(sum);
    }
}

/* Channel order within each chunk of the int4 path: position i of a chunk holds channel 2i (i < LANES),
 * else 2(i - LANES) + 1. */
static inline int64_t chunk_channel(int64_t position) {
    int64_t base = position - position % CH, i = position % CH;
    return base + (i < LANES ? 2 * i : 2 * (i - LANES) + 1);
}

/* attend_one (below) on the vector path. */
static void attend_vector(const float *q, QuantizedRows keys, QuantizedRows values, int format, int64_t span,
                          int64_t key_block, int64_t quantized_length, const float *k_window,
                          const float *v_window, int64_t window_row, int64_t window_length, float *out,
                          int64_t group, int64_t dim, float scale) {
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], scores[MAX_GROUP][SROW], acc[MAX_GROUP][MAX_DIM];
    float query[MAX_GROUP * MAX_DIM]; /* q in chunk order (int4) and scaled per channel (channel axis) */
    float score_scale[SROW] = {0}, value_scale[SROW] = {0}; /* the margin: read by whole vectors, unused */
    int permuted = format == FORMAT_INT4, scaled = !key_block; /* int4: tables scaled by token scales */
    float factor = format == FORMAT_FP8_E4M3 ? 256.0f : 1.0f;
    for (int64_t g = 0; g < group; g++) {
        running_max[g] = -FLT_MAX; /* finite: -ffast-math assumes no infinities */
        running_sum[g] = 0.0f;
        memset(acc[g], 0, sizeof(float) * dim);
    }
    const float *key_query = q;
    if (permuted && !key_block) {
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < dim; d++) query[g * dim + d] = q[g * dim + chunk_channel(d)];
        key_query = query;
    }
    Rows key_rows = {keys.payload, keys.row, keys.scales, key_block ? 0 : keys.scale_row, span};
    Rows value_rows = {values.payload, values.row, values.scales, values.scale_row, span};
    for (int64_t start = 0; start < quantized_length; start += BLOCK) {
        int64_t n = quantized_length - start < BLOCK ? quantized_length - start : BLOCK;
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
        softmax_block(scores, n, group, dim, score_scale, value_scale, running_max, running_sum, acc);
        values_block(format, value_rows, start, n, group, dim, scores, acc);
    }
    if (permuted) { /* the accumulators back in channel order */
        float row[MAX_DIM];
        for (int64_t g = 0; g < group; g++) {
            for (int64_t d = 0; d < dim; d++) row[chunk_channel(d)] = acc[g][d];
            memcpy(acc[g], row, sizeof(float) * dim);
        }
    }
    Rows k_rows = {(const uint8_t *)k_window, window_row * 4, NULL, 0, 1};
    Rows v_rows = {(const uint8_t *)v_window, window_row * 4, NULL, 0, 1};
    for (int64_t j = 0; j < SROW; j++) score_scale[j] = scale, value_scale[j] = 1.0f;
    for (int64_t start = 0; start < window_length; start += BLOCK) {
        int64_t n = window_length - start < BLOCK ? window_length - start : BLOCK;
        scores_block(FORMAT_F32, 0, k_rows, start, n, q, group, dim, scores);
        softmax_block(scores, n, group, dim, score_scale, value_scale, running_max, running_sum, acc);
        values_block(FORMAT_F32, v_rows, start, n, group, dim, scores, acc);
    }
    for (int64_t g = 0; g < group; g++) {
        float inverse = 1.0f / running_sum[g];
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g][d] * inverse;
    }
}
#endif

/* attend_one (below) on the generic path: each block dequantized into a tile, then fp32 attention. */
static void attend_generic(const float *q, QuantizedRows keys, QuantizedRows values, int format, int64_t span,
                           int64_t key_block, int64_t quantized_length, const float *k_window,
                           const float *v_window, int64_t window_row, int64_t window_length, float *out,
                           int64_t group, int64_t dim, float scale) {
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], p[MAX_GROUP][GENERIC_BLOCK], acc[MAX_GROUP][MAX_DIM];
    float tile[GENERIC_BLOCK * MAX_DIM]; /* one block of K, then of V, dequantized */
    for (int64_t g = 0; g < group; g++) {
        running_max[g] = -FLT_MAX; /* finite: -ffast-math assumes no infinities */
        running_sum[g] = 0.0f;
        memset(acc[g], 0, sizeof(float) * dim);
    }
    for (int64_t start = 0; start < quantized_length; start += GENERIC_BLOCK) {
        int64_t n = quantized_length - start < GENERIC_BLOCK ? quantized_length - start : GENERIC_BLOCK;
        prefetch_rows(keys, start + PREFETCH, GENERIC_BLOCK, key_block);
        prefetch_rows(values, start + PREFETCH, GENERIC_BLOCK, 0);
        dequantize_block(format, keys, start, n, dim, span, key_block, tile);
        block_scores(q, tile, dim, n, group, dim, scale, p);
        softmax_update(p, n, group, dim, running_max, running_sum, acc);
        dequantize_block(format, values, start, n, dim, span, 0, tile);
        block_values(tile, dim, n, group, dim, p, acc);
    }
    for (int64_t start = 0; start < window_length; start += GENERIC_BLOCK) {
        int64_t n = window_length - start < GENERIC_BLOCK ? window_length - start : GENERIC_BLOCK;
        block_scores(q, k_window + start * window_row, window_row, n, group, dim, scale, p);
        softmax_update(p, n, group, dim, running_max, running_sum, acc);
        block_values(v_window + start * window_row, window_row, n, group, dim, p, acc);
    }
    for (int64_t g = 0; g < group; g++) {
        float inverse = 1.0f / running_sum[g];
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g][d] * inverse;
    }
}

/* One (sequence, KV head): out[g] = softmax(scale * q[g] . K^T) V over the quantized tokens
 * 0..quantized_length-1, then the window's fp32 rows 0..window_length-1 (the tokens after them). The
 * vector path takes head widths of multiples of 32 (int4 with token scales: groups too). */
static void attend_one(const float *q, QuantizedRows keys, QuantizedRows values, int format, int64_t span,
                       int64_t key_block, int64_t quantized_length, const float *k_window, const float *v_window,
                       int64_t window_row, int64_t window_length, float *out, int64_t group, int64_t dim,
                       float scale) {
#ifdef LANES
    if (dim % 32 == 0 && (format != FORMAT_INT4 || key_block || span % 32 == 0)) {
        attend_vector(q, keys, values, format, span, key_block, quantized_length, k_window, v_window, window_row,
                      window_length, out, group, dim, scale);
        return;
    }
#endif
    attend_generic(q, keys, values, format, span, key_block, quantized_length, k_window, v_window, window_row,
                   window_length, out, group, dim, scale);
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
    /* Tasks handed out one at a time: equal work, but on a shared machine one core is often slowed for a
     * while, and a static split then waits for it. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
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

/* ---- Quantizing a step's new rows (QuantizedLayerCache._store, token-axis scales): what
 * strategies/quantization.py's quantize_per_token computes, bit for bit, in one call instead of ~12
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
