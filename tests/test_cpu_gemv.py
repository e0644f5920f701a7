"""The C small-batch linear (harness/kernels/csrc/cpu_gemv.c), device=cpu: aten's product at every edge of its
tiling, independent of the thread count, and used only where it is meant to be; and the decoder block
it runs in two calls, against the model's own."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.model import cpu_gemv
from tests.conftest import TINY, cpu_model, refused_by_runner, same_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_gemv.unavailable() is not None, reason=f"C linear: {cpu_gemv.unavailable()}")


# (out_features, in_features): whole segments per thread; rows left after the segments; fewer rows than
# STREAMS; in_features not a multiple of any vector width; cpu_small's widest.
SHAPES = [(768, 512), (1000, 512), (7, 64), (33, 17), (512, 1536), (3, 5)]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 16])
def test_the_kernel_computes_the_linear(rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)  # [R, in]
    weight = torch.randn(out_features, in_features, generator=generator)  # [out, in]
    torch.testing.assert_close(cpu_gemv.gemv(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_the_result_does_not_depend_on_the_thread_count():
    x, weight = torch.randn(3, 512), torch.randn(1001, 512)
    assert same_at_thread_counts(lambda: cpu_gemv.gemv(x, weight))


def test_batched_leading_dimensions_are_rows():
    x, weight = torch.randn(2, 3, 64), torch.randn(40, 64)  # [B, T, in]
    torch.testing.assert_close(cpu_gemv.gemv(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_small_calls_run_the_kernel_and_large_ones_aten(monkeypatch):
    linear = cpu_gemv.GemvLinear(torch.nn.Linear(64, 32, bias=False))
    calls = []
    monkeypatch.setattr(cpu_gemv, "gemv", lambda x, weight: calls.append(x.shape) or F.linear(x, weight))
    linear(torch.randn(cpu_gemv.MAX_ROWS, 64))
    linear(torch.randn(1, cpu_gemv.MAX_ROWS + 1, 64))
    assert calls == [torch.Size([cpu_gemv.MAX_ROWS, 64])]


def test_matmul_c_builds_gemv_linears_and_norms_over_the_same_weights():
    from harness.model.decoder import RMSNorm

    model = cpu_model(TINY, matmul="c")
    linears = [m for m in model.modules() if isinstance(m, cpu_gemv.GemvLinear)]
    norms = [m for m in model.modules() if isinstance(m, cpu_gemv.GemvRMSNorm)]
    assert linears and not any(isinstance(m, (torch.nn.Linear, RMSNorm)) for m in model.modules())
    assert len(norms) == 2 * TINY.n_layers + 1
    assert sum(m.weight.numel() for m in linears + norms) == sum(
        p.numel() for name, p in model.named_parameters() if "tok_" not in name)


@pytest.mark.parametrize("rows", [1, 3, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1])
def test_the_norm_is_torchs_rms_norm(rows):
    from harness.model.decoder import RMSNorm

    reference = RMSNorm(96, 1e-5)
    torch.nn.init.uniform_(reference.weight, 0.5, 1.5)
    x = 3 * torch.randn(rows, 1, 96)  # [B, T, dim]
    with torch.no_grad():
        torch.testing.assert_close(cpu_gemv.GemvRMSNorm(reference)(x), reference(x), rtol=1e-5, atol=1e-5)


def test_matmul_c_in_bf16_is_refused_in_one_line(tmp_path):
    line = refused_by_runner("model=tiny", "matmul=c", "dtype=bfloat16", "device=cpu", f"results_dir={tmp_path}")
    assert line.startswith("error: matmul:") and not list(tmp_path.rglob("*.parquet"))


class RecordingCache:
    """A layer cache that keeps what it is given and attends over exactly that (no earlier tokens)."""

    def __init__(self):
        self.given = []

    def attend(self, q, k, v, start_pos):
        from strategies.caches.attention import grouped_attention

        self.given.append((q.clone(), k.clone(), v.clone(), start_pos))
        return grouped_attention(q, k.transpose(1, 2), v.transpose(1, 2), q_offset=0)  # [B, T, H, D]


def block_pair():
    """A model Block with non-trivial norm weights, and a GemvBlock over the same modules."""
    from harness.model.decoder import Block

    block = Block(TINY)
    with torch.no_grad():
        for param in block.parameters():
            torch.nn.init.uniform_(param, 0.5, 1.5) if param.dim() == 1 else torch.nn.init.normal_(param, std=0.1)
    return block, cpu_gemv.GemvBlock(block)


# (batch, tokens): a decode step; several sequences; a short prompt; more rows than MAX_ROWS (the
# block's own modules run).
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 1), (2, 5), (4, 5)])
def test_the_block_is_the_models_block(batch, tokens):
    """The two C calls compute Block.forward: the same q, k, v reach the cache (RoPE at the position),
    and the residual stream comes out the same."""
    from harness.model.decoder import RotaryTable

    block, fused = block_pair()
    rope = RotaryTable(TINY.resolved_head_dim, 32, 10000.0, torch.device("cpu"), torch.float32)
    x = torch.randn(batch, tokens, TINY.d_model)  # [B, T, d_model]
    expected_cache, fused_cache = RecordingCache(), RecordingCache()
    with torch.no_grad():
        expected = block(x.clone(), rope, expected_cache, 7)
        got = fused(x.clone(), rope, fused_cache, 7)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for given, reference in zip(fused_cache.given[0][:3], expected_cache.given[0][:3]):
        torch.testing.assert_close(given, reference, rtol=1e-5, atol=1e-5)


def test_the_block_runs_in_place_and_does_not_depend_on_the_thread_count():
    from harness.model.decoder import RotaryTable

    _, fused = block_pair()
    rope = RotaryTable(TINY.resolved_head_dim, 8, 10000.0, torch.device("cpu"), torch.float32)
    x = torch.randn(3, 1, TINY.d_model)  # [B, T, d_model]

    def block():
        stream = x.clone()
        with torch.no_grad():
            assert fused(stream, rope, RecordingCache(), 2) is stream  # the residual stream, updated in place
        return stream

    assert same_at_thread_counts(block)


def test_matmul_c_wraps_every_block():
    from harness.model.decoder import Block

    model = cpu_model(TINY, matmul="c")
    assert all(isinstance(layer, cpu_gemv.GemvBlock) for layer in model.layers) and len(model.layers) == TINY.n_layers
    assert not any(type(m) is Block for m in model.layers)
    assert not any(isinstance(m, cpu_gemv.GemvBlock) for m in cpu_model(TINY, matmul="aten").modules())


def test_a_compiled_step_calls_the_two_block_ops():
    """Under torch.compile a block is the graph's two ops, not its modules' small operators."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    from strategies.caches.contiguous import ContiguousStrategy

    with torch.inference_mode():
        session = ContiguousStrategy().new_session(cpu_model(TINY, matmul="c"), 2, 16)
        session.fill_random(4, torch.Generator().manual_seed(0))
        graphs = EagerAndRecordGraphs()
        torch.compile(session.step, backend=graphs, fullgraph=True)(torch.zeros(2, dtype=torch.int64))
    code = graphs.graphs[0].code
    assert code.count("harness_kernels.attention_input") == TINY.n_layers
    assert code.count("harness_kernels.attention_output_and_ffn_") == TINY.n_layers
    assert code.count("torch.rms_norm(") == 1  # the final norm's: the blocks' norms run inside their ops
