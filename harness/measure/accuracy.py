"""How far an approximate cache moves the outputs, measured against an exact one on the same tokens.

For a strategy that does not declare itself exact (a quantized cache), after the timed steps and in
the same process, an accuracy pass scores `accuracy.tokens` tokens, whatever decode_tokens is. They
come from windows (harness.measure.prompts.accuracy_windows): each window's prompt, ctx tokens, is
prefilled, then `accuracy.steps` one-token decode steps follow, each fed the window's next token and
scored on the logits it returns. The same windows run through the exact reference (the point's
`reference`: an exact strategy with the plain contiguous layout on a torch backend, chosen by capability
in harness.run.inputs) and through the strategy's cache, fed the same tokens (teacher forcing), so each
step's two distributions compare however early their greedy choices would part.

Every scored token is predicted by a decode step, one token at a time, as decoding with the cache runs:
the step reads the prompt's K/V and the earlier steps' K/V as the cache stores them (quantized, or in a
full-width residual window), and only its own token's K/V as computed. The prefill's own logits are not
scored: a prompt attends to its own K/V in full precision before storing them (as transformers'
QuantizedCache does), which no decode step does. A multi-token call would likewise let a chunk's
tokens see each other's K/V at full width.

The tokens fed are the text's, with a prompt file or built-in text (`prompt=`), and each step is scored
on the text's next token too (perplexity); with seeded random prompts they are the reference's own
greedy choices, and perplexity (a statement about text) is not measured. More windows rather than more
steps: a CPU decode step of 16 sequences costs little more than one of 4, while every window's prompt
is prefilled once per strategy. Windows run `accuracy.batch` at a time, so memory stays bounded. The
reference's pass is run once and kept for every approximate member of a group scored on the same
windows with the same model (`ReferencePasses`).

Per point, over the scored tokens:
- top1_agreement: share whose argmax agrees; logit_max_abs_error: the largest |reference - strategy| logit;
- logit_kl_mean, logit_kl_p99, logit_kl_max: KL(reference || strategy) of the two softmaxes in float64;
- perplexity and perplexity_reference: exp(mean negative log-likelihood of the text's tokens), their
  difference and ratio.
The top-1 agreement, mean KL, its 99th percentile and the perplexity ratio get 95% intervals by a
bootstrap over windows (harness.measure.intervals): tokens of one window share their text and their
cache, so they are not independent draws.

Scored after the budget has filled: a cache that keeps at most `token_budget` tokens (eviction) drops
nothing while it holds fewer, so a step whose context is below the budget is not scored (`scored_after`).

The recall probe (`recall_*`): perplexity on prose rewards keeping the recent tokens, which every
eviction policy does, so it cannot see a dropped token that mattered. The probe can: each accuracy
prompt is rebuilt so that its last RECALL_CUE_TOKENS tokens repeat a span from near its start, and the
decode steps are fed the rest of that span (harness.measure.prompts.recall_windows). A model continues
a repeat by copying from the first occurrence (induction heads, which small models have too), so an
exact cache predicts the span's next tokens almost always (`recall_top1_reference`), while a cache
that dropped the first occurrence, `recall_distance` positions back, must guess. Scored per repeated
token: recall_top1, the share whose argmax is the span's next token through the strategy's cache, and
recall_kl_mean, KL(reference || strategy), each with its interval over windows. The reference's probe
pass is kept with its text pass (`ReferencePasses`). Nothing here runs inside a timed region. Rows of exact strategies leave these
columns null: their exactness is proven by token digests and tests instead.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from harness.config.validate import target_class
from harness.measure.intervals import cluster_mean_interval, cluster_percentile_interval
from harness.measure.prompts import RecallWindows

FED_TEXT = "the text's tokens"
FED_GREEDY = "the reference's greedy tokens (random prompts)"
NOT_MEASURED = ("top1_agreement", "logit_max_abs_error", "logit_kl_mean", "logit_kl_mean_ci_low",
                "logit_kl_mean_ci_high", "logit_kl_p99", "logit_kl_max", "perplexity", "perplexity_reference", "perplexity_delta",
                "perplexity_ratio", "perplexity_ratio_ci_low", "perplexity_ratio_ci_high", "accuracy_tokens",
                "accuracy_ctx", "accuracy_steps", "accuracy_windows", "accuracy_s", "top1_agreement_ci_low",
                "top1_agreement_ci_high", "logit_kl_p99_ci_low", "logit_kl_p99_ci_high")
RECALL_COLUMNS = ("recall_top1", "recall_top1_ci_low", "recall_top1_ci_high", "recall_top1_reference",
                  "recall_kl_mean", "recall_kl_mean_ci_low", "recall_kl_mean_ci_high", "recall_tokens",
                  "recall_distance")


def not_measured(reason: str) -> dict:
    return {**dict.fromkeys(NOT_MEASURED + RECALL_COLUMNS), "accuracy_reference": reason}


def reference_strategy(spec: str):
    """The strategy a point's `reference` names ("<module>.<Class>:<backend>"), built."""
    path, _, backend = spec.rpartition(":")
    return target_class("reference", path)(backend=backend)


