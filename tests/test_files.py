"""harness.files: the one atomic write and the one lock every writer of the harness uses."""
from __future__ import annotations

import errno
import logging
import os
import threading

import pytest

import harness.files
from harness.files import exclusive, write_whole


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
