"""The C decode-attention kernel (harness/kernels/csrc/cpu_decode_attention.c) against SDPA; the
kernels' extension: its build cache, its constants, its operators' schemas and fake implementations;
and how `contiguous` chooses and names the kernel."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from harness.kernels import extension
from strategies import StrategyUnavailable
from strategies.caches import cpu_kernel
from strategies.caches.contiguous import C_KERNEL
from tests.conftest import GQA4, STRATEGIES, same_at_thread_counts

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
        got = cpu_kernel.decode_attention(q, table_k, table_v, length, visible=visible)
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


@pytest.mark.parametrize("batch,n_kv,head_dim,length", [(1, 3, 64, 4096), (1, 3, 64, 1024), (1, 3, 128, 1537),
                                                        (2, 1, 64, 8191), (1, 1, 128, 1023), (4, 3, 64, 2048)])
def test_few_pairs_over_a_long_table_split_into_parts_exactly(batch, n_kv, head_dim, length):
    """Fewer (sequence, KV head) pairs than the split's task count (SmolLM2 at batch 1: 3 KV heads) have
    their keys split into parts, each part's softmax merged by its running max and sum: the same result,
    every key once (rows past the length are NaN, never read), and the same bits at 1, 2 and 3 threads
    (the split depends on the pairs and the length only)."""
    generator = torch.Generator().manual_seed(length)
    table_k = torch.randn(batch, n_kv, length + 5, head_dim, generator=generator) * 3  # [B, n_kv, S, D]
    table_v = torch.randn(batch, n_kv, length + 5, head_dim, generator=generator)
    table_k[:, :, length:] = float("nan")
    q = torch.randn(batch, n_kv, 3, head_dim, generator=generator)  # [B, n_kv, G, D]
    expected = F.scaled_dot_product_attention(q, table_k[:, :, :length], table_v[:, :, :length])
    torch.testing.assert_close(cpu_kernel.decode_attention(q, table_k, table_v, length), expected, rtol=1e-5, atol=1e-5)
    assert same_at_thread_counts(lambda: cpu_kernel.decode_attention(q, table_k, table_v, length))


@pytest.mark.parametrize("head_dim,group,visible", [(64, 2, 700), (128, 4, 700), (64, 4, 300), (40, 4, 700),
                                                    (16, 2, 700), (24, 3, 250)])
def test_the_output_does_not_depend_on_the_thread_count(head_dim, group, visible):
    """One task per (sequence, KV head), computed in the same order whichever thread takes it: 1, 2 and 3
    threads give the same bits, on the fixed-width path (64, 128) and the generic one, masked or not."""
    generator = torch.Generator().manual_seed(head_dim)
    k, v = (torch.randn(3, 2, 700, head_dim, generator=generator) for _ in range(2))  # [B, n_kv, S, D]
    q = torch.randn(3, 2, group, head_dim, generator=generator)  # [B, n_kv, G, D]
    assert same_at_thread_counts(lambda: cpu_kernel.decode_attention(q, k, v, 700, visible))


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """-ffast-math at link time would add a constructor that flushes denormals to zero process-wide."""
    assert cpu_kernel.unavailable(CPU, torch.float32) is None  # loaded by now
    assert (torch.tensor([1e-39]) * 1.0).item() > 0.0


def test_one_openmp_runtime_serves_torch_and_the_kernel():
    assert cpu_kernel.unavailable(CPU, torch.float32) is None
    assert len(extension._openmp_runtimes()) == 1


def test_large_scores_do_not_overflow():
    """The online softmax subtracts the running max: scores of ~1e4 would overflow a naive exp."""
    generator = torch.Generator().manual_seed(0)
    k = 100 * torch.randn(1, 2, 300, 64, generator=generator)
    v = torch.randn(1, 2, 300, 64, generator=generator)
    q = 100 * torch.randn(1, 2, 4, 64, generator=generator)
    got = cpu_kernel.decode_attention(q, k, v, 300)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v), rtol=1e-4, atol=1e-4)


def test_a_built_extension_is_reused():
    """A second process loads the cached build: nothing is compiled, nothing is added to the cache."""
    assert cpu_kernel.unavailable(CPU, torch.float32) is None
    folder = extension.cache_dir() / f"{extension.NAMESPACE}-{extension.build_key(extension.compiler())}"
    library = folder / f"{extension.NAMESPACE}.so"
    built_at, entries = library.stat().st_mtime_ns, sorted(extension.cache_dir().iterdir())
    code = "import torch; from harness.kernels import extension; assert extension.EXTENSION.unavailable() is None"
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())
    assert library.stat().st_mtime_ns == built_at and sorted(extension.cache_dir().iterdir()) == entries


def test_every_source_file_is_part_of_the_build_key(tmp_path):
    """A header edited (vector.h, included through cpu_attention_fixed.h) keys another build instead of
    loading a binary of the old code; so does another compiler."""
    copy = tmp_path / "csrc"
    shutil.copytree(extension.SOURCE_DIR, copy)
    key = extension.build_key("c++", copy)
    assert key == extension.build_key("c++", extension.SOURCE_DIR)
    (copy / "vector.h").write_text((copy / "vector.h").read_text() + "\n")
    assert extension.build_key("c++", copy) != key
    assert extension.build_key("g++", extension.SOURCE_DIR) != key


def test_a_failed_build_names_the_compiler_and_leaves_nothing(monkeypatch, tmp_path):
    """Nothing but the build's lock file (kept: deleting a lock another process may be waiting on would
    let two processes build at once)."""
    monkeypatch.setenv(extension.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="false could not build the kernels"):
        extension.build_and_load("false")
    assert [path.suffix for path in tmp_path.iterdir()] == [".lock"]


def test_the_constants_come_from_the_extension():
    assert cpu_kernel.unavailable(CPU, torch.float32) is None
    constants = extension.EXTENSION.constants
    assert constants["MAX_GROUP"] == 32 and constants["MAX_DIM"] == 512
    assert sorted(constants[f"FORMAT_{name}"] for name in ("INT8", "INT4", "FP8_E4M3")) == [0, 1, 2]


def test_the_operators_schemas_and_fake_implementations():
    """torch.library.opcheck: each schema says what its operator mutates, and the Meta implementations
    (what torch.compile's fake tensors run) give the CPU kernels' shapes."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 4, 64, generator=generator)  # [B, n_kv, G, D]
    k, v = (torch.randn(2, 2, 40, 64, generator=generator) for _ in range(2))  # [B, n_kv, S, D]
    kernels = extension.ops()
    torch.library.opcheck(kernels.decode_attention.default, (q, k, v, 30, 20))
    torch.library.opcheck(kernels.gemv.default, (torch.randn(3, 64, generator=generator), torch.randn(40, 64)))
    torch.library.opcheck(kernels.rms_norm.default, (torch.randn(3, 64, generator=generator), torch.ones(64), 1e-5))
    pools = [torch.randn(6, 2, 8, 64, generator=generator) for _ in range(2)]  # [n_blocks, n_kv, block_size, D]
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)  # [B, max_blocks]
    torch.library.opcheck(kernels.paged_decode_attention.default, (q, *pools, table, 20))