@dataclass(frozen=True)
class Windows:
    """What the pass runs: window i prefills prompts[i], then decode step j is fed fed[i, j] (None: the
    reference's greedy choice) and scored (on targets[i, j] where there is text) where scored[i, j]."""

    prompts: torch.Tensor  # [W, ctx]
    fed: torch.Tensor | None  # [W, steps]
    targets: torch.Tensor | None  # [W, steps]
    scored: np.ndarray  # [W, steps] bool

    @property
    def steps(self) -> int:
        return self.scored.shape[1]


@dataclass
class ReferencePass:
    """The exact reference over a set of windows: per chunk of windows, what each step was fed and the
    logits it returned, in the compute dtype (the score's float64 comes from these, as from the
    strategy's)."""

    fed: list[torch.Tensor]  # per chunk [b, steps]
    logits: list[torch.Tensor]  # per chunk [steps, b, V]
    seconds: float  # its wall time


class ReferencePasses(dict):
    """Reference passes of one process, by what they depend on: computed once, scored against by
    every approximate strategy that shares the reference, model and windows."""

    def get_or_run(self, key: tuple, reference, model, windows: Windows, chunk: int) -> ReferencePass:
        if key not in self:
            self[key] = reference_pass(reference, model, windows, chunk)
        return self[key]


def _chunks(windows: Windows, chunk: int):
    for start in range(0, windows.prompts.shape[0], chunk):
        yield slice(start, start + chunk)


def _sessions(n_windows: int, chunk: int, width: int):
    """(index of the reference's chunk, rows within that chunk, the same rows among all windows) for each
    session of at most `width` sequences (a strategy's forced_batch_limit) the chunks are cut into."""
    for first in range(0, n_windows, chunk):
        last = min(first + chunk, n_windows)
        for start in range(first, last, width):
            stop = min(start + width, last)
            yield first // chunk, slice(start - first, stop - first), slice(start, stop)


def reference_pass(reference, model, windows: Windows, chunk: int) -> ReferencePass:
    began = time.perf_counter()
    fed, logits = [], []
    for rows in _chunks(windows, chunk):
        prompts = windows.prompts[rows]  # [b, ctx]
        session = reference.new_session(model, prompts.shape[0], prompts.shape[1] + windows.steps)
        last, tokens, steps = session.prefill(prompts), [], []  # last: [b, V]
        for j in range(windows.steps):
            tokens.append(windows.fed[rows, j] if windows.fed is not None else last.argmax(-1))  # [b]
            last = session.step(tokens[-1])
            steps.append(last)
        del session
        fed.append(torch.stack(tokens, dim=1))  # [b, steps]
        logits.append(torch.stack(steps))  # [steps, b, V]
    return ReferencePass(fed, logits, time.perf_counter() - began)


def scored_steps(strategy, exact: ReferencePass, model, windows: Windows, chunk: int) -> tuple[dict, float]:
    """Per-token values [W, steps] of `strategy` teacher-forced on the reference's tokens, and the
    largest |reference - strategy| logit: kl, agree (argmaxes equal), and with targets the negative
    log-likelihoods (nll_*) and whether each argmax is the target (hit_*)."""
    n_windows, steps = windows.scored.shape
    names = ("kl", "agree", "nll_exact", "nll_strategy", "hit_exact", "hit_strategy")
    per_token = {name: np.zeros((n_windows, steps)) for name in names}
    max_abs = 0.0
    width = strategy.forced_batch_limit or chunk  # sequences a session of this strategy takes
    for index, part, rows in _sessions(n_windows, chunk, width):
        prompts = windows.prompts[rows]  # [b, ctx]
        session = strategy.new_session(model, prompts.shape[0], prompts.shape[1] + steps)
        session.prefill(prompts)
        for j in range(steps):
            exact_logits = exact.logits[index][j][part].double()  # [b, V]
            logits = session.step(exact.fed[index][part, j]).double()  # [b, V]
            log_p, log_q = exact_logits.log_softmax(-1), logits.log_softmax(-1)
            per_token["kl"][rows, j] = (log_p.exp() * (log_p - log_q)).sum(-1).cpu().numpy()
            per_token["agree"][rows, j] = (exact_logits.argmax(-1) == logits.argmax(-1)).cpu().numpy()
            max_abs = max(max_abs, (exact_logits - logits).abs().max().item())
            if windows.targets is not None:
                target = windows.targets[rows, j, None]  # [b, 1]: the text's next token
                per_token["nll_exact"][rows, j] = -log_p.gather(-1, target)[:, 0].cpu().numpy()
                per_token["nll_strategy"][rows, j] = -log_q.gather(-1, target)[:, 0].cpu().numpy()
                per_token["hit_exact"][rows, j] = (exact_logits.argmax(-1) == target[:, 0]).cpu().numpy()
                per_token["hit_strategy"][rows, j] = (logits.argmax(-1) == target[:, 0]).cpu().numpy()
        del session
    return per_token, max_abs


