// The CPU kernels as torch operators (namespace harness_kernels): one schema per kernel, a CPU
// implementation that checks its tensors and calls the plain C entry point (kernels.h), and a Meta
// implementation that gives the output's shape without touching data, which torch.compile's fake
// tensors run. Eager code and compiled graphs call the same operator. With ops_compacted.cpp (the
// compacted-slot and pruned-key kernels' implementations) the only translation units that include
// torch headers, and only the dispatcher's and the tensor's; ops_support.h holds their shared checks.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "ops_compacted.h"
#include "ops_support.h"

namespace {

using at::Tensor;

// Every constant Python needs, by name: read once per process (harness.kernels.extension.Extension.constants).
std::tuple<std::vector<std::string>, std::vector<int64_t>> constants() {
    return {{"MAX_GROUP", "MAX_DIM", "FORMAT_INT8", "FORMAT_INT4", "FORMAT_FP8_E4M3", "SLOTS_FP32",
             "STEP_WEIGHTS_IGNORE", "STEP_WEIGHTS_ACCUMULATE", "STEP_WEIGHTS_REPLACE"},
            {MAX_GROUP, MAX_DIM, FORMAT_INT8, FORMAT_INT4, FORMAT_FP8_E4M3, SLOTS_FP32, STEP_WEIGHTS_IGNORE,
             STEP_WEIGHTS_ACCUMULATE, STEP_WEIGHTS_REPLACE}};
}

// Scratch a call reuses: per calling thread, grown to the largest call seen, never shrunk.
float *scratch(std::vector<float> &buffer, int64_t floats) {
    if ((int64_t)buffer.size() < floats) buffer.resize(floats);
    return buffer.data();
}

// ---- Attention ----

// q [B, n_kv, G, D]; k, v [B, n_kv, S, D] (rows 0..length-1 read, rows visible.. weighted 0) -> [B, n_kv, G, D].
Tensor decode_attention_cpu(const Tensor &q, const Tensor &k, const Tensor &v, int64_t length, int64_t visible) {
    check_attention(q, k, "k", v, "v");
    const int64_t batch = q.size(0), n_kv = q.size(1), group = q.size(2), dim = q.size(3);
    TORCH_CHECK(k.size(0) == batch && k.size(1) == n_kv && k.size(3) == dim && v.sizes() == k.sizes(),
                "k and v must be [", batch, ", ", n_kv, ", S, ", dim, "], got ", k.sizes(), " and ", v.sizes());
    TORCH_CHECK(0 < length && length <= k.size(2) && 0 < visible && visible <= length,
                "need 0 < visible <= length <= ", k.size(2), "; got visible ", visible, ", length ", length);
    const Tensor rows = q.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    const auto k_strides = strides3(k), v_strides = strides3(v);
    decode_attention(rows.data_ptr<float>(), k.data_ptr<float>(), k_strides.data(), v.data_ptr<float>(),
                     v_strides.data(), out.data_ptr<float>(), batch, n_kv, group, length, visible, dim,
                     inverse_sqrt(dim), threads());
    return out;
}

Tensor decode_attention_meta(const Tensor &q, const Tensor &, const Tensor &, c10::SymInt, c10::SymInt) {
    return same_shape_meta(q);
}

// q [B, n_kv, G, D]; pools head-major [n_blocks, n_kv, block_size, D]; block_table [B, max_blocks] int32.
Tensor paged_decode_attention_cpu(const Tensor &q, const Tensor &k_pool, const Tensor &v_pool,
                                  const Tensor &block_table, int64_t length) {
    check_attention(q, k_pool, "k_pool", v_pool, "v_pool");
    const int64_t batch = q.size(0), n_kv = q.size(1), group = q.size(2), dim = q.size(3);
    TORCH_CHECK(k_pool.size(1) == n_kv && k_pool.size(3) == dim && v_pool.sizes() == k_pool.sizes(),
                "pools ", k_pool.sizes(), " and ", v_pool.sizes(), " are not head-major [n_blocks, ", n_kv,
                ", block_size, ", dim, "]");
    TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.size(0) == batch &&
                    block_table.stride(1) == 1,
                "the block table must be int32 [", batch, ", max_blocks] with contiguous rows");
    const int64_t block_size = k_pool.size(2);
    TORCH_CHECK(0 < length && length <= block_table.size(1) * block_size, "a table of ", block_table.size(1),
                " blocks of ", block_size, " cannot hold ", length, " tokens");
    const Tensor rows = q.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    const auto k_strides = strides3(k_pool), v_strides = strides3(v_pool);
    paged_decode_attention(rows.data_ptr<float>(), k_pool.data_ptr<float>(), k_strides.data(),
                           v_pool.data_ptr<float>(), v_strides.data(), block_table.data_ptr<int32_t>(),
                           block_table.stride(0), out.data_ptr<float>(), batch, n_kv, group, length, block_size, dim,
                           inverse_sqrt(dim), threads());
    return out;
}

