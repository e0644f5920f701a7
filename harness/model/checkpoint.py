"""A checkpoint on disk, read without loading it: its shape, its tensors' names, dtypes and shapes, and
a content hash; then its weights, straight into a built decoder.

`model.checkpoint` names a Hugging Face format folder or a GGUF file (llama.cpp's format, read by
harness.model.gguf_file), by its path or as `pkg:PACKAGE/FILE` (harness.config.paths). Both come out
as the same Checkpoint: the shape through `_shape` (a GGUF file's metadata mapped onto config.json's
fields), the tensors under their Hugging Face names through `_check_tensors`, the same hash and the
same `load_weights`. What follows is the folder's part; gguf_file's docstring says what a GGUF adds.

A folder holds `config.json` and its weights as `*.safetensors`: one file, or shards named by
`model.safetensors.index.json`. Llama 2/3/3.1+ (`rope_scaling` of type llama3), Mistral and Qwen2
(a bias on q, k and v) map onto harness.model.decoder.Decoder; `tie_word_embeddings` makes the output
head the embedding table. `read_checkpoint` refuses anything else before a byte of weight is read,
with one line naming the file and what is wrong (CheckpointError): another architecture, a quantized
checkpoint, a missing, extra or misshapen tensor, a truncated file. It reads config.json and each
file's safetensors header (8 bytes of length, then JSON), never the tensors.

`load_weights` then copies each tensor into its place in the decoder's parameters, one tensor at a
time, converting to the decoder's dtype and device in the copy: the peak beyond the model is one
tensor in its stored dtype, never an fp32 copy of the whole model. q, k and v go into the rows of the
fused `wqkv`, gate and up into the rows of `w13`. The stored q/k weights are in Hugging Face's
rotate-half order, the order harness.model.decoder.RotaryTable rotates in: nothing is permuted.

The content hash (`Checkpoint.content_hash`, a row's `checkpoint_hash`) is cheap by design: sha256
over config.json, and for each safetensors (or the GGUF) file its name, size, header (a GGUF's: its
metadata and tensor table) and the first and last MiB of its tensor data. A fine-tune changes those
bytes; an edit confined to the middle of a large file would not change the hash.
"""
from __future__ import annotations

import functools
import hashlib
import json
import struct
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from harness.config import ModelConfig
from harness.config.paths import LocationError, checkpoint_location
from harness.model import gguf_file

# config.json's `architectures` entry -> its `model_type`: the families the decoder reproduces.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
QKV_BIAS = {"llama": False, "mistral": False, "qwen2": True}  # the family's q/k/v projections carry a bias
FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}  # safetensors dtype codes that load, and their bytes
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # buffers older exports store; the decoder computes its own
INDEX = "model.safetensors.index.json"
HASHED_DATA_BYTES = 2**20  # the content hash reads this much of each file's data at its start and its end
HEADER_MAX_BYTES = 100 * 2**20  # safetensors' own limit on a header


class CheckpointError(ValueError):
    """A folder that is not a checkpoint the decoder can load. str() is one line naming the file."""


@dataclass(frozen=True)
class StoredTensor:
    file: str  # the safetensors (or GGUF) file holding it, relative to the folder
    dtype: str  # safetensors dtype code (F32, F16, BF16), or GGML type (F32, Q4_1, Q6_K, ...)
    shape: tuple[int, ...]  # as Hugging Face stores it: [out, in] for a projection


@dataclass(frozen=True)
class Checkpoint:
    folder: Path  # the folder holding its weight files, absolute
    shape: ModelConfig  # its shape as the decoder's (name: the folder's or file's, checkpoint: the folder or file)
    tensors: dict[str, StoredTensor]  # stored name -> where and what, every tensor the decoder loads
    sliding_window: Optional[int]  # attention window config.json enables (Mistral v0.1); None: full attention
    content_hash: str  # see the module docstring
    format: str = "safetensors"  # how the weights are stored: safetensors | gguf

    @property
    def parameters(self) -> int:
        """Elements the decoder holds: every tensor it loads, the tied head once."""
        return sum(_elements(t.shape) for t in self.tensors.values())


