"""Capacity planning: what fits, split over tensor-parallel devices, checked by hand and by identity."""
from __future__ import annotations

import pytest

from harness.analysis import analytic
import io
import json
import time
from contextlib import redirect_stderr, redirect_stdout

from harness.analysis.capacity import (PLANNING_BATCHES, allowed_tp, capacity, check_tp, decode_tokens_per_s,
                                       kv_heads_per_device, split_summary, usd_per_million_tokens,
                                       weight_bytes_per_device)
from harness.config import CONTIGUOUS
from tests.test_analytic import H100, LLAMA3_70B

H100_MEMORY = 80e9


def test_one_device_holds_every_weight_and_every_head():
    assert weight_bytes_per_device(LLAMA3_70B, "bfloat16", 1) == analytic.weight_bytes(LLAMA3_70B, "bfloat16")
    assert kv_heads_per_device(LLAMA3_70B, 1) == 8


def test_tp_splits_weights_and_kv_heads_then_replicates_kv():
    one = weight_bytes_per_device(LLAMA3_70B, "bfloat16", 1)
    assert weight_bytes_per_device(LLAMA3_70B, "bfloat16", 8) == pytest.approx(one / 8, rel=1e-3)
    assert kv_heads_per_device(LLAMA3_70B, 8) == 1 and kv_heads_per_device(LLAMA3_70B, 16) == 1  # replicated past 8
    per_token = capacity(LLAMA3_70B, "bfloat16", H100_MEMORY, tp=8).kv_bytes_per_token
    assert per_token == 327_680 / 8 == capacity(LLAMA3_70B, "bfloat16", H100_MEMORY, tp=16).kv_bytes_per_token


