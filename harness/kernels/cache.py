"""The kernels' build cache: a folder per build key, each build stamped once it is complete, checked
before it is loaded, and built by one process at a time.

Loading a library maps it into the process: a truncated file kills the process with SIGBUS when a
missing page is touched, corrupted code with SIGILL, neither with a line saying why. So a build is
trusted only through its stamp (STAMP, written last, after the library is on disk): the build key, and
the library's size and sha256. `problem` reads the stamp and the library's checksum before anything
is loaded; a folder without a stamp (a build killed first, or made by a harness that wrote no stamp), with a
stamp for another key, or whose library does not match its stamp, is never loaded: the caller builds
it again and says so in one line.

A build is published as every artifact of the harness is (harness.files.publish, through
`publish_build`): it runs in a folder of its own (`.<name>.tmp-<pid>-<random>`), is stamped there and
renamed into place, so no process ever sees half of one. One process builds a key at a time: it holds
an exclusive flock on `.<name>.lock` beside the build, which the kernel releases when the process ends,
so a lock left behind by a killed build is never stale; another process waits for the lock (at most
BUILD_WAIT_S), then finds the build complete and loads it. Under the lock, what a killed build left
(its temporary folder) and a damaged build are removed.

Every other state of the cache folder answers in one line (a RuntimeError the caller reports): a path
that is a file, a folder this process cannot write to (a complete build in it still loads: loading
writes nothing), a build another process has held the lock on for longer than BUILD_WAIT_S. The first
such answer of a process is also logged once (`unusable`): where a point asked for `auto`, torch's
kernels then run in the C kernels' place, and the row's kernel columns alone would not say why.

Trust: the stamp proves a build whole, not whose it is. Anyone who can write the cache folder can plant
a library and a stamp that matches it, and every later run would execute it. So a cache folder owned by
another user (root aside), or writable by others (group or world, sticky or not) on a writable file
system, is not used at all (`trusted_folder`): one line says so, and the kernels are built in a private
folder of this user's instead (PRIVATE_NAME under the temporary folder, mode 0700, itself checked the same
way; failing that a fresh one).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from harness.files import publish, write_whole

log = logging.getLogger("harness")

STAMP = "build.json"  # written into a build folder once its library is complete
BUILD_WAIT_S = 600.0  # longest wait for another process's build of the same key (one takes 10-60 s)
PRIVATE_NAME = "decode-harness-kernels-{uid}"  # the private cache under the temporary folder when the named one is not trusted
_told: list[str] = []  # the unusable-cache line this process has logged (once)


def untrusted(path: Path) -> str | None:
    """Why what `path` holds could be another user's (in words, for a line), or None: it is owned by this
    user or root, and no one else can write to it (or its file system is read-only)."""
    try:
        status = path.stat()
    except FileNotFoundError:
        return None  # made by this process when needed
    if status.st_uid not in (os.geteuid(), 0):
        return f"owned by another user (uid {status.st_uid})"
    if status.st_mode & 0o022 and not os.statvfs(path).f_flag & os.ST_RDONLY:
        return f"writable by other users (mode {status.st_mode & 0o7777:o})"
    return None


@functools.cache
def trusted_folder(folder: Path) -> Path:
    """`folder` where no other user can have put a build in it (`untrusted`); else, said once in one line,
    a private folder of this user's to build in."""
    reason = untrusted(folder)
    if reason is None:
        return folder
    private = Path(tempfile.gettempdir()) / PRIVATE_NAME.format(uid=os.geteuid())
    try:
        private.mkdir(mode=0o700, exist_ok=True)
        if untrusted(private) is not None or not private.is_dir():
            raise OSError("not private")
    except OSError:
        private = Path(tempfile.mkdtemp(prefix="decode-harness-kernels-"))
    log.warning(f"the kernel cache {folder} is {reason}: a library there could be anyone's, so none is loaded "
                f"from it; building the kernels in the private folder {private} instead (set HARNESS_KERNEL_CACHE "
                "to a folder only you can write)")
    return private


def unusable(message: str) -> RuntimeError:
    """The RuntimeError of a cache that cannot be used, its line also logged the first time in a process:
    a point asking for `auto` then runs torch's kernels, and says only which ran."""
    if not _told:
        _told.append(message)
        log.warning(f"{message}; the C kernels are unavailable: `auto` runs torch's kernels instead")
    return RuntimeError(message)


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
        raise unusable(f"the kernel cache {folder} is a file, not a folder: move it, or set "
                       "HARNESS_KERNEL_CACHE to a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise unusable(f"the kernel cache {folder} cannot be created ({error.strerror or error}): set "
                       "HARNESS_KERNEL_CACHE to a writable folder") from None


def publish_build(target: Path, library: str, key: str, build: Callable[[Path], None], wait_s: float | None = None) -> bool:
    """`build(folder)` makes and stamps the build of `key` in a folder of its own, published at `target`
    (harness.files.publish) unless a complete one is there; a damaged one found there is said in one line
    and replaced. Waits for another process building it at most `wait_s` (default BUILD_WAIT_S). True
    when this process built it. RuntimeError in one line where the folder cannot be written or the wait
    runs out."""
    usable_folder(target.parent)
    found = problem(target, library, key)
    if found not in (None, "missing"):
        log.warning(f"the cached kernel build {target} is {found}: building it again")
    try:
        return publish(target, build, "building the kernels", complete=lambda path: problem(path, library, key) is None,
                       folder=True, wait_s=BUILD_WAIT_S if wait_s is None else wait_s)
    except OSError as error:
        raise unusable(f"cannot build the kernels in {target.parent} ({error.strerror or error}): set "
                       "HARNESS_KERNEL_CACHE to a writable folder") from None
