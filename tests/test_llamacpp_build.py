"""llama.cpp built for this machine (strategies/engines/artifacts/llamacpp_build.py): the cache and checksum
logic on a stub build (no compiler runs: CI never builds llama.cpp), the pinned source's checksum, and,
where this machine has a build (made by `python -m strategies.engines.artifacts.llamacpp_build`, minutes),
the llama.cpp member running it beside the exact cache with rows that say so (device=cpu)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest

from harness.files import exclusive, lock_of
from harness.kernels import cache
from strategies.engines.artifacts import llamacpp_build, llamacpp_library
from strategies.engines.artifacts.llamacpp_build import BuildError
from strategies.engines.engine import BUILT_HERE, WHEEL


@pytest.fixture
def stub_build(tmp_path, monkeypatch):
    """build() with every slow step replaced: the source is an empty folder, cmake records its commands
    instead of running, and the module is a few bytes; returns the commands run."""
    monkeypatch.setenv("HARNESS_KERNEL_CACHE", str(tmp_path / "cache"))
    commands = []
    monkeypatch.setattr(llamacpp_build, "_download", lambda folder: folder / "stub.tar.gz")
    monkeypatch.setattr(llamacpp_build, "_unpack", lambda sdist, folder: folder)
    monkeypatch.setattr(llamacpp_build, "_run", lambda command, step: commands.append(command))
    monkeypatch.setattr(llamacpp_build, "_link_module",
                        lambda source, objects, work, library: library.write_bytes(b"\x7fELF stub module" * 64))
    return commands


def test_a_build_is_published_stamped_and_found_only_while_it_matches_its_stamp(stub_build):
    assert llamacpp_build.built() is None
    folder = llamacpp_build.build()
    assert llamacpp_build.built() == folder and folder.name == f"llamacpp-native-{llamacpp_build.build_key()}"
    configure, compile_ = stub_build
    assert "-DGGML_NATIVE=ON" in configure and compile_[-2:] == ["-j", str(os.cpu_count())]
    assert sorted(path.name for path in folder.iterdir()) == sorted([llamacpp_build.LIBRARY, llamacpp_build.INFO, cache.STAMP])
    info = llamacpp_build.build_info(folder)
    assert info["version"] == llamacpp_build.VERSION and "-DGGML_NATIVE=ON" in info["cmake_flags"]
    assert sorted(path.name for path in folder.parent.iterdir()) == [f".{folder.name}.lock", folder.name]  # nothing half-made

    llamacpp_build.build()
    assert len(stub_build) == 2  # complete: not built again
    library = folder / llamacpp_build.LIBRARY
    library.write_bytes(library.read_bytes()[:-1] + b"!")  # same size, other bytes
    assert llamacpp_build.built() is None  # never loaded: its checksum does not match its stamp
    assert llamacpp_build.build() == folder and len(stub_build) == 4 and llamacpp_build.built() == folder
    os.truncate(library, 10)
    assert llamacpp_build.built() is None


def test_a_build_key_is_this_machines(monkeypatch):
    """Another compiler, another CPU's flags or another Python make another key (another folder)."""
    key = llamacpp_build.build_key()
    monkeypatch.setattr(llamacpp_build, "_cpu_identity", lambda: "model name : another CPU\nflags : sse2")
    assert llamacpp_build.build_key() != key


def test_a_source_other_than_the_pinned_sdist_is_refused_by_its_checksum(tmp_path):
    sdist = tmp_path / llamacpp_build.SDIST_FILE
    sdist.write_bytes(b"not llama.cpp")
    with pytest.raises(BuildError, match=f"has sha256 [0-9a-f]{{64}}, not {llamacpp_build.SDIST}'s {llamacpp_build.SDIST_SHA256}"):
        llamacpp_build._unpack(sdist, tmp_path / "source")
    assert not (tmp_path / "source").exists()
    with pytest.raises(BuildError, match="--sdist: .* is not a file"):
        llamacpp_build._unpack(tmp_path / "missing.tar.gz", tmp_path / "source")


