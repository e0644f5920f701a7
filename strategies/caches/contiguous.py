"""`contiguous`: K and V preallocated per layer as [B, n_kv, max_len, D] and written in place.

The table is allocated once for the longest sequence a session will reach, so no step allocates or
copies it; a step writes one position and attends over the filled prefix [0, length).

Attention kernels (`strategy.backend`; BACKENDS, in preference order, says what each needs):
- `c`: decode steps through `cpu_decode_attention.c` (CPU, fp32; strategies.caches.cpu_kernel), which reads
  the cache faster than SDPA's CPU kernel (conf/sweep/attention_backends.yaml times the two); the
  prompt still goes through SDPA.
  Where the kernel cannot run, the point is skipped with the reason.
- `sdpa`: torch's scaled_dot_product_attention on the grouped queries (strategies.caches.attention), any device.
- `auto` (default): `c` where it can run, else `sdpa` (strategies.backends). Rows name the kernel that ran.
"""
from __future__ import annotations

import torch

from harness.kernels.extension import ops
from harness.model.decoder import SequencePositions
from strategies.caches import cpu_kernel
from strategies.caches.attention import KERNEL_NAME as SDPA_KERNEL
from strategies.caches.attention import grouped_attention
from strategies.caches.pools import SequencePool, arena_rows, grouped_kernel
from strategies.backends import Backend
from strategies.base import CachedSession, Strategy
from strategies.serving import ARENA, SequenceMemory, kv_bytes_per_token

C_KERNEL = f"{cpu_kernel.KERNEL_NAME} for decode steps, {SDPA_KERNEL} for the prompt"
# A serving pool's decode step (ArenaPool): the same file's ragged entry point, a length per sequence
RAGGED_KERNEL = f"{cpu_kernel.KERNEL_NAME} ragged (a length per sequence) for decode steps, {SDPA_KERNEL} for prompts"
BACKENDS = (Backend("c", C_KERNEL, compiled=cpu_kernel.CONTIGUOUS_KERNEL), Backend("sdpa", SDPA_KERNEL))


class ContiguousLayerCache:
    seq_dim = 2  # position axis of k and v

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype,
                 decode_kernel=None):
        # zeros, not empty: the pages are touched now, so the table is resident from the start, as a
        # serving engine's would be, and the memory peak shows it whatever the context.
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)  # [B, n_kv, S, D]
        self.v = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)  # [B, n_kv, S, D]
        # decode_kernel(q [B, 1, H, D], k, v, end) -> [B, 1, H, D] for decode steps (cpu_kernel.attend_heads),
        # or None for SDPA throughout
        self.decode_kernel = decode_kernel

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, k, v, start_pos: int) -> int:
        """Store the new tokens' k/v [B, T, n_kv, D] at start_pos..; returns the filled length."""
        end = start_pos + k.shape[1]
        self.k[:, :, start_pos:end] = k.transpose(1, 2)  # -> [B, n_kv, T, D]
        self.v[:, :, start_pos:end] = v.transpose(1, 2)
        return end

    def attend(self, q, k, v, start_pos):
        end = self.write(k, v, start_pos)
        if q.shape[1] == 1 and self.decode_kernel is not None:
            return self.decode_kernel(q, self.k, self.v, end)
        return grouped_attention(q, self.k[:, :, :end], self.v[:, :, :end], q_offset=start_pos)


