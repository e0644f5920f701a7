"""The Parquet row: every column, its Arrow type, its unit and its meaning. One source of truth.

The writer casts each row to this schema (so a null in one file and a float in another never disagree
on type), the README's column table is checked against it by a test, and readers can rely on it.
"""
from __future__ import annotations

import pyarrow as pa

S, I, F, B = pa.string(), pa.int64(), pa.float64(), pa.bool_()

# (name, type, unit, meaning)
COLUMNS: list[tuple[str, pa.DataType, str, str]] = [
    # what was measured
    ("strategy", S, "", "decode strategy: no_cache, contiguous, flash"),
    ("kernel", S, "", "attention kernel that actually ran; null when the point did not run"),
    ("matmul_kernel", S, "", "linear-layer kernel that ran: aten.linear or onednn.linear(packed weight)"),
    ("model", S, "", "model preset name (conf/model/)"),
    ("vocab_size", I, "tokens", "vocabulary size"),
    ("d_model", I, "", "residual width"),
    ("n_layers", I, "", "decoder blocks"),
    ("n_heads", I, "", "query heads per layer"),
    ("n_kv_heads", I, "", "key/value heads per layer"),
    ("head_dim", I, "", "per-head width"),
    ("ffn_dim", I, "", "SwiGLU hidden width"),
    ("dtype", S, "", "weights, activations and cache dtype"),
    ("device", S, "", "cpu or cuda"),
    ("device_name", S, "", "processor or GPU model"),
    ("threads", I, "", "torch intra-op threads"),
    ("batch", I, "sequences", "sequences decoded together"),
    ("ctx", I, "tokens", "prompt tokens per sequence, the context at the first decode step"),
    ("decode_tokens", I, "steps", "timed greedy decode steps"),
    ("prefill_mode", S, "", "compute (prompt run) or random (cache filled with random K/V)"),
    # outcome
    ("status", S, "", "ok, skipped (cannot run here or does not fit) or failed (error at run time)"),
    ("reason", S, "", "why skipped or failed; empty when ok"),
    # time
    ("prefill_s", F, "s", "time of the prompt's forward pass (null with prefill=random)"),
    ("decode_step_s", F, "s", "median time of one decode step (for no_cache: one full recompute)"),
    ("decode_step_p10_s", F, "s", "10th percentile of decode step times"),
    ("decode_step_p90_s", F, "s", "90th percentile of decode step times"),
    ("decode_steps_timed", I, "steps", "number of timed steps behind the percentiles"),
    ("warmup_steps", I, "steps", "untimed warm-up steps run at the first decode position"),
    ("timing_method", S, "", "clock and options that timed the steps: CUDA events or perf_counter, cache flush, CUDA graph replay"),
    ("tokens_per_s", F, "tokens/s", "batch / decode_step_s"),
    # memory
    ("kv_cache_bytes", I, "B", "bytes of cache storage allocated (0 for no_cache)"),
    ("weight_bytes", I, "B", "bytes of all weights"),
    ("peak_memory_bytes", I, "B", "the point's own peak: CUDA max_memory_allocated; CPU resident set above the process baseline"),
    ("peak_memory_reserved_bytes", I, "B", "CUDA max_memory_reserved; null on CPU"),
    ("process_baseline_bytes", I, "B", "CPU: resident set of Python and torch before the point allocated"),
    # traffic and work
    ("bytes_per_step_model", I, "B", "bytes a decode step must move (weights + cache read + cache written), mean over the timed steps"),
    ("bytes_per_step_measured", F, "B", "DRAM bytes read + written per step from a hardware counter; null where none exists"),
    ("traffic_source", S, "", "what filled the traffic figures: model or ncu"),
    ("flops_per_step_model", F, "FLOP", "FLOPs of a decode step from the analytic model, mean over the timed steps"),
    # roofs (calibration)
    ("roof_bandwidth_Bps", F, "B/s", "read bandwidth calibrated on this device and dtype; null if not calibrated"),
    ("roof_flops", F, "FLOP/s", "matmul rate calibrated on this device and dtype; null if not calibrated"),
    ("bandwidth_fraction", F, "", "bytes_per_step_model / decode_step_s / roof_bandwidth_Bps"),
    ("flops_fraction", F, "", "flops_per_step_model / decode_step_s / roof_flops"),
    ("roof_bound", S, "", "the roof that binds the step at the calibrated roofs: memory or compute"),
    ("roofline_fraction", F, "", "roofline time at the calibrated roofs / decode_step_s: max(bandwidth_fraction, flops_fraction)"),
    # proof of exactness
    ("tokens_digest", S, "", "hash of the generated token ids; equal across strategies means identical outputs"),
    # run metadata
    ("timestamp", S, "ISO 8601", "when the row was written (UTC)"),
    ("torch_version", S, "", "torch.__version__ of the run"),
    ("harness_version", S, "", "version of this package"),
    ("git_commit", S, "", "commit of the harness checkout, with +dirty if it had changes"),
    ("hostname", S, "", "machine that ran the point"),
    ("seed", I, "", "seed of weights and prompt"),
    ("point_key", S, "", "hash of the resolved config; a re-run skips keys it already has"),
    ("config_json", S, "JSON", "the resolved configuration of the point"),
]

SCHEMA = pa.schema([(name, dtype) for name, dtype, _unit, _meaning in COLUMNS])
COLUMN_NAMES = [name for name, *_ in COLUMNS]
