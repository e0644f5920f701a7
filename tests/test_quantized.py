"""The `quantized` strategy: its quantization functions, residual window, byte accounting, C kernel
against the torch dequantize + SDPA reference, and how far it moves generation from the exact cache."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.config import ModelConfig
from strategies.caches.attention import KERNEL_NAME as SDPA_KERNEL
from strategies.base import StrategyOptionError, StrategyUnavailable
from strategies.caches.contiguous import ContiguousStrategy
from strategies.caches.quantization import (
    QuantSpec, dequantize_per_channel, dequantize_per_token, pack_int4, quantize_per_channel,
    quantize_per_token, unpack_int4,
)
from strategies.caches.quantized import QUANTIZED_KERNEL, QuantizedLayerCache, QuantizedStrategy
from tests.conftest import GQA4, TINY, cpu_model, same_at_thread_counts

CPU = torch.device("cpu")
C_REASON = QUANTIZED_KERNEL.unavailable(CPU, torch.float32)
needs_c = pytest.mark.skipif(C_REASON is not None, reason=f"the quantized C kernel cannot be built here: {C_REASON}")
E4M3_MANTISSA_BITS, E4M3_SUBNORMAL_STEP = 3, 2.0**-9


def random_rows(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * torch.rand(shape[:-1] + (1,), generator=generator) * 3


# ---- quantization functions ----

@pytest.mark.parametrize("fmt,span", [("int8", 64), ("int4", 16), ("int4", 64)])
def test_integer_round_trip_is_within_half_a_scale_step(fmt, span):
    x = random_rows(3, 2, 50, 64)  # [B, n_kv, T, D]
    payload, scales = quantize_per_token(x, fmt, span)
    assert scales.shape == (3, 2, 50, 64 // span)
    error = (dequantize_per_token(payload, scales, fmt) - x).abs().unflatten(-1, (-1, span))  # [..., groups, span]
    assert (error <= scales[..., None] / 2 * (1 + 1e-5)).all()
    assert (scales > 0).all() and error.max() > 0  # a real quantization, not a copy


def test_fp8_round_trip_is_within_e4m3_rounding():
    x = random_rows(3, 2, 50, 64)
    payload, scales = quantize_per_token(x, "fp8_e4m3", 64)
    assert payload.dtype == torch.float8_e4m3fn
    error = (dequantize_per_token(payload, scales, "fp8_e4m3") - x).abs()
    # Normal numbers: half an ulp of a 3-bit mantissa; subnormals: half the subnormal step, in scale units.
    bound = x.abs() * 2.0**-(E4M3_MANTISSA_BITS + 1) + scales * E4M3_SUBNORMAL_STEP / 2  # scales [..., 1]
    assert (error <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_channel_axis_round_trip_is_within_half_a_step_per_channel(fmt):
    x = random_rows(2, 2, 48, 16)
    payload, scales = quantize_per_channel(x, fmt, block=16)
    assert scales.shape == (2, 2, 3, 16)  # one scale per channel per block of 16 tokens
    error = (dequantize_per_channel(payload, scales, fmt) - x).abs().unflatten(-2, (3, 16))  # [..., blocks, T, D]
    assert (error <= scales[..., None, :] / 2 * (1 + 1e-5)).all()


def test_int4_packing_is_exact_for_all_16_values_in_both_nibbles():
    values = torch.arange(-8, 8, dtype=torch.int8)
    pairs = torch.cartesian_prod(values, values)  # [256, 2]: every (low, high) combination
    packed = pack_int4(pairs)
    assert packed.dtype == torch.uint8 and packed.shape == (256, 1)
    assert sorted(packed.flatten().tolist()) == list(range(256))  # every byte, each once
    assert packed[0].item() == 0 and packed[-1].item() == 0xFF  # (-8, -8) -> 0x00, (7, 7) -> 0xFF
    assert pack_int4(torch.tensor([[-8, 7]], dtype=torch.int8)).item() == 0xF0  # channel 0 low, channel 1 high
    torch.testing.assert_close(unpack_int4(packed), pairs, rtol=0, atol=0)


def test_an_all_zero_row_quantizes_to_zeros_not_nan():
    payload, scales = quantize_per_token(torch.zeros(2, 8), "int8", 8)
    assert (scales == 0).all() and (dequantize_per_token(payload, scales, "int8") == 0).all()


# ---- the layer cache: residual window, bytes ----

def test_window_tokens_are_bit_exact_and_a_block_is_quantized_exactly_when_it_fills():
    spec = QuantSpec("int8", residual=4)
    cache = QuantizedLayerCache(1, 2, 16, 8, CPU, torch.float32, spec)
    tokens = random_rows(1, 2, 11, 8)  # [B, n_kv, T, D]
    cache.write(tokens[:, :, :6], tokens[:, :, :6], 0)  # a prompt of 6: one block quantized, 2 in the window
    for position in range(6, 11):
        k, v = cache.read(position)
        quantized = cache.quantized_length(position)
        assert quantized == position - position % 4
        assert torch.equal(k[:, :, quantized:], tokens[:, :, quantized:position])  # the window: bit-exact
        expected_payload, expected_scales = spec.quantize_keys(tokens[:, :, :quantized])
        assert torch.equal(cache.k_payload[:, :, :quantized], expected_payload)
        assert torch.equal(cache.k_scales[:, :, :quantized], expected_scales)
        assert (cache.k_payload[:, :, quantized:] == 0).all()  # nothing of the window in the table yet
        assert not torch.equal(k[:, :, :quantized], tokens[:, :, :quantized])  # the blocks were quantized
        cache.write(tokens[:, :, position:position + 1], tokens[:, :, position:position + 1], position)


@pytest.mark.parametrize("options", [
    dict(format="int8"), dict(format="int4", group_size=8), dict(format="fp8_e4m3", residual=8),
    dict(format="int4", group_size=16, key_axis="channel", residual=16),
    dict(format="int8", key_axis="channel", residual=4),
])
def test_bytes_are_payload_scales_and_window_as_the_cache_layout_says(options):
    strategy = QuantizedStrategy(backend="torch", **options)
    batch, max_len = 3, 64  # max_len a multiple of residual: channel scales are exact per token then
    session = strategy.new_session(cpu_model(TINY), batch, max_len)
    layout = strategy.cache_layout(TINY)
    head_dim, kv_heads_layers = TINY.resolved_head_dim, TINY.n_layers * TINY.n_kv_heads
    stored_per_token = kv_heads_layers * (2 * head_dim * layout.value_bits / 8 + layout.scale_bytes_per_token)
    window = kv_heads_layers * 2 * head_dim * 4 * layout.residual_tokens  # fp32, allocated whole
    assert session.kv_cache_bytes == batch * (max_len * stored_per_token + window)
    assert layout.residual_tokens == options.get("residual", 0)


def test_cache_layout_scale_bytes():
    assert QuantizedStrategy(format="int8").cache_layout().scale_bytes_per_token == 8  # 4 for K, 4 for V
    assert QuantizedStrategy(format="fp8_e4m3").cache_layout().value_bits == 8
    int4 = QuantizedStrategy(format="int4", group_size=32).cache_layout(ModelConfig(
        name="d128", vocab_size=8, d_model=1024, n_layers=1, n_heads=8, n_kv_heads=2, ffn_dim=8))
    assert (int4.value_bits, int4.scale_bytes_per_token) == (4, 2 * 4 * 128 / 32)
    kivi = QuantizedStrategy(format="int4", group_size=8, key_axis="channel", residual=32).cache_layout(TINY)
    assert kivi.scale_bytes_per_token == 4 * 16 / 32 + 4 * 16 / 8  # K: D per 32 tokens; V: D/8 per token
    with pytest.raises(ValueError, match="head_dim"):
        QuantizedStrategy(format="int4").cache_layout()


# ---- the C kernel against the torch reference ----

def kernel_cases():
    # (format, group_size, key_axis, residual, batch, n_kv, group, head_dim, length): the vector path
    # (head_dim and span multiples of 32) and the generic one, Llama's group of 4 and others, partial
    # blocks, windows partly filled and empty.
    yield from [("int8", 32, "token", 0, 2, 2, 4, 64, 100), ("int8", 32, "token", 0, 1, 3, 5, 40, 77),
                ("int4", 32, "token", 0, 2, 2, 4, 64, 100), ("int4", 8, "token", 0, 2, 2, 2, 16, 65),
                ("int4", 64, "token", 0, 1, 2, 1, 128, 33), ("fp8_e4m3", 32, "token", 0, 2, 2, 4, 64, 100),
                ("fp8_e4m3", 32, "token", 0, 1, 1, 3, 24, 50), ("int8", 32, "token", 16, 2, 2, 4, 64, 90),
                ("int8", 32, "token", 16, 1, 2, 4, 64, 96), ("int4", 32, "channel", 32, 2, 2, 4, 64, 110),
                ("int4", 8, "channel", 8, 1, 2, 2, 16, 43), ("fp8_e4m3", 32, "channel", 16, 2, 1, 8, 64, 70),
                ("int8", 32, "channel", 8, 1, 2, 32, 8, 30)]
    # The vector path's tiles: heads in slices of 4, 2 or 1 (group 2 is the benchmarks' shape), rows past
    # a partial tile, blocks of 64 and their tails, value slices of 1..4 chunks (head_dim 96: 3), query
    # groups of 8 and more (value accumulators for 8 heads), key blocks shorter than a tile and not
    # dividing the kernel's block (channel axis).
    yield from [("int8", 32, "token", 0, 2, 2, 2, 64, 300), ("int4", 32, "token", 0, 2, 2, 2, 64, 300),
                ("fp8_e4m3", 32, "token", 0, 2, 2, 2, 64, 300), ("int8", 32, "token", 0, 1, 2, 1, 64, 129),
                ("int4", 32, "token", 0, 1, 1, 3, 96, 71), ("int8", 32, "token", 0, 1, 1, 6, 128, 65),
                ("fp8_e4m3", 32, "token", 0, 1, 1, 8, 32, 17), ("int4", 64, "token", 24, 1, 2, 16, 128, 200),
                ("int8", 32, "token", 32, 2, 1, 2, 64, 250), ("int4", 32, "channel", 4, 1, 2, 2, 64, 150),
                ("int8", 32, "channel", 48, 1, 1, 4, 96, 200), ("fp8_e4m3", 32, "channel", 12, 1, 2, 5, 32, 100),
                ("int4", 32, "token", 0, 1, 1, 32, 64, 40)]
    # Groups of 3 (SmolLM2's 9 query heads over 3 KV heads) and 9: key tiles of 3 heads x 5 rows, their
    # partial tiles, value slices of 3 heads; token and channel scales, with and without a window.
    yield from [("int4", 32, "token", 0, 2, 3, 3, 64, 133), ("int8", 32, "token", 8, 1, 1, 9, 64, 61),
                ("fp8_e4m3", 32, "channel", 16, 1, 2, 3, 64, 77), ("int4", 32, "channel", 32, 1, 1, 3, 128, 90)]


@needs_c
@pytest.mark.parametrize("fmt,group_size,key_axis,residual,batch,n_kv,group,head_dim,length", list(kernel_cases()))
def test_c_kernel_matches_dequantize_then_sdpa(fmt, group_size, key_axis, residual, batch, n_kv, group, head_dim,
                                               length):
    spec = QuantSpec(fmt, group_size, key_axis, residual)
    cache = QuantizedLayerCache(batch, n_kv, length + 40, head_dim, CPU, torch.float32, spec, use_c_kernel=True)
    k, v = random_rows(batch, n_kv, length, head_dim, seed=1), random_rows(batch, n_kv, length, head_dim, seed=2)
    cache.write(k, v, 0)
    quantized = cache.quantized_length(length)
    # Nothing past the filled length may be read: NaN scales, fp8 NaN codes, NaN window slots.
    key_rows = quantized // residual if key_axis == "channel" else quantized
    cache.k_scales[:, :, key_rows:] = float("nan")
    cache.v_scales[:, :, quantized:] = float("nan")
    if fmt == "fp8_e4m3":
        cache.k_payload.view(torch.uint8)[:, :, quantized:] = 0x7F
    if residual:
        cache.k_window[:, :, length - quantized:] = float("nan")
        cache.v_window[:, :, length - quantized:] = float("nan")
    q = random_rows(batch, n_kv, group, head_dim, seed=3)  # [B, n_kv, G, D]
    # The reference in float64 on the values as stored: fp32 SDPA's own error reaches ~2e-5 at head_dim 128.
    expected = F.scaled_dot_product_attention(q.double(), *(t.double() for t in cache.read(length))).float()
    torch.testing.assert_close(cache.c_attention(q, length), expected, rtol=1e-5, atol=1e-5)


@needs_c
@pytest.mark.parametrize("fmt,group_size,key_axis,residual,head_dim", [
    ("int8", 32, "token", 0, 64), ("int4", 32, "token", 16, 64), ("fp8_e4m3", 32, "channel", 16, 64),
    ("int8", 32, "token", 16, 40), ("int4", 8, "token", 0, 16), ("fp8_e4m3", 32, "channel", 8, 24)])
def test_c_kernel_output_does_not_depend_on_the_thread_count(fmt, group_size, key_axis, residual, head_dim):
    """Tasks are handed out one (sequence, KV head) at a time, each computed in one order whichever
    thread takes it: 1, 2 and 3 threads give the same bits, on the vector path (head_dim 64) and the
    generic one, with and without a window."""
    spec = QuantSpec(fmt, group_size, key_axis, residual)
    cache = QuantizedLayerCache(3, 2, 300, head_dim, CPU, torch.float32, spec, use_c_kernel=True)
    cache.write(random_rows(3, 2, 250, head_dim, seed=1), random_rows(3, 2, 250, head_dim, seed=2), 0)
    q = random_rows(3, 2, 4, head_dim, seed=3)  # [B, n_kv, G, D]
    assert same_at_thread_counts(lambda: cache.c_attention(q, 250))


@needs_c
@pytest.mark.parametrize("fmt,group_size", [("int8", 32), ("int4", 32), ("int4", 8), ("fp8_e4m3", 32)])
def test_c_quantize_rows_is_bit_exact_with_quantize_per_token(fmt, group_size):
    """The C backend's writes (quantize_rows) store the bits quantization.quantize_per_token computes:
    rows of all zeros, signed zeros, subnormal scales, values on the codes' rounding ties (int8 and int4:
    halves; fp8: midpoints between neighbouring e4m3 values, at scale 1)."""
    spec = QuantSpec(fmt, group_size)
    head_dim, length = 64, 120
    x = random_rows(2, length, 2, head_dim, seed=4) * 4  # [B, T, n_kv, D] as a step's k before its transpose
    x[0, :3] = 0.0
    x[1, 3, 1, :8] = -0.0
    x[1, 4:8] *= 1e-39
    x[0, 8:16] = torch.randint(-254, 255, (8, 2, head_dim)).float() / 2
    if fmt == "fp8_e4m3":
        codes = torch.arange(0, 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448 - 1 step
        midpoints = torch.cat(((codes[1:] + codes[:-1]) / 2, -(codes[1:] + codes[:-1]) / 2))  # 250 ties
        x[1, 16:20, :, 1:] = midpoints.repeat(3)[:4 * 2 * 63].view(4, 2, 63)
        x[1, 16:20, :, 0] = 448.0  # amax 448: scale 1, so x / s is the tie itself
    k = x.transpose(1, 2)  # [B, n_kv, T, D], a strided view as attend passes it
    cache = QuantizedLayerCache(2, 2, length, head_dim, CPU, torch.float32, spec, use_c_kernel=True)
    cache._store(k[:, :, :100], k[:, :, :100], 0)  # a prompt's rows, then single steps
    for position in range(100, length):
        cache._store(k[:, :, position:position + 1], k[:, :, position:position + 1], position)
    payload, scales = quantize_per_token(k, fmt, spec.span(head_dim))
    for table, table_scales in ((cache.k_payload, cache.k_scales), (cache.v_payload, cache.v_scales)):
        assert torch.equal(table.view(torch.uint8), payload.view(torch.uint8))
        assert torch.equal(table_scales, scales)


# ---- whole sessions ----

def teacher_forced(strategy, model, prompt, tokens):
    """Logits [steps + 1, B, vocab] of a session fed the prompt, then `tokens` [B, steps] one at a time."""
    session = strategy.new_session(model, prompt.shape[0], prompt.shape[1] + tokens.shape[1])
    logits = [session.prefill(prompt)]
    for step in range(tokens.shape[1]):
        logits.append(session.step(tokens[:, step]))
    return torch.stack(logits)


def greedy_reference(model, prompt, steps):
    """The exact cache's greedy tokens [B, steps] and logits [steps + 1, B, vocab]."""
    session = ContiguousStrategy().new_session(model, prompt.shape[0], prompt.shape[1] + steps)
    logits, tokens = [session.prefill(prompt)], []
    for _ in range(steps):
        tokens.append(logits[-1].argmax(-1))
        logits.append(session.step(tokens[-1]))
    return torch.stack(tokens, dim=1), torch.stack(logits)


