"""A strategy that lives only under tests/: the proof that one Python file and one YAML on Hydra's
search path (tests/plugin/conf/strategy/plugin_cache.yaml) make a strategy the whole harness knows.

It keeps K and V per layer in Python lists of per-token tensors, stacked when attended: a different
cache from every shipped one, and exact (it stores what the model computed).
"""
from __future__ import annotations

import torch

from strategies.caches.attention import KERNEL_NAME, grouped_attention
from strategies.base import CachedSession, Strategy


class ListLayerCache:
    seq_dim = 2

    def __init__(self):
        self.keys, self.values = [], []  # one [B, n_kv, 1, D] tensor per position

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    def attend(self, q, k, v, start_pos):
        del self.keys[start_pos:], self.values[start_pos:]  # a rewind forgets later positions
        self.keys += list(k.transpose(1, 2).split(1, dim=2))
        self.values += list(v.transpose(1, 2).split(1, dim=2))
        keys, values = torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)  # [B, n_kv, L, D]
        return grouped_attention(q, keys, values, q_offset=start_pos)


class ListSession(CachedSession):
    def fill_random(self, length, generator):
        model = self.model
        shape = (self.batch, model.cfg.n_kv_heads, 1, model.cfg.resolved_head_dim)
        for cache in self.layer_caches:
            cache.keys = [torch.randn(shape, generator=generator, dtype=model.dtype) for _ in range(length)]
            cache.values = [torch.randn(shape, generator=generator, dtype=model.dtype) for _ in range(length)]
        self.length = length


class PluginCacheStrategy(Strategy):
    name = "plugin_cache"
    devices = ("cpu",)

    def kernel(self, device, dtype, shape=None) -> str:
        self.resolve_backend(device, dtype, shape)
        return f"python list + {KERNEL_NAME}"

    def new_session(self, model, batch: int, max_len: int) -> CachedSession:
        session = ListSession(model, [ListLayerCache() for _ in range(model.cfg.n_layers)], max_len)
        session.batch = batch
        return session
