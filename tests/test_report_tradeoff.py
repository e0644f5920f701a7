"""'What fewer bytes buy' on cache variants measured in one group on a checkpoint (tests/report_fixtures.py:
contiguous, paged32, int8, fp8, kivi4, int4 with the accuracy SmolLM2-135M gave on English prose): one
table of bytes, paired speed and accuracy per variant and point, the Pareto front of bytes against KL,
and the plot of both."""
from __future__ import annotations

import pandas as pd
import pytest

from harness.analysis import analytic
from harness.analysis.results import Results, load
from harness.measure.intervals import Interval
from harness.report import kv_formats
from harness.report import units as fmt
from harness.report.cohorts import cohorts_of
from harness.report.document import Figure, to_markdown
from harness.report.kv_formats import RANDOM_WEIGHTS_WARNING, format_section
from harness.report.tradeoff import Accuracy, FrontPoint, pareto_front, reference_series
from tests.report_fixtures import DECODE_TOKENS, DTYPE, SHAPE, VARIANTS, write_variant_results

FRONT = {"contiguous", "paged32", "int8", "kivi4", "int4"}  # fp8: as many bytes as int8, three times its KL


def section(tmp_path, weights: str = "checkpoint"):
    folder = write_variant_results(tmp_path / "results", weights=weights, batches=(4,), contexts=(256, 1024))
    (group,) = cohorts_of(Results.of(load(folder)))
    (tmp_path / "report").mkdir()
    blocks = format_section([group], tmp_path / "report")
    return blocks, to_markdown(blocks)


def table_lines(text: str) -> dict[tuple[str, str], list[str]]:
    """(variant, ctx) -> the table's cells."""
    found = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in VARIANTS:
            found[(cells[0], cells[3])] = cells
    return found


def test_every_variant_at_every_point_with_its_bytes_speed_and_accuracy(tmp_path):
    blocks, text = section(tmp_path)
    cells = table_lines(text)
    assert set(cells) == {(name, ctx) for name in VARIANTS for ctx in ("256", "1,024")}
    for (name, ctx), row in cells.items():
        variant = VARIANTS[name]
        tokens = int(ctx.replace(",", "")) + DECODE_TOKENS
        held = analytic.kv_bytes_per_token_held(SHAPE, DTYPE, tokens, variant.layout)
        assert row[1] == variant.family and row[4] == fmt.nbytes(held)
        assert row[5] == fmt.ratio(held / analytic.kv_bytes_per_token_held(SHAPE, DTYPE, tokens))
        if name == "contiguous":
            assert row[6] == "reference"
        else:  # the recorded paired ratio and its interval
            assert row[6] == f"{variant.step_ratio:.3g}x [{variant.step_ratio - 0.01:.3g}–{variant.step_ratio + 0.01:.3g}]"
        if not variant.accuracy:
            assert row[8] == row[12] == "exact"
            continue
        accuracy = variant.accuracy
        kl = accuracy["logit_kl_mean"]
        assert row[8] == f"{kl:.2g} [{0.9 * kl:.2g}–{1.1 * kl:.2g}]"
        assert row[9:12] == [f"{accuracy['logit_kl_p99']:.3g}", f"{accuracy['logit_kl_max']:.3g}",
                             f"{accuracy['top1_agreement']:.3g}"]
        assert row[12].startswith(f"{accuracy['perplexity_ratio']:.4f} [")
        assert row[13] == "1,024 (after 512)"
        assert (row[14] == "yes") == (name in FRONT), (name, row[14])
    assert "checkpoint's weights: `/models/SmolLM2-135M` (hash c0ffee)" in text and "`/data/prose.txt`" in text
    assert RANDOM_WEIGHTS_WARNING not in text and "Not recorded" not in text
    assert "**On the Pareto front** of bytes against KL, after ctx 512: `int4`" in text
    assert "`fp8`" not in text.split("**On the Pareto front**")[1].split("\n")[0]
    (figure,) = [b for b in blocks if isinstance(b, Figure)]
    assert figure.path.name.startswith("bytes_vs_kl_") and figure.path.read_bytes()[:4] == b"\x89PNG"


def test_the_plot_names_every_variant_once(tmp_path, monkeypatch):
    labels = []
    real_save = kv_formats.save

    def recording_save(fig, folder, name):
        labels.extend(t.get_text() for legend in fig.legends for t in legend.get_texts())
        return real_save(fig, folder, name)

    monkeypatch.setattr(kv_formats, "save", recording_save)
    section(tmp_path)
    named = [label.removesuffix(" (exact)") for label in labels if label != "Pareto front"]
    assert sorted(named) == sorted(VARIANTS) and "Pareto front" in labels
    assert "paged32 (exact)" in labels and "int8" in labels


def test_random_weights_keep_the_warning(tmp_path):
    _, text = section(tmp_path, weights="random")
    assert RANDOM_WEIGHTS_WARNING in text and "no perplexity was measured" in text


def front_point(series: str, bytes_per_token: float, kl: float | None, ctx: int = 512) -> FrontPoint:
    accuracy = Accuracy(exact=True) if kl is None else Accuracy(exact=False, kl=Interval(kl, kl, kl))
    return FrontPoint(series, ctx, bytes_per_token, accuracy)


@pytest.mark.parametrize("points, front", [
    # fewer bytes for more KL: every one on the front
    ([front_point("a", 1, 0.1), front_point("b", 2, 0.01), front_point("c", 8, None)], {"a", "b", "c"}),
    # as many bytes for more KL: beaten; equal on both: both on it
    ([front_point("int8", 2, 0.0016), front_point("fp8", 2, 0.0049), front_point("contiguous", 8, None),
      front_point("paged32", 8, None)], {"int8", "contiguous", "paged32"}),
    # more bytes for more KL: beaten; only rivals after the same context count
    ([front_point("x", 4, 0.2), front_point("y", 2, 0.1), front_point("z", 1, 0.5, ctx=64)], {"y", "z"}),
])
def test_the_front_keeps_what_nothing_beats_on_both(points, front):
    assert {series for _, series in pareto_front(points)} == front


def test_the_recorded_reference_is_found_by_its_key_whatever_its_variant_is_named():
    """Two exact caches in one group, the reference a variant with an option set (its name is not its
    class's): the report takes the one the rounds paired against, not the plainer one."""
    ran = pd.DataFrame({"strategy": ["contiguous(backend=sdpa)", "contiguous", "int8"],
                        "series": ["contiguous(backend=sdpa)", "contiguous", "int8"],
                        "point_key": ["k-sdpa", "k-c", "k-int8"], "exact": [True, True, False],
                        "group_reference": ["contiguous"] * 3, "group_reference_key": ["k-sdpa"] * 3})
    assert reference_series(ran) == "contiguous(backend=sdpa)"  # the key decides, not a name two rows match
    older = ran.drop(columns="group_reference_key").assign(group_reference="contiguous(backend=sdpa)")
    assert reference_series(older) == "contiguous(backend=sdpa)"  # rows without the key: found by name
