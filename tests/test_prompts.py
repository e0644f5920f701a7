"""Prompt files (`prompt=PATH`): token ids as JSON or NumPy, or text through the checkpoint's own
tokenizer.json; the windows a point takes; and the perplexity an approximate strategy records on
them against the exact reference, checked against transformers' own on the same weights and text."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from harness.measure.decoding import accuracy, start_decode
from harness.config import ConfigError
from harness.measure.prompts import PromptError, accuracy_windows, content_hash, read_tokens, windows
from harness.model import build_model
from tests.conftest import planned_point

transformers = pytest.importorskip("transformers")

from tests.test_checkpoint import hf_greedy, save_family  # noqa: E402 (needs transformers)

WORDS = ["[UNK]", "<s>"] + [f"w{i}" for i in range(200)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved Llama with a word-level tokenizer.json over WORDS (ids below its vocabulary of 384)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("ckpt") / "llama-with-tokenizer"
    reference = save_family("llama", folder)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder, reference


def test_a_json_stream_is_cut_into_consecutive_windows(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(list(range(25))))
    got = windows(read_tokens(path, None), batch=2, length=10, vocab_size=100)
    assert got.tolist() == [list(range(10)), list(range(10, 20))]


def test_rows_give_one_window_each(tmp_path):
    rows = np.arange(3 * 12).reshape(3, 12)
    np.save(tmp_path / "rows.npy", rows)
    (tmp_path / "rows.json").write_text(json.dumps(rows.tolist()))
    for name in ("rows.npy", "rows.json"):
        assert windows(read_tokens(tmp_path / name, None), 2, 10, 100).tolist() == rows[:2, :10].tolist()


def test_ragged_or_fractional_ids_are_refused(tmp_path):
    for name, content in [("ragged.json", [[1, 2], [3]]), ("floats.json", [1.5, 2.0]), ("empty.json", []),
                          ("bools.json", [True, 2, 3]), ("bool_rows.json", [[2, 3], [2, False]])]:  # NumPy: 1 and 0
        (tmp_path / name).write_text(json.dumps(content))
        with pytest.raises(PromptError, match=name):
            read_tokens(tmp_path / name, None)


def test_text_goes_through_the_checkpoints_tokenizer(checkpoint, tmp_path):
    folder, _ = checkpoint
    text = tmp_path / "words.txt"
    text.write_text(" ".join(WORDS[2:60]))
    point = planned_point(f"model.checkpoint={folder}", f"prompt={text}", "ctx=40", "decode_tokens=8", "batch=1")
    assert point.prompt == str(text) and len(point.prompt_hash) == 16
    assert read_tokens(text, folder / "tokenizer.json").tolist() == list(range(2, 60))


def test_the_exact_strategy_runs_the_files_prompt(checkpoint, tmp_path):
    """An exact point's greedy tokens from the file's prompt are transformers' from the same ids."""
    folder, reference = checkpoint
    path = tmp_path / "ids.json"
    ids = torch.randint(384, (2, 30), generator=torch.Generator().manual_seed(5))
    path.write_text(json.dumps(ids.tolist()))
    point = planned_point(f"model.checkpoint={folder}", f"prompt={path}", "strategy=contiguous", "ctx=20",
                          "decode_tokens=6", "batch=2")
    model = build_model(point.model, torch.device("cpu"), torch.float32, point.seed, point.matmul, point.batch)
    strategy = point.strategy.instantiate()
    session, first, _ = start_decode(point, lambda: strategy.new_session(model, 2, point.max_len),
                                     torch.Generator().manual_seed(point.seed))
    tokens = [first]
    for _ in range(point.decode_tokens):
        tokens.append(session.step(tokens[-1]).argmax(-1))
    assert torch.equal(torch.stack(tokens, dim=1), hf_greedy(reference, ids[:, :20], point.decode_tokens))


def transformers_perplexity(reference, window: torch.Tensor, ctx: int, steps: int) -> float:
    """exp(mean NLL) of the tokens at positions ctx + 1 .. ctx + steps, from transformers' logits."""
    with torch.no_grad():
        logits = reference(window).logits.double()  # [B, L, V]
    predicted = logits[:, ctx : ctx + steps].log_softmax(-1)  # positions ctx .. ctx + steps - 1 predict the next
    targets = window[:, ctx + 1 : ctx + steps + 1, None]
    return math.exp(-predicted.gather(-1, targets).mean().item())


