"""A strategy defined only under tests/ (tests/plugin/: one Python file, one YAML on Hydra's search
path) runs in a sweep beside the shipped ones, appears in the report's tables and plots, and in the
benchmark suite's parametrisation, with no edit anywhere else."""
from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest

from tests.conftest import PLUGIN, PLUGIN_CONF, REPO_ROOT


@pytest.fixture
def trusted(tiny_sweep, tmp_path):
    """The sweep's rows with `noisy` cleared: the report leaves noisy rows (timed while others took the
    CPUs) out of its plots, and this test is about where a strategy's name appears, not its timings."""
    from harness.store.files import write_row

    folder = tmp_path / "trusted"
    for _, row in pd.read_parquet(tiny_sweep.results).iterrows():
        write_row(folder, {**row.to_dict(), "noisy": False, "noise_reason": ""})
    return folder


def test_the_plugin_runs_beside_the_shipped_strategies_and_is_exact(tiny_sweep):
    rows = pd.read_parquet(tiny_sweep.results)  # the session's sweep (tests/conftest.py) names the plugin
    mine = rows[rows.strategy == PLUGIN]
    assert len(mine) == 2 and (mine.status == "ok").all()
    assert (mine.strategy_class == "tests.plugin.plugin_strategy.PluginCacheStrategy").all()
    assert mine.caches_kv.all() and mine.kernel.str.startswith("python list").all()
    assert (rows.groupby(["batch", "ctx"]).tokens_digest.nunique() == 1).all()  # same tokens as no_cache


def test_the_plugin_appears_in_every_table_and_in_every_plot_that_names_strategies(trusted, tmp_path, monkeypatch):
    from harness.report import assemble, plots

    legends = {}
    real_save = plots.save

    def recording_save(fig, folder, name):
        texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        texts += [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        legends[name] = " ".join(texts)
        return real_save(fig, folder, name)

    monkeypatch.setattr(plots, "save", recording_save)
    files = assemble.build_report(trusted, out_dir=tmp_path / "report")
    naming = {name: text for name, text in legends.items() if "contiguous" in text}
    assert len(naming) >= 3, legends  # step time, cache over no cache, cache bytes, prefill vs decode
    for name, text in naming.items():
        assert PLUGIN in text, f"{name} names contiguous but not {PLUGIN}: {text}"
    markdown = files.markdown.read_text()
    # every table that sets strategies side by side (the summary names only the fastest one per point)
    tables = [block for block in markdown.split("\n\n")
              if block.startswith("|") and "contiguous" in block and "fastest" not in block.splitlines()[0]]
    assert tables and all(PLUGIN in table for table in tables)


@pytest.mark.slow  # a second pytest collecting the benchmark suite
def test_the_plugin_is_in_the_benchmark_suites_parametrisation():
    env = {**os.environ, "HARNESS_SEARCHPATH": str(PLUGIN_CONF), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "benchmark",
                           "-p", "no:cacheprovider", "tests/benchmarks"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"test_decode_step[light-{PLUGIN}]" in done.stdout and f"test_decode_step[heavy-{PLUGIN}]" in done.stdout
