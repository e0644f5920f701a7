"""How far an approximate cache moves the outputs, measured against an exact one on the same prompt.

For a strategy that does not declare itself exact (a quantized cache), after its timed steps and in
the same process, the point's prompt runs through the exact reference (the contiguous cache in the
compute dtype, through SDPA) and through the strategy again, and both are fed the reference's own
greedy tokens at every step (teacher forcing): the two see the same inputs, so each step's logits are
comparable however early their greedy choices would part. Per point:
- top1_agreement: share of (sequence, step) pairs whose argmax agrees;
- logit_max_abs_error: the largest |reference - strategy| logit over all of them;
- logit_kl_mean: the mean KL(reference || strategy) of the two softmaxes, in float64.
None of this runs inside a timed region. Rows of exact strategies leave these columns null: their
exactness is proven by token digests and tests instead.
"""
from __future__ import annotations

import torch

from strategies.contiguous import ContiguousStrategy

REFERENCE = "contiguous (sdpa, compute dtype), teacher-forced on its own greedy tokens"


def not_measured(reason: str) -> dict:
    return {"top1_agreement": None, "logit_max_abs_error": None, "logit_kl_mean": None, "accuracy_steps": None,
            "accuracy_reference": reason}


def teacher_forced(strategy, model, prompt: torch.Tensor, steps: int) -> dict:
    """The accuracy columns of `strategy` against the exact reference over `steps` decode steps after
    `prompt` [B, P]."""
    batch, max_len = prompt.shape[0], prompt.shape[1] + steps
    reference = ContiguousStrategy(backend="sdpa").new_session(model, batch, max_len)
    candidate = strategy.new_session(model, batch, max_len)
    reference_logits, candidate_logits = [reference.prefill(prompt)], [candidate.prefill(prompt)]  # [B, V] each
    for _ in range(steps):
        token = reference_logits[-1].argmax(-1)  # [B]: the reference's greedy choice feeds both
        reference_logits.append(reference.step(token))
        candidate_logits.append(candidate.step(token))
    exact = torch.stack(reference_logits[1:]).double()  # [steps, B, V]: the decode steps' logits
    approximate = torch.stack(candidate_logits[1:]).double()
    log_p, log_q = exact.log_softmax(-1), approximate.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [steps, B]
    return {
        "top1_agreement": (exact.argmax(-1) == approximate.argmax(-1)).double().mean().item(),
        "logit_max_abs_error": (exact - approximate).abs().max().item(),
        "logit_kl_mean": kl.mean().item(),
        "accuracy_steps": steps,
        "accuracy_reference": REFERENCE,
    }
