"""The observations a step time is fitted from (harness.serve.step_fit), from either source:

- a measured serving run's iterations, recorded as they run by `IterationRecorder`, which wraps the
  run's executor: every iteration's FEATURES, the seconds the executor took, and its cycle, from its
  start to the next one's (what the scheduler did between them included: the time a simulation must
  give each iteration). A cycle during which every sequence left (the loop may then have waited for
  the next arrival) is not observed;
- step points of the same strategy (harness.analysis.results.load's rows): a decode step of `batch`
  sequences over ctx .. ctx + decode_tokens - 1 (decode_step_s, its keys the mean over those steps),
  and the prompt of `batch` sequences of ctx tokens computed in one pass (prefill_s).
Pure: numpy and pandas.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from harness.analysis.analytic import Layout, causal_pairs
from harness.analysis.cache_terms import summed_attended_keys
from harness.serve.memory import Placement
from harness.serve.records import Executor, Iteration
from harness.serve.step_fit import FEATURES, Observation, feature_vector, iteration_features

LOG_COLUMNS = (*FEATURES, "run_s", "cycle_s")  # an iteration log's columns, one row an iteration


class IterationRecorder:
    """An executor that runs another and records every iteration (the module docstring). `clock` is
    the run's clock (harness.serve.records.WallClock), read at each iteration's start."""

    def __init__(self, executor: Executor, layout: Layout, clock):
        self.executor, self.layout, self.clock = executor, layout, clock
        self.held: set[int] = set()  # sequences holding memory now
        self.emptied = False  # every sequence left since the last iteration
        self.rows: list[list[Optional[float]]] = []
        self.started: Optional[float] = None  # the last iteration's start

    def place(self, seq: int, placement: Placement) -> None:
        self.held.add(seq)
        self.executor.place(seq, placement)

    def release(self, seq: int) -> None:
        self.held.discard(seq)
        self.emptied = self.emptied or not self.held
        self.executor.release(seq)

    def run(self, iteration: Iteration) -> float:
        now = self.clock.now()
        if self.rows:
            self.rows[-1][-1] = None if self.emptied else now - self.started
        self.started, self.emptied = now, False
        seconds = self.executor.run(iteration)
        self.rows.append([*iteration_features(iteration, self.layout), float(seconds), None])
        return seconds

    def table(self) -> dict[str, list]:
        """The log as columns (LOG_COLUMNS): the last iteration's cycle is not known (None)."""
        return {name: [row[i] for row in self.rows] for i, name in enumerate(LOG_COLUMNS)}


def serving_observations(log: dict) -> list[Observation]:
    """The observed cycles of an iteration log (IterationRecorder.table, or the columns read back)."""
    features = np.column_stack([np.asarray(log[name], dtype=np.float64) for name in FEATURES])
    cycles = [math.nan if value is None else float(value) for value in log["cycle_s"]]
    return [Observation(tuple(row), cycle) for row, cycle in zip(features.tolist(), cycles)
            if math.isfinite(cycle) and cycle > 0]


def step_observations(rows: pd.DataFrame, layout: Layout) -> list[Observation]:
    """A decode step and a prompt from each measured step row (the module docstring)."""
    observations = []
    for row in rows.itertuples(index=False):
        batch, ctx, steps = int(row.batch), int(row.ctx), max(int(row.decode_tokens), 1)
        if _measured(row.decode_step_s):
            keys = batch * summed_attended_keys(ctx, steps, layout) / steps
            step = feature_vector(decode_pass=1, decodes=batch, decode_keys=keys)
            observations.append(Observation(tuple(step.tolist()), float(row.decode_step_s)))
        if _measured(getattr(row, "prefill_s", None)):
            prompt = feature_vector(chunks=batch, prefill_tokens=batch * ctx, prefill_pairs=batch * causal_pairs(0, ctx))
            observations.append(Observation(tuple(prompt.tolist()), float(row.prefill_s)))
    return observations


def _measured(value) -> bool:
    return value is not None and not pd.isna(value) and float(value) > 0
