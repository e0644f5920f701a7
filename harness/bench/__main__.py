"""`python -m harness.bench run.json [...]`: the performance gate (harness.bench.gate)."""
import sys

from harness.bench.gate import main

if __name__ == "__main__":
    sys.exit(main())
