// What the operators' CPU implementations share (ops.cpp, ops_compacted.cpp): the checks of their
// tensors against the kernels' limits (kernels.h), and the arguments every kernel takes alike.
#ifndef HARNESS_OPS_SUPPORT_H
#define HARNESS_OPS_SUPPORT_H

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <vector>

#include "kernels.h"

namespace {

using at::Tensor;

inline void check_float(const Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor, got ",
                t.scalar_type(), " on ", t.device());
}

inline void check_rows(const Tensor &t, const char *name) {
    TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, "'s rows must be contiguous");
}

// The one check of the attention kernels' limits (kernels.h).
inline void check_heads(int64_t group, int64_t dim) {
    TORCH_CHECK(group >= 1 && group <= MAX_GROUP && dim >= 1 && dim <= MAX_DIM, "the attention kernels take 1 to ",
                MAX_GROUP, " query heads per KV head and head_dim up to ", MAX_DIM, "; got ", group, " and ", dim);
}

// q [B, n_kv, G, D] and the two tables an attention kernel reads with it: float32 CPU tensors, 4-d, the
// tables' rows contiguous, G and D within the kernels' limits.
inline void check_attention(const Tensor &q, const Tensor &k, const char *k_name, const Tensor &v, const char *v_name) {
    for (auto [t, name] : {std::pair{&q, "q"}, {&k, k_name}, {&v, v_name}}) {
        check_float(*t, name);
        TORCH_CHECK(t->dim() == 4, name, " must be 4-d, got ", t->sizes());
    }
    check_rows(k, k_name);
    check_rows(v, v_name);
    check_heads(q.size(2), q.size(3));
}

// The first three strides of a 4-d tensor (zeros for an absent one), as the kernels take them.
inline std::vector<int64_t> strides3(const Tensor &t) {
    return {t.stride(0), t.stride(1), t.stride(2)};
}

inline int threads() { return at::get_num_threads(); }

// The softmax scale 1 / sqrt(D) in fp32, rounded from the double as Python's head_dim**-0.5 is.
inline float inverse_sqrt(int64_t dim) { return (float)std::pow((double)dim, -0.5); }

inline Tensor same_shape_meta(const Tensor &q) { return at::empty_symint(q.sym_sizes(), q.options()); }

inline const uint8_t *bytes(const Tensor &t) { return static_cast<const uint8_t *>(t.data_ptr()); }

inline void check_payload(const Tensor &payload, const char *name) {
    TORCH_CHECK(payload.device().is_cpu() && payload.element_size() == 1 && payload.dim() == 4 &&
                    payload.stride(3) == 1,
                name, " must be a 4-d CPU tensor of one-byte codes with contiguous rows");
}

}  // namespace

#endif
