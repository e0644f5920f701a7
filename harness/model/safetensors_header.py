"""The metadata of a checkpoint's weights, checked before a tensor is read: each safetensors file's
header, and the index (`model.safetensors.index.json`) that names the files of a sharded checkpoint.

A safetensors file is 8 bytes of header length (little-endian), the header (a JSON object: each
tensor's name -> its dtype, shape and data_offsets, plus an optional `__metadata__` of strings), then
the tensors' bytes. The header is parsed as safetensors' own JSON reader (Rust's serde_json) parses it,
which is stricter than Python's (`_header_json`). Each entry is checked against TENSOR_FIELDS
(harness.model.checkpoint_fields, the rules every metadata field follows), then against the file as
safetensors itself checks it before it reads a byte: the element count, extent by extent, fits 64
bits; data_offsets [begin, end] hold exactly shape x dtype's bytes; and the tensors lie end to end
over exactly the file's data. So a header this module accepts is one safetensors opens.

The index is a JSON object whose `weight_map` maps each tensor's name to the file holding it: a plain
file name ending in .safetensors, in the checkpoint's folder (never a path out of it). Its `metadata`,
if present, is an object; nothing in it is read.
"""
from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any, Optional

from harness.model.checkpoint_fields import (LAYERS_MAX, CheckpointError, Field, checked_fields, json_object,
                                             read_json_object, shown)

INDEX = "model.safetensors.index.json"
HEADER_MAX_BYTES = 100 * 2**20  # safetensors' own limit on a header
# Entries of one header: a decoder of LAYERS_MAX blocks holds at most 12 tensors a block (q/k/v biases
# included), so more says the file is no such checkpoint; bounds the check's time (a 100 MiB header of
# empty entries holds a million, seconds each hundred thousand).
TENSORS_MAX = 16 * LAYERS_MAX
INT64_MAX = 2**63 - 1  # offsets and sizes: safetensors reads them as 64-bit unsigned; a file is smaller
UINT64_LIMIT = 2**64  # safetensors counts a tensor's elements, then its bits, in 64-bit unsigned arithmetic
# Nesting serde_json reads (its recursion limit, 128, is reached by the 128th open bracket), the header
# object itself counted: an ignored field nested deeper makes safetensors refuse the whole header.
JSON_DEPTH_MAX = 127
_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone \uD800-\uDFFF escape, which serde_json refuses
# Every safetensors dtype code, and its bits per element (which codes load: harness.model.checkpoint).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
              "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
              "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
TENSOR_FIELDS = (
    Field("dtype", "text", allowed=tuple(DTYPE_BITS)),
    Field("shape", "integers", low=0, high=INT64_MAX),
    Field("data_offsets", "integers", low=0, high=INT64_MAX, length=2),  # [begin, end) within the data
)
INDEX_FIELDS = (
    Field("weight_map", "object"),  # tensor name -> file name; its entries are checked in weight_files
    Field("metadata", "object", None),  # total_size and the like: not read
)
METADATA = "__metadata__"  # the header's one entry that is not a tensor


def read_header(path: Path) -> tuple[bytes, dict[str, dict]]:
    """A safetensors file's header: its raw bytes, and each tensor's entry (dtype, shape,
    data_offsets) checked against TENSOR_FIELDS and against the file (the module docstring)."""
    if not path.is_file():  # a folder or a pipe named *.safetensors: opening a pipe would wait forever
        raise CheckpointError(f"'{path}' is not a file")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"'{path}' is truncated: {size} bytes, not even a safetensors header length")
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        if length > HEADER_MAX_BYTES or 8 + length > size:
            raise CheckpointError(f"'{path}' is truncated or not safetensors: its header claims {length:,} bytes, "
                                  f"the file holds {size:,}")
        raw = f.read(length)
    header = json_object(raw, f"'{path}' is not a safetensors file: its header", loads=_header_json)
    metadata = header.pop(METADATA, None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"'{path}': {METADATA} must be a JSON object of strings, got {shown(metadata)}")
    if len(header) > TENSORS_MAX:
        raise CheckpointError(f"'{path}': its header lists {len(header):,} tensors, more than a decoder of at most "
                              f"{LAYERS_MAX:,} blocks holds (at most {TENSORS_MAX:,} a file)")
    entries = {name: _entry(path, name, entry) for name, entry in header.items()}
    _check_layout(path, entries, size - 8 - length)
    return raw, entries


