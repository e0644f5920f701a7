"""A decode step's linears alone, through each CPU linear kernel: the C small-batch kernel
(harness/kernels/csrc/cpu_gemv.c), oneDNN with packed weights, aten's F.linear.

The weight matrices of a model's layers (fp32, seeded) are multiplied in a row by `rows` input rows, as
one decode step does, timed in interleaved rounds (harness.measure.rounds: one pass of each kernel in
turn, the order rotating); the medians and the bytes per second they read are printed. Run it under `flock /tmp/cpu.lock` on a shared machine.

    python scripts/linear_read_rate.py --model cpu_small --rows 1 4 8 16
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import yaml

from harness.config import ModelConfig
from harness.config.paths import config_dir
from harness.measure.rounds import RoundsOptions, time_rounds
from harness.model import cpu_gemv


def weight_shapes(shape: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of every linear of one decode step, in the order the step runs them."""
    q_width, kv_width = shape.n_heads * shape.resolved_head_dim, shape.n_kv_heads * shape.resolved_head_dim
    layer = [(q_width + 2 * kv_width, shape.d_model), (shape.d_model, q_width), (2 * shape.ffn_dim, shape.d_model),
             (shape.d_model, shape.ffn_dim)]
    return layer * shape.n_layers + [(shape.vocab_size, shape.d_model)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cpu_small")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if reason := cpu_gemv.unavailable():  # also builds or loads the kernels
        raise SystemExit(f"the C kernels cannot run here: {reason}")
    shape = ModelConfig(**yaml.safe_load((config_dir() / "model" / f"{args.model}.yaml").read_text()))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=generator) for s in weight_shapes(shape)]  # [out, in] each
    total_bytes = sum(w.nbytes for w in weights)
    print(f"{args.model}: {len(weights)} linears, {total_bytes / 1e6:.1f} MB of weights, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=generator) for w in weights}  # [rows, in]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
            kernels = {
                "c": lambda: [cpu_gemv.gemv(inputs[w.shape[1]], w) for w in weights],
                "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
                                   for w, p in zip(weights, packed)],
                "aten": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
            }
            rounds = time_rounds(kernels, RoundsOptions(rounds=args.rounds))
            print(f"rows {rows:3d}: " + "  ".join(f"{name} {median * 1e3:6.2f} ms {total_bytes / median / 1e9:5.1f} GB/s"
                                                  for name, median in rounds.medians().items())
                  + f"  (others took {rounds.contention:.0%} of the CPUs)")


if __name__ == "__main__":
    main()
