"""What a point runs on besides its shape: its weights, its prompt, and the exact strategy an
approximate one is judged against. Resolved once per point while the sweep is planned
(harness.run.resolve), so every refusal is one line and exit 2 before anything is written.

- Weights: with `model.checkpoint=PATH` the folder or GGUF file is read (harness.model.checkpoint:
  config.json and the safetensors headers, or the GGUF metadata; no tensor) and its shape replaces the
  preset's; `model.name` becomes the folder's (file's) name unless it was set to a name no preset under
  conf/model/ has; the point records how the tensors were stored and what they became
  (`checkpoint_format`). A checkpoint whose weights, in the point's dtype, exceed the CPU's free memory
  is refused (on CUDA the point's own process finds its free memory and skips a point that does not
  fit, as for random weights).
- Prompt: with `prompt=PATH` (or a built-in text, harness.config.texts) the text is read and cut into
  the point's windows now, the accuracy pass's too for an approximate strategy (harness.measure.
  prompts), so a text too short or ids outside the vocabulary are refused now.
- Reference: the first strategy of the catalog that could be a reference by the one rule
  (harness.config.layout.could_be_reference: exact, the plain contiguous layout), on a backend made of
  torch's own operators.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from contextlib import contextmanager
from typing import Optional

import torch
from omegaconf import OmegaConf

from harness.analysis.analytic import dtype_bytes, kv_cache_bytes, weight_bytes
from harness.config import AccuracyConfig, ConfigError, ModelConfig, StrategyChoice, could_be_reference
from harness.config.paths import LocationError, config_dir
from harness.config.validate import first_line, validate_model
from harness.measure.memory import available_bytes
from harness.measure.prompts import (PromptError, accuracy_tokens_needed, accuracy_windows, content_hash,
                                     file_windows, read_tokens, tokenizer_of, window_tokens)
from harness.model.checkpoint import Checkpoint, CheckpointError, read_checkpoint, shape_fields
from harness.run.catalog import strategy_catalog

TORCH_BACKENDS = ("sdpa", "torch")  # kernel families of torch's own operators: any device, any dtype
GIB = 2**30
STORED_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # stored float types, safetensors' and GGML's codes


def weights_description(checkpoint: Checkpoint, dtype: str) -> str:
    """A row's `checkpoint_format`: the file format, its tensors' stored types by count, and what they
    became in the point's dtype, e.g. "gguf: Q4_1 x210, F32 x61, Q8_0 x1, dequantized to float32"."""
    counts = Counter(stored.dtype for stored in checkpoint.tensors.values())
    floats = {STORED_FLOATS.get(kind) for kind in counts}
    if None in floats:
        done = "dequantized to"
    else:
        done = "as stored, in" if floats == {dtype} else "converted to"
    return f"{checkpoint.format}: {', '.join(f'{kind} x{n}' for kind, n in counts.most_common())}, {done} {dtype}"


def checkpoint_shape(model: ModelConfig, dtype: str, device: str, max_len: int) -> tuple[ModelConfig, str, str]:
    """The shape of `model.checkpoint` (its name as the module docstring says), its content hash and its
    weights_description; ConfigError on `model.checkpoint` for a checkpoint the decoder cannot load or
    memory cannot hold."""
    with input_boundary("model.checkpoint", model.checkpoint):
        checkpoint = read_checkpoint(model.checkpoint)
    preset = (config_dir() / "model" / f"{model.name}.yaml").is_file()
    shape = dataclasses.replace(model, **shape_fields(checkpoint.shape),
                                name=checkpoint.shape.name if preset else model.name)
    validate_model(OmegaConf.create(dataclasses.asdict(shape)))  # the checks a preset's shape passes
    window = checkpoint.sliding_window
    if window is not None and max_len > window:
        raise ConfigError("ctx", f"ctx + decode_tokens = {max_len} passes the checkpoint's sliding_window={window}, "
                                 "which the decoder does not apply; keep the point within it")
    if device == "cpu":
        need, have = checkpoint.parameters * dtype_bytes(dtype), available_bytes("cpu")
        if need > have:
            raise ConfigError("model.checkpoint", f"'{shape.checkpoint}' needs {need / GIB:.1f} GiB as {dtype}, "
                                                  f"{have / GIB:.1f} GiB of memory is free")
    return shape, checkpoint.content_hash, weights_description(checkpoint, dtype)


