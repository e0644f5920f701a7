"""The kernels' build cache: a folder per build key, each build stamped once it is complete, checked
before it is loaded, and built by one process at a time.

Loading a library maps it into the process: a truncated file kills the process with SIGBUS when a
missing page is touched, corrupted code with SIGILL, neither with a line saying why. So a build is
trusted only through its stamp (STAMP, written last, after the library is on disk): the build key, and
the library's size and sha256. `problem` reads the stamp and the library's checksum before anything
is loaded; a folder without a stamp (a build killed first, or made by a harness that wrote no stamp), with a
stamp for another key, or whose library does not match its stamp, is never loaded: the caller builds
it again and says so in one line.

A build runs in a folder of its own (`.<name>.tmp-<pid>`), is stamped there and renamed into place, so
no process ever sees half of one. One process builds a key at a time: it holds an exclusive flock on
`.<name>.lock` beside the build (`building`), which the kernel releases when the process ends, so a
lock left behind by a killed build is never stale; another process waits for the lock (at most
BUILD_WAIT_S), then finds the build complete and loads it. Under the lock, what a killed build left
(its temporary folder) and a damaged build are removed.

Every other state of the cache folder answers in one line (a RuntimeError the caller reports): a path
that is a file, a folder this process cannot write to (a complete build in it still loads: loading
writes nothing), a build another process has held the lock on for longer than BUILD_WAIT_S.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from harness.files import exclusive, write_whole

log = logging.getLogger("harness")

STAMP = "build.json"  # written into a build folder once its library is complete
BUILD_WAIT_S = 600.0  # longest wait for another process's build of the same key (one takes 10-60 s)


def checksum(path: Path) -> str:
    """The sha256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def problem(folder: Path, library: str, key: str) -> str | None:
    """Why the build in `folder` must not be loaded (in words, for a line), or None when its stamp says
    it is complete and its library matches it."""
    if not folder.is_dir():
        return "missing"
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except FileNotFoundError:
        return "unstamped (a build that did not finish, or one made by a harness that wrote no stamp)"
    except (OSError, ValueError) as error:
        return f"stamped unreadably ({error})"
    if not isinstance(stamp, dict) or stamp.get("key") != key:
        return f"stamped for another build key ({stamp.get('key') if isinstance(stamp, dict) else stamp!r}, not {key})"
    path = folder / library
    try:
        size = path.stat().st_size
        if size != stamp.get("bytes"):
            return f"damaged: its library has {size} bytes, its stamp says {stamp.get('bytes')}"
        if checksum(path) != stamp.get("sha256"):
            return "damaged: its library's checksum does not match its stamp"
    except OSError as error:
        return f"damaged: its library cannot be read ({error.strerror or error})"
    return None


def write_stamp(folder: Path, library: str, key: str, compiler: str) -> None:
    """Stamp a complete build: the library flushed to disk first, then the stamp written whole."""
    path = folder / library
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    stamp = {"key": key, "library": library, "bytes": path.stat().st_size, "sha256": checksum(path),
             "compiler": compiler, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_whole(folder / STAMP, json.dumps(stamp))


def usable_folder(folder: Path) -> None:
    """Create the cache folder where missing; RuntimeError in one line where it cannot be one."""
    if folder.exists() and not folder.is_dir():
        raise RuntimeError(f"the kernel cache {folder} is a file, not a folder: move it, or set "
                           "HARNESS_KERNEL_CACHE to a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RuntimeError(f"the kernel cache {folder} cannot be created ({error.strerror or error}): set "
                           "HARNESS_KERNEL_CACHE to a writable folder") from None


@contextmanager
def building(folder: Path, name: str, wait_s: float | None = None):
    """Hold the exclusive right to build `folder / name` (the flock on `.<name>.lock`), waiting for another
    process that has it at most `wait_s` (default BUILD_WAIT_S); inside, what an earlier build of the
    name left behind is removed. RuntimeError in one line where the folder cannot be written or the
    wait runs out."""
    usable_folder(folder)
    lock = folder / f".{name}.lock"
    held = exclusive(lock, "building the kernels", BUILD_WAIT_S if wait_s is None else wait_s)
    try:
        held.__enter__()  # harness.files' one waiting rule
    except OSError as error:
        raise RuntimeError(f"cannot build the kernels in {folder} ({error.strerror or error}): set "
                           "HARNESS_KERNEL_CACHE to a writable folder") from None
    try:
        for leftover in folder.glob(f".{name}.*-*"):  # a killed build's folder, a damaged build set aside
            shutil.rmtree(leftover, ignore_errors=True)
        yield
    finally:
        held.__exit__(None, None, None)  # releases the flock


def set_aside(folder: Path) -> None:
    """Move a damaged build out of its name (removed under the next build lock if not now)."""
    aside = folder.with_name(f".{folder.name}.damaged-{os.getpid()}")
    os.rename(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)
