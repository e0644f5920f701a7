"""Decode steps replayed from CUDA graphs (`timing.cuda_graphs=true`; CUDA only).

An eager decode step launches hundreds of small kernels; at small batch on a GPU the CPU's launch
time can exceed the GPU's work, and the step then measures Python, not memory. Serving engines
(vLLM, TensorRT-LLM) capture the step once and replay it. A decode step's shapes change with its
position (attention reads keys [0, pos]), so no single graph serves every position: each step is
captured at its own position, outside the timed window, and replayed inside it. The timed region then
holds exactly the GPU work of that step.

Capture records kernels without running them, but it does run the session's Python: the session's
length advances during capture and the cache write happens at replay, so capture-then-replay is one
step, as an eager call is.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

EAGER_WARMUP_STEPS = 3  # eager steps on a side stream before the first capture (torch.cuda.graphs docs)


class GraphedSteps:
    """Captures and replays the decode steps of one session."""

    def __init__(self, session, first_token: torch.Tensor):
        self.session = session
        self.token = first_token.clone()  # [B] static input of every captured step
        self._warm_up_eagerly()

    def _warm_up_eagerly(self) -> None:
        """Run a few eager steps on a side stream, as torch asks before a capture, so lazy
        initialisation (cuBLAS handles, workspaces) does not happen inside it; rewound after."""
        start = self.session.length
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(EAGER_WARMUP_STEPS):
                self.session.step(self.token)
                self.session.rewind(start)
        torch.cuda.current_stream().wait_stream(side)

    def capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record the step at the session's current position; returns (graph, its output token [B]).

        The output tensor is filled by each replay. The graph gets a memory pool of its own, freed
        when the caller drops the graph and the output.
        """
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            next_token = self.session.step(self.token).argmax(-1)  # [B]
        return graph, next_token

    def replay_step(self, token: torch.Tensor, timed: Callable) -> tuple[torch.Tensor, float]:
        """One decode step fed `token` [B]: captured here, then replayed through `timed` (a
        StepTimer.time). Returns (next token [B], seconds of the replay)."""
        graph, next_token = self.capture()
        self.token.copy_(token)
        _, seconds = timed(graph.replay)
        return next_token.clone(), seconds

    def replay_first_step_again(self, timed: Callable, rewind_to: int) -> Callable[[], float]:
        """A warm-up probe for harness.timing.warm_up: the step at `rewind_to`, captured once and
        replayed on every call (each replay writes the same K/V at the same position)."""
        graph, _ = self.capture()
        self.session.rewind(rewind_to)  # capture advanced the length; the replays do not

        def probe() -> float:
            return timed(graph.replay)[1]

        return probe
