"""The float GGUF copy (strategies.engines.artifacts.gguf_writer) as transformers reads it, for the engines
whose converters start from a Hugging Face model: in memory (OpenVINO's IR, strategies.engines.artifacts.
openvino_ir) or as a Hugging Face folder written once (ONNX Runtime GenAI's builder,
strategies.engines.artifacts.ortgenai_model).

transformers restores the q/k rows' order a GGUF file permutes. It marks a model read from GGUF as
quantized by it (a GgufHfQuantizer, which save_pretrained refuses) even though its tensors are
dequantized to float32 on reading: the marker is dropped, so the model saves as any float one.
"""
from __future__ import annotations

from pathlib import Path

import torch

from harness.files import publish
from strategies.engines.artifacts.gguf_writer import weights_dir

CONFIG = "config.json"  # a Hugging Face folder's configuration


class NoTokenizer(ValueError):
    """The GGUF file has no tokenizer transformers can read; the message is transformers' own."""


def transformers_model(gguf: str | Path):
    """The float GGUF copy's model, read by transformers in float32."""
    from transformers import AutoModelForCausalLM

    source = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def hf_folder(gguf: str | Path, engine: str) -> Path:
    """The float GGUF copy as a Hugging Face folder (config, safetensors, tokenizer) under `engine`'s
    folder of the weights, written once by transformers. NoTokenizer where the file has none transformers
    reads (a folder without one would be refused by the engine's builder)."""
    source = Path(gguf)
    folder = weights_dir() / engine / f"{source.stem}-hf"

    def save(building: Path) -> None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        except ValueError as error:  # transformers' words: which tokenizer the file states, which it reads
            raise NoTokenizer(str(error)) from None
        transformers_model(source).save_pretrained(building)
        tokenizer.save_pretrained(building)

    publish(folder, save, f"writing {folder.name}", complete=lambda path: (path / CONFIG).exists(), folder=True)
    return folder
