"""A prompt file costs what the point takes from it, not what the file holds: a large text file is
tokenized only in the prefix the point's windows need (and the first ids are the whole text's), a
`.npy` stream is memory-mapped, and the content hash reads a bounded part of the file."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.measure import prompts
from harness.measure.prompts import content_hash, point_prompt, read_tokens
from harness.model.gguf_tokenizer import gguf_tokenizer
from tests.conftest import planned_point
from tests.gguf_files import CORPUS, byte_level_vocab, random_weights, write_gguf

LARGE_BYTES = 48 * 2**20  # a prompt file far larger than any point here takes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GGUF Llama whose metadata holds a byte-level BPE tokenizer."""
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", random_weights(len(byte_level_vocab()[0])))


@pytest.fixture(scope="module")
def large_text(tmp_path_factory):
    """LARGE_BYTES of lines of text, blank lines and runs of spaces among them."""
    lines = [f"{sentence}  line {i}\n" + ("\n" if i % 7 == 0 else "") for i, sentence in enumerate(CORPUS * 50)]
    block = "".join(lines).encode()
    path = tmp_path_factory.mktemp("text") / "large.txt"
    with open(path, "wb") as f:
        for _ in range(LARGE_BYTES // len(block) + 1):
            f.write(block)
    return path


class CountingTokenizer:
    """A tokenizer that records how many characters it was given, and fails at once past `bound`
    (tokenizing the whole large file would take a minute here)."""

    def __init__(self, tokenizer, bound: int):
        self.tokenizer, self.bound, self.characters = tokenizer, bound, 0

    def encode(self, text):
        self.characters += len(text)
        assert self.characters <= self.bound, f"{self.characters:,} characters tokenized"
        return self.tokenizer.encode(text)


def test_a_large_text_is_tokenized_only_as_far_as_the_point_needs(checkpoint, large_text, monkeypatch):
    """The plan and the point's own read tokenize a prefix bounded by the point's windows (a few KiB of a
    48 MiB file), and the windows are the first ids of the whole text."""
    counting = CountingTokenizer(gguf_tokenizer(checkpoint), bound=2**20)
    monkeypatch.setattr(prompts, "_tokenizer", lambda path, mtime: counting)
    point = planned_point("model=tiny", f"model.checkpoint={checkpoint}", f"prompt={large_text}", "ctx=200",
                          "decode_tokens=16", "batch=2")
    windows = point_prompt(point, torch.device("cpu"))  # [2, 217]
    assert large_text.stat().st_size > LARGE_BYTES and counting.characters > 0
    with open(large_text, encoding="utf-8") as f:
        head = f.read(2**16)
    assert windows.flatten().tolist() == gguf_tokenizer(checkpoint).encode(head).ids[: windows.numel()]


@pytest.mark.parametrize("limit", [1, 40, 300, 3000])
def test_a_prefix_gives_the_first_ids_of_the_whole_text(checkpoint, tmp_path, limit):
    """Wherever the read is cut (a line break, else a space), the ids returned are the whole text's."""
    text = "".join(f"{sentence}\n\n   {'word ' * (i % 5)}é漢\t\n" for i, sentence in enumerate(CORPUS * 60))
    path = tmp_path / "text.txt"
    path.write_text(text + "x" * 5000)  # a last stretch with no place to cut
    whole = gguf_tokenizer(checkpoint).encode(path.read_text()).ids
    assert read_tokens(path, checkpoint, limit=limit).tolist() == whole[:limit]


def test_a_text_too_short_for_the_point_counts_all_its_tokens(checkpoint, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(CORPUS[0])
    whole = len(gguf_tokenizer(checkpoint).encode(CORPUS[0]).ids)
    assert len(read_tokens(path, checkpoint, limit=10_000)) == whole


def test_a_npy_stream_is_mapped_not_read(tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(4 * 2**20, dtype=np.int32) % 300)
    ids = read_tokens(path, None, limit=1000)
    assert isinstance(ids, np.memmap) and ids.shape == (1000,)
    assert prompts.windows(ids, 2, 500, 300).dtype == np.int64


def test_the_content_hash_is_stable_and_sees_the_files_start(large_text, checkpoint, tmp_path):
    path = tmp_path / "copy.txt"
    with open(large_text, "rb") as source:
        path.write_bytes(source.read(4 * 2**20))
    before = content_hash(path, checkpoint)
    assert content_hash(path, checkpoint) == before and content_hash(path, None) != before  # the tokenizer counts
    data = bytearray(path.read_bytes())
    data[1000] ^= 1
    path.write_bytes(bytes(data))
    assert content_hash(path, checkpoint) != before