class ArenaPool(SequencePool):
    """Serving (strategies.caches.pools): K and V per layer in one arena [n_kv, rows, D] as large as the
    budget, each sequence a contiguous run of its reservation (prompt + max_tokens, placed by
    harness.serve.memory: the rows a static server reserves, fragmentation included). A decode step
    writes each sequence's token at its own row and reads each sequence's run in one call of the C
    kernel with a length per sequence (`c`), or, with `sdpa`, SDPA over each sequence's run in turn."""

    def __init__(self, model, rows: int, max_len: int, use_c: bool, kernel: str):
        super().__init__(model, max_len)
        c = model.cfg
        self.kernel = kernel
        self.runs: dict = {}  # seq -> its harness.serve.memory.ArenaRun
        self.use_c = use_c
        self.layers = [ArenaLayerCache(self, c.n_kv_heads, rows, c.resolved_head_dim, model.device, model.dtype)
                       for _ in range(c.n_layers)]
        self.starts = self.rows = self.lengths = None  # a decode step's, per sequence [B] (arena_rows)

    def place(self, seq, placement, reserve):
        self.runs[seq] = placement

    def release(self, seq):
        del self.runs[seq]

    def held_bytes(self, seq):
        layer = self.layers[0]
        return self.runs[seq].tokens * (layer.k[:, 0].nbytes + layer.v[:, 0].nbytes) * len(self.layers)

    def before_decode(self, at):
        self.starts, self.rows = arena_rows(self, self.runs, at)
        self.lengths = at.positions + 1


class ArenaLayerCache:
    """One layer of an ArenaPool."""

    def __init__(self, pool: ArenaPool, n_kv_heads: int, rows: int, head_dim: int, device, dtype):
        self.pool = pool
        # zeros: resident from the start, as contiguous's tables are
        self.k = torch.zeros(n_kv_heads, rows, head_dim, device=device, dtype=dtype)  # [n_kv, rows, D]
        self.v = torch.zeros(n_kv_heads, rows, head_dim, device=device, dtype=dtype)  # [n_kv, rows, D]

    def attend(self, q, k, v, start_pos):
        pool = self.pool
        if not isinstance(start_pos, SequencePositions):  # one sequence's prompt chunk [1, T]
            base, end = pool.runs[pool.batch[0]].start, start_pos + q.shape[1]
            self.k[:, base + start_pos:base + end] = k[0].transpose(0, 1)  # [n_kv, T, D]
            self.v[:, base + start_pos:base + end] = v[0].transpose(0, 1)
            return grouped_attention(q, self.k[None, :, base:base + end], self.v[None, :, base:base + end],
                                     q_offset=start_pos)
        self.k[:, pool.rows] = k[:, 0].transpose(0, 1)  # [n_kv, B, D]: each sequence's token at its own row
        self.v[:, pool.rows] = v[:, 0].transpose(0, 1)
        if pool.use_c:
            return grouped_kernel(ops().ragged_decode_attention, q, self.k.shape[0], self.k, self.v, pool.starts,
                                  pool.lengths)
        return torch.cat([grouped_attention(q[b:b + 1], self.k[None, :, start:start + length],
                                            self.v[None, :, start:start + length], q_offset=length - 1)
                          for b, (start, length) in enumerate(zip(pool.starts.tolist(), pool.lengths.tolist()))])


class ContiguousStrategy(Strategy):
    name = "contiguous"
    backends = BACKENDS
    compilable = True  # the C kernel is a torch operator, which a compiled graph calls (strategies.caches.cpu_kernel)

    def serving_unavailable(self) -> str | None:
        return None

    def sequence_memory(self, shape, dtype) -> SequenceMemory:
        """A reservation: prompt + max_tokens rows of K and V in every layer, taken at admission."""
        return SequenceMemory(kv_bytes_per_token(shape, dtype), ARENA, reserved=True)

    def new_pool(self, model, memory, budget_bytes, max_len) -> ArenaPool:
        backend = self.session_backend(model)
        kernel = RAGGED_KERNEL if backend.name == "c" else f"{SDPA_KERNEL} over each sequence's rows"
        return ArenaPool(model, budget_bytes // memory.bytes_per_token, max_len, backend.name == "c", kernel)

    def new_session(self, model, batch: int, max_len: int) -> CachedSession:
        c = model.cfg
        decode_kernel = cpu_kernel.attend_heads if self.session_backend(model).name == "c" else None
        caches = [
            ContiguousLayerCache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype,
                                 decode_kernel)
            for _ in range(c.n_layers)
        ]
        return CachedSession(model, caches, max_len)