def test_the_block_operators_schemas_say_what_they_write():
    """attention_output_and_ffn_ writes its residual stream (Tensor(a!)) and nothing else; attention_input
    writes nothing it is given."""
    generator = torch.Generator().manual_seed(1)
    d_model, heads, kv_heads, dim, ffn = 32, 4, 2, 8, 48

    def weight(*shape):
        return torch.randn(*shape, generator=generator) * 0.1

    x = torch.randn(2, 1, d_model, generator=generator)  # [B, T, d_model]
    tables = [torch.randn(16, dim, generator=generator) for _ in range(2)]  # cos, sin [max_len, D]
    kernels = extension.ops()
    torch.library.opcheck(kernels.attention_input.default,
                          (x, torch.ones(d_model), 1e-5, weight((heads + 2 * kv_heads) * dim, d_model), *tables, 3,
                           heads, kv_heads))
    torch.library.opcheck(kernels.attention_output_and_ffn_.default,
                          (x, torch.randn(2, 1, heads, dim, generator=generator), weight(d_model, heads * dim),
                           torch.ones(d_model), 1e-5, weight(2 * ffn, d_model), weight(d_model, ffn)))


def test_the_quantized_operators_schemas_say_what_they_write():
    generator = torch.Generator().manual_seed(2)
    int8 = extension.EXTENSION.constants["FORMAT_INT8"]
    rows = torch.randn(1, 2, 3, 32, generator=generator)  # [B, n_kv, n, D]
    payload, scales = torch.zeros(1, 2, 8, 32, dtype=torch.int8), torch.zeros(1, 2, 8, 1)  # [B, n_kv, S, W], [.., D/span]
    kernels = extension.ops()
    torch.library.opcheck(kernels.quantize_rows_.default, (rows, payload, scales, int8, 32, 2))
    kernels.quantize_rows_(rows, payload, scales, int8, 32, 0)
    window = torch.randn(1, 2, 4, 32, generator=generator)  # [B, n_kv, R, D]
    q = torch.randn(1, 2, 2, 32, generator=generator)  # [B, n_kv, G, D]
    torch.library.opcheck(kernels.quantized_decode_attention.default,
                          (q, payload, scales, payload, scales, window, window, 3, 2, int8, 32, 0))


def test_a_bad_call_says_what_is_wrong():
    assert cpu_kernel.unavailable(CPU, torch.float32) is None
    q, k = torch.randn(1, 1, 64, 64), torch.randn(1, 1, 8, 64)
    with pytest.raises(RuntimeError, match="at most|1 to 32"):
        cpu_kernel.decode_attention(q, k, k, 8)  # 64 query heads per KV head
    with pytest.raises(RuntimeError, match="length"):
        cpu_kernel.decode_attention(q[:, :, :4], k, k, 9)  # past the table


def test_other_devices_and_dtypes_are_refused_with_the_reason():
    assert "CPU kernel" in cpu_kernel.unavailable(torch.device("meta"), torch.float32)
    assert "float32" in cpu_kernel.unavailable(CPU, torch.bfloat16)
    assert "at most 32" in cpu_kernel.CONTIGUOUS_KERNEL.shape_unsupported(64, 128)


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
    monkeypatch.setitem(extension.EXTENSION.__dict__, "_loaded", "no C++ compiler (false) on PATH")
    without = point()
    assert without.strategy.backend == "sdpa" and without.key != with_kernel.key
