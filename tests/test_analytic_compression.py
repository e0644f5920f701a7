"""The analytic model of compressed caches: kept tokens, kept layers, kept key channels and formats in the
bytes per token and per step, the arithmetic of eviction scores, the cache's share of a step's bytes
(the ceiling on what compressing it buys) and the context at which a batch's cache weighs the weights."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from harness.analysis import analytic, cache_terms
from harness.analysis.analytic import Roof
from harness.analysis.compression import (cache_share_of_step_bytes, compression_figures, context_to_match_weights,
                                          step_bytes_ratio)
from harness.config import CONTIGUOUS, CacheLayout, ModelConfig

SMOLLM2 = ModelConfig(name="smollm2_135m", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      ffn_dim=1536)
FP32 = "float32"
PER_TOKEN = 2 * 30 * 3 * 64 * 4  # 46,080 B: SmolLM2's exact K/V per token at fp32
INT4 = CacheLayout(value_bits=4, scale_bytes_per_token=16.0)
ROOF = Roof(flops_per_s=2e11, bytes_per_s=2e10)


def test_the_regime_of_the_real_model():
    """SmolLM2-135M at fp32: a step reads about 538 MB of weights; the cache equals them near 11.7k
    tokens at batch 1 and 2.9k at batch 4, and is about 8% and 27% of a step's bytes at ctx 1024."""
    assert analytic.kv_bytes_per_token(SMOLLM2, FP32) == PER_TOKEN
    assert analytic.decode_weight_bytes(SMOLLM2, FP32, 1) == pytest.approx(538e6, rel=0.01)
    assert context_to_match_weights(SMOLLM2, FP32, 1) == pytest.approx(11_677, rel=1e-3)
    assert context_to_match_weights(SMOLLM2, FP32, 4) == pytest.approx(2_919, rel=1e-3)
    assert cache_share_of_step_bytes(SMOLLM2, FP32, 1, 1024, 64, CONTIGUOUS) == pytest.approx(0.083, abs=0.002)
    assert cache_share_of_step_bytes(SMOLLM2, FP32, 4, 1024, 64, CONTIGUOUS) == pytest.approx(0.266, abs=0.002)
    assert cache_share_of_step_bytes(SMOLLM2, FP32, 4, 1024, 64, None) == 0  # no cache: weights only
    weights = analytic.decode_weight_bytes(SMOLLM2, FP32, 4)
    at_crossover = analytic.decode_step_bytes(SMOLLM2, FP32, 4, round(context_to_match_weights(SMOLLM2, FP32, 4)))
    assert at_crossover["cache_read"] == pytest.approx(weights, rel=1e-3)


def test_each_axis_divides_the_bytes_per_token_by_what_it_keeps():
    assert cache_terms.stored_bytes_per_token(SMOLLM2, FP32, CacheLayout(layers_stored=15)) == PER_TOKEN / 2
    assert cache_terms.stored_bytes_per_token(SMOLLM2, FP32, CacheLayout(key_channels_kept=32)) == PER_TOKEN * 3 / 4
    both = CacheLayout(layers_stored=20, key_channels_kept=16, value_bits=4, scale_bytes_per_token=16.0)
    assert cache_terms.stored_bytes_per_token(SMOLLM2, FP32, both) == 20 * 3 * ((16 + 64) * 4 / 8 + 16)
    # the crossover moves out by the factor stored less, at every batch
    for batch in (1, 4, 16):
        exact = context_to_match_weights(SMOLLM2, FP32, batch)
        assert context_to_match_weights(SMOLLM2, FP32, batch, CacheLayout(layers_stored=15)) == pytest.approx(2 * exact)
        assert context_to_match_weights(SMOLLM2, FP32, batch, INT4) == pytest.approx(
            exact * PER_TOKEN / cache_terms.stored_bytes_per_token(SMOLLM2, FP32, INT4))


def test_a_token_budget_caps_the_cache_held_read_and_attended():
    budget = CacheLayout(token_budget=256)
    assert analytic.kv_cache_bytes(SMOLLM2, FP32, 4, 1024, budget) == 4 * 256 * PER_TOKEN
    assert analytic.kv_cache_bytes(SMOLLM2, FP32, 4, 100, budget) == 4 * 100 * PER_TOKEN  # not yet full
    step = analytic.decode_step_bytes(SMOLLM2, FP32, 4, 4096, budget)
    assert step["cache_read"] == 4 * 256 * PER_TOKEN and step["cache_write"] == 4 * PER_TOKEN
    assert cache_terms.attended_keys(4096, 4097, budget) == 257
    assert analytic.decode_step_flops(SMOLLM2, 4, 4096, budget) == analytic.decode_step_flops(SMOLLM2, 4, 256)
    # a budget the cache never fills changes nothing
    assert analytic.mean_decode_step(SMOLLM2, FP32, 4, 512, 64, CacheLayout(token_budget=4096)) == \
        analytic.mean_decode_step(SMOLLM2, FP32, 4, 512, 64)
    # a budget keeps the cache below the weights at any length where the weights are more than it holds
    assert context_to_match_weights(SMOLLM2, FP32, 4, budget) is None
    assert context_to_match_weights(SMOLLM2, FP32, 64, CacheLayout(token_budget=1024)) == pytest.approx(
        context_to_match_weights(SMOLLM2, FP32, 64))  # 182 tokens: below the budget, so the budget never binds


