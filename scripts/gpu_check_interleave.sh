#!/usr/bin/env bash
# GPU check of groups timed together: llama3_8b at depth 8 in bf16, contiguous, paged and flash at
# batch {1, 16} x ctx {1024, 8192}, each shape's strategies interleaved in one process (interleave=shape),
# then the report. For a GPU machine such as an H200; budget: under 8 minutes.
# On a machine without hydra-core: carry hydra-core, omegaconf and antlr4-python3-runtime as wheels in
# .whl/ and install them first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Usage: bash scripts/gpu_check_interleave.sh [results_dir]
set -euo pipefail
out=${1:-${OUT:-/tmp}/gpu_check_interleave}
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
timeout 420 python3 -m harness.run -m device=cuda dtype=bfloat16 traffic=model results_dir="$out" \
  model=llama3_8b model.n_layers=8 strategy=contiguous,paged,flash batch=1,16 ctx=1024,8192 decode_tokens=32 || true
timeout 60 python3 -m harness.report results_dir="$out" || true
python3 - "$out" <<'PY'
import sys
import pandas as pd
rows = pd.read_parquet(sys.argv[1])
columns = ["strategy", "batch", "ctx", "status", "decode_step_s", "decode_step_ci_low_s", "decode_step_ci_high_s",
           "ratio_to_reference", "ratio_ci_low", "ratio_ci_high", "roof_bandwidth_in_rounds_Bps", "group_id", "reason"]
print(rows.sort_values(["batch", "ctx", "strategy"])[[c for c in columns if c in rows]].to_string(index=False))
PY