def _elements(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def default_name(folder: Path) -> str:
    """The name rows give a checkpoint: its folder's, a GGUF file's name without `.gguf`, or for a Hugging
    Face cache snapshot (models--org--name/snapshots/<commit>) the model's; characters a file name cannot
    take become '-'."""
    name = folder.name.removesuffix(".gguf")
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        name = folder.parent.parent.name.split("--")[-1]
    cleaned = "".join(c if c.isalnum() or c in "_-." else "-" for c in name).lstrip(".")
    return cleaned or "checkpoint"


def read_checkpoint(location: str | Path) -> Checkpoint:
    """The checkpoint `location` names (a folder, a .gguf file, `pkg:PACKAGE/FILE`), checked against what
    the decoder loads (CheckpointError otherwise). Cached per path and the sizes and times of its files,
    so a sweep reads each header once."""
    try:
        path = checkpoint_location(str(location))
    except LocationError as error:
        raise CheckpointError(str(error)) from None
    if path.is_file() and path.suffix == ".gguf":
        return _read_gguf(path, (path.stat().st_size, path.stat().st_mtime_ns))
    if not path.is_dir():
        what = "a file, neither a folder nor a .gguf file" if path.exists() else "no folder or file"
        raise CheckpointError(f"'{location}' is {what}")
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir()) if p.is_file())
    return _read_checkpoint(path, stamp)


@functools.lru_cache(maxsize=8)
def _read_checkpoint(path: Path, _stamp: tuple) -> Checkpoint:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"'{path}' has no config.json: not a Hugging Face format checkpoint folder")
    config_bytes = config_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"'{config_path}' is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"'{config_path}' holds no JSON object")
    family = _family(config, config_path)
    shape = _shape(config, config_path, family, path)
    files = _weight_files(path)
    headers = {name: _header(path / name) for name in files}
    tensors = _tensors(path, headers, files)
    _check_tensors(tensors, expected_tensors(shape), path, config_path)
    if shape.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # the head is the embedding table, as transformers ties it
    digest = hashlib.sha256(config_bytes)
    for name in sorted(headers):
        digest.update(_file_fingerprint(path / name, headers[name][0], 8 + len(headers[name][0])))
    return Checkpoint(folder=path, shape=shape, tensors=tensors, sliding_window=_sliding_window(config),
                      content_hash=digest.hexdigest()[:16])


@functools.lru_cache(maxsize=4)
def _read_gguf(path: Path, _stamp: tuple) -> Checkpoint:
    """A GGUF file as a Checkpoint: its metadata as config.json's fields, its tensors by their Hugging Face
    names (harness.model.gguf_file), the same shape and tensor checks as a folder's."""
    try:
        contents = gguf_file.read_gguf(path)
    except gguf_file.GGUFError as error:
        raise CheckpointError(str(error)) from None
    shape = _shape(contents.config, path, "llama", path)
    tensors = {name: StoredTensor(path.name, kind, stored) for name, (kind, stored) in contents.tensors.items()}
    _check_tensors(tensors, expected_tensors(shape), path, path, stored_name=gguf_file.gguf_name)
    fingerprint = _file_fingerprint(path, contents.header, len(contents.header))
    return Checkpoint(folder=path.parent, shape=shape, tensors=tensors, sliding_window=None,
                      content_hash=hashlib.sha256(fingerprint).hexdigest()[:16], format="gguf")


def check_unchanged(folder: str, planned_hash: str) -> None:
    """CheckpointError when the folder's content hash is no longer the one its point was planned with
    (a row must not name weights other than the ones it measured)."""
    found = read_checkpoint(folder).content_hash
    if found != planned_hash:
        raise CheckpointError(f"'{folder}' changed since the sweep was planned (hash {found}, planned {planned_hash})")


