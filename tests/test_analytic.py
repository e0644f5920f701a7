"""The analytic model against values worked by hand, the CLI, and the hardware configs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.analysis import analytic
from harness.analysis.analytic import Roof
from harness.config import CONTIGUOUS, CacheLayout, ModelConfig
from harness.analysis.hardware import HardwareError, available_hardware, load_hardware, resolve
from tests.report_fixtures import write_calibration

REPO_ROOT = Path(__file__).resolve().parent.parent

# A shape small enough to work by hand: d 4, 1 layer, 2 heads of 2, 1 KV head, ffn 8, vocab 10.
HAND = ModelConfig(name="hand", vocab_size=10, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8)
LLAMA3_70B = ModelConfig(name="llama3_70b", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                         n_kv_heads=8, ffn_dim=28672, head_dim=128)
H100 = Roof(flops_per_s=989e12, bytes_per_s=3.35e12)


def test_hand_shape_params_and_bytes():
    # attention: wq 4*4 + wk 4*2 + wv 4*2 + wo 4*4 = 48; mlp 3*4*8 = 96; norms 2*4 = 8 -> layer 152
    assert analytic.layer_params(HAND) == 152
    # embedding 40 + layer 152 + final norm 4 + head 40
    assert analytic.params(HAND) == 236
    assert analytic.weight_bytes(HAND, "float32") == 944
    # 2 (K and V) * 1 layer * 1 KV head * head_dim 2 * 4 B
    assert analytic.kv_bytes_per_token(HAND, "float32") == 16
    assert analytic.kv_cache_bytes(HAND, "float32", batch=3, tokens=5) == 240
    # matmul weights: layer 152 - norms 8 = 144, plus head 40
    assert analytic.matmul_params(HAND) == 184


def test_hand_shape_flops():
    # cached step at context 3: one token, 2*144 layer + 2*40 head, attention over 4 keys:
    # 4 FLOPs * 4 keys * 2 heads * head_dim 2 * 1 layer = 64
    assert analytic.decode_step_flops(HAND, batch=1, context=3) == 288 + 80 + 64
    # no cache at context 3: 4 tokens, 4*288 + one head 80 + causal pairs 1+2+3+4 = 10, 16 FLOPs each
    assert analytic.decode_step_flops(HAND, batch=1, context=3, layout=None) == 4 * 288 + 80 + 10 * 16
    assert analytic.decode_step_flops(HAND, batch=2, context=3) == 2 * (288 + 80 + 64)
    # prefill of 3 tokens: 3*288 + 80 + pairs 1+2+3 = 6
    assert analytic.prefill_flops(HAND, batch=1, prompt=3) == 3 * 288 + 80 + 6 * 16


LAYOUTS = {"no_cache": None, "contiguous": CONTIGUOUS, "paged16": CacheLayout(block_size=16),
           "static_full": CacheLayout(reads_max_len=True), "dynamic": CacheLayout(copies_per_step=True),
           "int4_window": CacheLayout(value_bits=4, scale_bytes_per_token=8, residual_tokens=32)}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("batch,prompt,steps", [(1, 1, 1), (2, 7, 5), (3, 16, 9), (1, 100, 64)])
def test_generate_flops_closed_form_equals_the_sum_of_steps(layout, batch, prompt, steps):
    by_step = sum(analytic.decode_step_flops(HAND, batch, prompt + i, layout, prompt + steps) for i in range(steps))
    assert analytic.generate_flops(HAND, batch, prompt, steps, layout) == by_step


def test_phases_run_one_after_the_other_each_at_its_roof():
    """Worked by hand at a roof of 100 FLOP/s and 10 B/s: matmuls of 500 FLOPs over 20 B take 5 s
    (compute), attention of 50 FLOPs over 40 B takes 4 s (memory). In sequence: 9 s; one max over the
    whole step would say max(5.5, 6) = 6 s, the two terms summed 11.5 s."""
    roof = Roof(flops_per_s=100.0, bytes_per_s=10.0)
    phases = (analytic.Phase(500, 20), analytic.Phase(50, 40))
    assert analytic.phased_time(phases, roof) == 9.0
    assert analytic.phased_bound(phases, roof) == "compute"  # 5 s waiting on FLOPs, 4 s on bytes
    assert analytic.phased_bound((analytic.Phase(500, 20), analytic.Phase(50, 60)), roof) == "memory"


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("batch,context", [(1, 5), (16, 3000)])
def test_a_decode_step_is_its_matmuls_then_its_attention(layout, batch, context):
    """The two phases hold every FLOP and byte of the step: the matmuls the weights' bytes and the
    matmuls' FLOPs (hand: 2 * 184 per token), attention every cache byte and the rest of the FLOPs. The
    step's time is theirs summed: at least one max over the whole step, at most the two terms summed."""
    shape = LLAMA3_70B if batch > 8 else HAND
    matmuls, attention = analytic.decode_step_phases(shape, "bfloat16", batch, context, layout)
    parts = analytic.decode_step_bytes(shape, "bfloat16", batch, context, layout)
    flops = analytic.decode_step_flops(shape, batch, context, layout)
    assert matmuls.bytes == parts["weights"] and matmuls.bytes + attention.bytes == parts["total"]
    assert matmuls.flops + attention.flops == flops
    if shape is HAND:
        assert matmuls.flops == batch * 2 * 184 * (1 if layout is not None else context + 1) - (
            0 if layout is not None else batch * 2 * 40 * context)  # the head runs on the last position only
    seconds = analytic.decode_step_time(shape, "bfloat16", batch, context, H100, layout)
    assert seconds == analytic.phased_time((matmuls, attention), H100)
    whole = analytic.roofline_time(flops, parts["total"], H100)
    both_terms = flops / H100.flops_per_s + parts["total"] / H100.bytes_per_s
    assert whole * (1 - 1e-12) <= seconds <= both_terms * (1 + 1e-12)  # equal where one phase dominates: rounding


