"""A cpu_small decode step with each piece of the C small-batch path in turn, timed interleaved in one process.

Variants (same seeded weights): `onednn` (matmul=onednn: packed linears, torch's small operators);
`c_linear` (the C linears only); `c_linear_norm` (and the C RMSNorm); `c_block` (matmul=c as shipped:
each decoder block two C calls, harness.model.cpu_gemv.GemvBlock). One step of each in turn, every
step at position ctx (the session is rewound), medians printed with whether all four pick the same
next tokens. The figures behind docs/performance.md's "small operators that run cold" and "a block in
two calls". Run it under `flock /tmp/cpu.lock`.

    python scripts/step_kernels_ab.py --batch 1 --ctx 256
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import yaml

from harness.config import ModelConfig
from harness.config.paths import config_dir
from harness.model import build_model, decoder
from strategies.contiguous import ContiguousStrategy

VARIANTS = ("onednn", "c_linear", "c_linear_norm", "c_block")


def variant_model(shape: ModelConfig, kind: str, batch: int) -> decoder.Decoder:
    """matmul=c's model with the pieces after `kind` put back to torch's (or matmul=onednn's model)."""
    model = build_model(shape, torch.device("cpu"), torch.float32, 0, "onednn" if kind == "onednn" else "c",
                        batch_hint=batch)
    if kind in ("c_linear", "c_linear_norm"):
        model.layers = torch.nn.ModuleList(layer.block for layer in model.layers)  # the block's own modules
    if kind == "c_linear":
        for block in model.layers:
            for name in ("attention_norm", "ffn_norm"):
                norm = decoder.RMSNorm(shape.d_model, shape.norm_eps)
                norm.weight = getattr(block, name).weight
                setattr(block, name, norm)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cpu_small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    shape = ModelConfig(**yaml.safe_load((config_dir() / "model" / f"{args.model}.yaml").read_text()))
    with torch.inference_mode():
        sessions = {}
        for kind in VARIANTS:
            session = ContiguousStrategy().new_session(variant_model(shape, kind, args.batch), args.batch, args.ctx + 2)
            session.fill_random(args.ctx, torch.Generator().manual_seed(0))
            sessions[kind] = session
        token = torch.zeros(args.batch, dtype=torch.int64)
        seconds: dict[str, list[float]] = {kind: [] for kind in VARIANTS}
        logits = {}
        for _ in range(args.rounds):
            for kind, session in sessions.items():
                start = time.perf_counter()
                logits[kind] = session.step(token)  # [B, vocab]
                seconds[kind].append(time.perf_counter() - start)
                session.rewind(args.ctx)
    same = all(torch.equal(logits[kind].argmax(-1), logits["onednn"].argmax(-1)) for kind in VARIANTS)
    print(f"{args.model} b={args.batch} ctx={args.ctx}: " + ", ".join(
        f"{kind} {statistics.median(s[5:]) * 1e3:.2f} ms" for kind, s in seconds.items()) + f"; same tokens: {same}")


if __name__ == "__main__":
    main()
