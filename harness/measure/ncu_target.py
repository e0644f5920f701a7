"""The program ncu profiles: a point's decode steps again, each inside the NVTX range `decode`.

    python -m harness.measure.ncu_target '<json of point.record()>'

It repeats what a group's member does before its rounds (harness.measure.member.Member.set_up, through
harness.measure.decoding.start_decode: same model, seed, prompt and cache), so the profiled steps are the measured steps: same positions, same tokens. Everything before
the steps (model build, prefill, one warm-up step) runs outside the range and is not profiled. It
prints nothing: ncu's CSV shares its stdout.
"""
from __future__ import annotations

import contextlib
import json
import sys

import torch

from harness.config import Point, point_from_record
from harness.measure.ncu import NVTX_RANGE
from harness.measure.decoding import start_decode
from harness.measure.timing import StepTimer
from harness.model import build_model


def _decode_range(device: torch.device):
    # NVTX needs a CUDA build of torch; on a CPU (tests) the steps run without a range.
    return torch.cuda.nvtx.range(NVTX_RANGE) if device.type == "cuda" else contextlib.nullcontext()


def run_decode_steps(point: Point) -> torch.Tensor:
    """Prefill, one warm-up step (rewound), then the point's greedy steps, each in the range.
    Returns the generated tokens [B, decode_tokens + 1], equal to the measured member's."""
    device, dtype = torch.device(point.device), getattr(torch, point.dtype)
    torch.set_num_threads(point.threads)
    strategy = point.strategy.instantiate()
    model = build_model(point.model, device, dtype, point.seed, point.matmul, batch_hint=point.batch)
    # cold_cache: the same eviction buffer the timed run zeroes before each step, zeroed here
    # between the ranges, so its 256 MB of writes are not counted as the step's traffic.
    flush_buffer = StepTimer(device, cold_cache=point.timing.cold_cache).flush_buffer
    generator = torch.Generator(device=device).manual_seed(point.seed)

    session, first_token, _ = start_decode(  # same draws as the measured member
        point, lambda: strategy.new_session(model, point.batch, point.max_len), generator)

    # One warm-up step: lazy initialisation and allocator growth stay out of the profiled steps.
    session.step(first_token)
    session.rewind(point.ctx)

    generated = [first_token]
    for _ in range(point.decode_tokens):
        if flush_buffer is not None:
            flush_buffer.zero_()
        with _decode_range(device):
            generated.append(session.step(generated[-1]).argmax(-1))  # [B]
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # every profiled kernel completes before the process exits
    return torch.stack(generated, dim=1)  # [B, decode_tokens + 1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m harness.measure.ncu_target '<point.record() as JSON>'", file=sys.stderr)
        return 2
    run_decode_steps(point_from_record(json.loads(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