def test_a_batch16_step_whose_matmuls_are_compute_bound_waits_for_its_cache_after_them():
    """70B at batch 16, 4096 tokens each, at a ridge of 12 FLOP/B: the matmuls are compute-bound (2
    FLOPs per weight per token, 16 tokens, 2 bytes a weight: 16 FLOP/B), attention memory-bound (4
    FLOPs per head dim per query head, 2 x 2 bytes per head dim per KV head, 8 query heads per KV head:
    8 FLOP/B). The step takes their times summed, longer than one max over the step."""
    roof = Roof(flops_per_s=600e9, bytes_per_s=50e9)
    matmuls, attention = analytic.decode_step_phases(LLAMA3_70B, "bfloat16", 16, 4096)
    assert analytic.bound(matmuls.flops, matmuls.bytes, roof) == "compute"
    assert analytic.bound(attention.flops, attention.bytes, roof) == "memory"
    seconds = analytic.decode_step_time(LLAMA3_70B, "bfloat16", 16, 4096, roof)
    assert seconds == pytest.approx(matmuls.flops / roof.flops_per_s + attention.bytes / roof.bytes_per_s)
    assert seconds > analytic.roofline_time(matmuls.flops + attention.flops, matmuls.bytes + attention.bytes, roof)


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("batch,prompt,steps", [(1, 1, 1), (2, 7, 5), (8, 3000, 37), (1, 100, 300), (32, 1, 999)])
@pytest.mark.parametrize("roof", [analytic.Roof(1e9, 1e9), analytic.Roof(1e11, 3e10), analytic.Roof(1e15, 1e9)])
def test_generate_time_closed_form_equals_the_sum_of_step_roofline_times(layout, batch, prompt, steps, roof):
    """The closed form splits the sum where a step's FLOPs and bytes cross; the brute-force sum of
    each step's roofline time is the definition. A residual window's sawtooth enters as its mean."""
    shape = LLAMA3_70B if batch > 8 else HAND
    by_step = sum(analytic.decode_step_time(shape, "bfloat16", batch, prompt + i, roof, layout, prompt + steps)
                  for i in range(steps))
    closed = analytic.generate_time(shape, "bfloat16", batch, prompt, steps, roof, layout)
    tolerance = 2e-2 if layout is not None and layout.residual_tokens else 1e-9
    assert closed == pytest.approx(by_step, rel=tolerance)
    mean = analytic.mean_decode_step(shape, "bfloat16", batch, prompt, steps, layout, roof)
    mean_bytes = sum(analytic.decode_step_bytes(shape, "bfloat16", batch, prompt + i, layout, prompt + steps)["total"]
                     for i in range(steps)) / steps
    assert mean.bytes == pytest.approx(mean_bytes, rel=1e-12) and mean.seconds == pytest.approx(closed / steps)
    matmuls, attention = mean.phases  # the mean step's phases hold its FLOPs and bytes
    assert matmuls.bytes + attention.bytes == pytest.approx(mean.bytes, rel=1e-12)
    assert matmuls.flops + attention.flops == pytest.approx(mean.flops, rel=1e-12)
    mean_matmuls = sum(analytic.decode_step_phases(shape, "bfloat16", batch, prompt + i, layout, prompt + steps)[0].flops
                       for i in range(steps)) / steps
    assert matmuls.flops == pytest.approx(mean_matmuls, rel=1e-12)


