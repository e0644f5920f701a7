"""Property: any command line is either refused before anything runs, in one line naming a key it
set (or one its values imply), or it composes, runs on `tiny` and writes rows that read back. Random
overrides mix good values with bad ones (zero, negative, beyond int64, NaN, names that are paths, keys
that move the output, unknown options). In process through the runner's own plan, and a few of the
same command lines through the real CLI, which must agree with the plan."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harness.config.validate import ConfigError
from harness.measure.group import measure_point
from harness.measure.decoding import not_run
from harness.run.catalog import strategy_targets
from harness.run.isolation import run_inline
from harness.run.plan import plan
from harness.run.row import build_row
from harness.store.calibration import Calibration, save
from harness.store.files import write_row
from tests.conftest import REPO_ROOT

NO_CUDA = lambda: False  # noqa: E731
FILE, UNDER_FILE, FOLDER = "<file>", "<under-file>", "<folder>"  # results_dir placeholders
BASE = {"device": "cpu", "model": "tiny", "ctx": 4, "decode_tokens": 2, "timing.warmup_max": 3}  # a fast point
VALUES = {  # key -> values to draw, good and bad
    "batch": [1, 2, 3, 0, -1, 2**62, 2**63, 2**64, 1.5, "x"],
    "ctx": [1, 4, 9, 0, -5, 2**63, "abc"],
    "decode_tokens": [1, 2, 3, 0, 2**63 - 1, 2**64],
    "seed": [0, 7, 2**63 - 1, 2**63, -1, 2**70],
    "dtype": ["auto", "float32", "bfloat16", "float16", "int4"],
    "prefill": ["compute", "random", "sometimes"],
    "strategy": [*sorted(strategy_targets()), "nosuch"],
    "strategy.block_size": [1, 4, 0, 2**63, "nan"],
    "strategy._target_": ["strategies.caches.no_cache.NoCacheStrategy", "nosuch.Klass", "os.path"],
    "model.name": ["tiny", "a/b", ".x", "ok-name.v2", "''"],
    "model.n_heads": [4, 2, 3, 0],
    "model.n_kv_heads": [2, 1, 3, 0],
    "model.head_dim": [16, 8, 7, 0, "null"],
    "model.rope_theta": [10000.0, "nan", "inf", -1, 0],
    "model.vocab_size": [256, 2**31, 1],
    "timing.warmup_min": [0, 1, -1, 2**63],
    "timing.warmup_max": [1, 3, 0, 10001],
    "timing.settle_tolerance": [0.05, 0, "nan", 1e308],
    "timing.cuda_graphs": ["false", "true"],
    "matmul": ["auto", "aten", "onednn", "c", "mkl"],
    "traffic": ["auto", "model", "ncu"],
    "results_dir": [FOLDER, "''", FILE, UNDER_FILE],
    "calibration_budget_s": [60, 0, "nan", 1e9],
    "rerun_failed": ["true", "false", "maybe"],
    "hydra.run.dir": ["/tmp/elsewhere"],
    "hydra.job.chdir": ["true"],
    "no_such_key": [1],
}
# Keys a refusal may name beyond the ones set: what a value implies (a shape's other side, a point
# that does not fit, a row column beyond int64, a strategy's own check, the checkpoint an engine needs).
IMPLIED = {"model", "batch", "command line", "strategy", "strategy._target_", "model.checkpoint", "model.d_model",
           "model.n_heads", "model.head_dim", "prefill", "timing.cuda_graphs", "timing.warmup_max", "matmul", "traffic",
           "config"}


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("property")
    (root / "a_file").write_text("x")
    return root


def command_line(drawn: dict, places, rows: str) -> list[str]:
    values = {**BASE, **drawn}
    names = {FOLDER: str(places / rows), FILE: str(places / "a_file"), UNDER_FILE: str(places / "a_file" / "x")}
    values.setdefault("results_dir", FOLDER)
    return [f"{key}={names.get(value, value) if isinstance(value, str) else value}" for key, value in values.items()]


def refused_line(error: ConfigError, drawn: dict) -> None:
    message = str(error)
    assert "\n" not in message and ": " in message, message
    key = message.split(": ", 1)[0]
    groups = {name.split(".")[0] for name in drawn}
    assert key in drawn or key.split(".")[0] in groups or key in IMPLIED, (key, drawn)


def runs_and_writes(jobs, places) -> None:
    """Each job measured as the runner measures it (in process), its row written where it says."""
    for job in jobs:
        folder = Path(str(job.config.results_dir))
        assert folder.is_absolute() and folder.is_relative_to(places), folder  # where the command line said
        measured = (not_run("skipped", job.does_not_fit) if job.does_not_fit is not None
                    else run_inline(measure_point, job.point))
        assert measured["status"] in ("ok", "skipped"), (job.overrides, measured.get("reason"))
        path = write_row(folder, build_row(job.point, measured))
        assert pq.read_table(path).num_rows == 1


overrides = st.dictionaries(st.sampled_from(sorted(VALUES)), st.none(), max_size=4).flatmap(
    lambda keys: st.fixed_dictionaries({key: st.sampled_from(VALUES[key]) for key in keys}))


# The adversarial pass's own cases, always tried, before the random ones.
@example(drawn={"results_dir": FILE})
@example(drawn={"results_dir": "''"})
@example(drawn={"results_dir": UNDER_FILE})
@example(drawn={"strategy": "paged", "strategy.block_size": 2**63})
@example(drawn={"strategy": "paged", "strategy.block_size": "nan"})
@example(drawn={"seed": 2**64})
@example(drawn={"model.name": "a/b"})
@example(drawn={"strategy": "llamacpp"})  # an engine on the random model: refused naming the checkpoint it needs
@settings(max_examples=18)
@given(drawn=overrides)
def test_every_command_line_runs_or_is_refused_in_one_line(places, drawn):
    try:
        the_plan = plan(command_line(drawn, places, "rows"), cuda_available=NO_CUDA)
    except ConfigError as error:
        refused_line(error, drawn)
        return
    runs_and_writes(the_plan.planned, places)


def examples(places, want_refused: bool, skip: int):
    """Command lines drawn from VALUES with a fixed seed: the `skip`-th one the plan refuses (or accepts)."""
    rng, found = random.Random(2024), 0
    while True:
        keys = rng.sample(sorted(VALUES), rng.randint(1, 3 if want_refused else 2))
        # the good values come first in VALUES: an accepted line is found in a try or two
        drawn = {key: rng.choice(VALUES[key] if want_refused else VALUES[key][:2]) for key in keys}
        try:
            plan(command_line(drawn, places, "cli"), cuda_available=NO_CUDA)
            refused = None
        except ConfigError as error:
            refused = str(error)
        if (refused is not None) == want_refused:
            if found == skip:
                return drawn, refused
            found += 1


@pytest.mark.slow  # the CLI against the plan on drawn lines; the lines themselves run in process above
@pytest.mark.parametrize("want_refused,skip", [(True, 0), (True, 1), (False, 0), (False, 1)])
def test_the_cli_agrees_with_the_plan(places, want_refused, skip):
    drawn, refused = examples(places, want_refused, skip)
    rows = places / "cli"
    save(rows, Calibration(device="cpu", device_name="test cpu", hostname=socket.gethostname(), dtype="float32",
                           read_bandwidth_Bps=1e10, read_bandwidth_sum_Bps=1e10, read_bandwidth_gemv_Bps=1e10,
                           read_bandwidth_packed_gemv_Bps=None, matmul_flops=1e11,
                           timestamp="2024-01-01T00:00:00+00:00", method="planted"))
    before = len(list(rows.glob("*.parquet")))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = subprocess.run([sys.executable, "-m", "harness.run", *command_line(drawn, places, "cli"), "isolate=false",
                             "overwrite=true"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    if refused is not None:
        assert result.returncode == 2, (drawn, result.stderr)
        line = result.stderr.strip()
        assert "\n" not in line and line.split(": ")[:2] == ["error", refused.split(": ")[0]], (drawn, line, refused)
        assert len(list(rows.glob("*.parquet"))) == before
    else:
        assert result.returncode == 0, (drawn, result.stderr)
        assert "Traceback" not in result.stderr
        assert len(list(rows.glob("*.parquet"))) >= max(before, 1)
