"""Rows of one model on one device in one dtype: what every plot and comparison is drawn from.

Rows of different shapes, devices or dtypes are never drawn on the same axes; a folder holding several
such groups gets one set of plots per group.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from harness.analytic import Roof
from harness.config import ModelConfig
from harness.results import shape_of

GROUP_KEYS = ["model", "device", "dtype"]


@dataclass
class Group:
    """One model x device x dtype slice of the results, with the roof its predictions use."""

    model: str  # preset name
    device: str  # cpu | cuda
    dtype: str  # float32 | bfloat16 | float16
    device_name: str  # processor or GPU model of the rows
    shape: ModelConfig  # decoder shape recorded in the rows
    roof: Roof  # the roof the predictions of these rows use
    roof_source: str  # measured | datasheet
    roof_description: str  # which calibration or datasheet, and why
    decode_tokens: int  # decode steps per point (the most common value)
    rows: pd.DataFrame  # every row of the group, whatever its status
    ok: pd.DataFrame  # rows with status ok and a prediction

    @property
    def title(self) -> str:
        return f"{self.model} · {self.device} ({self.device_name}) · {self.dtype}"

    @property
    def slug(self) -> str:
        return f"{self.model}_{self.device}_{self.dtype}"

    def strategies(self) -> list[str]:
        order = ["no_cache", "contiguous", "flash"]
        present = list(self.ok["strategy"].unique())
        return sorted(present, key=lambda s: (order.index(s) if s in order else len(order), s))


def groups_of(table: pd.DataFrame) -> list[Group]:
    """One Group per model/device/dtype with at least one predicted row, largest first."""
    if table.empty or "roof_flops_used" not in table:
        return []
    found = []
    for (model, device, dtype), rows in table.groupby(GROUP_KEYS, sort=True):
        predicted = rows[rows["roof_flops_used"].notna()]
        if predicted.empty:
            continue
        first = predicted.iloc[0]
        ok = predicted[predicted["status"] == "ok"].copy()
        found.append(Group(
            model=str(model), device=str(device), dtype=str(dtype),
            device_name=str(first.get("device_name") or device),
            shape=shape_of(first),
            roof=Roof(float(first["roof_flops_used"]), float(first["roof_bandwidth_used"])),
            roof_source=str(first["roof_source"]), roof_description=str(first["roof_description"]),
            decode_tokens=int(rows["decode_tokens"].mode().iloc[0]),
            rows=rows, ok=ok,
        ))
    return sorted(found, key=lambda g: -len(g.ok))
