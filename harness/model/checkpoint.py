"""A checkpoint on disk, read without loading it: its shape, its tensors' names, dtypes and shapes, and
a content hash; then its weights, straight into a built decoder.

`model.checkpoint` names a Hugging Face format folder or a GGUF file (llama.cpp's format, read by
harness.model.gguf_file), by its path or as `pkg:PACKAGE/FILE` (harness.config.paths). Both come out
as the same Checkpoint: the shape through harness.model.checkpoint_fields (a GGUF file's metadata
mapped onto config.json's fields), the tensors under their Hugging Face names through `_check_tensors`,
the same hash and the same `load_weights`. What follows is the folder's part; gguf_file's docstring
says what a GGUF file adds.

A folder holds `config.json` and its weights as `*.safetensors`: one file, or shards named by
`model.safetensors.index.json`. Llama 2/3/3.1+ (`rope_scaling` of type llama3), Mistral and Qwen2
(a bias on q, k and v) map onto harness.model.decoder.Decoder; `tie_word_embeddings` makes the output
head the embedding table. `read_checkpoint` refuses anything else before a byte of weight is read,
with one line naming the file and what is wrong (CheckpointError): a field of config.json of the wrong
type or out of range, another architecture, a quantized checkpoint, a missing, extra or misshapen
tensor, a malformed header or index, a truncated file. It reads config.json (checked against its
schema, harness.model.checkpoint_fields) and each file's safetensors header (checked in
harness.model.safetensors_header), never the tensors.

`load_weights` then copies each tensor into its place in the decoder's parameters, one tensor at a
time, converting to the decoder's dtype and device in the copy: the peak beyond the model is one
tensor in its stored dtype, never an fp32 copy of the whole model. q, k and v go into the rows of the
fused `wqkv`, gate and up into the rows of `w13`. The stored q/k weights are in Hugging Face's
rotate-half order, the order harness.model.decoder.RotaryTable rotates in: nothing is permuted.
A tensor that holds NaN or infinity once in the decoder's dtype is refused as it is copied
(`finite_or_refused`), naming the tensor and its file: the point fails with that reason in its row.

The content hash (`Checkpoint.content_hash`, a row's `checkpoint_hash`) is cheap by design: sha256
over config.json, and for each safetensors (or the GGUF) file its name, size, header (a GGUF's: its
metadata and tensor table) and the first and last MiB of its tensor data. A fine-tune changes those
bytes; an edit confined to the middle of a large file would not change the hash.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from harness.config import ModelConfig
from harness.config.paths import LocationError, checkpoint_location, not_a_checkpoint
from harness.model import gguf_file
from harness.model.checkpoint_fields import CheckpointError, config_shape, read_json_object, shown
from harness.model.safetensors_header import INDEX, read_header, weight_files

FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}  # safetensors dtype codes that load, and their bytes
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # buffers older exports store; the decoder computes its own
HASHED_DATA_BYTES = 2**20  # the content hash reads this much of each file's data at its start and its end
FINITE_CHECK_ELEMENTS = 2**24  # load_weights checks a loaded tensor for NaN and infinity this many elements at a time


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
    refused = not_a_checkpoint(path)
    if refused:
        raise CheckpointError(refused)
    if path.is_file():
        return _read_gguf(path, (path.stat().st_size, path.stat().st_mtime_ns))
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir()) if p.is_file())
    return _read_checkpoint(path, stamp)


@functools.lru_cache(maxsize=8)
def _read_checkpoint(path: Path, _stamp: tuple) -> Checkpoint:
    config_path = path / "config.json"  # there (read_checkpoint)
    config_bytes, config = read_json_object(config_path)
    shape, window = config_shape(config, lambda field: f"'{config_path}': {field}", default_name(path), str(path))
    files, weight_map = weight_files(path)
    headers = {name: read_header(path / name) for name in files}
    tensors = _tensors(path, headers, files, weight_map)
    _check_tensors(tensors, expected_tensors(shape), path, config_path)
    if shape.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # the head is the embedding table, as transformers ties it
    digest = hashlib.sha256(config_bytes)
    for name in sorted(headers):
        digest.update(_file_fingerprint(path / name, headers[name][0], 8 + len(headers[name][0])))
    return Checkpoint(folder=path, shape=shape, tensors=tensors, sliding_window=window,
                      content_hash=digest.hexdigest()[:16])


@functools.lru_cache(maxsize=4)
def _read_gguf(path: Path, _stamp: tuple) -> Checkpoint:
    """A GGUF file as a Checkpoint: its metadata as config.json's fields through the same schema, its
    tensors by their Hugging Face names through the same check (harness.model.gguf_file)."""
    contents = gguf_file.read_gguf(path)
    shape, _ = config_shape(contents.config, contents.where, default_name(path), str(path))
    gguf_file.check_heads(path, shape)
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


def _tensors(folder: Path, headers: dict[str, tuple[bytes, dict]], files: list[str],
             weight_map: Optional[dict[str, str]]) -> dict[str, StoredTensor]:
    """Every stored tensor the decoder may load, and where; the index (when there is one) agreeing
    with the headers about which file holds which tensor."""
    tensors: dict[str, StoredTensor] = {}
    for file in files:
        for tensor, entry in headers[file][1].items():
            if tensor.endswith(IGNORED_TENSORS):
                continue
            if weight_map is not None and weight_map.get(tensor) != file:
                placed = f"in '{weight_map[tensor]}'" if tensor in weight_map else "nowhere"
                raise CheckpointError(f"'{folder / file}': tensor {shown(tensor)} is in this file, '{INDEX}' places "
                                      f"it {placed}: the index contradicts the file")
            if entry["dtype"] not in FLOAT_DTYPES:
                raise CheckpointError(f"'{folder / file}': tensor {shown(tensor)} is {entry['dtype']}, a quantized or "
                                      f"integer checkpoint; only float weights ({', '.join(FLOAT_DTYPES)}) load")
            if tensor in tensors:
                raise CheckpointError(f"'{folder / file}': tensor {shown(tensor)} is also in '{tensors[tensor].file}'")
            tensors[tensor] = StoredTensor(file, entry["dtype"], tuple(entry["shape"]))
    for tensor, file in (weight_map or {}).items():
        if tensor not in headers[file][1]:
            raise CheckpointError(f"'{folder / INDEX}': weight_map places tensor {shown(tensor)} in '{file}', "
                                  "whose header does not hold it")
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
            raise CheckpointError(f"'{folder / found[name].file}': tensor {stored_name(name)} is "
                                  f"{list(found[name].shape)}, '{described_by}' makes it {list(shape)}: the config contradicts the tensors")
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
    hd, ffn = shape.resolved_head_dim, shape.ffn_dim
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
    dtype) from the checkpoint, one stored tensor at a time; CheckpointError naming the tensor and
    its file for one that holds NaN or infinity in the model's dtype (see `finite_or_refused`)."""
    import torch  # here, not at the top: read_checkpoint runs while a sweep is planned, without torch

    targets = parameter_rows(model, checkpoint.shape)
    shown_name = gguf_file.gguf_name if checkpoint.format == "gguf" else str
    with torch.no_grad():
        for name, stored in _stored_tensors(checkpoint):
            target, values = targets.pop(name), stored()
            # Viewed in the stored tensor's shape (a GGUF q/k comes as [heads, 2, D/2, d_model], gguf_file);
            # the copy converts dtype and device.
            target.view(values.shape).copy_(values)
            del values  # a safetensors tensor is read again only to tell why one is not finite
            finite_or_refused(target, stored, checkpoint.folder / checkpoint.tensors[name].file, shown_name(name))
    if targets:  # read_checkpoint checked the names; a mismatch here is a bug, not bad input
        raise AssertionError(f"parameters left unloaded: {sorted(targets)[:3]}")


