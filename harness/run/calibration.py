"""The roofs a point is judged against: the stored calibration of its device and dtype, or one measured
now (in a process of its own), once per process.

Records live in `<results_dir>/_calibration/` (harness.store.calibration) and are reused by every
later point on the same host until `calibrate=true` forces a new measurement. Two processes never
calibrate one device and dtype at once: `ensure` holds an exclusive lock on
`_calibration/<device>__<dtype>.lock` (fcntl.flock, released by the kernel when a process dies) while
it measures, and a second process waits for it, then reuses the record the first one wrote.

A calibration has a wall-time budget (`calibration_budget_s`): it says so in the log before it starts,
each kernel's repeats stop once its share of the budget is spent (one timed run at least), and the
GEMM shrinks (halving from harness.measure.roofs.MATMUL_N) until a warm-up and two runs fit its
share, so fp16 on a CPU without fp16 units takes seconds, not minutes. The record's `method` says
how many repeats each kernel ran and which GEMM size was used.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from harness.measure import roofs
from harness.store.calibration import Calibration, load, record_path, save  # noqa: F401 (record_path for callers)

log = logging.getLogger("harness")

DEFAULT_BUDGET_S = 120.0  # harness.config.schema.RunConfig.calibration_budget_s's default
KERNELS = 4  # the budget is shared by: sum, matrix-vector, packed matrix-vector, GEMM
PROBE_N = 256  # the GEMM first timed at this size, to choose the largest size that fits its share


def lock_path(results_dir: str | Path, device: str, dtype: str) -> Path:
    return record_path(results_dir, device, dtype).with_suffix(".lock")


@contextmanager
def _exclusive(path: Path, label: str):
    """Hold an exclusive flock on `path` (created if missing); log once when another process has it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info(f"another process is calibrating {label} ({path}): waiting for it, then using its record")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure(results_dir: str | Path, device: str, dtype: str, force: bool, run,
           budget_s: float = DEFAULT_BUDGET_S) -> tuple[Calibration, bool]:
    """The calibration to judge points against: stored, or measured now via `run(measure_within, arg)`
    (the runner passes its process isolation) under the device's lock. Returns (record, measured_now).
    With `force`, a record another process wrote while this one waited for the lock counts as fresh."""
    if not force:
        stored = load(results_dir, device, dtype)
        if stored is not None:
            return stored, False
    label = f"{device}/{dtype}"
    asked = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with _exclusive(lock_path(results_dir, device, dtype), label):
        stored = load(results_dir, device, dtype)  # written by whoever held the lock before us?
        if stored is not None and (not force or stored.timestamp >= asked):
            return stored, False
        path = record_path(results_dir, device, dtype)
        log.info(f"calibrating {label}: read bandwidth and matmul roofs, budget {budget_s:.0f} s "
                 f"(calibration_budget_s); the record goes to {path} and later runs reuse it")
        began = time.monotonic()
        outcome = run(measure_within, (device, dtype, float(budget_s)))
        if isinstance(outcome, dict):  # isolation reports a failure as a dict with a reason
            raise RuntimeError(f"calibration failed: {outcome.get('reason')}")
        log.info(f"calibration of {label} took {time.monotonic() - began:.1f} s")
        try:
            save(results_dir, outcome)
        except OSError:  # a full disk: no half-written temporary is left behind
            path.with_name(f".{path.name}.tmp-{os.getpid()}").unlink(missing_ok=True)
            raise
    return outcome, True


def measure_within(request: tuple[str, str, float]) -> Calibration:
    """harness.measure.roofs' kernels, within a wall-time budget (run it in a process of its own: it
    allocates ~1.5 roofs.READ_BYTES). `request` is (device, dtype, budget in seconds)."""
    import torch

    from harness.measure.device import device_name
    from harness.measure.timing import StepTimer
    from harness.model.cpu_linear import onednn_supports

    device_type, dtype_name, budget_s = request
    device, dtype = torch.device(device_type), getattr(torch, dtype_name)
    timer = StepTimer(device)
    share = budget_s / KERNELS
    repeats: list[int] = []

    def best_seconds(kernel) -> float:
        """Warm up once, then up to roofs.REPEATS timed runs, stopping when the kernel's share is spent."""
        start = time.monotonic()
        kernel()
        times = [timer.time(kernel)[1]]
        while len(times) < roofs.REPEATS and time.monotonic() - start < share:
            times.append(timer.time(kernel)[1])
        repeats.append(len(times))
        return min(times)

    read_bytes = roofs.READ_BYTES[device_type]
    sum_bw = roofs._reduction_rate(read_bytes, device, dtype, best_seconds)
    with_packed = device_type == "cpu" and onednn_supports(dtype_name)
    gemv_bw, packed_bw = roofs._gemv_rates(read_bytes // 2, device, dtype, best_seconds, with_packed)
    read_repeats = list(repeats)

    full_n = roofs.MATMUL_N[device_type]
    n = _gemm_size(full_n, share, device, dtype, timer)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))  # [n, n] each
    flops = 2 * n**3 / best_seconds(lambda: a @ b)
    shrunk = f" (shrunk from {full_n} to fit the budget)" if n < full_n else ""
    return Calibration(
        device=device_type,
        device_name=device_name(device),
        hostname=socket.gethostname(),
        dtype=dtype_name,
        read_bandwidth_Bps=max(sum_bw, gemv_bw, packed_bw or 0.0),
        read_bandwidth_sum_Bps=sum_bw,
        read_bandwidth_gemv_Bps=gemv_bw,
        read_bandwidth_packed_gemv_Bps=packed_bw,
        matmul_flops=flops,
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        method=(
            f"best of up to {roofs.REPEATS} after a warm-up, each kernel stopping after {share:.3g} s of a "
            f"{budget_s:.3g} s budget (timed runs: read kernels {'/'.join(map(str, read_repeats))}, GEMM "
            f"{repeats[-1]}); bandwidth: max(sum over {read_bytes >> 20} MiB, mv over a {read_bytes >> 21} MiB "
            f"matrix, the same through oneDNN's packed linear where supported); matmul: {n}x{n}x{n} GEMM"
            f"{shrunk}, {dtype_name}"
        ),
    )


def _gemm_size(full_n: int, share: float, device, dtype, timer) -> int:
    """The largest GEMM size, halving from full_n (PROBE_N at least), whose warm-up and two timed runs
    fit `share` seconds, extrapolated from one timed PROBE_N GEMM (time grows as n^3)."""
    import torch

    probe = min(PROBE_N, full_n)
    a, b = (torch.randn(probe, probe, device=device, dtype=dtype) for _ in range(2))  # [probe, probe]
    a @ b
    probe_s = timer.time(lambda: a @ b)[1]
    n = full_n
    while n > probe and 3 * probe_s * (n / probe) ** 3 > share:
        n //= 2
    return max(n, probe)
