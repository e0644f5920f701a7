"""The row columns the report never reads, so its loader leaves them in the files.

In a one-row file each column costs about as much to decode as the next, whatever it holds: over thousands
of files the columns nobody looks at are a third of the read. The loader (harness.analysis.results.load,
`left_out=`) adds each of them back null, as it does a column an older row lacks, so a section that
started reading one would see nulls: tests/test_report_scale.py checks that no module the report imports
names one of them.
"""
from __future__ import annotations

UNREAD_COLUMNS = (
    # the model's shape beyond what a prediction takes (harness.analysis.results.shape_of)
    "rope_theta", "norm_eps", "attention_bias", "tie_embeddings", "rope_scaling_factor", "rope_low_freq_factor",
    "rope_high_freq_factor", "rope_original_max_len",
    # how the point was timed: the report judges the times, not the settings that produced them (timing_method
    # it reads: the simulated-beside-measured table names what a step time was fitted from)
    "timing_warmup_min", "timing_warmup_max", "timing_settle_tolerance", "timing_cuda_graphs", "timing_cold_cache",
    "timing_prefill_repeats", "timing_prefill_budget_s", "timing_rounds_budget_s", "timing_max_passes", "threads",
    "repeat", "interval_method", "decode_steps_timed", "warmup_steps", "group_size", "rounds",
    "contention", "prefill_p10_s", "prefill_p90_s", "prefill_ci_low_s", "prefill_ci_high_s", "prefill_repeats",
    # the run's inputs and the machine's state, recorded for whoever reruns it
    "checkpoint_format", "prompt_hash", "kernel", "compile_mode", "gpu_other_processes", "gpu_sm_clock_mhz",
    "gpu_throttle_reasons", "roof_bandwidth_in_rounds_Bps", "roof_in_rounds_kernel", "bandwidth_fraction",
    "flops_fraction", "bandwidth_fraction_in_rounds",
    # memory and accuracy detail beyond the figures the report sets against their predictions
    "peak_memory_method", "peak_memory_reserved_bytes", "process_baseline_bytes", "anon_hugepages_bytes",
    "ncu_kernels", "logit_max_abs_error", "perplexity_delta", "accuracy_windows", "accuracy_s", "recall_tokens",
    "recall_distance", "agreement_logit_max_abs",
    # the software and the sweep it came from
    "engine_version", "engine_isa", "engine_build_flags", "torch_version", "harness_version", "git_commit",
    "hostname", "sweep_parallelism", "config_json",
)
