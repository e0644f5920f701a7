"""`layer_share`: some layers store no K/V and read another layer's cache instead (cross-layer sharing
without retraining, as KVSharer and MiniCache apply it to a trained model). Approximate (`exact =
False`): a reader's queries meet its source's keys and values, not its own.

Which layers read (options):
- `layers`: the reading layers, each reading the nearest storing layer below it (layer 0 always stores);
- else `fraction` (default 0.3) of the layers, in pairs from the top down: the last layer reads the one
  below it, then the third from last, and so on. KVSharer shares about 30% of the layers at small loss;
  MiniCache merges adjacent pairs from the middle of the stack up, where neighbouring layers' K/V are
  most alike. So with 30 layers: 9 readers, layers 29, 27, ..., 13 reading 28, 26, ..., 12.
KVSharer picks its pairs by calibration (and, counter-intuitively, the least similar layers); a fixed
rule needs no calibration pass and is what the option overrides.

Storing layers are `contiguous`'s caches (its kernels: `strategy.backend`); a reader allocates nothing
and attends over its source's table up to the same position (the source layer ran first, so the new
token's K/V are already there). A reader's own K/V projection still runs: the decoder fuses q, k and
v in one matmul, so the cache's bytes shrink and the weights a step reads do not.
"""
from __future__ import annotations

from typing import Sequence

from harness.config import CacheLayout, ModelConfig
from strategies.caches import cpu_kernel
from strategies.caches.attention import grouped_attention
from strategies.base import CachedSession, Strategy, StrategyOptionError
from strategies.caches.contiguous import BACKENDS, ContiguousLayerCache


class SharedLayerCache:
    """A layer that reads `source`'s cache (a ContiguousLayerCache of a layer below) and stores nothing."""

    nbytes = 0

    def __init__(self, source: ContiguousLayerCache):
        self.source = source

    def attend(self, q, k, v, start_pos):
        source, end = self.source, start_pos + q.shape[1]
        if q.shape[1] == 1 and source.decode_kernel is not None:
            return source.decode_kernel(q, source.k, source.v, end)
        return grouped_attention(q, source.k[:, :, :end], source.v[:, :, :end], q_offset=start_pos)


class SharedSession(CachedSession):
    def fill_random(self, length: int, generator) -> None:
        storing = self.layer_caches
        self.layer_caches = [cache for cache in storing if isinstance(cache, ContiguousLayerCache)]
        try:
            super().fill_random(length, generator)
        finally:
            self.layer_caches = storing


class LayerShareStrategy(Strategy):
    name = "layer_share"
    exact = False  # a reader attends over another layer's K/V; the harness measures how far that moves
    backends = BACKENDS

    def __init__(self, backend: str = "auto", fraction: float = 0.3, layers: Sequence[int] | None = None):
        super().__init__(backend)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 0.5:
            raise StrategyOptionError("fraction", f"must be a number in [0, 0.5] (readers alternate with the layers "
                                                  f"they read), got {fraction!r}")
        if layers is not None:
            if not isinstance(layers, (list, tuple)) or not all(
                    isinstance(layer, int) and not isinstance(layer, bool) and layer >= 1 for layer in layers):
                raise StrategyOptionError("layers", f"must be a list of layer indices >= 1, such as [1,3] (layer 0 "
                                                    f"has none below to read), or null; got {layers!r}")
            if len(set(layers)) != len(layers):
                raise StrategyOptionError("layers", f"names a layer more than once: {layers!r} (each reading layer once)")
            layers = list(layers)
        self.fraction, self.layers = float(fraction), sorted(set(layers)) if layers is not None else None

    def options(self) -> dict:
        return {"fraction": self.fraction, "layers": self.layers}

    def readers(self, n_layers: int) -> list[int]:
        """The layers that read another's cache, for a stack of n_layers (module docstring)."""
        if self.layers is not None:
            return self.layers
        count = round(self.fraction * n_layers)
        return sorted(n_layers - 1 - 2 * i for i in range(count))

    def sources(self, n_layers: int) -> list[int]:
        """The layer whose cache each layer reads (itself where it stores)."""
        readers, sources = set(self.readers(n_layers)), []
        for layer in range(n_layers):
            sources.append(sources[layer - 1] if layer in readers else layer)
        return sources

    def _check_shape(self, shape: ModelConfig) -> None:
        readers = self.readers(shape.n_layers)
        if readers and readers[-1] >= shape.n_layers:
            raise StrategyOptionError("layers", f"{readers[-1]} is past the last layer of {shape.name} "
                                                f"({shape.n_layers} layers)")

    def cache_layout(self, shape: ModelConfig | None = None) -> CacheLayout:
        if shape is None:
            raise ValueError("layer_share: the layers that store depend on n_layers; pass the model shape")
        self._check_shape(shape)
        return CacheLayout(layers_stored=shape.n_layers - len(self.readers(shape.n_layers)))

    def check_point(self, prefill: str, shape: ModelConfig, max_len: int) -> None:
        super().check_point(prefill, shape, max_len)
        self._check_shape(shape)

    def new_session(self, model, batch: int, max_len: int) -> SharedSession:
        c = model.cfg
        self._check_shape(c)
        decode_kernel = cpu_kernel.attend_heads if self.session_backend(model).name == "c" else None
        caches = []
        for layer, source in enumerate(self.sources(c.n_layers)):
            caches.append(SharedLayerCache(caches[source]) if source != layer else ContiguousLayerCache(
                batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype, decode_kernel))
        return SharedSession(model, caches, max_len)
