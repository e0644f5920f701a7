#!/usr/bin/env bash
# The grid behind docs/performance.md: every CPU strategy at the 8B width, depth 1, fp32, over
# batch {1, 8, 32} x ctx {512, 4096, 16384}: linear layers through aten, then through oneDNN with
# packed weights; attention through SDPA, then through the C decode kernel. Resumable: re-running
# skips finished points. Usage: bash scripts/perf_grid.sh [results_dir]   (about 25 minutes here)
set -euo pipefail
out=${1:-results/perf_grid}
common=(model=llama3_8b model.n_layers=1 dtype=float32 results_dir="$out")
# Cached: the cache is filled with random K/V (prefill=random), so long contexts cost no prompt.
# Linear layers before/after (aten vs oneDNN-packed), attention through SDPA in both:
python -m harness.run -m "${common[@]}" strategy=contiguous strategy.backend=sdpa matmul=aten,onednn \
  batch=1,8,32 ctx=512,4096,16384 prefill=random decode_tokens=8
# Attention before/after: SDPA (the rows above) vs the C decode kernel (strategies/cpu_decode_attention.c):
python -m harness.run -m "${common[@]}" strategy=contiguous strategy.backend=c matmul=onednn \
  batch=1,8,32 ctx=512,4096,16384 prefill=random decode_tokens=8
# No cache: each step recomputes the whole sequence (seconds to minutes at this width), so only the
# points a CPU can afford; the rest are predicted in docs/performance.md from the FLOP roof.
python -m harness.run -m "${common[@]}" strategy=no_cache matmul=aten,onednn \
  batch=1 ctx=512 decode_tokens=4 timing.warmup_max=3
for point in "batch=8 ctx=512" "batch=1 ctx=4096"; do
  python -m harness.run "${common[@]}" strategy=no_cache matmul=onednn $point decode_tokens=3 timing.warmup_max=2
done
