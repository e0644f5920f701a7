"""The C kernels of this checkout against another revision's, in one process: outputs compared bit for
bit, then every kernel's calls timed together in rounds.

The other revision's `harness/kernels/csrc/` (read with `git show REV:...`) is built as a second
extension beside this checkout's, with this checkout's compiler and flags (harness.kernels.extension),
its operator namespace renamed `harness_kernels_against` and its C entry points prefixed, so both load
into one process. Each case is one kernel at one shape, on seeded inputs: both extensions are called
on the same tensors and their outputs compared (`equal`, or the largest difference), then the two
calls are timed through the harness's timing engine (harness.measure.rounds: one call of each a round,
the order alternating, each call a loop of `--calls` kernel calls), and the case prints both medians
and this checkout's time over the other's, the median of the round-by-round ratios with its bootstrap
interval. A ratio below 1 is this checkout faster.

The figures behind docs/performance.md's "The kernels as one library". Run it under the machine's lock:

    flock /tmp/cpu.lock python scripts/kernels_ab.py [--against main] [--rounds 40] [--only paged]
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from harness.kernels import extension
from harness.measure.rounds import RoundsOptions, time_rounds

AGAINST = f"{extension.NAMESPACE}_against"  # the other revision's operator namespace
REPO_ROOT = Path(__file__).resolve().parent.parent


def build_against(revision: str) -> str:
    """Build `revision`'s csrc/ as the extension AGAINST (cached by the revision's commit and the build
    key of its sources) and load it; returns the commit."""
    from torch.utils import cpp_extension

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, check=True, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", revision).strip()
    csrc = extension.SOURCE_DIR.relative_to(REPO_ROOT).as_posix()
    sources = Path(tempfile.gettempdir()) / f"kernels_ab-{commit}" / "csrc"
    sources.mkdir(parents=True, exist_ok=True)
    for name in git("ls-tree", "--name-only", f"{commit}:{csrc}").split():
        text = git("show", f"{commit}:{csrc}/{name}")
        (sources / name).write_text(text.replace(extension.NAMESPACE, AGAINST) if name == "ops.cpp" else text)
    entry_points = re.findall(r"^void (\w+)\(", (sources / "kernels.h").read_text(), re.MULTILINE)
    renames = [f"-D{name}=against_{name}" for name in entry_points]
    build = sources.parent / f"build-{extension.build_key(extension.compiler(), sources)}"
    build.mkdir(exist_ok=True)
    cpp_extension.load(AGAINST, [str(path) for path in sorted(sources.iterdir()) if path.suffix in (".c", ".cpp")],
                       extra_cflags=[*extension.COMPILE_FLAGS, *renames], extra_ldflags=list(extension.LINK_FLAGS),
                       build_directory=str(build), is_python_module=False)
    return commit


def attention_inputs(batch: int, n_kv: int, group: int, head_dim: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_kv, group, head_dim, generator=generator)  # [B, n_kv, G, D]
    k, v = (torch.randn(batch, n_kv, length, head_dim, generator=generator) for _ in range(2))  # [B, n_kv, L, D]
    return q, k, v


def paged_inputs(batch: int, n_kv: int, group: int, head_dim: int, length: int, block_size: int):
    """q and k/v scattered through head-major pools [n_blocks, n_kv, block_size, D] by a shuffled table."""
    q, k, v = attention_inputs(batch, n_kv, group, head_dim, length)
    per_sequence = -(-length // block_size)
    generator = torch.Generator().manual_seed(1)
    table = torch.randperm(batch * per_sequence, generator=generator).view(batch, per_sequence).to(torch.int32)
    pools = []
    for tensor in (k, v):
        padded = torch.nn.functional.pad(tensor, (0, 0, 0, per_sequence * block_size - length))
        blocks = padded.view(batch, n_kv, per_sequence, block_size, head_dim).permute(0, 2, 1, 3, 4)
        pool = torch.zeros(batch * per_sequence, n_kv, block_size, head_dim)
        pool[table.view(-1).long()] = blocks.reshape(-1, n_kv, block_size, head_dim)
        pools.append(pool)
    return q, pools[0], pools[1], table


def quantized_inputs(fmt: str, head_dim: int, length: int, residual: int = 0, group_size: int = 32,
                     key_axis: str = "token", batch: int = 16, n_kv: int = 2, group: int = 2):
    """The arguments of quantized_decode_attention over a cache `quantized` fills with random codes."""
    from strategies.caches.quantization import QuantSpec
    from strategies.caches.quantized import QuantizedLayerCache

    spec = QuantSpec(fmt, group_size, key_axis, residual)
    cache = QuantizedLayerCache(batch, n_kv, length + residual, head_dim, torch.device("cpu"), torch.float32, spec,
                                use_c_kernel=True)
    cache.fill_random(length, torch.Generator().manual_seed(2))
    q = torch.randn(batch, n_kv, group, head_dim, generator=torch.Generator().manual_seed(3))
    quantized = cache.quantized_length(length)
    return (q, cache.k_payload, cache.k_scales, cache.v_payload, cache.v_scales, cache.k_window, cache.v_window,
            quantized, length - quantized, cache._c_format, cache._span, residual if key_axis == "channel" else 0)


def block_inputs(batch: int, d_model: int = 512, heads: int = 8, kv_heads: int = 2, ffn: int = 1536):
    """cpu_small's decoder block at `batch` rows: attention_input's and attention_output_and_ffn_'s arguments."""
    generator = torch.Generator().manual_seed(4)
    dim = d_model // heads

    def weight(*shape):
        return torch.randn(*shape, generator=generator) * 0.05

    x = torch.randn(batch, 1, d_model, generator=generator)  # [B, T, d_model]
    tables = [torch.randn(64, dim, generator=generator) for _ in range(2)]  # cos, sin [max_len, D]
    attention_input = (x, torch.ones(d_model), 1e-5, weight((heads + 2 * kv_heads) * dim, d_model), *tables, 3,
                       heads, kv_heads)
    output_and_ffn = (x, torch.randn(batch, 1, heads, dim, generator=generator), weight(d_model, heads * dim),
                      torch.ones(d_model), 1e-5, weight(2 * ffn, d_model), weight(d_model, ffn))
    return attention_input, output_and_ffn


