"""Facts about the run that every row carries: when, where, with what code.

`git_commit` names the code state: HEAD, suffixed `+dirty.<digest>` when the checkout differs from
it, untracked files included. The digest hashes what differs (the diff against HEAD, and the name and
content of every untracked source file that git does not ignore), so two runs of the same dirty tree
write the same value and a re-run can tell whether a row was made by this code (`same_code`). Data
files (rows, logs, Hydra's saved configs under `_hydra/`) are not code and do not count.
"""
from __future__ import annotations

import functools
import hashlib
import socket
import subprocess
from importlib import metadata
from pathlib import Path, PurePosixPath

REPO_ROOT = Path(__file__).resolve().parents[2]
DIRTY = "+dirty"  # suffix of a checkout with changes; followed by '.<digest>' of the changes
# Untracked files that are code: what a strategy, the harness or its configs are made of.
CODE_SUFFIXES = (".py", ".c", ".h", ".cc", ".cpp", ".cu", ".yaml", ".yml", ".toml", ".cfg", ".ini")
DATA_FOLDERS = ("_hydra", "_calibration", "_report", "__pycache__")  # written by runs, never code


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, check=True).stdout


def _is_code(relative: str) -> bool:
    path = PurePosixPath(relative)
    return path.suffix in CODE_SUFFIXES and not any(part in DATA_FOLDERS for part in path.parts)


@functools.cache
def git_commit() -> str | None:
    """HEAD of the harness checkout, suffixed +dirty.<digest> when it had changes (tracked or untracked
    code); None outside git."""
    try:
        head = _git("rev-parse", "HEAD").decode().strip()
        diff = _git("diff", "HEAD", "--binary", "--no-color", "--no-ext-diff")
        untracked = sorted(name for name in _git("ls-files", "--others", "--exclude-standard", "-z").decode().split("\0")
                           if name and _is_code(name))
    except (OSError, subprocess.CalledProcessError):
        return None
    if not diff and not untracked:
        return head
    digest = hashlib.sha256(diff)
    for name in untracked:
        digest.update(b"\0" + name.encode() + b"\0")
        try:
            digest.update((REPO_ROOT / name).read_bytes())
        except OSError:  # removed meanwhile: its name still counts
            pass
    return f"{head}{DIRTY}.{digest.hexdigest()[:12]}"


def same_code(row_commit: str | None, current: str | None) -> bool:
    """Whether a row's git_commit names the code running now. A bare `+dirty` (no digest of the
    changes) names no code state, so it is never the same; outside git (None) nothing can be
    told apart, so None matches None."""
    if row_commit is None or current is None:
        return row_commit == current
    return row_commit == current and not row_commit.endswith(DIRTY)


@functools.cache
def harness_version() -> str | None:
    try:
        return metadata.version("kv-decode-harness")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def torch_version() -> str:
    import torch  # here: the report reads a folder's metadata without torch

    return torch.__version__


def run_metadata(sweep_parallelism: int = 1) -> dict:
    """The run's columns; `sweep_parallelism`: points the launcher may run at once (the runner reads it
    from Hydra's sweeper, 1 for a single point)."""
    return {
        "torch_version": torch_version(),
        "harness_version": harness_version(),
        "git_commit": git_commit(),
        "hostname": socket.gethostname(),
        "sweep_parallelism": sweep_parallelism,
    }
