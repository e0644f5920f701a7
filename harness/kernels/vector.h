/* The vector type every C kernel of the project computes with (the attention reads under strategies/,
 * the model's small-batch linear): as wide as the machine's registers (AVX-512: 16 floats, AVX: 8,
 * else 4), in GCC's vector extensions, so one source compiles to each ISA with -march=native. A 16-float
 * vector on an AVX2 machine, two registers each, spilled and ran at a third of the speed.
 * Found through -I (harness/kernels/build.py puts this folder on every kernel's include path). */
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

#endif
