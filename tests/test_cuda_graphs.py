"""`timing.cuda_graphs=true`: graph-replayed decode steps produce the eager steps' tokens (CUDA only).

Each step is captured at its position and replayed (harness.measure.graphs); if capture missed a kernel, baked
in a stale position or read the wrong input, the greedy tokens would differ from the eager run's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.config import TimingConfig
from harness.measure.graphs import GraphedSteps
from harness.measure.group import measure_point
from harness.model import build_model
from harness.measure.timing import StepTimer
from strategies import StrategyUnavailable
from tests.conftest import STRATEGIES
from tests.conftest import GQA4
from tests.test_ncu import tiny_point

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

BATCH, PROMPT, NEW = 2, 24, 12


def decode(strategy, model, prompt, graphed: bool) -> torch.Tensor:
    session = strategy.new_session(model, BATCH, PROMPT + NEW)
    token = session.prefill(prompt).argmax(-1)  # [B]
    tokens = [token]
    timer = StepTimer(model.device)
    replayer = GraphedSteps(session, token, NEW - 1) if graphed else None
    for _ in range(NEW - 1):
        if graphed:
            replay, next_token = replayer.prepare_next(token)
            timer.time(replay)
            token = next_token.clone()
        else:
            token = session.step(token).argmax(-1)
        tokens.append(token)
    return torch.stack(tokens, dim=1)  # [B, NEW]


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_generates_the_eager_tokens(name, dtype):
    strategy = STRATEGIES[name]()
    if not type(strategy).graph_capturable:
        pytest.skip(f"{name} declares its steps not capturable (the runner refuses cuda_graphs=true for it)")
    device = torch.device("cuda")
    try:
        strategy.kernel(device, dtype)
    except StrategyUnavailable as unavailable:
        pytest.skip(f"{name} cannot run here: {unavailable}")
    model = build_model(GQA4, device, dtype, seed=0)
    prompt = torch.randint(GQA4.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
    assert torch.equal(decode(strategy, model, prompt, graphed=True), decode(strategy, model, prompt, graphed=False))


@pytest.mark.parametrize("prefill", ["compute", "random"])
def test_the_runner_path_with_graphs_times_the_eager_tokens(prefill):
    """measure_point end to end (warm-up probe, captured steps, replays): same tokens as eager timing."""
    eager = tiny_point(device="cuda", dtype="bfloat16", prefill=prefill, decode_tokens=6)
    graphed = dataclasses.replace(eager, timing=TimingConfig(warmup_min=1, warmup_max=3, cuda_graphs=True))
    eager_row, graphed_row = measure_point(eager), measure_point(graphed)
    assert eager_row["status"] == graphed_row["status"] == "ok", (eager_row, graphed_row)
    assert graphed_row["tokens_digest"] == eager_row["tokens_digest"]
    assert graphed_row["timing_method"] == "CUDA events, CUDA graph replay"
    assert graphed_row["decode_steps_timed"] == 6
