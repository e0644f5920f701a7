"""How much of the machine others took while a point was timed, and when a row's numbers are noise.

On a shared machine with as many threads as cores, one other busy process can make a decode step many
times slower: a point's OpenMP threads wait at every barrier for the one the other process displaced. So every point reads
/proc/stat (all processes' busy time, steal included) and its own CPU time around its timed steps:
`contention` is the share of all cores' time that others took. On CUDA, NVML (nvidia-ml-py, where
installed) adds the other processes on the point's GPU, its SM clock and its throttle reasons.

A row is `noisy` when contention exceeds CONTENTION_LIMIT, when its steps spread too far (p90 above
SPREAD_LIMIT x p10, and by more than SPREAD_FLOOR_S: a sub-millisecond step's spread at the scale of
the timer and the OS's own jitter is no sign of a busy machine), or when a roofline fraction exceeds ROOF_LIMIT (a step faster than the roof says
the roof was underestimated, e.g. calibrated while the machine was busy). The report leaves noisy rows
out of its fits and ratios; the progress line warns.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

# An idle VM shows a few percent of others (the hypervisor's steal included); one busy process on a
# second core of two shows about half. 10% leaves an idle machine's jitter clean and flags anything
# that competes for a core.
CONTENTION_LIMIT = 0.10
# /proc/stat counts in clock ticks (10 ms): over a few milliseconds of steps it reads 0 whatever runs
# beside them. A window this long resolves a few percent of two cores.
MIN_WINDOW_S = 0.25
SPREAD_LIMIT = 2.0  # p90 / p10 of the timed steps: a settled point's steps agree within tens of percent
# Below this gap between p90 and p10 a spread is not judged: on an idle 2-core EPYC VM the tiny model's
# clean steps (0.13-0.8 ms) spread by 0.46-0.65 ms, p90 over 2x p10, with nothing else running; a
# preemption or timer tick costs that much whatever the step. Twice that is kept as margin; a loaded
# machine's spreads run to many milliseconds, and its contention is flagged on its own.
SPREAD_FLOOR_S = 1e-3
ROOF_LIMIT = 1.05  # a roofline fraction above this: the roof, not the step, is wrong


@dataclass(frozen=True)
class CpuTimes:
    wall: float  # monotonic seconds
    busy: float  # CPU seconds all processes spent busy (user, nice, system, irq, softirq, steal)
    mine: float  # CPU seconds of this process (all its threads)

    @classmethod
    def now(cls) -> "CpuTimes":
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        busy = sum(ticks) - ticks[3] - ticks[4]
        mine = os.times()
        return cls(time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), mine.user + mine.system)


def others_cores(start: CpuTimes, end: CpuTimes) -> float:
    """Cores' worth of time between two readings that processes other than this one took (0 to the
    core count; steal included: a hypervisor's other guests are others too)."""
    wall = end.wall - start.wall
    if wall <= 0:
        return 0.0
    return max(0.0, (end.busy - start.busy) - (end.mine - start.mine)) / wall


def others_fraction(start: CpuTimes, end: CpuTimes) -> float:
    """Share of all cores' time between two readings that processes other than this one took."""
    return others_cores(start, end) / os.cpu_count()


def others_fraction_since(start: CpuTimes) -> float:
    """others_fraction from `start` to now, the window padded to MIN_WINDOW_S by waiting (idle, so the
    wait adds nothing of this process's own): a point of a few short steps still reads the machine."""
    left = MIN_WINDOW_S - (time.monotonic() - start.wall)
    if left > 0:
        time.sleep(left)
    return others_fraction(start, CpuTimes.now())


def gpu_state(device_index: int = 0) -> dict:
    """Other processes on the GPU, its SM clock and throttle reasons, from NVML; {} without nvidia-ml-py."""
    try:
        import pynvml  # optional: the gpu extra (nvidia-ml-py)
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        mine = os.getpid()
        others = [p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid != mine]
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        names = [name.removeprefix("nvmlClocksThrottleReason") for name in dir(pynvml)
                 if name.startswith("nvmlClocksThrottleReason") and name not in ("nvmlClocksThrottleReasonNone",
                                                                                "nvmlClocksThrottleReasonAll")
                 and reasons & getattr(pynvml, name)]
        return {"gpu_other_processes": len(others),
                "gpu_sm_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                "gpu_throttle_reasons": ",".join(sorted(names)) or "none"}
    except pynvml.NVMLError:
        return {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a library that failed to start
            pass


def noise_reasons(contention, p10, p90, fractions) -> list[str]:
    """Why a row's numbers cannot be trusted (empty: they can)."""
    reasons = []
    if contention is not None and contention > CONTENTION_LIMIT:
        reasons.append(f"other processes took {contention:.0%} of the CPUs while it was timed (limit {CONTENTION_LIMIT:.0%})")
    if p10 and p90 and p90 > SPREAD_LIMIT * p10 and p90 - p10 > SPREAD_FLOOR_S:
        reasons.append(f"its steps spread from {p10 * 1e3:.3g} to {p90 * 1e3:.3g} ms (p90 over {SPREAD_LIMIT:g}x p10, "
                       f"by over {SPREAD_FLOOR_S * 1e3:g} ms)")
    for name, value in fractions.items():
        if value is not None and value > ROOF_LIMIT:
            reasons.append(f"{name} {value:.2f} exceeds {ROOF_LIMIT}: the roof was underestimated (calibrate=true)")
    return reasons
