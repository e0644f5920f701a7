"""A GGUF file's header walked byte by byte before any library parses it: every declared count and
length checked against the bytes left, so no field, known or not, makes a reader loop or allocate
beyond the file.

Why not leave it to the `gguf` library: its reader takes a numeric array's declared length on trust,
and past the end of the mapped file gets empty slices back, looping in Python over the declared count
(a token_type array declared 2^40 long grows memory until the machine runs out). `scan` walks the same
structure with `struct` over the mapped file and refuses, in one line naming the file and the key or
tensor (CheckpointError), anything llama.cpp's own reader (ggml/src/gguf.cpp) refuses:

- a bad magic or a version other than 2 or 3; a tensor or key count larger than the bytes left could hold;
- a key or string whose length passes the end of the file, or is not UTF-8; a key given twice;
- a value type GGUF does not define; an array of arrays; an array whose entries pass the end of the file;
- general.alignment not a UINT32 non-zero power of two;
- a tensor name over GGML_MAX_NAME - 1 bytes or given twice, more than GGML_MAX_DIMS dimensions, a
  negative dimension or an element count beyond int64, a tensor type the library does not know, a row
  that is not whole blocks of its type;
- a tensor whose data does not start where the previous one's ends, padded to the alignment (llama.cpp:
  "tensor has offset X, expected Y"): a misaligned offset, or two tensors sharing bytes, would read
  shifted or shared data; data that passes the end of the file.

A big-endian file (its version reads as a multiple of 65536) is walked in its own byte order, as the
library reads it.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

import gguf

from harness.model.checkpoint_fields import CheckpointError, shown

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what the gguf library reads
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF value type -> struct code
STRING, ARRAY = 8, 9  # the two value types of variable length
UINT32 = 4
MAX_NAME = 63  # bytes of a tensor name: GGML_MAX_NAME (64) less its terminating zero
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
INT64_MAX = 2**63 - 1


def type_name(value_type: int) -> str:
    try:
        return gguf.GGUFValueType(value_type).name
    except ValueError:
        return str(value_type)


class _Walk:
    """A cursor over the mapped file that never reads past its end."""

    def __init__(self, path: Path, data, order: str):
        self.path, self.data, self.order, self.at = path, data, order, 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"'{self.path}' cannot be read as GGUF: {what}")

    def left(self) -> int:
        return len(self.data) - self.at

    def number(self, code: str, what: str):
        size = struct.calcsize(code)
        if size > self.left():
            raise self.fail(f"{what} passes the end of the file (truncated at byte {len(self.data):,})")
        value = struct.unpack_from(self.order + code, self.data, self.at)[0]
        self.at += size
        return value

    def text(self, what: str) -> str:
        length = self.number("Q", f"the length of {what}")
        if length > self.left():
            raise self.fail(f"{what} declares {length:,} bytes, {self.left():,} are left in the file")
        raw = self.data[self.at:self.at + length]
        self.at += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text ({shown(raw)})") from None

    def value(self, value_type: int, key: str, in_array: bool = False) -> None:
        """Step over one value of `value_type`, checking its lengths."""
        if value_type in SCALARS:
            self.number(SCALARS[value_type], f"the value of {key}")
        elif value_type == STRING:
            self.text(f"the value of {key}")
        elif value_type == ARRAY and not in_array:
            item = self.number("I", f"the entry type of {key}")
            count = self.number("Q", f"the length of {key}")
            if item == ARRAY:
                raise self.fail(f"{key} is an array of arrays, which GGUF readers do not take")
            if item not in SCALARS and item != STRING:
                raise self.fail(f"{key} holds entries of type {item}; GGUF defines types 0 to 12")
            least = struct.calcsize(SCALARS[item]) if item in SCALARS else 8  # a string: its length at least
            if count * least > self.left():
                raise self.fail(f"{key} declares {count:,} {type_name(item)} entries, at least {count * least:,} "
                                f"bytes; {self.left():,} are left in the file")
            if item in SCALARS:
                self.at += count * least
            else:
                for _ in range(count):
                    self.text(f"an entry of {key}")
        else:
            raise self.fail(f"{key} has value type {value_type}; GGUF defines types 0 to 12"
                            + (" (an array inside an array is not read)" if value_type == ARRAY else ""))


def scan(path: Path) -> None:
    """CheckpointError in one line where the GGUF file at `path` is not what the module docstring allows."""
    with open(path, "rb") as handle:
        if handle.seek(0, 2) == 0:
            raise CheckpointError(f"'{path}' cannot be read as GGUF: the file is empty")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _scan(path, data)


def _scan(path: Path, data) -> None:
    walk = _Walk(path, data, "<")
    if data[:4] != MAGIC:
        raise walk.fail(f"its first bytes are {shown(bytes(data[:4]))}, not GGUF's magic {MAGIC!r}")
    walk.at = 4
    version = walk.number("I", "the version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        walk.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in VERSIONS:
        raise walk.fail(f"version {version}; readable: {', '.join(map(str, VERSIONS))}")
    tensor_count = walk.number("Q", "the tensor count")
    kv_count = walk.number("Q", "the metadata count")
    if kv_count * 12 > walk.left() or tensor_count * 24 > walk.left():  # a key at least 12 bytes, a tensor 24
        raise walk.fail(f"it declares {kv_count:,} metadata keys and {tensor_count:,} tensors, more than its "
                        f"{walk.left():,} bytes left could hold")
    keys: dict[str, tuple[int, int]] = {}
    for _ in range(kv_count):
        key = walk.text("a metadata key")
        if key in keys:
            raise walk.fail(f"metadata key {shown(key)} is given twice")
        value_type = walk.number("I", f"the type of {key}")
        keys[key] = (value_type, walk.at)
        walk.value(value_type, shown(key))
    alignment = _alignment(walk, keys)
    tensors = []
    names = set()
    for _ in range(tensor_count):
        name = walk.text("a tensor name")
        if len(name.encode()) > MAX_NAME or name in names:
            raise walk.fail(f"tensor name {shown(name)} " + ("is given twice" if name in names else
                                                             f"is longer than {MAX_NAME} bytes"))
        names.add(name)
        n_dims = walk.number("I", f"the dimension count of tensor {shown(name)}")
        if n_dims > MAX_DIMS:
            raise walk.fail(f"tensor {shown(name)} has {n_dims:,} dimensions; at most {MAX_DIMS}")
        dims = [walk.number("Q", f"a dimension of tensor {shown(name)}") for _ in range(n_dims)]
        kind = walk.number("I", f"the type of tensor {shown(name)}")
        offset = walk.number("Q", f"the data offset of tensor {shown(name)}")
        tensors.append((name, dims, kind, offset))
    data_start = -(-walk.at // alignment) * alignment
    expected = 0
    for name, dims, kind, offset in tensors:
        size = _tensor_bytes(walk, name, dims, kind)
        if offset != expected:
            raise walk.fail(f"tensor {shown(name)} has data offset {offset:,}, expected {expected:,}: each tensor's "
                            f"data follows the one before, padded to general.alignment {alignment} (a misplaced "
                            "offset reads shifted or another tensor's bytes)")
        expected += -(-size // alignment) * alignment
        if data_start + offset + size > len(data):
            raise walk.fail(f"tensor {shown(name)}'s {size:,} bytes pass the end of the file (truncated at byte "
                            f"{len(data):,})")


def _alignment(walk: _Walk, keys: dict[str, tuple[int, int]]) -> int:
    if "general.alignment" not in keys:
        return DEFAULT_ALIGNMENT
    value_type, at = keys["general.alignment"]
    value = struct.unpack_from(walk.order + "I", walk.data, at)[0] if value_type == UINT32 else None
    if value is None or value == 0 or value & (value - 1):
        raise walk.fail(f"general.alignment must be a UINT32 non-zero power of two, got "
                        f"{type_name(value_type)} {'' if value is None else value}".rstrip())
    return value


def _tensor_bytes(walk: _Walk, name: str, dims: list[int], kind: int) -> int:
    """The bytes of a tensor's data, its dimensions and type checked as llama.cpp checks them."""
    try:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise walk.fail(f"tensor {shown(name)} has type {kind}, which the gguf library does not know") from None
    elements = 1
    for size in dims:
        if size > INT64_MAX or (size and elements > INT64_MAX // size):
            raise walk.fail(f"tensor {shown(name)} has dimensions {dims}: more elements than an int64 counts")
        elements *= size
    if dims and dims[0] % block:
        raise walk.fail(f"tensor {shown(name)}'s rows of {dims[0]:,} are not whole blocks of {block} "
                        f"({gguf.GGMLQuantizationType(kind).name})")
    return elements // block * block_bytes
