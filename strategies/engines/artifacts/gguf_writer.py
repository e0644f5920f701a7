"""The model the harness runs, written as a GGUF file an external engine reads: the same weights.

An engine measured beside the harness (strategies/engines/engine.py) must decode the weights the harness's
decoder holds, not its own reading of a quantized file: llama.cpp would run Q4_1 matrices through its
quantized kernels while the decoder runs their float32 dequantization. `float_gguf` writes the GGUF
checkpoint's tensors dequantized once (gguf.quants.dequantize, the function harness.model.gguf_file
loads the decoder with) back as F32 (or F16) under the same names, with every metadata field copied
(general.file_type set to what the tensors now are), so llama.cpp and ONNX
Runtime GenAI's model builder all read the decoder's numbers. The q and k rows stay in the order the
file stores them (GGML's RoPE pairs, llama.cpp's converter's `LlamaModel.permute`): the engines rotate
those pairs, as the decoder rotates the rotate-half order harness.model.gguf_file restores.

The file is cached by the source checkpoint's content hash (harness.model.checkpoint) and the float
type, under the kernel cache's folder (harness.kernels.extension.cache_dir, `weights/`): written once,
by one process at a time, under a temporary name renamed into place only when complete
(harness.files.publish), so a reader never sees half a file.
A Hugging Face folder checkpoint is refused (CheckpointError): it has no GGUF metadata to copy.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from harness.files import publish
from harness.kernels.extension import cache_dir
from harness.model.checkpoint import read_checkpoint
from harness.model.checkpoint_fields import CheckpointError
from harness.model.gguf_file import reader

FLOAT_TYPES = {"F32": (gguf.GGMLQuantizationType.F32, np.float32, gguf.LlamaFileType.ALL_F32),
               "F16": (gguf.GGMLQuantizationType.F16, np.float16, gguf.LlamaFileType.MOSTLY_F16)}
# Fields the writer makes itself from what it writes (the header's counts) or that this file changes.
WRITTEN_BY_WRITER = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")
FILE_TYPE = "general.file_type"


def weights_dir() -> Path:
    """Where the engines' copies of a checkpoint are kept: beside the built kernels."""
    return cache_dir() / "weights"


def float_gguf(checkpoint: str | Path, kind: str = "F32", folder: Path | None = None) -> Path:
    """The GGUF file of `checkpoint`'s tensors dequantized to `kind` (F32 or F16), written once per
    checkpoint hash and kind under `folder` (default weights_dir()); its path."""
    if kind not in FLOAT_TYPES:
        raise ValueError(f"kind must be one of {', '.join(FLOAT_TYPES)}, got {kind!r}")
    source = read_checkpoint(checkpoint)
    if source.format != "gguf":
        raise CheckpointError(f"'{checkpoint}' is a {source.format} folder; an engine's copy is written from a GGUF "
                              "file (its metadata and tokenizer are copied)")
    path = Path(source.shape.checkpoint)
    target = (folder or weights_dir()) / f"{source.shape.name}-{source.content_hash}-{kind}.gguf"
    publish(target, lambda temporary: write_float_gguf(path, temporary, kind), f"writing {target.name}")
    return target


def write_float_gguf(source: Path, target: Path, kind: str = "F32") -> None:
    """Write `source`'s tensors, dequantized to `kind` (norms and other 1-D tensors stay F32, as
    llama.cpp's converter keeps them), and its metadata to `target`."""
    ggml_type, numpy_type, file_type = FLOAT_TYPES[kind]
    found = reader(source)
    architecture = found.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, architecture)
    writer.add_file_type(int(file_type))  # what the tensors now are, whatever the source said
    for key, field in found.fields.items():
        if key in WRITTEN_BY_WRITER or key == FILE_TYPE:
            continue
        value_type = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[1]) if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)
    for tensor in found.tensors:
        shape = tuple(int(size) for size in reversed(tensor.shape.tolist()))  # outermost first, as numpy's
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)  # float32
        store_type, store = (ggml_type, numpy_type) if values.ndim > 1 else (gguf.GGMLQuantizationType.F32, np.float32)
        writer.add_tensor(tensor.name, np.ascontiguousarray(values, dtype=store), raw_dtype=store_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