def _stored_tensors(checkpoint: Checkpoint):
    """(name, a callable giving the stored tensor) for every tensor the checkpoint holds for the decoder,
    one at a time (a GGUF file's dequantized to float32)."""
    if checkpoint.format == "gguf":
        shape = checkpoint.shape
        for name, values in gguf_file.dequantized_tensors(Path(shape.checkpoint), checkpoint.tensors,
                                                          shape.n_heads, shape.n_kv_heads):
            yield name, lambda values=values: values  # in hand already: dequantizing again would cost as much
        return
    from safetensors import safe_open  # as torch in load_weights

    by_file: dict[str, list[str]] = {}
    for name, stored in checkpoint.tensors.items():
        by_file.setdefault(stored.file, []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(checkpoint.folder / file, framework="pt", device="cpu") as stored:
            for name in names:
                yield name, functools.partial(stored.get_tensor, name)


def finite_or_refused(loaded, stored, path: Path, name: str) -> None:
    """CheckpointError naming the tensor and its file when `loaded` (a parameter just filled) holds NaN
    or infinity: a model of such weights computes NaN logits, whose argmax is a token all the same,
    and a row would time and digest them as if they were a model's output. Checked where the weights
    are copied, a reduction per FINITE_CHECK_ELEMENTS on the device that holds them: the sweep's plan
    reads only headers, and reading every weight there would cost what loading costs. `stored()`
    reads the stored tensor again, only to tell a damaged file from values beyond the model's dtype."""
    import torch  # as in load_weights

    flat = loaded.reshape(-1)  # a view: a whole parameter, or a block of whole rows of one
    if all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(FINITE_CHECK_ELEMENTS)):
        return
    values = stored()
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise CheckpointError(f"'{path}': tensor {name} holds {bad:,} NaN or infinite values of {values.numel():,}; "
                              "the weights are damaged: a decoder of them computes NaN")
    largest = values.abs().max().item()
    raise CheckpointError(f"'{path}': tensor {name} holds values up to {largest:.4g}, beyond {loaded.dtype}'s range: "
                          "they would load as infinity; run it in float32 or bfloat16")
