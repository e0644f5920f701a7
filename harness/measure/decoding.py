"""What every measured point does, alone or in a group (harness.measure.group): bring a session to its
first decode position, name its tokens, and measure how far an approximate strategy moves the outputs.
"""
from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import astuple

import numpy as np
import torch

from harness.config import Point
from harness.measure.accuracy import (FED_GREEDY, FED_TEXT, RECALL_COLUMNS, ReferencePasses, Windows, not_measured,
                                      probe_windows, recall_probe, reference_strategy, scored_after, teacher_forced)
from harness.measure.prompts import (accuracy_tokens_needed, accuracy_windows, checked_tokens, point_prompt,
                                     recall_windows)
from harness.model.checkpoint import check_unchanged
from harness.measure.rounds import RoundsOptions, Step, time_rounds
from harness.measure.timing import StepTimer


def tokens_digest(tokens: torch.Tensor) -> str:
    """Short hash of generated token ids [B, n]: equal digests mean identical greedy outputs."""
    return hashlib.sha256(tokens.to("cpu", torch.int64).numpy().tobytes()).hexdigest()[:16]


PREFILL = "prefill"  # the prompt's entrant in its rounds (start_decode)

def not_run(status: str, reason: str, **extra) -> dict:
    return {"status": status, "reason": reason, **extra}


def start_decode(point: Point, new_session, generator: torch.Generator, timer: StepTimer | None = None):
    """A session brought to the first decode position: the prompt run (timed, and repeated when a
    timer is given) or, with prefill=random, the cache filled with random K/V. `new_session()` makes a
    fresh session: each timed repeat of the prompt runs on a fresh one, so a cache never sees its
    prompt twice. The repeats are timed through the rounds engine (harness.measure.rounds: one call a
    pass, another pass while prefill_repeats and prefill_budget_s allow), which gives prefill_s its
    interval like a step's. Returns (session, first token [B], the prefill's Rounds, entrant
    PREFILL, or None). The random draws come
    in one fixed order, so every caller that seeds the same generator gets the same prompt, cache and
    tokens."""
    vocab = point.model.vocab_size
    if point.checkpoint_hash is not None:  # the weights the row will name are the ones planned
        check_unchanged(point.model.checkpoint, point.checkpoint_hash)
    session = new_session()
    if point.prefill == "random":
        session.fill_random(point.ctx, generator)
        return session, torch.randint(vocab, (point.batch,), generator=generator, device=generator.device), None
    if point.prompt is not None:  # the prompt file's windows: their first ctx tokens
        prompt = point_prompt(point, generator.device)[:, : point.ctx]  # [B, P]
    else:
        prompt = torch.randint(vocab, (point.batch, point.ctx), generator=generator, device=generator.device)  # [B, P]
    if timer is None:
        return session, session.prefill(prompt).argmax(-1), None
    held = {"session": session, "fresh": False}

    def before():  # a fresh session for every repeat after the first, untimed; its prefill bound to the prompt
        if held["fresh"]:
            held["session"] = None  # the last session's cache freed before the next is made
            held["session"] = new_session()
        held["fresh"] = True
        return functools.partial(held["session"].prefill, prompt)

    def after(logits):
        held["logits"] = logits

    # One call a pass; another while the budget allows: a long prompt is timed once, a short one up to
    # prefill_repeats times. No warm-up: the first run of the prompt is the one every point pays.
    options = RoundsOptions(rounds=1, max_passes=point.timing.prefill_repeats, budget_s=point.timing.prefill_budget_s,
                            warmup=0, read_contention=False, device=point.device)
    rounds = time_rounds({PREFILL: Step(None, before, after)}, options, timer=timer)
    return held["session"], held["logits"].argmax(-1), rounds


def accuracy_failed(error: BaseException) -> dict:
    """The accuracy columns of a member whose pass raised (an engine refusing what the pass asks of it):
    null, the error named where the reason for null scores goes. Its timed steps stand: they ran."""
    return not_measured(f"the accuracy pass failed: {type(error).__name__}: {str(error)[:300]}")


