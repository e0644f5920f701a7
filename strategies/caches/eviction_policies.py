"""Which tokens an evicting cache keeps: the four policies of `strategies.caches.eviction`, as pure torch.

A policy answers three questions, all per sequence and KV head (each KV head keeps its own tokens):
- `weighted_rows(prompt_len)`: how many of the prompt's last query rows must hand back their attention
  weights (their column sums, averaged over the KV head's group of query heads, are its prefill score);
- `select(...)`: which `budget` prompt tokens survive the end of prefill;
- `victims(...)`: during decoding, once the cache holds budget + 1 tokens (the kept ones and the step's
  own), which one to drop.
The weights come from the attention the step computes anyway (strategies.caches.eviction): nothing here runs a
second attention pass.

The papers' rules and defaults:
- `streaming` (StreamingLLM, Xiao et al. 2023): `sinks` first tokens (4) + the most recent ones.
- `h2o` (Zhang et al. 2023): heavy hitters by attention accumulated over every query so far (the
  prompt's included) + a window of the `recent` last tokens (the paper splits the budget in two halves).
- `snapkv` (Li et al. 2024): once at the end of prefill, the softmax of the last `window` prompt queries
  (32) over the prompt's keys, summed over those queries, averaged over each GQA group, max-pooled along
  the keys with `kernel_size` (5); the top budget - window of those plus the window itself. SnapKV
  compresses once and decoding appends; to hold the budget while decoding, each step drops the kept
  prompt token ranked lowest at prefill (the window's last), and generated tokens only once no prompt
  token is left, oldest first.
- `tova` (Oren et al. 2024): drop the token the current query attends to least, its weights averaged
  over the heads of the KV group; at the end of prefill, the last prompt query's weights choose.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

POLICIES = ("streaming", "h2o", "snapkv", "tova")
# The layout's eviction_score per policy (harness.config.layout.CacheLayout.eviction_score).
SCORES = {"streaming": "recency", "h2o": "accumulated_attention", "snapkv": "observation_window",
          "tova": "current_attention"}
KEEP = float("inf")  # the score of a token the policy never drops


class Policy:
    """One policy with its options (strategies.caches.eviction.EvictionStrategy checks them)."""

    def __init__(self, name: str, budget: int, sinks: int, recent: int, window: int, kernel_size: int):
        self.name, self.budget = name, budget
        self.sinks, self.recent, self.window, self.kernel_size = sinks, recent, window, kernel_size

    @property
    def needs_weights(self) -> bool:
        """Decode steps must return their attention weights (h2o accumulates them, tova ranks by them)."""
        return self.name in ("h2o", "tova")

    def weighted_rows(self, prompt_len: int) -> int:
        """The prompt's last query rows whose attention weights the prefill score needs."""
        return {"streaming": 0, "h2o": prompt_len, "snapkv": min(self.window, prompt_len), "tova": 1}[self.name]

    def prefill_scores(self, column_sums: torch.Tensor | None, prompt_len: int, max_len: int) -> torch.Tensor | None:
        """column_sums [B, n_kv, P] (weights of the weighted rows, summed over rows, averaged over the
        group) -> the score each prompt token keeps in the cache's score table [B, n_kv, P], or None
        where the policy keeps no table (streaming: positions decide; tova: each step's weights do)."""
        if self.name == "h2o":
            return column_sums.float()
        if self.name != "snapkv":
            return None
        window = min(self.window, prompt_len)
        prefix = column_sums[..., : prompt_len - window].float() / window  # each in [0, 1]
        pooled = F.max_pool1d(prefix.flatten(0, 1)[:, None], self.kernel_size, stride=1,
                              padding=self.kernel_size // 2)[:, 0].view_as(prefix) if prefix.shape[-1] else prefix
        # The window outranks every pooled score ([0, 1]); generated tokens outrank the window (decode_score).
        positions = torch.arange(prompt_len - window, prompt_len, device=prefix.device, dtype=torch.float32)
        window_scores = (1.0 + positions / max_len).expand(*prefix.shape[:2], window)
        return torch.cat((pooled, window_scores), dim=-1)

    def decode_score(self, position: int, max_len: int) -> float:
        """The table score a generated token enters with (snapkv: above every prompt token, oldest lowest;
        h2o: nothing accumulated yet)."""
        return 2.0 + position / max_len if self.name == "snapkv" else 0.0

    def select(self, prompt_len: int, scores: torch.Tensor | None, column_sums: torch.Tensor | None,
               batch: int, n_kv: int, device) -> torch.Tensor:
        """The `budget` prompt positions kept at the end of prefill, per sequence and KV head, ascending:
        [B, n_kv, budget] int64."""
        budget = self.budget
        if self.name == "streaming":
            kept = torch.cat((torch.arange(self.sinks, device=device),
                              torch.arange(prompt_len - (budget - self.sinks), prompt_len, device=device)))
            return kept.expand(batch, n_kv, budget).contiguous()
        if self.name == "tova":
            ranked = column_sums.float()
        else:
            protected = self.recent if self.name == "h2o" else min(self.window, prompt_len)
            ranked = scores.clone()
            ranked[..., prompt_len - protected:] = KEEP
        return ranked.topk(budget, dim=-1).indices.sort(dim=-1).values

    def victims(self, positions: torch.Tensor, scores: torch.Tensor, weights: torch.Tensor | None,
                position: int) -> torch.Tensor:
        """The slot each sequence and KV head drops, [B, n_kv] int64, from the filled slots' original
        positions [B, n_kv, S], the score table [B, n_kv, S] and this step's weights [B, n_kv, S] (averaged
        over the group), `position` being the step's own token's."""
        if self.name == "streaming":
            ranked = positions.float().masked_fill(positions < self.sinks, KEEP)  # the oldest past the sinks
        elif self.name == "h2o":
            ranked = scores.masked_fill(positions > position - self.recent, KEEP)
        elif self.name == "snapkv":
            ranked = scores
        else:
            ranked = weights
        return ranked.argmin(dim=-1)
