"""A serving run without the decoder: the same scheduler (harness.serve.scheduler), the same allocator
by the strategy's own accounting (harness.serve.memory), on a virtual clock, with an executor that
says how long each iteration would take instead of computing it. A workload then replays at scales
and on devices this machine does not have. Pure: no torch.

Two step-time models (`StepTime`):
- `FittedStepTime`: this machine's own measurements, fitted per strategy (harness.serve.step_fit);
- `RoofStepTime`: the analytic model at a device's roofs, split over `tp` devices
  (harness.analysis.iteration): a lower bound that leaves out communication and overheads.
Nothing of a simulated run is measured: its rows say so (the `simulated` column).
"""
from __future__ import annotations

from typing import Optional, Protocol

from harness.analysis.analytic import Layout, Roof
from harness.analysis.cache_terms import Shape
from harness.analysis.iteration import IterationModel
from harness.serve.memory import KVMemory, Placement
from harness.serve.records import Iteration, ServingOutcome, VirtualClock
from harness.serve.scheduler import serve
from harness.serve.step_fit import StepFit, iteration_features
from harness.serve.workload import Workload


class StepTime(Protocol):
    """How long an iteration takes, per a model."""

    def seconds(self, iteration: Iteration) -> float: ...


class FittedStepTime:
    """A StepFit's time for the iterations of a strategy whose cache is `layout`, its linears splitting
    at `row_split` rows (harness.serve.step_fit)."""

    def __init__(self, fitted: StepFit, layout: Layout, row_split: Optional[int]):
        self.fitted, self.layout, self.row_split = fitted, layout, row_split

    def seconds(self, iteration: Iteration) -> float:
        return self.fitted.seconds(iteration_features(iteration, self.layout, self.row_split))


class RoofStepTime:
    """The analytic iteration of `shape` in `dtype`, its cache as `layout` stores it, split over `tp`
    devices whose roofs are `roof`."""

    def __init__(self, shape: Shape, dtype: str, layout: Layout, roof: Roof, tp: int = 1):
        self.model, self.roof = IterationModel(shape, dtype, layout, tp), roof

    def seconds(self, iteration: Iteration) -> float:
        chunks = [(chunk.start, chunk.tokens) for chunk in iteration.prefills]
        return self.model.seconds(iteration.positions, chunks, self.roof)


class SimulatedExecutor:
    """The executor seam (harness.serve.records) answered by a step-time model: memory is placed by
    the allocator alone (there are no tensors to place), and an iteration takes the model's time."""

    def __init__(self, step_time: StepTime):
        self.step_time = step_time
        self.iterations = 0

    def place(self, seq: int, placement: Placement) -> None:
        pass

    def release(self, seq: int) -> None:
        pass

    def run(self, iteration: Iteration) -> float:
        self.iterations += 1
        return self.step_time.seconds(iteration)


def simulate(workload: Workload, memory: KVMemory, step_time: StepTime, prefill_chunk: Optional[int] = None,
             max_batch: int = 256) -> ServingOutcome:
    """The workload served by the scheduler at the model's step times, on a virtual clock."""
    return serve(workload, memory, SimulatedExecutor(step_time), VirtualClock(), prefill_chunk, max_batch)
