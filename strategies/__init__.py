"""Decode strategies: one file each, all behind the interface in `strategies.base`.

A strategy decides what a decode step stores and reads. Hydra instantiates one from `conf/strategy/`
(`_target_`), and `STRATEGIES` maps each option name to its class for code that builds one directly.
"""
from strategies.base import DecodeSession, LayerCache, Strategy, StrategyUnavailable
from strategies.contiguous import ContiguousStrategy
from strategies.flash import FlashStrategy
from strategies.no_cache import NoCacheStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "no_cache": NoCacheStrategy,
    "contiguous": ContiguousStrategy,
    "flash": FlashStrategy,
}

__all__ = ["STRATEGIES", "DecodeSession", "LayerCache", "Strategy", "StrategyUnavailable"]
