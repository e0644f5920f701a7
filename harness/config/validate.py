"""Checks a composed config must pass before anything runs: one clear line per problem.

Types and unknown keys are enforced by the schemas (harness.config.schema) while Hydra composes; this
module checks values: known names, sizes that are positive and fit a 64-bit integer, shapes that can
exist, modes that fit the device, every number of the whole tree bounded (`bounded_tree`: integers
fit int64, floats are finite, strategy options included), a `_target_` that imports (`target_class`),
the folders a tool reads (`input_folder`) or writes (`output_folder`), and where a checkpoint is
(`checkpoint_path`). The runner, the analytic CLI and the report call the same functions. Every
failure is a ConfigError naming the key and what is allowed. A strategy checks its own options
(strategies.base.Strategy); this module knows no strategy.
"""
from __future__ import annotations

import importlib
import math
import os
import re
from pathlib import Path
from typing import Any, Optional

from harness.config.schema import RunConfig, unknown_key
from harness.config.texts import is_builtin_text
from harness.config.paths import LocationError, checkpoint_location, expanded, kind_of, not_a_checkpoint

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
PREFILL_MODES = ("compute", "random")
TRAFFIC_SOURCES = ("auto", "model", "ncu")
MATMUL_KERNELS = ("auto", "aten", "onednn", "c")
COMPILE_MODES = ("none", "inductor")  # harness.measure.compiled
SEARCHES = ("none", "max_batch")  # harness.run.capacity_search
ROPE_SCALINGS = ("llama3", "linear")  # model.rope_scaling besides null (harness.model.decoder)
INTERLEAVE_MODES = ("shape", "none")  # harness.run.grouping
REPEATS_MAX = 100  # repeats= of a sweep: each one measures every group again
ACCURACY_TOKENS_MAX = 1_000_000  # accuracy.tokens (.steps at most them): each scored token is a decode step of two models
POSITIVE_RUN_KEYS = ("batch", "ctx", "decode_tokens")
POSITIVE_MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
INT64_MAX = 2**63 - 1  # Parquet columns are int64: a larger integer cannot be written to a row
INT64_MIN = -(2**63)
CALIBRATION_BUDGET_MAX_S = 24 * 3600  # a day: beyond that a budget bounds nothing
NAME_CHARACTERS = "letters, digits, '_', '-' and '.'"  # names become part of file names


LINE_MAX = 1000  # characters of a one-line answer: a value quoted from a file or the command line is clipped to fit


def clipped(text: str, most: int = LINE_MAX) -> str:
    """`text` on one line of at most `most` characters: its head and its tail (which says what is allowed)
    kept, the middle of a long quoted value left out."""
    text = " ".join(text.splitlines())
    if len(text) <= most:
        return text
    tail = most // 4
    return f"{text[: most - tail - 5]} ... {text[-tail:]}"


class ConfigError(ValueError):
    """A bad configuration value. str() is the one line shown to the user (`clipped`)."""

    def __init__(self, key: str, message: str):
        super().__init__(clipped(f"{key}: {message}"))
        self.key = key


