#!/usr/bin/env bash
# GPU check: every strategy in bf16 on CUDA at `tiny` and the 8B width, then the rows.
# For a CUDA machine. Where torch is installed but hydra-core is not and there is no network, carry
# hydra-core, omegaconf and antlr4-python3-runtime as wheels in .whl/ and install them first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Usage: bash scripts/gpu_check.sh [results_dir]   (budget: under 8 minutes)
set -euo pipefail
out=${1:-${OUT:-/tmp}/gpu_check}
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
common=(device=cuda dtype=bfloat16 traffic=model results_dir="$out")
timeout 120 python3 -m harness.run -m "${common[@]}" model=tiny strategy=no_cache,contiguous,flash,paged,dynamic,static_full,quantized \
  batch=1,16 ctx=128,1024 decode_tokens=16
timeout 300 python3 -m harness.run -m "${common[@]}" model=llama3_8b model.n_layers=8 \
  strategy=no_cache,contiguous,flash,paged,dynamic,static_full,quantized strategy.backend=auto batch=1,16 ctx=1024,8192 decode_tokens=16 || true
# The same cached points with each step replayed from a CUDA graph (timing.cuda_graphs=true): the
# launch overhead eager steps pay shows as the gap to the rows above (tiny: most of the step).
for shape in "model=tiny" "model=llama3_8b model.n_layers=8"; do
  timeout 90 python3 -m harness.run -m "${common[@]}" $shape strategy=contiguous,flash batch=1,16 ctx=1024 \
    decode_tokens=16 timing.cuda_graphs=true || true
done
# Measured traffic on two points (ncu re-runs their decode steps).
timeout 180 python3 -m harness.run -m device=cuda dtype=bfloat16 traffic=ncu results_dir="$out" \
  model=llama3_8b model.n_layers=8 strategy=contiguous batch=1,16 ctx=8192 decode_tokens=4 || true
python3 - "$out" <<'PY'
import sys
import pandas as pd
rows = pd.read_parquet(sys.argv[1])
pd.set_option("display.width", 250)
print(rows[["strategy", "kernel", "model", "batch", "ctx", "status", "timing_method", "decode_step_s", "tokens_per_s",
            "kv_cache_bytes", "peak_memory_bytes", "bandwidth_fraction", "roofline_fraction", "bytes_per_step_model",
            "bytes_per_step_measured", "traffic_source", "tokens_digest", "reason"]].to_string())
exact = rows[(rows.status == "ok") & rows.exact & ~rows.timing_cuda_graphs & (rows.traffic != "ncu")]
digests = exact.groupby(["model", "n_layers", "batch", "ctx"])["tokens_digest"].nunique()
print("exact strategies' tokens equal at every point:", bool((digests == 1).all()))
print(digests[digests > 1].to_string() if (digests > 1).any() else "")
PY
