"""Memory of one point: its own peak, what it will need, and what the device has free.

CPU: torch keeps no allocator statistics, and ru_maxrss is a lifetime peak that cannot be reset. The
runner therefore runs each point in a fresh process (harness.run.isolation) and, inside it, resets the
kernel's resident-set high-water mark (VmHWM, via /proc/self/clear_refs) once the runtime is loaded,
so the recorded peak is what the point itself added on top of Python and torch.
CUDA: the caching allocator's peaks, reset per point.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from harness.analysis import analytic
from harness.analysis.peak_memory import predicted_peak_bytes

GIB = 2**30
_STATUS_FIELD = re.compile(r"^(Vm\w+):\s+(\d+) kB$", re.MULTILINE)


def _proc_status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {name: int(kb) * 1024 for name, kb in _STATUS_FIELD.findall(f.read())}


@dataclass
class PeakTracker:
    """Peak memory of the work done between `start()` and `read()` on one device."""

    device: torch.device
    baseline_bytes: int = 0  # resident set (CPU) or allocated bytes (CUDA) when the tracked work began

    def start(self) -> None:
        """Take the baseline (nothing of the tracked work allocated yet) and reset the peak."""
        self.baseline_bytes = self._held_now()
        self.reset_peak()

    def _held_now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _proc_status()["VmRSS"]

    def held_bytes(self) -> int:
        """Bytes held now above the baseline: what the tracked work keeps (a built model's weights)."""
        return self._held_now() - self.baseline_bytes

    def reset_peak(self) -> None:
        """Forget the peak so far, keep the baseline. Called again once the model is built, so that
        one-time set-up transients (the oneDNN repack holds two copies of one weight) stay out of the
        point's peak; the built weights stay resident and so stay in it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
        except OSError:
            pass  # the process is fresh anyway; the peak then includes the runtime's own start-up

    def read(self) -> dict[str, int | None]:
        """peak_memory_bytes: bytes the tracked work held at its peak above the baseline (CPU: resident
        set; CUDA: allocated tensors). peak_memory_reserved_bytes: CUDA allocator's reserve, None on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {
                "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device) - self.baseline_bytes,
                "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
                "process_baseline_bytes": None,
            }
        return {
            "peak_memory_bytes": _proc_status()["VmHWM"] - self.baseline_bytes,
            "peak_memory_reserved_bytes": None,
            "process_baseline_bytes": self.baseline_bytes,
        }


HUGEPAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator: madvise(MADV_HUGEPAGE) on allocations >= 2 MiB


def use_hugepages() -> None:
    """Ask torch's CPU allocator for 2 MiB pages. It reads the variable once, at the process's first
    allocation, so this must run before anything is allocated (a fresh point process)."""
    os.environ[HUGEPAGES_ENV] = "1"


def anon_hugepages_bytes() -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages now (None: not Linux)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes(device: str) -> int:
    """Memory a new point can still take: MemAvailable on a CPU, free device memory on CUDA."""
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def shortfall(point, beside: int | None = None) -> str | None:
    """Why the point cannot fit in its device's free memory (or in `memory_limit_bytes`, when the point
    sets a smaller one: the device is treated as that large), or None when it can. The one memory
    check of a point: the plan calls it for CPU points before anything runs, and a group's process
    again as it sets each member up (on CUDA the first time: free GPU memory is known only there).

    beside: None before the model is built; at a member's set-up, how many members of its group are set
    up already. The model's weights are then resident and not needed again, and the free memory read
    now is what the members before it left: their caches all stay alive until the group's rounds end."""
    whole = predicted_peak_bytes(point)  # the point's own peak counts the model (as its row's does)
    need = whole if beside is None else whole - analytic.weight_bytes(point.model, point.dtype)
    have = available_bytes(point.device)
    limit = point.memory_limit_bytes
    if limit is not None and limit < have:
        if whole <= limit:
            return None
        return f"does not fit in memory_limit_bytes={limit:,}: needs ~{whole / 2**20:,.1f} MiB (the memory model)"
    if need <= have:
        return None
    where = (f" beside the {beside} member(s) of its group set up before it (interleave=none measures it alone)"
             if beside else "")
    return f"does not fit in memory{where}: needs ~{need / GIB:.1f} GiB, {have / GIB:.1f} GiB available"