def test_huge_sizes_are_answered_in_closed_form_at_once():
    import time

    began = time.perf_counter()
    seconds = analytic.generate_time(LLAMA3_70B, "bfloat16", 128, 10**9, 10**12, analytic.Roof(989e12, 3.35e12))
    assert seconds > 0 and time.perf_counter() - began < 0.05


def test_hand_shape_step_bytes_and_prefill_bytes():
    # decode reads every weight but the embedding table, plus one embedding row per sequence
    weights = (236 - 40 + 2 * 4) * 4
    step = analytic.decode_step_bytes(HAND, "float32", batch=2, context=5)
    assert step == {"weights": weights, "cache_read": 2 * 5 * 16, "cache_write": 2 * 16, "cache_copy": 0,
                    "cache_bookkeeping": 0, "total": weights + 160 + 32}
    assert analytic.decode_step_bytes(HAND, "float32", 2, 5, layout=None)["total"] == weights
    prefill = analytic.prefill_bytes(HAND, "float32", batch=2, prompt=5)
    assert prefill["total"] == (236 - 40 + 10 * 4) * 4 + 10 * 16
    assert analytic.prefill_bytes_per_token(HAND, "float32", 2, 5) == prefill["total"] / 10
    assert analytic.decode_bytes_per_token(HAND, "float32", 2, 5) == step["total"] / 2


def test_roofline_time_bound_and_ridge():
    roof = Roof(flops_per_s=100.0, bytes_per_s=10.0)
    assert roof.ridge == 10.0
    assert analytic.roofline_time(50, 20, roof) == 2.0  # bytes: 2 s > FLOPs: 0.5 s
    assert analytic.bound(50, 20, roof) == "memory"
    assert analytic.roofline_time(500, 20, roof) == 5.0
    assert analytic.bound(500, 20, roof) == "compute"
    assert analytic.intensity(50, 20) == 2.5


def test_llama3_70b_worked_example_of_the_guide():
    assert analytic.kv_bytes_per_token(LLAMA3_70B, "bfloat16") == 327_680 == 320 * 1024
    assert analytic.params(LLAMA3_70B) == 70_553_706_496  # the published "70B"
    # the cache outweighs the weights at weights / 320 KiB tokens, in any batch x tokens split
    assert analytic.tokens_to_match_weights(LLAMA3_70B, "bfloat16") == pytest.approx(430_625.65, abs=0.01)
    assert analytic.kv_cache_bytes(LLAMA3_70B, "bfloat16", 1, 32768) == analytic.kv_cache_bytes(
        LLAMA3_70B, "bfloat16", 32, 1024)
    # decode at batch 1 is memory bound, intensity about 1 FLOP/B against a ridge near 295
    figures = analytic.summary(LLAMA3_70B, "bfloat16", batch=1, ctx=4096, decode_tokens=512, roof=H100)
    assert 1.0 < figures["decode_intensity_flops_per_byte"] < 1.1
    assert figures["ridge_flops_per_byte"] == pytest.approx(295.2, abs=0.1)
    assert figures["decode_step_bound"] == "memory"
    assert figures["decode_step_s"] == pytest.approx(figures["bytes_decode_step"] / 3.35e12)
    # prefill bytes per token is about the decode's divided by p
    ratio = figures["decode_bytes_per_token"] / figures["prefill_bytes_per_token"]
    assert 4000 < ratio < 4096 * 1.01


