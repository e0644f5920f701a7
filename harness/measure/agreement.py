"""Agreement with the exact cache, for a strategy that claims full precision without a proof of exactness
(an engine's decoder at its full-precision KV type: strategies.engines.engine), checked before it is timed.

Such a strategy declares its bounds (strategies.base.Strategy.agreement). Two checks, each stated in
its row:
- before the rounds: the point's prompt through the exact reference and one decode step fed the
  reference's first token, beside the strategy's own session at the same position fed the same token:
  the largest |difference| of the two steps' logits, absolute and relative to the reference's largest
  |logit|. Beyond the bound (or a different first token) the member fails naming the difference, so its
  steps are never timed. The reference's step is the group's own exact contiguous member's where that
  member was set up first (offer_first_step: its prompt is prefilled once, not again for the check, which
  at batch 4 and ctx 4096 cost 45 s on 2 cores), else the point's `reference`'s (the strategy the
  accuracy pass scores against). Both are exact caches (tests/test_exactness.py).
- after the accuracy pass: its mean KL over the accuracy windows; beyond the bound the row turns failed,
  naming it, and its step time and ratios are dropped.
The reference's step is run once per group and shared (ReferencePasses), outside the member's peak.
"""
from __future__ import annotations

import torch

from harness.config import Point
from harness.measure.accuracy import ReferencePasses, reference_strategy
from harness.measure.decoding import start_decode

NOT_CHECKED = {"agreement_logit_max_abs": None, "agreement_logit_rel": None, "agreement_logit_rel_bound": None,
               "agreement_kl_mean_bound": None}
DROPPED_WHEN_FAILED = ("decode_step_s", "decode_step_p10_s", "decode_step_p90_s", "decode_step_ci_low_s",
                       "decode_step_ci_high_s", "tokens_per_s", "ratio_to_reference", "ratio_ci_low", "ratio_ci_high")


class Disagreement(Exception):
    """A strategy claiming full precision moved the logits beyond its bound. The message names how far;
    `columns` holds the figures for the failed row."""

    def __init__(self, message: str, columns: dict):
        super().__init__(message)
        self.columns = columns


def checks_agreement(point: Point) -> bool:
    """Whether the point's strategy declares agreement bounds, so that an exact first step is computed for it."""
    if point.reference is None:
        return False
    try:
        return point.strategy.instantiate().agreement() is not None
    except Exception:  # noqa: BLE001 - the member's own set-up meets the same error and records it
        return False


def _first_step_key(point: Point, model) -> tuple:
    """What an exact first step depends on: the model, the prompt, the batch and the seed."""
    return ("first_step", id(model), point.batch, point.ctx, point.prefill, point.prompt_hash, point.seed)


def offer_first_step(point: Point, model, session, first_token: torch.Tensor, references: ReferencePasses) -> None:
    """Keep the first step of a member that could be the group's reference (harness.config.layout.
    could_be_reference; its session at the first decode position, left there) for the agreement checks of the members set up after it."""
    key = _first_step_key(point, model)
    if point.strategy.could_be_reference and point.prefill == "compute" and key not in references:
        references[key] = (first_token, session.step(first_token))
        session.rewind(point.ctx)


def reference_first_step(point: Point, model, references: ReferencePasses) -> tuple[torch.Tensor, torch.Tensor]:
    """(first token [B], logits [B, V] of the decode step fed it) of an exact cache on the point's prompt:
    the group's exact member's (offer_first_step), or the point's reference's, computed once per group."""
    key = _first_step_key(point, model)
    if key not in references:
        reference = reference_strategy(point.reference)
        generator = torch.Generator(device=point.device).manual_seed(point.seed)
        session, first, _ = start_decode(point, lambda: reference.new_session(model, point.batch, point.max_len),
                                         generator)
        references[key] = (first, session.step(first))
        del session
    return references[key]


def check_first_step(point: Point, strategy, session, first_token: torch.Tensor, reference: tuple) -> dict:
    """The agreement columns of `session` (at the first decode position, left there) against the
    reference's first step; raises Disagreement beyond the strategy's bound."""
    bounds = strategy.agreement()
    exact_first, exact_logits = reference
    logits = session.step(exact_first)  # [B, V]
    session.rewind(point.ctx)
    difference = (logits.double() - exact_logits.double()).abs().max().item()
    relative = difference / exact_logits.double().abs().max().item()
    columns = {"agreement_logit_max_abs": difference, "agreement_logit_rel": relative,
               "agreement_logit_rel_bound": bounds.logit_rel, "agreement_kl_mean_bound": bounds.kl_mean}
    if not torch.equal(first_token.cpu(), exact_first.cpu()):
        raise Disagreement(f"the prompt's greedy token differs from the exact cache's ({first_token.tolist()} vs "
                           f"{exact_first.tolist()}); first-step logits max |diff| {difference:.3g} (rel {relative:.2g})",
                           columns)
    if relative > bounds.logit_rel:
        raise Disagreement(f"first-step logits differ from the exact cache's by max |diff| {difference:.3g}, rel "
                           f"{relative:.2g} > bound {bounds.logit_rel:g}", columns)
    return columns


def judge_kl(outcome: dict, strategy) -> dict:
    """The row's changes when the accuracy pass's mean KL exceeds the strategy's bound: failed, naming it,
    its timings dropped; {} otherwise (or when it declares no bound or the KL was not measured)."""
    bounds = strategy.agreement()
    kl = outcome.get("logit_kl_mean")
    if bounds is None or kl is None or kl <= bounds.kl_mean or outcome.get("status") != "ok":
        return {}
    return {**dict.fromkeys(DROPPED_WHEN_FAILED), "status": "failed",
            "reason": f"Disagreement: mean KL {kl:.3g} nats against the exact cache over the accuracy windows > bound "
                      f"{bounds.kl_mean:g}"}