def _family(config: dict, config_path: Path) -> str:
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method", "unnamed")
        raise CheckpointError(f"'{config_path}' describes a quantized checkpoint (quantization_config: {method}); "
                              "only float weights (F32, F16, BF16) load")
    architectures = config.get("architectures") or []
    known = [a for a in architectures if a in ARCHITECTURES]
    model_type = config.get("model_type")
    if not known or ARCHITECTURES[known[0]] != model_type:
        raise CheckpointError(f"'{config_path}' is {architectures or 'no architecture'} (model_type {model_type!r}); "
                              f"allowed: {', '.join(ARCHITECTURES)}")
    return model_type


def _number(config: dict, key: str, config_path: Path, default: Any = None, kind: type = int):
    value = config.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or \
            (kind is int and value != int(value)):
        raise CheckpointError(f"'{config_path}': {key} must be a positive {'integer' if kind is int else 'number'}, "
                              f"got {value!r}")
    return kind(value)


def _rope(config: dict, config_path: Path) -> dict:
    """RoPE fields from transformers 5's `rope_parameters` or 4's `rope_theta` and `rope_scaling`."""
    parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    rope = {"rope_theta": _number({"rope_theta": theta}, "rope_theta", config_path, kind=float)}
    if kind == "default":
        return rope
    if kind != "llama3":
        raise CheckpointError(f"'{config_path}': rope scaling of type {kind!r} is not supported; allowed: llama3, none")
    scaling = {"rope_scaling_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
               "rope_high_freq_factor": "high_freq_factor", "rope_original_max_len": "original_max_position_embeddings"}
    rope["rope_scaling"] = "llama3"
    for field, key in scaling.items():
        rope[field] = _number(parameters, key, config_path, kind=int if field == "rope_original_max_len" else float)
    if rope["rope_high_freq_factor"] <= rope["rope_low_freq_factor"]:
        raise CheckpointError(f"'{config_path}': llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return rope


def _shape(config: dict, config_path: Path, family: str, folder: Path) -> ModelConfig:
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"'{config_path}': hidden_act {config['hidden_act']!r}; the decoder's MLP is SwiGLU (silu)")
    for flag in ("mlp_bias", "attention_bias"):  # Llama's options that put a bias on o_proj or the MLP
        if config.get(flag):
            raise CheckpointError(f"'{config_path}': {flag} is true; the decoder has no bias there")
    n_heads = _number(config, "num_attention_heads", config_path)
    d_model = _number(config, "hidden_size", config_path)
    head_dim = config.get("head_dim") or d_model // n_heads
    shape = ModelConfig(
        name=default_name(folder), vocab_size=_number(config, "vocab_size", config_path), d_model=d_model,
        n_layers=_number(config, "num_hidden_layers", config_path), n_heads=n_heads,
        n_kv_heads=_number(config, "num_key_value_heads", config_path, default=n_heads),
        ffn_dim=_number(config, "intermediate_size", config_path),
        head_dim=_number({"head_dim": head_dim}, "head_dim", config_path),
        norm_eps=_number(config, "rms_norm_eps", config_path, default=1e-6, kind=float),
        checkpoint=str(folder), attention_bias=QKV_BIAS[family],
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), **_rope(config, config_path))
    if shape.n_heads % shape.n_kv_heads or shape.head_dim % 2:
        raise CheckpointError(f"'{config_path}': {n_heads} heads over {shape.n_kv_heads} KV heads of width "
                              f"{shape.head_dim}; the decoder needs whole query groups and an even head width")
    return shape


def _sliding_window(config: dict) -> Optional[int]:
    """The attention window config.json turns on: Mistral's `sliding_window`, Qwen2's only with
    `use_sliding_window`."""
    window = config.get("sliding_window")
    if config.get("model_type") == "qwen2" and not config.get("use_sliding_window", False):
        return None
    return int(window) if isinstance(window, int) and window > 0 else None


def _weight_files(folder: Path) -> list[str]:
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise CheckpointError(f"'{index}' is not a safetensors index (a JSON object with a weight_map)") from None
        for name in files:
            if not (folder / name).is_file():
                raise CheckpointError(f"'{index}' names '{name}', which is not in '{folder}'")
        return files
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        hint = f" (it has {', '.join(other[:3])}: convert them to safetensors)" if other else ""
        raise CheckpointError(f"'{folder}' has no *.safetensors weights{hint}")
    return files


