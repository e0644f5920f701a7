"""The calibration kernels: the read bandwidth decode sees and the matmul rate, per device and dtype.

Bandwidth: the best of the read-dominated kernels over data several times the last-level cache (a
server CPU's L3 is tens of MiB to about 100 MiB, an H100/H200's L2 at most 60 MB): a full reduction (a pure stream), a
matrix-vector product (what a decode step's weight reads are), and on a CPU the same product through
the harness's own linear kernels where they run: oneDNN's packed linear, and in fp32 the C small-batch
linear (harness.model.cpu_gemv), which reads in interleaved streams faster than aten's sgemv. A roof
below a kernel in use would give fractions above 1. Matmul: a square GEMM in the dtype.
Each kernel runs once to warm up, then up to `REPEATS` times within its share of the calibration's
wall-time budget (the GEMM shrinks to fit its share); the best time stands, because on a shared
machine noise only ever makes a kernel slower than the hardware allows. The share of the CPUs other
processes took meanwhile is recorded with the roofs (`contention`): best-of cannot undo a busy machine
whose other process held a core for the whole run.
"""
from __future__ import annotations

import socket
from datetime import datetime, timezone

import torch

from harness.measure.contention import CpuTimes, others_fraction
from harness.measure.device import device_name
from harness.measure.rounds import RoundsOptions, time_rounds
from harness.measure.timing import StepTimer
from harness.model import cpu_gemv
from harness.model.cpu_linear import runnable_linears
from harness.store.calibration import Calibration, best_gemv

REPEATS = 10
READ_BYTES = {"cpu": 1 << 30, "cuda": 4 << 30}  # data streamed per read kernel
MATMUL_N = {"cpu": 2048, "cuda": 8192}  # square GEMM size, halved to fit the budget where needed
KERNELS = 5  # the budget is shared by: sum, matrix-vector, packed and C matrix-vector, GEMM
PROBE_N = 256  # the GEMM first timed at this size, to choose the largest size that fits its share


def measure_within(request: tuple[str, str, float, bool]) -> Calibration:
    """The calibration kernels, within a wall-time budget (run it in a process of its own: it
    allocates ~1.5 READ_BYTES). `request` is (device, dtype, budget in seconds, c_linear): with
    c_linear false the C linear is left out (and its extension never loaded: a run of torch's kernels
    only touches no kernel cache)."""
    device_type, dtype_name, budget_s, c_linear = request
    device, dtype = torch.device(device_type), getattr(torch, dtype_name)
    timer = StepTimer(device)
    best = _BestOf(timer, budget_s / KERNELS)

    began = CpuTimes.now()
    read_bytes = READ_BYTES[device_type]
    sum_bw = _reduction_rate(read_bytes, device, dtype, best.seconds)
    probes = gemv_kernels(device_type, dtype_name, c_linear)
    with_packed, with_c = "packed" in probes, "c" in probes
    gemv_bw, packed_bw, c_bw = _gemv_rates(read_bytes // 2, device, dtype, best.seconds, with_packed, with_c)
    read_repeats = list(best.repeats)

    full_n = MATMUL_N[device_type]
    n = _gemm_size(full_n, best.share, device, dtype, timer)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))  # [n, n] each
    flops = 2 * n**3 / best.seconds(lambda: a @ b)
    contention = others_fraction(began, CpuTimes.now())
    shrunk = f" (shrunk from {full_n} to fit the budget)" if n < full_n else ""
    return Calibration(
        device=device_type,
        device_name=device_name(device),
        hostname=socket.gethostname(),
        dtype=dtype_name,
        read_bandwidth_Bps=max(sum_bw, best_gemv(gemv_bw, packed_bw, c_bw)),
        read_bandwidth_sum_Bps=sum_bw,
        read_bandwidth_gemv_Bps=gemv_bw,
        read_bandwidth_packed_gemv_Bps=packed_bw,
        matmul_flops=flops,
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        contention=contention,
        read_bandwidth_c_gemv_Bps=c_bw,
        method=(
            f"best of up to {REPEATS} after a warm-up, each kernel stopping after {best.share:.3g} s of a "
            f"{budget_s:.3g} s budget (timed runs: read kernels {'/'.join(map(str, read_repeats))}, GEMM "
            f"{best.repeats[-1]}); bandwidth: max(sum over {read_bytes >> 20} MiB, mv over a {read_bytes >> 21} MiB "
            f"matrix, the same through oneDNN's packed linear and the C linear where they run); matmul: {n}x{n}x{n} GEMM"
            f"{shrunk}, {dtype_name}"
        ),
    )


