"""The report and harness.analysis.results on a generated results folder (tests/report_fixtures.py)."""
from __future__ import annotations

import base64
import shutil
from html.parser import HTMLParser

import pandas as pd
import pytest

from harness.store.calibration import host_slug

from harness.report.__main__ import main as report_main
from harness.report import tables
from harness.report import units as fmt
from harness.report.assemble import build_report
from harness.analysis.results import Results, load
from tests.report_fixtures import SLOWDOWN, write_results

VOID_TAGS = {"meta", "img", "br", "hr", "link", "input"}


class StructureCheck(HTMLParser):
    """Collects images and checks that every opened tag is closed in order."""

    def __init__(self):
        super().__init__()
        self.open: list[str] = []
        self.images: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag not in VOID_TAGS:
            self.open.append(tag)

    def handle_endtag(self, tag):
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.open[-1:] or 'nothing'}")
        else:
            self.open.pop()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One report built on the full fixture (plots take seconds: build it once for all checks)."""
    folder = write_results(tmp_path_factory.mktemp("results"))
    return folder, build_report(folder)


def test_report_writes_markdown_html_and_plots(report):
    folder, files = report
    assert files.markdown == folder / "_report" / "report.md" and files.markdown.is_file()
    assert files.html == folder / "_report" / "index.html" and files.html.is_file()
    assert len(files.figures) == 7  # step time, step ratio, no cache / cache, cache bytes, prefill / decode, peak memory, equal b x t
    assert files.csv.is_file() and files.csv.read_text().startswith("series,strategy,model,")
    for png in files.figures:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in files.markdown.read_text()


def test_html_parses_and_embeds_every_plot(report):
    _, files = report
    check = StructureCheck()
    check.feed(files.html.read_text())
    check.close()
    assert not check.errors and check.open == []
    assert len(check.images) == len(files.figures)
    for src in check.images:  # self-contained: no image is a link to a file
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"


def test_report_names_every_section_and_answer(report):
    _, files = report
    text = files.markdown.read_text()
    for needle in ("Every row beside its prediction", "What a KV cache buys and costs: the questions, answered",
                   "327,680 B (320 KiB)", "430,626 tokens", "9 of 9 points generated exactly the reference's tokens",
                   "Equal batch × tokens", f"measured: calibration {host_slug()}__cpu__float32.json"):
        assert needle in text, needle


def test_skipped_failed_rows_and_bad_files_are_listed_with_reasons(report):
    _, files = report
    text = files.markdown.read_text()
    section = text[text.index("## Rows and files not measured"):]
    assert "flash needs CUDA" in section and "out of memory allocating the cache" in section
    assert "corrupt.parquet" in section and "corrupt Parquet" in section
    assert "foreign.parquet" in section and "not a harness row" in section
    assert "notes.txt" in section


def test_load_joins_the_prediction_to_every_row(report):
    folder, _ = report
    df = load(folder)
    assert len(df) == 20 and set(df["status"]) == {"ok", "skipped", "failed"}
    ok = df[df["status"] == "ok"]
    for strategy, slowdown in SLOWDOWN.items():  # the fixture measured exactly slowdown x the roofline
        ratios = ok.loc[ok["strategy"] == strategy, "ratio_decode_step_s"]
        assert ratios.to_numpy() == pytest.approx(slowdown)
    cached = ok[ok["strategy"] == "contiguous"]
    assert cached["ratio_kv_cache_bytes"].to_numpy() == pytest.approx(1.0)
    assert "ratio_bytes_per_step_model" not in df  # model bytes over model bytes: always 1, never a column
    assert set(df["roof_source"]) == {"measured"}
    assert {p.rsplit("/", 1)[-1] for p, _ in df.attrs["skipped_files"]} == {
        "corrupt.parquet", "foreign.parquet", "notes.txt"}


def test_report_folder_does_not_break_read_parquet_of_the_results(report, tmp_path):
    folder = write_results(tmp_path, awkward=False, batches=(1,), contexts=(64,))
    shutil.copytree(report[1].markdown.parent, folder / "_report")  # a real report, without rebuilding it
    assert len(pd.read_parquet(folder)) == 2  # _report/ and _calibration/ are skipped by pyarrow


def test_without_calibration_the_report_says_which_datasheet_stands_in(tmp_path):
    folder = write_results(tmp_path, calibration=False, awkward=False, batches=(1,), contexts=(64, 256))
    df = load(folder)
    assert set(df["roof_source"]) == {"datasheet"}
    assert df["roof_description"].str.contains("h100_sxm").all()
    assert df["roof_description"].str.contains("stand-in").all()


def test_roofs_recorded_in_the_rows_come_first(tmp_path):
    folder = write_results(tmp_path, calibration=False, awkward=False, batches=(1,), contexts=(64,), row_roofs=True)
    df = load(folder)
    assert set(df["roof_source"]) == {"measured"}
    assert df["roof_description"].str.contains("recorded in the rows").all()
    for _, row in df.iterrows():
        assert row["ratio_decode_step_s"] == pytest.approx(SLOWDOWN[row["strategy"]])


def test_empty_folder_gets_a_message_not_a_traceback(tmp_path, capsys):
    assert report_main([f"results_dir={tmp_path}"]) == 0
    text = (tmp_path / "_report" / "report.md").read_text()
    assert "No rows to report" in text
    assert (tmp_path / "_report" / "index.html").is_file()


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    assert report_main([f"results_dir={tmp_path / 'missing'}"]) == 2
    assert capsys.readouterr().err.strip().startswith("results_dir:")
    assert report_main([f"results_dir={tmp_path}", "hardware=tpu"]) == 2
    assert capsys.readouterr().err.strip().startswith("hardware:")
    assert report_main(["colour=blue"]) == 2


def test_the_report_leads_with_this_machine_and_lists_rows_that_did_not_run_apart(report):
    _, files = report
    text = files.markdown.read_text()
    assert text.index("## This machine, point by point") < text.index("## Measured against predicted")
    assert text.index("## Measured against predicted") < text.index("## What a KV cache buys and costs")
    table = text.split("## Every row beside its prediction")[1].split("\n## ")[0]
    assert "| skipped |" not in table and "| failed |" not in table  # those are listed apart, with reasons
    assert "bytes/step (source)" in table and "| step ÷ roofline |" in table
    assert "max-height" not in files.html.read_text()  # a plain table: screenshots and print keep every row


def test_every_row_sets_its_measured_peak_beside_the_memory_models(report):
    folder, files = report
    rows = load(folder)
    ok = rows[rows.status == "ok"]
    assert (ok.peak_memory_predicted_bytes > ok.weight_bytes).all()
    assert ((ok.ratio_peak_memory_bytes - ok.peak_memory_bytes / ok.peak_memory_predicted_bytes).abs() < 1e-12).all()
    header = next(line for line in files.markdown.read_text().splitlines() if line.startswith("| strategy | model |"))
    assert "| peak memory | peak predicted | peak ÷ predicted |" in header
    assert len(set(header.split("|"))) == len(header.split("|")) - 1  # every column named apart (the ends are '')


def test_the_first_table_names_the_linear_kernel_of_each_point(report):
    """Two runs of one point with different linear kernels (matmul) are two lines: each says which."""
    _, files = report
    summary = files.markdown.read_text().split("## This machine, point by point")[1].split("\n## ")[0]
    lines = [line for line in summary.splitlines() if line.startswith("| ")]
    assert "| linears |" in lines[0]
    assert all(line.split("|")[4].strip() == "aten" for line in lines[2:])  # report_fixtures: matmul=aten


def test_fewer_bytes_sets_each_narrow_cache_point_beside_the_plain_cache(tmp_path):
    """"What fewer bytes buy" on rows of an older schema with an int8 cache at every point
    (tests/report_fixtures.py): its bytes per token against the plain cache's, the step ratio measured and
    predicted, how far its outputs moved, the random-weights warning, and the bytes-against-KL plot."""
    from harness.analysis import analytic
    from harness.report import units as fmt
    from harness.report.document import to_markdown
    from harness.report.kv_formats import RANDOM_WEIGHTS_WARNING, format_section
    from harness.report.cohorts import cohorts_of
    from tests.report_fixtures import DECODE_TOKENS, DTYPE, INT8, INT8_ACCURACY, SHAPE

    folder = write_results(tmp_path / "results", awkward=False, batches=(1, 4), contexts=(64, 256), quantized=True)
    (group,) = cohorts_of(Results.of(load(folder)))
    (tmp_path / "report").mkdir()
    text = to_markdown(format_section([group], tmp_path / "report"))
    lines = [line for line in text.splitlines() if line.startswith("| quantized |")]
    assert len(lines) == 4  # one per batch x ctx
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        tokens = int(cells[3]) + DECODE_TOKENS
        bytes_ratio = (analytic.kv_bytes_per_token_held(SHAPE, DTYPE, tokens, INT8)
                       / analytic.kv_bytes_per_token_held(SHAPE, DTYPE, tokens))
        assert cells[5] == fmt.ratio(bytes_ratio), cells
        # Both caches planted at the same multiple of their roofline: the measured step ratio is the predicted
        # one, compared across rows that were not timed together ("apart").
        assert cells[6] == f"{cells[7]} apart", cells
        assert cells[8] == f"{INT8_ACCURACY['logit_kl_mean']:.2g}" and cells[11] == f"{INT8_ACCURACY['top1_agreement']:.3g}"
    assert RANDOM_WEIGHTS_WARNING in text
    assert "Not recorded in these rows" in text and "`logit_kl_p99`" in text  # an older schema says what it lacks
    (plot,) = (tmp_path / "report").glob("bytes_vs_kl_*.png")
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_every_table_names_each_column_once_and_rows_csv_renders_the_rows_tables_model(report):
    """One table model (tables.ROW_COLUMNS) renders the rows table and rows.csv: the same rows in the same
    order, rows.csv holding each column's sources as numbers; no table heads two columns alike."""
    folder, files = report
    lines = files.markdown.read_text().splitlines()
    headers = [line for line, below in zip(lines, lines[1:]) if line.startswith("| ") and below.startswith("|:") or
               line.startswith("| ") and below.startswith("|-")]
    assert len(headers) >= 5
    for header in headers:
        cells = [cell.strip() for cell in header.strip("|").split(" | ")]
        assert len(set(cells)) == len(cells) and "ratio" not in cells, header
    csv = pd.read_csv(files.csv)
    expected = [s for column in tables.ROW_COLUMNS for s in column.sources] + list(tables.ROW_IDENTITY)
    assert list(csv.columns) == [c for c in dict.fromkeys(expected) if c in csv.columns]
    table = load(folder)
    shown = tables.rows_table(table)
    assert len(csv) == len(shown.rows) == int((table["status"] == "ok").sum())
    steps = shown.header.index("step measured")
    assert [row[steps] for row in shown.rows] == [fmt.seconds(v) for v in csv["decode_step_s"]]