def _header(path: Path) -> tuple[bytes, dict]:
    """A safetensors file's header: its raw bytes and its JSON, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"'{path}' is truncated: {size} bytes, not even a safetensors header length")
        length = struct.unpack("<Q", prefix)[0]
        if length > HEADER_MAX_BYTES or 8 + length > size:
            raise CheckpointError(f"'{path}' is truncated or not safetensors: its header claims {length:,} bytes, "
                                  f"the file holds {size:,}")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"'{path}' is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"'{path}' is not a safetensors file: its header is not a JSON object")
    end = max((entry["data_offsets"][1] for name, entry in header.items()
               if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry), default=0)
    if 8 + length + end > size:
        raise CheckpointError(f"'{path}' is truncated: its header places tensor data up to byte {8 + length + end:,}, "
                              f"the file holds {size:,}")
    return raw, header


def _tensors(folder: Path, headers: dict[str, tuple[bytes, dict]], files: list[str]) -> dict[str, StoredTensor]:
    tensors: dict[str, StoredTensor] = {}
    for name in files:
        for tensor, entry in headers[name][1].items():
            if tensor == "__metadata__" or tensor.endswith(IGNORED_TENSORS):
                continue
            try:
                dtype, shape = entry["dtype"], tuple(int(s) for s in entry["shape"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"'{folder / name}': tensor {tensor} has no dtype and shape") from None
            if dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"'{folder / name}': tensor {tensor} is {dtype}, a quantized or integer "
                                      f"checkpoint; only float weights ({', '.join(FLOAT_DTYPES)}) load")
            if tensor in tensors:
                raise CheckpointError(f"'{folder / name}': tensor {tensor} is also in '{tensors[tensor].file}'")
            tensors[tensor] = StoredTensor(name, dtype, shape)
    return tensors


def expected_tensors(shape: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every stored tensor the decoder of `shape` loads, by its Hugging Face name, and its shape."""
    d, hd, ffn = shape.d_model, shape.resolved_head_dim, shape.ffn_dim
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    expected = {"model.embed_tokens.weight": (shape.vocab_size, d), "model.norm.weight": (d,)}
    if not shape.tie_embeddings:
        expected["lm_head.weight"] = (shape.vocab_size, d)
    for i in range(shape.n_layers):
        layer = f"model.layers.{i}"
        expected.update({
            f"{layer}.input_layernorm.weight": (d,), f"{layer}.post_attention_layernorm.weight": (d,),
            f"{layer}.self_attn.q_proj.weight": (q, d), f"{layer}.self_attn.k_proj.weight": (kv, d),
            f"{layer}.self_attn.v_proj.weight": (kv, d), f"{layer}.self_attn.o_proj.weight": (d, q),
            f"{layer}.mlp.gate_proj.weight": (ffn, d), f"{layer}.mlp.up_proj.weight": (ffn, d),
            f"{layer}.mlp.down_proj.weight": (d, ffn)})
        if shape.attention_bias:
            expected.update({f"{layer}.self_attn.q_proj.bias": (q,), f"{layer}.self_attn.k_proj.bias": (kv,),
                             f"{layer}.self_attn.v_proj.bias": (kv,)})
    return expected


def _check_tensors(found: dict[str, StoredTensor], expected: dict[str, tuple[int, ...]], checkpoint: Path,
                   described_by: Path, stored_name=lambda name: name) -> None:
    """Every expected tensor found in its shape, none besides (a tied head aside). `checkpoint`: the folder
    or GGUF file; `described_by`: the config.json or GGUF file the shape came from, beside the weight
    files; `stored_name`: a tensor's name as its file spells it."""
    folder = described_by.parent
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"'{checkpoint}': tensor {stored_name(name)} is missing "
                                  f"('{described_by.name}' describes {len(expected)} tensors)")
        if found[name].shape != shape:
            raise CheckpointError(f"'{folder / found[name].file}': tensor {stored_name(name)} is {list(found[name].shape)}, "
                                  f"'{described_by}' makes it {list(shape)}: the config contradicts the tensors")
    tied_head = "lm_head.weight" if "lm_head.weight" not in expected else None
    extra = sorted(set(found) - set(expected) - {tied_head})
    if extra:
        raise CheckpointError(f"'{folder / found[extra[0]].file}': tensor {stored_name(extra[0])} is not part of the "
                              f"decoder '{described_by.name}' describes ({len(extra)} such tensors)")


