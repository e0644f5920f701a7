"""DRAM traffic of a point's decode steps, read from Nsight Compute's counters.

Only Nsight Compute reads a GPU's DRAM counters dependably (torch.profiler's CUPTI metrics do not).

Only ncu reads GPU DRAM counters dependably. The point's decode steps run again in a child process
(`harness.measure.ncu_target`) under ncu; the steps sit in an NVTX push/pop range named `decode`, and
`--nvtx-include "decode/"` restricts profiling to the kernels launched inside it, so model building,
prefill and warm-up are not counted. The sum of dram__bytes_read + dram__bytes_write over those
kernels, divided by the number of steps, is `bytes_per_step_measured`.

This re-run happens after the timed measurement, in a separate process: ncu serialises and replays
kernels, so nothing timed may run under it.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.config import Point

REPO_ROOT = Path(__file__).resolve().parents[2]  # on PYTHONPATH of the profiled child (a checkout)
NVTX_RANGE = "decode"  # the push/pop range ncu_target opens around each decode step
READ, WRITE = "dram__bytes_read.sum", "dram__bytes_write.sum"
NCU_ENV = "HARNESS_NCU"  # path of the ncu executable, when it is not (or should not be) the one on PATH

# Without --print-units base, ncu scales each metric column into a decimal-prefixed unit (12.29 Kbyte).
# Only units listed here are accepted: an unknown or blank unit refuses rather than being taken as
# bytes, which would be off by a factor of 1e3..1e9 and look plausible.
BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


class NcuParseError(ValueError):
    """ncu's output is not the raw-page CSV of the two DRAM metrics we asked for."""


@dataclass(frozen=True)
class NcuTraffic:
    read_bytes: float  # dram__bytes_read.sum over all profiled kernels
    write_bytes: float  # dram__bytes_write.sum over all profiled kernels
    kernels: int  # kernel launches profiled (rows of the CSV)

    @property
    def total_bytes(self) -> float:
        return self.read_bytes + self.write_bytes


def ncu_executable() -> str | None:
    return os.environ.get(NCU_ENV) or shutil.which("ncu")


def ncu_command(program_argv: list[str], ncu: str = "ncu") -> list[str]:
    """The Nsight Compute command around `program_argv`: DRAM bytes read and written per kernel,
    restricted to the NVTX range, as raw CSV.

    --cache-control none: ncu would otherwise flush the caches before every kernel, turning each
    step's L2 hits into DRAM reads; the timed run does not flush, so neither do we.
    --clock-control none: keep the clocks the timed run saw.
    --print-units base: values in plain bytes rather than ncu's per-kernel
    auto-scaled units, which it prints with two decimals (1.23 Gbyte is ±5 MB). The parser accepts
    either form.
    """
    return [
        ncu,
        "--nvtx", "--nvtx-include", f"{NVTX_RANGE}/",  # trailing slash: a push/pop range (torch.cuda.nvtx.range)
        "--metrics", f"{READ},{WRITE}",
        "--csv", "--page", "raw", "--print-units", "base",
        "--cache-control", "none", "--clock-control", "none",
        *program_argv,
    ]