def test_an_evicting_caches_bookkeeping_is_held_read_and_written_per_kept_token():
    """Each kept token's position and score (slot_bytes) are held and read by every step, the step's
    weights written over them where the policy takes them (slot_write_bytes): per layer and KV head."""
    plain = CacheLayout(token_budget=256)
    scored = dataclasses.replace(plain, slot_bytes=8, slot_write_bytes=4)
    per_token = SMOLLM2.n_layers * SMOLLM2.n_kv_heads
    assert analytic.kv_cache_bytes(SMOLLM2, FP32, 4, 1024, scored) == 4 * 256 * (PER_TOKEN + 8 * per_token)
    step, before = (analytic.decode_step_bytes(SMOLLM2, FP32, 4, 4096, layout) for layout in (scored, plain))
    assert step["cache_bookkeeping"] == 4 * 257 * (8 + 4) * per_token  # the budget and the step's own token
    assert step["total"] - before["total"] == step["cache_bookkeeping"] and before["cache_bookkeeping"] == 0
    assert analytic.decode_step_bytes(SMOLLM2, FP32, 4, 100, scored)["cache_bookkeeping"] == 4 * 101 * 12 * per_token


@pytest.mark.parametrize("layout", [CacheLayout(token_budget=300), CacheLayout(token_budget=300, value_bits=4,
                                    scale_bytes_per_token=16.0, residual_tokens=32),
                                    CacheLayout(token_budget=300, eviction_score="accumulated_attention",
                                                slot_bytes=8, slot_write_bytes=4)])
def test_the_mean_step_and_the_summed_time_are_exact_across_the_step_where_the_budget_fills(layout):
    """Closed forms split where a budget fills (growing, then flat): they equal the step-by-step sums."""
    ctx, steps, batch = 260, 90, 4
    per_step = [analytic.decode_step_flops(SMOLLM2, batch, ctx + i, layout) for i in range(steps)]
    mean = analytic.mean_decode_step(SMOLLM2, FP32, batch, ctx, steps, layout)
    assert mean.flops == pytest.approx(sum(per_step) / steps, rel=1e-12)
    if not layout.residual_tokens:  # the window's sawtooth enters as its mean: exact per step only without one
        step_bytes = [analytic.decode_step_bytes(SMOLLM2, FP32, batch, ctx + i, layout)["total"] for i in range(steps)]
        assert mean.bytes == pytest.approx(sum(step_bytes) / steps, rel=1e-12)
        times = [analytic.decode_step_time(SMOLLM2, FP32, batch, ctx + i, ROOF, layout) for i in range(steps)]
        assert analytic.generate_time(SMOLLM2, FP32, batch, ctx, steps, ROOF, layout) == pytest.approx(sum(times))


def test_eviction_scores_add_their_arithmetic_per_cached_key():
    plain, scored = CacheLayout(token_budget=512), CacheLayout(token_budget=512, eviction_score="current_attention")
    extra = analytic.decode_step_flops(SMOLLM2, 2, 2048, scored) - analytic.decode_step_flops(SMOLLM2, 2, 2048, plain)
    assert extra == 2 * 513 * cache_terms.SCORE_FLOPS_PER_KEY["current_attention"] * SMOLLM2.n_heads * SMOLLM2.n_layers
    for score in ("recency", "observation_window"):  # no per-step score: recency, or chosen once at prefill
        assert analytic.decode_step_flops(SMOLLM2, 2, 2048, dataclasses.replace(plain, eviction_score=score)) == \
            analytic.decode_step_flops(SMOLLM2, 2, 2048, plain)


def test_the_predicted_step_ratio_is_bounded_by_the_cache_share():
    share = cache_share_of_step_bytes(SMOLLM2, FP32, 4, 4096, 64, CONTIGUOUS)
    for layout in (INT4, CacheLayout(token_budget=256), CacheLayout(layers_stored=15), CacheLayout(key_channels_kept=32)):
        ratio = step_bytes_ratio(SMOLLM2, FP32, 4, 4096, 64, layout)
        assert 1 - share < ratio < 1
    assert step_bytes_ratio(SMOLLM2, FP32, 4, 4096, 64, CacheLayout(layers_stored=15)) == pytest.approx(1 - share / 2,
                                                                                                      rel=1e-3)
    figures = compression_figures(SMOLLM2, FP32, 4, 4096, 64, CacheLayout(token_budget=256))
    assert figures["kept_tokens_per_sequence"] == 256 and figures["context_to_match_weights"] is None
    assert compression_figures(SMOLLM2, FP32, 4, 4096, 64, None)["cache_share_of_step_bytes"] is None


def test_the_cli_gives_the_crossover_at_the_batch_asked():
    run = subprocess.run([sys.executable, "-m", "harness.analysis", "model=smollm2_135m", "dtype=float32", "batch=4",
                          "ctx=1024", "decode_tokens=64", "hardware=h200", "strategy=kivi4", "format=json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["context_to_match_weights_exact"] == pytest.approx(2_919, rel=1e-3)
    assert figures["context_to_match_weights"] > 4 * figures["context_to_match_weights_exact"]  # kivi4: 4 bits + scales
    assert 0 < figures["cache_share_of_step_bytes"] < 0.27
    table = subprocess.run([sys.executable, "-m", "harness.analysis", "model=smollm2_135m", "dtype=float32",
                            "batch=4", "hardware=h200"], capture_output=True, text=True, timeout=120).stdout
    assert "what compressing the cache can buy" in table and "context_to_match_weights" in table
