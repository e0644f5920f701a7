"""config.json against its schema (harness.model.checkpoint_fields): any value of any type in any field
is either a clean load or one CheckpointError line naming the file, the field and what is allowed;
never another exception, never a wrong type let through. The cases a new user's bad inputs hit first,
every field against every kind of JSON value, and a property over drawn values."""
from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harness.config import ModelConfig
from harness.model.checkpoint import CheckpointError, read_checkpoint
from harness.model.checkpoint_fields import CONFIG_FIELDS, ROPE_FIELDS, Field, checked_fields, config_shape
from harness.run.plan import plan
from tests.checkpoint_files import CONFIG, edit_config, write_checkpoint
from tests.conftest import refused_by_runner

NO_CUDA = lambda: False  # noqa: E731


@pytest.fixture
def folder(tmp_path):
    return write_checkpoint(tmp_path / "tiny-llama")


def refused(folder, **changes) -> str:
    edit_config(folder, **changes)
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(folder)
    message = str(error.value)
    assert "\n" not in message and f"'{folder / 'config.json'}'" in message, message
    return message


# A new user's bad inputs: each was a traceback (or a silent wrong load) before the schema.
@pytest.mark.parametrize("field,value,says", [
    ("num_hidden_layers", math.nan, "num_hidden_layers must be an integer from 1 to 10,000, got nan"),
    ("num_hidden_layers", math.inf, "num_hidden_layers must be an integer from 1 to 10,000, got inf"),
    ("num_hidden_layers", 10**12, "num_hidden_layers must be an integer from 1 to 10,000"),  # would build 9e12 names
    ("architectures", 7, "architectures must be a non-empty list of strings, got 7"),
    ("architectures", [["LlamaForCausalLM"]], "architectures must be a non-empty list of strings"),
    ("architectures", [], "architectures must be a non-empty list of strings"),
    ("rope_scaling", "llama3", "rope_scaling must be a JSON object, got 'llama3'"),
    ("rope_scaling", [8.0], "rope_scaling must be a JSON object, got [8.0]"),
    ("rope_scaling", 8, "rope_scaling must be a JSON object, got 8"),
    ("rope_scaling", {"rope_type": "llama3", "factor": "8"}, "rope_scaling.factor must be a finite number above 0"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type must be one of: default, linear, llama3"),
    ("rope_scaling", {"rope_type": "llama3"}, "rope_scaling.factor is missing"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 32}, "high_freq_factor must be above"),
    ("quantization_config", "bitsandbytes", "quantization_config must be a JSON object, got 'bitsandbytes'"),
    ("quantization_config", {"quant_method": "gptq"}, "describes a quantized checkpoint ('gptq')"),
    ("quantization_config", {}, "describes a quantized checkpoint"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false (a bool), got 'false'"),
    ("tie_word_embeddings", 0, "tie_word_embeddings must be true or false (a bool), got 0"),
    ("vocab_size", 512.0, "vocab_size must be an integer from 1 to 2,147,483,647, got 512.0"),
    ("vocab_size", True, "vocab_size must be an integer"),
    ("hidden_size", None, "hidden_size is missing: it must be an integer from 1 to 2,147,483,647"),  # null: absent
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be a finite number above 0, at most 1"),
    ("rope_theta", math.inf, "rope_theta must be a finite number above 0, got inf"),
    ("hidden_act", "gelu", "hidden_act must be silu, got 'gelu'"),
    ("mlp_bias", True, "mlp_bias must be false, got true"),
    ("sliding_window", -4, "sliding_window must be an integer from 1"),
    ("num_key_value_heads", 3, "num_attention_heads 2 over num_key_value_heads 3"),
    ("model_type", "gpt2", "allowed: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
])
def test_a_bad_field_is_one_line_naming_file_field_and_what_is_allowed(folder, field, value, says):
    assert says in refused(folder, **{field: value})


def test_the_config_must_be_a_json_object(folder):
    for text, says in [("[1, 2]", "holds [1, 2], not a JSON object"), ("{", "is not valid JSON"),
                       ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),  # deeper than Python's stack
                       ('{"vocab_size": 1' + "0" * 5000 + "}", "is not valid JSON")]:  # past int parsing's limit
        (folder / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match="config.json") as error:
            read_checkpoint(folder)
        assert says in str(error.value) and "\n" not in str(error.value)


def test_a_huge_config_is_refused_unread(folder):
    with open(folder / "config.json", "ab") as f:
        f.truncate(17 * 2**20)  # sparse: nothing to parse, and too large to be metadata
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="not a metadata file"):
        read_checkpoint(folder)
    assert time.monotonic() - started < 5


# Every field, every kind of JSON value: accepted exactly when the field's kind and range allow it.
KINDS_OF_VALUE = [True, False, 0, 1, 2, -3, 2**40, 0.5, 2.0, 512.0, math.nan, math.inf, -math.inf, "", "x", "silu",
                  "false", [], [1], ["LlamaForCausalLM"], {}, {"a": 1}]


def legal(field: Field, value) -> bool:
    """What the schema promises, said apart from its code: JSON ints for integers (bools are not),
    finite numbers, JSON bools, strings, lists of strings, objects; within the field's range."""
    if field.kind == "integer":
        return type(value) is int and field.low <= value <= field.high
    if field.kind == "number":
        return type(value) in (int, float) and math.isfinite(value) and field.low < value <= field.high
    if field.kind == "bool":
        return type(value) is bool and (not field.allowed or value in field.allowed)
    if field.kind == "text":
        return type(value) is str and (not field.allowed or value in field.allowed)
    if field.kind == "texts":
        return type(value) is list and len(value) > 0 and all(type(v) is str for v in value)
    return type(value) is dict


