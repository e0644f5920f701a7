"""`paged`: K and V in fixed-size blocks taken from a shared pool as sequences grow (vLLM's PagedAttention).

Per layer, a pool of blocks for K and one for V, and per session one block table [B, max_blocks] of
int32 block ids, shared by every layer as vLLM's is: position p of sequence b lives in block
table[b, p // block_size] at row p % block_size. Why a strategy of its own: a serving engine does not
know how long a sequence will get, so it cannot give it a contiguous table; it hands out blocks as the
sequence crosses block boundaries and attention reads them through the table. What that indirection
costs a decode step is what this strategy measures.

Pool layout, per backend (the kernel that reads the pool decides it):
- `c` and `torch`: head-major, [n_blocks, n_kv, block_size, D], as vLLM's own CUDA paged-attention
  kernel keeps its K cache: one KV head's rows of a block are consecutive (block_size * D floats), so
  the C kernel walks each (sequence, KV head) as runs of whole rows, block after block. Token-major
  (below) puts a head's consecutive rows n_kv * D floats apart, which a C kernel read more slowly. Head dims 64 and 128 take the path the contiguous kernel takes
  (harness/kernels/csrc/cpu_attention_fixed.h, 8 segments of a sequence read in lockstep). The
  gather (`torch`) copies each head's blocks as runs of block_size * D floats, and SDPA then reads
  rows that are contiguous per head.
- `flash_attn`: token-major, [n_blocks, block_size, n_kv, D]: flash_attn_with_kvcache's paged mode
  takes no other.

Allocation, decided here:
- The pool is sized for every sequence at max_len (batch * ceil(max_len / block_size) blocks) and
  zeroed up front, as a serving engine reserves its pool and as `contiguous` touches its table, so the
  memory peak compares like for like. Blocks are handed out lazily from a free list, one per sequence
  as its length crosses a block boundary (a prompt takes all its blocks at once), and `kv_cache_bytes`
  counts the blocks handed out: each sequence rounds up to whole blocks. A session that runs to max_len
  has handed out the whole pool by its last step.
- The free list is a permutation of the pool's block ids drawn from a fixed seed (BLOCK_ORDER_SEED),
  consumed front to back: a sequence's blocks are scattered through the pool in no order, so a kernel
  that ignored the table would read other positions' keys and generate other tokens.
- `rewind` keeps the blocks past the new length: a sequence that is rewound grows back over them
  (warm-up repeats the first decode step), as its cache entries are overwritten. Nothing is returned
  to the free list before the session ends.

Attention kernels (`strategy.backend`; BACKENDS, in preference order, says what each needs):
- `c`: decode steps through `cpu_paged_attention.c` (CPU, fp32), which reads each sequence's blocks in
  place through the table; the prompt goes through gather + SDPA.
- `torch`: any device: the sequence's blocks are gathered into a contiguous [n_kv, B, L, D] copy
  every call (viewed as [B, n_kv, L, D]), then SDPA on the grouped queries (strategies.caches.attention).
  Reads the cache twice and writes it once per step: the cost of paging without a paged kernel.
- `flash_attn`: `flash_attn.flash_attn_with_kvcache(..., block_table=...)` (CUDA, fp16/bf16, the
  flash_attn package): appends the new K/V into the blocks and attends in one launch. FlashAttention 2
  takes paged caches only with block_size a multiple of 256, refused otherwise.
- `auto` (default): `c` where it can run (CPU, fp32, the kernel builds), else `flash_attn` where it
  can run (and block_size is a multiple of 256), else `torch` (strategies.backends). Rows name the
  kernel that ran.
"""
from __future__ import annotations

import math

import torch

from harness.config import CacheLayout
from harness.kernels.extension import Kernel, ops
from harness.model.decoder import SequencePositions
from harness.model.random_fill import PIECE_ELEMENTS, uniform_like_normal_
from strategies.caches.attention import KERNEL_NAME as SDPA_KERNEL
from strategies.caches.attention import grouped_attention
from strategies.backends import Backend
from strategies.base import CachedSession, Strategy, StrategyOptionError
from strategies.caches.pools import SequencePool, grouped_kernel
from strategies.serving import BLOCKS, SequenceMemory, kv_bytes_per_token

