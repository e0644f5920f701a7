"""Numbers as a reader wants them: times in s/ms/µs, bytes in binary units, ratios with an x."""
from __future__ import annotations

import math


def missing(value) -> bool:
    try:
        return value is None or math.isnan(float(value))
    except (TypeError, ValueError):
        return True


def seconds(value) -> str:
    if missing(value):
        return "–"
    value = float(value)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def nbytes(value) -> str:
    if missing(value):
        return "–"
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def ratio(value) -> str:
    """3 significant figures, never in exponent form: 1.33x, 21.9x, 596x, 3,893x."""
    if missing(value):
        return "–"
    value = float(value)
    return f"{value:,.0f}x" if abs(value) >= 100 else f"{value:.3g}x"


def count(value) -> str:
    return "–" if missing(value) else f"{int(round(float(value))):,}"


SI_SCALES = {"E": 1e18, "P": 1e15, "T": 1e12, "G": 1e9, "M": 1e6, "k": 1e3}


def _si(value, unit: str, prefixes: str) -> str:
    """`value` with the largest of `prefixes` it reaches: _si(3.35e12, 'B/s', 'PTGMk') -> '3.35 TB/s'."""
    if missing(value):
        return "–"
    value = float(value)
    for prefix in prefixes:
        if abs(value) >= SI_SCALES[prefix]:
            return f"{value / SI_SCALES[prefix]:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def flops(value) -> str:
    return _si(value, "FLOP", "EPTGM")


def rate(value, unit: str) -> str:
    """A per-second rate with an SI prefix: rate(3.35e12, 'B/s') -> '3.35 TB/s'."""
    return _si(value, unit, "PTGMk")


def number(value) -> str:
    """A plain quantity: thousands separated when large, 3 significant figures when small (0.4, 12.5)."""
    if missing(value):
        return "–"
    value = float(value)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
