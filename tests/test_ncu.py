"""Measured traffic: ncu's raw CSV parser, the ncu command, and measure_traffic end to end against a
fake ncu (no GPU here). The profiled program itself is checked on the CPU: it generates the tokens
measure_point generates, so ncu profiles the steps that were timed."""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from harness.config import TimingConfig
from harness.measure.ncu import (
    NcuParseError, ncu_command, measure_traffic, parse_ncu_csv,
)
from harness.measure.ncu_target import run_decode_steps
from harness.config.point import point_from_record
from harness.config import Point
from tests.conftest import planned_point

FIXTURE = Path(__file__).parent / "fixtures" / "ncu_decode_sample.csv"
# The fixture: 2 decode steps x 3 kernels; reads in Mbyte, writes in Kbyte, some with "," separators.
FIXTURE_READ = (2.10 + 0.13 + 1050.62 + 2.11 + 0.13 + 1050.60) * 1e6
FIXTURE_WRITE = (4.10 + 131.07 + 1536.00 + 4.12 + 131.07 + 1536.00) * 1e3

HEADER = '"ID","Process ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum"'


def tiny_point(**changes) -> Point:
    """A contiguous point on `tiny`, resolved on the CPU (its backend: SDPA, so it runs on any device
    the test moves it to)."""
    point = planned_point("model=tiny", "strategy=contiguous", "strategy.backend=sdpa", "batch=2", "ctx=8",
                          "decode_tokens=2", "seed=3", "timing.warmup_min=1", "timing.warmup_max=2")
    return dataclasses.replace(point, **changes)


# ---------------------------------------------------------------- parser


def test_fixture_sums_reads_and_writes_in_bytes():
    traffic = parse_ncu_csv(FIXTURE.read_text())
    assert traffic.kernels == 6
    assert traffic.read_bytes == pytest.approx(FIXTURE_READ)
    assert traffic.write_bytes == pytest.approx(FIXTURE_WRITE)
    assert traffic.total_bytes == pytest.approx(FIXTURE_READ + FIXTURE_WRITE)


def test_preamble_and_trailing_output_are_skipped():
    text = "hello from the program\n==WARNING== something\n" + FIXTURE.read_text() + "==PROF== Report: done\n"
    assert parse_ncu_csv(text) == parse_ncu_csv(FIXTURE.read_text())


@pytest.mark.parametrize("unit, scale", [("byte", 1), ("Kbyte", 1e3), ("Mbyte", 1e6), ("Gbyte", 1e9)])
def test_units_convert_to_bytes(unit, scale):
    text = f'{HEADER}\n"","","","{unit}","byte"\n"0","1","k","1,500.25","7"\n"1","1","k","0.75","3"\n'
    traffic = parse_ncu_csv(text)
    assert traffic.read_bytes == pytest.approx(1501.0 * scale)
    assert traffic.write_bytes == 10 and traffic.kernels == 2


def test_base_units_as_print_units_base_prints_them():
    text = f'{HEADER}\n"","","","byte","byte"\n"0","1","k","1,048,576","65,536"\n'
    assert parse_ncu_csv(text).total_bytes == 1_048_576 + 65_536


@pytest.mark.parametrize(
    "text, message",
    [
        ("==PROF== Connected\n==ERROR== ERR_NVGPUCTRPERM - no permission\n", "no CSV header"),
        ('"ID","Kernel Name","gpu__time_duration.sum"\n"","","nsecond"\n"0","k","5"\n', "no column dram__bytes_read"),
        (f'{HEADER}\n"","","","byte","byte"\n', "profiled no kernels"),
        (f'{HEADER}\n"0","1","k","5","5"\n', "no units row"),
        (f'{HEADER}\n"","","","parsec","byte"\n"0","1","k","5","5"\n', "unexpected unit 'parsec'"),
        (f'{HEADER}\n"","","","","byte"\n"0","1","k","5","5"\n', "unexpected unit ''"),
        (f'{HEADER}\n"","","","byte","byte"\n"0","1","gemm","n/a","5"\n', "kernel 'gemm' is 'n/a'"),
        (f'{HEADER}\n"","","","byte","byte"\n"0","1","k","5"\n', "4 fields, the header 5"),
    ],
)
def test_malformed_output_raises_a_clear_error(text, message):
    with pytest.raises(NcuParseError, match=message):
        parse_ncu_csv(text)


