"""A strategy's attention kernels as data, and the one rule that picks among them.

A strategy declares its backends on its class (`Strategy.backends`), in preference order: each a
`Backend` saying what it needs: device types, dtypes, a kernel of the C extension (its build, and its
limits on the model's heads), an optional package (flash_attn), or any other condition on the
strategy's options or the device. `choose` is the rule, in one place:

- `auto` takes the first backend whose needs hold here;
- a backend named by `strategy.backend` is taken where its needs hold, and is otherwise unavailable
  with the reason: the point is a skipped row, never another kernel under its name.

The runner chooses once per point, when it plans it (harness.run.resolve), and the point records the
choice (the row's `backend`); the strategy built for the point names that backend, and its sessions run
it without choosing again (`Strategy.session_backend`). A member checks the named backend's needs once
more in the process that runs the point (`Strategy.kernel`), where a compiled kernel must be loaded
anyway. A new backend is one more entry in a strategy's list, beside the code that runs it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from harness.config import ModelConfig
from harness.kernels.extension import Kernel


class StrategyUnavailable(Exception):
    """This strategy cannot run on this device/dtype/installation. The message is the reason."""


@dataclass(frozen=True)
class Backend:
    """One attention kernel a strategy can run, and what it needs."""

    name: str  # the value of strategy.backend that asks for it, and the row's `backend` where it runs
    kernel: str  # the row's `kernel` where it runs; {option} fields are filled from the strategy's options()
    devices: Optional[tuple[str, ...]] = None  # device types it runs on; None: every one the strategy runs on
    dtypes: Optional[tuple[str, ...]] = None  # compute dtypes it runs in; None: every one the strategy takes
    compiled: Optional[Kernel] = None  # the C extension's kernel it calls: the build, the CPU and fp32, its head limits
    package: Optional[str] = None  # a package it imports, which must be importable here
    extra: Optional[str] = None  # the project's pip extra that installs `package`
    # Any other need: (the strategies.base.Strategy, the device) -> why it is not met, or None.
    condition: Optional[Callable[[Any, torch.device], Optional[str]]] = None

    def unmet(self, strategy, device: torch.device, dtype: torch.dtype, shape: ModelConfig | None) -> str | None:
        """Why this backend cannot run the strategy's point here (shape None: any shape), or None.
        The cheap needs first: a compiled kernel is built and loaded only where nothing else excludes it."""
        dtype_name = str(dtype).removeprefix("torch.")
        if self.devices is not None and device.type not in self.devices:
            return f"{self.name} runs on {', '.join(self.devices)}; this point runs on {device.type}"
        if self.dtypes is not None and dtype_name not in self.dtypes:
            return f"{self.name} runs in {', '.join(self.dtypes)}; dtype is {dtype_name}"
        if self.condition is not None and (reason := self.condition(strategy, device)) is not None:
            return reason
        if self.package is not None and (reason := _not_importable(self.package, self.extra)) is not None:
            return reason
        if self.compiled is not None:
            reason = self.compiled.unavailable(device, dtype)
            if reason is None and shape is not None:
                reason = self.compiled.shape_unsupported(shape.n_heads // shape.n_kv_heads, shape.resolved_head_dim)
            return reason
        return None


def _not_importable(package: str, extra: str | None) -> str | None:
    try:
        importlib.import_module(package)
    except ImportError as error:
        install = f"; install the extra: pip install -e '.[{extra}]'" if extra else ""
        return f"{package} is not importable ({error}){install}"
    return None


def choose(strategy, device: torch.device, dtype: torch.dtype, shape: ModelConfig | None = None) -> Backend:
    """The backend the strategy (a strategies.base.Strategy) runs for this device, dtype and model
    shape (None: any shape): the named one where its needs hold, for `auto` the first that holds.
    StrategyUnavailable with the reason (every candidate's, for `auto`) where none can run."""
    reason = strategy.unavailable(device, dtype)
    if reason is not None:
        raise StrategyUnavailable(reason)
    candidates = strategy.backends if strategy.backend == "auto" else (strategy.declared(strategy.backend),)
    reasons = []
    for backend in candidates:
        reason = backend.unmet(strategy, device, dtype, shape)
        if reason is None:
            return backend
        reasons.append(reason)
    raise StrategyUnavailable(reasons[0] if len(reasons) == 1 else
                              "; ".join(f"{backend.name}: {why}" for backend, why in zip(candidates, reasons)))
