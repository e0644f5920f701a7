"""Every served token against the recompute reference: one teacher-forced pass per request, after the
run and untimed (serving.check_tokens).

The reference is the harness's exactness reference, the computation of the strategy that keeps no cache
(strategies.caches.no_cache): the whole sequence, prompt and served output, in one causal forward pass
from position 0, whose logits at every position say which token greedy decoding picks there. A served
token equal to the reference's pick at every position means greedy decoding with the recompute
reference, alone, would have produced exactly the served tokens. Per request:
- `first_divergence`: the first output token (0-based) where the served token is not the reference's
  pick; null when none is. An exact strategy diverges only where float order decides a near tie (a
  preempted request's recomputed prompt, a chunked prefill, batched linears summed in another order), and
  `divergence_margin` says how near: the reference's logit of its own pick minus its logit of the served
  token there. A margin far above round-off in an exact strategy's row is a defect, not float order.
- `reference_agreement`: the share of the request's output tokens that equal the reference's pick,
  teacher-forced along the served tokens: how closely an approximate strategy follows the exact one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from strategies.caches.no_cache import StatelessLayer


@dataclass(frozen=True)
class TokenCheck:
    """One request's served tokens against the reference (the module docstring)."""

    first_divergence: Optional[int]
    divergence_margin: Optional[float]
    reference_agreement: float


def check_request(model, prompt: torch.Tensor, output: list[int]) -> TokenCheck:
    """prompt [P] ids, output its served tokens -> the reference's verdict on them."""
    sequence = torch.cat((prompt, torch.tensor(output[:-1], dtype=prompt.dtype, device=prompt.device)))[None]
    layers = [StatelessLayer()] * model.cfg.n_layers
    logits = model(sequence, 0, layers, model.rotary_table(sequence.shape[1]), every_position=True)[0]
    scored = logits[prompt.shape[0] - 1:].float()  # [n, vocab]: position P - 1 + t predicts output token t
    served = torch.tensor(output, device=scored.device)
    picks = scored.argmax(-1)
    agree = picks == served
    differs = (~agree).nonzero()
    if not len(differs):
        return TokenCheck(None, None, 1.0)
    first = int(differs[0, 0])
    margin = float(scored[first, picks[first]] - scored[first, served[first]])
    return TokenCheck(first, margin, float(agree.float().mean()))


def check_tokens(model, prompts: list[torch.Tensor], outputs: list[list[int]]) -> list[TokenCheck]:
    """Every request's check, in order."""
    return [check_request(model, prompt, output) for prompt, output in zip(prompts, outputs)]


def summary(checks: list[TokenCheck], outputs: list[list[int]]) -> dict:
    """The row's columns of the checks: tokens checked, requests diverged, the earliest divergence, the
    smallest and largest margins at the requests' first divergences, the share of tokens agreeing."""
    diverged = [c for c in checks if c.first_divergence is not None]
    tokens = sum(len(o) for o in outputs)
    agreeing = sum(c.reference_agreement * len(o) for c, o in zip(checks, outputs))
    return {
        "tokens_checked": tokens,
        "requests_diverged": len(diverged),
        "first_divergence_min": min((c.first_divergence for c in diverged), default=None),
        "divergence_margin_min": min((c.divergence_margin for c in diverged), default=None),
        "divergence_margin_max": max((c.divergence_margin for c in diverged), default=None),
        "reference_agreement": agreeing / tokens if tokens else None,
    }
