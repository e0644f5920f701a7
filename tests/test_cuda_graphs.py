"""`timing.cuda_graphs=true`: graph-replayed decode steps produce the eager steps' tokens (CUDA only).

Each step is captured at its position and replayed (harness.graphs); if capture missed a kernel, baked
in a stale position or read the wrong input, the greedy tokens would differ from the eager run's.
"""
from __future__ import annotations

import pytest
import torch

from harness.graphs import GraphedSteps
from harness.model import build_model
from harness.timing import StepTimer
from strategies import STRATEGIES, StrategyUnavailable
from tests.conftest import GQA4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

BATCH, PROMPT, NEW = 2, 24, 12


def decode(strategy, model, prompt, graphed: bool) -> torch.Tensor:
    session = strategy.new_session(model, BATCH, PROMPT + NEW)
    token = session.prefill(prompt).argmax(-1)  # [B]
    tokens = [token]
    timer = StepTimer(model.device)
    replayer = GraphedSteps(session, token) if graphed else None
    for _ in range(NEW - 1):
        if graphed:
            token, _ = replayer.replay_step(token, timer.time)
        else:
            token = session.step(token).argmax(-1)
        tokens.append(token)
    return torch.stack(tokens, dim=1)  # [B, NEW]


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_generates_the_eager_tokens(name, dtype):
    strategy = STRATEGIES[name]()
    device = torch.device("cuda")
    try:
        strategy.kernel(device, dtype)
    except StrategyUnavailable as unavailable:
        pytest.skip(f"{name} cannot run here: {unavailable}")
    model = build_model(GQA4, device, dtype, seed=0)
    prompt = torch.randint(GQA4.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
    assert torch.equal(decode(strategy, model, prompt, graphed=True), decode(strategy, model, prompt, graphed=False))
