"""Print a before/after table of docs/performance.md from a results folder of scripts/perf_grid.sh.

Usage: python scripts/perf_table.py results/perf_grid [matmul|attention]
  matmul:    linear layers through aten (before) vs oneDNN-packed (after), attention through SDPA
  attention: attention through SDPA (before) vs the C decode kernel (after), linears oneDNN-packed
"""
import sys

import pandas as pd

rows = pd.read_parquet(sys.argv[1])
compare = sys.argv[2] if len(sys.argv) > 2 else "matmul"
rows = rows[rows.status == "ok"]
kernel_of = {  # compare -> (label of a row's variant, labels before/after, rows taking part)
    "matmul": (lambda r: r.matmul, ("aten", "onednn"), rows.backend != "c"),
    "attention": (lambda r: r.backend, ("sdpa", "c"), rows.matmul == "onednn"),
}
variant, (first, second), taking_part = kernel_of[compare]
rows = rows[taking_part]
roof = rows.iloc[0]
print(f"Roofs (calibrated in the same run): read {roof.roof_bandwidth_Bps / 1e9:.1f} GB/s, "
      f"matmul {roof.roof_flops / 1e9:.0f} GFLOP/s, on {roof.device_name}\n")
print(f"| strategy | batch | ctx | step before ({first}) | step after ({second}) | bandwidth fraction before -> after "
      "| FLOP fraction before -> after | roofline fraction after (bound) | bytes/step | FLOP/step | intensity (FLOP/B) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for (strategy, batch, ctx), group in rows.groupby(["strategy", "batch", "ctx"]):
    by_variant = {variant(r): r for r in group.itertuples()}
    before, after = by_variant.get(first), by_variant.get(second)
    any_row = before or after

    def cell(row, column, fmt):
        return format(getattr(row, column), fmt) if row is not None else "not run"

    bound = f"{cell(after, 'roofline_fraction', '.2f')} ({after.roof_bound})" if after is not None else "not run"
    print(f"| {strategy} | {batch} | {ctx} | {cell(before, 'decode_step_s', '.3f')} s | "
          f"{cell(after, 'decode_step_s', '.3f')} s | {cell(before, 'bandwidth_fraction', '.2f')} -> "
          f"{cell(after, 'bandwidth_fraction', '.2f')} | {cell(before, 'flops_fraction', '.2f')} -> "
          f"{cell(after, 'flops_fraction', '.2f')} | {bound} | {any_row.bytes_per_step_model / 1e9:.2f} GB | "
          f"{any_row.flops_per_step_model / 1e9:.1f} G | {any_row.flops_per_step_model / any_row.bytes_per_step_model:.1f} |")
