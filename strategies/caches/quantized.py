"""`quantized`: K and V stored at 8 or 4 bits with fp32 scales (KIVI / vLLM-fp8 style), preallocated
per layer for max_len tokens. Approximate (`exact = False`): the harness measures how far it moves.

Options (conf/strategy/quantized.yaml; the functions are in strategies.caches.quantization):
- `format`: int8 (default; one scale per token and KV head) | int4 (two codes a byte, one scale per
  `group_size` channels) | fp8_e4m3 (torch.float8_e4m3fn, scale amax / 448 per token and KV head).
- `group_size` (int4): channels per scale; must divide head_dim.
- `key_axis`: token (default) | channel (KIVI's keys: one scale per channel per block of `residual`
  tokens; needs residual > 0). Values are always scaled per token.
- `residual`: the most recent tokens kept in the compute dtype (0: every token quantized when written).

Residual window invariant: positions [0, quantized) sit in the quantized tables, quantized =
length - length % residual, and [quantized, length) in the window, position p in slot p % residual. A
block is quantized exactly when it fills, from the window's fp32 rows, and the window is not cleared:
its slots keep the last `residual` tokens written. So `rewind` only sets the length: the tables'
blocks before the rewound length were quantized from the same values and are unchanged, a block that
fills again is quantized again from the same rows, and rewinding to r needs only the tokens
[r - r % residual, r) still in their slots. The cache records which position each slot holds and a
rewind whose tokens were overwritten is refused; warm-up's (step, rewind one step) never is.

Prompt (multi-token calls, every backend): the prompt attends to its own K/V in full precision (as
transformers' QuantizedCache does) and to earlier tokens as stored; its K/V are then quantized into
the tables (all but the window part). Decode steps (what is measured) read only what is stored,
including the new token's quantized K/V when residual is 0.

Attention kernels (`strategy.backend`; BACKENDS, in preference order, says what each needs):
- `c` (CPU, fp32): cpu_quantized_attention.c decodes the codes inside the kernel (a step reads the
  quantized bytes, never a dequantized copy) and reads the window's fp32 rows in the same call (one
  online softmax over both segments). All formats and both key axes. Its quantize_rows also quantizes
  what a step writes to token-axis tables (bit-exact with quantization.quantize_per_token).
- `torch` (any device, dtype): dequantize the filled prefix to the compute dtype, append the window,
  SDPA (strategies.caches.attention).
- `auto` (default): `c` where it can run, else `torch` (strategies.backends). Rows name the kernel that ran.
"""
from __future__ import annotations

import torch

from harness.config import CacheLayout, ModelConfig
from harness.kernels.extension import EXTENSION, Kernel, ops
from harness.model.random_fill import uniform_like_normal_
from strategies.caches import quantization
from strategies.caches.attention import KERNEL_NAME as SDPA_KERNEL
from strategies.caches.attention import grouped_attention
from strategies.backends import Backend
from strategies.base import CachedSession, Strategy, StrategyOptionError
from strategies.caches.quantized_pool import QuantizedArenaPool
from strategies.serving import ARENA, SequenceMemory
from strategies.caches.quantization import FORMATS, KEY_AXES, QuantSpec

QUANTIZED_KERNEL = Kernel("cpu_quantized_attention.c")  # torch.ops.harness_kernels.quantized_decode_attention
FP8_NAN_CODE = 0x7F  # e4m3fn's NaN (with either sign); random payloads must avoid it
# The kernels' names carry the payload format ({format}: the strategy's option).
BACKENDS = (Backend("c", f"{QUANTIZED_KERNEL.name}, {{format}} dequantized in-kernel, for decode steps; "
                         f"{SDPA_KERNEL} for the prompt", compiled=QUANTIZED_KERNEL),
            Backend("torch", f"torch dequantize ({{format}}) + {SDPA_KERNEL}"))


def format_code(fmt: str) -> int:
    """The kernels' code for a payload format (FORMAT_INT8, ... in the extension's constants)."""
    return EXTENSION.constants[f"FORMAT_{fmt.upper()}"]

