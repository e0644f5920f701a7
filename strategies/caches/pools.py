"""Serving pools: the tensors of a changing set of sequences, each at its own length, and the forward
passes over them (harness.serve.executor drives a pool; harness.serve.memory decides where each
sequence sits, and the pool realises that placement).

A pool is a strategy's layer caches made for serving. The decoder (harness.model.decoder) runs
unchanged: every layer hands its roped q, k, v to the pool's cache for that layer, which reads which
sequences the pass computes (`batch`) and where each sits. Two passes:
- `prefill(seq, tokens, start)`: one sequence's chunk of its prompt (or, after a preemption, of its
  prompt and output so far) [1, T] at positions start.., attending causally over the chunk and what the
  sequence holds before it, as a step measurement's prefill does;
- `decode(seqs, tokens, positions)`: one token for every sequence of the batch, each at its own position:
  RoPE per sequence (harness.model.decoder.SequencePositions) and attention over each sequence's own
  length, never padded to the longest.
The native pools (contiguous's arena, paged's blocks, quantized's arena) read a ragged batch in one
call of their C kernel with a length per sequence (harness/kernels/csrc/ragged_ops.cpp).
`PerSequencePool` serves a cache through its own batch-1 sessions (dynamic, the evicting caches): the
decode step's linears run the batch together, and each sequence attends through its own cache, one
call each, with the kernel the step measurements run.
"""
from __future__ import annotations

import torch

from harness.model.decoder import SequencePositions


class SequencePool:
    """The base of every pool: the batch of the pass running now, and the two passes."""

    kernel: str = ""  # the attention kernel of a decode step, as the row's `kernel` names it

    def __init__(self, model, max_len: int):
        self.model = model
        self.rope = model.rotary_table(max_len)  # positions 0 .. max_len - 1, every sequence's
        self.batch: list[int] = []  # the sequences the pass running now computes, in its order
        self.positions: list[int] = []  # a decode step's position per sequence of the batch
        self.layers: list = []  # the decoder's cache per layer (the subclass's)

    def place(self, seq: int, placement, reserve: int) -> None:
        """Sequence `seq` holds this memory now (harness.serve.memory's placement), and grows to at most
        `reserve` tokens."""
        raise NotImplementedError

    def release(self, seq: int) -> None:
        """Sequence `seq`'s memory is free again."""
        raise NotImplementedError

    def held_bytes(self, seq: int) -> int:
        """Bytes of tensors the sequence takes in the pool (what its SequenceMemory accounts for)."""
        raise NotImplementedError

    def prefill(self, seq: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens [1, T] of sequence `seq` at positions start.. -> logits [1, vocab] of the last."""
        self.batch, self.positions = [seq], []
        self.before_prefill(seq, start)
        return self.model(tokens, start, self.layers, self.rope)

    def decode(self, seqs: list[int], tokens: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """tokens [B], sequence seqs[b]'s token at positions[b] -> logits [B, vocab]."""
        self.batch, self.positions = list(seqs), list(positions)
        at = self.rope.at(torch.tensor(positions, dtype=torch.int64, device=tokens.device))
        self.before_decode(at)
        return self.model(tokens[:, None], at, self.layers, self.rope)

    def before_prefill(self, seq: int, start: int) -> None:
        """What every layer of a prefill reads, prepared once (nothing here)."""

    def before_decode(self, at: SequencePositions) -> None:
        """What every layer of a decode step reads, prepared once (nothing here)."""


class PerSequencePool(SequencePool):
    """A pool of batch-1 sessions of the strategy (the module docstring): each sequence's tensors are
    its own, allocated when it is placed (its reservation: prompt + max_tokens) and freed when released."""

    def __init__(self, strategy, model, max_len: int, kernel: str):
        super().__init__(model, max_len)
        self.strategy = strategy
        self.kernel = f"{kernel}, one call per sequence"
        self.sessions: dict = {}  # seq -> its batch-1 DecodeSession
        self.layers = [_PerSequenceLayer(self, layer) for layer in range(model.cfg.n_layers)]

    def place(self, seq, placement, reserve):
        if seq not in self.sessions:  # a growing cache grows its own tensors
            self.sessions[seq] = self.strategy.new_session(self.model, 1, reserve)

    def release(self, seq):
        del self.sessions[seq]

    def held_bytes(self, seq):
        return self.sessions[seq].kv_cache_bytes


class _PerSequenceLayer:
    """One layer of a PerSequencePool: each sequence of the pass through its own session's cache."""

    def __init__(self, pool: PerSequencePool, layer: int):
        self.pool, self.layer = pool, layer

    def attend(self, q, k, v, start_pos):
        pool = self.pool
        if not isinstance(start_pos, SequencePositions):  # one sequence's prompt chunk
            return pool.sessions[pool.batch[0]].layer_caches[self.layer].attend(q, k, v, start_pos)
        outputs = [pool.sessions[seq].layer_caches[self.layer].attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], position)
                   for b, (seq, position) in enumerate(zip(pool.batch, pool.positions))]
        return torch.cat(outputs)  # [B, 1, H, D]


def arena_rows(pool: SequencePool, runs: dict, at: SequencePositions) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's first arena row of each sequence [B] and the rows it writes [B] (int64): what
    every layer of an arena pool reads, computed once."""
    starts = torch.tensor([runs[seq].start for seq in pool.batch], dtype=torch.int64, device=at.positions.device)
    return starts, starts + at.positions


def grouped_kernel(kernel, q: torch.Tensor, n_kv: int, *tensors) -> torch.Tensor:
    """A ragged kernel on a layer's own layout: q [B, 1, H, D] (query head h = kv * G + g, as
    strategies.caches.attention.grouped_attention) handed to kernel(q as [B, n_kv, G, D], *tensors),
    its output [B, n_kv, G, D] returned as [B, 1, H, D]."""
    batch, _, n_heads, head_dim = q.shape
    return kernel(q.reshape(batch, n_kv, n_heads // n_kv, head_dim), *tensors).view(batch, 1, n_heads, head_dim)
