"""'What compressing the cache trades': per point where a cache that keeps fewer tokens, layers or key
channels ran, the picture of bytes held against quality (KL, perplexity ratio, recall), and a table that
sets each variant's measured step ratio beside the predicted one, calling out a disagreement."""
from __future__ import annotations

from harness.analysis.compression import step_bytes_ratio
from harness.analysis.results import Results, load
from harness.config import CacheLayout
from harness.report.cohorts import cohorts_of
from harness.report.compression import compression_section
from harness.report.document import Figure, to_markdown
from tests import report_fixtures
from tests.report_fixtures import DECODE_TOKENS, DTYPE, SHAPE, STRATEGY_CLASSES, Variant, write_variant_results

EVICTION_CLASS = "strategies.caches.eviction.EvictionStrategy"


def _quality(kl: float, perplexity_ratio: float, recall: float) -> dict:
    return {"logit_kl_mean": kl, "logit_kl_mean_ci_low": 0.8 * kl, "logit_kl_mean_ci_high": 1.2 * kl,
            "logit_kl_p99": 8 * kl, "logit_kl_p99_ci_low": 6 * kl, "logit_kl_p99_ci_high": 10 * kl,
            "logit_kl_max": 20 * kl, "top1_agreement": 0.8, "top1_agreement_ci_low": 0.75,
            "top1_agreement_ci_high": 0.85, "logit_max_abs_error": 3.0, "perplexity": 12.0 * perplexity_ratio,
            "perplexity_reference": 12.0, "perplexity_delta": 12.0 * (perplexity_ratio - 1),
            "perplexity_ratio": perplexity_ratio, "perplexity_ratio_ci_low": 0.98 * perplexity_ratio,
            "perplexity_ratio_ci_high": 1.02 * perplexity_ratio, "accuracy_tokens": 256, "accuracy_steps": 64,
            "accuracy_ctx": 1024, "accuracy_reference": f"{STRATEGY_CLASSES['contiguous']}:c",
            "recall_top1": recall, "recall_top1_ci_low": recall - 0.05, "recall_top1_ci_high": recall + 0.05,
            "recall_top1_reference": 0.96, "recall_kl_mean": 2 * kl, "recall_kl_mean_ci_low": kl,
            "recall_kl_mean_ci_high": 3 * kl, "recall_tokens": 256, "recall_distance": 944}


SNAPKV = CacheLayout(token_budget=128, eviction_score="observation_window")
PLANTED = {  # streaming: slower than its bytes predict (a disagreement to call out); snapkv: as predicted
    "streaming": Variant("eviction", EVICTION_CLASS, CacheLayout(token_budget=128, eviction_score="recency"), 1.2,
                         _quality(0.15, 1.10, 0.30)),
    "snapkv": Variant("eviction", EVICTION_CLASS, SNAPKV, step_bytes_ratio(SHAPE, DTYPE, 4, 1024, DECODE_TOKENS, SNAPKV),
                      _quality(0.12, 1.12, 0.75)),
}


def section(tmp_path, monkeypatch, variants):
    for name, variant in PLANTED.items():
        monkeypatch.setitem(report_fixtures.VARIANTS, name, variant)
    folder = write_variant_results(tmp_path / "results", batches=(4,), contexts=(1024,), variants=variants)
    (group,) = cohorts_of(Results.of(load(folder)))
    (tmp_path / "report").mkdir()
    return compression_section([group], tmp_path / "report")


def test_the_section_leads_with_the_tradeoff_and_calls_out_a_step_the_bytes_do_not_explain(tmp_path, monkeypatch):
    blocks = section(tmp_path, monkeypatch, ("contiguous", "streaming", "snapkv"))
    figures = [b for b in blocks if isinstance(b, Figure)]
    assert len(figures) == 1 and figures[0].path.is_file()
    text = to_markdown(blocks)
    assert text.index("![") < text.index("| variant")  # the picture before the table
    table = {cells[0]: cells for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| `"))}
    assert set(table) == {"`contiguous`", "`streaming`", "`snapkv`"}
    assert table["`streaming`"][8] == "0.300 [0.250–0.350]" and table["`snapkv`"][8] == "0.750 [0.700–0.800]"
    assert table["`contiguous`"][2] == "reference" and table["`contiguous`"][4] == "exact"
    assert "**outside**" in table["`streaming`"][3]  # 1.2x measured, the bytes predict below 1
    assert "never" in table["`streaming`"][10]  # a 128-token budget keeps the cache below the weights
    assert "**outside**" not in table["`snapkv`"][3]  # measured as predicted
    assert "of a step's bytes here" in text and "`streaming` 1.2x" in text


def test_no_compressed_cache_no_tradeoff(tmp_path, monkeypatch):
    blocks = section(tmp_path, monkeypatch, ("contiguous", "int8"))
    assert len(blocks) == 2 and "+sweep=kv_compression" in to_markdown(blocks)


def test_the_report_of_compressed_caches_leads_with_what_they_trade(tmp_path, monkeypatch):
    """+sweep=kv_compression's report opens on the trade-off picture; a report without such rows keeps
    its usual order (tests/test_report.py)."""
    from harness.report.assemble import build_report

    for name, variant in PLANTED.items():
        monkeypatch.setitem(report_fixtures.VARIANTS, name, variant)
    folder = write_variant_results(tmp_path / "results", batches=(4,), contexts=(1024,),
                                   variants=("contiguous", "streaming", "snapkv"))
    text = build_report(folder).markdown.read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## What compressing the cache trades", "## This machine, point by point"]
    assert text.index("![") < text.index("## This machine, point by point")  # the picture first
