// The compacted-slot and pruned-key kernels as torch operators (cpu_compacted_attention.c,
// cpu_pruned_attention.c): each CPU implementation checks its tensors (everything a kernel would index
// by a value read from a tensor, fill counts, free slots and channels, is checked against the tables
// here) and calls the plain C entry point; ops.cpp registers them beside the others.
#include "ops_compacted.h"

#include <optional>

#include "ops_support.h"

namespace {

// The slots' tables as the kernels take them: keys/values [t] fp32 [B, n_kv, S, D] (format
// SLOTS_FP32), or [payload, scales] of a format. `strides` keeps the strides the struct points at.
struct SlotTables {
    compacted_slots slots;
    std::vector<int64_t> strides[4];
};

SlotTables slot_tables(const std::vector<Tensor> &keys, const std::vector<Tensor> &values, int64_t format, int64_t span,
                       int64_t batch, int64_t n_kv, int64_t dim) {
    SlotTables tables{};
    compacted_slots &slots = tables.slots;
    slots.format = (int)format;
    slots.span = span;
    if (format == SLOTS_FP32) {
        TORCH_CHECK(keys.size() == 1 && values.size() == 1, "fp32 slots are one key and one value table");
        for (auto [t, name] : {std::pair{&keys[0], "k slots"}, {&values[0], "v slots"}}) {
            check_float(*t, name);
            TORCH_CHECK(t->dim() == 4, name, " must be 4-d, got ", t->sizes());
            check_rows(*t, name);
        }
        TORCH_CHECK(keys[0].size(0) == batch && keys[0].size(1) == n_kv && keys[0].size(3) == dim &&
                        values[0].sizes() == keys[0].sizes(),
                    "slots must be [", batch, ", ", n_kv, ", S, ", dim, "], got ", keys[0].sizes(), " and ",
                    values[0].sizes());
        tables.strides[0] = strides3(keys[0]);
        tables.strides[1] = strides3(values[0]);
        slots.k = keys[0].data_ptr<float>(), slots.v = values[0].data_ptr<float>();
        slots.k_strides = tables.strides[0].data(), slots.v_strides = tables.strides[1].data();
        return tables;
    }
    TORCH_CHECK(format == FORMAT_INT8 || format == FORMAT_INT4 || format == FORMAT_FP8_E4M3, "unknown format code ",
                format);
    TORCH_CHECK(keys.size() == 2 && values.size() == 2, "quantized slots are [payload, scales] for keys and values");
    const int64_t width = format == FORMAT_INT4 ? dim / 2 : dim;
    TORCH_CHECK(span >= 1 && dim % span == 0 && (format != FORMAT_INT4 || span % 2 == 0), "span ", span,
                " must divide head_dim ", dim, " (and be even for int4)");
    for (const auto *table : {&keys, &values}) {
        check_payload((*table)[0], "payload");
        check_float((*table)[1], "scales");
        TORCH_CHECK((*table)[0].size(0) == batch && (*table)[0].size(1) == n_kv && (*table)[0].size(3) == width &&
                        (*table)[1].dim() == 4 && (*table)[1].size(2) == (*table)[0].size(2) &&
                        (*table)[1].size(3) == dim / span && (*table)[1].size(0) == batch &&
                        (*table)[1].size(1) == n_kv && (*table)[1].stride(3) == 1,
                    "quantized slots [", batch, ", ", n_kv, ", S, ", width, "] with scales [", batch, ", ", n_kv,
                    ", S, ", dim / span, "], got ", (*table)[0].sizes(), " and ", (*table)[1].sizes());
    }
    TORCH_CHECK(values[0].size(2) == keys[0].size(2), "key and value slots must be as many");
    for (int i = 0; i < 4; i++) tables.strides[i] = strides3((i < 2 ? keys : values)[i % 2]);
    slots.k = keys[0].data_ptr(), slots.v = values[0].data_ptr();
    slots.k_strides = tables.strides[0].data(), slots.v_strides = tables.strides[2].data();
    slots.k_scales = keys[1].data_ptr<float>(), slots.v_scales = values[1].data_ptr<float>();
    slots.k_scale_strides = tables.strides[1].data(), slots.v_scale_strides = tables.strides[3].data();
    return tables;
}

// fill [B, n_kv] int32 contiguous, each in lowest..slots.
void check_fill(const Tensor &fill, int64_t batch, int64_t n_kv, int64_t slots, int64_t lowest) {
    TORCH_CHECK(fill.device().is_cpu() && fill.scalar_type() == at::kInt && fill.is_contiguous() && fill.dim() == 2 &&
                    fill.size(0) == batch && fill.size(1) == n_kv,
                "fill must be a contiguous int32 [", batch, ", ", n_kv, "], got ", fill.sizes());
    const int32_t *counts = fill.data_ptr<int32_t>();
    for (int64_t pair = 0; pair < batch * n_kv; pair++)
        TORCH_CHECK(lowest <= counts[pair] && counts[pair] <= slots, "fill ", counts[pair], " outside ", lowest, "..",
                    slots, " (the slots a pair has)");
}

// A per-slot table [B, n_kv, >= slots] of `type`, slots contiguous.
void check_slot_table(const Tensor &t, at::ScalarType type, const char *name, int64_t batch, int64_t n_kv,
                      int64_t slots) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 3 && t.size(0) == batch &&
                    t.size(1) == n_kv && t.size(2) >= slots && t.stride(2) == 1,
                name, " must be a CPU ", type, " [", batch, ", ", n_kv, ", ", slots, "] with contiguous slots, got ",
                t.scalar_type(), " ", t.sizes());
}

