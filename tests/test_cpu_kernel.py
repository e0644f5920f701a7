"""The C decode-attention kernel (strategies/cpu_decode_attention.c) against SDPA, its build cache, and
how `contiguous` chooses and names it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.kernels import build
from strategies import StrategyUnavailable, cpu_kernel
from tests.conftest import STRATEGIES
from strategies.contiguous import C_KERNEL
from tests.conftest import GQA4

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(cpu_kernel.unavailable(CPU, torch.float32) is not None,
                                reason=f"the C kernel cannot be built here: {cpu_kernel.unavailable(CPU, torch.float32)}")


def attention_cases():
    # (batch, n_kv, group, head_dim, length): Llama 3's group of 4, other groups (generic path), head
    # widths that are not multiples of 16 (tail path), lengths shorter than, equal to and beyond a block.
    # The limits: 32 query heads per KV head, head_dim 512; head_dim 8 goes through the tail path only.
    yield from [(2, 8, 4, 128, 1000), (1, 2, 4, 64, 1), (3, 2, 1, 32, 64), (2, 2, 8, 24, 65), (1, 4, 16, 40, 130),
                (2, 1, 3, 128, 777), (1, 1, 32, 128, 100), (1, 2, 4, 512, 70), (2, 2, 4, 8, 90)]


@pytest.mark.parametrize("batch,n_kv,group,head_dim,length", list(attention_cases()))
def test_matches_sdpa_over_the_filled_prefix_of_a_larger_table(batch, n_kv, group, head_dim, length):
    generator = torch.Generator().manual_seed(length)
    table_k = torch.randn(batch, n_kv, length + 37, head_dim, generator=generator)  # [B, n_kv, S, D]
    table_v = torch.randn(batch, n_kv, length + 37, head_dim, generator=generator)
    table_k[:, :, length:] = float("nan")  # rows past the filled length must never be read
    q = torch.randn(batch, n_kv, group, head_dim, generator=generator)  # [B, n_kv, G, D]
    expected = F.scaled_dot_product_attention(q, table_k[:, :, :length], table_v[:, :, :length])
    got = cpu_kernel.decode_attention(q, table_k, table_v, length)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch,n_kv,group,head_dim,length", list(attention_cases()))
def test_masked_rows_are_read_but_weigh_nothing(batch, n_kv, group, head_dim, length):
    """static_full's read: all `length` rows, those from `visible` on weighted exactly 0."""
    generator = torch.Generator().manual_seed(length + 1)
    table_k = torch.randn(batch, n_kv, length, head_dim, generator=generator) * 4  # [B, n_kv, S, D]
    table_v = torch.randn(batch, n_kv, length, head_dim, generator=generator)
    q = torch.randn(batch, n_kv, group, head_dim, generator=generator)  # [B, n_kv, G, D]
    for visible in sorted({1, max(1, length // 3), length}):
        expected = F.scaled_dot_product_attention(q, table_k[:, :, :visible], table_v[:, :, :visible])
        got = cpu_kernel.masked_decode_attention(q, table_k, table_v, length, visible=visible)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_long_tables_interleave_their_segments_exactly():
    """Lengths around the interleaved blocks' edges (multiples of 64 and the tail past them), both
    fixed widths: every key counted once, whatever the order the kernel reads them in."""
    generator = torch.Generator().manual_seed(7)
    for head_dim in (64, 128):
        for length in (63, 64, 65, 127, 128, 511, 512, 513, 1000):
            table_k = torch.randn(2, 2, length, head_dim, generator=generator)
            table_v = torch.randn(2, 2, length, head_dim, generator=generator)
            q = torch.randn(2, 2, 4, head_dim, generator=generator)
            expected = F.scaled_dot_product_attention(q, table_k, table_v)
            torch.testing.assert_close(cpu_kernel.decode_attention(q, table_k, table_v, length), expected,
                                       rtol=1e-5, atol=1e-5)


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """-ffast-math at link time would add a constructor that flushes denormals to zero process-wide."""
    assert cpu_kernel.unavailable(CPU, torch.float32) is None  # loaded by now
    assert (torch.tensor([1e-39]) * 1.0).item() > 0.0


def test_one_openmp_runtime_serves_torch_and_the_kernel():
    assert cpu_kernel.unavailable(CPU, torch.float32) is None
    assert len(build._openmp_runtimes()) == 1


def test_large_scores_do_not_overflow():
    """The online softmax subtracts the running max: scores of ~1e4 would overflow a naive exp."""
    generator = torch.Generator().manual_seed(0)
    k = 100 * torch.randn(1, 2, 300, 64, generator=generator)
    v = torch.randn(1, 2, 300, 64, generator=generator)
    q = 100 * torch.randn(1, 2, 4, 64, generator=generator)
    got = cpu_kernel.decode_attention(q, k, v, 300)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v), rtol=1e-4, atol=1e-4)


def test_a_built_kernel_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    first = cpu_kernel.CONTIGUOUS_KERNEL.build("gcc")
    built_at = first.stat().st_mtime_ns
    assert cpu_kernel.CONTIGUOUS_KERNEL.build("gcc") == first and first.stat().st_mtime_ns == built_at
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_every_included_header_is_part_of_the_build_key(monkeypatch, tmp_path):
    """A header included through another (vector.h through cpu_attention_fixed.h) keys the build too:
    editing it builds the kernel again instead of loading a binary of the old code."""
    kernel = build.CKernel(tmp_path / "probe.c", {})
    (tmp_path / "probe.c").write_text('#include "local.h"\nvec twice(vec x) { return x + x; }\n')
    (tmp_path / "local.h").write_text('#include "vector.h"\n')
    assert kernel.headers() == [tmp_path / "local.h", build.INCLUDE_DIR / "vector.h"]
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    first = kernel.build("gcc")
    edited = tmp_path / "edited"  # the shared header with one more line: another build
    edited.mkdir()
    (edited / "vector.h").write_text((build.INCLUDE_DIR / "vector.h").read_text() + "\n")
    monkeypatch.setattr(build, "INCLUDE_DIR", edited)
    assert kernel.build("gcc") != first


def test_a_failed_build_names_the_compiler_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="false could not build cpu_decode_attention.c"):
        cpu_kernel.CONTIGUOUS_KERNEL.build("false")
    assert list(tmp_path.iterdir()) == []


