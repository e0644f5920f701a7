"""A generated results folder for the analytic/report tests, independent of the runner.

`write_results(folder)` writes one Parquet file per row, as the runner does, with plausible measured
times (a multiple of the roofline prediction, so ratios are known), and the awkward cases a real folder
can hold: a skipped flash row, a failed row, a corrupt file, a foreign Parquet file, a stray text file.
"""
from __future__ import annotations

import socket
from pathlib import Path

import pandas as pd

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq

from harness.analysis import analytic
from harness.store.calibration import Calibration, save
from harness.config import CONTIGUOUS, CacheLayout, ModelConfig, Point, StrategyChoice, TimingConfig
from harness.run.row import build_row
from harness.store.files import row_filename, row_table, write_row
from strategies.caches.quantized import QuantizedStrategy

# The CPU default's shape (conf/model/cpu_small.yaml), written out so the fixture needs no config file.
SHAPE = ModelConfig(name="cpu_small", vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                    ffn_dim=1536, head_dim=64)
DTYPE = "float32"
CPU_ROOF = analytic.Roof(flops_per_s=0.23e12, bytes_per_s=19.6e9)  # an example: a 2-core CPU VM's calibrated roofs
DECODE_TOKENS = 8
SLOWDOWN = {"contiguous": 2.0, "no_cache": 1.5, "quantized": 2.0}  # measured / roofline, so tests know the ratio to expect


STRATEGY_CLASSES = {"no_cache": "strategies.caches.no_cache.NoCacheStrategy",
                    "contiguous": "strategies.caches.contiguous.ContiguousStrategy", "flash": "strategies.caches.flash.FlashStrategy",
                    "quantized": "strategies.caches.quantized.QuantizedStrategy"}
INT8 = QuantizedStrategy(format="int8").cache_layout(SHAPE)  # the layout the strategy declares for this shape
# How far the fixture's int8 cache moves the outputs (planted: the report sets them beside the speedup).
INT8_ACCURACY = {"top1_agreement": 0.97, "logit_kl_mean": 2.5e-4, "logit_max_abs_error": 0.031, "accuracy_steps": 8,
                 "accuracy_reference": "strategies.caches.contiguous.ContiguousStrategy:sdpa"}


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
        if not where.strategy.exact:  # scored after the point's own ctx, as the runner's pass records it
            measured.update(INT8_ACCURACY, accuracy_ctx=ctx)
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


# Cache variants swept in one group (strategy=contiguous,int8,kivi4,int4,fp8,paged32 on a checkpoint
# with a prompt file): each row names its variant in `strategy` and its class in `strategy_family`.
# Accuracy as measured on SmolLM2-135M over English prose (batch 4, ctx 512, 256 scored tokens); the
# step ratios to contiguous are planted, so a test knows what the report must print.
QUANTIZED_CLASS = STRATEGY_CLASSES["quantized"]


@dataclasses.dataclass(frozen=True)
class Variant:
    family: str  # the class's name (strategy_family)
    strategy_class: str  # its import path
    layout: CacheLayout  # how it stores K/V for SHAPE
    step_ratio: float  # its step time / contiguous's, every round (planted)
    accuracy: dict  # its accuracy columns; empty: exact


def _quantized(**options) -> CacheLayout:
    return QuantizedStrategy(**options).cache_layout(SHAPE)


def _accuracy(kl: float, p99: float, kl_max: float, top1: float, perplexity_ratio: float) -> dict:
    return {"logit_kl_mean": kl, "logit_kl_mean_ci_low": 0.9 * kl, "logit_kl_mean_ci_high": 1.1 * kl,
            "logit_kl_p99": p99, "logit_kl_max": kl_max, "top1_agreement": top1, "logit_max_abs_error": 10 * kl ** 0.5,
            "perplexity": 12.0 * perplexity_ratio, "perplexity_reference": 12.0, "perplexity_delta": 12.0 * (perplexity_ratio - 1),
            "perplexity_ratio": perplexity_ratio, "perplexity_ratio_ci_low": perplexity_ratio - 0.002 * perplexity_ratio,
            "perplexity_ratio_ci_high": perplexity_ratio + 0.002 * perplexity_ratio, "accuracy_tokens": 1024,
            "accuracy_steps": 256, "accuracy_ctx": 512, "accuracy_reference": f"{STRATEGY_CLASSES['contiguous']}:c"}


VARIANTS = {
    "contiguous": Variant("contiguous", STRATEGY_CLASSES["contiguous"], CONTIGUOUS, 1.0, {}),
    "paged32": Variant("paged", "strategies.caches.paged.PagedStrategy", CacheLayout(block_size=32), 1.03, {}),
    "int8": Variant("quantized", QUANTIZED_CLASS, _quantized(format="int8"), 0.96,
                    _accuracy(1.6e-3, 1.2e-2, 0.21, 0.985, 1.0003)),
    "fp8": Variant("quantized", QUANTIZED_CLASS, _quantized(format="fp8_e4m3"), 0.97,
                   _accuracy(4.9e-3, 3.1e-2, 0.44, 0.972, 1.0011)),
    "kivi4": Variant("quantized", QUANTIZED_CLASS, _quantized(format="int4", key_axis="channel", residual=32), 0.93,
                     _accuracy(0.026, 0.16, 1.9, 0.93, 1.038)),
    "int4": Variant("quantized", QUANTIZED_CLASS, _quantized(format="int4"), 0.91,
                    _accuracy(0.13, 0.81, 6.2, 0.83, 1.16)),
}
CHECKPOINT = "/models/SmolLM2-135M"  # a folder name only: no weights are read


