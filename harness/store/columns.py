"""The Parquet row: every column, its Arrow type, its unit, its meaning and where it comes from.

One source of truth: the writer casts each row to this schema (so a null in one file and a float in
another never disagree on type), docs/columns.md is checked against it by a test, and readers can rely
on it. Integers are nullable (pandas reads them as Int64, not float), booleans are booleans, the
timestamp is a timestamp. Every ratio runs measured / analytic unless its name says otherwise (the
`*_fraction` columns: share of a roof reached, analytic / measured time).

Sources (the fifth field): `point` columns are the resolved point's dataclasses flattened
(harness.run.row.flatten), `measured` ones come from the point's process, `model` from the analytic
model, `roofs` from the calibration the row is judged against, `run` from the run's metadata.
"""
from __future__ import annotations

import pyarrow as pa

# The version of the column set below: raise it, and add a step to harness.store.upgrade, whenever a
# column is added, renamed or changes meaning, so rows written before read as rows of today.
SCHEMA_VERSION = 4

S, I, F, B = pa.string(), pa.int64(), pa.float64(), pa.bool_()
T = pa.timestamp("us", tz="UTC")

# (name, type, unit, meaning, source)
COLUMNS: list[tuple[str, pa.DataType, str, str, str]] = [
    # the point: what was asked for, resolved
    ("strategy", S, "", "the strategy variant: the conf/strategy/ option chosen (int8, kivi4, paged32; a class's own option is named as the class), with any strategy option set beside it that differs from the option's file appended, e.g. quantized(group_size=64) (harness.run.variants)", "point"),
    ("strategy_family", S, "", "the strategy class's name (quantized, paged, ...): what the variants of one class share", "point"),
    ("strategy_class", S, "", "import path of the strategy class that ran", "point"),
    ("backend", S, "", "kernel family the strategy ran (auto resolved on this machine)", "point"),
    ("caches_kv", B, "", "the strategy stores K/V between steps", "point"),
    ("exact", B, "", "the strategy is proven to generate the no-cache reference's tokens", "point"),
    ("strategy_options", S, "JSON", "the strategy's other options (block_size, format, ...)", "point"),
    ("cache_block_size", I, "tokens", "allocation unit of the cache per sequence (1: exact; paged: its block)", "point"),
    ("cache_reads_max_len", B, "", "attention reads every preallocated position each step", "point"),
    ("cache_copies_per_step", B, "", "the cache is copied into a new one every step", "point"),
    ("cache_value_bits", I, "bits", "bits per stored K/V element; 0: the compute dtype's", "point"),
    ("cache_scale_bytes_per_token", F, "B", "quantization scales per token and KV head, K and V together", "point"),
    ("cache_residual_tokens", I, "tokens", "recent tokens kept at full width (quantized caches)", "point"),
    ("cache_preallocated_tokens", I, "tokens", "positions allocated per sequence whatever its length; 0: what the point needs", "point"),
    ("cache_token_budget", I, "tokens", "most tokens the cache keeps per sequence, KV head and layer (eviction); 0: every token", "point"),
    ("cache_eviction_score", S, "", "how kept tokens are chosen: empty for none, recency (sinks + recent window), accumulated_attention, observation_window (once at the end of prefill) or current_attention", "point"),
    ("cache_layers_stored", I, "layers", "layers that store their own K/V (cross-layer sharing); 0: every layer", "point"),
    ("cache_key_channels_kept", I, "channels", "key channels stored per KV head (key-channel pruning); 0: head_dim", "point"),
    ("cache_slot_bytes", I, "B", "bytes an evicting cache keeps per kept token, KV head and layer beyond its K/V (position, score), read every step; 0: none", "point"),
    ("cache_slot_write_bytes", I, "B", "bytes a decode step writes per kept token, KV head and layer into those (the policy's step weights); 0: none", "point"),
    ("model", S, "", "model preset name (conf/model/), or with a checkpoint its folder's (GGUF file's) name unless model.name named another", "point"),
    ("vocab_size", I, "tokens", "vocabulary size", "point"),
    ("d_model", I, "", "residual width", "point"),
    ("n_layers", I, "", "decoder blocks", "point"),
    ("n_heads", I, "", "query heads per layer", "point"),
    ("n_kv_heads", I, "", "key/value heads per layer", "point"),
    ("ffn_dim", I, "", "SwiGLU hidden width", "point"),
    ("head_dim", I, "", "per-head width", "point"),
    ("rope_theta", F, "", "RoPE base frequency", "point"),
    ("norm_eps", F, "", "RMSNorm epsilon", "point"),
    ("checkpoint", S, "", "model.checkpoint: the Hugging Face format folder or GGUF file the weights were read from, absolute; null: seeded random weights", "point"),
    ("attention_bias", B, "", "the q/k/v projections carry a bias (Qwen2)", "point"),
    ("tie_embeddings", B, "", "the output head is the embedding table", "point"),
    ("rope_scaling", S, "", "RoPE frequency scaling: llama3 (Llama 3.1+), null for none", "point"),
    ("rope_scaling_factor", F, "", "llama3 RoPE scaling: stretch of the low frequencies", "point"),
    ("rope_low_freq_factor", F, "", "llama3 RoPE scaling: low_freq_factor", "point"),
    ("rope_high_freq_factor", F, "", "llama3 RoPE scaling: high_freq_factor", "point"),
    ("rope_original_max_len", I, "tokens", "llama3 RoPE scaling: original_max_position_embeddings", "point"),
    ("timing_warmup_min", I, "steps", "warm-up steps always run", "point"),
    ("timing_warmup_max", I, "steps", "warm-up steps at most", "point"),
    ("timing_settle_tolerance", F, "", "warm-up ends when two steps differ by less than this fraction", "point"),
    ("timing_cuda_graphs", B, "", "steps were replayed from CUDA graphs", "point"),
    ("timing_cold_cache", B, "", "the last-level cache (L2 on a GPU) was flushed before each timed step", "point"),
    ("timing_prefill_repeats", I, "", "times the prompt was to be timed at most", "point"),
    ("timing_prefill_budget_s", F, "s", "time budget of the prompt's repeats", "point"),
    ("timing_rounds_budget_s", F, "s", "a group replays its decode positions while another pass of its rounds fits this budget", "point"),
    ("timing_max_passes", I, "", "passes over the decode positions at most; rounds = passes x decode_tokens", "point"),
    ("timing_adapt_threads", B, "", "on a CPU, eager steps on torch's threads were to run at fewer threads while other processes held cores (how many did: decode_steps_fewer_threads)", "point"),
    ("batch", I, "sequences", "sequences decoded together", "point"),
    ("ctx", I, "tokens", "prompt tokens per sequence, the context at the first decode step", "point"),
    ("decode_tokens", I, "steps", "timed greedy decode steps", "point"),
    ("device", S, "", "cpu or cuda", "point"),
    ("dtype", S, "", "weights, activations and cache dtype", "point"),
    ("seed", I, "", "seed of weights and prompt", "point"),
    ("prefill", S, "", "compute (prompt run) or random (cache filled with random K/V)", "point"),
    ("traffic", S, "", "where measured bytes were asked from: model or ncu", "point"),
    ("matmul", S, "", "linear-layer kernel asked for, resolved: aten, onednn or c", "point"),
    ("threads", I, "", "torch intra-op threads", "point"),
    ("compile", S, "", "none (eager decode steps) or inductor (decode steps through torch.compile)", "point"),
    ("memory_limit_bytes", I, "B", "memory the point was allowed (memory_limit_bytes=); null: the device's free memory", "point"),
    ("hugepages", B, "", "CPU tensors of 2 MiB or more asked for on 2 MiB pages (hugepages=, torch's THP_MEM_ALLOC_ENABLE)", "point"),
    ("weights", S, "", "random (seeded) or checkpoint (read from `checkpoint`)", "point"),
    ("checkpoint_hash", S, "", "the checkpoint's content hash, cheap by design and not cached: sha256 of config.json and of each safetensors (or the GGUF) file's name, size, header and first and last MiB of data (harness.model.checkpoint)", "point"),
    ("checkpoint_format", S, "", "how the checkpoint's tensors were stored, by count, and what they became in `dtype`, e.g. 'gguf: Q4_1 x210, F32 x61, Q8_0 x1, dequantized to float32'; null: seeded random weights", "point"),
    ("prompt", S, "", "prompt=: the file the prompt and the scored text came from, absolute; null: seeded random token ids", "point"),
    ("prompt_hash", S, "", "sha256 of the prompt file (and of the tokenizer.json that tokenized it, for text)", "point"),
    ("reference", S, "", "approximate strategies: the exact strategy and backend their accuracy columns are measured against (module.Class:backend)", "point"),
    ("interleave", S, "", "shape: timed in one process with the other points of its shape, steps interleaved round by round; none: timed alone", "point"),
    ("repeat", I, "", "which of the sweep's repeats= measurements of the point (0: the first); the report pools them", "point"),
    # a serving run's point (harness.serve; null on a step row): the workload and how it was scheduled
    ("workload_lengths", S, "", "where each request's lengths came from: sharegpt or alpaca (seeded lognormal draws around the vLLM paper's means), fixed, or trace", "point"),
    ("workload_trace", S, "", "the trace file read (Azure CSV columns, or JSONL); null for a synthetic workload", "point"),
    ("workload_requests", I, "requests", "requests in the workload (from a trace: its first this many)", "point"),
    ("workload_prompt_len", I, "tokens", "lengths=fixed: every request's prompt", "point"),
    ("workload_output_len", I, "tokens", "lengths=fixed: every request's output", "point"),
    ("workload_length_scale", F, "", "every prompt and output length multiplied by this (rounded, at least 1); 1: the workload unscaled", "point"),
    ("workload_max_tokens", I, "tokens", "the output each request asks for at most (outputs cut to it; a reservation holds prompt + max_tokens); null: each request's own length", "point"),
    ("workload_arrival", S, "", "all_at_once, poisson, gamma, closed (a fixed concurrency) or trace", "point"),
    ("workload_rate", F, "requests/s", "poisson and gamma: the request rate asked for", "point"),
    ("workload_burstiness", F, "", "gamma: the inter-arrival times' shape (vLLM's --burstiness; 1 is Poisson)", "point"),
    ("workload_concurrency", I, "requests", "closed: requests kept in flight", "point"),
    ("workload", S, "", "the workload's name (conf/workload/); null for a step measurement", "point"),
    ("serving_kv_budget_bytes", F, "B", "the KV cache's budget, by the strategy's own accounting (strategies/serving.py): reserved rows, blocks, quantized bytes or kept slots", "point"),
    ("serving_prefill_chunk", I, "tokens", "prompt tokens prefilled per iteration at most (chunked prefill); null: whole prompts", "point"),
    ("serving_max_batch", I, "sequences", "sequences running at once at most", "point"),
    ("serving_slo_ttft_s", F, "s", "goodput's objective on time to first token; null: none", "point"),
    ("serving_slo_tpot_s", F, "s", "goodput's objective on time per output token; null: none", "point"),
    ("serving_check_tokens", B, "", "every served token was checked against the recompute reference after the run", "point"),
    ("workload_hash", S, "", "the trace file's content hash; null for a synthetic workload", "point"),
    ("serving_executor", S, "", "measured: our decoder served it on this machine; fitted or roofline: a simulation, nothing ran (harness.serve.simulated_point)", "point"),
    ("serving_fit_from", S, "", "executor=fitted: the rows its step time is fitted from: serving (the iterations of this strategy's other measured serving runs) or steps (its step points)", "point"),
    ("serving_hardware", S, "", "executor=roofline: the device whose datasheet roofs time each iteration (conf/hardware/)", "point"),
    ("serving_tp", I, "devices", "executor=roofline: devices the model is split over (tensor parallel)", "point"),
    ("serving_reserve", F, "", "executor=roofline with no budget: each device's share kept back for activations and workspace; null: the capacity plan's", "point"),
    # outcome
    ("status", S, "", "ok, skipped (cannot run here or does not fit) or failed (error at run time)", "measured"),
    ("reason", S, "", "why skipped or failed; empty when ok", "measured"),
    ("kernel", S, "", "attention kernel that actually ran; null when the point did not run", "measured"),
    ("matmul_kernel", S, "", "linear-layer kernel that ran: aten.linear, onednn.linear(packed weight) or cpu_gemv.c up to 16 rows (with the step's small operators)", "measured"),
    ("compile_mode", S, "", "the torch.compile call the decode steps ran through; eager when compile=none", "measured"),
    ("compile_s", F, "s", "compile=inductor: seconds compiling the decode step before timing (its first calls); null when eager", "measured"),
    ("compile_recompiles", I, "", "compile=inductor: graphs compiled during the timed steps (0: no recompilation per position); null when eager", "measured"),
    ("device_name", S, "", "processor or GPU model", "measured"),
    # time
    ("prefill_s", F, "s", "median time of the prompt's forward pass over its repeats (null with prefill=random)", "measured"),
    ("prefill_p10_s", F, "s", "10th percentile of the prompt's times", "measured"),
    ("prefill_p90_s", F, "s", "90th percentile of the prompt's times", "measured"),
    ("prefill_ci_low_s", F, "s", "lower end of prefill_s's 95% confidence interval over the prompt's repeats (interval_method)", "measured"),
    ("prefill_ci_high_s", F, "s", "upper end of prefill_s's 95% confidence interval", "measured"),
    ("prefill_repeats", I, "", "times the prompt was timed, each on a fresh session", "measured"),
    ("decode_step_s", F, "s", "median time of one decode step (for no_cache: one full recompute)", "measured"),
    ("decode_step_p10_s", F, "s", "10th percentile of decode step times", "measured"),
    ("decode_step_p90_s", F, "s", "90th percentile of decode step times", "measured"),
    ("decode_steps_timed", I, "steps", "number of timed steps behind the percentiles: decode_tokens x the passes the group made", "measured"),
    ("decode_steps_fewer_threads", I, "steps", "timed steps run at fewer torch threads than `threads`, other processes holding cores (timing_adapt_threads); null: its steps ran at a count of their own (an engine's pool, a compiled step)", "measured"),
    ("warmup_steps", I, "steps", "untimed warm-up steps run at the first decode position", "measured"),
    ("timing_method", S, "", "clock and options that timed the steps: CUDA events or perf_counter, cache flush, CUDA graph replay", "measured"),
    ("tokens_per_s", F, "tokens/s", "batch / decode_step_s", "measured"),
    # the group the point was timed in (harness.measure.group, harness.measure.intervals)
    ("group_id", S, "", "the group the point was timed in; rows of one group_id were measured in one process, interleaved", "measured"),
    ("group_size", I, "points", "points timed together in the group (1: alone)", "measured"),
    ("rounds", I, "", "rounds of the group: each member took one timed step per round, in rotating order; passes over the decode positions x decode_tokens", "measured"),
    ("decode_step_times_s", pa.list_(F), "s", "every timed step, in round order (round i of two rows of one group_id ran within one round)", "measured"),
    ("decode_step_ci_low_s", F, "s", "lower end of decode_step_s's 95% confidence interval (interval_method)", "measured"),
    ("decode_step_ci_high_s", F, "s", "upper end of decode_step_s's 95% confidence interval", "measured"),
    ("interval_method", S, "", "how the intervals were computed: percentile bootstrap of the median over rounds, ratios over paired rounds", "measured"),
    ("group_reference", S, "", "the strategy of the group's reference: an exact cached one that ran, the plain contiguous layout first; null when the group holds none", "measured"),
    ("group_reference_key", S, "", "point_key of the group's reference (its own row, unless it was timed again only as a partner)", "measured"),
    ("ratio_to_reference", F, "", "median over rounds of this step's time / the reference's in the same round; null for the reference itself", "measured"),
    ("ratio_ci_low", F, "", "lower end of ratio_to_reference's 95% confidence interval (paired rounds)", "measured"),
    ("ratio_ci_high", F, "", "upper end of ratio_to_reference's 95% confidence interval", "measured"),
    # the machine while the steps were timed (harness.measure.contention)
    ("contention", F, "", "share of all CPU cores' time other processes took during the timed steps", "measured"),
    ("gpu_other_processes", I, "", "CUDA: other processes on the point's GPU after its steps (NVML); null without NVML", "measured"),
    ("gpu_sm_clock_mhz", F, "MHz", "CUDA: the GPU's SM clock after the steps (NVML)", "measured"),
    ("gpu_throttle_reasons", S, "", "CUDA: active clock throttle reasons (NVML), or none", "measured"),
    # memory
    ("kv_cache_bytes", I, "B", "bytes of cache storage held at the end of the point (0 without a cache)", "measured"),
    ("peak_memory_bytes", I, "B", "the point's own peak (peak_memory_method): the model's bytes plus what its own set-up (session, prompt, warm-up steps) allocated at most", "measured"),
    ("peak_memory_method", S, "", "how peak_memory_bytes was measured: the member's own allocations while it alone was set up, before the group's rounds", "measured"),
    ("peak_memory_reserved_bytes", I, "B", "CUDA max_memory_reserved; null on CPU", "measured"),
    ("process_baseline_bytes", I, "B", "CPU: resident set of Python and torch before the point allocated", "measured"),
    ("anon_hugepages_bytes", I, "B", "the point process's anonymous memory on transparent huge pages after its steps (Linux); null elsewhere", "measured"),
    # traffic
    ("bytes_per_step_measured", F, "B", "DRAM bytes read + written per step from a hardware counter; null where none exists", "measured"),
    ("traffic_source", S, "", "what filled bytes_per_step_measured: model (nothing measured) or ncu", "measured"),
    ("ncu_kernels", I, "", "kernel launches ncu profiled over the timed steps; null without ncu", "measured"),
    # proof of exactness, or how far an approximate cache moves the outputs (harness.measure.accuracy)
    ("tokens_digest", S, "", "hash of the generated token ids; equal across strategies means identical outputs", "measured"),
    ("top1_agreement", F, "", "approximate strategies: share of the scored tokens (accuracy_tokens) whose argmax matches the exact reference's", "measured"),
    ("top1_agreement_ci_low", F, "", "low end of top1_agreement's 95% interval, by bootstrap over the accuracy windows", "measured"),
    ("top1_agreement_ci_high", F, "", "high end of top1_agreement's 95% interval", "measured"),
    ("logit_max_abs_error", F, "", "approximate strategies: largest |reference - strategy| logit over the scored tokens", "measured"),
    ("logit_kl_mean", F, "nats", "approximate strategies: mean KL(reference || strategy) of the two softmaxes over the scored tokens", "measured"),
    ("logit_kl_mean_ci_low", F, "nats", "low end of logit_kl_mean's 95% interval, by bootstrap over the accuracy windows (tokens of one window are correlated)", "measured"),
    ("logit_kl_mean_ci_high", F, "nats", "high end of logit_kl_mean's 95% interval", "measured"),
    ("logit_kl_p99", F, "nats", "99th percentile of the scored tokens' KL(reference || strategy)", "measured"),
    ("logit_kl_p99_ci_low", F, "nats", "low end of logit_kl_p99's 95% interval, by bootstrap over the accuracy windows", "measured"),
    ("logit_kl_p99_ci_high", F, "nats", "high end of logit_kl_p99's 95% interval", "measured"),
    ("logit_kl_max", F, "nats", "largest KL(reference || strategy) of a scored token", "measured"),
    ("perplexity", F, "", "approximate strategies with a prompt text: exp(mean negative log-likelihood) through the strategy's cache of the scored tokens, each the text's next token", "measured"),
    ("perplexity_reference", F, "", "the same perplexity through the exact reference, on the same weights and tokens", "measured"),
    ("perplexity_delta", F, "", "perplexity - perplexity_reference: what the approximation costs on this text", "measured"),
    ("perplexity_ratio", F, "", "perplexity / perplexity_reference", "measured"),
    ("perplexity_ratio_ci_low", F, "", "low end of perplexity_ratio's 95% interval, by bootstrap over the accuracy windows", "measured"),
    ("perplexity_ratio_ci_high", F, "", "high end of perplexity_ratio's 95% interval", "measured"),
    ("accuracy_tokens", I, "tokens", "tokens scored by the accuracy pass (accuracy.tokens): one a teacher-forced decode step", "measured"),
    ("accuracy_ctx", I, "tokens", "prompt tokens each accuracy window is prefilled with before its scored steps (the point's ctx)", "measured"),
    ("accuracy_steps", I, "steps", "teacher-forced decode steps per accuracy window (accuracy.steps; the last window may score fewer)", "measured"),
    ("accuracy_windows", I, "", "accuracy windows: prompts that may overlap, scored tokens that never do; what the intervals resample", "measured"),
    ("accuracy_s", F, "s", "wall time of the accuracy pass (the reference's share included where this member ran it), outside every timed region", "measured"),
    ("accuracy_reference", S, "", "what the accuracy columns were measured against and on which tokens, or why they are null", "measured"),
    # the recall probe: a span of the prompt repeated recall_distance positions later (harness.measure.accuracy)
    ("recall_top1", F, "", "approximate strategies: share of the repeated tokens (recall_tokens) whose argmax through the strategy's cache is the span's next token, teacher-forced; an evicted first occurrence must be guessed", "measured"),
    ("recall_top1_ci_low", F, "", "low end of recall_top1's 95% interval, by bootstrap over the probe's windows", "measured"),
    ("recall_top1_ci_high", F, "", "high end of recall_top1's 95% interval", "measured"),
    ("recall_top1_reference", F, "", "recall_top1 through the exact reference on the same probe: near 1 where the model copies the span (what the probe can show)", "measured"),
    ("recall_kl_mean", F, "nats", "mean KL(reference || strategy) over the repeated tokens", "measured"),
    ("recall_kl_mean_ci_low", F, "nats", "low end of recall_kl_mean's 95% interval, by bootstrap over the probe's windows", "measured"),
    ("recall_kl_mean_ci_high", F, "nats", "high end of recall_kl_mean's 95% interval", "measured"),
    ("recall_tokens", I, "tokens", "repeated tokens the recall probe scored (one probe window per accuracy window)", "measured"),
    ("recall_distance", I, "tokens", "positions between each repeated token and its first occurrence in the prompt: a budget below it must have kept that token by choice, not by recency", "measured"),
    # an engine measured as a member (strategies/engines/engine.py): what it says of itself, and its agreement
    ("engine", S, "", "peer members: the engine that decoded (llama.cpp, ...); null for the harness's own strategies", "measured"),
    ("engine_version", S, "", "peer members: the engine's version, from its library", "measured"),
    ("engine_kv_type", S, "", "peer members: the KV type in the engine's own words (f16, q8_0, u8 by channel)", "measured"),
    ("engine_isa", S, "", "peer members: the instruction set the engine's library was built for, from its own system info", "measured"),
    ("engine_build", S, "", "peer members: which build of the engine ran: wheel (its package as published) or built here (from source, for this machine: strategies/engines/artifacts/llamacpp_build.py)", "measured"),
    ("engine_build_flags", S, "", "peer members: what that build was made with: a build made here its flags (GGML_NATIVE=ON ...) and compiler; a wheel what it says of its own build (its version, commit, what it chooses at run time)", "measured"),
    ("step_granularity", S, "", "peer members: what one timed call covered: token (one decode step through the engine's API) or decode (a whole decode, the engine's own loop)", "measured"),
    ("agreement_logit_max_abs", F, "logits", "full-precision peers: largest |engine - exact cache| logit of the first decode step on the point's prompt (harness.measure.agreement)", "measured"),
    ("agreement_logit_rel", F, "", "agreement_logit_max_abs over the exact cache's largest |logit|", "measured"),
    ("agreement_logit_rel_bound", F, "", "the bound agreement_logit_rel must stay within, else the row fails untimed", "measured"),
    ("agreement_kl_mean_bound", F, "nats", "the bound logit_kl_mean over the accuracy windows must stay within, else the row fails", "measured"),
    # a serving run (harness.serve): the field's metrics (harness.serve.metrics) and its KV memory
    ("serving_placement", S, "", "how the strategy's serving pool places a sequence: arena (a contiguous run, reserved), blocks (paged) or separate (tensors of its own) (strategies/serving.py)", "measured"),
    ("serving_reserves", B, "", "a sequence takes its whole reservation, prompt + max_tokens (or its kept slots), when admitted", "measured"),
    ("serving_kv_bytes_per_token", I, "B", "KV bytes a token held takes in the strategy's accounting: K and V of every layer and KV head, scales and positions included", "measured"),
    ("serving_kept_tokens", I, "tokens", "most tokens a sequence holds at once (an evicting cache's slots); null: every token", "measured"),
    ("serving_requests", I, "requests", "requests served to their last token", "measured"),
    ("serving_duration_s", F, "s", "first arrival to last output token", "measured"),
    ("request_throughput", F, "requests/s", "requests served / serving_duration_s", "measured"),
    ("output_throughput", F, "tokens/s", "output tokens / serving_duration_s", "measured"),
    ("total_token_throughput", F, "tokens/s", "prompt and output tokens / serving_duration_s", "measured"),
    *[(f"{name}_{stat}_s", F, "s", f"{meaning}: {said}", "measured")
      for name, meaning in (("ttft", "time to first token, arrival to first output token"),
                            ("tpot", "time per output token after the first, per request: (e2e - ttft) / (tokens - 1)"),
                            ("itl", "inter-token latency, every gap between consecutive output tokens"),
                            ("e2e", "end to end, arrival to last output token"))
      for stat, said in (("mean", "mean"), ("p50", "median"), ("p90", "90th percentile"), ("p99", "99th percentile"))],
    ("queue_wait_mean_s", F, "s", "arrival to first being scheduled, mean over requests", "measured"),
    ("queue_wait_p99_s", F, "s", "arrival to first being scheduled, 99th percentile", "measured"),
    ("normalized_latency_mean_s", F, "s/token", "per request e2e / output tokens, mean (the vLLM paper's latency axis)", "measured"),
    ("goodput", F, "requests/s", "requests meeting every objective set (serving_slo_*) / serving_duration_s; null without one", "measured"),
    ("slo_attainment", F, "", "share of requests meeting every objective set; null without one", "measured"),
    ("preemptions", I, "", "times a running sequence's memory was taken back (its tokens recomputed later)", "measured"),
    ("iterations", I, "", "iterations of the scheduler: each a set of prompt chunks and one decode step per running sequence", "measured"),
    ("prefill_tokens_computed", I, "tokens", "prompt tokens computed, recomputation after preemption included", "measured"),
    ("running_batch_peak", I, "sequences", "most sequences one iteration computed", "measured"),
    ("running_batch_mean", F, "sequences", "sequences an iteration computed, time-weighted over the iterations", "measured"),
    ("kv_taken_bytes_peak", I, "B", "most KV budget the admitted sequences took at once (reservations, blocks, slots)", "measured"),
    ("kv_taken_bytes_mean", F, "B", "KV budget taken, time-weighted over the iterations", "measured"),
    ("kv_holding_bytes_peak", I, "B", "most KV bytes holding tokens at once", "measured"),
    ("kv_holding_bytes_mean", F, "B", "KV bytes holding tokens, time-weighted over the iterations", "measured"),
    ("kv_utilization", F, "", "kv_holding_bytes_mean / kv_taken_bytes_mean: the share of taken KV memory holding tokens (the vLLM paper's measure)", "measured"),
    ("serving_timeline_s", pa.list_(F), "s", "the end of each iteration of the timelines (at most 512, evenly picked)", "measured"),
    ("running_timeline", pa.list_(I), "sequences", "the running batch at each of serving_timeline_s", "measured"),
    ("kv_taken_timeline_bytes", pa.list_(I), "B", "the KV budget taken at each of serving_timeline_s", "measured"),
    ("kv_holding_timeline_bytes", pa.list_(I), "B", "the KV bytes holding tokens at each of serving_timeline_s", "measured"),
    ("simulated", B, "", "true: the row was computed by a step-time model (serving.executor fitted or roofline), never measured; null or false: measured", "measured"),
    ("simulates_point_key", S, "", "a simulated row: the point_key of the measured run it stands for (the same point with serving.executor=measured)", "measured"),
    ("step_fit_source", S, "", "executor=fitted: the rows the step time was fitted from, in words", "measured"),
    ("step_fit_observations", I, "iterations", "executor=fitted: the observations (iterations, steps or prompts) fitted", "measured"),
    ("step_fit_coefficients", S, "JSON", "executor=fitted: seconds per unit of each feature of harness.serve.step_fit.FEATURES", "measured"),
    ("step_fit_residual_median", F, "", "executor=fitted: median of |fitted / measured - 1| over the fit's own observations", "measured"),
    ("step_fit_residual_p90", F, "", "executor=fitted: 90th percentile of the same", "measured"),
    ("step_fit_total_ratio", F, "", "executor=fitted: fitted over measured seconds summed over the observations (the fit's bias on a whole run)", "measured"),
    ("tokens_checked", I, "tokens", "served output tokens checked against the recompute reference (harness.serve.exactness); null: not checked", "measured"),
    ("requests_diverged", I, "requests", "requests whose served tokens left the recompute reference's greedy choice somewhere", "measured"),
    ("first_divergence_min", I, "tokens", "the earliest output token (0-based) at which a request left the reference's choice; null: none did", "measured"),
    ("divergence_margin_min", F, "logits", "smallest reference logit margin (its pick minus the served token) at a request's first divergence: float order near a tie where tiny", "measured"),
    ("divergence_margin_max", F, "logits", "largest such margin: far above round-off in an exact strategy's row is a defect", "measured"),
    ("reference_agreement", F, "", "share of served tokens equal to the reference's greedy pick, teacher-forced along the served tokens", "measured"),
    # the analytic model at this point
    ("weight_bytes", I, "B", "bytes of all weights", "model"),
    ("kv_bytes_per_token", I, "B", "the shape's cache bytes per token in the compute dtype, whatever this point's layout: one key and one value vector per layer and KV head (2 x n_layers x n_kv_heads x head_dim x bytes per element), what any exact cache stores per token", "model"),
    ("tokens_to_match_weights", F, "tokens", "tokens (batch x tokens per sequence, any split) whose K/V at kv_bytes_per_token weigh as much as the weights: weight_bytes / kv_bytes_per_token", "model"),
    ("kv_cache_bytes_model", I, "B", "bytes the analytic model says the cache holds at the end of the point", "model"),
    ("peak_memory_predicted_bytes", I, "B", "the memory model's peak: weights + cache + the largest transients (harness.analysis.peak_memory); compare with peak_memory_bytes", "model"),
    ("bytes_per_step_model", I, "B", "bytes a decode step must move (weights, cache read, written, copied), mean over the timed steps", "model"),
    ("cache_share_of_step_bytes", F, "", "share of bytes_per_step_model that is cache (read, written, copied): the most any compression of this cache can save of the step", "model"),
    ("context_to_match_weights", F, "tokens", "tokens per sequence at which this batch's cache, as the layout stores it (kept tokens, layers, key channels, format), weighs as much as the weights a decode step reads (the cache is then half the step's bytes); null without a cache or where a token budget keeps it below them", "model"),
    ("flops_per_step_model", F, "FLOP", "FLOPs of a decode step, mean over the timed steps", "model"),
    ("kv_bytes_per_token_held", F, "B", "cache bytes per token held at ctx + decode_tokens, blocks, scales and full-width residual included (harness.analysis.analytic.kv_bytes_per_token_held); null without a cache", "model"),
    ("accuracy_kv_bytes_per_token_held", F, "B", "kv_bytes_per_token_held at the end of an accuracy window (accuracy_ctx + accuracy_steps tokens): the bytes per token the accuracy columns were measured at; null without a cache or an accuracy pass", "model"),
    ("kv_cache_used_bytes_model", F, "B", "bytes the analytic model says the cache needs for ctx + decode_tokens tokens per sequence (blocks rounded up; no preallocation beyond them); null without a cache", "model"),
    # roofs (calibration)
    ("roof_bandwidth_Bps", F, "B/s", "read bandwidth calibrated on this device and dtype; null if not calibrated", "roofs"),
    ("roof_flops", F, "FLOP/s", "matmul rate calibrated on this device and dtype; null if not calibrated", "roofs"),
    ("roof_bandwidth_in_rounds_Bps", F, "B/s", "the calibration's matrix-vector read timed once per round of the point's group, median: the bandwidth the machine gave in the point's own rounds", "measured"),
    ("roof_in_rounds_kernel", S, "", "the read kernel behind roof_bandwidth_in_rounds_Bps: aten (torch.mv), packed (oneDNN) or c", "measured"),
    ("roof_bandwidth_gemv_Bps", F, "B/s", "the same calibration's best matrix-vector read (what a decode step's weight reads can reach); below roof_bandwidth_Bps where a stream set the roof", "roofs"),
    ("roof_bound", S, "", "the roof that binds the step at the calibrated roofs, memory or compute: the one its phases bound by it spend longer on (harness.analysis.roofline.phased_bound)", "roofs"),
    ("predicted_step_s", F, "s", "the analytic decode step at the calibrated roofs: each timed step's roofline time (for its matmuls and its attention each, the larger of the bytes over the read roof and the FLOPs over the FLOP roof, summed), mean over the timed steps (harness.analysis.analytic.mean_decode_step); null if not calibrated", "roofs"),
    ("predicted_prefill_s", F, "s", "the analytic prefill of the prompt at the calibrated roofs, its matmuls and attention each at its roof (harness.analysis.analytic.prefill_time); null if not calibrated", "roofs"),
    ("bandwidth_fraction", F, "", "share of the read roof reached: bytes_per_step_model / decode_step_s / roof_bandwidth_Bps", "roofs"),
    ("flops_fraction", F, "", "share of the FLOP roof reached: flops_per_step_model / decode_step_s / roof_flops", "roofs"),
    ("roofline_fraction", F, "", "share of the binding roof reached: predicted_step_s / decode_step_s (max(bandwidth_fraction, flops_fraction) unless the timed steps cross the ridge)", "roofs"),
    ("bandwidth_fraction_in_rounds", F, "", "bytes_per_step_model / decode_step_s / roof_bandwidth_in_rounds_Bps: the read roof of the point's own rounds", "roofs"),
    ("roofline_fraction_in_rounds", F, "", "predicted_step_s at roof_bandwidth_in_rounds_Bps and roof_flops / decode_step_s", "roofs"),
    ("noisy", B, "", "the row's numbers are not to be trusted (contention, spread, a fraction above the roof, or a slow window: harness.run.windows)", "roofs"),
    ("noise_reason", S, "", "why the row is noisy; empty when it is not", "roofs"),
    # run metadata
    ("schema_version", I, "", "version of this column set the row was written with (SCHEMA_VERSION); harness.store.upgrade brings older rows to the current one on read", "run"),
    ("timestamp", T, "UTC", "when the row was written", "run"),
    ("torch_version", S, "", "torch.__version__ of the run", "run"),
    ("harness_version", S, "", "version of this package", "run"),
    ("git_commit", S, "", "commit of the harness checkout, with +dirty if it had changes", "run"),
    ("hostname", S, "", "machine that ran the point", "run"),
    ("sweep_parallelism", I, "points", "points of the sweep the launcher may run at once (1: each point timed alone; more: jobs that share a host contend, see contention)", "run"),
    ("point_key", S, "", "hash of the resolved point; a re-run skips keys it already has", "run"),
    ("config_json", S, "JSON", "the resolved point, every field (harness.config.Point.record)", "run"),
]

