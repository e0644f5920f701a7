"""The runner and the report end to end on a saved checkpoint and a text prompt, beside random weights:
the rows say what the weights and the prompt were, approximate rows carry perplexity, and the
report's "what fewer bytes buy" says where each group's accuracy came from."""
from __future__ import annotations

import pandas as pd
import pytest

from tests.conftest import QUICK_CALIBRATION, REPO_ROOT, run_cli

transformers = pytest.importorskip("transformers")

from tests.test_checkpoint import save_family  # noqa: E402 (needs transformers)

POINT = ("device=cpu", "ctx=48", "decode_tokens=8", "batch=1", QUICK_CALIBRATION)


@pytest.mark.slow
def test_a_sweep_on_a_checkpoint_and_its_report(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path / "tiny-llama"
    save_family("llama", folder)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train([str(REPO_ROOT / "README.md")], trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>"]))
    tokenizer.save(str(folder / "tokenizer.json"))
    results = tmp_path / "results"
    real = run_cli("-m", "model=tiny", f"model.checkpoint={folder}", "strategy=contiguous,quantized",
                   f"prompt={REPO_ROOT / 'README.md'}", *POINT, f"results_dir={results}")
    assert real.returncode == 0, real.stderr[-2000:]
    random = run_cli("-m", "model=tiny", "strategy=contiguous,quantized", *POINT, f"results_dir={results}")
    assert random.returncode == 0, random.stderr[-2000:]

    rows = pd.read_parquet(results).set_index(["weights", "strategy"])
    checkpoint = rows.loc[("checkpoint", "quantized")]
    assert checkpoint["model"] == "tiny-llama" and checkpoint["checkpoint"] == str(folder)
    assert len(checkpoint["checkpoint_hash"]) == 16 and checkpoint["prompt"] == str(REPO_ROOT / "README.md")
    assert checkpoint["perplexity_reference"] > 1 and checkpoint["perplexity_delta"] == pytest.approx(
        checkpoint["perplexity"] - checkpoint["perplexity_reference"])
    assert checkpoint["reference"] == "strategies.caches.contiguous.ContiguousStrategy:sdpa"
    assert pd.isna(rows.loc[("checkpoint", "contiguous"), "perplexity"])  # exact: proven by its tokens instead
    assert pd.isna(rows.loc[("random", "quantized"), "perplexity"])  # random ids: no text to score
    assert rows.loc[("random", "quantized"), "top1_agreement"] > 0

    report = run_cli(f"results_dir={results}", module="harness.report")
    assert report.returncode == 0, report.stderr[-2000:]
    text = (results / "_report" / "report.md").read_text()
    section = text[text.index("## What fewer bytes buy"):]
    section = section[: section.index("\n## ", 1)]
    assert f"Accuracy from a checkpoint's weights: `{folder}`" in section
    assert "Random weights do not predict real accuracy" in section
    reference = checkpoint["perplexity_reference"]
    assert f"The exact cache's perplexity on it: {reference:.4g} after ctx " in section
    assert f"| {checkpoint['perplexity_ratio']:.4f} [" in section  # the ratio with its interval
