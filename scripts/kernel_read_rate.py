"""Read rate of the C decode-attention kernels alone, against torch.mv over the same bytes, in one process.

The figures behind docs/performance.md's "The C kernels rewritten". Each round times, in turn: the
contiguous kernel on [B, n_kv, L, D] tables, the paged kernel on the same keys and values scattered
through a shuffled block table (block sizes 16 and 64), any other builds of the contiguous kernel
given with --source (an earlier revision: `git show REV:strategies/cpu_decode_attention.c >
/tmp/old.c`), and torch.mv over a matrix of the same bytes (the memory control). Medians over the
rounds, in GB/s of cache read, and each kernel's time against the contiguous kernel's.

Usage: python scripts/kernel_read_rate.py [--batch 16 --kv-heads 2 --group 2 --head-dim 64 --length 8192]
                                          [--rounds 20] [--source /tmp/old.c ...]
"""
import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from harness.kernels import build
from strategies import cpu_kernel
from strategies.paged import paged_decode_attention

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--kv-heads", type=int, default=2)
parser.add_argument("--group", type=int, default=2, help="query heads per KV head")
parser.add_argument("--head-dim", type=int, default=64)
parser.add_argument("--length", type=int, default=8192, help="cached tokens per sequence")
parser.add_argument("--rounds", type=int, default=20)
parser.add_argument("--source", action="append", default=[], help="another build of cpu_decode_attention.c to time")
args = parser.parse_args()

B, NKV, G, D, L = args.batch, args.kv_heads, args.group, args.head_dim, args.length
generator = torch.Generator().manual_seed(0)
k, v = (torch.randn(B, NKV, L, D, generator=generator) for _ in range(2))  # [B, n_kv, L, D]
q = torch.randn(B, NKV, G, D, generator=generator)  # [B, n_kv, G, D]
cache_bytes = k.nbytes + v.nbytes
expected = cpu_kernel.decode_attention(q, k, v, L)


def paged_pools(block_size: int):
    """k and v as head-major pools [n_blocks, n_kv, block_size, D] behind a shuffled block table."""
    blocks_per_sequence = -(-L // block_size)
    table = torch.randperm(B * blocks_per_sequence, generator=generator).view(B, blocks_per_sequence).to(torch.int32)
    padded = blocks_per_sequence * block_size
    pools = []
    for tensor in (k, v):
        pool = torch.zeros(B * blocks_per_sequence, NKV, block_size, D)
        blocks = torch.nn.functional.pad(tensor, (0, 0, 0, padded - L)).view(B, NKV, blocks_per_sequence, block_size, D)
        pool[table.view(-1).long()] = blocks.permute(0, 2, 1, 3, 4).reshape(-1, NKV, block_size, D)
        pools.append(pool)
    return pools[0], pools[1], table


def other_build(source: str):
    """A call of the contiguous kernel built from `source` (the signature with or without `visible`)."""
    text = Path(source).read_text()
    library_path = Path(tempfile.mkdtemp()) / "kernel.so"
    flags = [flag for flag in build.COMPILE_FLAGS if flag != "-c"]
    include = ["-I", str(Path(cpu_kernel.__file__).parent), "-I", str(build.INCLUDE_DIR)]  # the shared headers
    subprocess.run(["gcc", *flags, *include, "-shared", source, "-o", str(library_path), "-lm"], check=True)
    function = ctypes.CDLL(str(library_path)).decode_attention
    with_visible = "int64_t visible" in text
    size = ctypes.c_int64
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, cpu_kernel.STRIDES, ctypes.c_void_p, cpu_kernel.STRIDES,
                         ctypes.c_void_p, size, size, size, size, *([size] if with_visible else []), size,
                         ctypes.c_float, ctypes.c_int]
    strides = ctypes.c_int64 * 3
    out = torch.empty_like(q)

    def call():
        lengths = (L, L) if with_visible else (L,)
        function(q.data_ptr(), k.data_ptr(), strides(*k.stride()[:3]), v.data_ptr(), strides(*v.stride()[:3]),
                 out.data_ptr(), B, NKV, G, *lengths, D, D**-0.5, torch.get_num_threads())
        return out
    return call


kernels = {"contiguous": lambda: cpu_kernel.decode_attention(q, k, v, L)}
for block_size in (16, 64):
    k_pool, v_pool, table = paged_pools(block_size)
    kernels[f"paged{block_size}"] = (lambda kp=k_pool, vp=v_pool, t=table: paged_decode_attention(q, kp, vp, t, L))
for source in args.source:
    kernels[source] = other_build(source)
for name, kernel in kernels.items():
    torch.testing.assert_close(kernel(), expected, rtol=1e-4, atol=1e-4, msg=f"{name} disagrees")
matrix = torch.randn(8192, cache_bytes // 4 // 8192, generator=generator)  # [8192, C]: the cache's bytes
vector = torch.randn(matrix.shape[1], generator=generator)
kernels["torch.mv (memory control)"] = lambda: torch.mv(matrix, vector)

seconds = {name: [] for name in kernels}
for _ in range(args.rounds):
    for name, kernel in kernels.items():
        start = time.perf_counter()
        kernel()
        seconds[name].append(time.perf_counter() - start)
reference = statistics.median(seconds["contiguous"])
print(f"B={B} n_kv={NKV} G={G} D={D} L={L}: {cache_bytes / 2**20:.0f} MiB of cache, {args.rounds} rounds, "
      f"{torch.get_num_threads()} threads")
for name, times in seconds.items():
    median = statistics.median(times)
    print(f"{name:40s} {median * 1e3:8.2f} ms  {cache_bytes / median / 1e9:6.1f} GB/s  {median / reference:6.3f}x contiguous")
