"""A generated results folder for the analytic/report tests, independent of the runner.

`write_results(folder)` writes one Parquet file per row, as the runner does, with plausible measured
times (a multiple of the roofline prediction, so ratios are known), and the awkward cases a real folder
can hold: a skipped flash row, a failed row, a corrupt file, a foreign Parquet file, a stray text file.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from harness import analytic
from harness.config import ModelConfig

# The CPU default's shape (conf/model/cpu_small.yaml), written out so the fixture needs no config file.
SHAPE = ModelConfig(name="cpu_small", vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                    ffn_dim=1536, head_dim=64)
DTYPE = "float32"
CPU_ROOF = analytic.Roof(flops_per_s=0.23e12, bytes_per_s=19.6e9)  # GUIDE section 3's measured CPU figures
DECODE_TOKENS = 8
SLOWDOWN = {"contiguous": 2.0, "no_cache": 1.5}  # measured / roofline, so tests know the ratio to expect


def row(strategy: str, batch: int, ctx: int, status: str = "ok", reason: str = "") -> dict:
    """One row with every column the runner writes; measured columns null unless status is ok."""
    cached = strategy != "no_cache"
    roofline_step = analytic.generate_time(SHAPE, DTYPE, batch, ctx, DECODE_TOKENS, CPU_ROOF, cached) / DECODE_TOKENS
    step_s = roofline_step * SLOWDOWN.get(strategy, 1.0)
    ok = status == "ok"
    bytes_model = sum(
        analytic.decode_step_bytes(SHAPE, DTYPE, batch, ctx + i, cached)["total"] for i in range(DECODE_TOKENS)
    ) // DECODE_TOKENS
    flops_model = analytic.generate_flops(SHAPE, batch, ctx, DECODE_TOKENS, cached) / DECODE_TOKENS
    cache_bytes = analytic.kv_cache_bytes(SHAPE, DTYPE, batch, ctx + DECODE_TOKENS) if cached else 0
    measured = lambda value: value if ok else None  # noqa: E731: skipped/failed rows carry nulls
    return {
        "strategy": strategy, "kernel": "grouped_sdpa" if ok else None, "model": SHAPE.name,
        "vocab_size": SHAPE.vocab_size, "d_model": SHAPE.d_model, "n_layers": SHAPE.n_layers,
        "n_heads": SHAPE.n_heads, "n_kv_heads": SHAPE.n_kv_heads, "head_dim": SHAPE.head_dim,
        "ffn_dim": SHAPE.ffn_dim, "dtype": DTYPE, "device": "cpu", "device_name": "Intel Xeon (fixture)",
        "threads": 2, "batch": batch, "ctx": ctx, "decode_tokens": DECODE_TOKENS, "prefill_mode": "compute",
        "status": status, "reason": reason,
        "prefill_s": measured(2.5 * analytic.prefill_time(SHAPE, DTYPE, batch, ctx, CPU_ROOF, cached)),
        "decode_step_s": measured(step_s), "decode_step_p10_s": measured(0.95 * step_s),
        "decode_step_p90_s": measured(1.1 * step_s), "decode_steps_timed": measured(DECODE_TOKENS),
        "warmup_steps": measured(3), "tokens_per_s": measured(batch / step_s),
        "kv_cache_bytes": measured(cache_bytes), "weight_bytes": analytic.weight_bytes(SHAPE, DTYPE),
        "peak_memory_bytes": measured(cache_bytes + 50_000_000),
        "bytes_per_step_model": bytes_model, "bytes_per_step_measured": None, "traffic_source": "model",
        "flops_per_step_model": flops_model, "roof_bandwidth_Bps": None, "roof_flops": None,
        "bandwidth_fraction": measured(bytes_model / step_s / CPU_ROOF.bytes_per_s),
        "flops_fraction": measured(flops_model / step_s / CPU_ROOF.flops_per_s),
        "roof_bound": analytic.bound(flops_model, bytes_model, CPU_ROOF),
        "roofline_fraction": measured(analytic.roofline_time(flops_model, bytes_model, CPU_ROOF) / step_s),
        "tokens_digest": measured(f"digest-b{batch}-c{ctx}"),
        "timestamp": "2025-01-01T00:00:00+00:00", "torch_version": "2.13.0+cpu", "git_commit": "fixture",
        "seed": 0, "config_json": json.dumps({"strategy": strategy, "batch": batch, "ctx": ctx}),
        "point_key": f"{strategy}-{batch}-{ctx}",
    }


def write_calibration(folder: Path) -> Path:
    """The record the runner writes for the CPU roofs (format of issue 4)."""
    path = Path(folder) / "_calibration" / f"cpu__{DTYPE}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "device": "cpu", "device_name": "Intel Xeon (fixture)", "dtype": DTYPE,
        "read_bandwidth_Bps": CPU_ROOF.bytes_per_s, "matmul_flops": CPU_ROOF.flops_per_s,
        "timestamp": "2025-01-01T00:00:00+00:00", "method": "fixture",
    }))
    return path


def write_results(folder, calibration: bool = True, awkward: bool = True,
                  batches=(1, 4, 16), contexts=(64, 256, 1024), row_roofs: bool = False) -> Path:
    """A results folder: no_cache and contiguous at every batch x ctx, plus the awkward cases.
    row_roofs: record the CPU roofs in each row, as the runner does once it has calibrated."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [row(s, b, c) for s in ("no_cache", "contiguous") for b in batches for c in contexts]
    if awkward:
        rows.append(row("flash", 1, 64, "skipped", "flash needs CUDA and float16/bfloat16; this point is cpu float32"))
        rows.append(row("contiguous", 64, 4096, "failed", "RuntimeError: out of memory allocating the cache"))
    for r in rows:
        if row_roofs:
            r.update(roof_bandwidth_Bps=CPU_ROOF.bytes_per_s, roof_flops=CPU_ROOF.flops_per_s)
        pd.DataFrame([r]).to_parquet(folder / f"{r['point_key']}.parquet", index=False)
    if awkward:
        (folder / "corrupt.parquet").write_bytes(b"PAR1 this is not a parquet file")
        pd.DataFrame({"x": [1, 2]}).to_parquet(folder / "foreign.parquet", index=False)
        (folder / "notes.txt").write_text("a stray file")
    if calibration:
        write_calibration(folder)
    return folder