def teacher_forced(strategy, exact: ReferencePass, model, windows: Windows, chunk: int) -> dict:
    """The accuracy columns of `strategy` against the reference's pass over the same `windows`."""
    began = time.perf_counter()
    per_token, max_abs = scored_steps(strategy, exact, model, windows, chunk)
    columns = summary(per_token, windows.scored, windows.targets is not None)
    columns.update(logit_max_abs_error=max_abs, accuracy_ctx=windows.prompts.shape[1], accuracy_steps=windows.steps,
                   accuracy_windows=windows.scored.shape[0], accuracy_s=time.perf_counter() - began + exact.seconds)
    return columns


def scored_after(windows: Windows, token_budget: int) -> Windows:
    """The windows with only the steps scored whose context (ctx + j cached tokens) has filled a cache
    of at most `token_budget` tokens (0: no budget, every step scored)."""
    context = windows.prompts.shape[1] + np.arange(windows.steps)  # [steps]
    return dataclasses.replace(windows, scored=windows.scored & (context >= token_budget))


def probe_windows(recall: RecallWindows, device) -> Windows:
    """The recall probe as windows the passes run: every repeated token scored."""
    tensor = lambda array: torch.from_numpy(array).to(device)  # noqa: E731
    return Windows(tensor(recall.prompts), tensor(recall.fed), tensor(recall.targets),
                   np.ones(recall.fed.shape, dtype=bool))


def recall_probe(strategy, exact: ReferencePass, model, windows: Windows, distance: int, chunk: int) -> dict:
    """The recall_* columns of `strategy` over the probe's `windows` (the module docstring)."""
    per_token, _ = scored_steps(strategy, exact, model, windows, chunk)
    scored = windows.scored
    counts = scored.sum(axis=1)  # [W]
    hit, hit_low, hit_high = cluster_mean_interval(np.where(scored, per_token["hit_strategy"], 0).sum(axis=1), counts)
    kl, kl_low, kl_high = cluster_mean_interval(np.where(scored, per_token["kl"], 0).sum(axis=1), counts)
    return {"recall_top1": hit, "recall_top1_ci_low": hit_low, "recall_top1_ci_high": hit_high,
            "recall_top1_reference": float(per_token["hit_exact"][scored].mean()), "recall_kl_mean": kl,
            "recall_kl_mean_ci_low": kl_low, "recall_kl_mean_ci_high": kl_high,
            "recall_tokens": int(counts.sum()), "recall_distance": distance}


def summary(per_token: dict, scored: np.ndarray, has_text: bool) -> dict:
    """The columns from per-token values [W, steps] where `scored`; intervals resample windows."""
    counts = scored.sum(axis=1)  # [W]
    kl = per_token["kl"][scored]
    kl_mean, kl_low, kl_high = cluster_mean_interval(np.where(scored, per_token["kl"], 0).sum(axis=1), counts)
    agree, agree_low, agree_high = cluster_mean_interval(np.where(scored, per_token["agree"], 0).sum(axis=1), counts)
    p99, p99_low, p99_high = cluster_percentile_interval(per_token["kl"], scored, 99)
    columns = {
        "top1_agreement": agree, "top1_agreement_ci_low": agree_low, "top1_agreement_ci_high": agree_high,
        "logit_kl_mean": kl_mean, "logit_kl_mean_ci_low": kl_low, "logit_kl_mean_ci_high": kl_high,
        "logit_kl_p99": p99, "logit_kl_p99_ci_low": p99_low, "logit_kl_p99_ci_high": p99_high,
        "logit_kl_max": float(kl.max()),
        "accuracy_tokens": int(counts.sum()),
        "perplexity": None, "perplexity_reference": None, "perplexity_delta": None,
        "perplexity_ratio": None, "perplexity_ratio_ci_low": None, "perplexity_ratio_ci_high": None,
    }
    if has_text:
        exact = math.exp(per_token["nll_exact"][scored].mean())
        approximate = math.exp(per_token["nll_strategy"][scored].mean())
        excess = np.where(scored, per_token["nll_strategy"] - per_token["nll_exact"], 0).sum(axis=1)  # [W]
        log_ratio, low, high = cluster_mean_interval(excess, counts)
        columns.update(perplexity=approximate, perplexity_reference=exact, perplexity_delta=approximate - exact,
                       perplexity_ratio=math.exp(log_ratio), perplexity_ratio_ci_low=math.exp(low),
                       perplexity_ratio_ci_high=math.exp(high))
    return columns
