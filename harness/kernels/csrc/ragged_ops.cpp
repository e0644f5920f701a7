// The ragged attention kernels as torch operators (harness_kernels::ragged_*, a fragment of the library
// ops.cpp defines): a serving pool's decode step, each sequence at its own length (strategies/caches/
// contiguous.py, paged.py, quantized.py). As in ops.cpp: one schema per kernel, a CPU implementation
// that checks its tensors and calls the plain C entry point (kernels.h), and a Meta implementation.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "kernels.h"

namespace {

using at::Tensor;

// q [B, n_kv, G, D] fp32 and its group and width within the kernels' limits; the lengths (and starts)
// int64 [B], every length at least 1.
void check_ragged(const Tensor &q, const Tensor &lengths, const char *what) {
    TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 4,
                "q must be a 4-d float32 CPU tensor, got ", q.sizes(), " ", q.scalar_type());
    TORCH_CHECK(q.size(2) >= 1 && q.size(2) <= MAX_GROUP && q.size(3) >= 1 && q.size(3) <= MAX_DIM,
                "the attention kernels take 1 to ", MAX_GROUP, " query heads per KV head and head_dim up to ", MAX_DIM);
    TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1 && lengths.size(0) == q.size(0) &&
                    lengths.is_contiguous(),
                what, " must be contiguous int64 [", q.size(0), "]");
    const int64_t *length = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); b++) TORCH_CHECK(length[b] >= 1, "every sequence attends over at least 1 token");
}

// Rows starts[b] .. starts[b] + lengths[b] - 1 of every sequence lie within a table of `rows` rows.
void check_runs(const Tensor &starts, const Tensor &lengths, int64_t rows) {
    TORCH_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 && starts.size(0) == lengths.size(0) &&
                    starts.is_contiguous(),
                "starts must be contiguous int64 [", lengths.size(0), "]");
    const int64_t *start = starts.data_ptr<int64_t>(), *length = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < starts.size(0); b++)
        TORCH_CHECK(start[b] >= 0 && start[b] + length[b] <= rows, "sequence ", b, "'s rows ", start[b], "..",
                    start[b] + length[b], " run past the table's ", rows);
}

void check_table(const Tensor &t, const char *name, int64_t dims) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == dims && t.stride(-1) == 1, name, " must be a ", dims,
                "-d CPU tensor with contiguous rows, got ", t.sizes());
}

float inverse_sqrt(int64_t dim) { return (float)std::pow((double)dim, -0.5); }

// q [B, n_kv, G, D]; k, v [n_kv, S, D] fp32, sequence b at rows starts[b] .. starts[b] + lengths[b] - 1.
Tensor ragged_decode_attention_cpu(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &starts,
                                   const Tensor &lengths) {
    check_ragged(q, lengths, "lengths");
    check_table(k, "k", 3);
    check_table(v, "v", 3);
    TORCH_CHECK(k.scalar_type() == at::kFloat && v.sizes() == k.sizes() && k.size(0) == q.size(1) &&
                    k.size(2) == q.size(3),
                "k and v must be float32 [", q.size(1), ", S, ", q.size(3), "], got ", k.sizes(), " and ", v.sizes());
    check_runs(starts, lengths, k.size(1));
    const Tensor rows = q.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    const int64_t k_strides[2] = {k.stride(0), k.stride(1)}, v_strides[2] = {v.stride(0), v.stride(1)};
    ragged_decode_attention(rows.data_ptr<float>(), k.data_ptr<float>(), k_strides, v.data_ptr<float>(), v_strides,
                            starts.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<float>(), q.size(0),
                            q.size(1), q.size(2), q.size(3), inverse_sqrt(q.size(3)), at::get_num_threads());
    return out;
}

// q [B, n_kv, G, D]; pools head-major [n_blocks, n_kv, block_size, D] fp32; block_table [B, max_blocks]
// int32, row b holding sequence b's blocks; lengths [B].
Tensor ragged_paged_decode_attention_cpu(const Tensor &q, const Tensor &k_pool, const Tensor &v_pool,
                                         const Tensor &block_table, const Tensor &lengths) {
    check_ragged(q, lengths, "lengths");
    check_table(k_pool, "k_pool", 4);
    check_table(v_pool, "v_pool", 4);
    TORCH_CHECK(k_pool.scalar_type() == at::kFloat && v_pool.sizes() == k_pool.sizes() && k_pool.size(1) == q.size(1) &&
                    k_pool.size(3) == q.size(3),
                "pools ", k_pool.sizes(), " are not float32 head-major [n_blocks, ", q.size(1), ", block_size, ", q.size(3), "]");
    TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.size(0) == q.size(0) &&
                    block_table.stride(1) == 1,
                "the block table must be int32 [", q.size(0), ", max_blocks] with contiguous rows");
    const int64_t block_size = k_pool.size(2);
    const int64_t *length = lengths.data_ptr<int64_t>();
    const int32_t *ids = block_table.data_ptr<int32_t>();
    for (int64_t b = 0; b < q.size(0); b++) {
        const int64_t used = (length[b] + block_size - 1) / block_size;
        TORCH_CHECK(used <= block_table.size(1), "a table of ", block_table.size(1), " blocks of ", block_size,
                    " cannot hold sequence ", b, "'s ", length[b], " tokens");
        for (int64_t i = 0; i < used; i++) {
            const int32_t id = ids[b * block_table.stride(0) + i];
            TORCH_CHECK(id >= 0 && id < k_pool.size(0), "block id ", id, " lies outside the pool's ", k_pool.size(0),
                        " blocks");
        }
    }
    const Tensor rows = q.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    const int64_t k_strides[3] = {k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)};
    const int64_t v_strides[3] = {v_pool.stride(0), v_pool.stride(1), v_pool.stride(2)};
    ragged_paged_decode_attention(rows.data_ptr<float>(), k_pool.data_ptr<float>(), k_strides, v_pool.data_ptr<float>(),
                                  v_strides, block_table.data_ptr<int32_t>(), block_table.stride(0),
                                  lengths.data_ptr<int64_t>(), out.data_ptr<float>(), q.size(0), q.size(1), q.size(2),
                                  block_size, q.size(3), inverse_sqrt(q.size(3)), at::get_num_threads());
    return out;
}

