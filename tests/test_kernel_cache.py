"""The kernels' build cache (harness/kernels/cache.py) in every state its folder can be in: a complete
build loads; a damaged one (truncated, corrupted, unstamped, stamped for another key) is built again,
never loaded; a missing folder is made; a file in its place, a folder that cannot be written, a build
another process holds too long each answer in one line; a stale lock and a half-written build are
cleared; another process's build in progress is waited for. And a run of torch's kernels only never
opens the cache at all.

A library is loaded in a subprocess of its own (LOAD): a damaged one mapped by mistake would kill the
process that loads it (SIGBUS on a truncated page), and a process registers the operators once. The
subprocess's compiler is replaced by a copy of this machine's complete build, stamped as a build is,
so no test here compiles.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.kernels import cache, extension
from harness.store.calibration import save
from tests.conftest import REPO_ROOT
from tests.hardening_helpers import FAST, MOUNTABLE, cli, fake_calibration, seeded, tmpfs  # noqa: F401 (tmpfs: a fixture)

pytestmark = pytest.mark.skipif(extension.EXTENSION.unavailable() is not None,
                                reason=f"the kernels cannot be built here: {extension.EXTENSION.unavailable()}")

KEY = extension.build_key(extension.compiler())
NAME = f"{extension.NAMESPACE}-{KEY}"  # this machine's build folder's name

# Load the kernels from $HARNESS_KERNEL_CACHE; argv: the complete build to copy where a build is due
# ("-": none may be due), the longest wait for another process's build. Prints what unavailable()
# said and every path of the library mapped into the process.
LOAD = """
import json, os, shutil, sys
import torch
from harness.kernels import cache, extension
good, cache.BUILD_WAIT_S = sys.argv[1], float(sys.argv[2])

def copy_build(cxx, key, building):
    assert good != "-", "a build was due"
    shutil.copytree(good, building, dirs_exist_ok=True)
    (building / cache.STAMP).unlink()
    cache.write_stamp(building, extension.LIBRARY, key, cxx)
    torch.ops.load_library(str(building / extension.LIBRARY))

extension._build = copy_build
reason = extension.EXTENSION.unavailable()
mapped = {line.split(maxsplit=5)[-1].strip() for line in open("/proc/self/maps") if extension.LIBRARY in line}
print(json.dumps({"reason": reason, "mapped": sorted(mapped)}))
"""


@pytest.fixture(scope="module")
def good_build() -> Path:
    """This machine's complete, stamped build of the kernels."""
    folder = extension.cache_dir() / NAME
    assert cache.problem(folder, extension.LIBRARY, KEY) is None
    return folder