@pytest.mark.parametrize("fmt", ["int8", "int4 strategy.group_size=8"])
def test_an_approximate_strategy_records_perplexity_against_the_exact_reference(checkpoint, tmp_path, fmt):
    folder, reference = checkpoint
    path = tmp_path / "stream.npy"
    stream = torch.randint(384, (100,), generator=torch.Generator().manual_seed(6))
    np.save(path, stream.numpy())
    ctx, steps = 24, 8
    point = planned_point(f"model.checkpoint={folder}", f"prompt={path}", "strategy=quantized",
                          *f"strategy.format={fmt}".split(), f"ctx={ctx}", "decode_tokens=3", "batch=2",
                          "accuracy.tokens=16", f"accuracy.steps={steps}")
    assert point.reference.endswith("ContiguousStrategy:sdpa")
    model = build_model(point.model, torch.device("cpu"), torch.float32, point.seed, point.matmul, point.batch)
    got = accuracy(point, point.strategy.instantiate(), model)
    # Two windows, `steps` apart: prompts overlap, the scored tokens (ctx + 1 .. ctx + steps of each) do not.
    windows = torch.stack([stream[i * steps : i * steps + ctx + steps + 1] for i in range(2)])
    assert got["perplexity_reference"] == pytest.approx(transformers_perplexity(reference, windows, ctx, steps), rel=1e-5)
    assert got["perplexity_delta"] == pytest.approx(got["perplexity"] - got["perplexity_reference"])
    assert got["perplexity_ratio"] == pytest.approx(got["perplexity"] / got["perplexity_reference"])
    assert got["perplexity_ratio_ci_low"] <= got["perplexity_ratio"] <= got["perplexity_ratio_ci_high"]
    assert got["perplexity"] != got["perplexity_reference"]  # the quantized cache moved something
    assert "text's tokens" in got["accuracy_reference"]
    assert (got["accuracy_tokens"], got["accuracy_steps"], got["accuracy_windows"], got["accuracy_ctx"]) == (16, steps, 2, ctx)


def test_accuracy_windows_score_disjoint_tokens_each_fed_the_one_before():
    ids = np.arange(100)
    got = accuracy_windows(ids, ctx=10, steps=4, tokens=10, vocab_size=100)
    assert got.prompts.tolist() == [list(range(0, 10)), list(range(4, 14)), list(range(8, 18))]
    targets = got.targets[got.scored]
    assert targets.tolist() == list(range(11, 21))  # each scored once, the last window cut to what is left
    assert (got.fed[got.scored] == targets - 1).all()  # teacher-forced: fed the text's previous token
    assert got.scored.sum(axis=1).tolist() == [4, 4, 2]


def test_rows_of_a_file_are_streams_of_their_own():
    ids = np.arange(40).reshape(2, 20)
    got = accuracy_windows(ids, ctx=12, steps=8, tokens=14, vocab_size=40)
    assert got.targets[got.scored].tolist() == list(range(13, 20)) + list(range(33, 40))


def test_a_text_too_short_for_the_accuracy_tokens_is_refused_when_planned(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(list(range(200))))
    planned_point("model=tiny", f"prompt={path}", "strategy=contiguous", "ctx=64", "decode_tokens=2")  # exact: no pass
    with pytest.raises(ConfigError) as refused:
        planned_point("model=tiny", "model.d_model=128", f"prompt={path}", "strategy=int8", "ctx=64",
                      "decode_tokens=2", "accuracy.tokens=1024")
    assert refused.value.key == "accuracy.tokens"
    assert "1,089 tokens" in str(refused.value) and "200 tokens" in str(refused.value)


def test_the_python_docs_text_is_built_in_and_hashed_with_the_tokenizer(checkpoint):
    folder, _ = checkpoint
    point = planned_point(f"model.checkpoint={folder}", "prompt=python-docs", "strategy=contiguous", "ctx=64",
                          "decode_tokens=2", "batch=2")
    tokens = read_tokens("python-docs", folder / "tokenizer.json")
    assert point.prompt == "python-docs" and len(tokens) > 50_000
    assert point.prompt_hash == content_hash("python-docs", folder / "tokenizer.json")
    with pytest.raises(ConfigError, match="prompt: 'python-docs' is a built-in text, which needs a tokenizer"):
        planned_point("model=tiny", "prompt=python-docs", "ctx=8")


def test_a_prompt_file_changed_after_planning_is_refused_in_the_point(checkpoint, tmp_path):
    folder, _ = checkpoint
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(list(range(50))))
    point = planned_point(f"model.checkpoint={folder}", f"prompt={path}", "strategy=quantized", "ctx=8",
                          "decode_tokens=2", "accuracy.tokens=16", "accuracy.steps=8")
    path.write_text(json.dumps(list(range(1, 51))))
    model = build_model(point.model, torch.device("cpu"), torch.float32, point.seed, point.matmul, point.batch)
    with pytest.raises(PromptError, match="changed since the sweep was planned"):
        accuracy(point, point.strategy.instantiate(), model)
