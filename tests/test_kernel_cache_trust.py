"""The kernels' cache checks whose it is, not only whether it is whole (harness/kernels/cache.py,
`trusted_folder`): a cache folder another user owns, or one other users can write, is never loaded
from; one line says so, and the kernels are built in a private folder instead. A cache that cannot be
used at all says so once, since `auto` then runs torch's kernels. Loads run in a subprocess, with a
copy of this machine's build standing in for the compiler (tests/test_kernel_cache.py's LOAD)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.kernels import cache, extension
from tests.conftest import REPO_ROOT
from tests.test_kernel_cache import LOAD, NAME, answer, good_build, planted  # noqa: F401 (good_build: a fixture)

pytestmark = pytest.mark.skipif(extension.EXTENSION.unavailable() is not None,
                                reason=f"the kernels cannot be built here: {extension.EXTENSION.unavailable()}")


def load_with_tmp(folder: Path, good: Path, tmp: Path):
    """The kernels loaded in a subprocess from the cache `folder`, its temporary folder `tmp` (where a
    private cache goes)."""
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), extension.CACHE_ENV: str(folder), "TMPDIR": str(tmp)}
    done = subprocess.run([sys.executable, "-c", LOAD, str(good), "30"], env=env, capture_output=True, text=True,
                          timeout=120)
    return answer(done)


def other_uid() -> int:
    return 4242 if os.geteuid() != 4242 else 4243


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "another user's"])
def test_a_cache_others_could_write_is_never_loaded_from(good_build, tmp_path, how):
    shared = tmp_path / "shared"
    shared.mkdir()
    planted(shared, good_build)  # a build anyone could have put there, stamp and all
    if how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("only root can give a folder to another user")
        os.chown(shared, other_uid(), -1)
    else:
        shared.chmod(0o777 if how == "world-writable" else 0o775)
    said, lines = load_with_tmp(shared, good_build, tmp_path / "tmp")
    private = tmp_path / "tmp" / cache.PRIVATE_NAME.format(uid=os.geteuid())
    assert said == {"reason": None, "mapped": [str(private / NAME / extension.LIBRARY)]}
    assert len(lines) == 1 and str(shared) in lines[0] and str(private) in lines[0], lines
    assert ("owned by another user" if how == "another user's" else "writable by other users") in lines[0]
    assert oct(private.stat().st_mode & 0o777) == "0o700"


def test_a_private_folder_someone_else_made_first_is_not_used_either(good_build, tmp_path):
    shared, tmp = tmp_path / "shared", tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o777)
    squatted = tmp / cache.PRIVATE_NAME.format(uid=os.geteuid())
    squatted.mkdir(parents=True)
    squatted.chmod(0o777)
    said, lines = load_with_tmp(shared, good_build, tmp)
    built_in = Path(said["mapped"][0]).parents[1]  # <cache>/<build>/<library>
    assert said["reason"] is None and built_in != squatted and built_in.parent == tmp, said
    assert built_in.name.startswith("decode-harness-kernels-") and len(lines) == 1


def test_an_own_cache_is_trusted(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir(mode=0o755)
    assert cache.untrusted(folder) is None and cache.trusted_folder(folder) == folder
    assert cache.untrusted(tmp_path / "not yet") is None  # made by this user when needed


def test_an_unusable_cache_is_said_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cache, "_told", [])
    (tmp_path / "cache").write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="harness"):
        for _ in range(3):
            with pytest.raises(RuntimeError):
                cache.usable_folder(tmp_path / "cache")
    said = [r.getMessage() for r in caplog.records if r.name == "harness"]
    assert len(said) == 1 and "`auto` runs torch's kernels" in said[0] and str(tmp_path / "cache") in said[0]
