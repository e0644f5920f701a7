"""The schema of a checkpoint's metadata: every field the loader reads, its type, the values it may
take and its default, declared once (CONFIG_FIELDS) and checked in one place (`checked_fields`)
before anything reads a value. A wrong type or an out-of-range value is a CheckpointError in one
line naming the file, the field and what is allowed.

The rules, the same for every field:
- An integer is a JSON integer: `512.0` is refused, not rounded, since a float where an integer
  belongs says the file was written by something other than a model's own config class.
- A number is a JSON integer or float, finite (`NaN` and `Infinity` parse, and are refused).
- A bool is a JSON `true` or `false`: the string "false" is refused, not read as true.
- An absent key and a JSON `null` both mean the field's default; a field without one is required.
- An object's own fields are checked the same way (rope_scaling, quantization_config); a key no
  field names is not read, and not checked.

The table is in config.json's names. Another format's reader (a GGUF file, say, whose keys are
`llama.block_count` and the like) maps its own keys onto these names and checks them through the
same functions, passing `where`: the function that names a field, in its own file and its own key,
for the messages. `config_shape` then turns the checked fields into the decoder's shape, with the
rules that relate one field to another (the family, the RoPE variant, whole query groups).
"""
from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from harness.config import ModelConfig
from harness.config.validate import first_line

# config.json's `architectures` entry -> its `model_type`: the families the decoder reproduces.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
QKV_BIAS = {"llama": False, "mistral": False, "qwen2": True}  # the family's q/k/v projections carry a bias
SIZE_MAX = 2**31 - 1  # a width or a count: what harness.config.validate allows a model's sizes
LAYERS_MAX = 10_000  # decoder blocks: far beyond any model (Llama 3.1 405B has 126); bounds the tensor list built
JSON_MAX_BYTES = 16 * 2**20  # config.json or an index: kilobytes to a few MiB (a 405B model's index is ~100 KiB)
SHOWN_CHARACTERS = 60  # of a refused value in a message: enough to recognise it, one line whatever it holds
KINDS = ("integer", "number", "bool", "text", "texts", "integers", "numbers", "object")
Where = Callable[[str], str]  # a field's name -> how a message names it: "'<file>': <key>"


class CheckpointError(ValueError):
    """A checkpoint the decoder cannot load. str() is one line naming the file."""


class _Required:
    def __repr__(self) -> str:
        return "required"


REQUIRED: Any = _Required()  # a Field's default when the field must be given


@dataclass(frozen=True)
class Field:
    """One field of a metadata object: its name, what type and values it may hold, and its default."""

    name: str  # the key (config.json's name; a nested object's fields: the key within it)
    kind: str  # one of KINDS: integer (JSON integer), number (integer or float), bool, text (a string),
    #            texts (a non-empty list of strings), integers (a list of integers), numbers (a list of
    #            finite numbers), object (its own fields)
    default: Any = REQUIRED  # the value when the key is absent or null; REQUIRED: it must be given
    low: float = 1  # integer, integers: the smallest allowed; number: allowed only above it
    high: float = SIZE_MAX  # integer, integers, number: the largest allowed (a number: math.inf for no bound)
    allowed: tuple = ()  # text, bool, texts' entries: the only values accepted (empty: any)
    length: Optional[int] = None  # integers, numbers: the exact number of entries (None: any)
    fields: tuple["Field", ...] = ()  # object: its own fields (none: the object as it is, for its reader to check)

    def __post_init__(self):
        if self.kind not in KINDS:  # a table's typo, not a file's fault
            raise ValueError(f"field {self.name}: kind {self.kind!r} is not one of {KINDS}")

    def describe(self) -> str:
        """What the field may hold, as a message says it."""
        if self.allowed:
            choices = ", ".join(_json_text(value) for value in self.allowed)
            one = choices if len(self.allowed) == 1 else f"one of: {choices}"
            return f"a list of strings, each {one}" if self.kind == "texts" else one
        bounds = f"from {self.low:,} to {self.high:,}"
        # words both sources share: a GGUF field is no JSON (only config.json has objects)
        return {"integer": f"an integer {bounds}",
                "number": f"a finite number above {self.low:g}" + (f", at most {self.high:g}" if math.isfinite(self.high) else ""),
                "bool": "true or false (a bool)",
                "text": "a string",
                "texts": "a non-empty list of strings",
                "integers": f"a list of{'' if self.length is None else f' {self.length:,}'} integers, each {bounds}",
                "numbers": f"a list of{'' if self.length is None else f' {self.length:,}'} finite numbers",
                "object": "a JSON object"}[self.kind]

    def accepts(self, value: Any) -> bool:
        """Whether `value` (not null) is of this field's kind and within its values."""
        if self.kind == "integer":
            return _integer(value) and self.low <= value <= self.high
        if self.kind == "number":
            return _number(value) and math.isfinite(value) and self.low < value <= self.high
        if self.kind == "integers":
            return (isinstance(value, list) and (self.length is None or len(value) == self.length)
                    and all(_integer(v) and self.low <= v <= self.high for v in value))
        if self.kind == "numbers":
            return (isinstance(value, list) and (self.length is None or len(value) == self.length)
                    and all(_number(v) and math.isfinite(v) for v in value))
        if self.kind == "texts":
            return (isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
                    and (not self.allowed or all(v in self.allowed for v in value)))
        typed = {"bool": bool, "text": str, "object": dict}[self.kind]
        return type(value) is typed and (not self.allowed or value in self.allowed)