def accuracy(point: Point, strategy, model, references: ReferencePasses | None = None) -> dict:
    """The accuracy columns (harness.measure.accuracy): measured for a strategy that is not exact, on
    windows it prefills itself (the prompt's text, or with prefill=compute and no prompt file seeded
    random ids), so a point timed over a random fill is scored on its prompt file's text; null with the
    reason otherwise. `references` keeps the exact reference's pass
    for the next approximate strategy scored on the same windows (a group's members)."""
    if point.strategy.exact:
        return not_measured("exact strategy: its tokens equal the reference's (tokens_digest)")
    if point.prefill != "compute" and point.prompt is None:
        return not_measured("prefill=random without a prompt file: no text to score (with prompt=, the pass "
                            "prefills its own windows of the text)")
    if point.reference is None:
        return not_measured("no exact reference strategy was chosen for this point")
    if point.accuracy.at_batch is not None:  # harness.run.resolve keeps it only where the batch differs
        return not_measured(f"scored at batch={point.accuracy.at_batch} only (accuracy.at_batch): the pass does not "
                            "depend on the batch, and that batch's row of this variant holds the scores")
    if point.accuracy.max_ctx is not None:  # harness.run.resolve keeps it only where the ctx is longer
        return not_measured(f"scored up to ctx={point.accuracy.max_ctx} only (accuracy.max_ctx): a window's prompt "
                            f"of ctx={point.ctx} would be prefilled once per scored variant")
    windows = accuracy_windows_of(point, model.device)
    budget = point.strategy.layout.token_budget if point.strategy.layout is not None else 0
    if not scored_after(windows, budget).scored.any():
        return not_measured(f"token_budget={budget} is never filled by ctx={point.ctx} + accuracy.steps="
                            f"{windows.steps} tokens: nothing would be evicted while scored")
    reference = reference_strategy(point.reference)
    key = (point.reference, id(model), point.ctx, astuple(point.accuracy), point.prompt_hash, point.seed)
    references = references if references is not None else ReferencePasses()
    exact = references.get_or_run(key, reference, model, windows, point.accuracy.batch)
    columns = teacher_forced(strategy, exact, model, scored_after(windows, budget), point.accuracy.batch)
    recall = recall_windows(windows.prompts.cpu().numpy(), point.accuracy.steps) if point.accuracy.recall else None
    probe = scored_after(probe_windows(recall, model.device), budget) if recall is not None else None
    if probe is None or not probe.scored.any():
        columns.update(dict.fromkeys(RECALL_COLUMNS))
    else:
        exact_probe = references.get_or_run(key + ("recall",), reference, model, probe, point.accuracy.batch)
        began = time.perf_counter()
        columns.update(recall_probe(strategy, exact_probe, model, probe, recall.distance, point.accuracy.batch))
        columns["accuracy_s"] += time.perf_counter() - began + exact_probe.seconds
    fed = FED_TEXT if windows.targets is not None else FED_GREEDY
    columns["accuracy_reference"] = (f"{reference.name} ({reference.backend}, compute dtype), each scored token one "
                                     f"decode step teacher-forced on {fed}")
    return columns


def accuracy_windows_of(point: Point, device) -> Windows:
    """The accuracy pass's windows: the prompt text's (harness.measure.prompts), or seeded random
    prompts of ctx ids, as many as score accuracy.tokens at accuracy.steps a window."""
    settings = point.accuracy
    if point.prompt is not None:
        ids = checked_tokens(point, accuracy_tokens_needed(point.ctx, settings.tokens))
        text = accuracy_windows(ids, point.ctx, settings.steps, settings.tokens,
                                point.model.vocab_size, f"'{point.prompt}'")
        tensor = lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(device)  # noqa: E731
        return Windows(tensor(text.prompts), tensor(text.fed), tensor(text.targets), text.scored)
    steps = min(settings.steps, settings.tokens)
    count = -(-settings.tokens // steps)  # windows: the last scores what is left
    scored = np.arange(count * steps).reshape(count, steps) < settings.tokens  # [W, steps]
    generator = torch.Generator(device=device).manual_seed(point.seed)
    prompts = torch.randint(point.model.vocab_size, (count, point.ctx), generator=generator, device=device)
    return Windows(prompts, None, None, scored)
