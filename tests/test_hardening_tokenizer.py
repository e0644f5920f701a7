"""A GGUF file's tokenizer metadata as untrusted input (harness.model.gguf_tokenizer.tokenizer_fields):
every field through the same field schema as the shape's, so a text prompt is refused by the plan in
one line naming the file and the key, never tokenized into garbage ids nor ended by a traceback."""
from __future__ import annotations

import time

import pytest

from harness.config.validate import ConfigError
from harness.model.gguf_tokenizer import gguf_tokenizer
from tests.conftest import planned_point
from tests.gguf_files import CORPUS, byte_level_vocab, random_weights, sentencepiece_vocab, write_gguf

TOKENS, MERGES = byte_level_vocab()
PIECES = sentencepiece_vocab()[0]

CASES = {  # name -> (tokenizer, tokenizer metadata, what the line says)
    "tokens a string": ("gpt2", {"tokens": "abc"}, "tokenizer.ggml.tokens must be a non-empty list of strings"),
    "tokens of ints": ("gpt2", {"tokens": list(range(len(TOKENS)))}, "tokenizer.ggml.tokens must be"),
    "256 identical tokens": ("gpt2", {"tokens": ["a"] * len(TOKENS), "merges": None}, "'a' 320 times"),
    "add_bos_token the string false": ("gpt2", {"add_bos_token": "false"}, "add_bos_token must be true or false"),
    "add_eos_token 1": ("gpt2", {"add_eos_token": 1}, "add_eos_token must be true or false"),
    "types longer than tokens": ("gpt2", {"token_type": [1] * (len(TOKENS) + 5)},
                                 f"token_type must be a list of {len(TOKENS)} integers"),
    "a type of 9": ("gpt2", {"token_type": [9] * len(TOKENS)}, "each from 0 to 6"),
    "a merge without a space": ("gpt2", {"merges": ["ab"] + MERGES[1:]}, "two tokens joined by one space"),
    "a merge of unknown tokens": ("gpt2", {"merges": ["zzq qqz"] + MERGES[1:]}, "is not in tokenizer.ggml.tokens"),
    "merges as ints": ("gpt2", {"merges": [1, 2, 3]}, "tokenizer.ggml.merges must be a non-empty list of strings"),
    "a negative BOS id": ("gpt2", {"bos_token_id": -1}, "bos_token_id must be an integer from 0 to"),
    "a BOS id past the tokens": ("gpt2", {"bos_token_id": len(TOKENS)}, f"from 0 to {len(TOKENS) - 1}"),
    "an EOS id of text": ("gpt2", {"eos_token_id": "2"}, "eos_token_id must be an integer"),
    "scores of text": ("llama", {"scores": ["x"] * len(PIECES)}, "tokenizer.ggml.scores must be a list of"),
    "scores too few": ("llama", {"scores": [0.5, 1.5]}, "tokenizer.ggml.scores must be a list of"),
    "an unknown pre-tokenizer": ("gpt2", {"pre": "klingon"}, "tokenizer.ggml.pre must be one of"),
    "another tokenizer model": ("gpt2", {"model": "bert"}, "text prompts need gpt2 or llama"),
    "no tokens": ("gpt2", {"tokens": None, "merges": None, "token_type": None}, "with no tokens"),
}


@pytest.fixture(scope="module")
def weights():
    return random_weights(len(TOKENS))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_text(" ".join(CORPUS * 8))
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_bad_tokenizer_metadata_is_refused_in_one_line(weights, text, tmp_path, case):
    tokenizer, fields, says = CASES[case]
    path = write_gguf(tmp_path / "bad.gguf", weights, tokenizer=tokenizer, tokenizer_metadata=fields)
    began = time.monotonic()
    with pytest.raises(ConfigError) as error:
        planned_point("model=tiny", f"model.checkpoint={path}", f"prompt={text}", "ctx=8", "decode_tokens=2")
    assert time.monotonic() - began < 5.0
    message = str(error.value)
    assert "\n" not in message and len(message) < 600 and message.startswith("prompt:"), message
    assert str(path) in message and says in message, message


@pytest.mark.parametrize("tokenizer", ["gpt2", "llama"])
def test_good_metadata_still_builds_the_tokenizer(weights, tmp_path, tokenizer):
    path = write_gguf(tmp_path / "good.gguf", weights, tokenizer=tokenizer,
                      tokenizer_metadata={"add_bos_token": True, "add_eos_token": False})
    ids = gguf_tokenizer(path).encode("The capital of France").ids
    assert ids[0] == (0 if tokenizer == "gpt2" else 1) and len(ids) > 2  # BOS as the flag says


def test_add_bos_false_leaves_bos_out(weights, tmp_path):
    path = write_gguf(tmp_path / "nobos.gguf", weights, tokenizer="llama", tokenizer_metadata={"add_bos_token": False})
    assert gguf_tokenizer(path).encode("The capital").ids[0] != 1
