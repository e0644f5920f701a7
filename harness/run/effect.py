"""Values a command line sets that would change nothing in its run, refused before anything runs.

A value the run would ignore is worse than a refusal: the rows then claim it. Two kinds, checked once
the sweep is planned (harness.run.plan), each a ConfigError in one line naming the key and what is
allowed:
- an option of the accuracy pass that selects no point of this run: `accuracy.at_batch=3` in a run of
  batch 1, `accuracy.max_ctx=8` below every ctx. The pass would score nothing while each approximate
  row says at which batch or up to which ctx its scores are.
- a shape key set on the command line beside `model.checkpoint`, whose own config gives the shape
  (harness.run.inputs.checkpoint_shape): `model.n_layers=7` would be dropped without a word.
(A boolean key given anything but true or false is refused as it is parsed: harness.config.overrides.)
"""
from __future__ import annotations

from harness.config import ConfigError


def check_accuracy_selection(planned: list) -> None:
    """The accuracy pass scores an approximate point whose batch is accuracy.at_batch (or any, when
    null) and whose ctx is at most accuracy.max_ctx (or any); harness.run.resolve keys a scored point
    without them. ConfigError when they are set and select no approximate point of the run (a run of
    exact strategies alone runs no pass, and these keys mean nothing to it either way)."""
    approximate = [one for one in planned if not one.point.strategy.exact]
    if not approximate or any(one.point.accuracy.at_batch is None and one.point.accuracy.max_ctx is None
                              for one in approximate):
        return
    accuracy = approximate[0].config.accuracy
    batches = sorted({one.point.batch for one in approximate})
    contexts = sorted({one.point.ctx for one in approximate if accuracy.at_batch in (None, one.point.batch)})
    if accuracy.at_batch is not None and accuracy.at_batch not in batches:
        raise ConfigError("accuracy.at_batch", f"{accuracy.at_batch} is no batch of this run's approximate points "
                                               f"({_listed(batches)}), so no point would be scored; allowed: "
                                               f"{_listed(batches)}, or null to score every batch")
    raise ConfigError("accuracy.max_ctx", f"{accuracy.max_ctx} is below every ctx of this run's approximate points"
                                          f"{' at batch ' + str(accuracy.at_batch) if accuracy.at_batch else ''} "
                                          f"({_listed(contexts)}), so no point would be scored; allowed: at least "
                                          f"{contexts[0]}, or null to score every ctx")


def _listed(values: list) -> str:
    return ", ".join(map(str, values))


def check_checkpoint_shape(overrides, model_cfg, shape) -> None:
    """ConfigError on a `model.<key>` override that the checkpoint's own shape replaces with another
    value. `overrides`: the point's, as given; `model_cfg`: the composed model node; `shape`: the point's
    resolved ModelConfig (the checkpoint's shape where model.checkpoint is set)."""
    if shape.checkpoint is None:
        return
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        name = key.removeprefix("model.")
        if not key.startswith("model.") or name in ("checkpoint", "name") or model_cfg.get(name) is None:
            continue
        given, held = model_cfg.get(name), getattr(shape, name, None)
        if given != held:
            raise ConfigError(key, f"{given} is set beside model.checkpoint, whose own config gives {held}: a "
                                   f"checkpoint's shape is its own; drop {key}, or set model.checkpoint=null for "
                                   "seeded random weights of this shape")
