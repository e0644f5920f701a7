"""`python -m harness.run`: the command-line entry point (the Hydra app lives in harness.run.app).

Kept to a few lines on purpose: each point's process re-imports the main module, and this one costs
nothing to import twice.
"""
import sys

from harness.run.app import main

if __name__ == "__main__":
    sys.exit(main())