Tensor paged_decode_attention_meta(const Tensor &q, const Tensor &, const Tensor &, const Tensor &, c10::SymInt) {
    return same_shape_meta(q);
}

// q [B, n_kv, G, D] over the quantized tokens 0..quantized_length-1 (payloads [B, n_kv, S, W], fp32
// scales), then the windows' rows 0..window_length-1 ([B, n_kv, R, D] fp32) -> [B, n_kv, G, D].
Tensor quantized_decode_attention_cpu(const Tensor &q, const Tensor &k_payload, const Tensor &k_scales,
                                      const Tensor &v_payload, const Tensor &v_scales,
                                      const std::optional<Tensor> &k_window, const std::optional<Tensor> &v_window,
                                      int64_t quantized_length, int64_t window_length, int64_t format, int64_t span,
                                      int64_t key_block) {
    check_float(q, "q");
    check_float(k_scales, "k_scales");
    check_float(v_scales, "v_scales");
    check_payload(k_payload, "k_payload");
    check_payload(v_payload, "v_payload");
    TORCH_CHECK(q.dim() == 4 && k_scales.dim() == 4 && v_scales.dim() == 4, "q and the scales must be 4-d");
    const int64_t batch = q.size(0), n_kv = q.size(1), group = q.size(2), dim = q.size(3);
    check_heads(group, dim);
    TORCH_CHECK(format == FORMAT_INT8 || format == FORMAT_INT4 || format == FORMAT_FP8_E4M3, "unknown format code ",
                format);
    TORCH_CHECK(span >= 1 && dim % span == 0 && key_block >= 0, "span must divide head_dim; key_block >= 0");
    TORCH_CHECK(quantized_length >= 0 && quantized_length <= k_payload.size(2) && window_length >= 0 &&
                    quantized_length + window_length > 0,
                "no tokens to attend over, or more quantized tokens than the tables hold");
    const bool windowed = window_length > 0;
    if (windowed) {
        TORCH_CHECK(k_window.has_value() && v_window.has_value(), "window_length > 0 needs both windows");
        check_float(*k_window, "k_window");
        check_float(*v_window, "v_window");
        TORCH_CHECK(k_window->dim() == 4 && window_length <= k_window->size(2) && k_window->stride(3) == 1 &&
                        v_window->strides() == k_window->strides() && v_window->sizes() == k_window->sizes(),
                    "the windows must be alike [B, n_kv, R, D] with contiguous rows and at least window_length rows");
    }
    const Tensor rows = q.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    const auto k_strides = strides3(k_payload), v_strides = strides3(v_payload);
    const auto k_scale_strides = strides3(k_scales), v_scale_strides = strides3(v_scales);
    const auto window_strides = windowed ? strides3(*k_window) : std::vector<int64_t>{0, 0, 0};
    const quantized_table keys = {bytes(k_payload), k_strides.data(), k_scales.data_ptr<float>(), k_scale_strides.data()};
    const quantized_table values = {bytes(v_payload), v_strides.data(), v_scales.data_ptr<float>(),
                                    v_scale_strides.data()};
    quantized_decode_attention(rows.data_ptr<float>(), keys, values, windowed ? k_window->data_ptr<float>() : nullptr,
                               windowed ? v_window->data_ptr<float>() : nullptr, window_strides.data(),
                               out.data_ptr<float>(), batch, n_kv, group, quantized_length, window_length, dim,
                               (int)format, span, key_block, inverse_sqrt(dim), threads());
    return out;
}