def prompt_for(shape, batch=4, length=12, seed=0):
    return torch.randint(shape.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [TINY, GQA4], ids=lambda s: s.name)
def test_int8_follows_the_exact_cache_and_int4_moves_further(shape):
    model, prompt, steps = cpu_model(shape), prompt_for(shape), 24
    tokens, exact = greedy_reference(model, prompt, steps)
    picked = exact[:-1].argmax(-1)  # [steps, B]: the exact cache's choices, step by step
    measured = {}
    for fmt in ("int8", "int4"):
        logits = teacher_forced(QuantizedStrategy(format=fmt, group_size=8), model, prompt, tokens)
        agreement = (logits[:-1].argmax(-1) == picked).float().mean().item()
        error = ((logits - exact).abs().mean() / exact.abs().mean()).item()
        measured[fmt] = agreement, error
    print(f"{shape.name}: token agreement, relative logit error: {measured}")
    assert measured["int8"][0] >= 0.9
    assert measured["int4"][1] > 4 * measured["int8"][1]  # 16x coarser steps: clearly further


def test_scales_wrong_by_2x_move_the_logits_far_beyond_quantization_error():
    """The accuracy comparison has teeth: a cache that decodes every value at twice its size is caught."""
    model, prompt, steps = cpu_model(GQA4), prompt_for(GQA4), 8
    tokens, exact = greedy_reference(model, prompt, steps)
    honest = teacher_forced(QuantizedStrategy(format="int8"), model, prompt, tokens)

    strategy = QuantizedStrategy(format="int8")
    session = strategy.new_session(model, prompt.shape[0], prompt.shape[1] + steps)
    broken = [session.prefill(prompt)]
    for cache in session.layer_caches:
        cache.v_scales.mul_(2)  # the planted bug: values written so far decode at twice their size
    for step in range(steps):
        broken.append(session.step(tokens[:, step]))
    broken = torch.stack(broken)
    honest_error = (honest[1:] - exact[1:]).abs().mean()
    assert (broken[1:] - exact[1:]).abs().mean() > 20 * honest_error


