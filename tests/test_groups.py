"""Strategies of one shape measured together: intervals, the rotation, the group's process, the plan's
grouping, the runner's resume and the report's verdicts (device=cpu throughout)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from harness.measure.group import GroupRequest, measure_group
from harness.measure.intervals import median_interval, paired_ratio
from harness.report.verdicts import compare, verdict
from harness.run.grouping import form_groups
from harness.config import ConfigError
from harness.run.plan import plan
from tests.conftest import QUICK_CALIBRATION, planned_point, refused_by_runner, run_cli

PLUGIN = f"hydra.searchpath=[file://{Path(__file__).parent / 'plugin' / 'conf'}]"


def test_median_interval_holds_the_median_and_narrows_with_more_rounds():
    few = median_interval([1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 0.8, 1.0])
    many = median_interval([1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 0.8, 1.0] * 8)
    assert few.low <= few.median <= few.high
    assert many.high - many.low < few.high - few.low
    assert median_interval([2.0]) == median_interval([2.0])  # seeded: the same data, the same interval
    assert median_interval([1.0, 3.0, 2.0]) == median_interval([1.0, 3.0, 2.0])


def test_median_interval_is_the_plain_resamplers_to_the_bit():
    """The interval picks each resample's middle by ranks (harness.measure.intervals): the same draws, so
    the same interval as np.median over the resampled values, for odd and even counts, ties, infinities
    and a NaN."""
    import numpy as np

    from harness.measure.intervals import CONFIDENCE, RESAMPLES, SEED

    def plain(values):
        data = np.asarray(values, dtype=np.float64)
        draws = np.random.default_rng(SEED).integers(0, len(data), size=(RESAMPLES, len(data)))
        tail = (1 - CONFIDENCE) / 2 * 100
        return list(np.percentile(np.median(data[draws], axis=1), [tail, 100 - tail]))

    rng = np.random.default_rng(1)
    for count in (2, 3, 4, 31, 256, 257, 1200):
        for values in (rng.lognormal(size=count), np.round(rng.normal(size=count), 1), rng.integers(0, 3, count) * 1.0):
            if count > 3:
                values[[0, 1]] = (np.inf, -np.inf) if count % 2 else (np.inf, values[1])
            with np.errstate(invalid="ignore"):  # +inf and -inf in one resample: NaN in both, with a warning
                found = median_interval(list(values))
                assert np.array_equal([found.low, found.high], plain(values), equal_nan=True), count
    with_nan = [1.0, float("nan"), 2.0, 3.0]
    assert np.array_equal([median_interval(with_nan).low, median_interval(with_nan).high], plain(with_nan), equal_nan=True)


def test_paired_ratio_sees_a_constant_factor_through_drift():
    drift = [1.0, 1.4, 0.8, 1.9, 1.1, 0.7, 1.5, 1.2]  # the machine moving by 2.7x between rounds
    slower = [1.05 * t for t in drift]
    ratio = paired_ratio(slower, drift)
    assert ratio.median == pytest.approx(1.05) and ratio.low == pytest.approx(1.05)
    assert ratio.excludes(1.0)
    unpaired = median_interval(slower).median / median_interval(drift).median
    assert unpaired == pytest.approx(1.05)  # the medians agree, but their own intervals overlap widely
    assert median_interval(slower).low < median_interval(drift).high
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


@pytest.fixture(scope="module")
def tiny_group():
    names = ("paged", "contiguous", "no_cache", "quantized", "flash")  # contiguous not first: chosen by capability
    points = tuple(dataclasses.replace(planned_point("model=tiny", f"strategy={name}", "ctx=16", "decode_tokens=6",
                                                     "device=cpu"), interleave="shape") for name in names)
    return dict(zip(names, measure_group(GroupRequest("g0", points))))


def test_the_reference_is_recorded_under_the_name_its_rows_carry():
    """A reference chosen with an option set is a variant (`contiguous(backend=sdpa)`): group_reference
    names it as its row's `strategy` does, so a reader finds it by name as by key."""
    points = tuple(dataclasses.replace(planned_point("model=tiny", *strategy, "ctx=8", "decode_tokens=2", "device=cpu"),
                                       interleave="shape")
                   for strategy in (["strategy=int8"], ["strategy=contiguous", "strategy.backend=sdpa"]))
    assert points[1].strategy.variant == "contiguous(backend=sdpa)"  # the row's `strategy`
    int8, _ = measure_group(GroupRequest("g1", points))
    assert int8["group_reference"] == points[1].strategy.variant and int8["group_reference_key"] == points[1].key


