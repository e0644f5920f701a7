"""Read rate of the C decode-attention kernels alone, against torch.mv over the same bytes, in one process.

Each round (harness.measure.rounds)
times, in rotating order: the contiguous kernel on [B, n_kv, L, D] tables, the paged kernel on the same
keys and values scattered through a shuffled block table (block sizes 16 and 64), and torch.mv over a
matrix of the same bytes (the memory control). Medians over the rounds, in GB/s of cache read, and
each kernel's paired ratio to the contiguous kernel's with its interval. To time an earlier revision's kernels, run the script in a worktree of it
(`git worktree add --detach /tmp/before REV`): each checkout builds its own.

Usage: python scripts/kernel_read_rate.py [--batch 16 --kv-heads 2 --group 2 --head-dim 64 --length 8192]
                                          [--rounds 20]
"""
import argparse

import torch

from harness.measure.rounds import RoundsOptions, time_rounds
from strategies.caches import cpu_kernel
from strategies.caches.paged import paged_decode_attention

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--kv-heads", type=int, default=2)
parser.add_argument("--group", type=int, default=2, help="query heads per KV head")
parser.add_argument("--head-dim", type=int, default=64)
parser.add_argument("--length", type=int, default=8192, help="cached tokens per sequence")
parser.add_argument("--rounds", type=int, default=20)
args = parser.parse_args()

if reason := cpu_kernel.unavailable(torch.device("cpu"), torch.float32):  # also builds or loads the kernels
    raise SystemExit(f"the C kernels cannot run here: {reason}")
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


kernels = {"contiguous": lambda: cpu_kernel.decode_attention(q, k, v, L)}
for block_size in (16, 64):
    k_pool, v_pool, table = paged_pools(block_size)
    kernels[f"paged{block_size}"] = (lambda kp=k_pool, vp=v_pool, t=table: paged_decode_attention(q, kp, vp, t, L))
for name, kernel in kernels.items():
    torch.testing.assert_close(kernel(), expected, rtol=1e-4, atol=1e-4, msg=f"{name} disagrees")
matrix = torch.randn(8192, cache_bytes // 4 // 8192, generator=generator)  # [8192, C]: the cache's bytes
vector = torch.randn(matrix.shape[1], generator=generator)
kernels["torch.mv (memory control)"] = lambda: torch.mv(matrix, vector)

rounds = time_rounds(kernels, RoundsOptions(rounds=args.rounds, reference="contiguous"))
print(f"B={B} n_kv={NKV} G={G} D={D} L={L}: {cache_bytes / 2**20:.0f} MiB of cache, {rounds.count} rounds, "
      f"{torch.get_num_threads()} threads, other processes took {rounds.contention:.0%} of the CPUs")
ratios = rounds.ratios()
for name, median in rounds.medians().items():
    ratio = f"{ratios[name].median:6.3f}x [{ratios[name].low:.3f}, {ratios[name].high:.3f}]" if name in ratios else "reference"
    print(f"{name:40s} {median * 1e3:8.2f} ms  {cache_bytes / median / 1e9:6.1f} GB/s  {ratio} contiguous")