def load(folder: Path, good: Path | str = "-", wait_s: float = 30.0, popen: bool = False):
    """The kernels loaded in a subprocess from the cache `folder`: (its answer, its stderr lines)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), extension.CACHE_ENV: str(folder)}
    command = [sys.executable, "-c", LOAD, str(good), str(wait_s)]
    if popen:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return answer(subprocess.run(command, env=env, capture_output=True, text=True, timeout=120))


def answer(done) -> tuple[dict, list[str]]:
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr}"
    return json.loads(done.stdout.splitlines()[-1]), [line for line in done.stderr.splitlines() if line.strip()]


def planted(folder: Path, good: Path, name: str = NAME) -> Path:
    """A copy of the complete build under `folder / name`."""
    return Path(shutil.copytree(good, folder / name))


def damage(build: Path, how: str) -> None:
    library, stamp = build / extension.LIBRARY, build / cache.STAMP
    if how == "truncated":
        os.truncate(library, library.stat().st_size // 2)
    elif how == "corrupted":  # same size, a run of bytes in the middle of its code overwritten
        data = bytearray(library.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(64)
        library.write_bytes(bytes(data))
    elif how == "unstamped":
        stamp.unlink()
    elif how == "stamped for another key":  # e.g. a build for another CPU or compiler put here
        stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "key": "0123456789abcdef"}))
    elif how == "stamp unreadable":
        stamp.write_text("{half a stamp")


DAMAGES = ("truncated", "corrupted", "unstamped", "stamped for another key", "stamp unreadable")


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_build_is_found_before_anything_loads_it(good_build, tmp_path, how):
    build = planted(tmp_path, good_build)
    assert cache.problem(build, extension.LIBRARY, KEY) is None
    damage(build, how)
    reason = cache.problem(build, extension.LIBRARY, KEY)
    assert reason is not None and "\n" not in reason
    assert cache.problem(tmp_path / "absent", extension.LIBRARY, KEY) == "missing"


@pytest.mark.parametrize("how", ["truncated", pytest.param("corrupted", marks=pytest.mark.slow),
                                 pytest.param("stamped for another key", marks=pytest.mark.slow)])
def test_a_damaged_build_is_built_again_with_one_line_and_never_mapped(good_build, tmp_path, how):
    """The case that died by SIGBUS: the library is checked against its stamp, set aside and built
    again; the process maps only the new build."""
    damage(planted(tmp_path, good_build), how)
    said, lines = load(tmp_path, good_build)
    assert said == {"reason": None, "mapped": [str(tmp_path / NAME / extension.LIBRARY)]}
    assert len(lines) == 1 and "building it again" in lines[0] and str(tmp_path / NAME) in lines[0], lines
    assert sorted(path.name for path in tmp_path.iterdir()) == [f".{NAME}.lock", NAME]


def test_a_stale_lock_and_a_half_written_build_are_cleared(good_build, tmp_path):
    """A build killed half way leaves its temporary folder and a lock file nobody holds (a flock dies
    with its process): the next process builds at once and removes what was left."""
    (tmp_path / f".{NAME}.lock").write_text("999999")
    half = tmp_path / f".{NAME}.tmp-999999"
    half.mkdir()
    (half / extension.LIBRARY).write_bytes((good_build / extension.LIBRARY).read_bytes()[:4096])
    said, lines = load(tmp_path, good_build)
    assert said["reason"] is None and not lines
    assert not half.exists() and cache.problem(tmp_path / NAME, extension.LIBRARY, KEY) is None


@pytest.mark.slow
def test_a_missing_folder_is_made(good_build, tmp_path):
    folder = tmp_path / "not" / "yet"
    said, lines = load(folder, good_build)
    assert said == {"reason": None, "mapped": [str(folder / NAME / extension.LIBRARY)]} and not lines


@pytest.mark.slow
def test_a_build_for_another_cpu_or_compiler_stays_apart(good_build, tmp_path):
    """Another key (CPU, compiler, sources) is another folder: it is neither loaded nor touched."""
    other = planted(tmp_path, good_build, f"{extension.NAMESPACE}-fedcba9876543210")
    before = sorted((path.name, path.stat().st_mtime_ns) for path in other.iterdir())
    said, _ = load(tmp_path, good_build)
    assert said["mapped"] == [str(tmp_path / NAME / extension.LIBRARY)]
    assert sorted((path.name, path.stat().st_mtime_ns) for path in other.iterdir()) == before


def hold_lock(folder: Path):
    """The build lock of this key, held by this process (as a build in progress holds it)."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / f".{NAME}.lock", "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def test_another_process_building_is_waited_for_then_its_build_loaded(good_build, tmp_path):
    lock = hold_lock(tmp_path)
    waiting = load(tmp_path, "-", wait_s=60, popen=True)  # "-": it must not build
    time.sleep(3)  # it has met the lock
    built = tmp_path / f".{NAME}.tmp-{os.getpid()}"
    shutil.copytree(good_build, built)
    built.rename(tmp_path / NAME)
    lock.close()
    out, err = waiting.communicate(timeout=60)
    said, _ = answer(subprocess.CompletedProcess([], waiting.returncode, out, err))
    assert said == {"reason": None, "mapped": [str(tmp_path / NAME / extension.LIBRARY)]}


def test_a_build_held_too_long_answers_in_one_line(tmp_path):
    lock = hold_lock(tmp_path)
    try:
        said, _ = load(tmp_path, "-", wait_s=1)
    finally:
        lock.close()
    assert said["reason"] == (f"another process (pid {os.getpid()}) has been building the kernels for over 1 s "
                              f"(it holds {tmp_path / f'.{NAME}.lock'})")
    assert said["mapped"] == []


def test_a_file_where_the_folder_should_be_answers_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv(extension.CACHE_ENV, str(tmp_path / "cache"))
    reason = extension.Extension().unavailable()  # nothing is loaded: safe in this process
    assert reason == f"the kernel cache {tmp_path / 'cache'} is a file, not a folder: move it, or set " \
                     "HARNESS_KERNEL_CACHE to a folder"


