"""A generated results folder for the analytic/report tests, independent of the runner.

`write_results(folder)` writes one Parquet file per row, as the runner does, with plausible measured
times (a multiple of the roofline prediction, so ratios are known), and the awkward cases a real folder
can hold: a skipped flash row, a failed row, a corrupt file, a foreign Parquet file, a stray text file.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pandas as pd

from harness.analysis import analytic
from harness.store.calibration import Calibration, save
from harness.config import CONTIGUOUS, ModelConfig, Point, StrategyChoice, TimingConfig
from harness.run.row import build_row
from harness.store.files import write_row
from strategies.quantized import QuantizedStrategy

# The CPU default's shape (conf/model/cpu_small.yaml), written out so the fixture needs no config file.
SHAPE = ModelConfig(name="cpu_small", vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                    ffn_dim=1536, head_dim=64)
DTYPE = "float32"
CPU_ROOF = analytic.Roof(flops_per_s=0.23e12, bytes_per_s=19.6e9)  # an example: a 2-core CPU VM's calibrated roofs
DECODE_TOKENS = 8
SLOWDOWN = {"contiguous": 2.0, "no_cache": 1.5, "quantized": 2.0}  # measured / roofline, so tests know the ratio to expect


STRATEGY_CLASSES = {"no_cache": "strategies.no_cache.NoCacheStrategy",
                    "contiguous": "strategies.contiguous.ContiguousStrategy", "flash": "strategies.flash.FlashStrategy",
                    "quantized": "strategies.quantized.QuantizedStrategy"}
INT8 = QuantizedStrategy(format="int8").cache_layout(SHAPE)  # the layout the strategy declares for this shape
# How far the fixture's int8 cache moves the outputs (planted: the report sets them beside the speedup).
INT8_ACCURACY = {"top1_agreement": 0.97, "logit_kl_mean": 2.5e-4, "logit_max_abs_error": 0.031, "accuracy_steps": 8,
                 "accuracy_reference": "strategies.contiguous.ContiguousStrategy:sdpa"}


def point(strategy: str, batch: int, ctx: int) -> Point:
    caches_kv = strategy != "no_cache"  # the fixture's own names; the report reads the capability columns
    layout = (INT8 if strategy == "quantized" else CONTIGUOUS) if caches_kv else None
    choice = StrategyChoice(name=strategy, strategy_class=STRATEGY_CLASSES[strategy], backend="sdpa",
                            caches_kv=caches_kv, exact=strategy != "quantized", layout=layout)
    return Point(model=SHAPE, strategy=choice, timing=TimingConfig(), batch=batch, ctx=ctx, decode_tokens=DECODE_TOKENS,
                 device="cpu", dtype=DTYPE, seed=0, prefill="compute", traffic="model", matmul="aten", threads=2)


def row(strategy: str, batch: int, ctx: int, status: str = "ok", reason: str = "") -> dict:
    """One row as the runner assembles it (harness.run.row.build_row), from a made-up measurement that
    is SLOWDOWN times the roofline; measured columns null unless status is ok."""
    where = point(strategy, batch, ctx)
    layout = where.strategy.layout
    step = analytic.mean_decode_step(SHAPE, DTYPE, batch, ctx, DECODE_TOKENS, layout, CPU_ROOF)
    step_s = step.seconds * SLOWDOWN.get(strategy, 1.0)
    cache_bytes = round(analytic.kv_cache_bytes(SHAPE, DTYPE, batch, ctx + DECODE_TOKENS, layout))
    measured = {"status": status, "reason": reason, "device_name": "Intel Xeon (fixture)"}
    if status == "ok":
        measured.update(
            kernel="grouped_sdpa", matmul_kernel="aten.linear",
            prefill_s=2.5 * analytic.prefill_time(SHAPE, DTYPE, batch, ctx, CPU_ROOF, layout),
            decode_step_s=step_s, decode_step_p10_s=0.95 * step_s, decode_step_p90_s=1.1 * step_s,
            decode_steps_timed=DECODE_TOKENS, warmup_steps=3, tokens_per_s=batch / step_s,
            kv_cache_bytes=cache_bytes, peak_memory_bytes=cache_bytes + 50_000_000,
            tokens_digest=f"digest-b{batch}-c{ctx}", timing_method="perf_counter",
        )
        if not where.strategy.exact:
            measured.update(INT8_ACCURACY)
    built = build_row(where, measured, roofs=None)
    built["point_key"] = f"{strategy}-{batch}-{ctx}"
    return built


def write_calibration(folder: Path) -> Path:
    """The record the runner writes for the CPU roofs, through the writer the runner uses."""
    record = Calibration(
        device="cpu", device_name="Intel Xeon (fixture)", hostname=socket.gethostname(), dtype=DTYPE,
        read_bandwidth_Bps=CPU_ROOF.bytes_per_s, read_bandwidth_sum_Bps=CPU_ROOF.bytes_per_s,
        read_bandwidth_gemv_Bps=CPU_ROOF.bytes_per_s, read_bandwidth_packed_gemv_Bps=None,
        matmul_flops=CPU_ROOF.flops_per_s, timestamp="2025-01-01T00:00:00+00:00", method="fixture",
    )
    return save(folder, record)


def write_results(folder, calibration: bool = True, awkward: bool = True,
                  batches=(1, 4, 16), contexts=(64, 256, 1024), row_roofs: bool = False,
                  quantized: bool = False) -> Path:
    """A results folder: no_cache and contiguous at every batch x ctx, plus the awkward cases.
    row_roofs: record the CPU roofs in each row, as the runner does once it has calibrated.
    quantized: an int8 cache at every point too, with planted accuracy columns."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    strategies = ("no_cache", "contiguous", "quantized") if quantized else ("no_cache", "contiguous")
    rows = [row(s, b, c) for s in strategies for b in batches for c in contexts]
    if awkward:
        rows.append(row("flash", 1, 64, "skipped", "flash needs CUDA and float16/bfloat16; this point is cpu float32"))
        rows.append(row("contiguous", 64, 4096, "failed", "RuntimeError: out of memory allocating the cache"))
    for r in rows:
        if row_roofs:
            r.update(roof_bandwidth_Bps=CPU_ROOF.bytes_per_s, roof_flops=CPU_ROOF.flops_per_s)
        write_row(folder, r)
    if awkward:
        (folder / "corrupt.parquet").write_bytes(b"PAR1 this is not a parquet file")
        pd.DataFrame({"x": [1, 2]}).to_parquet(folder / "foreign.parquet", index=False)
        (folder / "notes.txt").write_text("a stray file")
    if calibration:
        write_calibration(folder)
    return folder
