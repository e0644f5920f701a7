"""Measurement fidelity: calibration kept and reused, fractions from the row's own columns,
prefill=random measuring the same decode path as a computed prompt."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from harness.measure.group import measure_point
from harness.store import calibration as records
from tests.conftest import TINY, copy_sweep, planned_point, run_cli


def test_calibration_is_stored_with_its_timestamp(tiny_sweep):
    record = json.loads(records.record_path(tiny_sweep.results, "cpu", "float32").read_text())  # a fresh folder calibrated
    assert record["read_bandwidth_Bps"] > 1e9 and record["matmul_flops"] > 1e9
    assert record["timestamp"] and "calibrated cpu/float32" in tiny_sweep.log


@pytest.mark.slow  # two more runs through the CLI, one calibrating again
# Alone: the session sweep's record must be stored quiet, or a quiet machine now measures it again.
@pytest.mark.serial
def test_calibration_is_reused_until_forced(tiny_sweep, tmp_path):
    results = copy_sweep(tiny_sweep, tmp_path / "results")
    path = records.record_path(results, "cpu", "float32")
    before = path.read_text()
    again = run_cli("device=cpu", "model=tiny", "ctx=32", "decode_tokens=4", f"results_dir={results}")
    assert again.returncode == 0 and "calibrated" not in again.stderr + again.stdout
    assert path.read_text() == before
    forced = run_cli("device=cpu", "model=tiny", "ctx=64", "decode_tokens=4", "calibrate=true", "calibration_budget_s=1",
                     f"results_dir={results}")
    assert forced.returncode == 0 and "calibrated cpu/float32" in forced.stderr + forced.stdout
    assert path.read_text() != before


def test_fractions_are_computed_from_the_rows_own_columns(tiny_sweep):
    rows = pd.read_parquet(tiny_sweep.results).query("status == 'ok'")
    assert len(rows) >= 1
    expected_bw = rows.bytes_per_step_model / rows.decode_step_s / rows.roof_bandwidth_Bps
    expected_flops = rows.flops_per_step_model / rows.decode_step_s / rows.roof_flops
    assert (rows.bandwidth_fraction - expected_bw).abs().max() < 1e-12
    assert (rows.flops_fraction - expected_flops).abs().max() < 1e-12
    # The binding roof's fraction is the larger of the two; the bound names the roof it came from.
    expected_roofline = pd.concat([expected_bw, expected_flops], axis=1).max(axis=1)
    assert (rows.roofline_fraction - expected_roofline).abs().max() < 1e-12
    ridge = rows.roof_flops / rows.roof_bandwidth_Bps
    intensity = rows.flops_per_step_model / rows.bytes_per_step_model
    assert (rows.roof_bound == intensity.gt(ridge).map({True: "compute", False: "memory"})).all()


def test_a_stored_record_is_reused_unless_forced(tmp_path):
    """The fast tier's form of the test above: calibrate.ensure with a stand-in for the kernels."""
    import dataclasses
    import socket

    from harness.run import calibrate

    stored = records.Calibration("cpu", "x", socket.gethostname(), "float32", 1.0, 1.0, 1.0, None, 1.0,
                                   "2024-01-01T00:00:00+00:00", "m")
    records.save(tmp_path, stored)
    fresh = dataclasses.replace(stored, read_bandwidth_Bps=2.0, timestamp="2999-01-01T00:00:00+00:00")
    calls = []

    def run(fn, request):
        calls.append(request)
        return fresh

    assert calibrate.ensure(tmp_path, "cpu", "float32", False, run) == (stored, False) and not calls
    assert calibrate.ensure(tmp_path, "cpu", "float32", True, run, budget_s=1) == (fresh, True) and len(calls) == 1
    assert records.load(tmp_path, "cpu", "float32").read_bandwidth_Bps == 2.0


def test_a_record_from_another_host_is_not_reused(tmp_path):
    record = records.Calibration("cpu", "x", "another-host", "float32", 1.0, 1.0, 1.0, None, 1.0, "t", "m")
    records.save(tmp_path, record)
    assert records.load(tmp_path, "cpu", "float32") is None


def test_hosts_sharing_a_results_folder_keep_their_own_records(tmp_path):
    import dataclasses
    import socket

    other = records.Calibration("cpu", "x", "node/7", "float32", 1.0, 1.0, 1.0, None, 1.0, "t", "m")
    mine = dataclasses.replace(other, hostname=socket.gethostname(), read_bandwidth_Bps=2.0)
    records.save(tmp_path, other)
    records.save(tmp_path, mine)  # does not overwrite the other host's record
    assert records.load(tmp_path, "cpu", "float32").read_bandwidth_Bps == 2.0
    names = sorted(p.name for p in (tmp_path / "_calibration").glob("*.json"))
    assert names == sorted(["node-7__cpu__float32.json", f"{records.host_slug()}__cpu__float32.json"])


def point(prefill: str):
    return planned_point("model=tiny", "strategy=contiguous", "batch=2", "ctx=24", "decode_tokens=4", f"prefill={prefill}",
                         "timing.max_passes=1")  # one pass: each position timed once


def test_random_prefill_fills_the_same_cache_and_times_the_same_steps(monkeypatch):
    from strategies.base import CachedSession

    fed_positions = []
    real_step = CachedSession.step

    def recording_step(self, token):
        fed_positions.append(self.length)
        return real_step(self, token)

    monkeypatch.setattr(CachedSession, "step", recording_step)
    timed = {}
    for mode in ("compute", "random"):
        fed_positions.clear()
        timed[mode] = measure_point(point(mode))
        assert fed_positions[-4:] == [24, 25, 26, 27]  # the timed steps, same positions in both modes
        assert set(fed_positions[:-4]) == {24}  # warm-up repeats the first decode position
    computed, random = timed["compute"], timed["random"]
    for row in (computed, random):
        assert row["status"] == "ok" and row["decode_steps_timed"] == 4
    assert computed["kv_cache_bytes"] == random["kv_cache_bytes"] == 2 * 2 * 2 * 16 * 4 * 2 * (24 + 4)
    assert computed["prefill_s"] is not None and random["prefill_s"] is None


def test_random_prefill_writes_random_keys_and_values():
    from tests.conftest import STRATEGIES, cpu_model

    session = STRATEGIES["contiguous"]().new_session(cpu_model(TINY), 2, 32)
    session.fill_random(24, torch.Generator().manual_seed(0))
    cache = session.layer_caches[0]
    assert session.length == 24
    assert cache.k[:, :, :24].std() > 0.5 and (cache.k[:, :, 24:] == 0).all()


def test_rows_name_the_clock_that_timed_them(tiny_sweep):
    rows = pd.read_parquet(tiny_sweep.results).query("status == 'ok'")
    # a CPU: no events, no graphs, no flush asked; a group's rows add whom they were interleaved with
    assert rows.timing_method.str.startswith("perf_counter").all()


def test_the_prompt_is_timed_several_times_on_fresh_sessions_within_its_budget():
    short = measure_point(planned_point("model=tiny", "strategy=contiguous", "ctx=16", "decode_tokens=2"))
    assert short["prefill_repeats"] == 5  # a short prompt: every repeat fits the budget
    assert short["prefill_p10_s"] <= short["prefill_s"] <= short["prefill_p90_s"]
    tight = measure_point(planned_point("model=tiny", "strategy=contiguous", "ctx=16", "decode_tokens=2",
                                        "timing.prefill_budget_s=1e-9"))
    assert tight["prefill_repeats"] == 1  # a prompt longer than the budget is timed once
    assert tight["tokens_digest"] == short["tokens_digest"]  # repeats never change what is decoded
