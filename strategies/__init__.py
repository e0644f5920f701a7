"""Decode strategies: one file each, all behind the interface in `strategies.base`.

A strategy decides what a decode step stores and reads, and declares what it is (caches K/V, exact,
devices, dtypes, backends) as class attributes. Hydra instantiates one from `conf/strategy/<name>.yaml`
(`_target_`); harness.run.catalog lists every option of that group, shipped or on Hydra's search path.
Each declares its attention kernels as data (strategies.backends), and one rule picks among them.
Nothing here imports the harness beyond harness.kernels, harness.config and harness.model.
"""
from strategies.base import DecodeSession, LayerCache, Strategy, StrategyOptionError, StrategyUnavailable

__all__ = ["DecodeSession", "LayerCache", "Strategy", "StrategyOptionError", "StrategyUnavailable"]
