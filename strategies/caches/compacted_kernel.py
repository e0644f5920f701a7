"""The compacted-slot kernels (`cpu_compacted_attention.c`): decode attention of one query per sequence
and query head over each (sequence, KV head)'s filled slots, fp32 or quantized, with a policy's step
weights written into its score table in the same pass; and an evicting cache's whole decode step
around it (the new token written, the slot to free chosen). The operators of the kernels' extension
(harness.kernels.extension), built on first use for this CPU; where they cannot be, `unavailable` says
why. `pruned_key_attention` is think's read of keys pruned to their kept channels (`cpu_pruned_attention.c`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from harness.kernels.extension import EXTENSION, Kernel, ops
from strategies.caches.eviction_policies import EvictionPolicy, StepWeights

COMPACTED_KERNEL = Kernel("cpu_compacted_attention.c")
PRUNED_KERNEL = Kernel("cpu_pruned_attention.c")


def slots_code(format: str) -> int:
    """The kernels' code for slots of a per-token format ('' for the compute dtype's fp32)."""
    return EXTENSION.constants[f"FORMAT_{format.upper()}" if format else "SLOTS_FP32"]


def step_weights_code(step_weights: StepWeights) -> int:
    """The kernels' code for what a step does with its weights."""
    return EXTENSION.constants[f"STEP_WEIGHTS_{step_weights.name}"]


def compacted_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                        fill: torch.Tensor, scores: torch.Tensor | None = None,
                        step_weights: StepWeights = StepWeights.IGNORE, format: str = "", span: int = 0) -> torch.Tensor:
    """q [B, n_kv, G, D] fp32 over the slots each (sequence, KV head) has filled -> [B, n_kv, G, D].

    keys, values: (table,) fp32 [B, n_kv, S, D], or (payload [B, n_kv, S, W], scales [B, n_kv, S, D /
    span]) of a per-token `format` (strategies.caches.quantization). fill [B, n_kv] int32: the slots
    0..fill-1 each pair attends over, any count from 1 to S (sequences of different lengths cost what
    they hold). scores [B, n_kv, S] fp32 takes the step's weights, averaged over each KV head's group of
    query heads, as `step_weights` says (None where it is IGNORE)."""
    return ops().compacted_decode_attention(q, list(keys), list(values), fill, scores, step_weights_code(step_weights),
                                            slots_code(format), span)


def evicting_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store, fill: torch.Tensor,
                  positions: torch.Tensor, scores: torch.Tensor, free: torch.Tensor, position: int,
                  policy: EvictionPolicy, max_len: int, sink_keys: torch.Tensor | None = None,
                  cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """An evicting cache's decode step in one call: the new token k, v [B, n_kv, D] at `position`
    written into each pair's next slot of `store` (strategies.caches.eviction_store; fill counted up,
    its position and the policy's entry score beside it), the sinks' keys [B, n_kv, sinks, D] rotated by
    RoPE's cos/sin tables where given (in-cache positions), q [B, n_kv, G, D] attended over the filled
    slots with the policy's step weights into `scores`, and each pair over the budget's slot to free
    next chosen into `free` [B, n_kv] -> [B, n_kv, G, D]."""
    keys, values = store.kernel_tables
    return ops().evicting_decode_step_(
        q, k, v, keys, values, fill, positions, scores, free, position, policy.entry_score(position, max_len),
        step_weights_code(policy.step_weights), policy.budget, policy.protected_first, policy.protected_recent,
        slots_code(store.format), store.span, sink_keys, cos, sin)


def pruned_key_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         channels: torch.Tensor, position: int) -> torch.Tensor:
    """q [B, n_kv, G, D] over rows 0..position of k [B, n_kv, S, kept] (keys at their kept channels,
    `channels` [B, n_kv, kept] int64) and v [B, n_kv, S, D], after writing row `position` from k_new,
    v_new [B, n_kv, D] -> [B, n_kv, G, D]. k needs D - kept floats of storage after its last row."""
    return ops().pruned_key_decode_attention_(q, k_new, v_new, k, v, channels, position)