def test_llama3_70b_does_not_fit_one_h100_and_fits_a_node_of_eight():
    assert not capacity(LLAMA3_70B, "bfloat16", H100_MEMORY, tp=1).weights_fit  # 141 GB of weights
    node = capacity(LLAMA3_70B, "bfloat16", H100_MEMORY, tp=8)
    assert node.weights_fit
    room = 80e9 * 0.9 - weight_bytes_per_device(LLAMA3_70B, "bfloat16", 8)
    assert node.max_tokens == int(room // (327_680 / 8))
    assert node.max_context(1) == node.max_tokens and node.max_context(32) == node.max_tokens // 32
    assert node.fits(128, node.max_context(128)) and not node.fits(128, node.max_context(128) + 1)


@pytest.mark.parametrize("tp,why", [(3, "does not divide"), (0, "positive"), (6, "does not divide")])
def test_bad_tensor_parallel_sizes_are_named(tp, why):
    assert why in check_tp(LLAMA3_70B, tp)


def test_cost_per_million_tokens():
    # 40 ms per step of 32 sequences on 8 devices at $2/h: 800 tokens/s, 1.25 ms per token, 8 x $2/h
    assert decode_tokens_per_s(0.040 * 512, 32, 512) == pytest.approx(800)
    assert usd_per_million_tokens(800, 8, 2.0) == pytest.approx(16 / 3600 * 0.00125 * 1e6)


def test_hand_worked_weights_of_one_of_eight_devices():
    # per layer: wq+wo 2*8192*64*128/8, wk+wv 2*8192*1*128 (one KV head each), MLP 3*8192*28672/8, norms 2*8192
    layer = 2 * 8192 * 64 * 128 // 8 + 2 * 8192 * 1 * 128 + 3 * 8192 * 28672 // 8 + 2 * 8192
    # + the final norm, + the embedding and the output head split by rows: 2 * 128256/8 * 8192
    params = 80 * layer + 8192 + 2 * (128256 // 8) * 8192
    assert weight_bytes_per_device(LLAMA3_70B, "bfloat16", 8) == params * 2 == 17_640_734_720


def test_one_device_split_is_the_model_itself():
    figures = analytic.summary(LLAMA3_70B, "bfloat16", 4, 1000, 100, H100)
    split = split_summary(LLAMA3_70B, "bfloat16", 4, 1000, 100, H100, CONTIGUOUS, tp=1)
    assert {k: split[k] for k in figures} == figures
    assert split["bytes_decode_step_per_device"] == figures["bytes_decode_step"]


def test_a_split_step_reads_its_share_and_the_sizes_stay_whole():
    whole = split_summary(LLAMA3_70B, "bfloat16", 32, 4096, 512, H100, CONTIGUOUS, tp=1)
    eight = split_summary(LLAMA3_70B, "bfloat16", 32, 4096, 512, H100, CONTIGUOUS, tp=8)
    assert eight["weight_bytes"] == whole["weight_bytes"]
    assert eight["flops_generate_cached"] == whole["flops_generate_cached"]
    assert eight["bytes_decode_step_per_device"] == pytest.approx(whole["bytes_decode_step"] / 8, rel=1e-2)
    assert eight["decode_step_bound"] == "memory"
    assert eight["decode_step_s"] == pytest.approx(eight["bytes_decode_step_per_device"] / 3.35e12)
    assert eight["generate_s_cached"] == pytest.approx(whole["generate_s_cached"] / 8, rel=1e-2)


def test_allowed_splits_are_those_check_tp_accepts():
    assert allowed_tp(LLAMA3_70B) == [1, 2, 4, 8, 16, 32, 64]
    assert all(check_tp(LLAMA3_70B, tp) is None for tp in allowed_tp(LLAMA3_70B))
    assert check_tp(LLAMA3_70B, 3).endswith("allowed: 1, 2, 4, 8, 16, 32, 64")


def analytic_cli(*args: str) -> tuple[int, str, str]:
    from harness.analysis.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def plan_json(*args: str) -> dict:
    code, out, err = analytic_cli(*args, "format=json")
    assert code == 0, err
    return json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON output"))


def test_cli_plans_llama3_70b_on_a_node_of_eight_h100():
    out = plan_json("model=llama3_70b", "hardware=h100_sxm", "tp=8", "batch=32")
    assert out["weight_bytes_per_device"] == pytest.approx(141.1e9 / 8, rel=1e-3)
    assert out["kv_bytes_per_token_per_device"] == 2 * 80 * 1 * 128 * 2  # tp = n_kv = 8: one KV head each
    room = 80e9 - 0.10 * 80e9 - out["weight_bytes_per_device"]
    assert out["max_tokens"] == int(room // 40_960) == 1_327_130
    assert out["kv_cache_bytes_per_device"] == 32 * (4096 + 512) * 40_960 and out["fits"] is True
    assert out["max_batch"] == 1_327_130 // 4608 and out["max_context"] == 1_327_130 // 32
    assert [out[f"max_context_batch_{b}"] for b in PLANNING_BATCHES] == [1_327_130, 41_472, 10_368]
    assert out["reserve_bytes_per_device"] == 8e9 and out["usd_per_million_tokens"] is None


def test_cli_one_h100_cannot_hold_llama3_70b():
    out = plan_json("model=llama3_70b", "hardware=h100_sxm")
    assert out["fits"] is False and out["max_tokens"] == 0 and out["max_context_batch_1"] == 0


def test_cli_reserve_is_the_stated_share():
    out = plan_json("model=llama3_70b", "tp=8", "reserve=0")
    assert out["max_tokens"] == int((80e9 - out["weight_bytes_per_device"]) // 40_960)


def test_cli_cost_per_million_tokens_is_the_node_price_over_its_throughput():
    out = plan_json("model=llama3_70b", "tp=8", "batch=32", "usd_per_device_hour=2.5")
    tokens_per_s = 32 * 512 / out["generate_s_cached"]
    assert out["decode_tokens_per_s"] == pytest.approx(tokens_per_s)
    assert out["usd_per_million_tokens"] == pytest.approx(2.5 * 8 / tokens_per_s * 1e6 / 3600)


def test_cli_table_has_the_capacity_section():
    code, table, _ = analytic_cli("model=llama3_70b", "tp=8", "batch=32", "usd_per_device_hour=2.5")
    assert code == 0
    assert "memory per device: 8 x h100_sxm, 10% of each kept for activations" in table
    assert "yes: 17.64 GB weights + 6.04 GB cache + 8 GB reserve, of 80 GB" in table
    for line in ("max_context_batch_1              1,327,130 tokens", "max_context_batch_32             41,472 tokens",
                 "max_context_batch_128            10,368 tokens", "$1.196 per million generated tokens",
                 "6.791 ms"):
        assert line in table, line


@pytest.mark.parametrize("args,key", [
    (["model=llama3_8b", "tp=3"], "tp: 3 does not divide model.n_heads=32; allowed: 1, 2, 4, 8, 16, 32"),
    (["model=llama3_70b", "tp=6"], "tp: 6 does not divide"),
    (["tp=0"], "tp:"),
    (["tp=1.5"], "tp:"),
    (["usd_per_device_hour=-2.5"], "usd_per_device_hour:"),
    (["usd_per_device_hour=0"], "usd_per_device_hour:"),
    (["usd_per_device_hour=nan"], "usd_per_device_hour:"),
    (["usd_per_device_hour=abc"], "usd_per_device_hour:"),
    (["reserve=1"], "reserve:"),
    (["reserve=-0.1"], "reserve:"),
    (["hardware.memory_bytes=-1"], "hardware.memory_bytes:"),
    (["hardware.memory_bytes=1e30"], "hardware.memory_bytes:"),
])
def test_cli_refuses_a_bad_plan_in_one_line(args, key):
    code, out, err = analytic_cli(*args)
    assert code == 2 and out == ""
    assert err.startswith(key) and err.count("\n") == 1 and "Traceback" not in err, err


def test_hardware_without_memory_says_capacity_is_not_known(tmp_path):
    from tests.report_fixtures import write_calibration

    write_calibration(tmp_path)
    measured = ("model=tiny", "hardware=measured", f"results_dir={tmp_path}", "device=cpu", "dtype=float32", "tp=2")
    out = plan_json(*measured)
    assert out["device_memory_bytes"] is None and out["fits"] is None and out["max_context_batch_32"] is None
    assert out["weight_bytes_per_device"] > 0  # what the split puts on a device needs no memory figure
    code, table, _ = analytic_cli(*measured)
    assert code == 0 and "not known: hardware=measured states no memory_bytes" in table
    assert "max_context_batch_32" not in table


def test_no_cache_grows_nothing_with_the_tokens():
    out = plan_json("model=tiny", "strategy=no_cache")
    assert out["kv_bytes_per_token_per_device"] == 0 and out["fits"] is True and out["max_tokens"] is None


def test_the_plan_answers_at_once_for_any_accepted_size():
    analytic_cli("model=tiny")  # Hydra and the strategy classes imported once
    for args in (["decode_tokens=1000000000000", "tp=8", "usd_per_device_hour=2.5"],
                 [f"batch={2**63 - 1}", f"ctx={2**62}", "model=llama3_405b", "tp=16", "hardware.memory_bytes=1e18",
                  "usd_per_device_hour=1e6"]):
        for form in ("format=json", "format=table"):
            began = time.monotonic()
            code, out, err = analytic_cli(*args, form)
            assert code == 0, err
            assert time.monotonic() - began < 1.0, args
