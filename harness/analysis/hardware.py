"""Device roofs: datasheet configs (conf/hardware/*.yaml) and calibration records measured on the device.

A roof is what the analytic model needs of a device for one dtype: peak FLOP/s and memory bandwidth
(`harness.analysis.analytic.Roof`). Datasheet configs give them per dtype; `measured` reads them from the newest
calibration record the runner wrote under `<results_dir>/_calibration/`, and says so when there is none
rather than guessing. No torch, no Hydra: the report uses this on any machine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import yaml

from harness.analysis.analytic import DTYPE_BYTES, Roof
from harness.config.paths import config_dir
from harness.config.validate import ConfigError, positive_float
from harness.store import calibration
from harness.store.calibration import CALIBRATION_DIR, Calibration

HARDWARE_DIR = config_dir() / "hardware"

# Bounds of a roof (the shared check, harness.config.validate.positive_float). Far beyond any device in
# both directions, and tight enough that no figure of the analytic model overflows a float for any
# size the CLI accepts (a bandwidth of 1e-300 B/s made a step take infinitely long).
BANDWIDTH_BOUNDS_BPS = (1.0, 1e18)  # 1 B/s .. 1 EB/s
FLOPS_BOUNDS = (1.0, 1e21)  # 1 FLOP/s .. 1 ZFLOP/s

# Substrings of torch.cuda.get_device_name() -> the datasheet config that describes that device.
DATASHEET_BY_DEVICE_NAME = {"H200": "h200", "H100": "h100_sxm", "A100": "a100_80g"}


class HardwareError(ValueError):
    """A hardware config or calibration cannot give a roof. The message is one line for the user."""


@dataclass
class Hardware:
    """One device's roofs, from a datasheet or a calibration."""

    name: str  # config name (h100_sxm, h200, a100_80g, measured)
    bandwidth_Bps: Optional[float]  # memory read bandwidth, bytes/s; None until a calibration fills it
    flops: Dict[str, float] = field(default_factory=dict)  # dtype name -> peak dense FLOP/s
    source: str = ""  # where the figures come from (datasheet, calibration file path)
    calibrated: bool = False  # True: figures come from a calibration record, not a datasheet
    memory_bytes: Optional[float] = None  # memory of one device (capacity planning); None where unknown

    def roof(self, dtype: str) -> Roof:
        for name, value, bounds in [("bandwidth_Bps", self.bandwidth_Bps, BANDWIDTH_BOUNDS_BPS),
                                    *((f"flops.{k}", v, FLOPS_BOUNDS) for k, v in self.flops.items())]:
            if value is None:
                continue
            try:
                positive_float(f"hardware.{name}", value, *bounds)
            except ConfigError as error:
                raise HardwareError(str(error)) from None
        if self.bandwidth_Bps is None:
            raise HardwareError(f"hardware={self.name}: no bandwidth (no calibration record read)")
        if dtype not in self.flops:
            have = ", ".join(self.flops) or "none"
            raise HardwareError(f"dtype: hardware={self.name} has no FLOP/s for '{dtype}', has: {have}")
        return Roof(flops_per_s=float(self.flops[dtype]), bytes_per_s=float(self.bandwidth_Bps))


def hardware_from_calibration(path: Path, record: Calibration) -> Hardware:
    """The roofs of a calibration record as a Hardware (name `measured`)."""
    return Hardware(
        name="measured",
        bandwidth_Bps=record.read_bandwidth_Bps,
        flops={record.dtype: record.matmul_flops},
        source=f"calibration {path.name} ({record.device_name}, {record.timestamp})",
        calibrated=True,
    )


def available_hardware() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def hardware_from_mapping(mapping) -> Hardware:
    """A Hardware from a dict or DictConfig with the fields of conf/hardware/*.yaml."""
    flops = {str(k): float(v) for k, v in dict(mapping.get("flops") or {}).items()}
    bandwidth = mapping.get("bandwidth_Bps")
    return Hardware(
        name=str(mapping["name"]),
        bandwidth_Bps=None if bandwidth is None else float(bandwidth),
        flops=flops,
        source=str(mapping.get("source", "")),
        calibrated=bool(mapping.get("calibrated", False)),
        memory_bytes=None if mapping.get("memory_bytes") is None else float(mapping["memory_bytes"]),
    )


def load_hardware(name: str) -> Hardware:
    """The config conf/hardware/<name>.yaml (for `measured`, figures still empty: see `resolve`)."""
    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise HardwareError(f"hardware: unknown '{name}', allowed: {', '.join(available_hardware())}")
    return hardware_from_mapping(yaml.safe_load(path.read_text()))


def datasheet_for_device_name(device_name: str) -> Optional[str]:
    """The datasheet config matching a CUDA device name, or None (CPUs have none)."""
    for key, config in DATASHEET_BY_DEVICE_NAME.items():
        if key.lower() in (device_name or "").lower():
            return config
    return None


def resolve(
    hardware: Hardware, dtype: str, results_dir=None, device: Optional[str] = None
) -> tuple[Roof, str]:
    """The roof for `dtype` and a line saying where it came from.

    `measured` reads the newest calibration record under results_dir; without one it raises a
    HardwareError naming the folder it looked in, so no number is ever silently a datasheet's.
    """
    if dtype not in DTYPE_BYTES:
        raise HardwareError(f"dtype: unknown '{dtype}', allowed: {', '.join(DTYPE_BYTES)}")
    if hardware.calibrated and hardware.bandwidth_Bps is None:
        folder = Path(results_dir or "results") / CALIBRATION_DIR
        found = calibration.find(results_dir or "results", dtype, device)
        if found is None:
            raise HardwareError(
                f"hardware=measured: no calibration record for dtype {dtype} in {folder} "
                "(the runner writes one when it runs on this device; or pick a datasheet: "
                f"{', '.join(n for n in available_hardware() if n != 'measured')})"
            )
        hardware = hardware_from_calibration(*found)
    return hardware.roof(dtype), f"{hardware.name}: {hardware.source}"