class _BestOf:
    """Times a kernel (harness.measure.rounds): a warm-up, then up to REPEATS timed runs while another
    fits its `share` of the budget; the best time stands. `repeats` records the timed runs of each kernel."""

    def __init__(self, timer, share: float):
        self.timer = timer
        self.share = share  # seconds each kernel may take
        self.repeats: list[int] = []

    def seconds(self, kernel) -> float:
        options = RoundsOptions(rounds=1, max_passes=REPEATS, budget_s=self.share, read_contention=False)
        times = time_rounds({"kernel": kernel}, options, timer=self.timer).seconds["kernel"]
        self.repeats.append(len(times))
        return min(times)


def _gemm_size(full_n: int, share: float, device, dtype, timer) -> int:
    """The largest GEMM size, halving from full_n (PROBE_N at least), whose warm-up and two timed runs
    fit `share` seconds, extrapolated from one timed PROBE_N GEMM (time grows as n^3)."""
    probe = min(PROBE_N, full_n)
    a, b = (torch.randn(probe, probe, device=device, dtype=dtype) for _ in range(2))  # [probe, probe]
    a @ b
    probe_s = timer.time(lambda: a @ b)[1]
    n = full_n
    while n > probe and 3 * probe_s * (n / probe) ** 3 > share:
        n //= 2
    return max(n, probe)


def _reduction_rate(nbytes: int, device, dtype, best_seconds) -> float:
    """Bytes/s of a full reduction: a pure stream. Its buffer is freed on return."""
    stream = torch.ones(nbytes // torch.empty((), dtype=dtype).element_size(), device=device, dtype=dtype)  # [N]
    return stream.nbytes / best_seconds(lambda: stream.sum())


PROBE_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}  # a group's in-round read: 8x a 32 MiB L3, 16x an H200's L2


class GemvRead:
    """One matrix-vector read kernel over an `nbytes` matrix of ones: the kernel the calibration times
    and a group interleaves with its steps (harness.measure.group), so both read the same way."""

    def __init__(self, kernel: str, nbytes: int, device, dtype):
        rows = 8192
        cols = nbytes // torch.empty((), dtype=dtype).element_size() // rows
        matrix = torch.ones(rows, cols, device=device, dtype=dtype)  # [R, C]
        vector = torch.ones(cols, device=device, dtype=dtype)  # [C]
        row = vector[None, :]  # [1, C]
        self.kernel, self.nbytes = kernel, matrix.nbytes
        if kernel == "aten":
            self.run = lambda: torch.mv(matrix, vector)
        elif kernel == "c":
            self.run = lambda: cpu_gemv.gemv(row, matrix)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(matrix, 1)
            self.run = lambda: torch.ops.mkldnn._linear_pointwise(row, packed, None, "none", [], "")

    def __call__(self) -> None:
        self.run()


def gemv_kernels(device_type: str, dtype_name: str, c_linear: bool) -> tuple[str, ...]:
    """The matrix-vector kernels that run on this device and dtype; the C linear only where `c_linear`
    (the points use it: matmul=c), so a run of torch's kernels never loads the C extension."""
    leave_out = () if c_linear else ("c",)  # harness.model.cpu_linear's one rule
    return tuple(kernel.probe for kernel in runnable_linears(device_type, dtype_name, leave_out))


def _gemv_rates(nbytes: int, device, dtype, best_seconds, with_packed: bool,
                with_c: bool) -> tuple[float, float | None, float | None]:
    """Bytes/s of a matrix-vector product over an `nbytes` matrix: aten's, oneDNN's packed one (None
    unless `with_packed`) and the C linear's (None unless `with_c`). Each matrix is freed before the next."""
    rates = {}
    for kernel, runs in (("aten", True), ("c", with_c), ("packed", with_packed)):
        if runs:
            read = GemvRead(kernel, nbytes, device, dtype)
            rates[kernel] = read.nbytes / best_seconds(read)
            del read
    return rates["aten"], rates.get("packed"), rates.get("c")
