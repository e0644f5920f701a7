"""Safetensors headers and the shard index against their schema (harness.model.safetensors_header): a
wrong type or an impossible layout is one CheckpointError line naming the file; a header the check
accepts is one safetensors itself opens. Unit cases, then properties over drawn headers and indexes."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from harness.model.checkpoint import CheckpointError, read_checkpoint
from harness.model.safetensors_header import INDEX, read_header
from tests.checkpoint_files import header_of, write_checkpoint, write_header, write_header_text

EMBED = "model.embed_tokens.weight"  # [32, 16] fp32: 2048 bytes


@pytest.fixture
def folder(tmp_path):
    return write_checkpoint(tmp_path / "tiny-llama")


@pytest.fixture
def sharded(tmp_path):
    return write_checkpoint(tmp_path / "sharded", shards=2)


def refused(folder, names: str) -> str:
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(folder)
    message = str(error.value)
    assert "\n" not in message and f"'{folder / names}" in message, message
    return message


def edited_header(folder, edit) -> None:
    """model.safetensors rewritten with `edit(header)` applied to its header, its data unchanged."""
    path = folder / "model.safetensors"
    header, data = header_of(path)
    edited = edit(header)
    write_header(path, header if edited is None else edited, data)


def entry(header: dict, **fields) -> None:
    header[EMBED].update(fields)


def shifted(header: dict, by: int) -> None:
    """Every tensor's data moved `by` bytes (a gap before the first, or one byte too few)."""
    for name, value in header.items():
        if name != "__metadata__":
            value["data_offsets"] = [value["data_offsets"][0] + by, value["data_offsets"][1] + by]


