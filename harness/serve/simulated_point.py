"""One simulated serving point (serving.executor=fitted or roofline): the point's workload, budget and
strategy, served by the scheduler of a measured run on a virtual clock, each iteration taking what a
step-time model says (harness.serve.simulation). Nothing is measured; the row says so (`simulated`)
and names the measured point it stands for (`simulates_point_key`: the same point with
serving.executor=measured), which the report sets it beside.

- fitted: the step time is fitted (harness.serve.step_fit) from this machine's rows in results_dir of
  the same model, device, dtype and strategy, one machine's (the newest row's device_name):
  fit_from=serving, the iterations of its measured serving runs (their files under _iterations/), the
  run it stands for left out, so the simulation predicts a run it never saw; fit_from=steps, its step
  points (decode_step_s, prefill_s). Rows that cannot make a fit make a skipped row saying what they lack.
- roofline: the analytic iteration at `serving.hardware`'s roofs split over `serving.tp` devices
  (harness.analysis.iteration), a lower bound: no communication, no overheads.
Each strategy's memory is its own accounting (Strategy.sequence_memory), as in a measured run.
"""
from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import pandas as pd
import torch

from harness.analysis.capacity import DEFAULT_RESERVE, node_kv_budget_bytes
from harness.analysis.hardware import Hardware, load_hardware, resolve
from harness.analysis.results import load
from harness.config import Point
from harness.config.schema import ServingConfig
from harness.measure.decoding import not_run
from harness.model.cpu_linear import LINEAR_KERNELS
from harness.serve import metrics
from harness.serve.memory import KVMemory
from harness.serve.point import unservable
from harness.serve.simulation import FittedStepTime, RoofStepTime, StepTime, simulate
from harness.serve.step_fit import FitError, StepFit, fit
from harness.serve.step_observations import serving_observations, step_observations
from harness.serve.workload import build_workload
from harness.store.files import read_iterations

MEASURED = "measured"
FITTED, ROOFLINE = "fitted", "roofline"
EXECUTORS = (MEASURED, FITTED, ROOFLINE)  # serving.executor
FIT_SOURCES = ("serving", "steps")  # serving.fit_from
SIMULATION_KEYS = ("executor", "fit_from", "hardware", "tp", "reserve")  # serving.* that say how a point is simulated


def measured_twin(point: Point) -> Point:
    """The same point with serving.executor=measured and the simulation's keys at their defaults: the
    measured run a simulated point stands for."""
    defaults = {spec.name: spec.default for spec in dataclasses.fields(ServingConfig) if spec.name in SIMULATION_KEYS}
    spec = point.serving
    return dataclasses.replace(point, serving=dataclasses.replace(spec, serving=dataclasses.replace(spec.serving, **defaults)))


