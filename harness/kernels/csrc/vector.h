/* The vector type every kernel computes with, and what they do with it: as wide as the machine's
 * registers (AVX-512: 16 floats, AVX: 8, else 4), in GCC's vector extensions (+, *, loads and stores
 * as operators), so one source compiles to each ISA with -march=native. A 16-float vector on an AVX2
 * machine takes two registers each and spills.
 *
 * Where the vector extensions do not reach (an explicit FMA, a horizontal max, a rounding, a scale by
 * a power of two, a masked blend), the x86 intrinsics of the same width take vec as it is:
 * VECTOR_INTRINSICS is 1 where they are there (AVX-512 F/BW/VL at 16 lanes; AVX2 with F16C and FMA at
 * 8). The quantized kernel's vector path needs them and takes its generic path elsewhere.
 */
#ifndef HARNESS_VECTOR_H
#define HARNESS_VECTOR_H

#include <stdint.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vec __attribute__((vector_size(4 * LANES), aligned(4), may_alias)); /* LANES floats */

static inline vec load_vec(const float *p) { return *(const vec *)p; }
static inline void store_vec(float *p, vec v) { *(vec *)p = v; }

/* FOLD(x, y, h): half of each 2h-lane segment of x and of y, summed: segment s of the result holds
 * x's segment s folded to h lanes (lane i + h added to lane i), then y's. Lane i of either operand of
 * the sum is FOLD_LANE(i, h, part), an index into x's lanes then y's. log2(LANES) folds reduce LANES
 * vectors to one vector of their LANES sums (sum_lanes). */
#define FOLD_LANE(i, h, part) (((i) % (2 * (h)) < (h) ? (i) : LANES + (i) - (h)) + (part) * (h))
#define FOLD_4(first, h, part) FOLD_LANE(first, h, part), FOLD_LANE(first + 1, h, part), \
                               FOLD_LANE(first + 2, h, part), FOLD_LANE(first + 3, h, part)
#if LANES == 16
#define FOLD_ALL(h, part) FOLD_4(0, h, part), FOLD_4(4, h, part), FOLD_4(8, h, part), FOLD_4(12, h, part)
#elif LANES == 8
#define FOLD_ALL(h, part) FOLD_4(0, h, part), FOLD_4(4, h, part)
#else
#define FOLD_ALL(h, part) FOLD_4(0, h, part)
#endif
#define FOLD(x, y, h) (__builtin_shufflevector(x, y, FOLD_ALL(h, 0)) + __builtin_shufflevector(x, y, FOLD_ALL(h, 1)))

/* fold_h (FOLD at h), and the order in which sum_lanes takes its inputs: the folds leave lane j holding
 * input bitreverse(j). */
#if LANES == 16
static inline vec fold8(vec x, vec y) { return FOLD(x, y, 8); }
static inline vec fold4(vec x, vec y) { return FOLD(x, y, 4); }
static inline vec fold2(vec x, vec y) { return FOLD(x, y, 2); }
static inline vec fold1(vec x, vec y) { return FOLD(x, y, 1); }
static const int fold_order[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15}; /* bit reversal */
#elif LANES == 8
static inline vec fold4(vec x, vec y) { return FOLD(x, y, 4); }
static inline vec fold2(vec x, vec y) { return FOLD(x, y, 2); }
static inline vec fold1(vec x, vec y) { return FOLD(x, y, 1); }
static const int fold_order[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#else
static inline vec fold2(vec x, vec y) { return FOLD(x, y, 2); }
static inline vec fold1(vec x, vec y) { return FOLD(x, y, 1); }
static const int fold_order[4] = {0, 2, 1, 3};
#endif

/* Lane j of the result: the sum of part[j]'s lanes, a balanced tree (lane i + LANES/2 added first, lane
 * i + 1 last). */
static inline vec sum_lanes(const vec part[LANES]) {
    vec level[LANES];
    int count = LANES / 2;
#if LANES == 16
    for (int i = 0; i < count; i++) level[i] = fold8(part[fold_order[2 * i]], part[fold_order[2 * i + 1]]);
    for (int i = 0; i < count / 2; i++) level[i] = fold4(level[2 * i], level[2 * i + 1]);
    count /= 2;
#elif LANES == 8
    for (int i = 0; i < count; i++) level[i] = fold4(part[fold_order[2 * i]], part[fold_order[2 * i + 1]]);
#else
    for (int i = 0; i < count; i++) level[i] = fold2(part[fold_order[2 * i]], part[fold_order[2 * i + 1]]);
    return fold1(level[0], level[1]);
#endif
#if LANES >= 8
    for (int i = 0; i < count / 2; i++) level[i] = fold2(level[2 * i], level[2 * i + 1]);
    return fold1(level[0], level[1]);
#endif
}

#if LANES == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VECTOR_INTRINSICS 1
#define VECTOR_REGISTERS 32
#elif LANES == 8 && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define VECTOR_INTRINSICS 1
#define VECTOR_REGISTERS 16
#else
#define VECTOR_INTRINSICS 0
#endif

#if VECTOR_INTRINSICS
#include <immintrin.h>

#if LANES == 16
static inline vec splat(float x) { return _mm512_set1_ps(x); }
static inline vec fma_vec(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }     /* a * b + c, one rounding */
static inline vec fnma_vec(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }   /* c - a * b, one rounding */
static inline vec max_vec(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec round_vec(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec scale_by_exp2(vec y, vec n) { return _mm512_scalef_ps(y, n); } /* y * 2^n, n whole */
static inline float max_of_lanes(vec v) { return _mm512_reduce_max_ps(v); }
static inline float sum_of_lanes(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec keep_lanes(vec v, int64_t lanes, vec fill) { /* lanes < `lanes`: v's, the rest fill's */
    return _mm512_mask_blend_ps((__mmask16)((1u << lanes) - 1), fill, v);
}
#else
static inline vec splat(float x) { return _mm256_set1_ps(x); }
static inline vec fma_vec(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec fnma_vec(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vec max_vec(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec round_vec(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec scale_by_exp2(vec y, vec n) { /* the exponent field built from n */
    return y * _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline float max_of_lanes(vec v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float sum_of_lanes(vec v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
static inline vec keep_lanes(vec v, int64_t lanes, vec fill) {
    __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(fill, v, _mm256_castsi256_ps(keep));
}
#endif

/* exp(x) for x <= 0 (softmax's arguments), within ~2 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a
 * degree-5 polynomial for exp(r) - 1 - r, times 2^n); x below -87 gives exp(-87), which no sum notices.
 * glibc's vector expf called through libmvec cost more than the quantized kernel's dot products. */
static inline vec exp_nonpositive(vec x) {
    x = max_vec(x, splat(-87.0f));
    vec n = round_vec(x * splat(1.44269504088896341f));
    vec r = fnma_vec(n, splat(0.693359375f), x);
    r = fnma_vec(n, splat(-2.12194440e-4f), r);
    vec y = splat(1.9875691500e-4f);
    y = fma_vec(y, r, splat(1.3981999507e-3f));
    y = fma_vec(y, r, splat(8.3334519073e-3f));
    y = fma_vec(y, r, splat(4.1665795894e-2f));
    y = fma_vec(y, r, splat(1.6666665459e-1f));
    y = fma_vec(y, r, splat(5.0000001201e-1f));
    y = fma_vec(y, r * r, r + splat(1.0f));
    return scale_by_exp2(y, n);
}
#endif

#endif
