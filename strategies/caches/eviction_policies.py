"""Which tokens an evicting cache keeps: the policies of `strategies.caches.eviction`, one small class each.

A policy is its paper's scores and parameters, nothing else. Every policy answers, per sequence and KV
head (each KV head keeps its own tokens):
- `weighted_rows(prompt_len)`: how many of the prompt's last query rows must hand back their attention
  weights (their column sums, averaged over the KV head's group of query heads, feed `prefill_scores`);
- `prefill_scores(...)`: the score each prompt token enters the cache's score table with;
- `entry_score(position, max_len)`: the score a generated token enters it with;
- `step_weights`: what a decode step does with its own attention weights (averaged over the group):
  nothing, add them to the table (H2O) or replace the table with them (TOVA);
- `protected_first` / `protected_recent`: the tokens it never drops, by position.
How the cache acts on those is one rule for every policy (`EvictionPolicy.select`, `EvictionPolicy.victims`):
it keeps the `budget` tokens of highest score at the end of prefill and, once a step has written its own
token into the budget + 1-th slot, frees the slot of lowest score, the protected ones never chosen. The
weights come from the attention the step computes anyway (strategies.caches.eviction): nothing here
runs a second attention pass.

The papers' rules and defaults:
- `streaming` (StreamingLLM, Xiao et al. 2023): `sinks` first tokens (4) + the most recent ones: its
  score is the position, so the oldest past the sinks goes.
- `h2o` (Zhang et al. 2023): heavy hitters by attention accumulated over every query so far (the
  prompt's included) + a window of the `recent` last tokens (0: half the budget, the paper's split).
- `snapkv` (Li et al. 2024): once at the end of prefill, the softmax of the last `window` prompt queries
  (32) over the prompt's keys, summed over those queries, averaged over each GQA group, max-pooled along
  the keys with `kernel_size` (5); the top budget - window of those plus the window itself. SnapKV
  compresses once and decoding appends; to hold the budget while decoding, each step drops the kept
  prompt token ranked lowest at prefill (the window's last), and generated tokens only once no prompt
  token is left, oldest first.
- `tova` (Oren et al. 2024): drop the token the current query attends to least, its weights averaged
  over the heads of the KV group; at the end of prefill, the last prompt query's weights choose.

Adding a policy is a subclass here (its `name`, `score` and parameters as dataclass fields, checked in
`__post_init__`) and a YAML under conf/strategy/ that sets `policy` to its name.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from strategies.base import StrategyOptionError

KEEP = float("inf")  # the rank of a token the policy never drops


class StepWeights(enum.IntEnum):
    """What a decode step does with its attention weights (the values are the C kernel's codes)."""

    IGNORE = 0  # the policy scores without them
    ACCUMULATE = 1  # added to the score table (H2O)
    REPLACE = 2  # written over the score table (TOVA: the step's own weights rank)


@dataclass(frozen=True)
class EvictionPolicy:
    """A policy with its parameters (its dataclass fields); the subclasses are the policies."""

    name: ClassVar[str]  # the value of strategy.policy that picks it
    score: ClassVar[str]  # what it ranks by: the layout's eviction_score (harness.config.layout.CacheLayout)
    step_weights: ClassVar[StepWeights] = StepWeights.IGNORE
    ranks_inside_cache: ClassVar[bool] = False  # may run with positions=in_cache (StreamingLLM's ranks)
    registered: ClassVar[dict[str, type[EvictionPolicy]]] = {}  # every policy by name

    budget: int  # tokens kept per sequence, KV head and layer

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        EvictionPolicy.registered[cls.name] = cls

    def __post_init__(self):
        _check_integer("budget", self.budget, 1)

    @classmethod
    def parameters(cls) -> dict:
        """The paper's parameters (its fields besides the budget) and their defaults."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name != "budget"}

    @property
    def protected_first(self) -> int:
        """Positions 0 .. protected_first - 1 are never dropped."""
        return 0

    @property
    def protected_recent(self) -> int:
        """The last protected_recent positions (the newest token's included) are never dropped."""
        return 0

    def weighted_rows(self, prompt_len: int) -> int:
        """The prompt's last query rows whose attention weights `prefill_scores` needs."""
        return 0

    def prefill_scores(self, column_sums: torch.Tensor | None, positions: torch.Tensor, max_len: int) -> torch.Tensor:
        """column_sums [B, n_kv, P] fp32 (the weighted rows' weights summed over rows, averaged over the
        group; None where no row is weighted), positions [P] int64 (0 .. P - 1) -> each prompt token's
        score, fp32, [B, n_kv, P] or broadcastable to it."""
        raise NotImplementedError

    def entry_score(self, position: int, max_len: int) -> float:
        """The score a generated token at `position` enters the table with."""
        return 0.0

    def protected(self, positions: torch.Tensor, newest: int) -> torch.Tensor:
        """Which of the original positions (any shape) the policy never drops while `newest` is the
        newest token's position."""
        return (positions < self.protected_first) | (positions > newest - self.protected_recent)

    def select(self, scores: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """The `budget` prompt positions kept at the end of prefill, per sequence and KV head, ascending
        [B, n_kv, budget] int64, from the prompt's scores [B, n_kv, P]: the protected ones, then the
        highest scores."""
        positions = torch.arange(prompt_len, device=scores.device)
        ranked = scores.masked_fill(self.protected(positions, prompt_len - 1), KEEP)
        return ranked.topk(self.budget, dim=-1).indices.sort(dim=-1).values

    def victims(self, positions: torch.Tensor, scores: torch.Tensor, position: int) -> torch.Tensor:
        """The slot each sequence and KV head frees, [B, n_kv] int64, from the filled slots' original
        positions [B, n_kv, S] and scores [B, n_kv, S] (this step's weights already in), `position`
        being the step's own token's: the lowest score among the slots not protected."""
        return scores.masked_fill(self.protected(positions, position), KEEP).argmin(dim=-1)


def _check_integer(option: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise StrategyOptionError(option, f"must be an integer >= {least}, got {value!r}")


def _check_inside_budget(option: str, value: int, budget: int) -> None:
    if value >= budget:
        raise StrategyOptionError(option, f"{value} leaves no room in a budget of {budget} tokens; must be < budget")


@dataclass(frozen=True)
class StreamingPolicy(EvictionPolicy):
    name = "streaming"
    score = "recency"
    ranks_inside_cache = True

    sinks: int = 4  # first tokens always kept (StreamingLLM: 4 attention sinks)

    def __post_init__(self):
        super().__post_init__()
        _check_integer("sinks", self.sinks, 0)
        _check_inside_budget("sinks", self.sinks, self.budget)

    @property
    def protected_first(self) -> int:
        return self.sinks

    def prefill_scores(self, column_sums, positions, max_len):
        return positions.float()

    def entry_score(self, position, max_len):
        return float(position)


@dataclass(frozen=True)
class H2OPolicy(EvictionPolicy):
    name = "h2o"
    score = "accumulated_attention"
    step_weights = StepWeights.ACCUMULATE

    recent: int = 0  # the last tokens always kept; 0: half the budget (the paper's even split)

    def __post_init__(self):
        super().__post_init__()
        _check_integer("recent", self.recent, 0)
        _check_inside_budget("recent", self.protected_recent, self.budget)

    @property
    def protected_recent(self) -> int:
        return self.recent or self.budget // 2

    def weighted_rows(self, prompt_len):
        return prompt_len  # every query so far

    def prefill_scores(self, column_sums, positions, max_len):
        return column_sums.float()


@dataclass(frozen=True)
class SnapKVPolicy(EvictionPolicy):
    name = "snapkv"
    score = "observation_window"

    window: int = 32  # the last prompt queries whose attention ranks the prompt (SnapKV: 32)
    kernel_size: int = 5  # the 1-D max-pooling of those scores along the keys (SnapKV: 5; odd, so centred)

    def __post_init__(self):
        super().__post_init__()
        _check_integer("window", self.window, 1)
        _check_integer("kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise StrategyOptionError("kernel_size", f"must be odd (the pooled score stays centred), got {self.kernel_size}")
        _check_inside_budget("window", self.window, self.budget)

    def weighted_rows(self, prompt_len):
        return min(self.window, prompt_len)

    def prefill_scores(self, column_sums, positions, max_len):
        """The pooled scores of the prompt before the window (each in [0, 1]), then the window's, above
        every pooled one; generated tokens enter above the window (entry_score)."""
        prompt_len = positions.shape[0]
        window = min(self.window, prompt_len)
        prefix = column_sums[..., : prompt_len - window].float() / window  # each in [0, 1]
        pooled = F.max_pool1d(prefix.flatten(0, 1)[:, None], self.kernel_size, stride=1,
                              padding=self.kernel_size // 2)[:, 0].view_as(prefix) if prefix.shape[-1] else prefix
        window_scores = (1.0 + positions[prompt_len - window:].float() / max_len).expand(*prefix.shape[:2], window)
        return torch.cat((pooled, window_scores), dim=-1)

    def entry_score(self, position, max_len):
        return 2.0 + position / max_len  # above every prompt token, the oldest generated token lowest


@dataclass(frozen=True)
class TOVAPolicy(EvictionPolicy):
    name = "tova"
    score = "current_attention"
    step_weights = StepWeights.REPLACE

    def weighted_rows(self, prompt_len):
        return 1  # the last prompt query

    def prefill_scores(self, column_sums, positions, max_len):
        return column_sums.float()


def policy_of(name: str, budget: int, parameters: dict) -> tuple[EvictionPolicy, dict]:
    """The policy `name` with its parameters taken from `parameters` (the strategy's options besides
    the ones every policy shares), and those options as configured. Every policy's parameters arrive
    together (conf/strategy/eviction.yaml sets each at its paper's default); one that is not this
    policy's must keep its default, and one no policy has is refused: both name this policy's options."""
    policies = EvictionPolicy.registered
    if name not in policies:
        raise StrategyOptionError("policy", f"unknown value {name!r}, allowed: {', '.join(policies)}")
    cls = policies[name]
    own = cls.parameters()
    others = {key: default for policy in policies.values() if policy is not cls
              for key, default in policy.parameters().items() if key not in own}
    for key, value in parameters.items():
        if key in own or (key in others and value == others[key]):
            continue
        takes = ", ".join(("budget", *own))
        why = f"policy {name} has no {key}" if key in others else f"no eviction policy has an option {key!r}"
        raise StrategyOptionError(key, f"{why} (set to {value!r}); policy {name} takes: {takes}")
    return cls(budget=budget, **{key: value for key, value in parameters.items() if key in own}), dict(parameters)