# ---------------------------------------------------------------- command and availability


def test_command_filters_the_decode_range_and_reads_dram_without_flushing():
    command = ncu_command(["python", "-m", "harness.measure.ncu_target", "{}"], ncu="/opt/ncu")
    assert command[0] == "/opt/ncu" and command[-4:] == ["python", "-m", "harness.measure.ncu_target", "{}"]
    flags = command[1:-4]
    pairs = {flags[i]: flags[i + 1] for i in range(len(flags) - 1)}
    assert "--nvtx" in flags and pairs["--nvtx-include"] == "decode/"
    assert pairs["--metrics"] == "dram__bytes_read.sum,dram__bytes_write.sum"
    assert "--csv" in flags and pairs["--page"] == "raw"
    assert pairs["--cache-control"] == "none" and pairs["--clock-control"] == "none"


# ---------------------------------------------------------------- measure_traffic with a fake ncu


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch) -> Path:
    """An `ncu` on PATH that records its arguments and prints the fixture instead of profiling."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "ncu"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, pathlib, sys\n"
        f"pathlib.Path({str(tmp_path / 'argv.json')!r}).write_text(json.dumps(sys.argv[1:]))\n"
        f"sys.stdout.write(pathlib.Path({str(FIXTURE)!r}).read_text())\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("HARNESS_NCU", raising=False)
    return script


def test_measure_traffic_parses_the_fake_ncus_output_end_to_end(fake_ncu, tmp_path):
    point = tiny_point(device="cuda", dtype="bfloat16", traffic="ncu")
    measured = measure_traffic(point)
    assert measured == {
        "bytes_per_step_measured": pytest.approx((FIXTURE_READ + FIXTURE_WRITE) / point.decode_tokens),
        "traffic_source": "ncu",
        "ncu_kernels": 6,
    }
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--nvtx-include") + 1] == "decode/"
    program = argv[argv.index("harness.measure.ncu_target") - 2:]  # python -m harness.measure.ncu_target <json>
    assert program[0] == sys.executable and point_from_record(json.loads(program[3])) == point


def test_measure_traffic_reports_ncus_failure(tmp_path):
    failing = tmp_path / "ncu"
    failing.write_text("#!/bin/sh\necho '==ERROR== ERR_NVGPUCTRPERM - The user does not have permission' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with code 1(.|\n)*ERR_NVGPUCTRPERM"):
        measure_traffic(tiny_point(device="cuda"), ncu=str(failing))


def test_measure_traffic_reports_an_empty_profile(tmp_path):
    silent = tmp_path / "ncu"
    silent.write_text(
        "#!/bin/sh\necho '==PROF== Disconnected from process 1'\necho '==WARNING== No kernels were profiled.' >&2\n"
    )
    silent.chmod(0o755)
    with pytest.raises(RuntimeError, match="no CSV header(.|\n)*No kernels were profiled"):
        measure_traffic(tiny_point(device="cuda"), ncu=str(silent))


def test_measure_traffic_refuses_a_cpu_point(fake_ncu):
    with pytest.raises(ValueError, match="GPU counters"):
        measure_traffic(tiny_point())


# ---------------------------------------------------------------- the profiled program


def test_point_survives_the_json_round_trip():
    point = tiny_point(timing=TimingConfig(cold_cache=True), prefill="random", device="cuda")
    again = point_from_record(json.loads(json.dumps(point.record())))
    assert again == point and again.key == point.key


@pytest.mark.parametrize("prefill", ["compute", "random"])
def test_target_generates_the_tokens_measure_point_timed(prefill):
    from harness.measure.group import measure_point

    point = tiny_point(prefill=prefill)
    assert run_decode_steps(point).tolist() == measure_point(point)["tokens"]


def test_target_main_reads_the_json_argument_and_prints_nothing(capsys):
    from harness.measure.ncu_target import main

    assert main([json.dumps(tiny_point().record())]) == 0
    assert capsys.readouterr().out == ""  # ncu's CSV shares this stdout
    assert main([]) == 2
