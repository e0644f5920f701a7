"""`python -m harness.analysis key=value ...`: the analytic model's figures for one point (harness.analysis.cli)."""
import os
import sys

from harness.analysis.cli import main

if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # `| head` closed the pipe: the reader has what it wanted, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit must not fail
        sys.exit(141)  # 128 + SIGPIPE, as a shell tool killed by the signal reports
