"""`no_cache`: every step re-runs the whole sequence so far. The recompute reference, whose tokens exact ones reproduce.

Nothing is kept between steps except the token ids, so step i costs a full forward pass over
ctx + i + 1 tokens (the prompt, the i tokens fed so far and the new one): work grows with the square
of the sequence, and no memory grows with it.
"""
from __future__ import annotations

import torch

from strategies.caches.attention import KERNEL_NAME, grouped_attention
from strategies.base import DecodeSession, Strategy


class StatelessLayer:
    """Attends over exactly the keys and values it is handed: the whole sequence, every step."""

    def attend(self, q, k, v, start_pos):
        if start_pos != 0:
            raise ValueError("no_cache always runs the sequence from position 0")
        return grouped_attention(q, k.transpose(1, 2), v.transpose(1, 2), q_offset=0)


class NoCacheSession(DecodeSession):
    def __init__(self, model, batch: int, max_len: int):
        self.model = model
        self.rope = model.rotary_table(max_len)
        self.tokens = torch.zeros(batch, max_len, dtype=torch.long, device=model.device)  # [B, max_len]
        self.layers = [StatelessLayer()] * model.cfg.n_layers
        self.length = 0

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        self.length = prompt.shape[1]
        self.tokens[:, : self.length] = prompt
        return self.model(self.tokens[:, : self.length], 0, self.layers, self.rope)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.tokens[:, self.length] = token
        self.length += 1
        return self.model(self.tokens[:, : self.length], 0, self.layers, self.rope)


class NoCacheStrategy(Strategy):
    name = "no_cache"
    caches_kv = False  # the recompute reference: exact by definition, the tokens every other strategy must reproduce

    def kernel(self, device, dtype, shape=None) -> str:
        self.resolve_backend(device, dtype, shape)
        return KERNEL_NAME

    def new_session(self, model, batch: int, max_len: int) -> NoCacheSession:
        return NoCacheSession(model, batch, max_len)
