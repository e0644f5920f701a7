"""Small Hugging Face format checkpoints written straight from the decoder's own tensor list
(harness.model.checkpoint.expected_tensors), without transformers: the bad-metadata tests edit one
field of a good one, thousands of times, in milliseconds each."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from harness.model.checkpoint import expected_tensors
from harness.model.checkpoint_fields import config_shape
from harness.model.safetensors_header import INDEX

CONFIG = {  # a Llama config.json as transformers writes it, at a toy shape
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 24, "vocab_size": 32,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "float32", "transformers_version": "4.46.0",
}


def tensors_of(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor a decoder of `config` loads, seeded, in fp32."""
    shape, _ = config_shape(config, str, "checkpoint", "checkpoint")
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(size, generator=generator) * 0.1 for name, size in expected_tensors(shape).items()}


def write_checkpoint(folder: Path, config: dict | None = None, shards: int = 1, tensors: dict | None = None) -> Path:
    """A checkpoint folder: config.json and the tensors in `shards` safetensors files (an index with
    more than one)."""
    config = dict(CONFIG if config is None else config)
    tensors = tensors_of(config) if tensors is None else tensors
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = names[shard::shards]
        save_file({name: tensors[name] for name in part}, folder / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in part})
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return folder


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def header_of(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header as JSON, and its data."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_header(path: Path, header, data: bytes) -> None:
    """A safetensors file of `header` (any JSON value, as Python's json writes it) and `data`."""
    write_header_text(path, json.dumps(header).encode(), data)


def write_header_text(path: Path, text: bytes, data: bytes) -> None:
    """A safetensors file whose header is `text`, byte for byte, then `data`, laid out as safetensors lays them."""
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