// k_new, v_new [B, n_kv, D] (a step's new rows; copies where they are not contiguous).
Tensor new_rows(const Tensor &x, const char *name, int64_t batch, int64_t n_kv, int64_t dim) {
    check_float(x, name);
    TORCH_CHECK(x.numel() == batch * n_kv * dim, name, " must hold [", batch, ", ", n_kv, ", ", dim, "], got ",
                x.sizes());
    return x.contiguous();
}

// The query [B, n_kv, G, D] fp32 both entry points take, checked: its sizes.
struct QueryShape {
    int64_t batch, n_kv, group, dim;
};

QueryShape query_shape(const Tensor &q) {
    check_float(q, "q");
    TORCH_CHECK(q.dim() == 4, "q must be 4-d [B, n_kv, G, D], got ", q.sizes());
    check_heads(q.size(2), q.size(3));
    return {q.size(0), q.size(1), q.size(2), q.size(3)};
}

void check_step_weights(int64_t step_weights) {
    TORCH_CHECK(step_weights >= STEP_WEIGHTS_IGNORE && step_weights <= STEP_WEIGHTS_REPLACE,
                "unknown step_weights code ", step_weights);
}

}  // namespace

Tensor compacted_decode_attention_cpu(const Tensor &q, const std::vector<Tensor> &keys,
                                      const std::vector<Tensor> &values, const Tensor &fill,
                                      const std::optional<Tensor> &scores, int64_t step_weights, int64_t format,
                                      int64_t span) {
    const auto [batch, n_kv, group, dim] = query_shape(q);
    SlotTables tables = slot_tables(keys, values, format, span, batch, n_kv, dim);
    const int64_t slots = keys[0].size(2);
    check_fill(fill, batch, n_kv, slots, 1);
    check_step_weights(step_weights);
    TORCH_CHECK(step_weights == STEP_WEIGHTS_IGNORE || scores.has_value(), "step weights need a score table");
    eviction_state scoring{};
    scoring.step_weights = (int)step_weights;
    std::vector<int64_t> score_strides{0, 0};
    if (step_weights != STEP_WEIGHTS_IGNORE) {
        check_slot_table(*scores, at::kFloat, "scores", batch, n_kv, slots);
        score_strides = {scores->stride(0), scores->stride(1)};
        scoring.scores = scores->data_ptr<float>();
    }
    scoring.score_strides = score_strides.data();
    const Tensor rows = q.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    compacted_decode_attention(rows.data_ptr<float>(), tables.slots, fill.data_ptr<int32_t>(), scoring,
                               out.data_ptr<float>(), batch, n_kv, group, dim, inverse_sqrt(dim), threads());
    return out;
}

