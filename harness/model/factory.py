"""A model ready to decode: the decoder allocated on its device, its weights seeded or loaded from a
checkpoint, and its CPU kernels chosen.

harness.model.decoder is the model alone; this is where the weights are drawn (or read, through
harness.model.checkpoint) and where `matmul` swaps its linears (and, for `c`, the small operators
between them) for a CPU kernel's modules.
"""
from __future__ import annotations

import math

import torch

from harness.config import ModelConfig
from harness.model.checkpoint import load_weights, read_checkpoint
from harness.model.cpu_gemv import use_gemv
from harness.model.cpu_linear import LINEAR_KERNELS, pack_linears
from harness.model.decoder import Decoder
from harness.model.random_fill import uniform_like_normal_


BIAS_FREE_MATMULS = tuple(kernel.name for kernel in LINEAR_KERNELS if not kernel.adds_bias)  # their linears drop a bias


@torch.no_grad()
def init_weights(model: Decoder, seed: int) -> None:
    """Seeded random weights, scaled so activations stay finite at any depth and in bf16.

    Values are uniform with the standard deviations below (harness.model.random_fill: filled on all cores;
    a decode step's time does not depend on the distribution).

    Projections get std 1/sqrt(fan_in), which keeps each matmul's output at unit scale; the two
    projections that write into the residual stream (wo, w2) are further divided by sqrt(2 * n_layers),
    so the residual's variance grows to about 2 over the whole depth instead of by 2 per layer.
    """
    generator = torch.Generator(device=model.device).manual_seed(seed)
    residual_scale = 1.0 / math.sqrt(2 * model.cfg.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        fan_in = param.shape[1] if param.dim() == 2 else model.cfg.d_model  # a q/k/v bias: its projection's
        std = 1.0 if name == "tok_embeddings.weight" else 1.0 / math.sqrt(fan_in)
        if name.endswith(("wo.weight", "w2.weight")):
            std *= residual_scale
        uniform_like_normal_(param, std, generator)


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int,
                matmul: str = "aten", batch_hint: int = 1) -> Decoder:
    """Allocate the decoder directly on its device and dtype (no fp32 CPU copy first) and seed it, or
    with cfg.checkpoint fill it from the checkpoint's tensors (cfg is then the checkpoint's shape).

    matmul="onednn" then repacks every linear for oneDNN (harness.model.cpu_linear), tuned for
    `batch_hint` rows; matmul="c" runs them through the C small-batch kernel, each decoder block's few-row
    calls as two C calls with its norms, RoPE, SwiGLU and residual adds (harness.model.cpu_gemv).
    The weights' values are unchanged.
    """
    with torch.device("meta"):
        model = Decoder(cfg).to(dtype)  # on meta: costs nothing
    # nn.Module.to_empty, but through torch.empty: to_empty's empty_like on meta tensors runs through
    # torch._refs, whose first call imports the symbolic-shape machinery (sympy; most of a second of
    # every run's start-up) to allocate memory the next lines overwrite.
    model = model._apply(lambda meta: torch.empty(meta.shape, dtype=meta.dtype, device=device))
    model.tie_output()  # the allocation made the tied head a tensor apart from the embedding
    if cfg.attention_bias and matmul in BIAS_FREE_MATMULS:  # harness.run.resolve refuses it before this
        raise ValueError(f"matmul={matmul} drops a bias; a q/k/v bias (model.attention_bias) needs matmul=aten")
    if cfg.checkpoint is not None:
        load_weights(model, read_checkpoint(cfg.checkpoint))
    else:
        init_weights(model, seed)
    model = model.eval().requires_grad_(False)
    if matmul == "onednn":
        pack_linears(model, batch_hint)
    elif matmul == "c":
        use_gemv(model)
    return model