def test_a_group_times_every_member_in_the_same_rounds(tiny_group):
    ran = {name: row for name, row in tiny_group.items() if row["status"] == "ok"}
    assert set(ran) == {"paged", "contiguous", "no_cache", "quantized"}
    assert tiny_group["flash"]["status"] == "skipped" and tiny_group["flash"]["group_id"] == "g0"
    rounds = ran["contiguous"]["rounds"]
    # Whole passes over the 6 positions, as many as the budget holds: one on a machine busy enough that a
    # pass overruns it (how passes fill a budget is tests/test_rounds.py's, with planted times).
    assert rounds % 6 == 0 and 6 <= rounds <= 6 * 8
    for row in ran.values():
        assert row["group_id"] == "g0" and row["group_size"] == 5 and row["rounds"] == rounds
        assert len(row["decode_step_times_s"]) == row["decode_steps_timed"] == rounds
        assert row["decode_step_ci_low_s"] <= row["decode_step_s"] <= row["decode_step_ci_high_s"]
        assert row["roof_bandwidth_in_rounds_Bps"] > 0 and row["roof_in_rounds_kernel"] in ("aten", "packed", "c")
        assert row["group_reference"] == "contiguous"
        assert row["peak_memory_bytes"] >= 0 and "own allocations" in row["peak_memory_method"]  # in this process: reused memory
    assert ran["contiguous"]["ratio_to_reference"] is None
    for name in ("paged", "no_cache", "quantized"):
        assert ran[name]["ratio_ci_low"] <= ran[name]["ratio_to_reference"] <= ran[name]["ratio_ci_high"]
    # exact members generate the reference's tokens even when interleaved with others
    assert len({ran[name]["tokens_digest"] for name in ("paged", "contiguous", "no_cache")}) == 1
    assert ran["quantized"]["top1_agreement"] is not None


def test_a_member_that_fails_costs_the_others_nothing():
    points = tuple(dataclasses.replace(planned_point("model=tiny", *strategy, "ctx=8", "decode_tokens=3", "device=cpu",
                                                     "timing.max_passes=1"), interleave="shape")
                   for strategy in (["strategy=contiguous"], ["strategy=contiguous", "strategy._target_=tests.failing.ExplodingStrategy"],
                                    ["strategy=paged"]))
    rows = measure_group(GroupRequest("g1", points))
    assert [row["status"] for row in rows] == ["ok", "failed", "ok"]
    assert rows[0]["rounds"] == 3  # one pass over the positions: timing.max_passes=1
    assert "planted" in rows[1]["reason"]
    assert rows[2]["ratio_to_reference"] is not None


def _planned(*overrides):
    return plan(["-m", "model=tiny", "device=cpu", "ctx=8", "decode_tokens=2", *overrides], lambda: False).planned


def test_the_plan_groups_a_shape_and_keys_members_by_mode_and_repeat():
    planned = _planned("strategy=contiguous,paged", "batch=1,2")
    groups = form_groups(planned, "shape", 1, seed=0)
    assert [len(g.members) for g in groups] == [2, 2]
    assert {p.batch for g in groups for p in g.points} == {1, 2}
    assert all(len({p.batch for p in g.points}) == 1 and p.interleave == "shape" for g in groups for p in g.points)
    alone = form_groups(planned, "none", 1, seed=0)
    assert len(alone) == 4 and all(p.interleave == "none" for g in alone for p in g.points)
    assert {p.key for g in alone for p in g.points} == {one.point.key for one in planned}  # keys as before
    repeated = form_groups(planned, "shape", 3, seed=0)
    assert len(repeated) == 6 and sorted(p.repeat for g in repeated for p in g.points) == [0] * 4 + [1] * 4 + [2] * 4
    assert len({p.key for g in repeated for p in g.points}) == 12