def _entry(path: Path, name: str, entry) -> dict:
    """One tensor's entry, checked against TENSOR_FIELDS and its own size."""
    where = lambda field: f"'{path}': tensor {shown(name)} {field}"  # noqa: E731
    if not isinstance(entry, dict):
        raise CheckpointError(f"'{path}': tensor {shown(name)} must be a JSON object (dtype, shape, data_offsets), "
                              f"got {shown(entry)}")
    checked = checked_fields(entry, TENSOR_FIELDS, where)
    begin, end = checked["data_offsets"]
    elements = 1
    for extent in checked["shape"]:  # as safetensors counts: an overflow refuses, even before an extent of 0
        elements *= extent
        if elements >= UINT64_LIMIT:
            raise CheckpointError(f"{where('shape')} {shown(checked['shape'])} counts past 2^64 elements, its "
                                  "extents multiplied in order: safetensors refuses a count past 64 bits")
    bits = elements * DTYPE_BITS[checked["dtype"]]
    if bits >= UINT64_LIMIT:
        raise CheckpointError(f"{where('shape')} {shown(checked['shape'])} of {checked['dtype']} holds 2^64 bits "
                              "or more: safetensors refuses a size past 64 bits")
    if end < begin or 8 * (end - begin) != bits:
        raise CheckpointError(f"{where('data_offsets')} {[begin, end]} hold {end - begin:,} bytes; shape "
                              f"{checked['shape']} of {checked['dtype']} needs {bits / 8:,.0f}")
    return checked


def _header_json(raw: bytes) -> Any:
    """The header parsed as serde_json parses it for safetensors, where that is stricter than Python's
    json: UTF-8 alone (no byte-order mark, no encoded surrogate); no NaN or Infinity; no number beyond a
    double's range; an integer outside 64 bits, and -0, read as a float (so never a shape or an offset);
    no lone surrogate escape; at most JSON_DEPTH_MAX levels of nesting. A key listed twice in one object
    is refused too, a little stricter than safetensors (which refuses a tensor's field or __metadata__
    listed twice, and of a tensor listed twice keeps one unsaid). ValueError says which rule."""
    header = json.loads(raw.decode("utf-8"), parse_constant=_not_a_number, parse_int=_integer,
                        parse_float=_finite, object_pairs_hook=_unique_keys)
    pending = [(header, 1)]  # (a value, its nesting depth), walked without recursion
    while pending:
        value, depth = pending.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise ValueError(f"{shown(value)} holds a lone surrogate escape (\\uD800-\\uDFFF)")
        elif isinstance(value, (dict, list)):
            if depth > JSON_DEPTH_MAX:
                raise ValueError(f"nested deeper than the {JSON_DEPTH_MAX} levels safetensors' JSON reader allows")
            children = [*value, *value.values()] if isinstance(value, dict) else value
            pending.extend((child, depth + 1) for child in children)
    return header


def _not_a_number(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _integer(text: str) -> int | float:
    """An integer as serde_json reads it: within 64 bits an integer; beyond, or -0, a float."""
    value = int(text)
    if -(2**63) <= value < UINT64_LIMIT and text != "-0":
        return value
    return _finite(text)


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:20]}{'...' if len(text) > 20 else ''} is beyond a double's range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    found = dict(pairs)
    if len(found) < len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"key {shown(twice)} appears twice in one object")
    return found


def _check_layout(path: Path, entries: dict[str, dict], data_bytes: int) -> None:
    """The tensors' data lies end to end from byte 0 and ends where the file does, as safetensors requires."""
    reached = 0
    for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"]):
        begin, end = entry["data_offsets"]
        if begin != reached:
            raise CheckpointError(f"'{path}': tensor {shown(name)} data_offsets start at byte {begin:,}, where the "
                                  f"tensors before it end at {reached:,}: safetensors lays tensors end to end")
        reached = end
    if reached > data_bytes:
        raise CheckpointError(f"'{path}' is truncated: its header places tensor data up to byte {8 + reached:,} past "
                              f"the header, the file holds {data_bytes:,} bytes of data")
    if reached < data_bytes:
        raise CheckpointError(f"'{path}' holds {data_bytes - reached:,} bytes after its last tensor's data: not a "
                              "safetensors file its header describes")


def weight_files(folder: Path) -> tuple[list[str], Optional[dict[str, str]]]:
    """The safetensors files of a checkpoint folder, and the index's weight_map (tensor -> file; None
    when the folder has no index, its weights then every *.safetensors file in it)."""
    index = folder / INDEX
    if not index.is_file():
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
            hint = f" (it has {', '.join(other[:3])}: convert them to safetensors)" if other else ""
            raise CheckpointError(f"'{folder}' has no *.safetensors weights{hint}")
        return files, None
    _, content = read_json_object(index)
    weight_map = checked_fields(content, INDEX_FIELDS, lambda field: f"'{index}': {field}")["weight_map"]
    for tensor, file in weight_map.items():
        if not (isinstance(file, str) and _plain_name(file)):
            raise CheckpointError(f"'{index}': weight_map entry {shown(tensor)} must name a .safetensors file in "
                                  f"the folder (a plain file name), got {shown(file)}")
    files = sorted(set(weight_map.values()))
    for file in files:
        if not (folder / file).is_file():
            raise CheckpointError(f"'{index}' names '{file}', which is not in '{folder}'")
    return files, weight_map


def _plain_name(file: str) -> bool:
    """A file name within the folder: no separator, not '..', no NUL, and a safetensors file's suffix."""
    return (file.endswith(".safetensors") and Path(file).name == file and "\\" not in file and "\0" not in file
            and not file.startswith("."))
