"""The OpenMP wait policy the harness sets before torch loads libgomp (harness.kernels.openmp): set where
the user chose none, the user's kept, and inherited by the processes the runner starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.kernels.openmp import CHOSEN_BY_USER, SPIN_COUNT, SPIN_ENV, set_wait_policy
from tests.conftest import REPO_ROOT


def test_the_spin_is_set_where_the_user_chose_none():
    environ = {"PATH": "/bin"}
    set_wait_policy(environ)
    assert environ == {"PATH": "/bin", SPIN_ENV: str(SPIN_COUNT)}


@pytest.mark.parametrize("key,value", [("OMP_WAIT_POLICY", "PASSIVE"), ("OMP_WAIT_POLICY", "active"),
                                       ("GOMP_SPINCOUNT", "300000"), ("GOMP_SPINCOUNT", "infinite")])
def test_a_policy_the_user_chose_is_kept(key, value):
    environ = {key: value}
    set_wait_policy(environ)
    assert environ == {key: value}


def test_a_process_that_imports_the_harness_before_torch_starts_libgomp_with_it():
    """What the runner's group processes inherit: the setting is in the environment before torch loads
    libgomp (which reads it then), and a child process started afterwards gets it too."""
    env = {key: value for key, value in os.environ.items() if key not in CHOSEN_BY_USER}
    code = ("import harness, sys, subprocess; assert 'torch' not in sys.modules, 'torch came first'; import torch; "
            "print(subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"GOMP_SPINCOUNT\"])'], "
            "capture_output=True, text=True).stdout.strip())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-1000:]
    assert done.stdout.split() == [str(SPIN_COUNT)]