Tensor quantized_decode_attention_meta(const Tensor &q, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                                       const std::optional<Tensor> &, const std::optional<Tensor> &, c10::SymInt,
                                       c10::SymInt, int64_t, int64_t, int64_t) {
    return same_shape_meta(q);
}

// x [B, n_kv, n, D] fp32 quantized per token into rows start..start+n-1 of payload [B, n_kv, S, W] and
// scales [B, n_kv, S, D / span], in place.
void quantize_rows_cpu(const Tensor &x, const Tensor &payload, const Tensor &scales, int64_t format, int64_t span,
                       int64_t start) {
    check_float(x, "x");
    check_float(scales, "scales");
    check_payload(payload, "payload");
    TORCH_CHECK(x.dim() == 4 && scales.dim() == 4 && x.stride(3) == 1, "x [B, n_kv, n, D] with contiguous rows");
    const int64_t batch = x.size(0), n_kv = x.size(1), n = x.size(2), dim = x.size(3);
    TORCH_CHECK(format == FORMAT_INT8 || format == FORMAT_INT4 || format == FORMAT_FP8_E4M3, "unknown format code ",
                format);
    const int64_t width = format == FORMAT_INT4 ? dim / 2 : dim;
    TORCH_CHECK(span >= 1 && dim % span == 0 && start >= 0 && start + n <= payload.size(2) &&
                    payload.size(0) == batch && payload.size(1) == n_kv && payload.size(3) == width &&
                    scales.size(2) >= start + n && scales.size(3) == dim / span,
                "rows ", start, "..", start + n, " of shape ", x.sizes(), " do not fit the table ", payload.sizes(),
                " and scales ", scales.sizes());
    const auto x_strides = strides3(x), payload_strides = strides3(payload), scale_strides = strides3(scales);
    quantize_rows(x.data_ptr<float>(), x_strides.data(), batch, n_kv, n, dim, (int)format, span,
                  static_cast<uint8_t *>(payload.data_ptr()), payload_strides.data(), scales.data_ptr<float>(),
                  scale_strides.data(), start);
}

void quantize_rows_meta(const Tensor &, const Tensor &, const Tensor &, int64_t, int64_t, c10::SymInt) {}

// ---- The small-batch linear and a decoder block ----

// x [..., in] @ weight [out, in]^T -> [..., out].
Tensor gemv_cpu(const Tensor &x, const Tensor &weight) {
    check_float(x, "x");
    check_float(weight, "weight");
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == weight.size(1),
                "x [..., ", weight.size(-1), "] against a contiguous weight [out, in], got ", x.sizes(), " and ",
                weight.sizes());
    const Tensor rows = x.contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    Tensor out = at::empty(shape, x.options());
    gemv(rows.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows.numel() / weight.size(1),
         weight.size(1), weight.size(0), threads());
    return out;
}

Tensor gemv_meta(const Tensor &x, const Tensor &weight) {
    std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
    shape.back() = weight.sym_size(0);
    return at::empty_symint(shape, x.options());
}