def test_flop_ratio_grows_with_context_but_time_ratio_stays_far_smaller():
    flop_ratios, time_ratios = [], []
    for ctx in (512, 2048, 8192, 32768):
        flop_ratios.append(analytic.generate_flops(LLAMA3_70B, 1, ctx, 64, layout=None)
                           / analytic.generate_flops(LLAMA3_70B, 1, ctx, 64))
        time_ratios.append(analytic.generate_time(LLAMA3_70B, "bfloat16", 1, ctx, 64, H100, layout=None)
                           / analytic.generate_time(LLAMA3_70B, "bfloat16", 1, ctx, 64, H100))
    assert flop_ratios == sorted(flop_ratios) and flop_ratios[-1] > 10_000
    for flops, time in zip(flop_ratios, time_ratios):
        assert time < flops / 100  # the cached run waits on bytes: most of the FLOP saving is not time
    # and it is memory-bound decode that makes it so
    assert analytic.bound(analytic.decode_step_flops(LLAMA3_70B, 1, 32768),
                          analytic.decode_step_bytes(LLAMA3_70B, "bfloat16", 1, 32768)["total"], H100) == "memory"


def test_generate_time_is_the_sum_of_per_step_roofline_times():
    total = analytic.generate_time(HAND, "float32", 2, 4, 3, H100)
    assert total == pytest.approx(sum(analytic.decode_step_time(HAND, "float32", 2, c, H100) for c in (4, 5, 6)))


def test_datasheet_configs_load_with_every_dtype():
    assert {"h100_sxm", "h200", "a100_80g", "measured"} <= set(available_hardware())
    for name in ("h100_sxm", "h200", "a100_80g"):
        hardware = load_hardware(name)
        for dtype in analytic.DTYPE_BYTES:
            assert hardware.roof(dtype).flops_per_s > 1e12
    assert load_hardware("h100_sxm").roof("bfloat16") == H100
    assert load_hardware("h200").bandwidth_Bps == 4.8e12


def test_measured_hardware_reads_the_calibration_or_says_there_is_none(tmp_path):
    measured = load_hardware("measured")
    with pytest.raises(HardwareError, match="no calibration record"):
        resolve(measured, "float32", tmp_path)
    write_calibration(tmp_path)
    roof, source = resolve(measured, "float32", tmp_path, "cpu")
    assert roof == Roof(0.23e12, 19.6e9) and "cpu__float32.json" in source


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.analysis", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_json_has_every_key_and_agrees_with_the_functions():
    done = _cli("model=llama3_70b", "hardware=h100_sxm", "dtype=bfloat16", "batch=2", "ctx=1000",
                "decode_tokens=10", "format=json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    for key in ("params weight_bytes kv_bytes_per_token kv_cache_bytes tokens_to_match_weights "
                "flops_decode_step flops_generate_cached flops_generate_no_cache bytes_decode_step "
                "decode_step_s generate_s_cached generate_s_no_cache prefill_s prefill_bytes_per_token "
                "decode_bytes_per_token ridge_flops_per_byte decode_intensity_flops_per_byte").split():
        assert key in out, key
    assert out["kv_bytes_per_token"] == 327_680
    assert out["kv_cache_bytes"] == 2 * 1010 * 327_680
    assert out["flops_generate_cached"] == analytic.generate_flops(LLAMA3_70B, 2, 1000, 10)


