"""The benchmark suite's points, models, controls and the one helper that times a benchmark
(`pytest -m benchmark`; see harness.bench.gate). Everything is timed by harness.measure.rounds, the
runner's own engine; pytest-benchmark only receives its times, computes its statistics and writes
--benchmark-json.

Two small points, each a decode step a 2-core CPU times in milliseconds:
- light: a weight-dominated step (batch 1, 128 cached tokens: the cache is <1% of the bytes);
- heavy: a cache-dominated step (batch 16, 2048 cached tokens: the cache is ~8x the weights read),
  filled with random K/V (session.fill_random) so no prompt runs. no_cache runs at the light point
  only: at the heavy point one recompute step would be ~2 TFLOP.
Both move more bytes than a CPU's L3 (tens of MiB; about 100 MiB on the largest server parts).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import yaml

from harness.analysis import analytic
from harness.config import ModelConfig
from harness.config.paths import config_dir
from harness.measure.contention import CpuTimes, others_fraction
from harness.measure.rounds import Rounds, RoundsOptions, Step, time_rounds
from harness.model.cpu_linear import resolve_matmul
from harness.model import build_model
from strategies.caches.contiguous import ContiguousStrategy

DTYPE = torch.float32  # the honest CPU default (bf16 GEMV is slow on CPUs without AVX-512 bf16)
SEED = 0

# Weights ~82 MB (decode reads ~65 MB); GQA group of 4 as in Llama 3.
LIGHT_MODEL = ModelConfig(name="bench_light", vocab_size=8192, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2,
                          ffn_dim=1536)
# Weights ~21 MB, 4 KiB of K/V per token: 16 x 2048 tokens are 134 MB of cache.
HEAVY_MODEL = ModelConfig(name="bench_heavy", vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                          ffn_dim=768)


@dataclass(frozen=True)
class BenchPoint:
    name: str  # benchmark id part: light | heavy
    shape: ModelConfig
    batch: int
    ctx: int  # cached tokens before the timed step
    prefill: str  # compute: run the prompt; random: fill the cache with random K/V (caching strategies only)


POINTS = {
    "light": BenchPoint("light", LIGHT_MODEL, batch=1, ctx=128, prefill="compute"),
    "heavy": BenchPoint("heavy", HEAVY_MODEL, batch=16, ctx=2048, prefill="random"),
}
PREFILL = (LIGHT_MODEL, 1, 256)  # shape, batch, prompt tokens of the prefill benchmark


def filled_session(strategy, model, batch: int, ctx: int, room: int):
    """A session of `strategy` on `model` holding `ctx` tokens of seeded random K/V per sequence (a step's
    time does not depend on the values), with `room` tokens more to step into, and the [B] token its
    steps decode: what every timed comparison of caches at a point starts from."""
    session = strategy.new_session(model, batch, ctx + room)
    generator = torch.Generator().manual_seed(SEED)
    session.fill_random(ctx, generator)
    return session, torch.randint(model.cfg.vocab_size, (batch,), generator=generator)  # [B]


def smollm2_shape() -> ModelConfig:
    """SmolLM2-135M's shape as conf/model/ states it, without its checkpoint (random weights, same bytes)."""
    fields = yaml.safe_load((config_dir() / "model" / "smollm2_135m.yaml").read_text())
    return dataclasses.replace(ModelConfig(**fields), checkpoint=None)


# The linear layers' kernel a harness run uses here by default at the suite's largest batch (matmul=auto:
# the C small-batch linear in fp32 where it builds, else oneDNN-packed weights where supported, else
# aten): the suite times the path users run.
MATMUL = resolve_matmul("auto", "cpu", str(DTYPE).removeprefix("torch."), max(p.batch for p in POINTS.values()))


@pytest.fixture(scope="session")
def model_for():
    """Build each shape's model once per session and batch (seeded, fp32, CPU, linears as MATMUL, packed
    for that batch as the runner does)."""
    built = {}

    def get(shape: ModelConfig, batch: int):
        if (shape.name, batch) not in built:
            built[shape.name, batch] = build_model(shape, torch.device("cpu"), DTYPE, SEED, MATMUL, batch_hint=batch)
        return built[shape.name, batch]

    return get


class MemoryControl:
    """The control: one row vector through 64 fixed 1024x1024 fp32 matrices (256 MiB, beyond a CPU's
    L3), i.e. the weight reads of a batch-1 decode step without the model. Memory bound and made of
    many short parallel regions, like the cached decode steps, so machine noise hits it as it hits
    them; and it uses no project code, so no change to the harness can move it."""

    kind = "memory"

    def __init__(self, n: int = 1024, matrices: int = 64):
        generator = torch.Generator().manual_seed(SEED)
        self.matrices = [torch.randn(n, n, generator=generator) for _ in range(matrices)]  # each [n, n]
        self.row = torch.randn(1, n, generator=generator)  # [1, n]
        self.nbytes = sum(m.nbytes for m in self.matrices)
        self.flops = 2 * matrices * n * n
        self.name = f"{matrices} fp32 GEMV {n}^2"

    def __call__(self) -> None:
        for matrix in self.matrices:
            F.linear(self.row, matrix)


class ComputeControl:
    """The compute-bound counterpart: an fp32 1024^3 GEMM (2.1 GFLOP on 12 MiB). Compute-bound steps
    (no_cache's recompute, the prefill) are slowed by what slows arithmetic (a busy SMT sibling on the
    host, a lower clock) more than by what slows memory, which can shift them within a run while the
    memory control does not move."""

    kind = "compute"

    def __init__(self, n: int = 1024):
        generator = torch.Generator().manual_seed(SEED)
        self.a = torch.randn(n, n, generator=generator)  # [n, n]
        self.b = torch.randn(n, n, generator=generator)  # [n, n]
        self.nbytes = 3 * self.a.nbytes
        self.flops = 2 * n**3
        self.name = f"fp32 GEMM {n}^3"

    def __call__(self) -> None:
        torch.mm(self.a, self.b)


