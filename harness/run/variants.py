"""The name a strategy goes by in rows, progress lines and reports: its variant.

A variant is an option of the strategy group, `conf/strategy/<name>.yaml`: a class's own option
(`quantized.yaml`, `paged.yaml`) or one that extends it through Hydra's defaults list and sets a few
options (`int4.yaml`: `defaults: [quantized, _self_]` then `format: int4`), so one sweep puts them side
by side: `strategy=contiguous,int8,int4,kivi4,fp8,paged,paged32`.

The name is the option chosen (Hydra's runtime choice of the `strategy` group), followed by every
strategy option whose value differs from what that option's own file gives it, set on the command line
or by a preset: `strategy=quantized strategy.group_size=32,64` makes `quantized` and
`quantized(group_size=64)`. Two points with different options therefore never share a name, and a
name never hides an option it did not choose. The row's `strategy` column is the name,
`strategy_class` the class and `strategy_family` the class's `name` attribute. Nothing is chosen or
compared by the name (the reference and the report's plain cache are picked by what classes declare),
and it is not in the point's key: a variant and the same class with the same options set by hand
measure the same thing, so they share a key and a row.
"""
from __future__ import annotations

import json
from typing import Callable

from omegaconf import OmegaConf

STRATEGY_GROUP = "strategy"
SEARCH_PATH = "hydra.searchpath"  # kept when composing an option alone: it may live on the search path


def variant_name(choice: str, options: dict, as_chosen: dict) -> str:
    """`choice`, with the options whose value differs from `as_chosen` (the option's own file)
    appended as `key=value` in the node's order, and `~key` for an option removed."""
    differing = [f"{key}={_text(value)}" for key, value in options.items()
                 if key not in as_chosen or as_chosen[key] != value]
    differing += [f"~{key}" for key in as_chosen if key not in options]
    return f"{choice}({','.join(differing)})" if differing else choice


def chosen_of(variant: str) -> str:
    """The option of the strategy group a variant name (variant_name) starts with; empty for none."""
    return variant.split("(", 1)[0]


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def variant_of(cfg, overrides, compose: Callable, as_chosen: dict) -> str:
    """The variant name of a composed job config that still has Hydra's node (runtime choices), given
    the job's overrides, a function composing a list of overrides without Hydra's node, and a dict
    that keeps what it composed for the next job; empty when no option of the group was chosen (the
    class's name then names it)."""
    choice = OmegaConf.select(cfg, f"hydra.runtime.choices.{STRATEGY_GROUP}")
    if choice is None:
        return ""
    alone = tuple(o for o in overrides if o.lstrip("+").split("=", 1)[0] == SEARCH_PATH)
    alone += (f"{STRATEGY_GROUP}={choice}",)
    if alone not in as_chosen:
        as_chosen[alone] = OmegaConf.to_container(compose(list(alone))[STRATEGY_GROUP], resolve=True)
    return variant_name(str(choice), OmegaConf.to_container(cfg[STRATEGY_GROUP], resolve=True), as_chosen[alone])