Tensor compacted_decode_attention_meta(const Tensor &q, const std::vector<Tensor> &, const std::vector<Tensor> &,
                                       const Tensor &, const std::optional<Tensor> &, int64_t, int64_t, int64_t) {
    return same_shape_meta(q);
}

Tensor evicting_decode_step_cpu(const Tensor &q, const Tensor &k_new, const Tensor &v_new,
                                const std::vector<Tensor> &keys, const std::vector<Tensor> &values, const Tensor &fill,
                                const Tensor &positions, const Tensor &scores, const Tensor &free, int64_t position,
                                double entry_score, int64_t step_weights, int64_t budget, int64_t protected_first,
                                int64_t protected_recent, int64_t format, int64_t span,
                                const std::optional<Tensor> &sink_keys, const std::optional<Tensor> &cos,
                                const std::optional<Tensor> &sin) {
    const auto [batch, n_kv, group, dim] = query_shape(q);
    SlotTables tables = slot_tables(keys, values, format, span, batch, n_kv, dim);
    const int64_t slots = keys[0].size(2);
    check_fill(fill, batch, n_kv, slots, 0);
    check_slot_table(positions, at::kInt, "positions", batch, n_kv, slots);
    check_slot_table(scores, at::kFloat, "scores", batch, n_kv, slots);
    TORCH_CHECK(free.device().is_cpu() && free.scalar_type() == at::kLong && free.is_contiguous() &&
                    free.numel() == batch * n_kv,
                "free must be a contiguous int64 [", batch, ", ", n_kv, "]");
    const int64_t *next = free.data_ptr<int64_t>();
    for (int64_t pair = 0; pair < batch * n_kv; pair++)
        TORCH_CHECK(0 <= next[pair] && next[pair] < slots, "free slot ", next[pair], " outside 0..", slots - 1);
    check_step_weights(step_weights);
    TORCH_CHECK(position >= 0 && position < INT32_MAX && budget >= 1 && protected_first >= 0 && protected_recent >= 0,
                "position ", position, ", budget ", budget, " or protection out of range");
    const Tensor k_rows = new_rows(k_new, "k_new", batch, n_kv, dim), v_rows = new_rows(v_new, "v_new", batch, n_kv, dim);
    sink_rotation rotation{};
    if (sink_keys.has_value()) {
        TORCH_CHECK(format == SLOTS_FP32 && cos.has_value() && sin.has_value(), "rotated sinks need fp32 slots and RoPE's tables");
        for (auto [t, name] : {std::pair{&*sink_keys, "sink_keys"}, {&*cos, "cos"}, {&*sin, "sin"}}) {
            check_float(*t, name);
            TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
        }
        TORCH_CHECK(sink_keys->dim() == 4 && sink_keys->size(0) == batch && sink_keys->size(1) == n_kv &&
                        sink_keys->size(3) == dim && sink_keys->size(2) <= slots && cos->dim() == 2 &&
                        cos->size(1) == dim && sin->sizes() == cos->sizes() && position < cos->size(0),
                    "sink_keys [", batch, ", ", n_kv, ", sinks, ", dim, "] and cos/sin [max_len > ", position, ", ", dim,
                    "], got ", sink_keys->sizes(), " and ", cos->sizes());
        rotation = {sink_keys->data_ptr<float>(), sink_keys->size(2), cos->data_ptr<float>(), sin->data_ptr<float>()};
    }
    const std::vector<int64_t> score_strides{scores.stride(0), scores.stride(1)};
    const std::vector<int64_t> position_strides{positions.stride(0), positions.stride(1)};
    eviction_state state = {scores.data_ptr<float>(), score_strides.data(), (int)step_weights,
                            positions.data_ptr<int32_t>(), position_strides.data(), free.data_ptr<int64_t>(),
                            budget, protected_first, protected_recent};
    const Tensor rows = q.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    evicting_decode_step(rows.data_ptr<float>(), k_rows.data_ptr<float>(), v_rows.data_ptr<float>(), tables.slots,
                         fill.data_ptr<int32_t>(), state, position, (float)entry_score,
                         sink_keys.has_value() ? &rotation : nullptr, out.data_ptr<float>(), batch, n_kv, group, slots,
                         dim, inverse_sqrt(dim), threads());
    return out;
}