def variant_row(name: str, batch: int, ctx: int, weights: str = "checkpoint") -> dict:
    """One variant's row of the group at (batch, ctx), every round `step_ratio` times contiguous's."""
    variant = VARIANTS[name]
    exact = not variant.accuracy
    choice = StrategyChoice(name=name, strategy_class=variant.strategy_class, backend="c", caches_kv=True, exact=exact,
                            layout=variant.layout)
    model = dataclasses.replace(SHAPE, checkpoint=CHECKPOINT if weights == "checkpoint" else None)
    where = Point(model=model, strategy=choice, timing=TimingConfig(), batch=batch, ctx=ctx, decode_tokens=DECODE_TOKENS,
                  device="cpu", dtype=DTYPE, seed=0, prefill="compute", traffic="model", matmul="aten", threads=2,
                  weights=weights, checkpoint_hash="c0ffee" if weights == "checkpoint" else None,
                  prompt="/data/prose.txt" if weights == "checkpoint" else None,
                  reference=None if exact else f"{STRATEGY_CLASSES['contiguous']}:c", interleave="shape")
    base = analytic.mean_decode_step(SHAPE, DTYPE, batch, ctx, DECODE_TOKENS, CONTIGUOUS, CPU_ROOF).seconds * 2.0
    rounds = [base * (1 + 0.01 * ((i * 7) % 5 - 2)) for i in range(32)]  # contiguous's, round by round
    times = [t * variant.step_ratio for t in rounds]
    reference = name == "contiguous"
    measured = {
        "status": "ok", "device_name": "Intel Xeon (fixture)", "kernel": "c", "matmul_kernel": "aten.linear",
        "prefill_s": 2.5 * analytic.prefill_time(SHAPE, DTYPE, batch, ctx, CPU_ROOF, variant.layout),
        "decode_step_s": sorted(times)[len(times) // 2], "decode_step_ci_low_s": min(times), "decode_step_ci_high_s": max(times),
        "decode_step_times_s": times, "decode_steps_timed": len(times), "rounds": len(times), "warmup_steps": 3,
        "tokens_per_s": batch / sorted(times)[len(times) // 2], "group_id": f"group-b{batch}-c{ctx}",
        "group_size": len(VARIANTS), "group_reference": "contiguous", "timing_method": "perf_counter",
        "ratio_to_reference": None if reference else variant.step_ratio,
        "ratio_ci_low": None if reference else variant.step_ratio - 0.01,
        "ratio_ci_high": None if reference else variant.step_ratio + 0.01,
        "kv_cache_bytes": round(analytic.kv_cache_bytes(SHAPE, DTYPE, batch, ctx + DECODE_TOKENS, variant.layout)),
        "tokens_digest": f"digest-b{batch}-c{ctx}" if exact else f"{name}-b{batch}-c{ctx}",
        **{k: v for k, v in variant.accuracy.items() if k in ("top1_agreement", "logit_kl_mean", "logit_max_abs_error",
                                                              "perplexity", "perplexity_reference", "perplexity_delta",
                                                              "accuracy_steps", "accuracy_reference")},
    }
    built = build_row(where, measured, roofs=None)
    built.update(roof_bandwidth_Bps=CPU_ROOF.bytes_per_s, roof_flops=CPU_ROOF.flops_per_s, noisy=False, noise_reason="")
    return {**built, "strategy_family": variant.family, **variant.accuracy}


def write_row_as_is(folder: Path, row: dict) -> Path:
    """A row written through the runner's schema, with the columns that schema lacks appended as they
    are (the variants' columns, in a checkout whose schema predates them)."""
    table = row_table(row)
    for name, value in row.items():
        if name not in table.column_names:
            table = table.append_column(name, pa.array([value]))
    path = Path(folder) / row_filename(row)
    pq.write_table(table, path)
    return path


NOISE_REASON = "faster than the calibrated roof allows: a roof calibrated on a busy machine"  # as the runner flags it


def write_variant_results(folder, weights: str = "checkpoint", batches=(1, 4), contexts=(256, 1024),
                          variants=tuple(VARIANTS), noisy=lambda name, batch, ctx: False) -> Path:
    """A results folder of the cache variants measured together at every batch x ctx; the rows for
    which `noisy(name, batch, ctx)` is true flagged noisy, as a run on a busy machine leaves them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in variants:
        for batch in batches:
            for ctx in contexts:
                row = variant_row(name, batch, ctx, weights)
                if noisy(name, batch, ctx):
                    row.update(noisy=True, noise_reason=NOISE_REASON)
                write_row_as_is(folder, row)
    write_calibration(folder)
    return folder