def positive_int(key: str, value: Any, at_most: int = INT64_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= at_most:
        raise ConfigError(key, f"must be an integer from 1 to {at_most:,}, got {value!r}")


def non_negative_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        raise ConfigError(key, f"must be an integer from 0 to {INT64_MAX:,}, got {value!r}")


def positive_float(key: str, value: Any, at_least: float | None = None, at_most: float | None = None) -> None:
    """A finite number above 0 (and within [at_least, at_most] where given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(key, f"must be a finite number above 0, got {value!r}")
    if (at_least is not None and value < at_least) or (at_most is not None and value > at_most):
        raise ConfigError(key, f"must be a number from {at_least:g} to {at_most:g}, got {value!r}")


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, f"unknown value {value!r}, allowed: {', '.join(allowed)}")


def safe_name(key: str, value: Any) -> None:
    """A name that becomes part of a file name: no '/', no leading '.', nothing a shell must quote."""
    text = str(value)
    if not text or text.startswith(".") or not all(c.isalnum() or c in "_-." for c in text):
        raise ConfigError(key, f"{text!r} cannot name a file; use {NAME_CHARACTERS}, not starting with '.'")


def bounded_tree(tree: Any, prefix: str = "") -> None:
    """Every number anywhere in a config (a plain container: OmegaConf.to_container(cfg, resolve=True))
    is bounded: integers fit a 64-bit integer (rows are int64 columns, strategy options JSON read back
    by int64 readers), floats are finite (JSON has no NaN or infinity). Booleans are not numbers here."""
    if isinstance(tree, dict):
        for name, value in tree.items():
            bounded_tree(value, f"{prefix}.{name}" if prefix else str(name))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            bounded_tree(value, f"{prefix}[{index}]")
    elif isinstance(tree, bool):
        return
    elif isinstance(tree, int) and not INT64_MIN <= tree <= INT64_MAX:
        raise ConfigError(prefix or "config", f"{tree} does not fit a 64-bit integer (at most {INT64_MAX:,})")
    elif isinstance(tree, float) and not math.isfinite(tree):
        raise ConfigError(prefix or "config", f"must be a finite number, got {tree!r}")


def target_class(key: str, target: Any, base: Optional[type] = None) -> type:
    """The class a `_target_` names (`package.module.Class`), imported: the one place such a path
    becomes a class (the checks, the strategy catalog, a point's `instantiate`, the analytic CLI).
    ConfigError in one line on `key` when it is not an import path, does not import, names no class, or
    (with `base`) names a class that is not a subclass of `base`. (Hydra's own get_class logs a
    three-line error before raising.)"""
    text = str(target) if target is not None else ""
    module_name, _, attribute = text.rpartition(".")
    parts = text.split(".")
    if not module_name or not all(part.isidentifier() for part in parts):
        raise ConfigError(key, f"{text!r} is not an import path 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or whatever the module raised while importing
        raise ConfigError(key, f"cannot import {text!r}: {first_line(error)}") from None
    found = getattr(module, attribute, None)
    if not isinstance(found, type):
        raise ConfigError(key, f"cannot import {text!r}: module {module_name!r} has no class {attribute!r}")
    if base is not None and not issubclass(found, base):
        raise ConfigError(key, f"{text!r} is not a {base.__module__}.{base.__qualname__} subclass")
    return found


def first_line(error: BaseException, typed: bool = True) -> str:
    """An exception in one line: the first line of its message, after its type's name where `typed`
    (the type alone where it has no message). Every one-line answer of the harness is made here."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = clipped(text.splitlines()[0])
    return f"{type(error).__name__}: {line}" if typed else line


def _path_text(key: str, value: Any, names: str = "a folder") -> str:
    """`value` as a path's text; `names`: what the key names, as its refusal says it."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise ConfigError(key, f"is empty: name {names} (absolute, or relative to the working directory)")
    if "\0" in text:
        raise ConfigError(key, f"{text!r} contains a NUL character and cannot name {names}")
    return text


def input_folder(key: str, value: Any) -> Path:
    """A folder a tool reads: named, and an existing directory."""
    return _existing(key, value, folder=True)


def input_file(key: str, value: Any) -> Path:
    """A file a tool reads: named, and an existing file."""
    return _existing(key, value, folder=False)


def _existing(key: str, value: Any, folder: bool) -> Path:
    text = _path_text(key, value, "a folder" if folder else "a file")
    try:
        path = expanded(text)
        found = path.is_dir() if folder else path.is_file()
    except LocationError as error:
        raise ConfigError(key, str(error)) from None
    except OSError as error:
        raise ConfigError(key, f"cannot read '{text}': {error.strerror or first_line(error)}") from None
    if not found:
        raise ConfigError(key, f"'{text}' is {kind_of(path)}, not {'a folder' if folder else 'a file'}")
    return path


def checkpoint_path(key: str, value: Any) -> Path:
    """A checkpoint a point loads: a folder (Hugging Face format) or a `.gguf` file, named by its path or
    as `pkg:PACKAGE/FILE` (harness.config.paths.checkpoint_location). Its contents are
    harness.model.checkpoint's to check."""
    try:
        path = checkpoint_location(_path_text(key, value, "a checkpoint folder or GGUF file"))
        refused = not_a_checkpoint(path)
    except LocationError as error:
        raise ConfigError(key, str(error)) from None
    except OSError as error:
        raise ConfigError(key, f"cannot read '{value}': {error.strerror or first_line(error)}") from None
    if refused:
        raise ConfigError(key, refused)
    return path


def output_folder(key: str, value: Any) -> Path:
    """A folder a tool writes into (created when missing): named, not a file, not under a file, and
    writable where it (or its nearest existing parent) is. Nothing is created here."""
    path = Path(_path_text(key, value))
    absolute = Path(os.path.abspath(path))
    try:
        if absolute.exists() and not absolute.is_dir():
            raise ConfigError(key, f"'{path}' is {kind_of(absolute)}, not a folder")  # a device or FIFO said as such
        existing = absolute
        while not existing.exists():
            existing = existing.parent
    except OSError as error:
        raise ConfigError(key, f"cannot use '{path}': {error.strerror}") from None
    if not existing.is_dir():
        raise ConfigError(key, f"'{path}' is under '{existing}', {kind_of(existing)}, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is read-only" if existing == absolute else f"cannot be created: '{existing}' is read-only"
        raise ConfigError(key, f"'{path}' {where}")
    return path


def validate_model(model) -> None:
    safe_name("model.name", model.name)
    for key in POSITIVE_MODEL_KEYS:
        positive_int(f"model.{key}", model[key], at_most=2**31 - 1)
    if model.n_heads % model.n_kv_heads:
        raise ConfigError(
            "model.n_heads",
            f"{model.n_heads} is not divisible by model.n_kv_heads={model.n_kv_heads}; "
            "grouped-query attention needs n_heads = k * n_kv_heads",
        )
    head_dim = model.head_dim
    if head_dim is None:
        if model.d_model % model.n_heads:
            raise ConfigError(
                "model.d_model",
                f"{model.d_model} is not divisible by model.n_heads={model.n_heads}; set model.head_dim explicitly",
            )
        head_dim = model.d_model // model.n_heads
    positive_int("model.head_dim", head_dim, at_most=2**31 - 1)
    if head_dim % 2:
        raise ConfigError("model.head_dim", f"must be even for RoPE, got {head_dim}")
    positive_float("model.rope_theta", model.rope_theta)
    positive_float("model.norm_eps", model.norm_eps)
    validate_rope_scaling(model)


def validate_rope_scaling(model) -> None:
    """Linear or Llama 3.1's RoPE scaling (harness.model.decoder.rope_inverse_frequencies), where asked for."""
    scaling = model.get("rope_scaling")
    if scaling is None:
        return
    one_of("model.rope_scaling", scaling, ROPE_SCALINGS)
    positive_float("model.rope_scaling_factor", model.rope_scaling_factor)
    if scaling == "linear":
        return
    positive_float("model.rope_low_freq_factor", model.rope_low_freq_factor)
    positive_float("model.rope_high_freq_factor", model.rope_high_freq_factor)
    positive_int("model.rope_original_max_len", model.rope_original_max_len, at_most=2**31 - 1)
    if model.rope_high_freq_factor <= model.rope_low_freq_factor:
        raise ConfigError("model.rope_high_freq_factor", f"must be above model.rope_low_freq_factor="
                                                         f"{model.rope_low_freq_factor}, got {model.rope_high_freq_factor}")


def validate_timing(timing) -> None:
    non_negative_int("timing.warmup_min", timing.warmup_min)
    if timing.warmup_max < max(timing.warmup_min, 1):
        raise ConfigError("timing.warmup_max", f"must be >= max(timing.warmup_min, 1), got {timing.warmup_max}")
    positive_int("timing.warmup_max", timing.warmup_max, at_most=10_000)
    positive_float("timing.settle_tolerance", timing.settle_tolerance)
    positive_int("timing.prefill_repeats", timing.prefill_repeats, at_most=1000)
    positive_float("timing.prefill_budget_s", timing.prefill_budget_s)
    positive_float("timing.rounds_budget_s", timing.rounds_budget_s, at_least=0.001, at_most=86400)
    positive_int("timing.max_passes", timing.max_passes, at_most=1000)


def validate_accuracy(accuracy) -> None:
    positive_int("accuracy.tokens", accuracy.tokens, at_most=ACCURACY_TOKENS_MAX)
    positive_int("accuracy.steps", accuracy.steps, at_most=ACCURACY_TOKENS_MAX)
    if accuracy.steps > accuracy.tokens:  # a window's steps past the tokens scored would score nothing: refused, not cut
        raise ConfigError("accuracy.steps", f"must be at most accuracy.tokens={accuracy.tokens:,} (the tokens scored), "
                                            f"got {accuracy.steps:,}")
    positive_int("accuracy.batch", accuracy.batch, at_most=4096)
    if accuracy.at_batch is not None:
        positive_int("accuracy.at_batch", accuracy.at_batch)
    if accuracy.max_ctx is not None:
        positive_int("accuracy.max_ctx", accuracy.max_ctx)



def interpolations_resolve(cfg, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """Every `${...}` of a composed config resolves, each to a value of its key's type: ConfigError
    naming the first key whose interpolation does not (an unset environment variable, an unknown
    resolver, a key that does not exist, a cycle), with the text given and why. Checked before
    anything reads a value, since the read would raise OmegaConf's own error (a traceback). `skip`:
    keys left unchecked (Hydra's own node, whose job fields are set only when a job runs)."""
    from omegaconf import DictConfig, OmegaConf  # imported here: this module stays free of omegaconf at import
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException, ValidationError  # likewise

    keys = list(cfg.keys()) if isinstance(cfg, DictConfig) else list(range(len(cfg)))
    for key in keys:
        name = f"{prefix}.{key}" if prefix and isinstance(key, str) else f"{prefix}[{key}]" if prefix else str(key)
        if name in skip:
            continue
        try:
            value = cfg[key]
        except MissingMandatoryValue:
            raise ConfigError(name, "is missing ('???'): give it a value") from None
        except OmegaConfBaseException as error:
            raw = OmegaConf.to_container(cfg, resolve=False)[key]
            problem = "gives a value of the wrong type" if isinstance(error, ValidationError) else "does not resolve"
            reason = re.sub(r"^\w+ raised while resolving interpolation: ", "", str(error).strip().splitlines()[0])
            raise ConfigError(name, f"{raw!r} {problem}: {reason}") from None
        if OmegaConf.is_config(value) and not OmegaConf.is_interpolation(cfg, key):  # a reference: checked where it points
            interpolations_resolve(value, name, skip)


def _plain(cfg) -> Any:
    """A composed config as plain containers, interpolations resolved (omegaconf imported only here)."""
    if isinstance(cfg, (dict, list)):
        return cfg
    from omegaconf import OmegaConf  # here: this module stays free of omegaconf at import

    return OmegaConf.to_container(cfg, resolve=True)


def validate_sizes(cfg) -> None:
    """The keys the runner and the analytic CLI share: the shape and the sizes (batch, ctx, decode_tokens)."""
    for key in POSITIVE_RUN_KEYS:
        positive_int(key, cfg[key])
    validate_model(cfg.model)


def known_keys(cfg, schema=RunConfig) -> None:
    """ConfigError naming the first key of a composed config that no field of `schema` names (one
    added with `+`), with the keys allowed where it stands."""
    unknown = unknown_key(cfg, schema)
    if unknown:
        key, allowed = unknown
        parent = key.rpartition(".")[0]
        raise ConfigError(key, f"is not a key; allowed{' in ' + parent if parent else ''}: {', '.join(allowed)}")


def validate_run(cfg, cuda_available) -> None:
    """Raise ConfigError for the first bad value of a composed RunConfig (the strategy's own options
    are checked by its class, in harness.run.resolve).

    `cuda_available` is a callable, so a CPU-only config never pays for asking.
    """
    known_keys(cfg)
    validate_sizes(cfg)
    output_folder("results_dir", cfg.results_dir)
    non_negative_int("seed", cfg.seed)
    one_of("device", cfg.device, DEVICES)
    one_of("dtype", cfg.dtype, DTYPES)
    one_of("prefill", cfg.prefill, PREFILL_MODES)
    one_of("traffic", cfg.traffic, TRAFFIC_SOURCES)
    one_of("matmul", cfg.matmul, MATMUL_KERNELS)
    one_of("compile", cfg.compile, COMPILE_MODES)
    one_of("search", cfg.search, SEARCHES)
    one_of("interleave", cfg.interleave, INTERLEAVE_MODES)
    positive_int("repeats", cfg.repeats, at_most=REPEATS_MAX)
    if cfg.memory_limit_bytes is not None:
        positive_float("memory_limit_bytes", cfg.memory_limit_bytes, at_least=1, at_most=INT64_MAX)
    if cfg.search != "none" and cfg.memory_limit_bytes is None:
        raise ConfigError("memory_limit_bytes", f"search={cfg.search} needs a limit to search within: set memory_limit_bytes=<bytes>")
    if cfg.hugepages and not cfg.isolate:
        raise ConfigError("hugepages", "needs isolate=true: torch reads THP_MEM_ALLOC_ENABLE at a process's first "
                                       "allocation, which this process has long made")
    validate_timing(cfg.timing)
    validate_accuracy(cfg.accuracy)
    if cfg.model.get("checkpoint") is not None:  # its contents: harness.run.inputs, as the point resolves
        checkpoint_path("model.checkpoint", cfg.model.checkpoint)
    if cfg.get("prompt") is not None and not is_builtin_text(cfg.prompt):
        input_file("prompt", cfg.prompt)
    positive_float("calibration_budget_s", cfg.calibration_budget_s, at_least=1, at_most=CALIBRATION_BUDGET_MAX_S)
    strategy = cfg.strategy
    if "_target_" not in strategy:
        raise ConfigError("strategy", "no _target_: pick an option of conf/strategy/ (strategy=<name>)")
    target_class("strategy._target_", strategy["_target_"])
    bounded_tree(_plain(cfg))  # what no check above names: the strategy's options, any other number

    device = cfg.device
    if device == "cuda" and not cuda_available():
        raise ConfigError("device", "cuda was asked for but torch sees no CUDA device here; allowed: auto, cpu")
    on_cpu = device == "cpu" or (device == "auto" and not cuda_available())
    if cfg.timing.cuda_graphs and cfg.compile != "none":
        raise ConfigError("timing.cuda_graphs", f"compile={cfg.compile} replays its own CUDA graphs (mode=reduce-overhead); "
                                                "allowed with it: false")
    if cfg.timing.cuda_graphs and on_cpu:
        # Refused rather than ignored: a row must never claim a timing method that did not run.
        raise ConfigError("timing.cuda_graphs", "CUDA graphs need a CUDA device and this point runs on cpu; allowed: false")
    if on_cpu and cfg.traffic == "ncu":
        raise ConfigError("traffic", "ncu reads GPU DRAM counters and needs CUDA; on cpu use auto or model")
