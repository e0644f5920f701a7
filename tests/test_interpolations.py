"""An interpolation that does not resolve (an unset environment variable, an unknown resolver, a key
that does not exist, a cycle) is one line naming the key, exit 2, nothing written, in each of the
three tools: the runner (every job of a sweep, a launcher's options, --cfg --resolve), the analytic
CLI and the report. One that resolves is used as resolved."""
from __future__ import annotations

import importlib.util
import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import pytest

from tests.conftest import refused_by_runner
from tests.hardening_helpers import FAST, cli, only_line, refusal

MISSING_ENV = "HARNESS_TEST_NO_SUCH_VARIABLE"
# Each way an interpolation fails, and what the line says of it.
FAILING = [
    (f"${{oc.env:{MISSING_ENV}}}", f"Environment variable '{MISSING_ENV}' not found"),
    ("${no_such_resolver:x}", "Unsupported interpolation type no_such_resolver"),
    ("${no_such.key}", "Interpolation key 'no_such.key' not found"),
]


@pytest.fixture(autouse=True)
def no_such_variable(monkeypatch):
    monkeypatch.delenv(MISSING_ENV, raising=False)


def ran(main, argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("text,says", FAILING)
@pytest.mark.parametrize("key", ["results_dir", "ctx", "model.n_layers", "timing.warmup_max", "interleave", "+extra"])
def test_the_plan_refuses_an_interpolation_that_does_not_resolve(tmp_path, key, text, says):
    message = refusal(f"results_dir={tmp_path}", f"{key}={text}")
    assert message.startswith(f"{key.lstrip('+')}: {text!r} does not resolve: ") and says in message, message


@pytest.mark.parametrize("args,key", [
    (["results_dir=${results_dir}"], "results_dir"),  # a cycle
    (["ctx=${batch}", "batch=${ctx}"], "batch"),  # a cycle of two: the first key of the config
    (["-m", "ctx=4,${oc.env:" + MISSING_ENV + "}"], "ctx"),  # the second job of a sweep
    (["model.name=???"], "model.name"),
    (["ctx=${oc.env:HOME}"], "ctx"),  # resolves, to a value of the wrong type
    (["hydra.verbose=${oc.env:" + MISSING_ENV + "}"], "hydra.verbose"),
])
def test_cycles_sweeps_and_hydras_keys_are_refused_alike(tmp_path, args, key):
    assert refusal(f"results_dir={tmp_path}", *args).startswith(f"{key}: ")


def test_an_interpolation_that_resolves_is_used(tmp_path, monkeypatch):
    from tests.hardening_helpers import planned

    monkeypatch.setenv("HARNESS_TEST_ROWS", str(tmp_path / "rows"))
    job = planned("results_dir=${oc.env:HARNESS_TEST_ROWS}", "decode_tokens=${ctx}")[0]
    assert str(job.config.results_dir) == str(tmp_path / "rows") and job.point.decode_tokens == 8


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins") is None  # the namespace first: find_spec of a
                    or importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,  # child raises without it
                    reason="hydra-submitit-launcher (the cluster extra) is not installed")
def test_a_launchers_option_is_checked_too(tmp_path):
    message = refusal("-m", "hydra/launcher=local", f"results_dir={tmp_path}",
                      f"hydra.launcher.timeout_min=${{oc.env:{MISSING_ENV}}}")
    assert message.startswith("hydra.launcher.timeout_min: ") and "does not resolve" in message


def test_the_runner_cli_says_it_in_one_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refused_by_runner(*FAST, f"results_dir=${{oc.env:{MISSING_ENV}}}")
    assert line == f"error: results_dir: '${{oc.env:{MISSING_ENV}}}' does not resolve: " \
                   f"\"Environment variable '{MISSING_ENV}' not found\""
    assert not list(tmp_path.iterdir())


def test_cfg_resolve_says_it_in_one_line(tmp_path, monkeypatch):
    from harness.run import app

    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    with mock.patch.object(sys, "argv", ["harness.run", "--cfg", "job", "--resolve", "ctx=${no_such_key}"]), \
            redirect_stderr(err):
        code = app.main()
    assert code == 2 and only_line(err.getvalue()).startswith("error: ctx: '${no_such_key}' does not resolve")


@pytest.mark.slow  # a process of its own; the same main() in process: the test above
def test_the_reported_case_through_a_real_process(tmp_path):
    result = cli(*FAST, f"results_dir=${{oc.env:{MISSING_ENV}}}", cwd=tmp_path)
    assert result.returncode == 2 and only_line(result.stderr).startswith("error: results_dir: ")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("text,says", FAILING)
@pytest.mark.parametrize("key", ["results_dir", "ctx", "model.n_layers", "hardware.name", "usd_per_device_hour"])
def test_the_analytic_cli_refuses_in_one_line(key, text, says):
    from harness.analysis.cli import main

    code, out, err = ran(main, [f"{key}={text}"])
    assert code == 2 and out == "" and only_line(err).startswith(f"{key}: {text!r} does not resolve") and says in err


@pytest.mark.parametrize("text,says", FAILING)
@pytest.mark.parametrize("key", ["results_dir", "hardware", "out", "baseline"])
def test_the_report_refuses_in_one_line_and_writes_nothing(tmp_path, key, text, says):
    from harness.report.__main__ import main

    results = tmp_path / "results"
    results.mkdir()
    args = {"results_dir": str(results), key: text}
    code, out, err = ran(main, [f"{k}={v}" for k, v in args.items()])
    assert code == 2 and out == "" and only_line(err).startswith(f"{key}: {text!r} does not resolve") and says in err
    assert not list(results.iterdir()) and sorted(tmp_path.iterdir()) == [results]


def test_the_report_resolves_its_values_as_the_runner_does(tmp_path, monkeypatch):
    from harness.report.__main__ import parse
    from harness.report.assemble import ReportError

    monkeypatch.setenv("HARNESS_TEST_ROWS", str(tmp_path))
    options = parse(["results_dir=${oc.env:HARNESS_TEST_ROWS}", "out=${results_dir}/summary"])
    assert options["results_dir"] == str(tmp_path) and options["out"] == f"{tmp_path}/summary"
    with pytest.raises(ReportError, match=r"^out: '\$\{' is not an interpolation"):
        parse(["out=${"])
    assert parse([r"out=\${literal}"])["out"] == "${literal}"  # escaped: the text itself