@pytest.fixture
def read_only(tmp_path, tmpfs):  # noqa: F811 (the fixture imported above)
    """make(build=None): a folder this process cannot write to, holding a copy of `build` if given: a
    read-only tmpfs where this process may mount one, else a folder without write permission."""
    def make(build: Path | None = None) -> Path:
        if MOUNTABLE:
            folder = tmpfs(tmp_path / "ro", "size=8m")
        elif os.geteuid() != 0:
            folder = tmp_path / "ro"
            folder.mkdir()
        else:
            pytest.skip("root without mount: every folder is writable")
        if build is not None:
            planted(folder, build)
        if MOUNTABLE:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        else:
            folder.chmod(0o555)
        return folder
    return make


def test_a_read_only_folder_without_a_build_answers_in_one_line(read_only, monkeypatch):
    folder = read_only()
    monkeypatch.setenv(extension.CACHE_ENV, str(folder))
    reason = extension.Extension().unavailable()
    assert reason.startswith(f"cannot build the kernels in {folder} (") and "HARNESS_KERNEL_CACHE" in reason
    assert "\n" not in reason


@pytest.mark.slow
def test_a_read_only_folder_with_a_complete_build_loads_it(read_only, good_build):
    folder = read_only(good_build)
    said, lines = load(folder)
    assert said == {"reason": None, "mapped": [str(folder / NAME / extension.LIBRARY)]} and not lines


# Records every file a Python process opens or dlopens under $WATCHED into $OPENED (PYTHONPATH's first
# folder holds it as sitecustomize, which every process of the run imports at start-up).
WATCH = """
import os, sys
watched, opened = os.environ["WATCHED"], os.environ["OPENED"]

def record(event, args):
    if event in ("open", "ctypes.dlopen") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.startswith(watched):
            with open(opened, "a") as log:
                log.write(f"{event} {path}\\n")

sys.addaudithook(record)
"""


@pytest.mark.parametrize("strategy", [["strategy=contiguous", "strategy.backend=sdpa"],
                                      ["strategy=quantized", "strategy.backend=torch"]])
def test_a_run_of_torch_kernels_never_opens_the_kernel_cache(tmp_path, strategy):
    """The cache holds garbage where this machine's build would be; a run whose attention and linears
    are torch's (backend=sdpa or torch, matmul=aten) plans, measures and writes its row without opening
    a file of it."""
    garbage = tmp_path / "kernels" / NAME
    garbage.mkdir(parents=True)
    (garbage / extension.LIBRARY).write_bytes(os.urandom(4096))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(WATCH)
    opened = tmp_path / "opened.txt"
    result = cli(*FAST, *strategy, "matmul=aten", f"results_dir={seeded(tmp_path / 'results')}",
                 HARNESS_KERNEL_CACHE=str(tmp_path / "kernels"), WATCHED=str(tmp_path / "kernels"),
                 OPENED=str(opened), PYTHONPATH=f"{hook}{os.pathsep}{REPO_ROOT}")
    assert result.returncode == 0, result.stderr
    assert "1 ok" in result.stdout, result.stdout
    assert not opened.exists(), opened.read_text()


def test_the_roofs_take_the_c_linear_only_for_points_that_run_it(tmp_path):
    """A record calibrated by a run of torch's linears has no C linear rate: it serves such runs, and a
    run with matmul=c measures the roofs again rather than be judged against a roof below its kernel."""
    from harness.measure.roofs import gemv_kernels
    from harness.run import calibrate

    assert "c" not in gemv_kernels("cpu", "float32", c_linear=False)
    assert gemv_kernels("cpu", "float32", c_linear=True)[-1] == "c"
    requests = []

    def run(function, request):
        requests.append(request)
        return fake_calibration()

    save(tmp_path, dataclasses.replace(fake_calibration(), read_bandwidth_c_gemv_Bps=None))  # without the C linear's rate
    assert calibrate.ensure(tmp_path, "cpu", "float32", False, run, budget_s=1)[1] is False and not requests
    record, measured = calibrate.ensure(tmp_path, "cpu", "float32", False, run, budget_s=1, c_linear=True)
    assert measured and requests == [("cpu", "float32", 1.0, True)]
