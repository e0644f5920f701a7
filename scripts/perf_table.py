"""Print the before/after table of docs/performance.md from a results folder of scripts/perf_grid.sh.

Usage: python scripts/perf_table.py results/perf_grid
"""
import sys

import pandas as pd

rows = pd.read_parquet(sys.argv[1])
rows = rows[rows.status == "ok"]
roof = rows.iloc[0]
print(f"Roofs (calibrated in the same run): read {roof.roof_bandwidth_Bps / 1e9:.1f} GB/s, "
      f"matmul {roof.roof_flops / 1e9:.0f} GFLOP/s, on {roof.device_name}\n")
print("| strategy | batch | ctx | step before (aten) | step after (oneDNN) | bandwidth fraction before -> after "
      "| FLOP fraction before -> after | bytes/step | FLOP/step | intensity (FLOP/B) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (strategy, batch, ctx), group in rows.groupby(["strategy", "batch", "ctx"]):
    by_kernel = {r.matmul_kernel.split(".")[0]: r for r in group.itertuples()}
    before, after = by_kernel.get("aten"), by_kernel.get("onednn")
    any_row = before or after

    def cell(row, column, fmt):
        return format(getattr(row, column), fmt) if row is not None else "not run"

    print(f"| {strategy} | {batch} | {ctx} | {cell(before, 'decode_step_s', '.3f')} s | "
          f"{cell(after, 'decode_step_s', '.3f')} s | {cell(before, 'bandwidth_fraction', '.2f')} -> "
          f"{cell(after, 'bandwidth_fraction', '.2f')} | {cell(before, 'flops_fraction', '.2f')} -> "
          f"{cell(after, 'flops_fraction', '.2f')} | {any_row.bytes_per_step_model / 1e9:.2f} GB | "
          f"{any_row.flops_per_step_model / 1e9:.1f} G | {any_row.flops_per_step_model / any_row.bytes_per_step_model:.1f} |")
