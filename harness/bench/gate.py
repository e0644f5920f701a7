"""Performance gate on pytest-benchmark JSON: ratios to a control measured in the same run.

Absolute times on shared CI machines move by tens of percent between runs; a benchmark's median divided
by the median of a fixed control kernel timed in the same session moves far less (pytest-benchmark's
author recommends exactly this, its issues #2 and #24). The gate reads one run's JSON and fails when:
- a benchmark's ratio to the control grew by more than RATIO_THRESHOLD over the baseline (BASELINE,
  harness/bench/baseline.json, shipped with this module; --baseline names another), or a baselined
  benchmark is missing from the run;
  (against a baseline of another CPU model such growth is inconclusive, exit 3: how a kernel compares
  with the control differs between CPU models);
- a dimensionless fact of the run falls below its floor (both judged against roofs measured in the
  same run: read bandwidth from the control kernel, FLOP/s from the matmul roof kernel):
  * speedup fraction: at every point with a recompute reference (a benchmark whose extra_info says
    caches_kv false), its step / each cached strategy's step divided by the speedup the analytic
    roofline predicts there, >= SPEEDUP_FRACTION_FLOOR;
  * bandwidth fraction: each cached strategy's analytic bytes per step / median step time, divided
    by the control's bandwidth, >= BANDWIDTH_FRACTION_FLOOR.
The suite (tests/benchmarks, timed by harness.measure.rounds) runs a control right before the benchmark
in every round, the memory-bound one (GEMV chain) or, for compute-bound benchmarks, the compute-bound
one (GEMM): a ratio is the median of the per-round ratios to it (extra_info control_ratio), else the
median over the median of those interleaved runs (control_median_s), else over the control benchmark's.
Thresholds come from the spread measured over repeated runs (docs/performance.md, "Benchmark gate:
spread and threshold"). Pure Python: no torch, so the gate runs anywhere the JSON is.

    python -m harness.bench run.json [--baseline harness/bench/baseline.json]
    python -m harness.bench run1.json run2.json ... --update   # baseline = median ratio per benchmark
    python -m harness.bench run1.json run2.json ... --spread   # spread of every ratio and fact
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from harness.analysis.roofline import Phase, Roof, phased_time
from harness.files import publish

BASELINE = Path(__file__).with_name("baseline.json")  # package data: the code that reads it ships it
RATIO_THRESHOLD = 0.25  # fail when median / control grows by more than this (docs/performance.md: spread)
SPEEDUP_FRACTION_FLOOR = 0.40  # measured no_cache/contiguous speedup >= this fraction of the predicted one
# Each cached strategy's achieved bandwidth >= this fraction of the control's. The quantized cache sits
# lowest (its dequantizing kernel is bound by instructions, and it moves 3-4x fewer bytes); the floor
# sits below every strategy's clean runs (docs/performance.md, "Benchmark gate"), so a halving still fails.
BANDWIDTH_FRACTION_FLOOR = 0.15
CONTENTION_LIMIT = 0.05  # other processes took more than this share of all cores during the run: inconclusive
MUST_MATCH = ("torch_threads", "harness_matmul", "harness_attention")  # a run and its baseline must agree on these
GATED_ROLES = ("decode", "prefill")  # extra_info["role"] of the benchmarks whose ratios are gated
REFRESH = "python -m harness.bench <run.json>... --update"


class GateError(ValueError):
    """The input cannot be gated (no control, unreadable file). The message is one line for the user."""


@dataclass(frozen=True)
class Bench:
    name: str  # pytest-benchmark's name, e.g. test_decode_step[heavy-contiguous]
    median: float  # seconds
    extra: dict  # extra_info the benchmark recorded (role, point, strategy, bytes, flops, ...)


def read_run_data(data: dict) -> dict[str, Bench]:
    """The benchmarks of one parsed pytest-benchmark JSON document, by name."""
    return {row["name"]: Bench(row["name"], float(row["stats"]["median"]), row.get("extra_info", {}))
            for row in data["benchmarks"]}


def load(path) -> tuple[dict[str, Bench], dict]:
    """(benchmarks by name, machine_info) of one pytest-benchmark JSON file (--benchmark-json)."""
    try:
        data = json.loads(Path(path).read_text())
        return read_run_data(data), data.get("machine_info", {})
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise GateError(f"{path}: not a pytest-benchmark JSON file ({type(error).__name__}: {error})") from None


def conditions(machine: dict) -> dict:
    """What the gate needs of the machine a run ran on (tests/benchmarks/conftest.py records it)."""
    return {
        "cpu": machine.get("cpu", {}).get("brand_raw") or machine.get("processor") or "unknown",
        "torch_threads": machine.get("torch_threads"),
        "harness_matmul": machine.get("harness_matmul"),
        "harness_attention": machine.get("harness_attention"),
        "contention": machine.get("cpu_contention", {}).get("others_fraction"),
    }


def with_role(run: dict[str, Bench], role: str) -> list[Bench]:
    return [bench for bench in run.values() if bench.extra.get("role") == role]


def one_with_role(run: dict[str, Bench], role: str) -> Bench:
    found = with_role(run, role)
    if len(found) != 1:
        raise GateError(f"expected one benchmark with extra_info role={role!r}, found {len(found)}")
    return found[0]


def ratios(run: dict[str, Bench]) -> dict[str, float]:
    """Each gated benchmark's time over the control's: the median of its per-round ratios to the control
    run right before each round (extra_info control_ratio, the paired ratio of
    harness.measure.intervals) where recorded; else its median over the control's median, interleaved
    (control_median_s) or the control benchmark's."""
    control = one_with_role(run, "control")
    return {b.name: b.extra.get("control_ratio") or b.median / b.extra.get("control_median_s", control.median)
            for b in run.values() if b.extra.get("role") in GATED_ROLES}


