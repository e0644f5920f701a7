"""kv-decode-harness. Importing it first sets how the process's OpenMP threads wait, before torch loads
its OpenMP runtime (harness.kernels.openmp): a group's process, forked from a server started with the
runner's environment, inherits it."""
import os

from harness.kernels.openmp import set_wait_policy

set_wait_policy(os.environ)
