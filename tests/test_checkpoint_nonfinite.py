"""Weights that hold NaN or infinity, or values the point's dtype cannot hold, are refused as they are
loaded (harness.model.checkpoint.finite_or_refused), in one line naming the tensor and its file: a
decoder of them computes NaN logits whose argmax is still a token, and its row would look measured.
The plan reads only headers, so the point itself fails, its row saying why, and the sweep goes on."""
from __future__ import annotations

import math

import pytest
import torch

from harness.measure.group import measure_point
from harness.model import build_model
from harness.model.checkpoint import CheckpointError, read_checkpoint
from harness.run.isolation import run_inline
from harness.run.plan import plan
from harness.run.row import build_row
from tests.checkpoint_files import CONFIG, tensors_of, write_checkpoint

CPU = torch.device("cpu")  # device=cpu: the refusal is the same on CUDA, where the check runs on the GPU
NO_CUDA = lambda: False  # noqa: E731
DAMAGED = "model.layers.0.mlp.up_proj.weight"


def with_value(name: str, value: float, at: int = 5) -> dict:
    tensors = tensors_of(CONFIG)
    tensors[name].view(-1)[at] = value
    return tensors


def load(folder, dtype=torch.float32):
    return build_model(read_checkpoint(folder).shape, CPU, dtype, seed=0, matmul="aten")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_weight_is_refused_naming_the_tensor_and_file(tmp_path, value):
    folder = write_checkpoint(tmp_path / "damaged", tensors=with_value(DAMAGED, value))
    read_checkpoint(folder)  # the headers are fine: the plan accepts it
    with pytest.raises(CheckpointError) as error:
        load(folder)
    message = str(error.value)
    assert "\n" not in message and f"'{folder / 'model.safetensors'}': tensor {DAMAGED} holds 1 NaN or infinite" in message


def test_the_shard_holding_it_is_named(tmp_path):
    folder = write_checkpoint(tmp_path / "sharded", shards=2, tensors=with_value("model.norm.weight", math.nan, at=0))
    file = read_checkpoint(folder).tensors["model.norm.weight"].file
    with pytest.raises(CheckpointError, match=f"'{folder / file}': tensor model.norm.weight holds"):
        load(folder)


def test_a_value_beyond_the_dtype_is_refused_saying_so(tmp_path):
    folder = write_checkpoint(tmp_path / "large", tensors=with_value(DAMAGED, 1e6))  # float16's largest is 65504
    load(folder, torch.float32)  # finite in float32 and bfloat16
    load(folder, torch.bfloat16)
    with pytest.raises(CheckpointError, match=f"tensor {DAMAGED} holds values up to 1e\\+06, beyond torch.float16's range"):
        load(folder, torch.float16)


def test_a_fused_weight_is_checked_in_its_own_rows(tmp_path):
    """q, k and v share one parameter: the check names the stored tensor whose rows hold the NaN."""
    name = "model.layers.0.self_attn.v_proj.weight"
    folder = write_checkpoint(tmp_path / "v", tensors=with_value(name, math.nan, at=0))
    with pytest.raises(CheckpointError, match=f"tensor {name} holds 1 NaN"):
        load(folder)


def test_the_point_fails_with_the_reason_in_its_row_and_the_sweep_goes_on(tmp_path):
    folder = write_checkpoint(tmp_path / "damaged", tensors=with_value(DAMAGED, math.nan))
    jobs = plan(["-m", "device=cpu", "model=tiny", f"model.checkpoint={folder},null", "ctx=4", "decode_tokens=2",
                 "timing.warmup_max=2", f"results_dir={tmp_path / 'results'}"], cuda_available=NO_CUDA).planned
    rows = [build_row(job.point, run_inline(measure_point, job.point)) for job in jobs]
    damaged, random = (rows if rows[0]["weights"] == "checkpoint" else rows[::-1])
    assert damaged["status"] == "failed" and f"tensor {DAMAGED} holds 1 NaN or infinite" in damaged["reason"]
    assert "\n" not in damaged["reason"] and damaged["tokens_digest"] is None
    assert random["status"] == "ok"