def same_run_roof(run: dict[str, Bench]) -> Roof:
    """Read bandwidth of the control kernel and FLOP/s of the matmul roof kernel, both of this run."""
    control, matmul = one_with_role(run, "control"), one_with_role(run, "roof_flops")
    return Roof(flops_per_s=matmul.extra["flops"] / matmul.median, bytes_per_s=control.extra["bytes"] / control.median)


def steady_time(run: dict[str, Bench], bench: Bench) -> float:
    """The benchmark's median as if timed under the same conditions as the control benchmarks: scaled by
    the control benchmark's median over the median of the control runs interleaved with its rounds
    (same kernel, named in extra_info control_kernel). Unscaled when it recorded no interleaved control."""
    kernel = bench.extra.get("control_kernel")
    same = [b for b in run.values() if b.extra.get("role") in ("control", "roof_flops") and b.extra.get("kernel") == kernel]
    if kernel is None or not same:
        return bench.median
    return bench.median * same[0].median / bench.extra["control_median_s"]


def predicted_time(bench: Bench, roof: Roof) -> float:
    """A benchmark's roofline time at the run's roof: its phases' (extra_info phases, [FLOPs, bytes] each:
    the matmuls, then attention) each at the roof, summed; one phase of its FLOPs and bytes where a run
    older than the phases recorded none."""
    phases = bench.extra.get("phases") or [[bench.extra["flops"], bench.extra["bytes"]]]
    return phased_time((Phase(flops, moved) for flops, moved in phases), roof)


def facts(run: dict[str, Bench]) -> dict[str, float]:
    """The run's dimensionless facts: speedup fraction per point, bandwidth fraction per contiguous step,
    from step times brought to the control benchmarks' conditions (steady_time)."""
    roof = same_run_roof(run)
    found = {}
    decode = {(b.extra["point"], b.extra["strategy"]): b for b in with_role(run, "decode")}
    # The recompute reference of each point: the benchmark of a strategy that keeps no cache.
    references = {point: b for (point, _), b in decode.items() if not b.extra.get("caches_kv", True)}
    for (point, strategy), cached in sorted(decode.items()):
        if not cached.extra.get("caches_kv", True):
            continue
        cached_s = steady_time(run, cached)
        found[f"bandwidth_fraction[{point}-{strategy}]"] = cached.extra["bytes"] / cached_s / roof.bytes_per_s
        recompute = references.get(point)
        if recompute is not None:
            measured = steady_time(run, recompute) / cached_s
            predicted = predicted_time(recompute, roof) / predicted_time(cached, roof)
            found[f"speedup_fraction[{point}-{strategy}]"] = measured / predicted
    return found


