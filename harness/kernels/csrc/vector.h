/* The vector type the fp32 kernels compute with (cpu_decode_attention.c, cpu_paged_attention.c through
 * cpu_attention_fixed.h, cpu_gemv.c), and its LANES-at-once horizontal sum: as wide as the machine's
 * registers (AVX-512: 16 floats, AVX: 8, else 4), in GCC's vector extensions, so one source compiles
 * to each ISA with -march=native. A 16-float vector on an AVX2 machine takes two registers each and
 * spills. */
#ifndef HARNESS_VECTOR_H
#define HARNESS_VECTOR_H

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

/* fold_h: half of each 2h-lane segment of x and of y, summed: segment s of the result holds x's
 * segment s folded to h lanes, then y's. log2(LANES) such steps reduce LANES vectors to one vector of
 * their LANES sums (sum_lanes). */
#define FOLD(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#if LANES == 16
static inline vec fold8(vec x, vec y) {
    return FOLD(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           FOLD(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline vec fold4(vec x, vec y) {
    return FOLD(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           FOLD(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
static inline vec fold2(vec x, vec y) {
    return FOLD(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           FOLD(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
static inline vec fold1(vec x, vec y) {
    return FOLD(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           FOLD(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
static const int fold_order[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15}; /* bit reversal */
#elif LANES == 8
static inline vec fold4(vec x, vec y) {
    return FOLD(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + FOLD(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
}
static inline vec fold2(vec x, vec y) {
    return FOLD(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + FOLD(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
}
static inline vec fold1(vec x, vec y) {
    return FOLD(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + FOLD(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
}
static const int fold_order[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#else
static inline vec fold2(vec x, vec y) { return FOLD(x, y, 0, 1, 4, 5) + FOLD(x, y, 2, 3, 6, 7); }
static inline vec fold1(vec x, vec y) { return FOLD(x, y, 0, 4, 2, 6) + FOLD(x, y, 1, 5, 3, 7); }
static const int fold_order[4] = {0, 2, 1, 3};
#endif

/* Lane j of the result: the sum of part[j]'s lanes. The tree leaves lane j holding input
 * bitreverse(j), so it takes its inputs in bit-reversed order. */
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

#endif
