"""Stage 1 of the pipeline: what a point is. Typed schemas, value checks, the resolved point.

Pure: imports neither torch nor Hydra at import time, so the analytic model and the report use these
dataclasses on machines without torch.
"""
from harness.config.layout import CONTIGUOUS, CacheLayout, could_be_reference
from harness.config.point import Point, StrategyChoice, point_from_record
from harness.config.schema import (AccuracyConfig, ModelConfig, RunConfig, TimingConfig, model_config_from,
                                   register_schemas)
from harness.config.validate import ConfigError

__all__ = [
    "AccuracyConfig", "CONTIGUOUS", "CacheLayout", "ConfigError", "ModelConfig", "Point", "RunConfig",
    "StrategyChoice", "TimingConfig", "could_be_reference", "model_config_from", "point_from_record", "register_schemas",
]