# A serving run's per-request file (<results_dir>/_requests/<the row's file name>): one row per request
# (harness.serve.records.RequestRecord, harness.serve.exactness), written beside its run's row.
REQUEST_COLUMNS: list[tuple[str, pa.DataType, str, str]] = [
    ("point_key", S, "", "the run's row (its point_key)"),
    ("strategy", S, "", "the run's strategy variant"),
    ("workload", S, "", "the run's workload name"),
    ("workload_rate", F, "requests/s", "the run's request rate (poisson, gamma)"),
    ("serving_kv_budget_bytes", F, "B", "the run's KV budget"),
    ("request", I, "", "the request's index in the workload"),
    ("arrival_s", F, "s", "when it arrived, from the run's start"),
    ("prompt_len", I, "tokens", "its prompt"),
    ("output_len", I, "tokens", "its output"),
    ("max_tokens", I, "tokens", "the output it asked for at most"),
    ("admitted_s", F, "s", "when it was first scheduled"),
    ("queue_wait_s", F, "s", "admitted_s - arrival_s"),
    ("ttft_s", F, "s", "arrival to its first output token"),
    ("tpot_s", F, "s", "time per output token after the first; null for one token"),
    ("e2e_s", F, "s", "arrival to its last output token"),
    ("itl_s", pa.list_(F), "s", "every inter-token latency, in order"),
    ("token_times_s", pa.list_(F), "s", "when each output token was produced, from the run's start"),
    ("preemptions", I, "", "times its memory was taken back"),
    ("output_tokens", pa.list_(I), "", "its output token ids"),
    ("first_divergence", I, "tokens", "the first output token where it left the recompute reference's greedy choice; null: never (or not checked)"),
    ("divergence_margin", F, "logits", "the reference's logit margin there (its pick minus the served token)"),
    ("reference_agreement", F, "", "share of its output tokens equal to the reference's pick, teacher-forced"),
]
REQUEST_SCHEMA = pa.schema([(name, dtype) for name, dtype, *_ in REQUEST_COLUMNS])

