"""Facts about the run that every row carries: when, where, with what code."""
from __future__ import annotations

import functools
import socket
import subprocess
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def git_commit() -> str | None:
    """HEAD of the harness checkout, suffixed +dirty when it had uncommitted changes; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


@functools.cache
def harness_version() -> str | None:
    try:
        return metadata.version("kv-decode-harness")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def torch_version() -> str:
    import torch

    return torch.__version__


def run_metadata() -> dict:
    return {
        "torch_version": torch_version(),
        "harness_version": harness_version(),
        "git_commit": git_commit(),
        "hostname": socket.gethostname(),
    }
