"""The observations a step time is fitted from (harness.serve.step_fit), from either source:

- a measured serving run's iterations, recorded as they run by `IterationRecorder`, which wraps the
  run's executor. Its log (LOG_COLUMNS, one row an iteration) keeps what the features are made of:
  the sequences decoding and the keys they attended, each prompt chunk's tokens and its attention's
  pairs; the seconds the executor took; and the iteration's cycle, from its start to the next one's
  (what the scheduler did between them included: the time a simulation must give each iteration). A
  cycle during which every sequence left (the loop may then have waited for the next arrival) is not
  observed;
- step points of the same strategy (harness.analysis.results.load's rows), each step an iteration of
  one pass: a decode step of `batch` sequences over ctx .. ctx + decode_tokens - 1 (decode_step_s; its
  keys the mean over those steps), and the prompt of `batch` sequences of ctx tokens computed in one
  pass of batch x ctx rows (prefill_s). One pass each: an iteration's fixed cost merges into a pass's.
Pure: pandas.
"""
from __future__ import annotations

import math
from typing import Optional

import pandas as pd

from harness.analysis.analytic import Layout, causal_pairs
from harness.analysis.cache_terms import attended_keys, summed_attended_keys
from harness.serve.memory import Placement
from harness.serve.records import Executor, Iteration
from harness.serve.step_fit import Observation, feature_vector, pass_features
from harness.store.columns import ITERATION_COLUMNS

LOG_COLUMNS = tuple(name for name, *_ in ITERATION_COLUMNS)  # an iteration log's, as its file stores them


class IterationRecorder:
    """An executor that runs another and logs every iteration (the module docstring). `clock` is the
    run's clock (harness.serve.records.WallClock), read at each iteration's start."""

    def __init__(self, executor: Executor, layout: Layout, clock):
        self.executor, self.layout, self.clock = executor, layout, clock
        self.held: set[int] = set()  # sequences holding memory now
        self.emptied = False  # every sequence left since the last iteration began
        self.rows: list[list] = []
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
        keys = sum(attended_keys(position, position + 1, self.layout) for position in iteration.positions)
        self.rows.append([len(iteration.decodes), keys, [chunk.tokens for chunk in iteration.prefills],
                          sum(causal_pairs(chunk.start, chunk.tokens) for chunk in iteration.prefills),
                          float(seconds), None])
        return seconds

    def table(self) -> dict[str, list]:
        """The log as columns (LOG_COLUMNS): the last iteration's cycle is not known (None)."""
        return {name: [row[i] for row in self.rows] for i, name in enumerate(LOG_COLUMNS)}


def serving_observations(log: dict, row_split: Optional[int]) -> list[Observation]:
    """The observed cycles of an iteration log (IterationRecorder.table, or its columns read back), for
    linears that split at `row_split` rows."""
    observations = []
    for decodes, keys, chunks, pairs, cycle in zip(log["decodes"], log["decode_keys"], log["chunk_tokens"],
                                                   log["prefill_pairs"], log["cycle_s"]):
        if cycle is None or not math.isfinite(cycle) or cycle <= 0:
            continue
        passes = ([int(decodes)] if decodes else []) + [int(tokens) for tokens in chunks]
        vector = feature_vector(iteration=1, **pass_features(passes, row_split), decodes=decodes, decode_keys=keys,
                                prefill_pairs=pairs)
        observations.append(Observation(tuple(vector.tolist()), float(cycle)))
    return observations


def step_observations(rows: pd.DataFrame, layout: Layout, row_split: Optional[int]) -> list[Observation]:
    """A decode step and a prompt from each measured step row (the module docstring)."""
    observations = []
    for row in rows.itertuples(index=False):
        batch, ctx, steps = int(row.batch), int(row.ctx), max(int(row.decode_tokens), 1)
        if _measured(row.decode_step_s):
            keys = batch * summed_attended_keys(ctx, steps, layout) / steps
            step = feature_vector(iteration=1, **pass_features([batch], row_split), decodes=batch, decode_keys=keys)
            observations.append(Observation(tuple(step.tolist()), float(row.decode_step_s)))
        if _measured(getattr(row, "prefill_s", None)):
            prompt = feature_vector(iteration=1, **pass_features([batch * ctx], row_split),
                                    prefill_pairs=batch * causal_pairs(0, ctx))
            observations.append(Observation(tuple(prompt.tolist()), float(row.prefill_s)))
    return observations


def _measured(value) -> bool:
    return value is not None and not pd.isna(value) and float(value) > 0