def test_a_failed_step_is_one_line_and_leaves_no_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HARNESS_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(llamacpp_build, "_unpack", lambda sdist, folder: folder)
    monkeypatch.setenv("PATH", str(tmp_path))  # no cmake, no compiler
    assert llamacpp_build.main(["--sdist", str(tmp_path / "any.tar.gz")]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("cmake's configure step: cmake cannot be run") and err.count("\n") == 1, err
    assert [path.name for path in (tmp_path / "cache").iterdir() if not path.name.startswith(".")] == []
    assert llamacpp_build.main(["--jobs", "0"]) == 2


def test_a_wrong_build_choice_is_the_members_skipped_reason(monkeypatch):
    monkeypatch.setenv(llamacpp_library.BUILD_ENV, "native")
    llamacpp_library.load.cache_clear()
    try:
        with pytest.raises(llamacpp_library.LibraryProblem, match="HARNESS_LLAMACPP_BUILD='native': allowed: auto, wheel, background"):
            llamacpp_library.load()
    finally:
        llamacpp_library.load.cache_clear()


def test_a_background_build_is_started_once_at_the_lowest_priority(tmp_path, monkeypatch):
    """HARNESS_LLAMACPP_BUILD=background: the build command in a session of its own, its lines in a log
    beside the builds; none started while another process holds the build's lock (no compiler runs)."""
    monkeypatch.setenv("HARNESS_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(llamacpp_build, "build_key", lambda: "0123456789abcdef")  # runs no compiler
    started = []
    monkeypatch.setattr(llamacpp_build.subprocess, "Popen", lambda command, **how: started.append((command, how)))
    folder = llamacpp_build.build_folder()
    with exclusive(lock_of(folder), "building llama.cpp for this machine"):
        assert llamacpp_build.start_in_background() is None and started == []
    log = llamacpp_build.start_in_background()
    assert log == folder.with_name(f".{folder.name}.log") and log.exists()
    [(command, how)] = started
    assert command[1:] == ["-m", "strategies.engines.artifacts.llamacpp_build", "--jobs", "1"]
    assert how["start_new_session"] and how["preexec_fn"].args == (19,)


needs_build = pytest.mark.skipif(llamacpp_build.built() is None or importlib.util.find_spec("llama_cpp_py_sync") is None,
                                 reason="llama.cpp is not built for this machine (python -m strategies.engines.artifacts."
                                        "llamacpp_build: minutes; CI does not build it) or its wheel is not installed")


@pytest.fixture(params=["auto", "wheel"])
def build_choice(request, monkeypatch):
    monkeypatch.setenv(llamacpp_library.BUILD_ENV, request.param)
    llamacpp_library.load.cache_clear()
    yield request.param
    llamacpp_library.load.cache_clear()


@needs_build
def test_the_member_prefers_this_machines_build_and_its_rows_say_which_ran(build_choice, tmp_path_factory):
    from harness.measure.group import GroupRequest, measure_group
    from tests.conftest import planned_point
    from tests.gguf_files import CONFIG, Q, byte_level_vocab, random_weights, write_gguf

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(CONFIG, "num_attention_heads", 2)
        patch.setitem(CONFIG, "num_key_value_heads", 1)
        path = write_gguf(tmp_path_factory.mktemp("native") / "tiny-heads32.gguf",
                          random_weights(len(byte_level_vocab()[0])), kind=Q.Q8_0)
    points = tuple(dataclasses.replace(planned_point("model=tiny", f"model.checkpoint={path}", f"strategy={name}", "ctx=12",
                                                     "decode_tokens=4", "batch=2", "accuracy.tokens=16", "accuracy.steps=4"),
                                       interleave="shape") for name in ("contiguous", "llamacpp_f16", "llamacpp_q8_0"))
    _, full, quantized = measure_group(GroupRequest("native", points))
    for row in (full, quantized):
        assert row["status"] == "ok", row["reason"]
    assert full["agreement_logit_rel"] <= full["agreement_logit_rel_bound"]
    if build_choice == "auto":
        assert full["engine_build"] == BUILT_HERE and "GGML_NATIVE=ON" in full["engine_build_flags"]
        assert full["engine_version"] == llamacpp_build.VERSION
        cpu = open("/proc/cpuinfo").read()
        assert ("AVX512" in full["engine_isa"]) == (" avx512f" in cpu), full["engine_isa"]
    else:
        assert full["engine_build"] == WHEEL and full["engine_version"].startswith("b")
    assert json.dumps(full["engine_build_flags"])  # a string either way
