"""A/B of contiguous's two CPU attention kernels (SDPA vs the C decode kernel) in one process.

Sweep rows of the two backends are measured minutes apart, and on a shared VM the machine moves more
between them than the kernels differ at depth 1. Here both sessions share one model and their decode
steps alternate, so both see the same machine; the median of each is printed.

Usage: python scripts/attention_ab.py [--layers N] [--rounds R] BATCHxCTX...
       python scripts/attention_ab.py --layers 4 8x16384
(the 8B width, fp32, oneDNN-packed linears, caches filled with random K/V; ~5 GB + 0.9 GB per layer)
"""
import argparse
import statistics
import time

import torch

from harness.config import ModelConfig
from harness.model import build_model
from harness.run.catalog import strategy_catalog

STRATEGIES = strategy_catalog()

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("points", nargs="+", help="BATCHxCTX, e.g. 8x16384")
parser.add_argument("--layers", type=int, default=1)
parser.add_argument("--rounds", type=int, default=12, help="steps per backend (the first 2 are warm-up)")
args = parser.parse_args()

shape = ModelConfig(name="llama3_8b", vocab_size=128256, d_model=4096, n_layers=args.layers, n_heads=32,
                    n_kv_heads=8, ffn_dim=14336)
for point in args.points:
    batch, ctx = (int(part) for part in point.split("x"))
    model = build_model(shape, torch.device("cpu"), torch.float32, seed=0, matmul="onednn", batch_hint=batch)
    sessions = {}
    for backend in ("sdpa", "c"):
        session = STRATEGIES["contiguous"](backend=backend).new_session(model, batch, ctx + 1)
        session.fill_random(ctx, torch.Generator().manual_seed(0))
        sessions[backend] = session
    token = torch.zeros(batch, dtype=torch.long)  # [B]
    seconds = {backend: [] for backend in sessions}
    with torch.inference_mode():
        for round_index in range(args.rounds):
            order = list(sessions.items())
            for backend, session in order if round_index % 2 == 0 else order[::-1]:  # no order bias
                begin = time.perf_counter()
                session.step(token)
                seconds[backend].append(time.perf_counter() - begin)
                session.rewind(ctx)
    sdpa, c = (statistics.median(seconds[backend][2:]) for backend in ("sdpa", "c"))
    print(f"layers={args.layers} b={batch} ctx={ctx}: sdpa {sdpa * 1e3:.1f} ms, c {c * 1e3:.1f} ms, "
          f"speedup {sdpa / c:.2f}x", flush=True)
    del sessions, model
