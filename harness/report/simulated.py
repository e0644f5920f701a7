"""The Serving section's simulated rows (serving.executor=fitted or roofline; harness.serve.simulation),
kept apart from the measured ones:

- beside each measured run, the simulation of the same point fitted from this machine's other rows
  (its `simulates_point_key` is the measured row's point_key): the measured and simulated output
  throughput, TTFT and TPOT p50 and p99, each simulated figure's error against the measured one, and
  how well the step time fitted its own observations;
- the simulations that stand for no run of this machine (a device's roofs, tp devices): a table of
  their own, headed as a simulation, never drawn among the measurements.
"""
from __future__ import annotations

import pandas as pd

from harness.report import units as fmt
from harness.report.document import Block, Heading, Paragraph, Table

COMPARED = (("output_throughput", "output tok/s"), ("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"),
            ("tpot_p50_s", "TPOT p50"), ("tpot_p99_s", "TPOT p99"))
WITHIN = 0.10  # the simulation's promise on this machine: each compared figure within 10% of the measured one


def simulated_rows(table: pd.DataFrame) -> pd.Series:
    """Which rows are a simulation's (never a measurement)."""
    if "simulated" not in table:
        return pd.Series(False, index=table.index)
    return table["simulated"].fillna(False).astype(bool)


def error(simulated, measured) -> float | None:
    """simulated / measured - 1, or None where either is missing."""
    if fmt.missing(simulated) or fmt.missing(measured) or float(measured) == 0:
        return None
    return float(simulated) / float(measured) - 1


def _value(name: str, value) -> str:
    return fmt.rate(value, "tok/s") if name == "output_throughput" else fmt.seconds(value)


def _error_text(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1%}"


def twins(table: pd.DataFrame) -> pd.DataFrame:
    """Each ok measured serving row beside its ok simulation, as columns <name> and <name>_simulated."""
    ok = table[(table["status"] == "ok") & table["workload"].notna()] if "workload" in table else table.iloc[0:0]
    simulated = simulated_rows(ok)
    if not simulated.any():
        return ok.iloc[0:0]
    pairs = ok[~simulated].merge(ok[simulated], left_on="point_key", right_on="simulates_point_key",
                                 suffixes=("", "_simulated"))
    return pairs


def validation_table(table: pd.DataFrame) -> list[Block]:
    """Measured against simulated, one line per measured run that has a simulation (nothing without one)."""
    pairs = twins(table)
    if pairs.empty:
        return []
    header = ["strategy", "workload", "rate", *(f"{label} meas. / sim. (error)" for _, label in COMPARED), "within 10%"]
    rows = []
    for _, pair in pairs.sort_values(["strategy", "workload", "workload_rate"]).iterrows():
        errors = [error(pair[f"{name}_simulated"], pair[name]) for name, _ in COMPARED]
        rows.append([pair["strategy"], pair["workload"], fmt.number(pair["workload_rate"]),
                     *(f"{_value(name, pair[name])} / {_value(name, pair[f'{name}_simulated'])} ({_error_text(e)})"
                       for (name, _), e in zip(COMPARED, errors)),
                     "yes" if all(e is not None and abs(e) <= WITHIN for e in errors) else "no"])
    met = sum(row[-1] == "yes" for row in rows)
    return [Heading("Simulated beside measured", 3),
            Paragraph("Each measured run beside the same workload replayed by the same scheduler on a virtual clock, "
                      "every iteration taking the time a step-time model fitted from this machine's other rows gives "
                      "it (serving.executor=fitted; each run's own rows left out of its fit: the simulation predicts "
                      f"a run it never saw). The target is every figure within {WITHIN:.0%} of the measured one; "
                      f"{met} of {len(rows)} runs met it (the last column). The rows' step_fit_source says what each "
                      "fit read."),
            Table(header, rows, [False, False, True, *([True] * len(COMPARED)), False])]


def simulation_section(table: pd.DataFrame) -> list[Block]:
    """The simulated rows that stand for no measured run of this folder: labelled a simulation."""
    ok = table[(table["status"] == "ok") & simulated_rows(table)] if "status" in table else table.iloc[0:0]
    measured_keys = set(table.loc[~simulated_rows(table), "point_key"])
    alone = ok[~ok["simulates_point_key"].isin(measured_keys)]
    if alone.empty:
        return []
    header = ["model", "simulated device", "strategy", "workload", "rate", "KV budget", "output tok/s", "TTFT p50",
              "TTFT p99", "TPOT p50", "TPOT p99", "batch peak", "KV holding / taken", "preemptions"]
    rows = [[r["model"], r["device_name"], r["strategy"], r["workload"], fmt.number(r["workload_rate"]),
             fmt.nbytes(r["kv_cache_bytes"]), fmt.rate(r["output_throughput"], "tok/s"),
             fmt.seconds(r["ttft_p50_s"]), fmt.seconds(r["ttft_p99_s"]), fmt.seconds(r["tpot_p50_s"]),
             fmt.seconds(r["tpot_p99_s"]), fmt.count(r["running_batch_peak"]), f"{r['kv_utilization']:.0%}",
             fmt.count(r["preemptions"])]
            for _, r in alone.sort_values(["model", "device_name", "workload", "workload_rate", "strategy"]).iterrows()]
    methods = "; ".join(sorted(set(alone["timing_method"].dropna())))
    return [Heading("Simulated, not measured", 3),
            Paragraph("These rows were computed, not measured: the scheduler replayed each workload on a virtual "
                      f"clock at a modelled step time ({methods}). At a device's datasheet roofs a step time is a lower "
                      "bound: no communication between devices, no launch or scheduling overhead."),
            Table(header, rows, [False] * 4 + [True] * 10)]
