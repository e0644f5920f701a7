// The CPU and Meta implementations of the compacted-slot and pruned-key operators (ops_compacted.cpp),
// which ops.cpp registers: schemas there.
#ifndef HARNESS_OPS_COMPACTED_H
#define HARNESS_OPS_COMPACTED_H

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// q [B, n_kv, G, D] over each pair's fill of compacted slots (keys/values: [t] fp32 [B, n_kv, S, D],
// or [payload, scales] of `format`), step weights into `scores` -> [B, n_kv, G, D].
at::Tensor compacted_decode_attention_cpu(const at::Tensor &q, const std::vector<at::Tensor> &keys,
                                          const std::vector<at::Tensor> &values, const at::Tensor &fill,
                                          const std::optional<at::Tensor> &scores, int64_t step_weights,
                                          int64_t format, int64_t span);
at::Tensor compacted_decode_attention_meta(const at::Tensor &q, const std::vector<at::Tensor> &,
                                           const std::vector<at::Tensor> &, const at::Tensor &,
                                           const std::optional<at::Tensor> &, int64_t, int64_t, int64_t);
// An evicting cache's decode step (cpu_compacted_attention.c): writes, attention, the slots freed.
at::Tensor evicting_decode_step_cpu(const at::Tensor &q, const at::Tensor &k_new, const at::Tensor &v_new,
                                    const std::vector<at::Tensor> &keys, const std::vector<at::Tensor> &values,
                                    const at::Tensor &fill, const at::Tensor &positions, const at::Tensor &scores,
                                    const at::Tensor &free, int64_t position, double entry_score, int64_t step_weights,
                                    int64_t budget, int64_t protected_first, int64_t protected_recent, int64_t format,
                                    int64_t span, const std::optional<at::Tensor> &sink_keys,
                                    const std::optional<at::Tensor> &cos, const std::optional<at::Tensor> &sin);
at::Tensor evicting_decode_step_meta(const at::Tensor &q, const at::Tensor &, const at::Tensor &,
                                     const std::vector<at::Tensor> &, const std::vector<at::Tensor> &,
                                     const at::Tensor &, const at::Tensor &, const at::Tensor &, const at::Tensor &,
                                     c10::SymInt, double, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                     const std::optional<at::Tensor> &, const std::optional<at::Tensor> &,
                                     const std::optional<at::Tensor> &);
// q [B, n_kv, G, D] over keys pruned to k.size(3) channels (channels [B, n_kv, kept] int64), row
// `position` written first -> [B, n_kv, G, D] (cpu_pruned_attention.c).
at::Tensor pruned_key_decode_attention_cpu(const at::Tensor &q, const at::Tensor &k_new, const at::Tensor &v_new,
                                           const at::Tensor &k, const at::Tensor &v, const at::Tensor &channels,
                                           int64_t position);
at::Tensor pruned_key_decode_attention_meta(const at::Tensor &q, const at::Tensor &, const at::Tensor &,
                                            const at::Tensor &, const at::Tensor &, const at::Tensor &, c10::SymInt);

#endif
