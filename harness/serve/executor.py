"""The executor that runs our decoder (harness.serve.records says what an executor is asked): each
iteration's prompt chunks and ragged decode step through the strategy's serving pool
(strategies.caches.pools), greedy, every output token kept, the iteration timed on the machine's clock.

Each request's prompt is real text where the point has a prompt (`prompt=`, python-docs in the serving
preset): consecutive windows of the text's tokens, request i's after request i - 1's, wrapping to the
start when the text runs out; without one, seeded random ids. Outputs are greedy and run to the
request's output length whatever the tokens are (end-of-sequence ignored, as vLLM's benchmark runs).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from harness.serve.records import Iteration
from harness.serve.workload import Workload


def request_prompts(workload: Workload, ids: np.ndarray | None, vocab_size: int, seed: int, device) -> list[torch.Tensor]:
    """Each request's prompt ids [prompt_len] (the module docstring): windows of the stream `ids`, or
    seeded random ids where it is None."""
    prompts, at = [], 0
    generator = torch.Generator().manual_seed(seed)
    for request in workload.requests:
        if ids is None:
            prompt = torch.randint(vocab_size, (request.prompt_len,), generator=generator)
        else:
            taken = np.take(ids, np.arange(at, at + request.prompt_len), mode="wrap")
            at = (at + request.prompt_len) % len(ids)
            prompt = torch.from_numpy(np.ascontiguousarray(taken, dtype=np.int64))
        prompts.append(prompt.to(device))
    return prompts


class DecoderExecutor:
    """Runs iterations through a pool; keeps every request's output tokens."""

    def __init__(self, pool, workload: Workload, prompts: list[torch.Tensor], device: torch.device):
        self.pool, self.device = pool, device
        self.reserves = [r.reserve for r in workload.requests]
        self.prompts = prompts
        self.outputs: list[list[int]] = [[] for _ in workload.requests]  # each request's output token ids

    def place(self, seq, placement) -> None:
        self.pool.place(seq, placement, self.reserves[seq])

    def release(self, seq) -> None:
        self.pool.release(seq)

    def tokens(self, seq: int, start: int, count: int) -> torch.Tensor:
        """Ids at positions start .. start + count - 1 of the request's prompt followed by its output."""
        prompt = self.prompts[seq]
        known = prompt if start + count <= len(prompt) else torch.cat(
            (prompt, torch.tensor(self.outputs[seq], dtype=torch.int64, device=self.device)))
        return known[start:start + count]

    def run(self, iteration: Iteration) -> float:
        began = time.perf_counter()
        for chunk in iteration.prefills:
            logits = self.pool.prefill(chunk.seq, self.tokens(chunk.seq, chunk.start, chunk.tokens)[None], chunk.start)
            if chunk.last:
                self.outputs[chunk.seq].append(int(logits[0].argmax()))
        if iteration.decodes:
            fed = torch.tensor([self.outputs[seq][-1] for seq in iteration.decodes], dtype=torch.int64, device=self.device)
            picks = self.pool.decode(list(iteration.decodes), fed, list(iteration.positions)).argmax(-1).tolist()
            for seq, token in zip(iteration.decodes, picks):
                self.outputs[seq].append(token)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - began