def parse_ncu_csv(text: str) -> NcuTraffic:
    """Sum the two DRAM metrics over the kernels of ncu's `--csv --page raw` output.

    The layout (one row per profiled kernel launch, every field quoted):
        ==PROF== ...                          ncu's log lines, and any program stdout, come first
        "ID","Process ID",...,"Kernel Name",...,"dram__bytes_read.sum","dram__bytes_write.sum"
        "","",...,"","Mbyte","Kbyte"          units row: empty ID, a unit per metric column
        "0","4242",...,"1.05","12.29"          one row per kernel; numbers may carry thousands
                                                separators ("1,048,576"), inside the quotes
        ==PROF== Disconnected from process     more log lines may follow
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith('"ID"')), None)
    if start is None:
        raise NcuParseError(f'no CSV header row (a line starting with "ID") in ncu\'s output:\n{_tail(text)}')
    # ncu quotes every CSV field; anything else after the header is a log line or program output.
    rows = list(csv.reader(line for line in lines[start:] if line.lstrip().startswith('"')))
    header = [name.strip() for name in rows[0]]
    body = [row for row in rows[1:] if row != rows[0]]  # a repeated header (one per process) is not a kernel
    missing = [m for m in (READ, WRITE) if m not in header]
    if missing:
        raise NcuParseError(f"ncu's CSV has no column {', '.join(missing)}; its columns: {header}")
    for row in body:
        if len(row) != len(header):
            raise NcuParseError(f"a CSV row has {len(row)} fields, the header {len(header)}: {row}")
    id_col = header.index("ID")
    name_col = header.index("Kernel Name") if "Kernel Name" in header else id_col  # names a kernel in errors
    units = next((row for row in body if not row[id_col].strip()), None)
    if units is None:
        raise NcuParseError("ncu's CSV has no units row (a row with an empty ID) after the header")
    kernels = [row for row in body if row[id_col].strip()]
    if not kernels:
        raise NcuParseError(
            f'ncu profiled no kernels: nothing ran inside the NVTX range "{NVTX_RANGE}", or ncu filtered it out'
        )
    totals = {}
    for metric in (READ, WRITE):
        col = header.index(metric)
        scale = _byte_scale(units[col], metric)
        totals[metric] = sum(scale * _number(row[col], metric, row[name_col]) for row in kernels)
    return NcuTraffic(read_bytes=totals[READ], write_bytes=totals[WRITE], kernels=len(kernels))


def measure_traffic(point: Point, ncu: str | None = None, timeout: float = 3600.0) -> dict:
    """Re-run the point's decode steps under ncu; the traffic half of its row.

    `ncu`: the executable (default $HARNESS_NCU, else `ncu` on PATH); tests pass a fake one.
    Raises RuntimeError, with ncu's output tail, when ncu fails or reports nothing usable.
    """
    if point.device != "cuda":
        raise ValueError(f"ncu reads GPU counters; {point.label()} runs on {point.device}")
    ncu = ncu or ncu_executable()
    if ncu is None:
        raise RuntimeError("traffic=ncu needs Nsight Compute: no `ncu` on PATH and $HARNESS_NCU unset")
    program = [sys.executable, "-m", "harness.measure.ncu_target", json.dumps(point.record())]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "LC_NUMERIC": "C",  # ncu formats numbers by locale; C keeps "," as the thousands separator
    }
    try:
        done = subprocess.run(
            ncu_command(program, ncu), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as expired:
        raise RuntimeError(f"ncu did not finish within {timeout:.0f} s for {point.label()}") from expired
    if done.returncode != 0:
        raise RuntimeError(
            f"ncu exited with code {done.returncode} for {point.label()}:\n{_tail(done.stdout + done.stderr)}"
        )
    try:
        traffic = parse_ncu_csv(done.stdout)
    except NcuParseError as error:
        raise RuntimeError(f"{error}\nncu's stderr:\n{_tail(done.stderr)}") from error
    return {
        "bytes_per_step_measured": traffic.total_bytes / point.decode_tokens,
        "traffic_source": "ncu",
        "ncu_kernels": traffic.kernels,
    }


def _byte_scale(unit: str, metric: str) -> float:
    unit = unit.strip()
    if unit not in BYTE_UNITS:
        raise NcuParseError(f"unexpected unit {unit!r} for {metric}; known: {', '.join(BYTE_UNITS)}")
    return BYTE_UNITS[unit]


def _number(value: str, metric: str, kernel: str) -> float:
    try:
        return float(value.strip().replace(",", ""))  # "1,048,576.00" -> 1048576.0
    except ValueError:
        # "n/a" or blank: the counter was not collected for this kernel; a partial sum would look valid.
        raise NcuParseError(f"{metric} of kernel {kernel!r} is {value!r}, not a number") from None


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "(no output)"
