"""A GGUF file (llama.cpp's format) read as a checkpoint: its metadata mapped onto config.json's
fields, its tensors under the names Hugging Face gives them, and each tensor dequantized on its own.

harness.model.checkpoint builds the Checkpoint from what `read_gguf` finds: the shape through the
same schema as a config.json's (harness.model.checkpoint_fields, its messages naming this file's keys,
`llama.block_count` and the like), the tensors through the same check, and fills the decoder from
`dequantized_tensors` as it does from safetensors files. The `gguf` library llama.cpp publishes parses
the header and maps the file (gguf.GGUFReader: no tensor byte is read until it is dequantized), and
dequantizes (gguf.quants.dequantize).

Accepted: general.architecture `llama`, as llama.cpp's converter writes Llama 2/3, Mistral, SmolLM and
other Llama-shaped models, with tensors stored in one of DEQUANTIZED_TYPES. Refused with one line
naming the file (CheckpointError): a file whose header harness.model.gguf_scan refuses before the
library reads it (every declared count and length against the bytes left, llama.cpp's tensor rules),
or the library cannot parse, another architecture, a metadata field of the wrong kind or range (the
schema's rules), a model feature the decoder does not reproduce (UNSUPPORTED_KEYS; partial rotary
embeddings, `check_heads`), another tensor type, a missing, extra or misshapen tensor. RoPE scaling is
read as llama.cpp reads it (harness.model.gguf_rope): linear, and Llama 3.1's `rope_freqs.weight`.

Row order: llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`) reorders the rows of
attn_q and attn_k within each head, from Hugging Face's rotate-half halves to the adjacent pairs GGML's
RoPE rotates. `dequantized_tensors` undoes it, as transformers' GGUF loader does
(`_reverse_permute_weights`), so the decoder's RotaryTable rotates the pairs the model was trained with.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import gguf
import numpy as np

from harness.config import ModelConfig
from harness.model import gguf_rope, gguf_scan
from harness.model.checkpoint_fields import CheckpointError, Where, shown

if TYPE_CHECKING:  # the annotations only: torch is imported where a tensor is made (dequantized_tensors)
    import torch

ARCHITECTURE = "llama"  # general.architecture the decoder reproduces
# GGML tensor types gguf.quants.dequantize turns into float32 (floats, the legacy block quants, the K-quants).
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# config.json's field <- the GGUF key (after "llama.") llama.cpp's converter writes it as; the schema
# (harness.model.checkpoint_fields.CONFIG_FIELDS) checks the values and supplies the defaults.
CONFIG_KEYS = {
    "num_hidden_layers": "block_count", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base", "vocab_size": "vocab_size",
}
# Keys (after "llama.") whose presence, with a value other than these, names what the decoder lacks.
UNSUPPORTED_KEYS = {
    "expert_count": ((0,), "a mixture of experts"),
    "rope.scaling.type": (("none", "linear"), "RoPE scaling of a kind the decoder does not compute (it has linear)"),
    "rope.scaling.attn_factor": ((1.0,), "RoPE with scaled attention (YaRN's)"),
    "attention.sliding_window": ((0,), "sliding-window attention"),
}
ROPE_FACTOR_KEYS = ("rope.scaling.factor", "rope.scale_linear")  # linear scaling's factor, llama.cpp's key then its legacy one
HEAD_WIDTH_KEYS = ("rope.dimension_count", "attention.value_length")  # each, where present, is the heads' width
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1's RoPE scaling, stored as per-frequency factors
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFContents:
    config: dict[str, Any]  # the metadata under config.json's names, unchecked (the schema checks it)
    where: Where  # how a message names a config.json field: the file and its GGUF key
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # Hugging Face name -> (GGML type, shape as Hugging Face's)
    header: bytes  # the file up to its tensor data: magic, metadata, tensor table (hashed with the data's ends)


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor name (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight);
    a name the decoder does not load comes back as it is."""
    stem, _, kind = name.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if layer and layer[2] in LAYER_NAMES:
        return f"model.layers.{int(layer[1])}.{LAYER_NAMES[layer[2]]}.{kind}"
    return name


def gguf_name(name: str) -> str:
    """Inverse of hf_name: the name a tensor has in a GGUF file."""
    stem, _, kind = name.rpartition(".")
    for gguf_stem, hf_stem in GLOBAL_NAMES.items():
        if stem == hf_stem:
            return f"{gguf_stem}.{kind}"
    layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    for gguf_part, hf_part in LAYER_NAMES.items():
        if layer and layer[2] == hf_part:
            return f"blk.{layer[1]}.{gguf_part}.{kind}"
    return name


