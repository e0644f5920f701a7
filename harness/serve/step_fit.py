"""A serving iteration's time fitted from this machine's measurements: a linear model over what the
iteration computes, per strategy. Pure: numpy.

An iteration (harness.serve.records.Iteration) runs forward passes: one over its decoding sequences,
one row each, and one per prompt chunk, a row per token (harness.serve.executor). Its time is a sum of
costs, each a coefficient times one of FEATURES:
- `iteration`: a fixed cost per iteration (the scheduler's own work, the Python around the passes);
- `passes`, `rows`: each forward pass and each row it multiplies through the weights, for passes of
  at most `row_split` rows; `wide_passes`, `wide_rows`: the same above it. The linears run another
  kernel above a number of rows (harness.model.cpu_linear: the C small-batch linear up to its
  max_rows, aten's blocked GEMM above), whose fixed cost and cost per row differ: one line cannot hold
  both (measured: a 17-token prompt chunk cost 100 ms where a 14-token one cost 60 ms). `row_split`
  None: one kernel at every size, every pass counted in `passes` and `rows`;
- `decodes`: each decoding sequence beyond its row (its RoPE row, its share of the ragged attention's
  set-up, or its own attention call where a pool calls one per sequence);
- `decode_keys`: each key a decode attends (its position's kept tokens and itself:
  harness.analysis.cache_terms.attended_keys, so an evicting cache's budget caps it as it caps reads);
- `prefill_pairs`: each (query, key) pair of the chunks' causal attention (harness.analysis.analytic.causal_pairs).

The coefficients come from observations of measured time (each the features of one iteration, or of
one homogeneous step or prompt, and the seconds it took) by non-negative least squares on relative
errors: every coefficient is a cost, and a 15 ms decode step counts as much as a 300 ms prefill, since
a latency percentile is made of many small steps. Where the observations cannot tell the cost of a
feature from the others' (it varies with them in every observation: step points have one pass each,
so `iteration` and `passes` go together), it is merged into them, in the order MERGEABLE, and the fit
says so; a feature the observations never computed has no cost to give, and a replay that needs it
raises FitError naming what the rows lack. The fit keeps its residuals over its own observations.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from harness.analysis.analytic import Layout, causal_pairs
from harness.analysis.cache_terms import attended_keys
from harness.serve.records import Iteration

# What an iteration's time is fitted over (the module docstring), in this order.
FEATURES = ("iteration", "passes", "rows", "wide_passes", "wide_rows", "decodes", "decode_keys", "prefill_pairs")
# Merged into the others, in this order, while the observations cannot tell their costs apart.
MERGEABLE = ("decodes", "iteration", "prefill_pairs", "decode_keys", "passes", "wide_passes")
# What the rows need to have observed a feature, for the message of a replay that needs it.
NEEDS = {
    "iteration": "iterations of a serving run",
    "passes": "decode steps or prompts within the linears' row split",
    "rows": "decode steps or prompts within the linears' row split",
    "wide_passes": "decode steps or prompts above the linears' row split (larger batches, longer prompts)",
    "wide_rows": "decode steps or prompts above the linears' row split (larger batches, longer prompts)",
    "decodes": "decode steps",
    "decode_keys": "decode steps",
    "prefill_pairs": "prompts computed (prefill=compute)",
}


class FitError(ValueError):
    """The observations cannot fit a step time, or a replay needs what they never observed; the
    message says what the rows lack."""


def feature_vector(**counts: float) -> np.ndarray:
    """FEATURES in order, from counts by name (a feature not named counts 0)."""
    unknown = set(counts) - set(FEATURES)
    if unknown:
        raise ValueError(f"not a step-time feature: {', '.join(sorted(unknown))}")
    return np.array([float(counts.get(name, 0.0)) for name in FEATURES])


def pass_features(pass_rows: Sequence[int], row_split: Optional[int]) -> dict:
    """`passes`, `rows`, `wide_passes` and `wide_rows` of forward passes of these many rows each."""
    narrow = [rows for rows in pass_rows if row_split is None or rows <= row_split]
    wide = [rows for rows in pass_rows if row_split is not None and rows > row_split]
    return {"passes": len(narrow), "rows": sum(narrow), "wide_passes": len(wide), "wide_rows": sum(wide)}


def iteration_features(iteration: Iteration, layout: Layout, row_split: Optional[int]) -> np.ndarray:
    """The FEATURES of one iteration of a strategy whose cache is `layout`, its linears splitting at
    `row_split` rows."""
    passes = ([len(iteration.decodes)] if iteration.decodes else []) + [chunk.tokens for chunk in iteration.prefills]
    return feature_vector(
        iteration=1, **pass_features(passes, row_split), decodes=len(iteration.decodes),
        decode_keys=sum(attended_keys(position, position + 1, layout) for position in iteration.positions),
        prefill_pairs=sum(causal_pairs(chunk.start, chunk.tokens) for chunk in iteration.prefills))


@dataclass(frozen=True)
class Observation:
    """One measured time and what it computed."""

    features: tuple[float, ...]  # FEATURES, in order
    seconds: float  # the time it took


@dataclass(frozen=True)
class StepFit:
    """A fitted step time and how well it fits its own observations."""

    coefficients: dict  # feature -> seconds per unit (FEATURES; 0 for one merged or never observed)
    source: str  # what it was fitted from, in words (step points, or serving runs, and which)
    observations: int  # how many
    unobserved: tuple[str, ...]  # features no observation computed: a replay that needs one cannot be made
    merged: tuple[str, ...]  # features the observations could not tell from the others (their cost is in theirs)
    residual_median: float  # median of |predicted / measured - 1| over the observations
    residual_p90: float  # 90th percentile of the same
    total_ratio: float  # sum of predicted over sum of measured seconds: the fit's bias on a whole run

    def seconds(self, features: np.ndarray) -> float:
        """The fitted time of an iteration with these FEATURES; FitError where it needs a feature never observed."""
        for name in self.unobserved:
            if features[FEATURES.index(name)]:
                raise FitError(f"{self.source}: nothing observed computes {name}, which the replay needs; the rows "
                               f"need {NEEDS[name]}")
        return float(np.dot([self.coefficients[name] for name in FEATURES], features))

    def as_json(self) -> str:
        """The coefficients, seconds per unit of each feature."""
        return json.dumps({name: self.coefficients[name] for name in FEATURES})


def fit(observations: Sequence[Observation], source: str) -> StepFit:
    """Non-negative least squares of the observations' seconds over FEATURES, on relative errors."""
    if not observations:
        raise FitError(f"{source}: no observation to fit a step time from")
    design = np.array([obs.features for obs in observations], dtype=np.float64)
    seconds = np.array([obs.seconds for obs in observations], dtype=np.float64)
    unobserved = [name for name, column in zip(FEATURES, design.T) if not column.any()]
    used = [name for name in FEATURES if name not in unobserved]
    if not used:
        raise FitError(f"{source}: its observations compute nothing")
    merged = []
    weighted = _weighted(design, seconds, used)
    for name in MERGEABLE:
        if np.linalg.matrix_rank(weighted) == len(used) or name not in used:
            continue
        rest = [other for other in used if other != name]
        if np.linalg.matrix_rank(_weighted(design, seconds, rest)) == np.linalg.matrix_rank(weighted):
            used, merged = rest, [*merged, name]
            weighted = _weighted(design, seconds, used)
    if np.linalg.matrix_rank(weighted) < len(used):
        raise FitError(f"{source}: {', '.join(_dependent(weighted, used))} vary together in all {len(observations)} "
                       "observations, so their costs cannot be told apart; the rows need observations where they do "
                       "not (step points at several batches and contexts, prompts of several lengths, or a serving "
                       "run's iterations)")
    columns = [FEATURES.index(name) for name in used]
    scale = np.abs(design[:, columns]).max(axis=0)
    solved = nnls(weighted, np.ones_like(seconds)) / scale
    coefficients = dict.fromkeys(FEATURES, 0.0)
    coefficients.update({name: float(value) for name, value in zip(used, solved)})
    predicted = design[:, columns] @ solved
    relative = np.abs(predicted / seconds - 1)
    return StepFit(coefficients, source, len(observations), tuple(unobserved), tuple(merged),
                   float(np.median(relative)), float(np.percentile(relative, 90)), float(predicted.sum() / seconds.sum()))


def _weighted(design: np.ndarray, seconds: np.ndarray, used: Sequence[str]) -> np.ndarray:
    """The columns of `used`, each at unit scale, each row over its measured seconds (relative errors)."""
    columns = design[:, [FEATURES.index(name) for name in used]]
    return columns / np.abs(columns).max(axis=0) / seconds[:, None]


def _dependent(design: np.ndarray, features: Sequence[str]) -> list[str]:
    """The features whose columns the others span (leaving one out keeps the rank)."""
    rank = np.linalg.matrix_rank(design)
    return [name for i, name in enumerate(features) if np.linalg.matrix_rank(np.delete(design, i, axis=1)) == rank]


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
