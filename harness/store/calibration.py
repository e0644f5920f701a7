"""Calibration records on disk: the roofs measured on one host's device in one dtype.

`<results_dir>/_calibration/<host>__<device>__<dtype>.json`, one per host (several hosts' rows and
records share one results folder on a cluster, and each host is judged against its own roofs),
written atomically like the rows, one record
type for the writer (harness.run.calibrate) and every reader (the analytic CLI's hardware=measured,
harness.analysis.results). A row copies the roofs it was judged against, so a later recalibration
never rewrites history.
"""
from __future__ import annotations

import json
import re
import socket
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Optional

from harness.files import write_whole

CALIBRATION_DIR = "_calibration"  # under results_dir; '_' so pyarrow skips it when reading the folder


@dataclass
class Calibration:
    device: str  # cpu | cuda
    device_name: str  # processor or GPU model
    hostname: str  # machine the roofs were measured on; another host recalibrates
    dtype: str  # dtype of the kernels
    read_bandwidth_Bps: float  # roof: the best of the read kernels, bytes/s
    read_bandwidth_sum_Bps: float  # full reduction
    read_bandwidth_gemv_Bps: float  # matrix-vector product (aten)
    read_bandwidth_packed_gemv_Bps: Optional[float]  # the same through oneDNN's packed linear; None where unsupported
    matmul_flops: float  # roof: square GEMM rate, FLOP/s
    timestamp: str  # when it was measured (UTC, ISO 8601); the newest wins
    method: str  # what was run, in words
    # Share of the CPUs other processes took while the kernels ran (harness.measure.contention); a
    # record measured on a busy machine has roofs that are too low. None: a record from before it was kept.
    contention: Optional[float] = None
    # The matrix-vector product through the C small-batch linear (harness.model.cpu_gemv), the kernel
    # matmul=auto runs on a CPU in fp32; None where it cannot run, or a record from before it was measured.
    read_bandwidth_c_gemv_Bps: Optional[float] = None

    @property
    def gemv_bandwidth_Bps(self) -> float:
        """The best matrix-vector read of the record (aten, oneDNN packed, the C linear): what a decode
        step's weight reads, which are matrix-vector products, can reach on this machine. Below the roof
        where a stream (the full reduction) set it."""
        return best_gemv(self.read_bandwidth_gemv_Bps, self.read_bandwidth_packed_gemv_Bps,
                         self.read_bandwidth_c_gemv_Bps)


    @property
    def gemv_kernel(self) -> str:
        """Which matrix-vector read set gemv_bandwidth_Bps: aten, packed or c (the names of
        harness.measure.roofs.GemvRead), the kernel a group times in its rounds."""
        rates = {"aten": self.read_bandwidth_gemv_Bps, "packed": self.read_bandwidth_packed_gemv_Bps,
                 "c": self.read_bandwidth_c_gemv_Bps}
        return max((name for name in rates if rates[name]), key=lambda name: rates[name])


def best_gemv(aten: float, packed: Optional[float], c: Optional[float]) -> float:
    """The fastest of the matrix-vector reads measured (packed and c: None where they did not run)."""
    return max(rate for rate in (aten, packed, c) if rate)


def host_slug(hostname: str | None = None) -> str:
    """The host's name as it may appear in a file name (anything else becomes '-')."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", hostname or socket.gethostname()).lstrip(".") or "host"


def record_path(results_dir: str | Path, device: str, dtype: str, hostname: str | None = None) -> Path:
    """Where this host's (or `hostname`'s) record for a device and dtype lives."""
    return Path(results_dir) / CALIBRATION_DIR / f"{host_slug(hostname)}__{device}__{dtype}.json"


def parse(text: str) -> Calibration:
    """A record from its JSON text; ValueError/TypeError/KeyError when it is not one."""
    raw = json.loads(text)
    optional = {f.name for f in fields(Calibration) if f.default is not MISSING}
    record = Calibration(**{f.name: raw[f.name] for f in fields(Calibration) if f.name in raw or f.name not in optional})
    for name in ("read_bandwidth_Bps", "matmul_flops"):
        value = getattr(record, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} is {value!r}, not a positive number")
    return record


def load(results_dir: str | Path, device: str, dtype: str) -> Calibration | None:
    """The stored calibration for this host, device and dtype, or None."""
    try:
        record = parse(record_path(results_dir, device, dtype).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return record if record.hostname == socket.gethostname() else None


def save(results_dir: str | Path, record: Calibration) -> Path:
    """Write atomically: a reader never sees half a record."""
    path = record_path(results_dir, record.device, record.dtype, record.hostname)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_whole(path, json.dumps(asdict(record), indent=2) + "\n")


def read_all(results_dir) -> tuple[list[tuple[Path, Calibration]], list[tuple[Path, str]]]:
    """Every record under results_dir/_calibration with its path, and the files that are not one."""
    records, problems = [], []
    folder = Path(results_dir) / CALIBRATION_DIR
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            records.append((path, parse(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError) as error:
            problems.append((path, f"not a calibration record: {type(error).__name__}: {error}"))
    return records, problems


def find(results_dir, dtype: str, device: Optional[str] = None,
         device_name: Optional[str] = None) -> Optional[tuple[Path, Calibration]]:
    """The newest record for this dtype (and device / device name when given), with its path, or None."""
    records, _ = read_all(results_dir)
    matches = [(p, r) for p, r in records
               if r.dtype == dtype and (device is None or r.device == device)
               and (not device_name or not r.device_name or r.device_name == device_name)]
    return max(matches, key=lambda pr: pr[1].timestamp) if matches else None