// x [..., dim] * weight / sqrt(mean(x^2) + eps), on one thread.
Tensor rms_norm_cpu(const Tensor &x, const Tensor &weight, double eps) {
    check_float(x, "x");
    check_float(weight, "weight");
    TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == weight.size(0),
                "x [..., ", weight.size(0), "] against a contiguous weight [dim]");
    const Tensor rows = x.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    rms_norm_rows(rows.data_ptr<float>(), weight.data_ptr<float>(), (float)eps, out.data_ptr<float>(),
                  rows.numel() / weight.size(0), weight.size(0));
    return out;
}

Tensor rms_norm_meta(const Tensor &x, const Tensor &, double) { return same_shape_meta(x); }

void check_contiguous(std::initializer_list<std::pair<const Tensor *, const char *>> tensors) {
    for (auto [t, name] : tensors) {
        check_float(*t, name);
        TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
    }
}

// rope(rms_norm(x) @ wqkv^T): x [B, T, d_model] at positions start_pos.., cos/sin [max_len, D] ->
// [B, T, n_heads + 2 n_kv_heads, D], queries and keys roped.
Tensor attention_input_cpu(const Tensor &x, const Tensor &norm_weight, double eps, const Tensor &wqkv,
                           const Tensor &cos, const Tensor &sin, int64_t start_pos, int64_t n_heads,
                           int64_t n_kv_heads) {
    check_contiguous({{&x, "x"}, {&norm_weight, "norm_weight"}, {&wqkv, "wqkv"}, {&cos, "cos"}, {&sin, "sin"}});
    TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes(), "x [B, T, d_model], cos/sin [max_len, D]");
    const int64_t batch = x.size(0), tokens = x.size(1), d_model = x.size(2), dim = cos.size(1);
    const int64_t heads = n_heads + 2 * n_kv_heads;
    TORCH_CHECK(norm_weight.numel() == d_model && wqkv.dim() == 2 && wqkv.size(0) == heads * dim &&
                    wqkv.size(1) == d_model && start_pos >= 0 && start_pos + tokens <= cos.size(0),
                "wqkv ", wqkv.sizes(), " or the positions ", start_pos, "..", start_pos + tokens,
                " do not fit x ", x.sizes(), " and tables ", cos.sizes());
    Tensor qkv = at::empty({batch, tokens, heads, dim}, x.options());
    thread_local std::vector<float> normed;
    attention_input(x.data_ptr<float>(), norm_weight.data_ptr<float>(), (float)eps, wqkv.data_ptr<float>(),
                    cos.data_ptr<float>() + start_pos * dim, sin.data_ptr<float>() + start_pos * dim,
                    scratch(normed, batch * tokens * d_model), qkv.data_ptr<float>(), batch, tokens, d_model, heads,
                    n_heads + n_kv_heads, dim, threads());
    return qkv;
}

Tensor attention_input_meta(const Tensor &x, const Tensor &, double, const Tensor &, const Tensor &cos, const Tensor &,
                            c10::SymInt, int64_t n_heads, int64_t n_kv_heads) {
    return at::empty_symint({x.sym_size(0), x.sym_size(1), c10::SymInt(n_heads + 2 * n_kv_heads), cos.sym_size(1)},
                            x.options());
}

// x += attention @ wo^T; x += swiglu(rms_norm(x)), in place on x [B, T, d_model]; attention [B, T, H, D].
void attention_output_and_ffn_cpu(const Tensor &x, const Tensor &attention, const Tensor &wo,
                                  const Tensor &norm_weight, double eps, const Tensor &w13, const Tensor &w2) {
    check_contiguous({{&x, "x"}, {&attention, "attention"}, {&wo, "wo"}, {&norm_weight, "norm_weight"},
                      {&w13, "w13"}, {&w2, "w2"}});
    const int64_t d_model = x.size(-1), rows = x.numel() / d_model, ffn = w2.size(1);
    TORCH_CHECK(wo.dim() == 2 && wo.size(0) == d_model && attention.numel() == rows * wo.size(1) &&
                    norm_weight.numel() == d_model && w13.dim() == 2 && w13.size(0) == 2 * ffn &&
                    w13.size(1) == d_model && w2.size(0) == d_model,
                "the block's weights do not fit x ", x.sizes(), " and attention ", attention.sizes());
    thread_local std::vector<float> normed, gate_up, hidden;
    attention_output_and_ffn(attention.data_ptr<float>(), wo.data_ptr<float>(), x.data_ptr<float>(),
                             norm_weight.data_ptr<float>(), (float)eps, w13.data_ptr<float>(), w2.data_ptr<float>(),
                             scratch(normed, rows * d_model), scratch(gate_up, rows * 2 * ffn),
                             scratch(hidden, rows * ffn), rows, d_model, wo.size(1), ffn, threads());
}

