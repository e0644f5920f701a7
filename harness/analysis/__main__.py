"""`python -m harness.analysis key=value ...`: the analytic model's figures for one workload (harness.analysis.cli)."""
import sys

from harness.analysis.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