def cases():
    """(name, operator, arguments builder, outputs): each kernel's main paths at the shapes the harness runs."""
    def attention(*shape, visible=None):
        q, k, v = attention_inputs(*shape)
        return q, k, v, shape[-1], visible or shape[-1]

    def quantize(fmt, span):
        generator = torch.Generator().manual_seed(5)
        x = torch.randn(16, 2, 1, 64, generator=generator)  # [B, n_kv, n, D]: a step's new rows
        width = 32 if fmt == "int4" else 64
        payload = torch.zeros(16, 2, 2048, width, dtype=torch.uint8)
        scales = torch.zeros(16, 2, 2048, 64 // span)
        code = {"int8": 0, "int4": 1, "fp8_e4m3": 2}[fmt]
        return x, payload, scales, code, span, 1000

    def gemv(rows, out_features, in_features):
        generator = torch.Generator().manual_seed(6)
        return torch.randn(rows, in_features, generator=generator), torch.randn(out_features, in_features, generator=generator)

    blocks = {batch: block_inputs(batch) for batch in (1, 4)}
    yield "decode D=64 G=2 B=16 L=2048 (bench heavy)", "decode_attention", lambda: attention(16, 2, 2, 64, 2048)
    yield "decode D=128 G=4 B=4 L=4096 (Llama 3 8B)", "decode_attention", lambda: attention(4, 8, 4, 128, 4096)
    yield "decode D=64 masked L=4096 visible=1024", "decode_attention", lambda: attention(4, 2, 4, 64, 4096, visible=1024)
    yield "decode D=16 G=2 B=16 L=2048 (generic)", "decode_attention", lambda: attention(16, 2, 2, 16, 2048)
    yield "decode D=80 G=4 B=4 L=2048 (generic)", "decode_attention", lambda: attention(4, 2, 4, 80, 2048)
    yield "decode D=80 masked L=4096 visible=1024", "decode_attention", lambda: attention(4, 2, 4, 80, 4096, visible=1024)
    yield "paged D=64 G=2 B=16 L=2048 block 16", "paged_decode_attention", lambda: (*paged_inputs(16, 2, 2, 64, 2048, 16), 2048)
    yield "paged D=128 G=4 B=4 L=4096 block 16", "paged_decode_attention", lambda: (*paged_inputs(4, 8, 4, 128, 4096, 16), 4096)
    yield "paged D=16 G=2 B=16 L=2048 block 16 (generic)", "paged_decode_attention", lambda: (*paged_inputs(16, 2, 2, 16, 2048, 16), 2048)
    yield "paged D=80 G=4 B=4 L=2048 block 32 (generic)", "paged_decode_attention", lambda: (*paged_inputs(4, 2, 4, 80, 2048, 32), 2048)
    for fmt in ("int8", "int4", "fp8_e4m3"):
        yield f"quantized {fmt} D=64 L=2048", "quantized_decode_attention", lambda fmt=fmt: quantized_inputs(fmt, 64, 2048)
    yield "quantized int8 D=128 G=4 L=2048", "quantized_decode_attention", lambda: quantized_inputs("int8", 128, 2048, group=4, batch=4, n_kv=8)
    yield "quantized int4 KIVI D=64 L=2048 residual 32", "quantized_decode_attention", lambda: quantized_inputs("int4", 64, 2048, 32, key_axis="channel")
    yield "quantized int8 D=16 L=2048 (generic)", "quantized_decode_attention", lambda: quantized_inputs("int8", 16, 2048)
    yield "quantized int4 D=64 group 16 L=2048 (generic)", "quantized_decode_attention", lambda: quantized_inputs("int4", 64, 2048, group_size=16)
    yield "quantized fp8 D=80 L=2048 residual 32 (generic)", "quantized_decode_attention", lambda: quantized_inputs("fp8_e4m3", 80, 2048, 32)
    for fmt, span in (("int8", 64), ("int4", 32), ("fp8_e4m3", 64)):
        yield f"quantize_rows_ {fmt} B=16", "quantize_rows_", lambda fmt=fmt, span=span: quantize(fmt, span)
    for rows in (1, 4, 16):
        yield f"gemv {rows} x 512 @ 1536 x 512", "gemv", lambda rows=rows: gemv(rows, 1536, 512)
    yield "rms_norm 4 x 512", "rms_norm", lambda: (torch.randn(4, 512, generator=torch.Generator().manual_seed(7)), torch.ones(512), 1e-5)
    for batch, (attention_input, output_and_ffn) in blocks.items():
        yield f"attention_input cpu_small b={batch}", "attention_input", lambda a=attention_input: a
        yield f"attention_output_and_ffn_ cpu_small b={batch}", "attention_output_and_ffn_", lambda a=output_and_ffn: a


def result_of(op: str, args: tuple, namespace: str):
    """Call the operator of `namespace` on fresh copies of the tensors it writes; what it produced."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    out = getattr(getattr(torch.ops, namespace), op)(*args)
    if op == "quantize_rows_":
        return args[1], args[2]
    if op == "attention_output_and_ffn_":
        return (args[0],)
    return (out,)


def difference(ours, theirs) -> str:
    if all(torch.equal(a, b) for a, b in zip(ours, theirs)):
        return "equal"
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs))
    return f"differ (max |diff| {worst:.2e})"


def loop(op: str, args: tuple, namespace: str, calls: int):
    kernel = getattr(getattr(torch.ops, namespace), op)
    return lambda: [kernel(*args) for _ in range(calls)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="main", help="the revision whose csrc/ to compare with")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=0.004, help="about how long one timed loop of calls takes")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    parser.add_argument("--no-timing", action="store_true", help="compare the outputs only")
    args = parser.parse_args()
    if (reason := extension.EXTENSION.unavailable()) is not None:
        sys.exit(f"this checkout's kernels cannot run here: {reason}")
    commit = build_against(args.against)
    print(f"this checkout vs {args.against} ({commit}); torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"command: {shlex.join(sys.argv)}")
    with torch.inference_mode():
        for name, op, inputs in cases():
            if args.only not in name:
                continue
            arguments = inputs()
            verdict = difference(result_of(op, arguments, extension.NAMESPACE), result_of(op, arguments, AGAINST))
            if args.no_timing:
                print(f"{name:48s} {verdict}")
                continue
            kernel = getattr(torch.ops.harness_kernels, op)
            probe = time_rounds({"probe": lambda: kernel(*arguments)}, RoundsOptions(rounds=5, read_contention=False))
            calls = max(1, round(args.seconds / probe.median("probe").median))
            rounds = time_rounds({"this": loop(op, arguments, extension.NAMESPACE, calls),
                                  "against": loop(op, arguments, AGAINST, calls)},
                                 RoundsOptions(rounds=args.rounds, reference="against", warmup=2))
            ratio = rounds.ratio("this")
            print(f"{name:48s} {verdict:28s} this {rounds.median('this').median / calls * 1e6:9.1f} us  "
                  f"against {rounds.median('against').median / calls * 1e6:9.1f} us  "
                  f"ratio {ratio.median:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]  "
                  f"(contention {rounds.contention:.0%}, {calls} calls a loop)")


if __name__ == "__main__":
    main()
