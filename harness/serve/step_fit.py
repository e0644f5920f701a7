"""A serving iteration's time fitted from this machine's measurements: a linear model over what the
iteration computes, per strategy. Pure: numpy.

An iteration (harness.serve.records.Iteration) is described by FEATURES, each a count its time grows
with: a fixed cost per iteration (the scheduler's own work and, where decodes and chunks share one
forward pass, the weights' read), a decode pass and each prompt chunk (each a pass of its own where
the executor runs them apart), every decoding sequence (its share of the matmuls, its row of
bookkeeping), every key a decode attends (its position's kept tokens and itself:
harness.analysis.cache_terms.attended_keys, so an evicting cache's budget caps it as it caps the
reads), every prompt token computed and every (query, key) pair of the chunks' attention
(harness.analysis.analytic.causal_pairs). The time is their sum, each times a coefficient.

The coefficients come from observations of measured time (each the features of one iteration, or of
one homogeneous step, and the seconds it took), by non-negative least squares on relative errors:
every coefficient is a cost, and a 2 ms decode step counts as much as a 200 ms prefill, since a
latency percentile is made of many small steps. Two sources (step_observations.py builds them):
- a serving run's own iterations, each timed from its start to the next one's (the scheduler's work
  between two iterations included): every feature;
- the step points of the same strategy (decode_step_s at each batch and ctx, prefill_s of each
  prompt): one homogeneous step or prompt each, which cannot tell the per-iteration cost from a pass's
  cost, so that feature is left out (STEP_FEATURES).
A fit that the observations cannot make (a feature the replay needs that nothing observed computes,
or features that vary together in every observation) raises FitError saying what the rows lack; the
fit records its residuals over its own observations.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from harness.analysis.analytic import Layout, causal_pairs
from harness.analysis.cache_terms import attended_keys
from harness.serve.records import Iteration

# What an iteration's time is fitted over (the module docstring), in this order.
FEATURES = ("iteration", "decode_pass", "chunks", "decodes", "decode_keys", "prefill_tokens", "prefill_pairs")
STEP_FEATURES = FEATURES[1:]  # homogeneous steps cannot tell the per-iteration cost from a pass's
# What each feature needs observed, for the message of a fit that lacks it.
NEEDS = {
    "iteration": "iterations of a serving run",
    "decode_pass": "decode steps",
    "chunks": "prompts computed (prefill=compute)",
    "decodes": "decode steps",
    "decode_keys": "decode steps",
    "prefill_tokens": "prompts computed (prefill=compute)",
    "prefill_pairs": "prompts computed (prefill=compute)",
}


class FitError(ValueError):
    """The observations cannot fit a step time; the message says what they lack."""


def feature_vector(**counts: float) -> np.ndarray:
    """FEATURES in order, from counts by name (a feature not named counts 0)."""
    unknown = set(counts) - set(FEATURES)
    if unknown:
        raise ValueError(f"not a step-time feature: {', '.join(sorted(unknown))}")
    return np.array([float(counts.get(name, 0.0)) for name in FEATURES])


def iteration_features(iteration: Iteration, layout: Layout) -> np.ndarray:
    """The FEATURES of one iteration of a strategy whose cache is `layout`."""
    return feature_vector(
        iteration=1, decode_pass=bool(iteration.decodes), chunks=len(iteration.prefills),
        decodes=len(iteration.decodes),
        decode_keys=sum(attended_keys(position, position + 1, layout) for position in iteration.positions),
        prefill_tokens=iteration.prefill_tokens,
        prefill_pairs=sum(causal_pairs(chunk.start, chunk.tokens) for chunk in iteration.prefills))


@dataclass(frozen=True)
class Observation:
    """One measured time and what it computed."""

    features: tuple[float, ...]  # FEATURES, in order
    seconds: float  # the time it took


@dataclass(frozen=True)
class StepFit:
    """A fitted step time and how well it fits its own observations."""

    coefficients: dict  # feature -> seconds per unit (FEATURES; 0 for a feature left out)
    source: str  # what it was fitted from, in words (step points, or serving runs, and which)
    observations: int  # how many
    residual_median: float  # median of |predicted / measured - 1| over the observations
    residual_p90: float  # 90th percentile of the same
    total_ratio: float  # sum of predicted over sum of measured seconds: the fit's bias on a whole run

    def seconds(self, features: np.ndarray) -> float:
        return float(np.dot(self._vector, features))

    @property
    def _vector(self) -> np.ndarray:
        return np.array([self.coefficients[name] for name in FEATURES])

    def as_json(self) -> str:
        return json.dumps({name: self.coefficients[name] for name in FEATURES})


def fit(observations: Sequence[Observation], source: str, features: Sequence[str] = FEATURES) -> StepFit:
    """Non-negative least squares of the observations' seconds over `features`, on relative errors."""
    if not observations:
        raise FitError(f"{source}: no observation to fit a step time from")
    used = [FEATURES.index(name) for name in features]
    design = np.array([obs.features for obs in observations], dtype=np.float64)[:, used]
    seconds = np.array([obs.seconds for obs in observations], dtype=np.float64)
    missing = [name for name, column in zip(features, design.T) if not column.any()]
    if missing:
        raise FitError(f"{source}: nothing observed computes {', '.join(missing)}; the rows need "
                       + "; ".join(dict.fromkeys(NEEDS[name] for name in missing)))
    scale = np.abs(design).max(axis=0)
    weighted = design / scale / seconds[:, None]  # relative errors, each column at unit scale
    if np.linalg.matrix_rank(weighted) < len(used):
        raise FitError(f"{source}: {', '.join(_dependent(weighted, features))} vary together in all "
                       f"{len(observations)} observations, so their costs cannot be told apart; the rows need "
                       "observations where they do not (step points at several batches and contexts, prompts of "
                       "several lengths, or a serving run's iterations)")
    solved = nnls(weighted, np.ones_like(seconds)) / scale
    coefficients = dict.fromkeys(FEATURES, 0.0)
    coefficients.update({name: float(value) for name, value in zip(features, solved)})
    predicted = design @ solved
    relative = np.abs(predicted / seconds - 1)
    return StepFit(coefficients, source, len(observations), float(np.median(relative)),
                   float(np.percentile(relative, 90)), float(predicted.sum() / seconds.sum()))


def _dependent(design: np.ndarray, features: Sequence[str]) -> list[str]:
    """The features whose columns the others span (leaving one out keeps the rank)."""
    rank = np.linalg.matrix_rank(design)
    return [name for i, name in enumerate(features)
            if np.linalg.matrix_rank(np.delete(design, i, axis=1)) == rank]


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0: Lawson and Hanson's active-set method (Solving Least Squares
    Problems, 1974, chapter 23), for the handful of columns a step time has."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    tolerance = 1e-10 * max(1.0, np.abs(a).max()) * max(a.shape)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ x)
        if passive.all() or (gradient[~passive] <= tolerance).all():
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            shrinking = passive & (z <= 0)
            alpha = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + alpha * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
    return x
