"""`quantized`'s serving pool (strategies.caches.pools): token-axis formats without a full-width window,
their codes and scales in one arena per layer, each sequence a reservation (strategies.caches.quantized
declares it: QuantizedStrategy.new_pool)."""
from __future__ import annotations

import torch

from harness.kernels.extension import ops
from harness.model.decoder import SequencePositions
from strategies.caches import quantization
from strategies.caches.attention import grouped_attention
from strategies.caches.pools import SequencePool, arena_rows, grouped_kernel
from strategies.caches.quantization import QuantSpec


class QuantizedArenaPool(SequencePool):
    """Serving (strategies.caches.pools), token-axis scales without a window: every layer's quantized K
    and V in one arena [n_kv, rows, W] (and their scales [n_kv, rows, D / span]) as large as the budget,
    each sequence a contiguous run of its reservation, as contiguous's ArenaPool. A decode step quantizes
    each sequence's token into its own row and reads each sequence's run in one call of the C kernel with
    a length per sequence (`c`); `torch` dequantizes each sequence's run and attends in turn."""

    def __init__(self, model, rows: int, max_len: int, spec: QuantSpec, format_code: int | None, kernel: str):
        super().__init__(model, max_len)
        c = model.cfg
        self.kernel, self.spec = kernel, spec
        self.format_code = format_code  # the C kernel's code for the format; None: the torch path
        self.runs: dict = {}  # seq -> its harness.serve.memory.ArenaRun
        self.layers = [QuantizedArenaLayer(self, c.n_kv_heads, rows, c.resolved_head_dim, model.device, model.dtype)
                       for _ in range(c.n_layers)]
        self.starts = self.rows = self.lengths = None  # a decode step's, per sequence [B]

    def place(self, seq, placement, reserve):
        self.runs[seq] = placement

    def release(self, seq):
        del self.runs[seq]

    def held_bytes(self, seq):
        per_row = sum(table[:, 0].nbytes for table in self.layers[0].tables())
        return self.runs[seq].tokens * per_row * len(self.layers)

    def before_decode(self, at):
        self.starts, self.rows = arena_rows(self, self.runs, at)
        self.lengths = at.positions + 1


class QuantizedArenaLayer:
    """One layer of a QuantizedArenaPool."""

    def __init__(self, pool: QuantizedArenaPool, n_kv: int, rows: int, head_dim: int, device, dtype):
        self.pool, self.dtype = pool, dtype
        spec = pool.spec
        width, groups = quantization.payload_width(spec.format, head_dim), head_dim // spec.span(head_dim)
        storage, scale = quantization.STORAGE_DTYPE[spec.format], quantization.SCALE_DTYPE
        self.k_payload = torch.zeros(n_kv, rows, width, device=device, dtype=storage)  # [n_kv, rows, W]
        self.v_payload = torch.zeros(n_kv, rows, width, device=device, dtype=storage)
        self.k_scales = torch.zeros(n_kv, rows, groups, device=device, dtype=scale)  # [n_kv, rows, D / span]
        self.v_scales = torch.zeros(n_kv, rows, groups, device=device, dtype=scale)
        self._span = spec.span(head_dim)

    def tables(self) -> list[torch.Tensor]:
        return [self.k_payload, self.v_payload, self.k_scales, self.v_scales]

    def _store(self, k: torch.Tensor, v: torch.Tensor, rows) -> None:
        """k, v [n_kv, n, D] quantized per token into arena rows `rows` (a slice or [n] indices)."""
        spec = self.pool.spec
        for (codes, factors), payload, scales in ((spec.quantize_keys(k), self.k_payload, self.k_scales),
                                                  (spec.quantize_values(v), self.v_payload, self.v_scales)):
            payload[:, rows], scales[:, rows] = codes, factors

    def _read(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [1, n_kv, length, D] of arena rows start.., dequantized to the compute dtype."""
        spec, rows = self.pool.spec, slice(start, start + length)
        k = spec.dequantize_keys(self.k_payload[:, rows], self.k_scales[:, rows], self.dtype)
        v = spec.dequantize_values(self.v_payload[:, rows], self.v_scales[:, rows], self.dtype)
        return k[None], v[None]

    def attend(self, q, k, v, start_pos):
        pool = self.pool
        if not isinstance(start_pos, SequencePositions):  # one sequence's prompt chunk [1, T]: as QuantizedLayerCache
            base, end = pool.runs[pool.batch[0]].start, start_pos + q.shape[1]
            k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [n_kv, T, D]
            earlier_k, earlier_v = self._read(base, start_pos)  # earlier tokens as stored, its own at full width
            self._store(k, v, slice(base + start_pos, base + end))
            return grouped_attention(q, torch.cat((earlier_k, k[None]), dim=2), torch.cat((earlier_v, v[None]), dim=2),
                                     q_offset=start_pos)
        self._store(k[:, 0].transpose(0, 1), v[:, 0].transpose(0, 1), pool.rows)  # [n_kv, B, D]: a token per sequence
        if pool.format_code is not None:
            return grouped_kernel(ops().ragged_quantized_decode_attention, q, self.k_payload.shape[0], self.k_payload,
                                  self.k_scales, self.v_payload, self.v_scales, pool.starts, pool.lengths,
                                  pool.format_code, self._span)
        outputs = []
        for b, (start, length) in enumerate(zip(pool.starts.tolist(), pool.lengths.tolist())):
            keys, values = self._read(start, length)
            outputs.append(grouped_attention(q[b:b + 1], keys, values, q_offset=length - 1))
        return torch.cat(outputs)