BLOCK_ORDER_SEED = 0x9A6ED  # seeds the free list's shuffle: fixed, so every run lays blocks out alike
FLASH_ATTN_BLOCK_MULTIPLE = 256  # FlashAttention 2's paged KV needs page_block_size % 256 == 0
FILL_CHUNK_ELEMENTS = 4 * PIECE_ELEMENTS  # fill_random's staging buffer: 64 MB of fp32 at most

PAGED_KERNEL = Kernel("cpu_paged_attention.c")  # torch.ops.harness_kernels.paged_decode_attention
GATHER_KERNEL = f"gather + {SDPA_KERNEL}"


def flash_attn_block_unmet(block_size: int) -> str | None:
    """Why flash_attn cannot page blocks of `block_size` tokens, or None."""
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return f"flash_attn's paged KV (FlashAttention 2) needs a multiple of {FLASH_ATTN_BLOCK_MULTIPLE}, got {block_size}"
    return None


BACKENDS = (
    Backend("c", f"{PAGED_KERNEL.name} for decode steps, {GATHER_KERNEL} for the prompt", compiled=PAGED_KERNEL),
    Backend("flash_attn", "flash_attn.flash_attn_with_kvcache(block_table)", devices=("cuda",),
            dtypes=("bfloat16", "float16"), package="flash_attn", extra="flash",
            condition=lambda strategy, device: flash_attn_block_unmet(strategy.block_size)),
    Backend("torch", GATHER_KERNEL),
)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                           length: int) -> torch.Tensor:
    """q [B, n_kv, G, D]; k_pool, v_pool head-major [n_blocks, n_kv, block_size, D] (any strides with the
    last dimension contiguous); block_table [B, max_blocks] int32 (its first ceil(length / block_size)
    columns are read) -> [B, n_kv, G, D].

    Softmax(q k^T / sqrt(D)) v over each sequence's positions 0..length-1, read through the table; the
    caller has chosen the `c` backend, whose needs include the kernel's. The operator checks its tensors (shapes, dtypes, that the
    table can hold `length`) and raises with what is wrong.
    """
    return ops().paged_decode_attention(q, k_pool, v_pool, block_table, length)  # checks its tensors


