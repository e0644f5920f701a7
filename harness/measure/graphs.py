"""Decode steps replayed from CUDA graphs (`timing.cuda_graphs=true`; CUDA only).

An eager decode step launches hundreds of small kernels; at small batch on a GPU the CPU's launch
time can exceed the GPU's work, and the step then measures Python, not memory. Serving engines
(vLLM, TensorRT-LLM) capture the step once and replay it. A decode step's shapes change with its
position (attention reads keys [0, pos]), so no single graph serves every position: each step is
captured at its own position, outside the timed window, and replayed inside it. The timed region then
holds exactly the GPU work of that step.

Capture records kernels without running them, but it does run the session's Python: the session's
length advances during capture and the cache writes happen at replay. So the steps at positions
ctx .. ctx + n - 1 are captured in a row first (the length then stands where n eager steps leave it),
each graph reading the same static input token, and replayed in order, each fed the token the
previous replay produced.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

EAGER_WARMUP_STEPS = 3  # eager steps on a side stream before the first capture (torch.cuda.graphs docs)


class GraphedSteps:
    """The decode steps of one session at positions start .. start + steps - 1, captured up front and
    replayed in order.

    Capturing every step before timing any keeps the capture's CPU work and synchronisations out of
    the gaps between timed replays. The graphs share one memory pool, which is safe because they are
    replayed in the order they were captured and an earlier graph never runs after a later one.
    """

    def __init__(self, session, first_token: torch.Tensor, steps: int):
        self.session = session
        self.start = session.length
        self.token = first_token.clone()  # [B] static input of every captured step
        self._warm_up_eagerly()
        self.graphs: list[tuple[torch.cuda.CUDAGraph, torch.Tensor]] = []  # (graph, its output token [B])
        pool = None
        for _ in range(steps):  # capture advances session.length, one position per graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                next_token = session.step(self.token).argmax(-1)  # [B]
            pool = graph.pool()
            self.graphs.append((graph, next_token))
        self.next = 0  # index of the next step to replay

    def _warm_up_eagerly(self) -> None:
        """Run a few eager steps on a side stream, as torch asks before a capture, so lazy
        initialisation (cuBLAS handles, workspaces) does not happen inside it; rewound after."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(EAGER_WARMUP_STEPS):
                self.session.step(self.token)
                self.session.rewind(self.start)
        torch.cuda.current_stream().wait_stream(side)

    def first_step_probe(self, timed: Callable) -> Callable[[], float]:
        """A warm-up probe for harness.measure.timing.warm_up: replays the first step (each replay writes the
        same K/V at the same position, so repeating it changes nothing), returns its seconds."""
        graph, _ = self.graphs[0]
        return lambda: timed(graph.replay)[1]

    def restart(self) -> None:
        """Replay from the first captured step again (the session rewound to where capture began):
        each graph writes the K/V of its own position, so a second pass repeats the first's work."""
        self.next = 0

    def prepare_next(self, token: torch.Tensor) -> tuple[Callable[[], None], torch.Tensor]:
        """The next decode step fed `token` [B], replayed once untimed (a graph's first launch uploads
        it to the device, which is not part of a step). Returns (the replay to time, the output token
        [B] it writes; clone it after the replay)."""
        graph, next_token = self.graphs[self.next]
        self.next += 1
        self.token.copy_(token)
        graph.replay()  # idempotent: the same input writes the same K/V at the same position
        return graph.replay, next_token
