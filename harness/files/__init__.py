"""The bottom layer: how every writer of the harness puts a file on disk, and how processes take turns.

`write_whole(path, data)`: the bytes go to a hidden temporary beside `path` (`.<name>.tmp-<pid>`),
are flushed to disk (fsync), and the temporary is renamed over `path` (os.replace, atomic within one
filesystem). A reader, or a process killed at any moment, sees the old file or the new one, never
half of one; the temporary is removed whatever happens, and one left by a killed process starts with
'.', which pyarrow's discovery and the harness's globs skip. Rows (harness.store.files), calibration
records (harness.store.calibration), the kernels' stamps (harness.kernels.cache) and the report's
files (harness.report.assemble, its plots included) are all written by it; `write_through` is the same
step for a library that opens its own file.

`exclusive(lock, doing)`: one lock with one waiting rule, for every place two processes must not do
the same thing at once (calibrating one device, building one kernel library): an flock on `lock`
(released by the kernel when its holder dies, so a lock is never stale), the holder's pid written in
it; a process that finds it held says once who holds it and what it is doing, tries again every
POLL_S, and gives up after `wait_s` with a one-line RuntimeError.

`publish(path, build, doing)`: how every file or folder the harness builds or converts gets its name
(the kernel builds, the engines' libraries, weight copies and converted models, the bench baseline).
Unless `complete(path)` already holds, it takes the lock `.<name>.lock` beside `path` (`exclusive`),
looks again (another process may have built it meanwhile), removes what a killed builder left, has
`build` make the artifact under a temporary name of its own (`.<name>.tmp-<pid>-<random>`: no other
process ever writes or deletes it) and renames it into place (a folder left incomplete at `path` is
moved aside first). Two processes asking at once: one builds, the other waits and finds it whole.
A published name is written by `publish` alone.

It imports nothing of the harness: every other layer may use it (pyproject.toml, [tool.importlinter]).
"""
from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

log = logging.getLogger("harness")

WAIT_S = 600.0  # longest wait for another process's turn (a kernel build takes 10-60 s, a calibration up to its budget)
POLL_S = 0.2  # how often a waiting process tries the lock again


def temporary_of(path: Path) -> Path:
    """The hidden temporary `write_whole` writes `path` through (by this process)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_whole(path: str | Path, data: bytes | str | Callable) -> Path:
    """Write `data` (bytes, text, or a function given the open binary file) to `path` atomically:
    temporary, fsync, rename. OSError (a full disk, an unwritable folder) leaves no temporary behind."""
    def write(temporary: Path) -> None:
        with open(temporary, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())

    return write_through(path, write)


def write_through(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(temporary)` makes the file at a hidden temporary beside `path` (a library that opens its own
    file: a GGUF writer), which then replaces `path` atomically; the temporary is removed whatever happens."""
    path = Path(path)
    temporary = temporary_of(path)
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


@contextmanager
def exclusive(lock: str | Path, doing: str, wait_s: float = WAIT_S):
    """Hold the flock on `lock` (created if missing) while inside; `doing` says what its holder does, in
    the lines a waiting process logs ("another process (pid N) is <doing>") and raises."""
    lock = Path(lock)
    lock.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(descriptor, lock, doing, wait_s)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the flock


def _acquire(descriptor: int, lock: Path, doing: str, wait_s: float) -> None:
    deadline, told = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
            if time.monotonic() >= deadline:
                raise RuntimeError(f"another process (pid {holder}) has been {doing} for over {wait_s:.0f} s "
                                   f"(it holds {lock})") from None
            if not told:
                log.info(f"another process (pid {holder}) is {doing} ({lock}): waiting for it")
                told = True
            time.sleep(POLL_S)


def lock_of(path: Path) -> Path:
    """The lock `publish` holds while it builds `path`: `.<name>.lock` beside it."""
    return path.with_name(f".{path.name}.lock")


def owned_temporary(path: Path) -> Path:
    """A hidden name beside `path` that this process alone writes: its pid and a random suffix."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def publish(path: str | Path, build: Callable[[Path], None], doing: str, complete: Callable[[Path], bool] | None = None,
            folder: bool = False, wait_s: float = WAIT_S) -> bool:
    """Build `path` once (module docstring): `build(temporary)` makes the file (or, with `folder`, fills
    the folder made for it) under an owned temporary name, renamed to `path` once it returns. `complete`
    (default: `path` exists) says whether a build at `path` can be used; a builder of something always
    made anew passes one that says no. `doing` names the work in a waiting process's lines. True when
    this process built it, False when it was complete already; the temporary is removed whatever
    happens, and an OSError of the lock or the build reaches the caller."""
    path = Path(path)
    done = complete or Path.exists
    if done(path):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(lock_of(path), doing, wait_s):
        if done(path):  # another process built it while this one waited
            return False
        for leftover in path.parent.glob(f".{path.name}.tmp-*"):  # a killed builder's: only the holder writes these
            _remove(leftover)
        temporary = owned_temporary(path)
        try:
            if folder:
                temporary.mkdir()
            build(temporary)
            _replace(temporary, path)
        finally:
            _remove(temporary)
    return True


def _replace(temporary: Path, path: Path) -> None:
    """Rename `temporary` to `path`; a folder (or a file in a folder's place) at `path`, which the caller
    found incomplete, is moved aside first and removed."""
    if path.is_dir() or (temporary.is_dir() and path.exists()):
        aside = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}-old")
        os.rename(path, aside)
        _remove(aside)
    os.replace(temporary, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
