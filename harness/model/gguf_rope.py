"""A GGUF file's RoPE scaling, read by llama.cpp's rules and given as config.json's `rope_scaling`, so
the decoder rotates as it does for the same model's Hugging Face folder (harness.model.checkpoint_fields).

llama.cpp (llama-model.cpp, load_hparams) reads `<arch>.rope.scaling.type` (absent: `linear`) and the
factor from `<arch>.rope.scaling.factor`, else the legacy `<arch>.rope.scale_linear` (absent or 0: no
scaling); type `none` never scales. Linear scaling divides every rotation rate by the factor: config.json's
`{"rope_type": "linear", "factor": f}`. Other types (yarn, longrope) are refused by gguf_file.

Llama 3.1 and later store their RoPE scaling as a tensor, `rope_freqs.weight`: one factor per dimension
pair, each rate divided by its factor (ggml_rope_ext's freq_factors), computed by llama.cpp's converter
(convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors) from config.json's llama3 parameters: 1 for
wavelengths below original_max_position_embeddings / high_freq_factor, `factor` above
original_max_position_embeddings / low_freq_factor, and 1 / ((1 - s) / factor + s) between, s the smooth
blend. `llama3_parameters` recovers those parameters from the factors: the band's edges are fixed by the
blended entries (two or more; fewer: by the gaps between the entries of 1 and of `factor`), and since
only the ratios original / low and original / high matter, low_freq_factor is taken as 1 (Llama 3.1's
own), which gives back Llama 3.1's 8192 and 4. The recovered parameters are used only where they give
back every stored factor (RELATIVE_TOLERANCE: the file stores float32); factors of another rule are
refused in one line. A file with both a linear factor and the tensor is refused too.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from harness.model.checkpoint_fields import CheckpointError, shown

SCALING_TYPES = ("none", "linear")  # rope.scaling.type values the decoder computes (gguf_file refuses others)
RELATIVE_TOLERANCE = 1e-5  # recovered factors against stored float32 ones


def rope_scaling(path: Path, kind: Any, factor: Any, factors: Optional[np.ndarray], theta: Any,
                 head_dim: Optional[int]) -> Optional[dict]:
    """config.json's `rope_scaling` for a file whose rope.scaling.type is `kind` (None: absent), linear
    factor `factor` (None: absent) and rope_freqs.weight `factors` (None: absent); None for no scaling.
    `theta` and `head_dim` as the file gives them (unchecked: where they are not numbers the schema refuses
    the file, and the factors are not recovered)."""
    kind = "linear" if kind is None else kind
    if factor is not None and (type(factor) not in (int, float) or not math.isfinite(factor) or factor < 0):
        raise CheckpointError(f"'{path}': llama.rope.scaling.factor must be a finite number >= 0 (0: no scaling), "
                              f"got {shown(factor)}")
    linear = factor if kind == "linear" and factor not in (None, 0, 1) else None
    if factors is None:
        return None if linear is None else {"rope_type": "linear", "factor": float(linear)}
    if linear is not None:
        raise CheckpointError(f"'{path}': linear RoPE scaling (factor {linear:g}) and frequency factors "
                              "(rope_freqs.weight) together, which the decoder does not combine")
    if type(theta) not in (int, float) or not theta > 0 or not isinstance(head_dim, int) or head_dim <= 0:
        return None  # the schema refuses the shape before a rope is built
    if factors.shape != (head_dim // 2,):
        raise CheckpointError(f"'{path}': rope_freqs.weight holds {factors.size} factors, the heads of width "
                              f"{head_dim} rotate {head_dim // 2} pairs")
    return llama3_parameters(path, factors, float(theta), head_dim)


def _wavelengths(theta: float, head_dim: int) -> np.ndarray:
    return 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]


def llama3_factors(wavelengths: np.ndarray, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """The per-pair factors llama.cpp's converter computes from llama3 parameters (the module docstring)."""
    smooth = (original / wavelengths - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < original / high, 1.0, np.where(wavelengths > original / low, factor, blended))


def llama3_parameters(path: Path, factors: np.ndarray, theta: float, head_dim: int) -> Optional[dict]:
    """The llama3 rope_scaling that gives back `factors` (the module docstring), or CheckpointError."""
    refused = CheckpointError(f"'{path}': rope_freqs.weight holds factors {shown(factors.round(4).tolist())} that "
                              "Llama 3.1's rule (rope_type llama3) does not give; the decoder computes only that rule")
    if not np.isfinite(factors).all() or factors.min() <= 0:
        raise refused
    if np.allclose(factors, 1.0, rtol=RELATIVE_TOLERANCE):
        return None
    wavelengths = _wavelengths(theta, head_dim)
    factor = float(factors.max())
    unit = np.isclose(factors, 1.0, rtol=RELATIVE_TOLERANCE)
    full = np.isclose(factors, factor, rtol=RELATIVE_TOLERANCE)
    if full.all():  # every rate divided alike: linear scaling
        return {"rope_type": "linear", "factor": factor}
    if factor <= 1 or not unit.any():
        raise refused
    blended = ~unit & ~full
    # In the band, smooth = a / wavelength - b with a = original / (high - low), b = low / (high - low);
    # the band's edges are original / low = a / b and original / high = a / (b + 1).
    smooth = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
    if blended.sum() >= 2:  # a line through the blended entries
        a, b = np.polyfit(1 / wavelengths[blended], smooth, 1) * np.array([1, -1])
        if not (a > 0 and b > 0):
            raise refused
        low_edge, high_edge = a / b, a / (b + 1)
    else:  # the low edge in the gap before the first entry of `factor`; one blended entry then fixes the high one
        low_edge = math.sqrt(wavelengths[~full].max() * wavelengths[full].min()) if full.any() else wavelengths.max() * 2
        if blended.any():
            b = smooth[0] / (low_edge / wavelengths[blended][0] - 1)
            high_edge = b * low_edge / (b + 1)
        else:
            high_edge = math.sqrt(wavelengths[unit].max() * wavelengths[~unit].min())
    original = max(1, round(low_edge))
    low, high = (float(f"{value:.6g}") for value in (original / low_edge, original / high_edge))  # 1 and 4, not 0.9999999
    if not high > low or not np.allclose(llama3_factors(wavelengths, factor, low, high, original), factors,
                                         rtol=RELATIVE_TOLERANCE, atol=0):
        raise refused
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}
