"""How far an approximate cache moves the outputs, measured against an exact one on the same prompt.

For a strategy that does not declare itself exact (a quantized cache), after its timed steps and in
the same process, the point's prompt runs through the exact reference (the point's `reference`: an
exact strategy with the plain contiguous layout on a torch backend, chosen by capability in
harness.run.reference) and through the strategy again, and both are fed the same token at every step
(teacher forcing): the prompt file's text where the point has one (`prompt=PATH`), else the
reference's own greedy choice. The two see the same inputs, so each step's logits are comparable
however early their greedy choices would part. Per point:
- top1_agreement: share of (sequence, step) pairs whose argmax agrees;
- logit_max_abs_error: the largest |reference - strategy| logit over all of them;
- logit_kl_mean: the mean KL(reference || strategy) of the two softmaxes, in float64;
- with a prompt file, perplexity (the strategy's) and perplexity_reference over the text's tokens the
  decode steps predict, exp(mean negative log-likelihood), and perplexity_delta = perplexity -
  perplexity_reference. Perplexity is a statement about text: on seeded random ids it is not measured.
None of this runs inside a timed region. Rows of exact strategies leave these columns null: their
exactness is proven by token digests and tests instead.
"""
from __future__ import annotations

import math

import torch

from harness.config.validate import target_class

FED_TEXT = "the prompt file's next tokens"
FED_GREEDY = "its own greedy tokens"


def not_measured(reason: str) -> dict:
    return {"top1_agreement": None, "logit_max_abs_error": None, "logit_kl_mean": None, "accuracy_steps": None,
            "perplexity": None, "perplexity_reference": None, "perplexity_delta": None, "accuracy_reference": reason}


def reference_strategy(spec: str):
    """The strategy a point's `reference` names ("<module>.<Class>:<backend>"), built."""
    path, _, backend = spec.rpartition(":")
    return target_class("reference", path)(backend=backend)


def teacher_forced(strategy, reference, model, prompt: torch.Tensor, steps: int,
                   text: torch.Tensor | None = None) -> dict:
    """The accuracy columns of `strategy` against the exact `reference` strategy over `steps` decode
    steps after `prompt` [B, P]. `text` [B, steps + 1]: the tokens that follow the prompt, fed one a
    step and scored (perplexity); None feeds the reference's greedy tokens and scores nothing."""
    batch, max_len = prompt.shape[0], prompt.shape[1] + steps
    exact_session = reference.new_session(model, batch, max_len)
    candidate = strategy.new_session(model, batch, max_len)
    reference_logits, candidate_logits = [exact_session.prefill(prompt)], [candidate.prefill(prompt)]  # [B, V] each
    for i in range(steps):
        token = text[:, i] if text is not None else reference_logits[-1].argmax(-1)  # [B]: feeds both
        reference_logits.append(exact_session.step(token))
        candidate_logits.append(candidate.step(token))
    exact = torch.stack(reference_logits[1:]).double()  # [steps, B, V]: the decode steps' logits
    approximate = torch.stack(candidate_logits[1:]).double()
    log_p, log_q = exact.log_softmax(-1), approximate.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [steps, B]
    fed = FED_TEXT if text is not None else FED_GREEDY
    columns = {
        "top1_agreement": (exact.argmax(-1) == approximate.argmax(-1)).double().mean().item(),
        "logit_max_abs_error": (exact - approximate).abs().max().item(),
        "logit_kl_mean": kl.mean().item(),
        "accuracy_steps": steps,
        "perplexity": None, "perplexity_reference": None, "perplexity_delta": None,
        "accuracy_reference": f"{reference.name} ({reference.backend}, compute dtype), teacher-forced on {fed}",
    }
    if text is not None:
        targets = text[:, 1 : steps + 1].T.to(exact.device)[..., None]  # [steps, B, 1]: what each step predicts
        exact_ppl = math.exp(-log_p.gather(-1, targets).mean().item())
        approximate_ppl = math.exp(-log_q.gather(-1, targets).mean().item())
        columns.update(perplexity=approximate_ppl, perplexity_reference=exact_ppl,
                       perplexity_delta=approximate_ppl - exact_ppl)
    return columns