@pytest.mark.parametrize("edit,says", [
    (lambda h: entry(h, data_offsets=[0]), "data_offsets must be a list of 2 integers"),
    (lambda h: entry(h, data_offsets=["0", "2048"]), "data_offsets must be a list of 2 integers"),
    (lambda h: entry(h, data_offsets=None), "data_offsets is missing: it must be a list of 2 integers"),
    (lambda h: entry(h, data_offsets=[0, 2048.0]), "data_offsets must be a list of 2 integers"),
    (lambda h: entry(h, data_offsets=[-8, 2040]), "data_offsets must be a list of 2 integers, each from 0"),
    (lambda h: entry(h, data_offsets=[2048, 0]), "hold -2,048 bytes"),
    (lambda h: entry(h, shape=[32, 8]), "shape [32, 8] of F32 needs 1,024"),
    (lambda h: entry(h, shape=[32.0, 16]), "shape must be a list of integers"),
    (lambda h: entry(h, shape="32x16"), "shape must be a list of integers"),
    (lambda h: entry(h, dtype=32), "dtype must be one of: BOOL, U8"),
    (lambda h: entry(h, dtype="F33"), "dtype must be one of: BOOL, U8"),
    (lambda h: entry(h, dtype="I8", shape=[32, 64]), "is I8, a quantized or integer checkpoint"),
    (lambda h: h.update({EMBED: [1, 2]}), "must be a JSON object (dtype, shape, data_offsets), got [1, 2]"),
    (lambda h: h.update({"__metadata__": {"format": 1}}), "__metadata__ must be a JSON object of strings"),
    (lambda h: h.update({"__metadata__": "pt"}), "__metadata__ must be a JSON object of strings"),
    (lambda h: [1, 2], "holds [1, 2], not a JSON object"),
    (lambda h: shifted(h, 4), "start at byte 4, where the tensors before it end at 0"),  # a gap
    # The property's counterexample: an unread field holding NaN, which Python's json writes and reads
    # and safetensors refuses ("expected value at line 1 column 126").
    (lambda h: h["lm_head.weight"].update(other=math.nan), "NaN is not a JSON number"),
    (lambda h: h.update(overlap={"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}), "lays tensors end to end"),
])
def test_a_bad_header_is_one_line_naming_the_file(folder, edit, says):
    edited_header(folder, edit)
    assert says in refused(folder, "model.safetensors")


ONE_TENSOR = '"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]'  # 8 bytes of data follow
NESTED = lambda levels: "[" * levels + "]" * levels  # noqa: E731


def beside_one_tensor(other: str) -> bytes:
    """A header of one tensor whose entry also holds a field no reader reads: `"other": <other>`."""
    return f'{{{ONE_TENSOR}, "other": {other}}}}}'.encode()


# Headers where Python's JSON reader and safetensors' (serde_json) part: each refused here exactly when
# safetensors refuses it (None: both open it), checked against safetensors itself.
@pytest.mark.parametrize("text,data,says", [
    (beside_one_tensor("NaN"), 8, "NaN is not a JSON number"),
    (beside_one_tensor("-Infinity"), 8, "-Infinity is not a JSON number"),
    (beside_one_tensor("1e400"), 8, "1e400 is beyond a double's range"),
    (beside_one_tensor("1" + "0" * 400), 8, "is beyond a double's range"),
    (beside_one_tensor('"\\ud800"'), 8, "lone surrogate escape"),
    (b'{"t\\udc00": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 8, "lone surrogate escape"),
    (b'{"t": {"dtype": "F32", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 8, "'dtype' appears twice"),
    (f'{{"__metadata__": {{}}, "__metadata__": {{}}, {ONE_TENSOR}}}}}'.encode(), 8, "'__metadata__' appears twice"),
    (b"\xef\xbb\xbf{" + ONE_TENSOR.encode() + b"}}", 8, "Unexpected UTF-8 BOM"),
    (beside_one_tensor('"?"').replace(b"?", b"\xed\xa0\x80"), 8, "can't decode byte 0xed"),  # a surrogate, encoded
    (f"{{{ONE_TENSOR}}}}}".encode("utf-16"), 8, "can't decode byte 0xff"),
    (beside_one_tensor(NESTED(126)), 8, "nested deeper than the 127 levels"),
    (b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [-0, 8]}}', 8, "data_offsets must be a list of 2 integers"),
    (b'{"t": {"dtype": "F32", "shape": [1099511627776, 1099511627776, 0], "data_offsets": [0, 0]}}', 0,
     "counts past 2^64 elements"),  # safetensors multiplies extent by extent in 64 bits, before the 0
    (beside_one_tensor("1e-400"), 8, None),  # underflows to 0: a number
    (beside_one_tensor(str(2**64)), 8, None),  # beyond 64 bits: a float, where nothing wants an integer
    (beside_one_tensor('"\\ud83d\\ude00"'), 8, None),  # a surrogate pair is one character
    (beside_one_tensor(NESTED(125)), 8, None),  # 127 levels, the header object counted
    (f" \n{{{ONE_TENSOR}}}}} \n".encode(), 8, None),
    (b'{"t": {"dtype": "F8_E4M3FNUZ", "shape": [8], "data_offsets": [0, 8]}}', 8, None),
])
def test_a_header_is_refused_exactly_where_safetensors_refuses_its_json(tmp_path, text, data, says):
    path = tmp_path / "model.safetensors"
    write_header_text(path, text, b"\0" * data)
    try:
        with safe_open(path, framework="pt") as stored:
            for name in stored.keys():
                stored.get_tensor(name)
        opened = True
    except Exception:  # noqa: BLE001 -- safetensors' own refusal, of whatever type it raises
        opened = False
    if says is None:
        assert opened
        read_header(path)
        return
    assert not opened
    with pytest.raises(CheckpointError) as error:
        read_header(path)
    message = str(error.value)
    assert says in message and "\n" not in message and f"'{path}'" in message, message


def test_a_key_listed_twice_is_refused_where_safetensors_keeps_one_unsaid(tmp_path):
    path = tmp_path / "model.safetensors"
    write_header_text(path, f"{{{ONE_TENSOR}}}, {ONE_TENSOR}}}}}".encode(), b"\0" * 8)
    with safe_open(path, framework="pt") as stored:  # safetensors opens it: one of the two entries is read
        assert list(stored.keys()) == ["t"]
    with pytest.raises(CheckpointError, match="key 't' appears twice in one object"):
        read_header(path)


def test_data_past_or_short_of_the_header_is_refused(folder):
    path = folder / "model.safetensors"
    header, data = header_of(path)
    write_header(path, header, data + b"\0" * 4)
    assert "4 bytes after its last tensor's data" in refused(folder, "model.safetensors")
    write_header(path, header, data[:-4])
    assert "truncated" in refused(folder, "model.safetensors")


def test_a_header_length_past_the_file_or_a_stub(folder):
    path = folder / "model.safetensors"
    path.write_bytes(b"\xff" * 8 + b"{}")
    assert "its header claims" in refused(folder, "model.safetensors")
    path.write_bytes(b"\x02\x00")
    assert "not even a safetensors header length" in refused(folder, "model.safetensors")


def test_a_folder_named_like_weights_is_not_opened(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    assert "is not a file" in refused(folder, "model.safetensors")


# --- the index --------------------------------------------------------------------------------------


def edited_index(folder, edit) -> None:
    index = json.loads((folder / INDEX).read_text())
    edited = edit(index)
    (folder / INDEX).write_text(json.dumps(index if edited is None else edited))


def first_tensor(index: dict) -> str:
    return sorted(index["weight_map"])[0]


@pytest.mark.parametrize("edit,says", [
    (lambda i: i.update(weight_map={t: 1 for t in i["weight_map"]}), "must name a .safetensors file in the folder"),
    (lambda i: i.update(weight_map=[1, 2]), "weight_map must be a JSON object, got [1, 2]"),
    (lambda i: i.update(weight_map="model.safetensors"), "weight_map must be a JSON object"),
    (lambda i: i.pop("weight_map") and None, "weight_map is missing"),
    (lambda i: i.update(metadata="x"), "metadata must be a JSON object, got 'x'"),
    (lambda i: i["weight_map"].update({first_tensor(i): "../sharded/model-00001-of-00002.safetensors"}), "a plain file name"),
    (lambda i: i["weight_map"].update({first_tensor(i): "/etc/passwd"}), "a plain file name"),
    (lambda i: i["weight_map"].update({first_tensor(i): ""}), "a plain file name"),
    (lambda i: i["weight_map"].update({first_tensor(i): "config.json"}), "a plain file name"),
    (lambda i: i["weight_map"].update({first_tensor(i): "model-00009-of-00009.safetensors"}), "which is not in"),
    (lambda i: i["weight_map"].update({first_tensor(i): "model-00002-of-00002.safetensors"}), "the index contradicts the file"),
    (lambda i: i["weight_map"].update({"model.extra.weight": "model-00001-of-00002.safetensors"}), "whose header does not hold it"),
    (lambda i: [i], "not a JSON object"),
])
def test_a_bad_index_entry_is_one_line_naming_the_file(sharded, edit, says):
    edited_index(sharded, edit)
    message = refused(sharded, "")
    assert says in message and ("model.safetensors.index.json" in message or ".safetensors'" in message), message


def test_a_sharded_checkpoint_reads(sharded):
    assert len({t.file for t in read_checkpoint(sharded).tensors.values()}) == 2


# --- properties ---------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=6)
    | st.sampled_from(["F32", "F16", "BF16", "I8", "F4", "model-00001-of-00002.safetensors"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
offsets = st.lists(st.integers(min_value=-10, max_value=5000), min_size=0, max_size=3)
tensor_fields = st.sampled_from(["dtype", "shape", "data_offsets", "other"])
header_edits = st.lists(st.tuples(st.sampled_from(["entry", "field", "metadata", "new tensor"]), st.integers(0, 99),
                                  tensor_fields, json_values | offsets), min_size=1, max_size=3)


def apply_header_edits(header: dict, edits) -> None:
    names = sorted(name for name in header if name != "__metadata__")
    for i, (what, which, field, value) in enumerate(edits):
        name = names[which % len(names)]
        if what == "entry":
            header[name] = value
        elif what == "field" and isinstance(header.get(name), dict):
            header[name][field] = value
        elif what == "metadata":
            header["__metadata__"] = value
        else:
            header[f"drawn.{i}"] = {"dtype": "F32", "shape": [2], "data_offsets": value} if field == "data_offsets" else value


@example(edits=[("field", 0, "data_offsets", [0])])
@example(edits=[("field", 1, "data_offsets", ["0", "8"])])
@example(edits=[("field", 2, "data_offsets", None)])
@example(edits=[("field", 3, "shape", [])])  # a scalar where a matrix belongs: its bytes no longer match
@example(edits=[("new tensor", 0, "data_offsets", [0, 0])])  # an empty tensor: legal, then not part of the decoder
@example(edits=[("field", 0, "other", math.nan)])  # Python's json writes NaN; safetensors refuses it
@settings(max_examples=200)
@given(edits=header_edits)
def test_any_header_is_one_safetensors_opens_or_one_line(tmp_path_factory, edits):
    folder = write_checkpoint(tmp_path_factory.mktemp("drawn") / "tiny-llama")
    path = folder / "model.safetensors"
    edited_header(folder, lambda header: apply_header_edits(header, edits))
    try:
        _, entries = read_header(path)
    except CheckpointError as error:
        assert "\n" not in str(error) and f"'{path}'" in str(error), str(error)
        return
    with safe_open(path, framework="pt") as stored:  # what the check accepts, safetensors reads
        for name in entries:
            assert list(stored.get_tensor(name).shape) == entries[name]["shape"]
    try:
        read_checkpoint(folder)
    except CheckpointError as error:
        assert "\n" not in str(error) and f"'{folder}" in str(error)


index_edits = st.lists(st.tuples(st.sampled_from(["value", "key", "weight_map", "metadata", "top"]), json_values),
                       min_size=1, max_size=3)


def apply_index_edits(index: dict, edits) -> dict:
    for i, (what, value) in enumerate(edits):
        weight_map = index.get("weight_map")
        if what == "value" and isinstance(weight_map, dict) and weight_map:
            weight_map[sorted(weight_map)[i * 5 % len(weight_map)]] = value
        elif what == "key" and isinstance(weight_map, dict):
            weight_map[str(value)] = "model-00001-of-00002.safetensors"
        elif what in ("weight_map", "metadata"):
            index[what] = value
        elif what == "top":
            return value
    return index


@example(edits=[("weight_map", {"model.norm.weight": 3})])
@example(edits=[("value", "model-00001-of-00002.safetensors")])
@example(edits=[("metadata", None)])  # legal: nothing in it is read
@settings(max_examples=150)
@given(edits=index_edits)
def test_any_index_loads_cleanly_or_is_one_line(tmp_path_factory, edits):
    folder = write_checkpoint(tmp_path_factory.mktemp("drawn") / "sharded", shards=2)
    edited_index(folder, lambda index: apply_index_edits(index, edits))
    try:
        checkpoint = read_checkpoint(folder)
    except CheckpointError as error:
        assert "\n" not in str(error) and f"'{folder}" in str(error), str(error)
        return
    assert {t.file for t in checkpoint.tensors.values()} <= {p.name for p in folder.glob("*.safetensors")}
    assert not math.isnan(checkpoint.parameters)