class QuantizedLayerCache:
    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype, spec: QuantSpec,
                 use_c_kernel: bool = False):
        self.spec, self.dtype = spec, dtype
        fmt, residual = spec.format, spec.residual
        width = quantization.payload_width(fmt, head_dim)
        shape = (batch, n_kv_heads)
        # zeros, not empty: the pages are resident from the start, as contiguous's tables are.
        storage = quantization.STORAGE_DTYPE[fmt]
        self.k_payload = torch.zeros(*shape, max_len, width, device=device, dtype=storage)  # [B, n_kv, S, W]
        self.v_payload = torch.zeros(*shape, max_len, width, device=device, dtype=storage)  # [B, n_kv, S, W]
        groups = head_dim // spec.span(head_dim)
        scale = dict(device=device, dtype=quantization.SCALE_DTYPE)
        self.v_scales = torch.zeros(*shape, max_len, groups, **scale)  # [B, n_kv, S, D/span]
        if spec.key_axis == "channel":  # only whole blocks are ever quantized
            self.k_scales = torch.zeros(*shape, max_len // residual, head_dim, **scale)  # [B, n_kv, S/R, D]
        else:
            self.k_scales = torch.zeros(*shape, max_len, groups, **scale)  # [B, n_kv, S, D/span]
        self.k_window = self.v_window = None
        self.slot_positions = [-1] * residual  # the position each window slot holds (rewind checks them)
        if residual:
            self.k_window = torch.zeros(*shape, residual, head_dim, device=device, dtype=dtype)  # [B, n_kv, R, D]
            self.v_window = torch.zeros(*shape, residual, head_dim, device=device, dtype=dtype)  # [B, n_kv, R, D]
        self.use_c_kernel = use_c_kernel
        # The kernels' format code and span, fixed for the cache's life (read once, not per step).
        self._c_format = format_code(fmt) if use_c_kernel else None
        self._span = spec.span(head_dim)

    def tables(self) -> list[torch.Tensor]:
        return [t for t in (self.k_payload, self.v_payload, self.k_scales, self.v_scales, self.k_window,
                            self.v_window) if t is not None]

    @property
    def nbytes(self) -> int:
        """Payload + scales + window, as allocated."""
        return sum(t.nbytes for t in self.tables())

    def quantized_length(self, length: int) -> int:
        """Tokens of a sequence of `length` held in the quantized tables (the rest are in the window)."""
        residual = self.spec.residual
        return length - length % residual if residual else length

    def _store(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Quantize k, v [B, n_kv, n, D] into table rows start..start+n (whole blocks on the channel axis).
        With the C kernel, token-axis tables are quantized by its quantize_rows (the same bits as
        quantization.quantize_per_token, one call instead of ~12 torch ops a table)."""
        end = start + k.shape[2]
        channel_keys = self.spec.key_axis == "channel"
        if self.use_c_kernel:
            self._c_quantize(v, self.v_payload, self.v_scales, start)
            if not channel_keys:
                self._c_quantize(k, self.k_payload, self.k_scales, start)
                return
        else:
            v_payload, v_scales = self.spec.quantize_values(v)
            self.v_payload[:, :, start:end] = v_payload
            self.v_scales[:, :, start:end] = v_scales
        k_payload, k_scales = self.spec.quantize_keys(k)
        self.k_payload[:, :, start:end] = k_payload
        if channel_keys:
            residual = self.spec.residual
            self.k_scales[:, :, start // residual:end // residual] = k_scales
        else:
            self.k_scales[:, :, start:end] = k_scales

    def _c_quantize(self, x: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, start: int) -> None:
        """x [B, n_kv, n, D] quantized per token into rows start..start+n of payload and scales (C kernel,
        which checks that they fit)."""
        x = x.float()
        if x.stride(-1) != 1:
            x = x.contiguous()
        ops().quantize_rows_(x, payload, scales, self._c_format, self._span, start)

    def write(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> int:
        """Store the new tokens' k/v [B, n_kv, T, D] at start_pos..; returns the filled length."""
        end = start_pos + k.shape[2]
        residual = self.spec.residual
        if not residual:
            self._store(k, v, start_pos)
            return end
        block_start, quantized_end = self.quantized_length(start_pos), self.quantized_length(end)
        if quantized_end > block_start:  # blocks filled: quantize them from the window's rows + the new ones
            held, taken = start_pos - block_start, quantized_end - start_pos
            self._store(torch.cat((self.k_window[:, :, :held], k[:, :, :taken]), dim=2),
                        torch.cat((self.v_window[:, :, :held], v[:, :, :taken]), dim=2), block_start)
        # The window keeps the last `residual` tokens written, position p in slot p % residual.
        for position in range(max(start_pos, end - residual), end):
            slot, source = position % residual, position - start_pos
            self.k_window[:, :, slot] = k[:, :, source]
            self.v_window[:, :, slot] = v[:, :, source]
            self.slot_positions[slot] = position
        return end

    def can_rewind(self, length: int) -> bool:
        """Whether the window still holds the tokens a sequence of `length` keeps in it."""
        held = range(self.quantized_length(length), length)
        return all(self.slot_positions[p % self.spec.residual] == p for p in held)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, n_kv, length, D] in the compute dtype as stored: the quantized prefix dequantized,
        then the window's full-precision rows."""
        quantized = self.quantized_length(length)
        spec = self.spec
        key_rows = quantized // spec.residual if spec.key_axis == "channel" else quantized
        key_scales = self.k_scales[:, :, :key_rows]
        k = spec.dequantize_keys(self.k_payload[:, :, :quantized], key_scales, self.dtype)
        v = spec.dequantize_values(self.v_payload[:, :, :quantized], self.v_scales[:, :, :quantized], self.dtype)
        if length > quantized:
            held = length - quantized
            k = torch.cat((k, self.k_window[:, :, :held]), dim=2)
            v = torch.cat((v, self.v_window[:, :, :held]), dim=2)
        return k, v

    def attend(self, q, k, v, start_pos):
        batch, seq_len, n_heads, head_dim = q.shape
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, n_kv, T, D]
        if seq_len > 1:
            # The prompt: earlier tokens as stored (read before the write may overwrite window slots),
            # its own K/V in full precision.
            earlier_k, earlier_v = self.read(start_pos)
            self.write(k, v, start_pos)
            return grouped_attention(q, torch.cat((earlier_k, k), dim=2), torch.cat((earlier_v, v), dim=2),
                                     q_offset=start_pos)
        end = self.write(k, v, start_pos)
        if self.use_c_kernel:
            n_kv = self.k_payload.shape[1]
            grouped = q.reshape(batch, n_kv, n_heads // n_kv, head_dim)  # head h = kv * G + g: [B, n_kv, G, D]
            return self.c_attention(grouped, end).view(batch, 1, n_heads, head_dim)
        cached_k, cached_v = self.read(end)
        return grouped_attention(q, cached_k, cached_v, q_offset=start_pos)

    def c_attention(self, q: torch.Tensor, length: int) -> torch.Tensor:
        """q [B, n_kv, G, D] fp32 -> [B, n_kv, G, D] over the first `length` tokens, in the C kernel."""
        quantized = self.quantized_length(length)
        window = length - quantized
        spec = self.spec
        return ops().quantized_decode_attention(
            q, self.k_payload, self.k_scales, self.v_payload, self.v_scales, self.k_window, self.v_window, quantized,
            window, self._c_format, self._span, spec.residual if spec.key_axis == "channel" else 0)

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        """Valid random payload and scales for tokens [0, length) (window: the rest, at full width).

        Payload bytes are uniform (fp8 with NaN codes moved to their neighbour); scales are positive,
        sized so dequantized values are of unit order. A step's time does not depend on the values."""
        quantized = self.quantized_length(length)
        for payload in (self.k_payload, self.v_payload):
            stored = payload.view(torch.uint8).narrow(2, 0, quantized)  # [B, n_kv, quantized, W]
            stored.random_(0, 256, generator=generator)
            if self.spec.format == "fp8_e4m3":
                stored.sub_(((stored & 0x7F) == FP8_NAN_CODE).to(torch.uint8))
        code_max = quantization.CODE_MAX[self.spec.format]
        key_rows = quantized // self.spec.residual if self.spec.key_axis == "channel" else quantized
        for scales, rows in ((self.k_scales, key_rows), (self.v_scales, quantized)):
            uniform_like_normal_(scales.narrow(2, 0, rows), 1.0, generator).abs_().mul_(2.0 / code_max)
        if self.k_window is not None:  # every slot: the window holds the last `residual` tokens
            for window in (self.k_window, self.v_window):
                uniform_like_normal_(window, 1.0, generator)
            for position in range(max(0, length - self.spec.residual), length):
                self.slot_positions[position % self.spec.residual] = position


class QuantizedSession(CachedSession):
    def rewind(self, length: int) -> None:
        """As DecodeSession.rewind, within the window's reach (module docstring: residual window invariant)."""
        cache = self.layer_caches[0]  # every layer's window holds the same positions
        if 0 < length <= self.length and not cache.can_rewind(length):
            raise ValueError(f"cannot rewind to {length} from {self.length}: the residual window holds the last "
                             f"{cache.spec.residual} tokens written, no longer those from "
                             f"{cache.quantized_length(length)} to {length}")
        super().rewind(length)

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        for cache in self.layer_caches:
            cache.fill_random(length, generator)
        self.length = length


class QuantizedStrategy(Strategy):
    name = "quantized"
    exact = False  # quantization moves the logits; the harness measures by how much
    backends = BACKENDS

    def __init__(self, backend: str = "auto", format: str = "int8", group_size: int = 32, key_axis: str = "token",
                 residual: int = 0):
        super().__init__(backend)
        if format not in FORMATS:
            raise StrategyOptionError("format", f"unknown value {format!r}, allowed: {', '.join(FORMATS)}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2:
            raise StrategyOptionError("group_size", f"must be an even integer >= 2 (two int4 codes share a byte), "
                                                    f"got {group_size!r}")
        if key_axis not in KEY_AXES:
            raise StrategyOptionError("key_axis", f"unknown value {key_axis!r}, allowed: {', '.join(KEY_AXES)}")
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise StrategyOptionError("residual", f"must be an integer >= 0, got {residual!r}")
        if key_axis == "channel" and residual == 0:
            raise StrategyOptionError("key_axis", "channel scales keys per block of `residual` tokens; "
                                                  "set residual > 0 (KIVI uses 32 or 128)")
        self.spec = QuantSpec(format, group_size, key_axis, residual)

    def options(self) -> dict:
        spec = self.spec
        return {"format": spec.format, "group_size": spec.group_size, "key_axis": spec.key_axis,
                "residual": spec.residual}

    def cache_layout(self, shape: ModelConfig | None = None) -> CacheLayout:
        """The layout for `shape`. Scale bytes depend on head_dim for int4 and channel-axis keys; there
        the shape is needed (int8 and fp8 with token-axis scales take 8 bytes whatever the shape)."""
        spec = self.spec
        if shape is None and (spec.format == "int4" or spec.key_axis == "channel"):
            raise ValueError(f"quantized: the scale bytes of format={spec.format} key_axis={spec.key_axis} depend "
                             "on head_dim; pass the model shape to cache_layout")
        if shape is not None:
            self._check_shape(shape)  # a group that does not divide head_dim has no byte count
        head_dim = shape.resolved_head_dim if shape is not None else 1  # any width: one scale spans the row
        return CacheLayout(value_bits=spec.value_bits, scale_bytes_per_token=spec.scale_bytes_per_token(head_dim),
                           residual_tokens=spec.residual)

    def _check_shape(self, shape: ModelConfig) -> None:
        head_dim = shape.resolved_head_dim
        if self.spec.format == "int4" and head_dim % self.spec.group_size:
            raise StrategyOptionError("group_size", f"{self.spec.group_size} does not divide head_dim {head_dim} "
                                                    f"of {shape.name}")

    def check_point(self, prefill: str, shape: ModelConfig, max_len: int) -> None:
        super().check_point(prefill, shape, max_len)
        self._check_shape(shape)

    def serving_unavailable(self) -> str | None:
        if self.spec.residual or self.spec.key_axis != "token":
            return ("a quantized cache with a full-width window (residual) or channel-axis keys keeps per-sequence "
                    "window state its serving pool does not hold yet; token-axis formats with residual=0 serve")
        return None

    def sequence_memory(self, shape, dtype) -> SequenceMemory:
        """A reservation, as contiguous's, of quantized rows: K and V codes and their scales per token."""
        head_dim = shape.resolved_head_dim
        per_head = 2 * quantization.payload_width(self.spec.format, head_dim) + int(self.spec.scale_bytes_per_token(head_dim))
        return SequenceMemory(shape.n_layers * shape.n_kv_heads * per_head, ARENA, reserved=True)

    def new_pool(self, model, memory, budget_bytes, max_len) -> QuantizedArenaPool:
        use_c = self.session_backend(model).name == "c"
        kernel = self.kernel(model.device, model.dtype, model.cfg)
        kernel = kernel.replace("for decode steps", "ragged (a length per sequence) for decode steps") if use_c \
            else f"{kernel}, one sequence at a time"
        code = format_code(self.spec.format) if use_c else None
        return QuantizedArenaPool(model, budget_bytes // memory.bytes_per_token, max_len, self.spec, code, kernel)

    def new_session(self, model, batch: int, max_len: int) -> QuantizedSession:
        c = model.cfg
        self._check_shape(c)
        use_c = self.session_backend(model).name == "c"
        caches = [
            QuantizedLayerCache(batch, c.n_kv_heads, max_len, c.resolved_head_dim, model.device, model.dtype,
                                self.spec, use_c)
            for _ in range(c.n_layers)
        ]
        return QuantizedSession(model, caches, max_len)
