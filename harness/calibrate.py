"""Roofs of the device at hand: the read bandwidth decode sees and the matmul rate, per device and dtype.

Measured once and kept in `<results_dir>/_calibration/<device>__<dtype>.json` with its timestamp;
reused by every later point on the same host until `calibrate=true` forces a new measurement. Every
row copies the roofs it was judged against, so a later recalibration never rewrites history.

Bandwidth: the best of the read-dominated kernels over data several times the last-level cache (L3
is 32-105 MiB on the CPUs here, L2 at most 60 MB on H100/H200): a full reduction (a pure stream), a
matrix-vector product (what a decode step's weight reads are), and on a CPU where oneDNN can pack the
dtype, the same product through oneDNN's packed linear (the kernel the harness's CPU decode uses,
which reads faster than aten's: a roof below the kernel in use would give fractions above 1). Matmul: a square GEMM in the dtype.
Each kernel runs once to warm up, then `REPEATS` times; the best time stands, because on a shared
machine noise only ever makes a kernel slower than the hardware allows.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

CALIBRATION_DIR = "_calibration"  # under results_dir; '_' so pyarrow skips it when reading the folder
REPEATS = 10
READ_BYTES = {"cpu": 1 << 30, "cuda": 4 << 30}  # data streamed per read kernel
MATMUL_N = {"cpu": 2048, "cuda": 8192}  # square GEMM size


@dataclass
class Calibration:
    device: str  # cpu | cuda
    device_name: str  # processor or GPU model
    hostname: str  # machine the roofs were measured on; another host recalibrates
    dtype: str  # dtype of the kernels
    read_bandwidth_Bps: float  # roof: the better of the two read kernels, bytes/s
    read_bandwidth_sum_Bps: float  # full reduction over READ_BYTES
    read_bandwidth_gemv_Bps: float  # matrix-vector product over a READ_BYTES / 2 matrix (aten)
    read_bandwidth_packed_gemv_Bps: float | None  # the same through oneDNN's packed linear; None where unsupported
    matmul_flops: float  # roof: square GEMM rate, FLOP/s
    timestamp: str  # when it was measured (UTC, ISO 8601)
    method: str  # what was run, in words


def record_path(results_dir: str | Path, device: str, dtype: str) -> Path:
    return Path(results_dir) / CALIBRATION_DIR / f"{device}__{dtype}.json"


def load(results_dir: str | Path, device: str, dtype: str) -> Calibration | None:
    """The stored calibration for this host, device and dtype, or None."""
    path = record_path(results_dir, device, dtype)
    try:
        record = Calibration(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return record if record.hostname == socket.gethostname() else None


def save(results_dir: str | Path, record: Calibration) -> Path:
    """Write atomically, like the rows: a reader never sees half a record."""
    path = record_path(results_dir, record.device, record.dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(asdict(record), indent=2) + "\n")
    os.replace(temporary, path)
    return path


def measure(device_and_dtype: tuple[str, str]) -> Calibration:
    """Run the calibration kernels (call it in a process of its own: it allocates ~1.5 READ_BYTES)."""
    import torch

    from harness.cpu_linear import onednn_supports
    from harness.measure import device_name
    from harness.timing import StepTimer

    device_type, dtype_name = device_and_dtype
    device, dtype = torch.device(device_type), getattr(torch, dtype_name)
    timer = StepTimer(device)

    def best_seconds(kernel) -> float:
        kernel()
        return min(timer.time(kernel)[1] for _ in range(REPEATS))

    read_bytes = READ_BYTES[device_type]
    sum_bw = _reduction_rate(read_bytes, device, dtype, best_seconds)
    with_packed = device_type == "cpu" and onednn_supports(dtype_name)
    gemv_bw, packed_bw = _gemv_rates(read_bytes // 2, device, dtype, best_seconds, with_packed)
    n = MATMUL_N[device_type]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))  # [n, n] each
    flops = 2 * n**3 / best_seconds(lambda: a @ b)
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
            f"best of {REPEATS} after a warm-up; bandwidth: max(sum over {read_bytes >> 20} MiB, "
            f"mv over a {read_bytes >> 21} MiB matrix, the same through oneDNN's packed linear "
            f"where supported); matmul: {n}x{n}x{n} GEMM, {dtype_name}"
        ),
    )


def _reduction_rate(nbytes: int, device, dtype, best_seconds) -> float:
    """Bytes/s of a full reduction: a pure stream. Its buffer is freed on return."""
    import torch

    stream = torch.ones(nbytes // torch.empty((), dtype=dtype).element_size(), device=device, dtype=dtype)  # [N]
    return stream.nbytes / best_seconds(lambda: stream.sum())


def _gemv_rates(nbytes: int, device, dtype, best_seconds, with_packed: bool) -> tuple[float, float | None]:
    """Bytes/s of a matrix-vector product over an `nbytes` matrix: aten's, and oneDNN's packed one
    (None unless `with_packed`). The matrices are freed on return."""
    import torch

    rows = 8192
    cols = nbytes // torch.empty((), dtype=dtype).element_size() // rows
    matrix = torch.ones(rows, cols, device=device, dtype=dtype)  # [R, C]
    vector = torch.ones(cols, device=device, dtype=dtype)  # [C]
    aten = matrix.nbytes / best_seconds(lambda: torch.mv(matrix, vector))
    if not with_packed:
        return aten, None
    packed = torch.ops.mkldnn._reorder_linear_weight(matrix, 1)
    row = vector[None, :]  # [1, C]
    return aten, matrix.nbytes / best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(row, packed, None, "none", [], ""))


def ensure(results_dir: str | Path, device: str, dtype: str, force: bool, run) -> tuple[Calibration, bool]:
    """The calibration to judge points against: stored, or measured now via `run(measure, arg)` (the
    runner passes its process isolation). Returns (record, measured_now)."""
    if not force:
        stored = load(results_dir, device, dtype)
        if stored is not None:
            return stored, False
    outcome = run(measure, (device, dtype))
    if isinstance(outcome, dict):  # isolation reports a failure as a dict with a reason
        raise RuntimeError(f"calibration failed: {outcome.get('reason')}")
    save(results_dir, outcome)
    return outcome, True
