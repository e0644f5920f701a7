"""How close the default model's cached step comes to its roofline, eager and compiled, measured in one
run: the calibration kernels and the steps in the same process (docs/performance.md, 'Where a
cpu_small step goes').

cpu_small contiguous at batch 1 and 4, 256 and 1024 cached tokens (random K/V), its step eager and
through torch.compile (compile=inductor, harness.measure.compiled), timed in interleaved rounds. Targets:
roofline time / step time >= 0.6 eager and >= 0.8 compiled, at the read roof and matmul rate calibrated
here (harness.measure.roofs). The tiny model's step, which is all overhead, is printed with them.
Run: `python -m pytest -m target tests/benchmarks/test_overhead_targets.py -s` (prints the table).
"""
from __future__ import annotations

import functools
import shutil

import pytest
import torch

from harness.analysis import analytic
from harness.config import ModelConfig
from harness.config.paths import config_dir
from harness.measure.compiled import CompiledSteps
from harness.measure.roofs import measure_within
from harness.measure.timing import StepTimer
from strategies.contiguous import ContiguousStrategy
from tests.benchmarks.conftest import DTYPE, MATMUL, SEED, interleaved_medians

pytestmark = [pytest.mark.target,  # opt-in (`pytest -m target`): not met on every CPU (docs/performance.md)
              pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler")]
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
TARGETS = {"eager": 0.6, "inductor": 0.8}  # roofline fraction each mode must reach
ROUNDS = 20
CALIBRATION_BUDGET_S = 40.0


def preset(name: str) -> ModelConfig:
    import yaml

    return ModelConfig(**yaml.safe_load((config_dir() / "model" / f"{name}.yaml").read_text()))


@functools.cache
def roof() -> analytic.Roof:
    calibration = measure_within(("cpu", DTYPE_NAME, CALIBRATION_BUDGET_S))
    return analytic.Roof(flops_per_s=calibration.matmul_flops, bytes_per_s=calibration.read_bandwidth_Bps)


def step_medians(shape: ModelConfig, batch: int, ctx: int) -> tuple[dict, float, float]:
    """Median seconds of one step per mode at `ctx` cached tokens, the others' CPU share meanwhile, and
    the compilation's seconds. Each step is rewound, so every timed step runs at position ctx."""
    from harness.model import build_model

    with torch.inference_mode():
        model = build_model(shape, torch.device("cpu"), DTYPE, SEED, MATMUL, batch_hint=batch)
        session = ContiguousStrategy().new_session(model, batch, ctx + 2)
        session.fill_random(ctx, torch.Generator().manual_seed(SEED))
        token = torch.zeros(batch, dtype=torch.int64)
        compiled = CompiledSteps(session, token, torch.device("cpu"), StepTimer(torch.device("cpu")).time)

        def run(step):
            def one():
                step(token)
                session.rewind(ctx)
            return one

        medians, others = interleaved_medians({"eager": run(session.step), "inductor": run(compiled.step)}, ROUNDS)
        assert compiled.recompiles_since() == 0
    return medians, others, compiled.compile_s


POINTS = [(batch, ctx) for batch in (1, 4) for ctx in (256, 1024)]


@pytest.mark.parametrize("batch,ctx", POINTS, ids=[f"b{b}-ctx{c}" for b, c in POINTS])
def test_cpu_small_reaches_its_roofline_share(batch, ctx):
    shape = preset("cpu_small")
    step = analytic.mean_decode_step(shape, DTYPE_NAME, batch, ctx, 1)
    roofline_s = analytic.roofline_time(step.flops, step.bytes, roof())
    medians, others, compile_s = step_medians(shape, batch, ctx)
    fractions = {mode: roofline_s / seconds for mode, seconds in medians.items()}
    tiny, _, _ = step_medians(preset("tiny"), batch, ctx)
    print(f"\ncpu_small b={batch} ctx={ctx}: roofline {roofline_s * 1e3:.2f} ms at {roof().bytes_per_s / 1e9:.1f} GB/s; "
          + ", ".join(f"{m} {medians[m] * 1e3:.2f} ms ({fractions[m]:.2f})" for m in medians)
          + f"; compile {compile_s:.1f} s; others {others:.0%}; tiny step "
          + ", ".join(f"{m} {tiny[m] * 1e3:.3f} ms" for m in tiny))
    missed = [f"{m} {fractions[m]:.2f} < {TARGETS[m]}" for m in TARGETS if fractions[m] < TARGETS[m]]
    assert not missed, f"roofline fraction at b={batch} ctx={ctx}: {'; '.join(missed)} (others took {others:.0%})"