def _integer(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass, and not an integer here


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _json_text(value: Any) -> str:
    """A bool as JSON writes it (true, false), anything else as str() does."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


_SHORT_REPR = reprlib.Repr()  # bounded work and length, whatever a file holds (Python 3.11 takes no arguments)
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict, _SHORT_REPR.maxlong = 3, 4, 4, 30
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = SHOWN_CHARACTERS


def shown(value: Any) -> str:
    """A value from a file as a message shows it: its repr, clipped, on one line."""
    text = "null" if value is None else _json_text(value) if isinstance(value, bool) else _SHORT_REPR.repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."


def _kind_said(field: Field, value: Any) -> str:
    """" (a string)" where `value` is of another kind than `field` holds, so a wrong type does not read as
    a value out of range; "" where it is of the kind and only out of range."""
    kinds = {"integer": (int,), "number": (int, float), "bool": (bool,), "text": (str,), "texts": (list,),
             "integers": (list,), "numbers": (list,), "object": (dict,)}[field.kind]
    if type(value) in kinds and not (field.kind in ("integer", "number") and isinstance(value, bool)):
        return ""
    names = {bool: "a bool", int: "an integer", float: "a float", str: "a string", list: "a list", dict: "an object"}
    return f" ({names.get(type(value), type(value).__name__)})"


def checked_fields(values: Mapping[str, Any], table: Sequence[Field], where: Where, prefix: str = "") -> dict[str, Any]:
    """`values` checked against `table`: a dict of every field of the table, the default where the key
    is absent or null, an object's fields as its own dict; numbers as floats. CheckpointError naming
    where(field) and what the field allows otherwise. `prefix` names an object's fields by its key
    (rope_scaling.factor)."""
    checked: dict[str, Any] = {}
    for field in table:
        name, value = prefix + field.name, values.get(field.name)
        if value is None and field.default is REQUIRED:  # absent or null alike (a mapped format's absent key is None)
            raise CheckpointError(f"{where(name)} is missing: it must be {field.describe()}")
        if value is None:
            checked[field.name] = field.default
        elif not field.accepts(value):
            raise CheckpointError(f"{where(name)} must be {field.describe()}, got {shown(value)}{_kind_said(field, value)}")
        elif field.kind == "object" and field.fields:
            checked[field.name] = checked_fields(value, field.fields, where, f"{name}.")
        else:
            checked[field.name] = float(value) if field.kind == "number" else value
    return checked


# RoPE's fields: transformers 5's `rope_parameters`, 4's `rope_scaling` (theta then at the top level).
ROPE_TYPES = ("default", "linear", "llama3")  # the variants harness.model.decoder.RotaryTable computes
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_FIELDS = (
    Field("rope_type", "text", None, allowed=ROPE_TYPES),
    Field("type", "text", None, allowed=ROPE_TYPES),  # the name transformers before 4.45 wrote
    Field("rope_theta", "number", None, low=0, high=math.inf),
    Field("factor", "number", None, low=0, high=math.inf),
    Field("low_freq_factor", "number", None, low=0, high=math.inf),
    Field("high_freq_factor", "number", None, low=0, high=math.inf),
    Field("original_max_position_embeddings", "integer", None),
)
QUANTIZATION_FIELDS = (Field("quant_method", "text", "unnamed"),)

# Every field of config.json the loader reads (model.safetensors' headers: harness.model.safetensors_header).
CONFIG_FIELDS = (
    Field("architectures", "texts"),
    Field("model_type", "text"),
    Field("quantization_config", "object", None, fields=QUANTIZATION_FIELDS),  # present: refused (config_shape)
    Field("hidden_size", "integer"),
    Field("num_hidden_layers", "integer", high=LAYERS_MAX),
    Field("num_attention_heads", "integer"),
    Field("num_key_value_heads", "integer", None),  # None: one KV head per query head
    Field("intermediate_size", "integer"),
    Field("head_dim", "integer", None),  # None: hidden_size // num_attention_heads
    Field("vocab_size", "integer"),
    Field("rms_norm_eps", "number", 1e-6, low=0, high=1),
    Field("rope_theta", "number", 10000.0, low=0, high=math.inf),
    Field("rope_parameters", "object", None, fields=ROPE_FIELDS),
    Field("rope_scaling", "object", None, fields=ROPE_FIELDS),
    Field("hidden_act", "text", "silu", allowed=("silu",)),  # the decoder's MLP is SwiGLU
    Field("mlp_bias", "bool", False, allowed=(False,)),  # Llama's options: the decoder has no bias there
    Field("attention_bias", "bool", False, allowed=(False,)),
    Field("tie_word_embeddings", "bool", False),
    Field("sliding_window", "integer", None),  # Mistral v0.1's window; None: full attention
    Field("use_sliding_window", "bool", False),  # Qwen2: whether its sliding_window applies
)


def config_shape(values: Mapping[str, Any], where: Where, name: str, checkpoint: str) -> tuple[ModelConfig, Optional[int]]:
    """The decoder's shape from a checkpoint's metadata (config.json's names, checked against
    CONFIG_FIELDS here), and the attention window it turns on (None: full attention)."""
    config = checked_fields(values, CONFIG_FIELDS, where)
    family = _family(config, where)
    n_heads, d_model = config["num_attention_heads"], config["hidden_size"]
    n_kv_heads = config["num_key_value_heads"] or n_heads
    head_dim = config["head_dim"] or d_model // n_heads
    if head_dim == 0:
        raise CheckpointError(f"{where('hidden_size')} {d_model} over num_attention_heads {n_heads} leaves heads no "
                              "width; set head_dim")
    if head_dim % 2 or n_heads % n_kv_heads:
        raise CheckpointError(f"{where('num_attention_heads')} {n_heads} over num_key_value_heads {n_kv_heads} of "
                              f"head width {head_dim}: the decoder needs whole query groups and an even head width")
    shape = ModelConfig(
        name=name, vocab_size=config["vocab_size"], d_model=d_model, n_layers=config["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=config["intermediate_size"], head_dim=head_dim,
        norm_eps=config["rms_norm_eps"], checkpoint=checkpoint, attention_bias=QKV_BIAS[family],
        tie_embeddings=config["tie_word_embeddings"], **_rope(config, where))
    window = config["sliding_window"] if family != "qwen2" or config["use_sliding_window"] else None
    return shape, window


def _family(config: dict, where: Where) -> str:
    if config["quantization_config"] is not None:
        method = config["quantization_config"]["quant_method"]
        raise CheckpointError(f"{where('quantization_config')} describes a quantized checkpoint ({shown(method)}); "
                              "only float weights (F32, F16, BF16) load")
    known = [a for a in config["architectures"] if a in ARCHITECTURES]
    model_type = config["model_type"]
    if not known or ARCHITECTURES[known[0]] != model_type:
        raise CheckpointError(f"{where('architectures')} is {shown(config['architectures'])} with model_type "
                              f"{shown(model_type)}; allowed: {', '.join(ARCHITECTURES)}, each with its model_type "
                              f"({', '.join(ARCHITECTURES.values())})")
    return model_type


def _rope(config: dict, where: Where) -> dict:
    """ModelConfig's RoPE fields: transformers 5's `rope_parameters` (theta inside), else 4's
    `rope_scaling` (theta at the top level)."""
    key = "rope_parameters" if config["rope_parameters"] else "rope_scaling"
    parameters = config[key] or {}
    theta = parameters.get("rope_theta") or config["rope_theta"]
    kind = parameters.get("rope_type") or parameters.get("type") or "default"
    if kind == "default":
        return {"rope_theta": theta}
    if kind == "linear":
        if parameters["factor"] is None:
            raise CheckpointError(f"{where(f'{key}.factor')} is missing: linear RoPE scaling needs it")
        return {"rope_theta": theta, "rope_scaling": "linear", "rope_scaling_factor": parameters["factor"]}
    for field in LLAMA3_FIELDS:
        if parameters[field] is None:
            raise CheckpointError(f"{where(f'{key}.{field}')} is missing: llama3 RoPE scaling needs it")
    if parameters["high_freq_factor"] <= parameters["low_freq_factor"]:
        raise CheckpointError(f"{where(f'{key}.high_freq_factor')} must be above {key}.low_freq_factor "
                              f"({parameters['low_freq_factor']:g}), got {parameters['high_freq_factor']:g}")
    return {"rope_theta": theta, "rope_scaling": "llama3", "rope_scaling_factor": parameters["factor"],
            "rope_low_freq_factor": parameters["low_freq_factor"],
            "rope_high_freq_factor": parameters["high_freq_factor"],
            "rope_original_max_len": parameters["original_max_position_embeddings"]}


def read_json_object(path: Path, max_bytes: int = JSON_MAX_BYTES) -> tuple[bytes, dict]:
    """A metadata file's bytes and its JSON object; CheckpointError naming the file when it is larger
    than `max_bytes` (metadata is kilobytes: a larger file is not one), not JSON, or not an object."""
    size = path.stat().st_size
    if size > max_bytes:
        raise CheckpointError(f"'{path}' is {size:,} bytes, not a metadata file (at most {max_bytes:,})")
    raw = path.read_bytes()
    return raw, json_object(raw, f"'{path}'")


def json_object(raw: bytes, what: str, loads: Callable[[bytes], Any] = json.loads) -> dict:
    """`raw` parsed as a JSON object by `loads` (Python's JSON reader, or a stricter one raising
    ValueError: the reader of the file's format); CheckpointError saying `what` is not one."""
    try:
        value = loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:  # RecursionError: nesting deeper than Python's stack
        raise CheckpointError(f"{what} is not valid JSON ({first_line(error, typed=False)})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} holds {shown(value)}, not a JSON object")
    return value
