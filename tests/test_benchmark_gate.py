"""The benchmark gate (harness.bench.gate) on synthetic pytest-benchmark JSON: it passes an unchanged
run and a uniformly slower machine, and fails a planted slowdown of one strategy, naming it."""
from __future__ import annotations

import json

import pytest

from harness.bench import gate as bench_gate

MS = 1e-3
LIGHT, HEAVY = 82_000_000, 150_000_000  # bytes a decode step moves (light point, heavy point)


def bench(name: str, median: float, **extra) -> dict:
    """One benchmark as pytest-benchmark's --benchmark-json writes it (the fields the gate reads)."""
    return {"group": None, "name": name, "fullname": f"tests/benchmarks/test_decode_benchmarks.py::{name}", "params": None,
            "extra_info": extra, "stats": {"median": median, "min": median, "max": median, "rounds": 10}}


def run_json(scale: float = 1.0, slower: dict[str, float] | None = None, threads: int = 2,
             contention: float = 0.0, attention: str = "c-kernel", cpu: str = "synthetic") -> dict:
    """A run of the suite: every median times `scale`, and the named benchmarks further times a factor;
    `contention`: the share of the CPUs other processes took during the run."""
    slower = slower or {}
    rows = [
        bench("test_control_read_bandwidth", 20 * MS, role="control", kernel="gemv", bytes=256 << 20),
        bench("test_roof_matmul", 10 * MS, role="roof_flops", kernel="gemm", flops=2 * 1024**3),
        bench("test_decode_step[light-no_cache]", 40 * MS, role="decode", point="light", strategy="no_cache",
              caches_kv=False, bytes=65_000_000, flops=3_200_000_000),
        bench("test_decode_step[light-contiguous]", 12 * MS, role="decode", point="light", strategy="contiguous",
              bytes=LIGHT, flops=34_000_000),
        bench("test_decode_step[heavy-contiguous]", 12 * MS, role="decode", point="heavy", strategy="contiguous",
              bytes=HEAVY, flops=200_000_000),
        bench("test_prefill", 60 * MS, role="prefill", bytes=65_000_000, flops=13_000_000_000),
    ]
    for row in rows:
        row["stats"]["median"] *= scale * slower.get(row["name"], 1.0)
    machine = {"cpu": {"brand_raw": cpu}, "torch_threads": threads, "harness_matmul": "onednn",
               "harness_attention": attention, "cpu_contention": {"others_fraction": contention}}
    return {"machine_info": machine, "benchmarks": rows}