def test_the_prompt_attends_in_full_precision():
    model, prompt = cpu_model(GQA4), prompt_for(GQA4)
    exact = ContiguousStrategy().new_session(model, 4, 20).prefill(prompt)
    for options in (dict(format="int4", group_size=8), dict(format="int8", residual=8)):
        quantized = QuantizedStrategy(**options).new_session(model, 4, 20).prefill(prompt)
        torch.testing.assert_close(quantized, exact, rtol=1e-6, atol=1e-6)


@needs_c
@pytest.mark.parametrize("options", [dict(format="int8"), dict(format="int4", group_size=8, residual=4),
                                     dict(format="fp8_e4m3", key_axis="channel", residual=4)])
def test_c_and_torch_backends_generate_alike(options):
    model, prompt = cpu_model(GQA4), prompt_for(GQA4, batch=2)
    tokens, _ = greedy_reference(model, prompt, 10)
    c = teacher_forced(QuantizedStrategy(backend="c", **options), model, prompt, tokens)
    reference = teacher_forced(QuantizedStrategy(backend="torch", **options), model, prompt, tokens)
    torch.testing.assert_close(c, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", pytest.param("c", marks=needs_c)])
@pytest.mark.parametrize("prompt_length", [7, 8, 9])  # the step fills a block, starts one, sits inside one
def test_warm_up_step_rewind_step_equals_one_step(backend, prompt_length):
    model, prompt = cpu_model(TINY), prompt_for(TINY, batch=2, length=prompt_length)
    strategy = QuantizedStrategy(backend=backend, format="int4", group_size=8, key_axis="channel", residual=4)
    token = torch.tensor([3, 5])
    fresh = strategy.new_session(model, 2, 16)
    fresh.prefill(prompt)
    expected = [fresh.step(token), fresh.step(token)]
    warmed = strategy.new_session(model, 2, 16)
    warmed.prefill(prompt)
    warmed.step(token)
    warmed.rewind(prompt_length)
    assert torch.equal(warmed.step(token), expected[0]) and torch.equal(warmed.step(token), expected[1])


def test_a_rewind_past_the_window_is_refused():
    session = QuantizedStrategy(format="int8", residual=4).new_session(cpu_model(TINY), 1, 16)
    session.prefill(prompt_for(TINY, batch=1, length=10))  # the window's slots hold tokens 8, 9, 6, 7
    session.rewind(9)  # keeps token 8 in the window: still there
    with pytest.raises(ValueError, match="residual window"):
        session.rewind(7)  # would keep tokens 4..6 in the window: 4 and 5 were overwritten


@pytest.mark.parametrize("backend", ["torch", pytest.param("c", marks=needs_c)])
@pytest.mark.parametrize("options", [dict(format="fp8_e4m3"), dict(format="int4", group_size=8, residual=4),
                                     dict(format="int8", key_axis="channel", residual=4)])
def test_random_fill_gives_a_valid_cache(backend, options):
    strategy = QuantizedStrategy(backend=backend, **options)
    session = strategy.new_session(cpu_model(TINY), 2, 40)
    session.fill_random(30, torch.Generator().manual_seed(0))
    assert session.length == 30
    cache = session.layer_caches[0]
    quantized = cache.quantized_length(30)
    assert (cache.v_scales[:, :, :quantized] > 0).all() and (cache.v_scales[:, :, quantized:] == 0).all()
    if options["format"] == "fp8_e4m3":
        assert not cache.k_payload[:, :, :quantized].float().isnan().any()
    assert torch.isfinite(session.step(torch.tensor([1, 2]))).all()


@pytest.mark.parametrize("options", [dict(format="fp8_e4m3"), dict(format="int4", group_size=8, residual=4)])
def test_the_torch_backend_runs_in_bfloat16(options):
    model, prompt = cpu_model(TINY, dtype=torch.bfloat16), prompt_for(TINY, batch=2)
    strategy = QuantizedStrategy(**options)
    assert strategy.resolve_backend(CPU, torch.bfloat16, TINY) == "torch"  # the C kernel is fp32 only
    session = strategy.new_session(model, 2, 20)
    logits = session.step(session.prefill(prompt).argmax(-1))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert session.layer_caches[0].v_scales.dtype == torch.float32  # scales stay fp32 whatever the dtype


# ---- options and kernels ----

@pytest.mark.parametrize("options,key", [
    (dict(format="int3"), "strategy.format"), (dict(group_size=0), "strategy.group_size"),
    (dict(group_size=7), "strategy.group_size"), (dict(key_axis="head"), "strategy.key_axis"),
    (dict(key_axis="channel", residual=0), "strategy.key_axis"), (dict(residual=-1), "strategy.residual"),
    (dict(backend="sdpa"), "strategy.backend"),
])
def test_bad_options_are_refused_naming_the_key(options, key):
    with pytest.raises(StrategyOptionError, match=f"^{key}: "):
        QuantizedStrategy(**options)


def test_a_group_size_that_does_not_divide_head_dim_is_refused_before_running():
    strategy = QuantizedStrategy(format="int4", group_size=32)  # TINY's head_dim is 16
    with pytest.raises(StrategyOptionError, match="^strategy.group_size: 32 does not divide head_dim 16"):
        strategy.check_point("compute", TINY, 64)
    with pytest.raises(StrategyOptionError, match="group_size"):
        strategy.new_session(cpu_model(TINY), 1, 8)
    with pytest.raises(StrategyOptionError, match="group_size"):
        strategy.cache_layout(TINY)
    QuantizedStrategy(format="int8", group_size=32).check_point("compute", TINY, 64)  # int8 ignores it


def test_kernels_are_named_and_chosen_by_device_and_dtype():
    strategy = QuantizedStrategy(format="int4", group_size=8)
    assert strategy.kernel(CPU, torch.bfloat16, TINY) == f"torch dequantize (int4) + {SDPA_KERNEL}"
    assert strategy.kernel(torch.device("cuda"), torch.float16, TINY).startswith("torch dequantize")
    with pytest.raises(StrategyUnavailable, match="CPU kernel"):
        QuantizedStrategy(backend="c").kernel(torch.device("cuda"), torch.float32, TINY)
    if C_REASON is None:
        assert strategy.kernel(CPU, torch.float32, TINY).startswith("cpu_quantized_attention.c (fp32, OpenMP), int4")
    assert not QuantizedStrategy.exact and QuantizedStrategy.caches_kv
    assert QuantizedStrategy(format="fp8_e4m3", residual=4).options() == {
        "format": "fp8_e4m3", "group_size": 32, "key_axis": "token", "residual": 4}