# A measured serving run's iteration log (<results_dir>/_iterations/<the row's file name>): one row per
# iteration, what a step time is fitted from (harness.serve.step_observations.IterationRecorder).
ITERATION_COLUMNS: list[tuple[str, pa.DataType, str, str]] = [
    ("decodes", I, "sequences", "sequences the iteration decoded one token for"),
    ("decode_keys", I, "keys", "keys those decodes attended, summed (harness.analysis.cache_terms.attended_keys)"),
    ("chunk_tokens", pa.list_(I), "tokens", "each prompt chunk's tokens, in order"),
    ("prefill_pairs", I, "pairs", "(query, key) pairs of the chunks' causal attention"),
    ("run_s", F, "s", "the executor's time for the iteration's passes"),
    ("cycle_s", F, "s", "the iteration's start to the next one's (the scheduler's work between them included); null: the last, or one after which every sequence left (the loop may have waited for an arrival)"),
]
ITERATION_SCHEMA = pa.schema([(name, dtype) for name, dtype, *_ in ITERATION_COLUMNS])

SCHEMA = pa.schema([(name, dtype) for name, dtype, *_ in COLUMNS])
COLUMN_NAMES = [name for name, *_ in COLUMNS]
COLUMNS_BY_SOURCE = {source: [c[0] for c in COLUMNS if c[4] == source] for source in ("point", "measured", "model", "roofs", "run")}


