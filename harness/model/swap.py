"""Module swaps: how a CPU kernel's modules take the place of the model's (harness.model.cpu_linear,
harness.model.cpu_gemv)."""
from __future__ import annotations

from typing import Callable

from torch import nn


def swap_modules(model: nn.Module, kind: type[nn.Module], make: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every module of exactly type `kind` in `model` by `make(module)`, one at a time; returns
    how many. Names only are collected first: holding the modules in a list would keep every replaced
    one (a dense weight, for a repacking swap) alive until the end."""
    names = [name for name, module in model.named_modules() if type(module) is kind]
    for name in names:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, make(getattr(parent, attribute)))
    return len(names)