@pytest.mark.parametrize("field", [*CONFIG_FIELDS, *ROPE_FIELDS], ids=lambda f: f.name)
def test_every_field_takes_exactly_its_kind(field):
    where = lambda name: f"'config.json': {name}"  # noqa: E731
    for value in KINDS_OF_VALUE:
        if legal(field, value):
            got = checked_fields({field.name: value}, [field], where)[field.name]
            if field.kind == "object":  # its own fields, checked the same way
                assert isinstance(got, dict) and set(got) == {f.name for f in field.fields}
            else:
                assert got == value and (type(got) is float if field.kind == "number" else type(got) is type(value))
        else:
            with pytest.raises(CheckpointError) as error:
                checked_fields({field.name: value}, [field], where)
            message = str(error.value)
            assert message.startswith(f"'config.json': {field.name} must be") and "\n" not in message, message


def test_null_or_absent_is_the_default_and_legal_values_load(folder):
    edit_config(folder, head_dim=None, rope_theta=500000, sliding_window=None, rope_scaling=None,
                quantization_config=None, rms_norm_eps=1, tie_word_embeddings=None)
    shape = read_checkpoint(folder).shape
    assert (shape.head_dim, shape.rope_theta, shape.norm_eps, shape.tie_embeddings) == (8, 500000.0, 1.0, False)
    assert type(shape.rope_theta) is float and type(shape.tie_embeddings) is bool


# --- the property: any value of any type in any field ---------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=8)
    | st.sampled_from([1, 2, 8, 16, 24, 32, 1e-5, 10000.0, "LlamaForCausalLM", "llama", "silu", "llama3", "default"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from([f.name for f in ROPE_FIELDS]) | st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
field_names = st.sampled_from([f.name for f in CONFIG_FIELDS] + ["head_dim", "torch_dtype", "no_such_field"])
changes = st.dictionaries(field_names, json_values, min_size=1, max_size=3)


@example(changes={"num_hidden_layers": math.nan})
@example(changes={"architectures": 3})
@example(changes={"rope_scaling": {"rope_type": "llama3", "factor": math.inf}})
@example(changes={"tie_word_embeddings": True})  # legal: the head becomes the embedding table, lm_head extra
@example(changes={"hidden_size": 32})  # legal JSON, contradicted by the tensors
@settings(max_examples=300)
@given(changes=changes)
def test_any_value_in_any_field_loads_cleanly_or_is_one_line(tmp_path_factory, changes):
    folder = write_checkpoint(tmp_path_factory.mktemp("drawn") / "tiny-llama")
    edit_config(folder, **changes)
    try:
        checkpoint = read_checkpoint(folder)
    except CheckpointError as error:
        message = str(error)
        assert "\n" not in message and f"'{folder}" in message, message
        return
    shape = checkpoint.shape
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim"):
        assert type(getattr(shape, name)) is int and getattr(shape, name) > 0
    for name in ("rope_theta", "norm_eps", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
        assert type(getattr(shape, name)) is float and math.isfinite(getattr(shape, name))
    assert type(shape.tie_embeddings) is bool and shape.rope_scaling in (None, "llama3")


# --- through the runner: exit 2, one line, nothing written ----------------------------------------


def test_the_plan_refuses_a_bad_field_on_model_checkpoint(folder):
    edit_config(folder, num_hidden_layers=math.nan)
    with pytest.raises(Exception) as error:
        plan(["device=cpu", "model=tiny", f"model.checkpoint={folder}", "ctx=8"], cuda_available=NO_CUDA)
    assert type(error.value).__name__ == "ConfigError"
    assert str(error.value).startswith("model.checkpoint: ") and "num_hidden_layers must be an integer" in str(error.value)


def test_the_cli_refuses_a_bad_field_in_one_line_and_writes_nothing(folder, tmp_path):
    edit_config(folder, quantization_config="bitsandbytes")
    results = tmp_path / "results"
    line = refused_by_runner("device=cpu", "model=tiny", f"model.checkpoint={folder}", f"results_dir={results}")
    assert line.startswith("error: model.checkpoint: ") and "quantization_config must be a JSON object" in line
    assert not results.exists()


# --- the same schema for another format's metadata ------------------------------------------------

GGUF_KEYS = {"num_hidden_layers": "llama.block_count", "hidden_size": "llama.embedding_length"}  # a few, as a reader maps them


def test_another_format_maps_its_keys_onto_the_fields_and_names_its_own_in_messages():
    metadata = {**CONFIG, "num_hidden_layers": 2.0}  # a GGUF reader's values under config.json's names
    where = lambda field: f"'model.gguf': {GGUF_KEYS.get(field, field)}"  # noqa: E731
    with pytest.raises(CheckpointError, match=r"^'model.gguf': llama.block_count must be an integer"):
        config_shape(metadata, where, "model", "model.gguf")
    shape, window = config_shape({**metadata, "num_hidden_layers": 2}, where, "model", "model.gguf")
    assert isinstance(shape, ModelConfig) and shape.n_layers == 2 and window is None


def test_the_config_reaches_the_shape_unchanged(folder):
    config = json.loads((folder / "config.json").read_text())
    shape = read_checkpoint(folder).shape
    assert (shape.vocab_size, shape.d_model, shape.n_layers, shape.ffn_dim) == (
        config["vocab_size"], config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"])
