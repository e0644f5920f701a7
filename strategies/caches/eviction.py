"""`eviction`: a cache that keeps at most `budget` tokens per sequence, KV head and layer, compacted into
slots preallocated for the budget, never a mask over the whole sequence. Approximate (`exact = False`):
the harness measures how far it moves; at a budget that holds the whole sequence it evicts nothing and
generates the exact cache's tokens (tests/test_exactness.py).

Variants (conf/strategy/): `streaming`, `h2o`, `snapkv`, `tova` (the policies and their papers'
defaults: strategies.caches.eviction_policies), and `snapkv_int4` (SnapKV over int4 slots). Options:
- `policy`, `budget`; the papers' parameters `sinks` (streaming), `recent` (h2o; 0: half the budget, as
  the paper splits it), `window` and `kernel_size` (snapkv's observation window and pooling);
- `positions`: `original` (every token keeps the position it was computed at, as kvpress does) or
  `in_cache` (streaming only, as StreamingLLM: positions are ranks inside the cache, so the window
  slides and the sinks stay at 0..sinks-1). RoPE scores depend only on the query's position minus the
  key's; ranking the window's tokens after the sinks shifts the query and the window alike, so
  in-cache positions are exactly the original keys with the sinks' keys rotated forward by the count of
  evicted tokens. Each step writes the sinks' keys so rotated from their original ones (a few rows,
  bitwise the original while nothing was evicted), rather than re-rotating the whole cache;
- `format`: empty (the compute dtype) or a per-token format of strategies.caches.quantization (int8, int4,
  fp8_e4m3, with `group_size` for int4), stored and read as the `quantized` strategy's `torch` backend does.

Slots: min(budget + 1, max_len) per sequence, KV head and layer. Between steps the cache holds at most
`budget` tokens; a step writes its own token into the free slot, attends over the filled slots (budget
+ 1 once full, as H2O and TOVA score the new token with the others), and then the policy frees the slot
the next step overwrites. Each slot also has its token's original position (int32) and the policy's
score (fp32): `kv_cache_bytes` counts them.

Prompt: it attends in full over its own K/V (as the papers and kvpress do: the budget applies once it
is stored), the policy chooses `budget` of them at the end of prefill, and those are written. Weights a
policy scores by come from the same attention call: the prompt's scored rows (all of them for h2o,
snapkv's window, tova's last) run as matmul + softmax in chunks of rows (the others through SDPA), and
a decode step of h2o or tova runs matmul + softmax over the slots and hands its weights on; streaming
and snapkv steps run SDPA. Their cost is inside the step's time.

Rewind: evicted tokens are gone, so the session keeps a snapshot of every layer's slots, positions,
scores and policy state as the prompt (or the random fill) left them, copies it back in place on
`rewind`, and replays the fed tokens up to the length asked: the same computation, outside any timed
region (the runner rewinds between its timed calls). Replaying the prompt instead would cost a prefill
of batch x ctx tokens for every warm-up step and timing pass. The snapshot is one more copy of the
kept slots: inside the member's peak memory (its set-up's), outside `kv_cache_bytes`. It refuses a
length inside the prompt.
"""
from __future__ import annotations

import torch

from harness.config import CacheLayout, ModelConfig
from strategies.caches.attention import KERNEL_NAME as SDPA_KERNEL
from strategies.caches.attention import grouped_attention
from strategies.backends import Backend
from strategies.base import CachedSession, DecodeSession, Strategy, StrategyOptionError
from strategies.caches.eviction_policies import EvictionPolicy, StepWeights, StreamingPolicy, policy_of
from strategies.caches.eviction_store import FullWidthSlots, QuantizedSlots
from strategies.caches.pools import PerSequencePool
from strategies.caches.quantization import FORMATS, QuantSpec, payload_width
from strategies.serving import SequenceMemory