void attention_output_and_ffn_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &, double,
                                   const Tensor &, const Tensor &) {}

}  // namespace

TORCH_LIBRARY(harness_kernels, m) {
    m.def("constants() -> (str[], int[])", &constants);
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, SymInt length, SymInt visible) -> Tensor");
    m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, SymInt length) -> Tensor");
    m.def("quantized_decode_attention(Tensor q, Tensor k_payload, Tensor k_scales, Tensor v_payload, Tensor v_scales, "
          "Tensor? k_window, Tensor? v_window, SymInt quantized_length, SymInt window_length, int format, int span, "
          "int key_block) -> Tensor");
    m.def("quantize_rows_(Tensor x, Tensor(a!) payload, Tensor(b!) scales, int format, int span, SymInt start) -> ()");
    m.def("compacted_decode_attention(Tensor q, Tensor[] keys, Tensor[] values, Tensor fill, Tensor(a!)? scores, "
          "int step_weights, int format, int span) -> Tensor");
    m.def("evicting_decode_step_(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!)[] keys, Tensor(b!)[] values, "
          "Tensor(c!) fill, Tensor(d!) positions, Tensor(e!) scores, Tensor(f!) free, SymInt position, float entry_score, "
          "int step_weights, int budget, int protected_first, int protected_recent, int format, int span, "
          "Tensor(g!)? sink_keys, Tensor? cos, Tensor? sin) -> Tensor");
    m.def("pruned_key_decode_attention_(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k, Tensor(b!) v, "
          "Tensor channels, SymInt position) -> Tensor");
    m.def("gemv(Tensor x, Tensor weight) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("attention_input(Tensor x, Tensor norm_weight, float eps, Tensor wqkv, Tensor cos, Tensor sin, "
          "SymInt start_pos, int n_heads, int n_kv_heads) -> Tensor");
    m.def("attention_output_and_ffn_(Tensor(a!) x, Tensor attention, Tensor wo, Tensor norm_weight, float eps, "
          "Tensor w13, Tensor w2) -> ()");
}

// Every operator: its name, and the stem of its CPU (<stem>_cpu) and Meta (<stem>_meta) implementations.
#define OPERATORS(X)                                                                                       \
    X("decode_attention", decode_attention) X("paged_decode_attention", paged_decode_attention)           \
    X("quantized_decode_attention", quantized_decode_attention) X("quantize_rows_", quantize_rows)       \
    X("compacted_decode_attention", compacted_decode_attention)                                           \
    X("evicting_decode_step_", evicting_decode_step)                                                      \
    X("pruned_key_decode_attention_", pruned_key_decode_attention)                                        \
    X("gemv", gemv) X("rms_norm", rms_norm) X("attention_input", attention_input)                         \
    X("attention_output_and_ffn_", attention_output_and_ffn)

TORCH_LIBRARY_IMPL(harness_kernels, CPU, m) {
#define CPU_IMPLEMENTATION(name, stem) m.impl(name, &stem##_cpu);
    OPERATORS(CPU_IMPLEMENTATION)
}

TORCH_LIBRARY_IMPL(harness_kernels, Meta, m) {
#define META_IMPLEMENTATION(name, stem) m.impl(name, &stem##_meta);
    OPERATORS(META_IMPLEMENTATION)
}