def test_cli_bad_input_is_one_line_and_exit_2(capsys):
    from harness.analysis.cli import main  # in-process: a subprocess per case would cost a second each

    for args, key in ((["model=llama3_7b"], "model:"), (["dtype=int8"], "dtype:"), (["batch=0"], "batch:"),
                      (["batch=abc"], "batch:"), (["model.n_layerz=1"], "model.n_layerz:"),
                      (["format=xml"], "format:"), (["hardware=tpu"], "hardware:")):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith(key) and "\n" not in err, err


@pytest.mark.parametrize("hardware", ["h100_sxm", "h200", "a100_80g"])
def test_every_datasheet_composes_through_the_cli(hardware, capsys):
    from harness.analysis.cli import main

    assert main([f"hardware={hardware}", "model=tiny", "dtype=float32", "ctx=8", "decode_tokens=2",
                 "format=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bandwidth_Bps"] == load_hardware(hardware).bandwidth_Bps
    assert out["peak_flops"] == load_hardware(hardware).flops["float32"]


def test_cli_help_exits_0_and_lists_every_key_with_its_default_and_meaning(capsys):
    import dataclasses

    from harness.analysis.cli import AnalyticConfig, main
    from harness.analysis.usage import field_comments

    for flag in ("--help", "-h"):
        assert main([flag]) == 0
        out, err = capsys.readouterr()
        assert err == ""
        for key in ("model=llama3_70b", "hardware=h100_sxm", "strategy=contiguous", "dtype=bfloat16", "batch=1",
                    "ctx=4096", "decode_tokens=512", "format=table", "tp=1", "reserve=0.1", "usd_per_device_hour=null",
                    "device=null", "results_dir=results"):
            assert f"  {key} " in out, key
        meanings = field_comments(AnalyticConfig)
        for field in dataclasses.fields(AnalyticConfig):
            assert meanings[field.name] and meanings[field.name] in out, field.name  # the one comment of the field
        assert "model.n_kv_heads" in out and "hardware.memory_bytes" in out


def _table(*args: str) -> str:
    from harness.analysis.cli import main

    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def test_cli_table_is_in_human_units_with_the_cache_speedup_first():
    table = _table("model=llama3_70b", "hardware=h100_sxm")
    lines = table.splitlines()
    speedup = "\n".join(lines[:6])
    # 317.8 PFLOP / 77.01 TFLOP against 321.4 s / 21.46 s: the FLOP saving is not the time saving
    assert "in FLOPs  4,127x" in speedup and "in time   14.97x" in speedup and "memory bound" in speedup
    for text in ("41.9 ms", "141.1 GB", "77.01 TFLOP", "430.6 k tokens", "70.55 B parameters", "327.7 kB/token",
                 "3.35 TB/s", "989 TFLOP/s", "21.46 s"):
        assert text in table, text
    for raw in ("317,815,485,007,659,008", "4.306e+05", "0.0419 s", "e+"):
        assert raw not in table, raw


def test_cli_json_keeps_exact_si_numbers():
    from harness.analysis.cli import main

    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["model=llama3_70b", "hardware=h100_sxm", "format=json"]) == 0
    figures = json.loads(out.getvalue(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON output"))
    assert figures["flops_generate_no_cache"] == analytic.generate_flops(LLAMA3_70B, 1, 4096, 512, None)
    assert figures["decode_step_s"] == pytest.approx(0.041895, rel=1e-4) and figures["tp"] == 1


def test_table_units_pick_the_prefix_that_reads():
    from harness.analysis.table import count, duration, scaled

    assert scaled(141_107_412_992, "B") == "141.1 GB" and scaled(0, "B") == "0 B" and scaled(999, "B") == "999 B"
    assert scaled(1e30, "FLOP") == "1e+30 FLOP"  # past Y: plain scientific
    assert duration(0.0419) == "41.9 ms" and duration(2.5e-7) == "250 ns" and duration(321.4) == "321.4 s"
    assert duration(7200) == "2 h" and duration(10 * 365.25 * 86400) == "10 years"
    assert count("tokens")(430_625.65) == "430.6 k tokens" and count("parameters")(70.55e9) == "70.55 B parameters"
