"""The memory model of one point: the peak it will reach, predicted before it runs.

One estimate serves two uses: the runner skips a point that cannot fit (harness.measure.memory), and
every row records it as `peak_memory_predicted_bytes` beside the measured `peak_memory_bytes`, so the
report can show how far the model is off. It errs high (the transients are an upper bound), which is
what a fit check needs. Pure arithmetic on the point (harness.config.point.Point); no torch.
"""
from __future__ import annotations

from harness.analysis import analytic


def predicted_peak_bytes(point) -> int:
    """A conservative estimate of a point's peak: weights, cache, and the largest transient tensors.

    The largest forward pass runs T tokens per sequence: the whole sequence without a cache, the
    prompt for a computed prefill, one token with prefill=random. It holds one layer's activations for
    B*T tokens (residual, q/k/v, the MLP branches) and, for T > 1, the causal mask of the grouped
    attention (G*T x T booleans). Attention scores are not materialised: SDPA's CPU and CUDA kernels
    work block by block. Logits are fp32, batch x vocab. A cache that grows by concatenation holds two
    copies of itself while it grows.
    """
    shape, layout, batch = point.model, point.strategy.layout, point.batch
    elem = analytic.dtype_bytes(point.dtype)
    tokens = point.max_len if layout is None else (point.ctx if point.prefill == "compute" else 1)
    hd = shape.resolved_head_dim
    activations = batch * tokens * (4 * shape.d_model + 3 * shape.ffn_dim + 2 * shape.n_heads * hd) * elem
    keys = point.max_len if layout is not None and layout.reads_max_len else tokens  # a mask over max_len
    mask = (shape.n_heads // shape.n_kv_heads) * tokens * keys if tokens > 1 else 0
    cache = analytic.kv_cache_bytes(shape, point.dtype, batch, point.max_len, layout)
    copies = 2 if layout is not None and layout.copies_per_step else 1
    logits = batch * shape.vocab_size * 4
    return int(analytic.weight_bytes(shape, point.dtype) + copies * cache + activations + mask + logits)