def _file_fingerprint(path: Path, header: bytes, start: int) -> bytes:
    """A weight file's name, size and header and the first and last MiB of its data (from byte `start`), hashed."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}\0{size}\0".encode() + header)
    with open(path, "rb") as f:
        f.seek(start)
        digest.update(f.read(HASHED_DATA_BYTES))
        f.seek(max(start, size - HASHED_DATA_BYTES))
        digest.update(f.read(HASHED_DATA_BYTES))
    return digest.digest()


def shape_fields(shape: ModelConfig) -> dict[str, Any]:
    """The fields of `shape` a checkpoint decides (all but the name)."""
    return {f.name: getattr(shape, f.name) for f in fields(ModelConfig) if f.name != "name"}


def parameter_rows(model, shape: ModelConfig) -> dict[str, Any]:
    """Stored name -> the tensor of `model`'s parameters it fills (a row slice of a fused weight)."""
    d, hd, ffn = shape.d_model, shape.resolved_head_dim, shape.ffn_dim
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    rows = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight}
    if not shape.tie_embeddings:
        rows["lm_head.weight"] = model.output.weight
    for i, block in enumerate(model.layers):
        layer, attention, mlp = f"model.layers.{i}", block.attention, block.feed_forward
        qkv = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        rows.update({f"{layer}.input_layernorm.weight": block.attention_norm.weight,
                     f"{layer}.post_attention_layernorm.weight": block.ffn_norm.weight,
                     f"{layer}.self_attn.o_proj.weight": attention.wo.weight,
                     f"{layer}.mlp.gate_proj.weight": mlp.w13.weight[:ffn],  # gate first: SwiGLU chunks (gate, up)
                     f"{layer}.mlp.up_proj.weight": mlp.w13.weight[ffn:],
                     f"{layer}.mlp.down_proj.weight": mlp.w2.weight})
        for part, rows_of in qkv.items():
            rows[f"{layer}.self_attn.{part}_proj.weight"] = attention.wqkv.weight[rows_of]
            if shape.attention_bias:
                rows[f"{layer}.self_attn.{part}_proj.bias"] = attention.wqkv.bias[rows_of]
    return rows


def load_weights(model, checkpoint: Checkpoint) -> None:
    """Fill every parameter of `model` (a Decoder of checkpoint.shape, allocated on its device and
    dtype) from the checkpoint, one stored tensor at a time."""
    import torch

    targets = parameter_rows(model, checkpoint.shape)
    with torch.no_grad():
        for name, stored in _stored_tensors(checkpoint):
            # Viewed in the stored tensor's shape: a GGUF q/k comes as [heads, 2, D/2, d_model] (gguf_file);
            # the copy converts dtype and device.
            targets.pop(name).view(stored.shape).copy_(stored)
    if targets:  # read_checkpoint checked the names; a mismatch here is a bug, not bad input
        raise AssertionError(f"parameters left unloaded: {sorted(targets)[:3]}")


def _stored_tensors(checkpoint: Checkpoint):
    """(name, tensor) of every tensor the checkpoint holds for the decoder, one at a time, as stored (a
    GGUF file's dequantized to float32)."""
    if checkpoint.format == "gguf":
        shape = checkpoint.shape
        yield from gguf_file.dequantized_tensors(Path(shape.checkpoint), checkpoint.tensors, shape.n_heads,
                                                 shape.n_kv_heads)
        return
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, stored in checkpoint.tensors.items():
        by_file.setdefault(stored.file, []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(checkpoint.folder / file, framework="pt", device="cpu") as stored:
            for name in names:
                yield name, stored.get_tensor(name)
