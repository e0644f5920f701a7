#!/usr/bin/env bash
# GPU check for per-op overhead and compilation: the 8B width (8 layers) in bf16, contiguous, at
# batch {1, 16} x ctx {1024, 8192}, three ways: eager, compile=inductor (mode reduce-overhead on CUDA:
# inductor's kernels replayed from CUDA graphs) and timing.cuda_graphs=true (the eager step captured
# once and replayed); then the three step times and bandwidth fractions side by side.
# For a CUDA machine; set up as scripts/gpu_check.sh says.
# Usage: bash scripts/gpu_check_compile.sh [results_dir]   (budget: under 8 minutes)
set -euo pipefail
out=${1:-${OUT:-/tmp}/gpu_check_compile}
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
point=(device=cuda dtype=bfloat16 traffic=model results_dir="$out" model=llama3_8b model.n_layers=8
       strategy=contiguous batch=1,16 ctx=1024,8192 decode_tokens=16 prefill=random)
timeout 120 python3 -m harness.run -m "${point[@]}" || true
timeout 240 python3 -m harness.run -m "${point[@]}" compile=inductor || true
timeout 90 python3 -m harness.run -m "${point[@]}" timing.cuda_graphs=true || true
python3 - "$out" <<'PY'
import sys
import pandas as pd
rows = pd.read_parquet(sys.argv[1])
rows["mode"] = rows["compile"].where(rows["compile"] != "none", rows["timing_cuda_graphs"].map({True: "cuda_graphs", False: "eager"}))
rows["step_ms"] = rows["decode_step_s"] * 1e3
pd.set_option("display.width", 250)
print(rows.pivot_table(index=["batch", "ctx"], columns="mode", values=["step_ms", "bandwidth_fraction"]).round(3).to_string())
print(rows[["mode", "batch", "ctx", "status", "kernel", "compile_mode", "compile_s", "compile_recompiles",
            "timing_method", "tokens_digest", "reason"]].to_string())
digests = rows[rows.status == "ok"].groupby(["batch", "ctx"])["tokens_digest"].nunique()
print("tokens equal across modes at every point:", bool((digests == 1).all()))
PY