def write(tmp_path, data: dict, name: str = "run.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def baseline(tmp_path):
    """The baseline the gate CLI writes from an unchanged run."""
    path = tmp_path / "baseline.json"
    assert bench_gate.main([str(write(tmp_path, run_json(), "base.json")), "--baseline", str(path), "--update"]) == 0
    return path


def gate(tmp_path, baseline, data: dict, capsys) -> tuple[int, str]:
    code = bench_gate.main([str(write(tmp_path, data)), "--baseline", str(baseline)])
    return code, capsys.readouterr().out


def test_an_unchanged_run_passes(tmp_path, baseline, capsys):
    code, out = gate(tmp_path, baseline, run_json(), capsys)
    assert code == 0, out
    assert "FAIL" not in out and "passed" in out


def test_ratios_grown_against_another_cpus_baseline_are_inconclusive_but_floors_still_fail(tmp_path, baseline,
                                                                                         capsys):
    """A kernel's time against the control depends on the CPU model: against a baseline of another one a
    grown ratio is reported, not blamed (exit 3); a fact below its floor still fails."""
    name = "test_decode_step[heavy-contiguous]"
    code, out = gate(tmp_path, baseline, run_json(slower={name: 1.3}, cpu="another CPU"), capsys)
    assert code == 3 and "INCONCLUSIVE" in out and "another CPU" in out and name in out, out
    code, out = gate(tmp_path, baseline, run_json(slower={name: 10.0}, cpu="another CPU"), capsys)
    assert code == 1 and "BELOW FLOOR" in out, out


def test_a_planted_30_percent_slowdown_of_one_strategy_fails_naming_it(tmp_path, baseline, capsys):
    name = "test_decode_step[heavy-contiguous]"
    code, out = gate(tmp_path, baseline, run_json(slower={name: 1.3}), capsys)
    assert code == 1
    failures = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(failures) == 1, out
    # the message names the benchmark, the baseline, the new value and the threshold
    expected_baseline, expected_new = 12 / 20, 1.3 * 12 / 20
    assert name in failures[0]
    assert f"baseline {expected_baseline:.4g}" in failures[0] and f"ratio {expected_new:.4g}" in failures[0]
    assert f"threshold +{bench_gate.RATIO_THRESHOLD:.0%}" in failures[0] and "+30.0%" in failures[0]


def test_a_uniformly_slower_machine_passes(tmp_path, baseline, capsys):
    code, out = gate(tmp_path, baseline, run_json(scale=1.4), capsys)
    assert code == 0, out


def test_a_slower_control_alone_does_not_hide_a_regression_as_an_improvement(tmp_path, baseline, capsys):
    """Only the control slower: every ratio shrinks, which passes (the gate is one-sided)..."""
    code, _ = gate(tmp_path, baseline, run_json(slower={"test_control_read_bandwidth": 1.4}), capsys)
    assert code == 0
    # ...while a faster control makes every ratio grow: the gate cannot tell, and says so loudly.
    code, out = gate(tmp_path, baseline, run_json(slower={"test_control_read_bandwidth": 0.7}), capsys)
    assert code == 1 and out.count("REGRESSION") == 4


def test_a_regression_on_a_contended_machine_is_inconclusive_not_a_pass(tmp_path, baseline, capsys):
    """Other processes on the cores slow multi-threaded steps unevenly: a failing run is then called
    inconclusive (exit 3, still a failure for CI) rather than a regression; a passing one passes."""
    slower = {"test_decode_step[heavy-contiguous]": 1.3}
    code, out = gate(tmp_path, baseline, run_json(slower=slower, contention=0.3), capsys)
    assert code == 3 and "INCONCLUSIVE" in out and "30% of the CPUs" in out
    code, out = gate(tmp_path, baseline, run_json(contention=0.3), capsys)
    assert code == 0


def test_a_contended_run_cannot_become_the_baseline(tmp_path, capsys):
    paths = [str(write(tmp_path, run_json(), "a.json")), str(write(tmp_path, run_json(contention=0.2), "b.json"))]
    assert bench_gate.main([*paths, "--baseline", str(tmp_path / "baseline.json"), "--update"]) == 2
    assert "b.json: other processes took 20%" in capsys.readouterr().err
    assert not (tmp_path / "baseline.json").exists()


def test_runs_with_another_thread_count_than_the_baseline_are_refused(tmp_path, baseline, capsys):
    assert bench_gate.main([str(write(tmp_path, run_json(threads=1))), "--baseline", str(baseline)]) == 2
    assert "torch_threads=2, this run with torch_threads=1" in capsys.readouterr().err


def test_runs_with_another_attention_kernel_than_the_baseline_are_refused(tmp_path, baseline, capsys):
    """A machine without a C compiler runs contiguous through SDPA: no yardstick for the C kernel's ratios."""
    assert bench_gate.main([str(write(tmp_path, run_json(attention="sdpa"))), "--baseline", str(baseline)]) == 2
    assert "harness_attention=c-kernel, this run with harness_attention=sdpa" in capsys.readouterr().err


def test_the_control_interleaved_with_a_benchmark_is_its_denominator(tmp_path, baseline, capsys):
    """Contention that came and went during the run: the heavy step and the control runs interleaved
    with it were both 40% slower, the control benchmark (a minute earlier) was not: passes."""
    data = run_json(slower={"test_decode_step[heavy-contiguous]": 1.4})
    for row in data["benchmarks"]:
        if row["extra_info"]["role"] in ("decode", "prefill"):
            row["extra_info"]["control_median_s"] = 20 * MS * (1.4 if "heavy" in row["name"] else 1.0)
    code, out = gate(tmp_path, baseline, data, capsys)
    assert code == 0, out
    row = next(r for r in data["benchmarks"] if "heavy" in r["name"])
    row["extra_info"]["control_median_s"] = 20 * MS  # ...but the same slowdown with a steady control fails
    code, out = gate(tmp_path, baseline, data, capsys)
    assert code == 1 and "REGRESSION test_decode_step[heavy-contiguous]" in out


def test_facts_use_step_times_brought_to_the_control_benchmarks_conditions():
    """no_cache ran while arithmetic was 1.5x slower (its interleaved GEMM control saw the same): its
    ratio and the speedup fraction are what they are on a steady machine."""
    steady = bench_gate.read_run_data(run_json())
    data = run_json(slower={"test_decode_step[light-no_cache]": 1.5})
    for row in data["benchmarks"]:
        role, kind = row["extra_info"]["role"], "gemm" if "no_cache" in row["name"] else "gemv"
        if role == "decode":
            row["extra_info"].update(control_kernel=kind, control_median_s=(15 if kind == "gemm" else 20) * MS)
    shifted = bench_gate.read_run_data(data)
    assert bench_gate.facts(shifted) == pytest.approx(bench_gate.facts(steady))
    assert bench_gate.ratios(shifted)["test_decode_step[light-no_cache]"] == pytest.approx(1.5 * 40 / 15)


def test_a_benchmark_missing_from_the_run_fails(tmp_path, baseline, capsys):
    data = run_json()
    data["benchmarks"] = [b for b in data["benchmarks"] if b["name"] != "test_prefill"]
    code, out = gate(tmp_path, baseline, data, capsys)
    assert code == 1 and "test_prefill: in the baseline but missing" in out


def test_a_new_benchmark_without_baseline_passes_and_is_listed(tmp_path, baseline, capsys):
    data = run_json()
    data["benchmarks"].append(bench("test_decode_step[heavy-paged]", 10 * MS, role="decode", point="heavy",
                                    strategy="paged", bytes=HEAVY, flops=1))
    code, out = gate(tmp_path, baseline, data, capsys)
    assert code == 0 and "test_decode_step[heavy-paged]" in out and "no baseline" in out


def test_the_facts_are_computed_against_the_same_run_roofs():
    run = bench_gate.read_run_data(run_json())
    facts = bench_gate.facts(run)
    bandwidth = (256 << 20) / (20 * MS)
    assert facts["bandwidth_fraction[heavy-contiguous]"] == pytest.approx(HEAVY / (12 * MS) / bandwidth)
    flops_roof = 2 * 1024**3 / (10 * MS)
    predicted = max(3.2e9 / flops_roof, 65e6 / bandwidth) / max(34e6 / flops_roof, LIGHT / bandwidth)
    assert facts["speedup_fraction[light-contiguous]"] == pytest.approx((40 / 12) / predicted)
    assert set(facts) == {"bandwidth_fraction[light-contiguous]", "bandwidth_fraction[heavy-contiguous]",
                          "speedup_fraction[light-contiguous]"}
    # dimensionless: a uniformly slower machine leaves every fact where it was
    slower = bench_gate.facts(bench_gate.read_run_data(run_json(scale=1.4)))
    assert slower == pytest.approx(facts)


def test_a_fact_below_its_floor_fails(tmp_path, baseline, capsys):
    """contiguous slowed at the light point until both its facts fall below their floors."""
    facts = bench_gate.facts(bench_gate.read_run_data(run_json()))
    margin = max(facts[f"{name}[light-contiguous]"] / floor for name, floor in bench_gate.FLOORS.items())
    code, out = gate(tmp_path, baseline, run_json(slower={"test_decode_step[light-contiguous]": 1.2 * margin}), capsys)
    assert code == 1
    assert "BELOW FLOOR speedup_fraction[light-contiguous]" in out
    assert "BELOW FLOOR bandwidth_fraction[light-contiguous]" in out


def test_a_run_without_a_control_is_an_input_error(tmp_path, baseline, capsys):
    data = run_json()
    data["benchmarks"] = [b for b in data["benchmarks"] if b["extra_info"]["role"] != "control"]
    assert bench_gate.main([str(write(tmp_path, data)), "--baseline", str(baseline)]) == 2
    assert "role='control'" in capsys.readouterr().err


def test_the_baseline_is_the_median_of_several_runs(tmp_path):
    paths = [str(write(tmp_path, run_json(slower={"test_prefill": f}), f"r{i}.json"))
             for i, f in enumerate((1.0, 1.1, 3.0))]
    out = tmp_path / "baseline.json"
    assert bench_gate.main([*paths, "--baseline", str(out), "--update"]) == 0
    assert json.loads(out.read_text())["ratios"]["test_prefill"] == pytest.approx(1.1 * 60 / 20, rel=1e-4)


def test_the_committed_baseline_covers_the_suite():
    """Every gated benchmark of the suite that runs on a CPU has a committed baseline ratio."""
    committed = json.loads(bench_gate.BASELINE.read_text())
    from tests.benchmarks.test_decode_benchmarks import CASES, CATALOG

    on_a_cpu = {name for name, cls in CATALOG.items() if "cpu" in cls.devices and "float32" in cls.dtypes}
    expected = {f"test_decode_step[{p.name}-{s}]" for p, s in CASES if s in on_a_cpu}
    assert set(committed["ratios"]) == expected | {"test_prefill"}
    assert committed["control"] == "test_control_read_bandwidth"