// q [B, n_kv, G, D]; payloads [n_kv, S, W] one-byte codes, scales [n_kv, S, D / span] fp32 (token axis),
// sequence b at rows starts[b] .. starts[b] + lengths[b] - 1.
Tensor ragged_quantized_decode_attention_cpu(const Tensor &q, const Tensor &k_payload, const Tensor &k_scales,
                                             const Tensor &v_payload, const Tensor &v_scales, const Tensor &starts,
                                             const Tensor &lengths, int64_t format, int64_t span) {
    check_ragged(q, lengths, "lengths");
    for (auto [t, name] : {std::pair{&k_payload, "k_payload"}, {&v_payload, "v_payload"}}) {
        check_table(*t, name, 3);
        TORCH_CHECK(t->element_size() == 1 && t->size(0) == q.size(1), name, " must hold one-byte codes [", q.size(1),
                    ", S, W]");
    }
    for (auto [t, name] : {std::pair{&k_scales, "k_scales"}, {&v_scales, "v_scales"}}) {
        check_table(*t, name, 3);
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->size(1) == k_payload.size(1) && t->size(2) * span == q.size(3),
                    name, " must be float32 [n_kv, S, D / span]");
    }
    TORCH_CHECK(format == FORMAT_INT8 || format == FORMAT_INT4 || format == FORMAT_FP8_E4M3, "unknown format code ", format);
    TORCH_CHECK(span >= 1 && q.size(3) % span == 0, "span must divide head_dim");
    TORCH_CHECK(k_payload.size(2) == (format == FORMAT_INT4 ? q.size(3) / 2 : q.size(3)) && v_payload.sizes() == k_payload.sizes(),
                "payload rows do not fit head_dim ", q.size(3), " in this format");
    check_runs(starts, lengths, k_payload.size(1));
    const Tensor rows = q.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    // The batched kernel's tables are [B, n_kv, S, W]: these are its B = 1, strides (0, head, row).
    const int64_t k_strides[3] = {0, k_payload.stride(0), k_payload.stride(1)};
    const int64_t v_strides[3] = {0, v_payload.stride(0), v_payload.stride(1)};
    const int64_t k_scale_strides[3] = {0, k_scales.stride(0), k_scales.stride(1)};
    const int64_t v_scale_strides[3] = {0, v_scales.stride(0), v_scales.stride(1)};
    const quantized_table keys = {static_cast<const uint8_t *>(k_payload.data_ptr()), k_strides,
                                  k_scales.data_ptr<float>(), k_scale_strides};
    const quantized_table values = {static_cast<const uint8_t *>(v_payload.data_ptr()), v_strides,
                                    v_scales.data_ptr<float>(), v_scale_strides};
    ragged_quantized_decode_attention(rows.data_ptr<float>(), keys, values, starts.data_ptr<int64_t>(),
                                      lengths.data_ptr<int64_t>(), out.data_ptr<float>(), q.size(0), q.size(1),
                                      q.size(2), q.size(3), (int)format, span, inverse_sqrt(q.size(3)),
                                      at::get_num_threads());
    return out;
}

Tensor like_q(const Tensor &q) { return at::empty_symint(q.sym_sizes(), q.options()); }

Tensor ragged_decode_attention_meta(const Tensor &q, const Tensor &, const Tensor &, const Tensor &, const Tensor &) {
    return like_q(q);
}

Tensor ragged_paged_decode_attention_meta(const Tensor &q, const Tensor &, const Tensor &, const Tensor &,
                                          const Tensor &) {
    return like_q(q);
}

Tensor ragged_quantized_decode_attention_meta(const Tensor &q, const Tensor &, const Tensor &, const Tensor &,
                                              const Tensor &, const Tensor &, const Tensor &, int64_t, int64_t) {
    return like_q(q);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(harness_kernels, m) {
    m.def("ragged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor lengths) -> Tensor");
    m.def("ragged_paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, "
          "Tensor lengths) -> Tensor");
    m.def("ragged_quantized_decode_attention(Tensor q, Tensor k_payload, Tensor k_scales, Tensor v_payload, "
          "Tensor v_scales, Tensor starts, Tensor lengths, int format, int span) -> Tensor");
}

TORCH_LIBRARY_IMPL(harness_kernels, CPU, m) {
    m.impl("ragged_decode_attention", &ragged_decode_attention_cpu);
    m.impl("ragged_paged_decode_attention", &ragged_paged_decode_attention_cpu);
    m.impl("ragged_quantized_decode_attention", &ragged_quantized_decode_attention_cpu);
}

TORCH_LIBRARY_IMPL(harness_kernels, Meta, m) {
    m.impl("ragged_decode_attention", &ragged_decode_attention_meta);
    m.impl("ragged_paged_decode_attention", &ragged_paged_decode_attention_meta);
    m.impl("ragged_quantized_decode_attention", &ragged_quantized_decode_attention_meta);
}