def prompt_source(source: str, shape: ModelConfig, prefill: str, batch: int, ctx: int, decode_tokens: int,
                  accuracy: Optional[AccuracyConfig]) -> str:
    """The content hash of the prompt file or built-in text, once it is known to give the point its
    windows: the timed run's (prefill=compute; prefill=random times the steps over random K/V and runs
    no prompt), and with `accuracy` (an approximate strategy's pass, which prefills its own windows of
    the text either way) the accuracy pass's; ConfigError on `prompt` or `accuracy.tokens` otherwise."""
    with input_boundary("prompt", source):
        tokenizer = tokenizer_of(shape.checkpoint)
        # prefill=random reads no timed window: one token says the file reads as tokens of this model
        timed = (batch, window_tokens(ctx, decode_tokens)) if prefill == "compute" else (1, 1)
        file_windows(source, tokenizer, *timed, shape.vocab_size)
        found = content_hash(source, tokenizer)
    if accuracy is not None:
        with input_boundary("accuracy.tokens", source):
            ids = read_tokens(source, tokenizer, limit=accuracy_tokens_needed(ctx, accuracy.tokens))
            accuracy_windows(ids, ctx, accuracy.steps, accuracy.tokens, shape.vocab_size, f"'{source}'")
    return found


def accuracy_pass_bytes(shape: ModelConfig, dtype: str, ctx: int, accuracy: AccuracyConfig) -> dict[str, int]:
    """Memory the accuracy pass (harness.measure.accuracy) holds at its peak beside the model, by what
    holds it: the reference's logits of every scored step (kept for every approximate member of the
    group), one chunk's cache at ctx + steps, and a step's two distributions scored in float64."""
    windows = -(-accuracy.tokens // accuracy.steps)
    chunk = min(accuracy.batch, windows)
    return {"accuracy.tokens": windows * accuracy.steps * shape.vocab_size * dtype_bytes(dtype),
            "accuracy.batch": int(kv_cache_bytes(shape, dtype, chunk, ctx + accuracy.steps)
                                  + 4 * chunk * shape.vocab_size * 8)}


def accuracy_fits(shape: ModelConfig, dtype: str, device: str, ctx: int, accuracy: AccuracyConfig) -> None:
    """ConfigError, before anything is measured, on the key whose term dominates when the accuracy pass and
    the model cannot fit in the CPU's free memory (on CUDA the point's own process finds out, as for its cache)."""
    if device != "cpu":
        return
    parts = accuracy_pass_bytes(shape, dtype, ctx, accuracy)
    need, have = sum(parts.values()) + weight_bytes(shape, dtype), available_bytes("cpu")
    if need > have:
        raise ConfigError(max(parts, key=parts.get), f"the accuracy pass scores {accuracy.tokens:,} tokens in windows of "
                          f"{accuracy.steps:,} steps, {accuracy.batch:,} windows at a time, after ctx={ctx:,}: with "
                          f"the model it needs ~{need / GIB:.1f} GiB, {have / GIB:.1f} GiB of memory is free; "
                          "score fewer accuracy.tokens or run a smaller accuracy.batch")


@contextmanager
def input_boundary(key: str, source: object):
    """Where a file the user named is read: whatever is raised becomes a ConfigError on `key`, one line
    naming the file. The readers' own refusals (CheckpointError, PromptError, ConfigError) say what is
    allowed; anything else (a library's exception on a file it was not written for, a file name the
    system refuses, JSON nested past Python's stack) is said as it was raised, with its type, never as
    a traceback."""
    try:
        yield
    except ConfigError:
        raise
    except (CheckpointError, PromptError, LocationError) as error:
        raise ConfigError(key, str(error)) from None
    except OSError as error:
        raise ConfigError(key, f"cannot read '{source}': {error.strerror or first_line(error)}") from None
    except RecursionError:
        raise ConfigError(key, f"'{source}' nests deeper than can be read") from None
    except Exception as error:  # noqa: BLE001 - the input boundary: one line, whatever a reader raised
        raise ConfigError(key, f"'{source}' cannot be read: {first_line(error)}") from None


@functools.cache
def _reference_candidates() -> tuple[tuple[type, str], ...]:
    """(class, torch backend) of every exact caching strategy of the catalog, in its order."""
    found = []
    for cls in strategy_catalog().values():
        backend = next((b for b in cls.backend_names() if b in TORCH_BACKENDS), None)
        if cls.exact and cls.caches_kv and backend is not None:
            found.append((cls, backend))
    return tuple(found)


def accuracy_reference(strategy: StrategyChoice, shape: ModelConfig, device: str, dtype: str) -> Optional[str]:
    """"<module>.<Class>:<backend>" of the strategy an approximate `strategy` is judged against (the
    module docstring), None for an exact one; ConfigError when the catalog has none that runs here."""
    if strategy.exact:
        return None
    for cls, backend in _reference_candidates():
        candidate = cls(backend=backend)
        if could_be_reference(cls.exact, candidate.cache_layout(shape)) and candidate.unavailable(
                torch.device(device), getattr(torch, dtype)) is None:
            return f"{cls.__module__}.{cls.__qualname__}:{backend}"
    raise ConfigError("strategy", f"{strategy.name} is approximate, and no exact strategy with the contiguous "
                                  f"layout and a torch backend ({', '.join(TORCH_BACKENDS)}) runs on {device}/{dtype} "
                                  "to measure it against")
