"""`python -m harness.report results_dir=<dir>[,<dir>...] [hardware=<datasheet>] [out=<folder>] [baseline=<dir>]`.

results_dir: one folder, or several separated by commas, read as one table (rows of several hosts or
GPU types: the report draws each device apart, with its own roofs).

hardware: the datasheet for rows with no calibration and no datasheet matching their device name.
results_dir must be a folder and out (default <results_dir>/_report) a folder that can be written,
checked as the runner checks its results_dir (harness.config.validate) before anything is written.
baseline: another results folder (a readable one, checked as results_dir is); the report then compares
this run with it point by point (harness.report.compare).
Each value may hold interpolations, resolved as the runner's are (`out=${oc.env:HOME}/report`); one
that does not resolve is bad input. Bad input, or a fault while writing (a full disk), prints one line and exits 2; Ctrl-C exits 130.
"""
from __future__ import annotations

import sys

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.config.validate import ConfigError, interpolations_resolve
from harness.report.assemble import ReportError, build_report
from harness.analysis.results import DEFAULT_FALLBACK_HARDWARE

KEYS = {"results_dir": "results", "hardware": DEFAULT_FALLBACK_HARDWARE, "out": None, "baseline": None}


def parse(argv: list[str]) -> dict:
    options = dict(KEYS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in KEYS:
            raise ReportError(f"{arg}: expected key=value with key one of {', '.join(KEYS)}")
        options[key] = value
    return resolved(options)


def resolved(options: dict) -> dict:
    """The options with their interpolations resolved as the runner resolves its own
    (`out=${oc.env:HOME}/report`, `out=${results_dir}/summary`): ReportError naming the key whose
    `${...}` does not resolve, or cannot be parsed."""
    try:
        cfg = OmegaConf.create(options)
        interpolations_resolve(cfg)
    except ConfigError as error:
        raise ReportError(str(error)) from None
    except OmegaConfBaseException as error:  # a `${` OmegaConf cannot parse
        raise ReportError(f"{error.full_key}: {options[error.full_key]!r} is not an interpolation OmegaConf can "
                          f"parse ({str(error).strip().splitlines()[0]}); write '\\${{' for a literal '${{'") from None
    return OmegaConf.to_container(cfg, resolve=True)


def main(argv: list[str]) -> int:
    try:
        options = parse(argv)
        folders = options["results_dir"].split(",") if "," in options["results_dir"] else options["results_dir"]
        files = build_report(folders, options["hardware"], options["out"],
                             options["baseline"])
    except ReportError as error:
        print(error, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: report.md and index.html are each whole (this report's or the previous one)",
              file=sys.stderr)
        return 130
    print(f"wrote {files.markdown} and {files.html} ({len(files.figures)} plots)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