def test_other_devices_and_dtypes_are_refused_with_the_reason():
    assert "CPU kernel" in cpu_kernel.unavailable(torch.device("meta"), torch.float32)
    assert "float32" in cpu_kernel.unavailable(CPU, torch.bfloat16)
    assert "at most 32" in cpu_kernel.shape_unsupported(64, 128)


def test_contiguous_names_the_kernel_it_runs():
    assert STRATEGIES["contiguous"]().kernel(CPU, torch.float32, GQA4) == C_KERNEL  # auto: the C kernel
    assert "sdpa" in STRATEGIES["contiguous"]().kernel(CPU, torch.bfloat16, GQA4)  # auto falls back, says so
    assert "sdpa" in STRATEGIES["contiguous"](backend="sdpa").kernel(CPU, torch.float32, GQA4)
    with pytest.raises(StrategyUnavailable, match="float32"):  # asked for explicitly: skipped, not replaced
        STRATEGIES["contiguous"](backend="c").kernel(CPU, torch.bfloat16, GQA4)


def test_a_points_key_names_the_kernel_auto_chose(monkeypatch, tmp_path):
    """backend=auto depends on a compiler being there: the point records what it resolved to, so a
    resumed sweep on a machine without one never reuses a row the C kernel measured, or back."""
    from tests.conftest import planned_point

    def point(*overrides):
        return planned_point("model=tiny", *overrides)

    with_kernel = point()
    assert with_kernel.strategy.backend == "c"
    assert point("dtype=bfloat16").strategy.backend == "sdpa"
    monkeypatch.setitem(cpu_kernel.CONTIGUOUS_KERNEL.__dict__, "_loaded", "no C compiler (false) on PATH")
    without = point()
    assert without.strategy.backend == "sdpa" and without.key != with_kernel.key