def gather_blocks(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """pool head-major [n_blocks, n_kv, block_size, D], block_table [B, max_blocks] -> [B, n_kv, length, D]:
    a copy of each sequence's first `length` positions in order, gathered head by head into one
    [n_kv, B, positions, D] buffer (each block a run of block_size * D floats) and viewed as
    [B, n_kv, length, D], its rows contiguous per head."""
    batch = block_table.shape[0]
    n_kv, block_size, head_dim = pool.shape[1:]
    used = math.ceil(length / block_size)
    ids = block_table[:, :used].reshape(-1)  # [B * used] sequence-major
    gathered = torch.empty((n_kv, batch * used, block_size, head_dim), device=pool.device, dtype=pool.dtype)
    for head in range(n_kv):  # per head: one index_select along dim 1 of pool.transpose(0, 1) is slower
        torch.index_select(pool[:, head], 0, ids, out=gathered[head])
    rows = gathered.view(n_kv, batch, used * block_size, head_dim)  # [n_kv, B, used * block_size, D]
    return rows[:, :, :length].transpose(0, 1)  # [B, n_kv, length, D]


class BlockTable:
    """The session's block ids per sequence and the free list they come from; shared by all layers."""

    def __init__(self, batch: int, max_len: int, block_size: int, device):
        self.batch, self.block_size = batch, block_size
        self.max_blocks = math.ceil(max_len / block_size)  # blocks a sequence of max_len needs
        self.n_blocks = batch * self.max_blocks  # the pool: every sequence at max_len
        order = torch.randperm(self.n_blocks, generator=torch.Generator().manual_seed(BLOCK_ORDER_SEED))
        self.free = order.to(device=device, dtype=torch.int32)  # [n_blocks] the free list, consumed front to back
        self.handed_out = 0  # entries of `free` taken so far
        # Entries past a sequence's blocks are 0, a valid id: a kernel reading a whole row never faults.
        self.ids = torch.zeros(batch, self.max_blocks, dtype=torch.int32, device=device)  # [B, max_blocks]
        self.blocks_per_sequence = 0  # the same for every sequence: the batch grows in step

    def reserve(self, length: int) -> None:
        """Hand each sequence the blocks positions 0..length-1 need that it does not have yet.

        Called by every layer before it writes; all but the first find the blocks there. The ids are
        copied device to device, so the step stays capturable in a CUDA graph."""
        needed = math.ceil(length / self.block_size)
        if needed <= self.blocks_per_sequence:
            return
        if needed > self.max_blocks:
            raise ValueError(f"{length} tokens need {needed} blocks per sequence; the pool has {self.max_blocks}")
        count = needed - self.blocks_per_sequence
        taken = self.free[self.handed_out:self.handed_out + self.batch * count]  # sequence b takes run b
        self.ids[:, self.blocks_per_sequence:needed] = taken.view(self.batch, count)
        self.handed_out += self.batch * count
        self.blocks_per_sequence = needed

    def slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids and rows in the block, [B * T] each (int64, sequence-major), of positions start..end-1."""
        positions = torch.arange(start, end, device=self.ids.device)  # [T]
        blocks = self.ids[:, positions // self.block_size].long()  # [B, T]
        return blocks.reshape(-1), (positions % self.block_size).repeat(self.batch)


class PagedLayerCache:
    """One layer's K and V pools, read and written through the session's BlockTable: head-major
    [n_blocks, n_kv, block_size, D] for the `c` and `torch` backends, token-major
    [n_blocks, block_size, n_kv, D] for `flash_attn` (the module docstring says why)."""

    def __init__(self, blocks: BlockTable, n_kv_heads: int, head_dim: int, device, dtype, backend: str):
        self.head_major = backend != "flash_attn"
        if self.head_major:
            shape = (blocks.n_blocks, n_kv_heads, blocks.block_size, head_dim)
        else:
            shape = (blocks.n_blocks, blocks.block_size, n_kv_heads, head_dim)
        self.k_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.v_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.blocks = blocks
        self.backend = backend  # "c", "torch" or "flash_attn", resolved by the strategy
        if backend == "flash_attn":
            from flash_attn import flash_attn_with_kvcache  # optional: the flash extra

            self.flash_attn = flash_attn_with_kvcache
            self.seqlens = torch.zeros(blocks.batch, dtype=torch.int32, device=device)  # [B] cached length

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks handed out, K and V: each sequence rounded up to whole blocks."""
        block_bytes = self.k_pool[0].nbytes + self.v_pool[0].nbytes
        return self.blocks.handed_out * block_bytes

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        """Random values in every handed-out block (the session has reserved `length` tokens), in chunks
        staged through a buffer of at most FILL_CHUNK_ELEMENTS, since the blocks are not one slice."""
        ids = self.blocks.ids[:, :self.blocks.blocks_per_sequence].reshape(-1).long()  # [handed out]
        per_chunk = max(1, FILL_CHUNK_ELEMENTS // self.k_pool[0].numel())
        for pool in (self.k_pool, self.v_pool):
            for chunk in ids.split(per_chunk):
                staged = torch.empty((len(chunk), *pool.shape[1:]), device=pool.device, dtype=pool.dtype)
                pool.index_copy_(0, chunk, uniform_like_normal_(staged, 1.0, generator))

    def write(self, k, v, start_pos: int) -> None:
        """Store the new tokens' k/v [B, T, n_kv, D] at positions start_pos.. of the head-major pools."""
        batch, seq_len, n_kv, head_dim = k.shape
        if seq_len == 1:  # a decode step: one column of the table, one row of each of its blocks
            column, offset = divmod(start_pos, self.blocks.block_size)
            ids = self.blocks.ids[:, column].long()  # [B]
            self.k_pool[:, :, offset].index_copy_(0, ids, k[:, 0])  # [n_blocks, n_kv, D] view <- [B, n_kv, D]
            self.v_pool[:, :, offset].index_copy_(0, ids, v[:, 0])
            return
        blocks, rows = self.blocks.slots(start_pos, start_pos + seq_len)  # [B * T] each
        # transpose(1, 2): a token-major view [n_blocks, block_size, n_kv, D] of the head-major pool.
        self.k_pool.transpose(1, 2).index_put_((blocks, rows), k.reshape(-1, n_kv, head_dim))
        self.v_pool.transpose(1, 2).index_put_((blocks, rows), v.reshape(-1, n_kv, head_dim))

    def attend(self, q, k, v, start_pos):
        batch, seq_len, n_heads, head_dim = q.shape
        end = start_pos + seq_len
        self.blocks.reserve(end)
        if self.backend == "flash_attn":
            self.seqlens.fill_(start_pos)
            # q [B, T, H, D], k/v [B, T, n_kv, D] are the kernel's layout; it writes k/v into the blocks at
            # cache_seqlens and attends causally (bottom-right aligned) in the same launch.
            return self.flash_attn(q, self.k_pool, self.v_pool, k=k, v=v, cache_seqlens=self.seqlens,
                                   block_table=self.blocks.ids, causal=True)
        n_kv = k.shape[2]
        self.write(k, v, start_pos)
        if seq_len == 1 and self.backend == "c":
            # Query head h = kv * G + g, as in grouped_attention: [B, 1, H, D] -> [B, n_kv, G, D].
            grouped = q.reshape(batch, n_kv, n_heads // n_kv, head_dim)
            out = paged_decode_attention(grouped, self.k_pool, self.v_pool, self.blocks.ids, end)
            return out.view(batch, 1, n_heads, head_dim)
        k_seq = gather_blocks(self.k_pool, self.blocks.ids, end)  # [B, n_kv, end, D]
        v_seq = gather_blocks(self.v_pool, self.blocks.ids, end)
        return grouped_attention(q, k_seq, v_seq, q_offset=start_pos)


class PagedSession(CachedSession):
    def __init__(self, model, blocks: BlockTable, layer_caches, max_len: int):
        super().__init__(model, layer_caches, max_len)
        self.blocks = blocks

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        """As a prefill of `length` tokens would: reserve their blocks, then fill exactly those blocks."""
        if not 0 < length <= self.max_len:
            raise ValueError(f"cannot fill {length} tokens into a cache of {self.max_len}")
        self.blocks.reserve(length)
        for cache in self.layer_caches:
            cache.fill_random(length, generator)
        self.length = length


class BlockPool(SequencePool):
    """Serving (strategies.caches.pools): every layer's pools of `n_blocks` blocks (the budget), head-major
    as the `c` and `torch` backends keep them, and a block table row per sequence with the blocks
    harness.serve.memory handed it, one more whenever its last block fills. A decode step writes each
    sequence's token into its own block and reads each sequence's blocks in one call of the C kernel
    with a length per sequence (`c`), or, with `torch`, gathers and attends to each sequence in turn."""

    def __init__(self, model, n_blocks: int, block_size: int, max_len: int, use_c: bool, kernel: str):
        super().__init__(model, max_len)
        c = model.cfg
        self.kernel, self.use_c, self.block_size = kernel, use_c, block_size
        self.max_blocks = math.ceil(max_len / block_size)  # blocks the longest sequence takes
        shape = (n_blocks, c.n_kv_heads, block_size, c.resolved_head_dim)
        self.layers = [PagedPoolLayerCache(self, shape, model.device, model.dtype) for _ in range(c.n_layers)]
        self.tables: dict = {}  # seq -> its block ids [max_blocks] int32 (entries past its blocks: 0, a valid id)
        self.counts: dict = {}  # seq -> blocks it holds
        self.block_table = self.lengths = self.blocks = self.offsets = None  # a pass's (before_*), per sequence

    def place(self, seq, placement, reserve):
        row = torch.zeros(self.max_blocks, dtype=torch.int32, device=self.model.device)
        row[:len(placement.ids)] = torch.tensor(placement.ids, dtype=torch.int32)
        self.tables[seq], self.counts[seq] = row, len(placement.ids)

    def release(self, seq):
        del self.tables[seq], self.counts[seq]

    def held_bytes(self, seq):
        layer = self.layers[0]
        return self.counts[seq] * (layer.k_pool[0].nbytes + layer.v_pool[0].nbytes) * len(self.layers)

    def before_prefill(self, seq, start):
        self.block_table = self.tables[seq][None]  # [1, max_blocks]

    def before_decode(self, at):
        self.block_table = torch.stack([self.tables[seq] for seq in self.batch])  # [B, max_blocks]
        self.lengths = at.positions + 1
        column = at.positions // self.block_size
        self.blocks = self.block_table.gather(1, column[:, None])[:, 0].long()  # [B] the block each token goes to
        self.offsets = at.positions % self.block_size  # [B] its row there


class PagedPoolLayerCache:
    """One layer of a BlockPool: its K and V pools [n_blocks, n_kv, block_size, D]."""

    def __init__(self, pool: BlockPool, shape: tuple, device, dtype):
        self.pool = pool
        self.k_pool = torch.zeros(shape, device=device, dtype=dtype)  # zeros: resident from the start
        self.v_pool = torch.zeros(shape, device=device, dtype=dtype)

    def attend(self, q, k, v, start_pos):
        pool = self.pool
        if not isinstance(start_pos, SequencePositions):  # one sequence's prompt chunk [1, T]
            end = start_pos + q.shape[1]
            positions = torch.arange(start_pos, end, device=q.device)
            blocks = pool.block_table[0, positions // pool.block_size].long()
            rows = positions % pool.block_size
            self.k_pool.transpose(1, 2).index_put_((blocks, rows), k[0])  # token-major view <- [T, n_kv, D]
            self.v_pool.transpose(1, 2).index_put_((blocks, rows), v[0])
            return grouped_attention(q, gather_blocks(self.k_pool, pool.block_table, end),
                                     gather_blocks(self.v_pool, pool.block_table, end), q_offset=start_pos)
        self.k_pool[pool.blocks, :, pool.offsets] = k[:, 0]  # [B, n_kv, D]: each token into its own block
        self.v_pool[pool.blocks, :, pool.offsets] = v[:, 0]
        if pool.use_c:
            return grouped_kernel(ops().ragged_paged_decode_attention, q, self.k_pool.shape[1], self.k_pool,
                                  self.v_pool, pool.block_table, pool.lengths)
        return torch.cat([grouped_attention(q[b:b + 1], gather_blocks(self.k_pool, pool.block_table[b:b + 1], length),
                                            gather_blocks(self.v_pool, pool.block_table[b:b + 1], length),
                                            q_offset=length - 1)
                          for b, length in enumerate(pool.lengths.tolist())])


class PagedStrategy(Strategy):
    name = "paged"
    backends = BACKENDS

    def __init__(self, backend: str = "auto", block_size: int = 16):
        super().__init__(backend)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise StrategyOptionError("block_size", f"must be a positive integer (tokens per block), got {block_size!r}")
        if backend == "flash_attn" and (reason := flash_attn_block_unmet(block_size)) is not None:
            raise StrategyOptionError("block_size", f"{reason}; use backend=torch or auto for other sizes")
        self.block_size = block_size

    def options(self) -> dict:
        return {"block_size": self.block_size}

    def cache_layout(self, shape=None) -> CacheLayout:
        return CacheLayout(block_size=self.block_size)

    def serving_unavailable(self) -> str | None:
        if self.backend == "flash_attn":
            return "flash_attn's paged kernel takes one cache_seqlens per call here; serving runs backend=c or torch"
        return None

    def sequence_memory(self, shape, dtype) -> SequenceMemory:
        """A block of block_size tokens of K and V in every layer, taken when the last one fills."""
        return SequenceMemory(kv_bytes_per_token(shape, dtype), BLOCKS, block_tokens=self.block_size)

    def new_pool(self, model, memory, budget_bytes, max_len) -> BlockPool:
        use_c = self.session_backend(model).name == "c"
        kernel = (f"{PAGED_KERNEL.name} ragged (a length per sequence) for decode steps, {GATHER_KERNEL} for prompts"
                  if use_c else f"{GATHER_KERNEL}, one sequence at a time")
        n_blocks = budget_bytes // (memory.bytes_per_token * self.block_size)
        return BlockPool(model, n_blocks, self.block_size, max_len, use_c, kernel)

    def new_session(self, model, batch: int, max_len: int) -> PagedSession:
        c = model.cfg
        backend = self.session_backend(model).name
        blocks = BlockTable(batch, max_len, self.block_size, model.device)
        caches = [PagedLayerCache(blocks, c.n_kv_heads, c.resolved_head_dim, model.device, model.dtype, backend)
                  for _ in range(c.n_layers)]
        return PagedSession(model, blocks, caches, max_len)