Tensor evicting_decode_step_meta(const Tensor &q, const Tensor &, const Tensor &, const std::vector<Tensor> &,
                                 const std::vector<Tensor> &, const Tensor &, const Tensor &, const Tensor &,
                                 const Tensor &, c10::SymInt, double, int64_t, int64_t, int64_t, int64_t, int64_t,
                                 int64_t, const std::optional<Tensor> &, const std::optional<Tensor> &,
                                 const std::optional<Tensor> &) {
    return same_shape_meta(q);
}

Tensor pruned_key_decode_attention_cpu(const Tensor &q, const Tensor &k_new, const Tensor &v_new, const Tensor &k,
                                       const Tensor &v, const Tensor &channels, int64_t position) {
    check_attention(q, k, "k", v, "v");
    const int64_t batch = q.size(0), n_kv = q.size(1), group = q.size(2), dim = q.size(3), key_dim = k.size(3);
    TORCH_CHECK(k.size(0) == batch && k.size(1) == n_kv && v.size(0) == batch && v.size(1) == n_kv &&
                    v.size(3) == dim && 1 <= key_dim && key_dim <= dim && 0 <= position && position < k.size(2) &&
                    position < v.size(2),
                "k [", batch, ", ", n_kv, ", S, kept <= ", dim, "] and v [", batch, ", ", n_kv, ", S, ", dim,
                "] must hold row ", position, "; got ", k.sizes(), " and ", v.sizes());
    // The fixed-width path reads each key row at the values' width (cpu_pruned_attention.c): the rows
    // read must lie within the key table's storage.
    const int64_t last_read = (batch - 1) * k.stride(0) + (n_kv - 1) * k.stride(1) + position * k.stride(2) + dim;
    TORCH_CHECK(k.storage_offset() + last_read <= (int64_t)(k.storage().nbytes() / sizeof(float)),
                "the key table needs ", dim - key_dim, " floats of margin after its rows");
    TORCH_CHECK(channels.device().is_cpu() && channels.scalar_type() == at::kLong && channels.is_contiguous() &&
                    channels.numel() == batch * n_kv * key_dim,
                "channels must be a contiguous int64 [", batch, ", ", n_kv, ", ", key_dim, "]");
    const int64_t *kept = channels.data_ptr<int64_t>();
    for (int64_t i = 0; i < channels.numel(); i++)
        TORCH_CHECK(0 <= kept[i] && kept[i] < dim, "channel ", kept[i], " outside 0..", dim - 1);
    const Tensor k_rows = new_rows(k_new, "k_new", batch, n_kv, dim), v_rows = new_rows(v_new, "v_new", batch, n_kv, dim);
    const Tensor rows = q.contiguous();
    Tensor out = at::empty(rows.sizes(), rows.options());
    const auto k_strides = strides3(k), v_strides = strides3(v);
    pruned_key_decode_attention(rows.data_ptr<float>(), k_rows.data_ptr<float>(), v_rows.data_ptr<float>(),
                                k.data_ptr<float>(), k_strides.data(), v.data_ptr<float>(), v_strides.data(), kept,
                                out.data_ptr<float>(), batch, n_kv, group, position, key_dim, dim, inverse_sqrt(dim),
                                threads());
    return out;
}

Tensor pruned_key_decode_attention_meta(const Tensor &q, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                                        const Tensor &, c10::SymInt) {
    return same_shape_meta(q);
}