def test_a_groups_job_is_named_by_one_override_and_plans_its_members_again():
    """A group is one Hydra job: its override (+group=<spec>) carries the members' overrides and keys, which
    a launcher's job in another process plans again to the same points; nothing goes through results_dir."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from harness.run.grouping import GroupSpec
    from harness.run.plan import plan_group

    groups = form_groups(_planned("strategy=no_cache,contiguous,paged", "batch=1,2"), "shape", 2, seed=0)
    assert len(groups) == 8  # 2 batches x (the recompute reference, the caches) x 2 repeats: 8 jobs
    group = next(g for g in groups if len(g.members) == 2 and g.points[0].repeat == 1)
    spec = GroupSpec.of(group, first=5)
    override = spec.override()
    (parsed,) = OverridesParser.create().parse_overrides([override])  # one plain value to Hydra
    assert parsed.key_or_group == "group" and parsed.value() == spec.encode()
    assert GroupSpec.decode(spec.encode()) == spec
    members = plan_group(spec, cuda_available=lambda: False)
    assert [job.point.key for job in members] == [job.point.key for job in group.members]
    assert all(job.point.repeat == 1 and job.point.interleave == "shape" for job in members)
    assert refused_by_runner("+group=" + spec.encode(), "model=tiny").startswith("error: group: ")  # not the user's
    forged = dataclasses.replace(spec, members=((group.members[1].point.key, spec.members[0][1]), spec.members[1]))
    with pytest.raises(ConfigError, match="group"):
        plan_group(forged, cuda_available=lambda: False)


def test_the_recompute_reference_is_timed_apart_from_the_caches():
    groups = form_groups(_planned("strategy=no_cache,contiguous,paged"), "shape", 1, seed=0)
    members = sorted(sorted(p.strategy.name for p in g.points) for g in groups)
    assert members == [["contiguous", "paged"], ["no_cache"]]


def test_grouping_is_one_choice_per_command_line():
    from harness.config import ConfigError

    with pytest.raises(ConfigError, match="interleave"):
        _planned("strategy=contiguous", "interleave=shape,none")


@pytest.mark.slow
def test_a_sweep_writes_a_group_and_resumes_a_lost_member_beside_its_reference(results_dir):
    args = ("-m", "model=tiny", "strategy=contiguous,paged,quantized", "ctx=16", "decode_tokens=4", "device=cpu",
            QUICK_CALIBRATION, f"results_dir={results_dir}")
    assert run_cli(*args).returncode == 0
    rows = pd.read_parquet(results_dir)
    assert len(rows) == 3 and rows["group_id"].nunique() == 1 and set(rows["interleave"]) == {"shape"}
    lost = next(results_dir.glob("paged*.parquet"))
    kept = {path.name: path.stat().st_mtime_ns for path in results_dir.glob("*.parquet") if path != lost}
    lost.unlink()
    again = run_cli(*args)
    assert again.returncode == 0
    assert {path.name: path.stat().st_mtime_ns for path in results_dir.glob("*.parquet") if path.name in kept} == kept
    rows = pd.read_parquet(results_dir)
    paged = rows[rows.strategy == "paged"].iloc[0]
    assert paged["ratio_to_reference"] > 0 and paged["group_reference"] == "contiguous"
    assert "already measured" in again.stdout + again.stderr


def _rows(series_times: dict, group: str | None = "g") -> pd.DataFrame:
    return pd.DataFrame([{"series": name, "group_id": group, "decode_step_times_s": times,
                          "decode_step_s": sorted(times)[len(times) // 2]} for name, times in series_times.items()])


def test_the_verdict_names_a_winner_only_where_its_interval_clears():
    drift = [1.0, 1.3, 0.9, 1.6, 1.1, 0.8, 1.4, 1.2, 1.0, 1.5]
    clear = verdict(_rows({"a": drift, "b": [1.05 * t for t in drift]}))
    assert clear.fastest == "a" and clear.text == "a (5% faster than b)"
    noise = [1.0, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97, 1.0, 1.02, 0.98]
    tied = verdict(_rows({"a": drift, "b": [t * n for t, n in zip(drift, noise)]}))
    assert tied.text.startswith("tie within") and "a" in tied.text and "b" in tied.text
    apart = compare(_rows({"b": [1.05 * t for t in drift]}, group="g1"), _rows({"a": drift}, group="g2"))
    assert not apart.paired and apart.tie and apart.text().endswith(" apart")


def test_a_step_that_beats_a_stale_calibration_but_not_its_own_rounds_read_is_not_noisy():
    from harness.run.row import noise_columns

    row = {"status": "ok", "contention": 0.0, "decode_step_p10_s": 1.0, "decode_step_p90_s": 1.1,
           "bandwidth_fraction": 1.10, "flops_fraction": 0.1, "bandwidth_fraction_in_rounds": 0.90}
    assert noise_columns(row)["noisy"] is False
    assert noise_columns({**row, "bandwidth_fraction_in_rounds": 1.2})["noisy"] is True
    assert noise_columns({**row, "bandwidth_fraction_in_rounds": None})["noisy"] is True


def test_a_member_that_does_not_fit_beside_the_others_is_skipped_and_they_are_measured(monkeypatch):
    """Every member's session stays alive through the rounds: each is checked against the free memory
    the members before it left (here planted: plenty, until the third read)."""
    from harness.measure import memory

    points = [planned_point("model=tiny", f"strategy={name}", "ctx=8", "decode_tokens=2") for name in ("contiguous", "paged")]
    reads = []

    def free_memory(device):  # reads: the discarded trial set-up, the first member, the second
        reads.append(device)
        return 1 << 40 if len(reads) < 3 else 1

    monkeypatch.setattr(memory, "available_bytes", free_memory)
    first, second = measure_group(GroupRequest(group_id="g", members=tuple(points)))
    assert first["status"] == "ok", first
    assert second["status"] == "skipped" and "beside the 1 member(s) of its group" in second["reason"], second
    assert "interleave=none" in second["reason"] and len(reads) == 3