FLOORS = {"bandwidth_fraction": BANDWIDTH_FRACTION_FLOOR, "speedup_fraction": SPEEDUP_FRACTION_FLOOR}


def check(run: dict[str, Bench], baseline: dict, threshold: float = RATIO_THRESHOLD,
          floors: dict[str, float] | None = None) -> tuple[list[str], list[str]]:
    """(failures, report lines). No failures: the run passes."""
    floors = {**FLOORS, **(floors or {})}
    failures, lines = [], []
    now, before = ratios(run), baseline.get("ratios", {})
    for name in sorted(before.keys() - now.keys()):
        failures.append(f"{name}: in the baseline but missing from this run (baseline ratio {before[name]:.4g})")
    for name, ratio in sorted(now.items()):
        if name not in before:
            lines.append(f"  new   {name}: ratio {ratio:.4g}, no baseline yet (refresh: {REFRESH})")
            continue
        change = ratio / before[name] - 1
        line = (f"{name}: median/control ratio {ratio:.4g}, baseline {before[name]:.4g} ({change:+.1%}), "
                f"threshold +{threshold:.0%}")
        if change > threshold:
            failures.append(f"REGRESSION {line}")
        else:
            lines.append(f"  ok    {line}")
    for name, value in facts(run).items():
        floor = floors[name.split("[")[0]]
        line = f"{name} = {value:.3f}, floor {floor:.2f}"
        if value < floor:
            failures.append(f"BELOW FLOOR {line}")
        else:
            lines.append(f"  ok    {line}")
    return failures, lines


def spread(runs: list[dict[str, Bench]]) -> dict[str, dict]:
    """Per ratio and fact over several runs: min, median, max, and (max - min) / median."""
    series: dict[str, list[float]] = {}
    for run in runs:
        for name, value in {**ratios(run), **facts(run)}.items():
            series.setdefault(name, []).append(value)
    out = {}
    for name, values in series.items():
        mid = statistics.median(values)
        out[name] = {"n": len(values), "min": min(values), "median": mid, "max": max(values),
                     "spread": (max(values) - min(values)) / mid}
    return out


def new_baseline(runs: list[dict[str, Bench]], machines: list[dict]) -> dict:
    summary, where = spread(runs), conditions(machines[0])
    return {
        "about": f"Median/control ratios of the benchmark suite (tests/benchmarks). Refresh: {REFRESH}",
        "control": one_with_role(runs[0], "control").name,
        "runs": len(runs),
        "cpu": where["cpu"],
        **{key: where[key] for key in MUST_MATCH},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "ratios": {name: round(summary[name]["median"], 5) for name in sorted(ratios(runs[0]))},
        "facts": {name: round(summary[name]["median"], 4) for name in sorted(facts(runs[0]))},
    }


def contention(run: dict[str, Bench], machine: dict) -> float:
    """Share of the CPUs other processes took: the run's, or a single benchmark's if higher (a burst
    during one benchmark is diluted in the run's)."""
    shares = [conditions(machine)["contention"] or 0.0] + [b.extra.get("others_cpu_fraction", 0.0) for b in run.values()]
    return max(shares)