# FLOPs per byte above which a benchmark is interleaved with the compute control: about the fp32 ridge
# of a small server CPU (for example tests/report_fixtures.py's CPU_ROOF: 0.23 TFLOP/s over 19.6 GB/s,
# ~12). The suite's benchmarks sit far from it on either side (cached steps ~0.5-1.5, no_cache and
# prefill ~50-100), so the choice never flips.
CONTROL_RIDGE = 12.0


@pytest.fixture(scope="session")
def controls() -> dict:
    return {"memory": MemoryControl(), "compute": ComputeControl()}


def control_for(controls: dict, flops: float, bytes_moved: float):
    return controls["compute" if flops / bytes_moved > CONTROL_RIDGE else "memory"]


ROUNDS = 5  # rounds in a pass; passes repeat while one more fits a benchmark's budget
MAX_PASSES = 12
WARMUP = 3  # untimed calls of the benchmark and its control first: allocator, caches, lazy set-up


def time_benchmark(benchmark, target, before=None, control=None, budget_s: float = 2.0) -> tuple[Rounds, object]:
    """Time `target` (harness.measure.rounds) in passes of ROUNDS rounds while one more fits `budget_s`,
    and hand its times to pytest-benchmark; returns the rounds and what the last timed call returned.
    `before` runs before every call, outside the timed region (the decode benchmarks rewind the
    session there).

    With `control`, every round times the control kernel right before the benchmark (the listed
    order: the L3 is left in the same, cold, state before every call of the benchmark), so the gate
    divides by a control measured at the same moments as the benchmark, not a minute earlier
    (contention on a shared machine comes and goes within a run): extra_info control_median_s, and
    control_ratio with its interval, the median over rounds of the benchmark's time over the
    control's in the same round (the paired ratio a group of the runner records against its
    reference). extra_info others_cpu_fraction: the share of the cores other processes took meanwhile.
    """
    steps = {"control": control} if control is not None else {}
    last = {}
    steps["benchmark"] = Step(target, before=before, after=lambda output: last.update(output=output))
    options = RoundsOptions(rounds=ROUNDS, max_passes=MAX_PASSES, budget_s=budget_s, warmup=WARMUP, order="listed",
                            reference="control" if control is not None else None)
    rounds = time_rounds(steps, options)
    record_times(benchmark, rounds.seconds["benchmark"])
    info = benchmark.extra_info
    info.update(threads=torch.get_num_threads(), others_cpu_fraction=rounds.contention, timing_method=rounds.method)
    if control is not None:
        ratio = rounds.ratio("benchmark")
        info.update(control_median_s=rounds.median("control").median, control_kernel=control.name,
                    control_ratio=ratio.median, control_ratio_ci=[ratio.low, ratio.high])
    return rounds, last["output"]


def record_times(benchmark, seconds: list[float]) -> None:
    """Give pytest-benchmark the engine's times as the benchmark's rounds: it computes the statistics,
    prints the table and writes --benchmark-json from them. It has no public way to take times measured
    elsewhere, so this is the one place the suite reaches into it (the statistics object its own loop
    would fill, and the mark that the fixture was used)."""
    if benchmark.disabled:
        return
    benchmark._mode = "harness.measure.rounds"
    stats = benchmark._make_stats(1)  # one call per round
    for one in seconds:
        stats.update(one)


@pytest.fixture(scope="session")
def same_run_roofs(controls) -> analytic.Roof:
    """This run's roofs, for each benchmark's analytic prediction: the memory control's read rate and
    the compute control's FLOP rate, timed together in rounds (a fixture, so no benchmark depends on
    another having run first)."""
    memory, compute = controls["memory"], controls["compute"]
    rounds = time_rounds({"memory": memory, "compute": compute}, RoundsOptions(rounds=ROUNDS, warmup=1))
    return analytic.Roof(flops_per_s=compute.flops / rounds.median("compute").median,
                         bytes_per_s=memory.nbytes / rounds.median("memory").median)


def cpu_seconds() -> CpuTimes:
    """Wall clock, CPU seconds all processes spent busy (steal included), CPU seconds of this process."""
    return CpuTimes.now()


AT_START = cpu_seconds()


def pytest_benchmark_update_machine_info(config, machine_info):
    """How much of the CPUs other processes (and the hypervisor, as steal) took during the run. The
    benchmarks' threads are spread over every core, so any other busy process slows them unevenly: a
    thread descheduled in the middle of a parallel region stalls the others. The gate calls a run
    where others took more than a few percent inconclusive (docs/performance.md)."""
    end = cpu_seconds()
    machine_info["cpu_contention"] = {
        "others_fraction": others_fraction(AT_START, end),  # share of all cores' time others took
        "wall_s": end.wall - AT_START.wall, "cores": os.cpu_count(), "loadavg_1min_end": os.getloadavg()[0],
    }
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["harness_matmul"] = MATMUL
    # contiguous's attention kernel here: the C kernel where it builds, SDPA otherwise (far apart at the
    # heavy point), so a baseline of one is no yardstick for the other.
    machine_info["harness_attention"] = ContiguousStrategy().kernel(torch.device("cpu"), DTYPE, HEAVY_MODEL)