WEIGHTED_KERNEL = "torch matmul + softmax (weights kept for the policy's scores)"
BACKENDS = (Backend("torch", f"{{policy}} eviction over the kept slots: {SDPA_KERNEL} or {WEIGHTED_KERNEL}"),)
POSITIONS = ("original", "in_cache")
PREFILL_CHUNK_ELEMENTS = 1 << 24  # attention weights one chunk of prompt rows holds at most (64 MiB in fp32)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weighted: int):
    """Causal attention of the prompt q [B, P, H, D] over its k, v [B, n_kv, P, D] -> (out [B, P, H, D],
    column sums [B, n_kv, P] fp32 of the last `weighted` rows' weights averaged over each group, or None).
    Those rows run as matmul + softmax, in chunks of rows, so their weights are the call's own; the
    other rows through SDPA."""
    batch, length, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    group, first = n_heads // n_kv, length - weighted
    outputs = [grouped_attention(q[:, :first], k[:, :, :first], v[:, :, :first], q_offset=0)] if first else []
    if not weighted:
        return outputs[0], None
    sums = torch.zeros(batch, n_kv, length, device=q.device, dtype=torch.float32)  # [B, n_kv, P]
    rows = max(1, PREFILL_CHUNK_ELEMENTS // (batch * n_heads * length))
    positions = torch.arange(length, device=q.device)
    for start in range(first, length, rows):
        end = min(length, start + rows)
        chunk = q[:, start:end].unflatten(2, (n_kv, group)).permute(0, 2, 3, 1, 4)  # [B, n_kv, G, T, D]
        logits = chunk @ k[:, :, None, :end].transpose(-1, -2) * head_dim ** -0.5  # [B, n_kv, G, T, end]
        visible = positions[None, :end] <= positions[start:end, None]  # [T, end]
        weights = logits.masked_fill(~visible, float("-inf")).softmax(-1, dtype=torch.float32)
        out = weights.to(v.dtype) @ v[:, :, None, :end]  # [B, n_kv, G, T, D]
        outputs.append(out.permute(0, 3, 1, 2, 4).flatten(2, 3))  # [B, T, H, D]
        sums[..., :end] += weights.sum(3).mean(2)
    return torch.cat(outputs, dim=1), sums


class EvictionLayerCache:
    def __init__(self, batch: int, n_kv: int, max_len: int, head_dim: int, device, dtype, policy: EvictionPolicy,
                 spec: QuantSpec | None, in_cache_positions: bool):
        self.policy, self.max_len = policy, max_len
        self.slots = min(policy.budget + 1, max_len)  # the kept tokens and the step's own
        shape = (batch, n_kv, self.slots)
        self.store = (QuantizedSlots(*shape, head_dim, device, dtype, spec) if spec is not None
                      else FullWidthSlots(*shape, head_dim, device, dtype))
        self.positions = torch.full(shape, -1, device=device, dtype=torch.int32)  # [B, n_kv, S] original positions
        self.scores = torch.zeros(shape, device=device, dtype=torch.float32)  # [B, n_kv, S] the policy's table
        self.free = torch.zeros(batch, n_kv, device=device, dtype=torch.int64)  # [B, n_kv] the slot written next once full
        # streaming with in-cache positions: the sinks' keys as first computed [B, n_kv, sinks, D]
        self.sink_keys = (torch.zeros(batch, n_kv, policy.protected_first, head_dim, device=device, dtype=dtype)
                          if in_cache_positions else None)
        self.rope = None  # the session's RotaryTable (set by EvictionSession)
        self.filled = 0  # slots in use (the kept tokens, and the step's own during a step)

    @property
    def nbytes(self) -> int:
        extra = self.sink_keys.nbytes if self.sink_keys is not None else 0
        return self.store.nbytes + self.positions.nbytes + self.scores.nbytes + self.free.nbytes + extra

    def reset(self) -> None:
        self.filled = 0
        self.positions.fill_(-1)
        self.scores.zero_()

    @property
    def _state(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a step reads or writes: the slots, positions, scores, next free slot, sinks' keys."""
        sinks = (self.sink_keys,) if self.sink_keys is not None else ()
        return (*self.store.tables, self.positions, self.scores, self.free, *sinks)

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        return self.filled, [table.clone() for table in self._state]

    def restore(self, saved: tuple[int, list[torch.Tensor]]) -> None:
        """Copy a snapshot back into the same tensors (in place: captured graphs keep their addresses)."""
        self.filled, tables = saved[0], saved[1]
        for table, copy in zip(self._state, tables):
            table.copy_(copy)

    def attend(self, q, k, v, start_pos):
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, n_kv, T, D]
        if q.shape[1] > 1:
            return self._prefill(q, k, v, start_pos)
        return self._step(q, k, v, start_pos)

    def _prefill(self, q, k, v, start_pos: int):
        if start_pos != 0 or self.filled:
            raise ValueError("an evicting cache takes several tokens at once only as the prompt, at position 0")
        policy, length = self.policy, k.shape[2]
        out, sums = prefill_attention(q, k, v, policy.weighted_rows(length))
        positions = torch.arange(length, device=k.device)
        scores = policy.prefill_scores(sums, positions, self.max_len).expand(*k.shape[:2], length)  # [B, n_kv, P]
        if length <= policy.budget:
            kept = positions.expand(*k.shape[:2], length)  # [B, n_kv, P]
        else:
            kept = policy.select(scores, length)  # [B, n_kv, budget]
            rows = kept[..., None].expand(-1, -1, -1, k.shape[-1])
            k, v = k.gather(2, rows), v.gather(2, rows)
        self.filled = kept.shape[-1]
        self.store.write(k, v, 0)
        self.positions[..., :self.filled] = kept
        self.scores[..., :self.filled] = scores.gather(-1, kept)
        if self.sink_keys is not None:
            sinks = min(policy.protected_first, self.filled)
            self.sink_keys[:, :, :sinks] = k[:, :, :sinks]
        return out

    def _step(self, q, k, v, position: int):
        policy = self.policy
        entry = policy.entry_score(position, self.max_len)
        if self.filled < self.slots:
            self.store.write(k, v, self.filled)
            self.positions[..., self.filled] = position
            self.scores[..., self.filled] = entry
            self.filled += 1
        else:
            self.store.scatter(k, v, self.free)
            self.positions.scatter_(2, self.free[..., None], position)
            self.scores.scatter_(2, self.free[..., None], entry)
        filled = self.filled
        keys, values = self.store.read(filled)  # [B, n_kv, filled, D]
        if self.sink_keys is not None:
            if position < policy.protected_first:
                self.sink_keys[:, :, position] = k[:, :, 0]
            self._rotate_sinks(keys, evicted=position + 1 - filled)
        if policy.step_weights != StepWeights.IGNORE:
            batch, _, n_heads, head_dim = q.shape
            grouped = q.view(batch, keys.shape[1], n_heads // keys.shape[1], head_dim)  # [B, n_kv, G, D]
            logits = grouped @ keys.transpose(-1, -2) * head_dim ** -0.5  # [B, n_kv, G, filled]
            probabilities = logits.softmax(-1, dtype=torch.float32)
            out = (probabilities.to(values.dtype) @ values).view(q.shape)  # [B, 1, H, D]
            weights = probabilities.mean(2)  # [B, n_kv, filled]: averaged over the group
            if policy.step_weights == StepWeights.ACCUMULATE:
                self.scores[..., :filled] += weights
            else:
                self.scores[..., :filled] = weights
        else:
            out = grouped_attention(q, keys, values, q_offset=position)
        if filled > policy.budget:
            self.free = policy.victims(self.positions[..., :filled], self.scores[..., :filled], position)
        return out

    def _rotate_sinks(self, keys: torch.Tensor, evicted: int) -> None:
        """Write into keys [B, n_kv, filled, D] (slots 0.. hold the sinks) the sinks' keys rotated forward
        by `evicted` positions: the cache's ranks (module docstring)."""
        sinks = min(self.policy.protected_first, keys.shape[2])
        original = self.sink_keys[:, :, :sinks]  # [B, n_kv, s, D]
        half = original.shape[-1] // 2
        swapped = original.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # (x2, x1), as RotaryTable.rotate
        keys[:, :, :sinks] = torch.addcmul(original * self.rope.cos[evicted], swapped, self.rope.sin[evicted])

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        """Stand in for a prompt of `length`: random K/V in min(length, budget) slots holding the
        policy's choice as streaming would make it (the protected first tokens, then the last ones),
        scored as the policy scores a prompt whose attention weights are random."""
        self.reset()
        policy = self.policy
        kept, sinks = min(length, policy.budget), min(policy.protected_first, length)
        device = self.positions.device
        positions = torch.cat((torch.arange(sinks, device=device), torch.arange(length - kept + sinks, length, device=device)))
        self.positions[..., :kept] = positions.to(torch.int32)
        sums = torch.empty(*self.scores.shape[:2], length, device=device).uniform_(generator=generator)  # [B, n_kv, P]
        scores = policy.prefill_scores(sums, torch.arange(length, device=device), self.max_len)
        self.scores[..., :kept] = scores.expand_as(sums)[..., positions]
        self.store.fill_random(kept, generator)
        if self.sink_keys is not None:
            self.sink_keys[:, :, :sinks] = self.store.read(sinks)[0]
        self.filled = kept


class EvictionSession(CachedSession):
    """A cached session that can replay itself: `rewind` (module docstring)."""

    def __init__(self, model, layer_caches, max_len: int):
        super().__init__(model, layer_caches, max_len)
        for cache in self.layer_caches:
            cache.rope = self.rope
        self.start = 0  # the prompt's (or random fill's) length: the earliest position a rewind reaches
        self.saved: list = []  # every layer's snapshot as the prompt left it
        self.fed: list[torch.Tensor] = []  # the tokens fed since, each [B]

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        for cache in self.layer_caches:
            cache.reset()
        logits = super().prefill(prompt)
        self._save()
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        logits = super().step(token)
        self.fed.append(token.clone())
        return logits

    def rewind(self, length: int) -> None:
        DecodeSession.rewind(self, length)  # the range check
        if length < self.start:
            raise ValueError(f"cannot rewind to {length}: an evicting cache replays from its prompt of {self.start} tokens")
        self.length = self.start + len(self.fed)  # undo the range check's move: the replay decides
        if length == self.length:
            return
        fed = self.fed[: length - self.start]
        for cache, saved in zip(self.layer_caches, self.saved):
            cache.restore(saved)
        self.length, self.fed = self.start, []
        for token in fed:
            self.step(token)

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        for cache in self.layer_caches:
            cache.fill_random(length, generator)
        self.length = length
        self._save()

    def _save(self) -> None:
        self.start, self.fed = self.length, []
        self.saved = [cache.snapshot() for cache in self.layer_caches]


class EvictionStrategy(Strategy):
    name = "eviction"
    exact = False  # dropped tokens move the logits; the harness measures by how much
    graph_capturable = False  # each step's slot is chosen from its data, and the replay log is kept in Python
    backends = BACKENDS
    chunked_prefill = False  # the policy chooses its tokens over the whole prompt, at position 0

    def serving_unavailable(self) -> str | None:
        return None

    def sequence_memory(self, shape, dtype) -> SequenceMemory:
        """Its slots, min(budget + 1, prompt + max_tokens), taken at admission: K and V (and their scales),
        an int32 position and an fp32 score per slot and KV head; per head the next free slot (int64) and
        the sinks' original keys (in_cache positions)."""
        heads, head_dim = shape.n_layers * shape.n_kv_heads, shape.resolved_head_dim
        stored = (2 * head_dim * dtype.itemsize if self.spec is None else
                  2 * payload_width(self.format, head_dim) + int(self.spec.scale_bytes_per_token(head_dim)))
        sinks = self.policy.protected_first * head_dim * dtype.itemsize if self.positions == "in_cache" else 0
        return SequenceMemory(heads * (stored + 8), reserved=True, kept_tokens=self.policy.budget + 1,
                              sequence_bytes=heads * (8 + sinks))

    def new_pool(self, model, memory, budget_bytes, max_len) -> PerSequencePool:
        return PerSequencePool(self, model, max_len, self.kernel(model.device, model.dtype, model.cfg))

    def __init__(self, backend: str = "auto", policy: str = StreamingPolicy.name, budget: int = 256, positions: str = "original",
                 format: str = "", group_size: int = 32, **parameters):
        """`parameters`: the policies' own (strategies.caches.eviction_policies; conf/strategy/eviction.yaml
        lists each with its paper's default), checked by the policy."""
        super().__init__(backend)
        self.policy, self.parameters = policy_of(policy, budget, parameters)
        if positions not in POSITIONS:
            raise StrategyOptionError("positions", f"unknown value {positions!r}, allowed: {', '.join(POSITIONS)}")
        if positions == "in_cache" and (not self.policy.ranks_inside_cache or format):
            ranking = [name for name, cls in EvictionPolicy.registered.items() if cls.ranks_inside_cache]
            raise StrategyOptionError("positions", f"in_cache (ranks inside the cache) is defined for policy="
                                                   f"{'|'.join(ranking)} over full-width slots; allowed here: original")
        if format not in ("", *FORMATS):
            raise StrategyOptionError("format", f"unknown value {format!r}, allowed: '' (the compute dtype), "
                                                f"{', '.join(FORMATS)}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2:
            raise StrategyOptionError("group_size", f"must be an even integer >= 2, got {group_size!r}")
        self.positions, self.format, self.group_size = positions, format, group_size
        self.spec = QuantSpec(format, group_size) if format else None

    @classmethod
    def option_defaults(cls) -> dict:
        parameters = {key: default for policy in EvictionPolicy.registered.values()
                      for key, default in policy.parameters().items()}
        return {**super().option_defaults(), **parameters}

    def options(self) -> dict:
        return {"policy": self.policy.name, "budget": self.policy.budget, **self.parameters,
                "positions": self.positions, "format": self.format, "group_size": self.group_size}

    def kernel(self, device, dtype, shape=None) -> str:
        super().kernel(device, dtype, shape)  # raises where it cannot run
        kind = WEIGHTED_KERNEL if self.policy.step_weights != StepWeights.IGNORE else SDPA_KERNEL
        stored = f", {self.format} slots dequantized per step" if self.format else ""
        return f"{self.policy.name} eviction, {kind} over the kept slots{stored}"

    def cache_layout(self, shape: ModelConfig | None = None) -> CacheLayout:
        if self.spec is None:
            return CacheLayout(token_budget=self.policy.budget, eviction_score=self.policy.score)
        if shape is None and self.format == "int4":
            raise ValueError("eviction: int4 slots' scale bytes depend on head_dim; pass the model shape")
        if shape is not None:
            self._check_shape(shape)
        head_dim = shape.resolved_head_dim if shape is not None else 1
        return CacheLayout(token_budget=self.policy.budget, eviction_score=self.policy.score,
                           value_bits=self.spec.value_bits, scale_bytes_per_token=self.spec.scale_bytes_per_token(head_dim))

    def _check_shape(self, shape: ModelConfig) -> None:
        if self.format == "int4" and shape.resolved_head_dim % self.group_size:
            raise StrategyOptionError("group_size", f"{self.group_size} does not divide head_dim "
                                                    f"{shape.resolved_head_dim} of {shape.name}")

    def check_point(self, prefill: str, shape: ModelConfig, max_len: int) -> None:
        super().check_point(prefill, shape, max_len)
        self._check_shape(shape)

    def new_session(self, model, batch: int, max_len: int) -> EvictionSession:
        c = model.cfg
        self._check_shape(c)
        caches = [EvictionLayerCache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype,
                                     self.policy, self.spec, self.positions == "in_cache")
                  for _ in range(c.n_layers)]
        return EvictionSession(model, caches, max_len)
