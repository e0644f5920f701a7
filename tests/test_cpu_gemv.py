"""The C small-batch linear (harness/model/cpu_gemv.c), device=cpu: aten's product at every edge of its
tiling, independent of the thread count, and used only where it is meant to be."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.model import cpu_gemv
from tests.conftest import TINY, cpu_model, run_cli

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
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append(cpu_gemv.gemv(x, weight))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


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
    done = run_cli("model=tiny", "matmul=c", "dtype=bfloat16", "device=cpu", f"results_dir={tmp_path}")
    assert done.returncode == 2 and "matmul" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not list(tmp_path.rglob("*.parquet"))


@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 1), (2, 5), (4, 5)])  # the last: more than MAX_ROWS rows
def test_the_rotation_is_the_models_rope(batch, tokens):
    """Through a strided view as the model calls it (q and k of the fused qkv projection), at a position."""
    from harness.model.decoder import RotaryTable

    heads, kv, head_dim, start = 4, 2, 64, 7
    qkv = torch.randn(batch, tokens, heads + 2 * kv, head_dim)  # [B, T, H + 2 kv, D]
    view = qkv[:, :, : heads + kv]  # not contiguous
    reference = RotaryTable(head_dim, 32, 10000.0, torch.device("cpu"), torch.float32)
    tables = cpu_gemv.GemvRotaryTable(head_dim, 32, 10000.0, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(tables.rotate(view, start), reference.rotate(view, start), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, cpu_gemv.MAX_ROWS + 1])
def test_the_activation_is_swiglus(rows):
    from harness.model.decoder import SwiGLU

    reference = SwiGLU(TINY)
    fused = cpu_gemv.GemvSwiGLU(reference)
    x = torch.randn(rows, 1, TINY.d_model)  # [B, T, d_model]
    with torch.no_grad():
        torch.testing.assert_close(fused(x), reference(x), rtol=1e-5, atol=1e-5)


def test_matmul_c_rotates_with_the_c_tables():
    assert isinstance(cpu_model(TINY, matmul="c").rotary_table(8), cpu_gemv.GemvRotaryTable)
    assert type(cpu_model(TINY, matmul="aten").rotary_table(8)).__name__ == "RotaryTable"