def reader(path: Path) -> gguf.GGUFReader:
    """The file's parsed header over its memory map; CheckpointError when the library cannot parse it.
    Cached per file, its size and time: the plan and the load parse it once per process."""
    stat = path.stat()
    return _reader(path, (stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _reader(path: Path, _stamp: tuple) -> gguf.GGUFReader:
    gguf_scan.scan(path)  # every declared count and length bounded by the file before the library reads one
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as error:
        # What the library raises for a file it cannot parse: a bad magic or version, a field or tensor
        # table running past the end of the file, a tensor type it does not know.
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"'{path}' cannot be read as GGUF: not GGUF, truncated, damaged, or with a tensor "
                              f"type the gguf library does not know ({reason})") from None


def metadata(path: Path, key: str, default: Any = None) -> Any:
    """A metadata field's value (a number, a string, a list), or `default` where the file has none."""
    field = reader(path).fields.get(key)
    return default if field is None else field.contents()


def read_gguf(path: Path) -> GGUFContents:
    """The metadata, tensors and header of the GGUF file at `path`, checked as the module docstring says
    (the shape itself: by the schema, harness.model.checkpoint)."""
    found = reader(path)
    architecture = metadata(path, "general.architecture")
    if architecture != ARCHITECTURE:
        raise CheckpointError(f"'{path}' holds a {architecture or 'unnamed'} model (general.architecture); "
                              f"allowed: {ARCHITECTURE}")
    tensors = {}
    for tensor in found.tensors:  # each one's data is in the file: the library's parse maps all of it
        kind = tensor.tensor_type.name
        if kind not in DEQUANTIZED_TYPES:
            raise CheckpointError(f"'{path}': tensor {tensor.name} is stored as {kind}; allowed: "
                                  f"{', '.join(DEQUANTIZED_TYPES)}")
        tensors[hf_name(tensor.name)] = (kind, _stored_shape(tensor))
    for key, (neutral, what) in UNSUPPORTED_KEYS.items():
        value = metadata(path, f"{ARCHITECTURE}.{key}")
        if value is not None and value not in neutral:
            raise CheckpointError(f"'{path}': {ARCHITECTURE}.{key} = {shown(value)} makes it {what}, which the decoder "
                                  "does not run")
    config = {field: metadata(path, f"{ARCHITECTURE}.{key}") for field, key in CONFIG_KEYS.items()}
    factors = tensors.pop(ROPE_FACTORS, None)  # not a decoder weight: it becomes the shape's rope_scaling
    heads, width = config["num_attention_heads"], config["hidden_size"]
    head_dim = config["head_dim"] or (width // heads if type(heads) is int and type(width) is int and heads > 0 else None)
    factor = next((value for key in ROPE_FACTOR_KEYS if (value := metadata(path, f"{ARCHITECTURE}.{key}")) is not None), None)
    config["rope_scaling"] = gguf_rope.rope_scaling(
        path, metadata(path, f"{ARCHITECTURE}.rope.scaling.type"), factor,
        None if factors is None else _rope_factors(found), config["rope_theta"] or 10000.0, head_dim)
    if config["vocab_size"] is None and "model.embed_tokens.weight" in tensors:  # older exports leave it out
        config["vocab_size"] = tensors["model.embed_tokens.weight"][1][0]
    config.update(architectures=["LlamaForCausalLM"], model_type="llama",
                  tie_word_embeddings="lm_head.weight" not in tensors)  # no output tensor: the head is the embedding
    with open(path, "rb") as f:
        header = f.read(int(found.data_offset))
    return GGUFContents(config=config, where=lambda field: f"'{path}': {_key(field)}", tensors=tensors, header=header)


def _key(field: str) -> str:
    """How a message names a config.json field: its GGUF key, or for rope_scaling's what it came from."""
    if field.startswith("rope_scaling"):
        return f"{ARCHITECTURE}.rope.scaling.factor / {ROPE_FACTORS} (as {field})"
    return f"{ARCHITECTURE}.{CONFIG_KEYS.get(field, field)}"


def _rope_factors(found: gguf.GGUFReader) -> np.ndarray:
    """The stored RoPE frequency factors [D/2], float64 (a few hundred bytes, read while the plan reads metadata)."""
    tensor = next(t for t in found.tensors if t.name == ROPE_FACTORS)
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)


def check_heads(path: Path, shape: ModelConfig) -> None:
    """CheckpointError when the file rotates or reads less than whole heads (partial rotary embeddings,
    values narrower than keys), which the decoder does not do."""
    for key in HEAD_WIDTH_KEYS:
        value = metadata(path, f"{ARCHITECTURE}.{key}")
        if value is not None and value != shape.resolved_head_dim:
            raise CheckpointError(f"'{path}': {ARCHITECTURE}.{key} = {value!r}, the heads are {shape.resolved_head_dim} "
                                  "wide; the decoder rotates and reads whole heads")


def _stored_shape(tensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first ([d_model, vocab] for the embedding); Hugging Face the other way."""
    return tuple(int(size) for size in reversed(tensor.shape.tolist()))


def dequantized_tensors(path: Path, names: Iterable[str], n_heads: int,
                        n_kv_heads: int) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(Hugging Face name, float32 values) for each of `names`, one tensor at a time, dequantized from the
    mapped file. q and k come as a view [heads, 2, head_dim / 2, d_model] that puts their rows back in
    rotate-half order (the module docstring): copy it into the target rows viewed in that shape."""
    import torch  # here, as harness.model.checkpoint.load_weights imports it: reading a header needs none

    stored = {hf_name(tensor.name): tensor for tensor in reader(path).tensors}
    heads = {"self_attn.q_proj.weight": n_heads, "self_attn.k_proj.weight": n_kv_heads}
    for name in names:
        tensor = stored[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32, rows of the stored shape
        if not values.flags.writeable:  # F32 comes back as the read-only map itself; torch wants memory it may write
            values = np.array(values)
        values = torch.from_numpy(values).reshape(_stored_shape(tensor))
        permuted = next((count for suffix, count in heads.items() if name.endswith(suffix)), None)
        if permuted is not None:
            rows, columns = values.shape
            # GGUF row (head h, pair i, member j) is Hugging Face row (h, j, i): [h, i, j, :] -> [h, j, i, :]
            values = values.view(permuted, rows // permuted // 2, 2, columns).transpose(1, 2)
        yield name, values
