"""compile=inductor: a session's decode step through torch.compile, compiled before anything is timed.

What is compiled is `session.step`: the model's forward pass for one token per sequence, with the
cache's write and read, in one graph (`fullgraph=True`: a graph break is an error and the point a
failed row, never a step that runs partly eager under a compiled label). On CUDA the mode is
"reduce-overhead" (inductor's kernels replayed from CUDA graphs; the tensors the layer caches hold are
marked as static addresses, so the graphs write into the session's own tables); on a CPU it is the
default mode, inductor's C++/OpenMP code generation. A strategy's own kernel enters the graph as a
custom op (strategies.caches.cpu_kernel) or the strategy does not declare itself compilable
(strategies.base.Strategy.compilable) and its point is skipped before anything is built.

Positions: besides the token, the step's only changing input is its position, a Python int. Dynamo
specialises on it the first time, and on a second value recompiles once with the position symbolic
(automatic dynamic shapes); no later position recompiles. Both compilations happen here, before
timing, at positions ctx and ctx + 1 (the session is rewound after, so the tokens are unchanged); any
graph compiled later, during the timed steps, is counted (`recompiles_since`).
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

MODES = {"cuda": "reduce-overhead", "cpu": "default"}  # torch.compile's mode per device type


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    if "torch._dynamo" not in sys.modules:
        return 0  # torch.compile imports dynamo: nothing compiled yet (and no second of importing it to learn so)
    from torch._dynamo.utils import counters  # here: dynamo takes seconds to import, and only a compiled run needs it

    return counters["stats"]["unique_graphs"]


class CompiledSteps:
    """`step(token) -> logits` through torch.compile, its compilation done and timed on construction."""

    def __init__(self, session, first_token: torch.Tensor, device: torch.device,
                 time_call: Callable[[Callable[[], object]], tuple[object, float]]):
        mode = MODES[device.type]
        self.call = f"torch.compile(session.step, backend=inductor, mode={mode}, fullgraph=True)"  # the row's compile_mode
        if device.type == "cuda":
            for cache in getattr(session, "layer_caches", ()):
                for tensor in vars(cache).values():
                    if isinstance(tensor, torch.Tensor):
                        torch._dynamo.mark_static_address(tensor)
        self.step = torch.compile(session.step, backend="inductor", mode=mode, fullgraph=True)
        start = session.length
        # Two positions where the session has room for them: the static graph, then the dynamic one.
        positions = min(2, getattr(session, "max_len", start + 1) - start)
        self.compile_s = 0.0  # seconds of the first calls: tracing, code generation, loading, one run each
        for _ in range(positions):
            _, seconds = time_call(lambda: self.step(first_token))
            self.compile_s += seconds
        session.rewind(start)
        self.graphs_before_timing = graphs_compiled()

    def recompiles_since(self) -> int:
        """Graphs compiled after construction: 0 unless a position or shape forced a recompilation."""
        return graphs_compiled() - self.graphs_before_timing
