"""The report's "what fewer bytes buy" says where each group's accuracy came from: a checkpoint (its
folder and hash) or seeded random weights, with the warning that those do not predict real accuracy."""
from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from harness.report.kv_formats import RANDOM_WEIGHTS_WARNING, weights_note
from harness.report.tradeoff import accuracy_of
from harness.store.upgrade import upgrade

QUANTIZED = {"status": "ok", "decode_step_s": 1e-3, "caches_kv": True, "cache_value_bits": 8}


def note(*rows: dict) -> str:
    """The note for rows as the loader reads them (harness.store.upgrade: a row without `weights` was
    written before the column, with seeded random weights)."""
    return weights_note(SimpleNamespace(rows=upgrade(pd.DataFrame([{**QUANTIZED, **row} for row in rows]))))


def test_random_weights_carry_the_warning():
    said = note({"weights": "random", "prompt": None})
    assert RANDOM_WEIGHTS_WARNING in said and "no perplexity was measured" in said


def test_rows_written_before_weights_were_recorded_count_as_random():
    assert RANDOM_WEIGHTS_WARNING in note({})


def test_a_checkpoint_is_named_with_its_hash_and_prompt_file():
    said = note({"weights": "checkpoint", "checkpoint": "/models/llama", "checkpoint_hash": "abc123",
                 "prompt": "/data/text.txt"})
    assert "checkpoint's weights: `/models/llama` (hash abc123)" in said and "`/data/text.txt`" in said
    assert RANDOM_WEIGHTS_WARNING not in said


def test_a_group_mixing_both_says_so():
    said = note({"weights": "checkpoint", "checkpoint": "/m", "checkpoint_hash": "h"}, {"weights": "random"})
    assert "/m" in said and "Some of these rows have seeded random weights" in said


def test_rows_without_a_perplexity_ratio_give_one_from_both_perplexities_without_interval():
    older = upgrade(pd.DataFrame([{"exact": False, "perplexity": 12.6, "perplexity_reference": 12.0},
                                  {"exact": False, "perplexity": None, "perplexity_reference": None}]))
    ratio = accuracy_of(older.iloc[0]).perplexity
    assert (ratio.median, ratio.low, ratio.high) == pytest.approx((1.05, 1.05, 1.05))
    assert accuracy_of(older.iloc[1]).perplexity is None
