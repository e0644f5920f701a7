"""A GGUF file as untrusted input (harness.model.gguf_scan): every declared count and length is checked
against the bytes left before the gguf library reads anything, for every field, known or not; tensor
data offsets follow llama.cpp's rule. Each damaged file is refused by the plan in one line naming the
file and the field, within seconds. Every case is a byte patch of a file llama.cpp's way of writing
makes (tests/gguf_files.py)."""
from __future__ import annotations

import struct
import time

import gguf
import numpy as np
import pytest

from harness.config.validate import ConfigError
from tests.conftest import planned_point
from tests.gguf_files import byte_level_vocab, random_weights, write_gguf

SECONDS = 5.0  # a refusal's budget, whatever the file declares


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    """A valid GGUF file's bytes, with three keys the harness never reads (general.extra_*: an int32
    array, a string array, a string) after the header's counts, so a patch can reach a field no reader
    looks at."""
    path = write_gguf(tmp_path_factory.mktemp("good") / "good.gguf", random_weights(len(byte_level_vocab()[0])))
    data, reader = path.read_bytes(), gguf.GGUFReader(path)
    last = reader.tensors[-1].field
    header_end, data_start = int(last.offset) + sum(part.nbytes for part in last.parts), int(reader.data_offset)

    def text(value: bytes) -> bytes:
        return struct.pack("<Q", len(value)) + value

    extra = (text(b"general.extra_ints") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 1, 2, 3)
             + text(b"general.extra_texts") + struct.pack("<IIQ", 9, 8, 2) + text(b"a") + text(b"bc")
             + text(b"general.extra_text") + struct.pack("<I", 8) + text(b"abc"))
    tensors, keys = struct.unpack_from("<QQ", data, 8)
    header = data[:8] + struct.pack("<QQ", tensors, keys + 3) + extra + data[24:header_end]
    return header + b"\0" * (-len(header) % 32) + data[data_start:]  # tensor data re-padded to the alignment


def after_key(data: bytes, key: str) -> int:
    """The offset just after key `key`'s name: its u32 value type is there."""
    name = key.encode()
    return data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)


def put(data: bytes, at: int, code: str, value) -> bytes:
    packed = struct.pack("<" + code, value)
    return data[:at] + packed + data[at + len(packed):]


def array_count(key: str, count: int):
    return lambda data: put(data, after_key(data, key) + 8, "Q", count)  # u32 type, u32 entry type, u64 count


def entry_type(key: str, kind: int):
    return lambda data: put(data, after_key(data, key) + 4, "I", kind)


def value_type(key: str, kind: int):
    return lambda data: put(data, after_key(data, key), "I", kind)


def string_length(key: str, length: int):
    return lambda data: put(data, after_key(data, key) + 4, "Q", length)  # u32 type, then the string's u64 length


def tensor_field(name: str, field: str, value: int):
    """Patch a tensor's n_dims, first dimension, type or offset."""
    def patch(data: bytes) -> bytes:
        encoded = name.encode()
        at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
        n_dims = struct.unpack_from("<I", data, at)[0]
        where = {"n_dims": (at, "I"), "dim": (at + 4, "Q"), "type": (at + 4 + 8 * n_dims, "I"),
                 "offset": (at + 8 + 8 * n_dims, "Q")}[field]
        if field == "offset" and value < 0:  # -1: the offset of the tensor before it (shared bytes)
            return put(data, where[0], "Q", struct.unpack_from("<Q", data, where[0])[0] - (-value))
        return put(data, where[0], where[1], value)
    return patch


def rename_key(old: str, new: str):
    assert len(old) == len(new)
    return lambda data: data.replace(old.encode(), new.encode(), 1)


def header_count(offset: int, value: int):
    return lambda data: put(data, offset, "Q", value)


CASES = {  # name -> (patch, what the line says)
    "token_type declared 2^40 long": (array_count("tokenizer.ggml.token_type", 2**40), "tokenizer.ggml.token_type"),
    "token_type declared 2^64-1 long": (array_count("tokenizer.ggml.token_type", 2**64 - 1), "tokenizer.ggml.token_type"),
    "tokens declared 2^40 long": (array_count("tokenizer.ggml.tokens", 2**40), "tokenizer.ggml.tokens"),
    "merges declared 2^62 long": (array_count("tokenizer.ggml.merges", 2**62), "tokenizer.ggml.merges"),
    "an unread int array 2^40 long": (array_count("general.extra_ints", 2**40), "general.extra_ints"),
    "an unread string array 2^40 long": (array_count("general.extra_texts", 2**40), "general.extra_texts"),
    "an unread string 2^40 long": (string_length("general.extra_text", 2**40), "general.extra_text"),
    "the architecture 2^63 long": (string_length("general.architecture", 2**63), "general.architecture"),
    "an array of arrays": (entry_type("general.extra_ints", 9), "array of arrays"),
    "an array of type 13": (entry_type("general.extra_ints", 13), "type 13"),
    "a value of type 13": (value_type("general.extra_text", 13), "type 13"),
    "a key given twice": (rename_key("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"), "given twice"),
    "2^62 metadata keys": (header_count(16, 2**62), "metadata keys"),
    "2^40 tensors": (header_count(8, 2**40), "tensors"),
    "a tensor of 2^31 dimensions": (tensor_field("output_norm.weight", "n_dims", 2**31), "dimensions"),
    "a dimension of 2^62": (tensor_field("token_embd.weight", "dim", 2**62), "token_embd.weight"),
    "a tensor type 999": (tensor_field("output_norm.weight", "type", 999), "type 999"),
    "a misaligned offset": (tensor_field("output_norm.weight", "offset", 4), "expected"),
    "an offset shared with the tensor before": (tensor_field("output.weight", "offset", -32), "expected"),
    "an offset past the end": (tensor_field("output_norm.weight", "offset", 2**40), "expected"),
    "a non-UTF-8 architecture": (lambda data: data.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                                           b"\x05\x00\x00\x00\x00\x00\x00\x00\xffllam", 1), "UTF-8"),
    "the file cut in its metadata": (lambda data: data[:after_key(data, "tokenizer.ggml.merges") + 100], "left in the file"),
    "an empty file": (lambda data: b"", "empty"),
    "bad magic": (lambda data: b"GGUG" + data[4:], "magic"),
    "version 1": (lambda data: put(data, 4, "I", 1), "version 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_gguf_is_refused_in_one_line_within_seconds(good, tmp_path, case):
    patch, says = CASES[case]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(patch(good))
    began = time.monotonic()
    with pytest.raises(ConfigError) as error:
        planned_point("model=tiny", "ctx=8", "decode_tokens=2", f"model.checkpoint={path}")
    assert time.monotonic() - began < SECONDS, case
    message = str(error.value)
    assert "\n" not in message and len(message) < 600 and message.startswith("model.checkpoint:"), message
    assert str(path) in message and says in message, message


def test_the_unpatched_file_with_extra_keys_is_read(good, tmp_path):
    path = tmp_path / "good.gguf"
    path.write_bytes(good)
    point = planned_point("model=tiny", "ctx=8", "decode_tokens=2", f"model.checkpoint={path}")
    assert point.model.d_model == 64
    assert gguf.GGUFReader(path).fields["general.extra_texts"].contents() == ["a", "bc"]
    assert np.asarray(gguf.GGUFReader(path).fields["general.extra_ints"].contents()).tolist() == [1, 2, 3]