SOURCES = {  # the headings of docs/columns.md, one per source
    "point": "The point: what was asked for, resolved",
    "measured": "Measured in the point's process",
    "model": "The analytic model at this point",
    "roofs": "The roofs the row is judged against",
    "run": "The run",
}


def columns_markdown() -> str:
    """docs/columns.md, generated from COLUMNS (`python -m harness.store.columns > docs/columns.md`;
    a test keeps the committed file equal to this)."""
    lines = ["# Columns of a row", "",
             "Every Parquet row under `results/` has these columns, in this order (generated from",
             "`harness/store/columns.py` by `python -m harness.store.columns > docs/columns.md`; a test keeps",
             "them equal). Integers are nullable (pandas reads them as `Int64`), `timestamp` is a UTC",
             "timestamp. Ratios run measured / analytic; the `*_fraction` columns are shares of a roof reached.",
             ""]
    for source, heading in SOURCES.items():
        lines += [f"## {heading}", "", "| column | type | unit | meaning |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {dtype} | {unit} | {meaning} |"
                  for name, dtype, unit, meaning, where in COLUMNS if where == source]
        lines.append("")
    lines += ["## A serving run's per-request file", "",
              "`<results_dir>/_requests/<the row's file name>`, one row per request, beside the run's row (a `_` folder:",
              "`pandas.read_parquet(results_dir)` reads the rows alone, `pandas.read_parquet(results_dir + '/_requests')`",
              "every run's requests).", "", "| column | type | unit | meaning |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {dtype} | {unit} | {meaning} |" for name, dtype, unit, meaning in REQUEST_COLUMNS]
    lines.append("")
    lines += ["## A measured serving run's iteration log", "",
              "`<results_dir>/_iterations/<the row's file name>`, one row per iteration: what a simulation's step time",
              "is fitted from (`serving.executor=fitted`).", "", "| column | type | unit | meaning |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {dtype} | {unit} | {meaning} |" for name, dtype, unit, meaning in ITERATION_COLUMNS]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(columns_markdown(), end="")
