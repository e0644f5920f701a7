"""What a serving point must pass before anything runs (harness.run.plan calls `check_serving_config`,
then `check_serving_fits` once the point is resolved, for every serving job): one ConfigError naming
the key and what is allowed, so a bad sweep ends with exit code 2 and nothing written.

- The workload's values and its trace (harness.serve.workload.build_workload): lengths below 1, a
  malformed or empty trace, a rate that is not above 0, and so on.
- The scheduling keys: a budget, a chunk and a batch that are positive, objectives that are times
  (finite seconds above 0, or null); the simulation's keys (serving.executor, fit_from, hardware, tp,
  reserve) known, and each set only where its executor reads it; no budget only for a roofline
  simulation (the node's memory left after the weights is its budget).
- Every request fits the model: prompt plus output (or max_tokens) within the checkpoint's context
  (config.json's max_position_embeddings, a GGUF file's llama.context_length); random weights have none.
- Every request fits the budget alone, by the strategy's own accounting (a reservation's prompt +
  max_tokens, a paged sequence's blocks at its longest): a budget below one request can serve nothing.
  A strategy that cannot serve at all is not refused here: its row says why (harness.serve.point).
"""
from __future__ import annotations

import json
import math

import torch

from harness.config.paths import checkpoint_location
from harness.analysis.hardware import available_hardware
from harness.config.validate import ConfigError, one_of, positive_float, positive_int
from harness.model.gguf_file import metadata
from harness.serve.memory import KVMemory
from harness.serve.simulated_point import EXECUTORS, FIT_SOURCES, ROOFLINE
from harness.serve.workload import Workload, build_workload

BUDGET_MAX = 2.0**62  # bytes: far beyond any device, within a 64-bit integer


def check_scheduling(serving) -> None:
    """serving.* values (a ServingConfig or its DictConfig)."""
    check_simulation(serving)
    if serving.kv_budget_bytes is not None or serving.executor != ROOFLINE:
        positive_float("serving.kv_budget_bytes", serving.kv_budget_bytes, at_least=1, at_most=BUDGET_MAX)
    if serving.prefill_chunk is not None:
        positive_int("serving.prefill_chunk", serving.prefill_chunk, at_most=2**31 - 1)
    positive_int("serving.max_batch", serving.max_batch, at_most=2**20)
    for key in ("ttft_s", "tpot_s"):
        value = serving.slo[key] if hasattr(serving.slo, "keys") else getattr(serving.slo, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ConfigError(f"serving.slo.{key}", f"must be a time in seconds above 0, or null for no objective; "
                                                    f"got {value!r}")


def check_simulation(serving) -> None:
    """The keys that say how a point is simulated (harness.serve.simulated_point), each only where it is read."""
    one_of("serving.executor", serving.executor, EXECUTORS)
    one_of("serving.fit_from", serving.fit_from, FIT_SOURCES)
    positive_int("serving.tp", serving.tp, at_most=4096)
    if serving.reserve is not None and (isinstance(serving.reserve, bool) or not isinstance(serving.reserve, (int, float))
                                        or not 0 <= serving.reserve < 1):
        raise ConfigError("serving.reserve", f"must be a share from 0 to below 1, or null; got {serving.reserve!r}")
    if serving.executor == ROOFLINE:
        if serving.hardware is None:
            raise ConfigError("serving.hardware", "serving.executor=roofline needs a device: one of "
                                                  f"{', '.join(available_hardware())}")
        one_of("serving.hardware", serving.hardware, tuple(available_hardware()))
    else:
        for key, default in (("hardware", None), ("tp", 1), ("reserve", None)):
            if getattr(serving, key) != default:
                raise ConfigError(f"serving.{key}", f"is read only with serving.executor=roofline (here "
                                                    f"{serving.executor}); leave it at {default}")


def model_context(checkpoint: str | None) -> int | None:
    """The longest sequence the checkpoint was made for, or None (random weights, or none declared)."""
    if not checkpoint:
        return None
    path = checkpoint_location(str(checkpoint))
    if path.is_file():
        found = metadata(path, "llama.context_length")
    else:
        found = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    return int(found) if isinstance(found, (int, float)) and not isinstance(found, bool) and found > 0 else None


def check_serving_config(cfg) -> Workload:
    """A serving job's own values (the workload, its trace, the scheduling keys), before its point is
    resolved; returns its workload."""
    check_scheduling(cfg.serving)
    return build_workload(cfg.workload, cfg.seed)


def check_serving_fits(cfg, point, workload: Workload) -> None:
    """A serving job's requests against its model and its budget (the module docstring)."""
    context = model_context(point.model.checkpoint)
    for request in workload.requests:
        longest = request.prompt_len + max(request.output_len, request.max_tokens)
        if context is not None and longest > context:
            raise ConfigError("workload", f"request {request.index} needs {longest:,} tokens (prompt {request.prompt_len:,} "
                                          f"+ output {max(request.output_len, request.max_tokens):,}), beyond "
                                          f"{point.model.name}'s context of {context:,}; choose a smaller "
                                          "workload.length_scale or workload.max_tokens")
    strategy = point.strategy.instantiate()
    if strategy.serving_unavailable() is not None:
        return
    if cfg.serving.kv_budget_bytes is None:  # a node's memory (a roofline simulation): planned when it runs
        return
    layout = strategy.sequence_memory(point.model, getattr(torch, point.dtype))
    memory = KVMemory(layout, int(cfg.serving.kv_budget_bytes))
    for request in workload.requests:
        longest = request.prompt_len + request.output_len
        if not memory.fits_empty(longest, request.reserve):
            need = layout.taken_bytes(longest, request.reserve)
            raise ConfigError("serving.kv_budget_bytes", f"{cfg.serving.kv_budget_bytes:.0f} bytes cannot hold request "
                                                         f"{request.index} alone under {point.strategy.variant} "
                                                         f"({need:,} bytes: prompt {request.prompt_len}, max_tokens "
                                                         f"{request.max_tokens}); give at least that")