def simulate_point(point: Point, results_dir: str) -> dict:
    """The measured dict of a simulated serving point (harness.run.row makes it a row); its `requests`
    entry holds one dict per request for the per-request file, as a measured point's does."""
    try:
        return _simulate(point, results_dir)
    except FitError as error:
        return not_run("skipped", str(error))
    except Exception as error:  # a failure of this point, with its reason; the sweep goes on
        return {**not_run("failed", f"{type(error).__name__}: {error}"),
                "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))}


def _simulate(point: Point, results_dir: str) -> dict:
    spec = point.serving
    strategy = point.strategy.instantiate()
    reason = unservable(point, strategy)  # what a measured run of the point would refuse, refused alike
    if reason is not None:
        return not_run("skipped", reason)
    twin = measured_twin(point).key
    budget = spec.serving.kv_budget_bytes
    if spec.serving.executor == FITTED:
        step_time, described = _fitted(point, results_dir, twin)
    else:
        hardware = load_hardware(spec.serving.hardware)
        step_time, described = _roofline(point, results_dir, hardware)
        budget = node_budget_bytes(point, hardware) if budget is None else budget
    workload = build_workload(spec.workload, point.seed)
    layout = strategy.sequence_memory(point.model, getattr(torch, point.dtype))
    memory = KVMemory(layout, int(budget))
    outcome = simulate(workload, memory, step_time, spec.serving.prefill_chunk, spec.serving.max_batch)
    fitted: StepFit | None = getattr(step_time, "fitted", None)
    return {"status": "ok", "reason": "", "kernel": None, "device_name": described["device_name"],
            "timing_method": described["timing_method"], "kv_cache_bytes": int(budget),
            "serving_placement": layout.placement, "serving_reserves": layout.reserved,
            "serving_kv_bytes_per_token": layout.bytes_per_token, "serving_kept_tokens": layout.kept_tokens,
            "simulated": True, "simulates_point_key": twin, **fit_columns(fitted),
            **metrics.summary(outcome, spec.serving.slo.ttft_s, spec.serving.slo.tpot_s),
            "requests": [_request_row(point, record, budget) for record in outcome.requests]}


def fit_columns(fitted: StepFit | None) -> dict:
    """The row's step_fit_* columns (null but for a fitted simulation)."""
    if fitted is None:
        return dict.fromkeys(("step_fit_source", "step_fit_observations", "step_fit_coefficients",
                              "step_fit_residual_median", "step_fit_residual_p90", "step_fit_total_ratio"))
    return {"step_fit_source": fitted.source, "step_fit_observations": fitted.observations,
            "step_fit_coefficients": fitted.as_json(), "step_fit_residual_median": fitted.residual_median,
            "step_fit_residual_p90": fitted.residual_p90, "step_fit_total_ratio": fitted.total_ratio}


def node_budget_bytes(point: Point, hardware: Hardware) -> float:
    """The KV budget of `serving.tp` devices of `hardware`: each device's memory less the weights' share
    and the reserve (harness.analysis.capacity.node_kv_budget_bytes), in the strategy's whole-model bytes."""
    serving = point.serving.serving
    if hardware.memory_bytes is None:
        raise FitError(f"serving.kv_budget_bytes=null: {hardware.name} declares no memory_bytes to plan a budget from; "
                       "give serving.kv_budget_bytes")
    reserve = DEFAULT_RESERVE if serving.reserve is None else serving.reserve
    budget = node_kv_budget_bytes(point.model, point.dtype, hardware.memory_bytes, serving.tp, reserve)
    if budget <= 0:
        raise FitError(f"serving.tp={serving.tp}: {point.model.name}'s {point.dtype} weights leave no room for a cache "
                       f"on {serving.tp} x {hardware.name}; split it over more devices")
    return budget


def _roofline(point: Point, results_dir: str, hardware: Hardware) -> tuple[StepTime, dict]:
    serving = point.serving.serving
    roof, source = resolve(hardware, point.dtype, results_dir, point.device)
    devices = f"{serving.tp} x " if serving.tp > 1 else ""
    return RoofStepTime(point.model, point.dtype, point.strategy.layout, roof, serving.tp), {
        "device_name": f"{devices}{hardware.name} (simulated)",
        "timing_method": f"simulated: the analytic iteration at the roofs of {source}"
                         + (f", split over {serving.tp} devices (no communication counted)" if serving.tp > 1 else "")}


def _fitted(point: Point, results_dir: str, twin: str) -> tuple[StepTime, dict]:
    source = point.serving.serving.fit_from
    rows = _same_machine(_rows_of(point, results_dir), results_dir)
    split = row_split(point.matmul)
    if source == "serving":
        runs = rows[rows["workload"].notna() & (rows["serving_executor"].fillna(MEASURED) == MEASURED)
                    & (rows["point_key"] != twin)]
        logs = [read_iterations(folder, Path(name).name) for folder, name in zip(runs["source_dir"], runs["source_file"])]
        observations = [o for log in logs if log is not None for o in serving_observations(log, split)]
        described = f"the iterations of {len(runs)} measured serving run(s) of {point.strategy.variant}, this point's left out"
    else:
        steps = rows[rows["workload"].isna()]
        observations = step_observations(steps, point.strategy.layout, split)
        described = f"{len(steps)} step point(s) of {point.strategy.variant}"
    fitted = fit(observations, described)
    machine = rows["device_name"].iloc[0]
    return FittedStepTime(fitted, point.strategy.layout, split), {
        "device_name": f"{machine} (simulated)",
        "timing_method": f"simulated: a step time fitted from {described} on {machine}"}


def row_split(matmul: str) -> int | None:
    """Rows above which the linears of the point's matmul kernel hand a pass to another kernel
    (harness.model.cpu_linear.LinearKernel.max_rows; None: one kernel at every size)."""
    return next(kernel.max_rows for kernel in LINEAR_KERNELS if kernel.name == matmul)


def _rows_of(point: Point, results_dir: str) -> pd.DataFrame:
    """The ok rows of results_dir measured at the point's model, device, dtype, linear kernel and strategy."""
    if not Path(results_dir).is_dir():
        raise FitError(f"serving.fit_from: {results_dir} holds no rows to fit a step time from")
    rows = load(results_dir)
    mine = rows[(rows["status"] == "ok") & (rows["model"] == point.model.name) & (rows["device"] == point.device)
                & (rows["dtype"] == point.dtype) & (rows["matmul"] == point.matmul) & (rows["strategy"] == point.strategy.variant)
                & (rows["simulated"].fillna(False) == False)]  # noqa: E712 (a column, not a bool)
    if mine.empty:
        raise FitError(f"serving.fit_from: {results_dir} has no measured row of {point.strategy.variant} at "
                       f"{point.model.name} {point.device}/{point.dtype} to fit a step time from")
    return mine


def _same_machine(rows: pd.DataFrame, results_dir: str) -> pd.DataFrame:
    """The rows of one machine: the newest row's device_name (a step time is one machine's)."""
    newest = rows.sort_values("timestamp").iloc[-1]["device_name"]
    return rows[rows["device_name"] == newest]


def _request_row(point: Point, record, budget: float) -> dict:
    spec = point.serving
    return {"point_key": point.key, "strategy": point.strategy.variant, "workload": spec.workload.name,
            "workload_rate": spec.workload.rate, "serving_kv_budget_bytes": float(budget),
            "request": record.request.index, "arrival_s": record.arrival_s, "prompt_len": record.request.prompt_len,
            "output_len": record.request.output_len, "max_tokens": record.request.max_tokens,
            "admitted_s": record.admitted_s, "queue_wait_s": record.queue_wait_s, "ttft_s": record.ttft_s,
            "tpot_s": record.tpot_s, "e2e_s": record.e2e_s, "itl_s": record.itl_s,
            "token_times_s": list(record.token_times_s), "preemptions": record.preemptions,
            "output_tokens": [], "first_divergence": None, "divergence_margin": None, "reference_agreement": None}
