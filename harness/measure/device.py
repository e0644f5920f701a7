"""What the device at hand is called, for rows and calibration records."""
from __future__ import annotations

import os

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    return f"{model} ({os.cpu_count()} threads)"
