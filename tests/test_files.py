"""harness.files: the one atomic write, the one lock and the one publisher every writer and builder of the harness uses."""
from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import sys
import threading

import pytest

import harness.files
from harness.files import exclusive, owned_temporary, publish, write_whole
from tests.conftest import REPO_ROOT


def test_a_write_is_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    write_whole(path, "old")
    write_whole(path, lambda handle: handle.write(b"new"))
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["record.json"]

    def full_disk(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(harness.files.os, "fsync", full_disk)
    with pytest.raises(OSError):
        write_whole(path, b"newer")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["record.json"]  # no temporary


def test_one_lock_one_waiting_rule(tmp_path, caplog):
    """A second holder waits, says once who holds the lock and what it does, and gives up in one line."""
    lock, entered, release = tmp_path / ".x.lock", threading.Event(), threading.Event()

    def holder():
        with exclusive(lock, "calibrating cpu/float32"):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    entered.wait(10)
    try:
        with caplog.at_level(logging.INFO, logger="harness"), pytest.raises(RuntimeError) as error:
            with exclusive(lock, "calibrating cpu/float32", wait_s=0.5):
                pass
    finally:
        release.set()
        thread.join()
    assert str(error.value) == (f"another process (pid {os.getpid()}) has been calibrating cpu/float32 for over 0 s "
                                f"(it holds {lock})")
    assert caplog.text.count("is calibrating cpu/float32") == 1
    with exclusive(lock, "calibrating cpu/float32", wait_s=0.5):  # free again once its holder is done
        assert lock.read_text() == str(os.getpid())


# A builder that takes its time over several files, so two processes started together overlap: each
# prints whether it built the folder (argv: the folder, the seconds a file takes).
BUILD = """
import sys, time
from pathlib import Path
from harness.files import publish

def build(folder):
    for index in range(4):
        (folder / f"part{index}").write_text(str(index) * 1000)
        time.sleep(float(sys.argv[2]))

print(publish(Path(sys.argv[1]), build, "building the test artifact", folder=True))
"""


def run_builders(target, count: int, seconds: float) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    builders = [subprocess.Popen([sys.executable, "-c", BUILD, str(target), str(seconds)], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(count)]
    said = [builder.communicate(timeout=120) for builder in builders]
    assert all(builder.returncode == 0 for builder in builders), said
    return [out.strip() for out, _ in said]


def whole(folder) -> bool:
    return sorted(path.name for path in folder.iterdir()) == [f"part{i}" for i in range(4)] and \
        all((folder / f"part{i}").read_text() == str(i) * 1000 for i in range(4))


def test_two_processes_publishing_one_artifact_both_end_with_a_whole_one(tmp_path):
    """One builds while the other waits for the lock, then finds it whole: neither deletes the other's work."""
    target = tmp_path / "artifact"
    assert sorted(run_builders(target, 2, 0.3)) == ["False", "True"]
    assert whole(target)
    assert sorted(path.name for path in tmp_path.iterdir()) == [".artifact.lock", "artifact"]  # no temporary left
    assert run_builders(target, 1, 0.0) == ["False"]  # complete: nothing built again


def test_a_killed_builders_leftovers_and_an_incomplete_artifact_are_replaced(tmp_path):
    target = tmp_path / "artifact"
    (tmp_path / ".artifact.tmp-999999-0badf00d").mkdir()  # a builder killed half way: its pid and suffix
    (tmp_path / ".artifact.tmp-999999-0badf00d" / "part0").write_text("half")
    target.mkdir()  # a folder without what marks it complete (e.g. written by an older harness)
    (target / "stale").write_text("old")
    assert publish(target, lambda folder: (folder / "marker").write_text("done"), "building",
                   complete=lambda path: (path / "marker").exists(), folder=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == [".artifact.lock", "artifact"]
    assert [path.name for path in target.iterdir()] == ["marker"]


def test_a_failed_build_leaves_nothing_and_says_why(tmp_path):
    def fails(path):
        path.write_text("half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        publish(tmp_path / "copy.gguf", fails, "writing a copy")
    assert [path.name for path in tmp_path.iterdir()] == [".copy.gguf.lock"]
    assert publish(tmp_path / "copy.gguf", lambda path: path.write_text("whole"), "writing a copy")
    assert (tmp_path / "copy.gguf").read_text() == "whole"


def test_each_temporary_is_owned_by_one_process_and_one_call(tmp_path):
    names = {owned_temporary(tmp_path / "x").name for _ in range(50)}
    assert len(names) == 50 and all(name.startswith(f".x.tmp-{os.getpid()}-") for name in names)


def test_every_builder_publishes_through_harness_files():
    """One publisher: no module of the harness or the strategies renames a built file into place itself."""
    renames = re.compile(r"os\.replace\(|os\.rename\(|\.rename\(|shutil\.move\(")
    found = [f"{path.relative_to(REPO_ROOT)}:{number}" for root in ("harness", "strategies")
             for path in sorted((REPO_ROOT / root).rglob("*.py")) if path.parent.name != "files"
             for number, line in enumerate(path.read_text().splitlines(), 1) if renames.search(line)]
    assert found == [], found