def gate(run: dict[str, Bench], machine: dict, baseline: dict, threshold: float) -> tuple[int, list[str]]:
    """(exit code, lines to print): 0 passed, 1 failed, 3 failed on a run too contended to judge or only
    by ratios against a baseline measured on another CPU model."""
    where = conditions(machine)
    for key in MUST_MATCH:
        if baseline.get(key) not in (None, where[key]):
            raise GateError(f"the baseline was measured with {key}={baseline[key]}, this run with {key}={where[key]}: "
                            f"ratios are not comparable (match them, or refresh: {REFRESH})")
    failures, lines = check(run, baseline, threshold)
    other_cpu = where["cpu"] != baseline.get("cpu", where["cpu"])
    if other_cpu:
        lines.insert(0, f"  note  baseline measured on '{baseline.get('cpu')}', this run on '{where['cpu']}'")
    lines += [f"FAIL  {failure}" for failure in failures]
    others = contention(run, machine)
    contended = others > CONTENTION_LIMIT
    if contended:
        lines.append(f"  note  other processes took {others:.0%} of the CPUs during this run "
                     f"(limit {CONTENTION_LIMIT:.0%}): its times are not to be trusted")
    if not failures:
        return 0, lines + [f"bench_gate: passed ({len(run)} benchmarks)"]
    if contended:
        return 3, lines + [f"bench_gate: INCONCLUSIVE ({len(failures)} failure(s) on a contended machine: rerun)"]
    if other_cpu and all(failure.startswith("REGRESSION") for failure in failures):
        # How a kernel compares with the control differs between CPU models (the C kernels and oneDNN
        # against aten's GEMV can differ by tens of percent from one CPU model to another): ratios
        # grown against another CPU's baseline say nothing about the code. The floors above still bind.
        return 3, lines + [f"bench_gate: INCONCLUSIVE ({len(failures)} ratio(s) grown against a baseline of another "
                           f"CPU model: refresh it on this machine to gate ratios here: {REFRESH})"]
    return 1, lines + [f"bench_gate: FAILED ({len(failures)} failure(s))"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="pytest-benchmark JSON file(s) (--benchmark-json)")
    parser.add_argument("--baseline", default=str(BASELINE), help="baseline ratios (default: %(default)s)")
    parser.add_argument("--threshold", type=float, default=RATIO_THRESHOLD, help="allowed ratio growth (fraction)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--update", action="store_true", help="write the baseline from the run(s): median ratio")
    mode.add_argument("--spread", action="store_true", help="print the spread of every ratio and fact")
    args = parser.parse_args(argv)
    try:
        runs, machines = zip(*(load(path) for path in args.runs))
        if args.update:
            for path, run, machine in zip(args.runs, runs, machines):
                if contention(run, machine) > CONTENTION_LIMIT:
                    raise GateError(f"{path}: other processes took {contention(run, machine):.0%} of the CPUs during "
                                    f"this run (limit {CONTENTION_LIMIT:.0%}); a baseline needs runs on an idle machine")
            baseline = new_baseline(list(runs), list(machines))
            text = json.dumps(baseline, indent=2) + "\n"
            # made anew each time (never `complete`), whole, by one process at a time (harness.files.publish)
            publish(args.baseline, lambda temporary: temporary.write_text(text), "writing the bench baseline",
                    complete=lambda path: False)
            print(f"wrote {args.baseline}: {len(baseline['ratios'])} ratios, median of {len(runs)} run(s)")
            return 0
        if args.spread:
            print(f"{'name':<48} {'n':>2} {'min':>9} {'median':>9} {'max':>9} {'spread':>7}")
            for name, s in spread(list(runs)).items():
                print(f"{name:<48} {s['n']:>2} {s['min']:>9.4g} {s['median']:>9.4g} {s['max']:>9.4g} {s['spread']:>7.1%}")
            return 0
        if len(runs) != 1:
            raise GateError("gate one run at a time (several files only with --update or --spread)")
        baseline = json.loads(Path(args.baseline).read_text())
        print(f"bench_gate: {args.runs[0]} against {args.baseline} (control {baseline.get('control')})")
        code, lines = gate(runs[0], machines[0], baseline, args.threshold)
    except (GateError, OSError, ValueError) as error:
        print(f"bench_gate: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
