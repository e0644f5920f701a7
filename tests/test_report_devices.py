"""Rows of several machines in one report: each device is its own group, with its own roofs.

Two GPU types are both `device=cuda`; two CPUs both `cpu`. The report groups by the device's name too,
so their points are never drawn on one axis or judged against one roof, and the folders of several
sweeps (one per GPU type, docs/cluster.md) are read as one table.
"""
from __future__ import annotations

import re

import pandas as pd
import pytest

from harness.report.__main__ import main as report_main
from harness.store.files import write_row
from tests.report_fixtures import write_results

OTHER = "Other CPU (fixture)"


def two_machines(tmp_path):
    """Folder a: the fixture's Intel Xeon; folder b: the same points on another CPU with half the roofs."""
    a = write_results(tmp_path / "a", calibration=False, awkward=False, batches=(1, 4), contexts=(64, 256),
                      row_roofs=True)
    b = write_results(tmp_path / "b", calibration=False, awkward=False, batches=(1, 4), contexts=(64, 256),
                      row_roofs=True)
    for path in sorted(b.glob("*.parquet")):
        row = pd.read_parquet(path).iloc[0].to_dict()
        path.unlink()
        row.update(device_name=OTHER, roof_bandwidth_Bps=row["roof_bandwidth_Bps"] / 2,
                   roof_flops=row["roof_flops"] / 2, hostname="other-host")
        write_row(b, row)
    return a, b


@pytest.fixture(scope="module")
def report_of_two(tmp_path_factory):
    """Both folders through the CLI into one report (built once for the module: plots take seconds)."""
    root = tmp_path_factory.mktemp("devices")
    a, b = two_machines(root)
    assert report_main([f"results_dir={a},{b}", f"out={root / 'out'}"]) == 0
    return a, b, (root / "out" / "report.md").read_text()


def test_two_devices_are_two_groups_with_their_own_roofs(report_of_two):
    text = report_of_two[2]
    headings = [line for line in text.splitlines() if line.startswith("## Measured against predicted")]
    assert len(headings) == 2, headings
    assert any("Intel Xeon (fixture)" in h for h in headings) and any(OTHER in h for h in headings)
    roofs = text[text.index("## Roofs the predictions use"):]
    roofs = roofs[:roofs.index("\n## ", 1)]
    assert "Intel Xeon (fixture)" in roofs and OTHER in roofs and "9.8 GB/s" in roofs  # b's halved bandwidth
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert figures and len(set(figures)) == len(figures)  # each group's plots under their own names


def test_the_cli_reads_several_folders_as_one_table(report_of_two, tmp_path, capsys):
    a, b, text = report_of_two
    assert f"`{a}, {b}`: 16 rows" in text and OTHER in text
    assert report_main([f"results_dir={a},{tmp_path / 'missing'}"]) == 2
    assert capsys.readouterr().err.strip().startswith("results_dir: ")
