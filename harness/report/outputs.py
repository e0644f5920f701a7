"""Where a report may write, the files it writes there, and the only ones it removes.

A report's folder may hold files that are not the report's (`out=` names any folder): the report removes
only files it wrote, named in a manifest beside them (MANIFEST). Each name goes into the manifest before
its file is written (`claim`, appended: the forked worker that draws the plots claims its own), so a
report killed at any moment has named every file it wrote; nothing is removed before the new report.md,
rows.csv and index.html are whole, and then only what the manifest names that this report did not write
(the plots of cohorts now gone, a previous report's temporaries), and the manifest is rewritten with this
report's files alone (`finish`). A folder in which the report's files would be read as rows is refused
(`refuse_results_folder`): a results folder itself, or a folder inside one that the readers do not skip.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

from harness.config.validate import ConfigError
from harness.files import write_whole

MANIFEST = ".report-files"  # in the report's folder: the names of the files the report wrote there, a line each
SKIPPED_PREFIXES = ("_", ".")  # names the row readers never read (harness.analysis.row_files.row_paths)


def refuse_results_folder(key: str, folder: Path, results_folders: list[Path]) -> None:
    """ConfigError on `key` when the report's files in `folder` would be read beside rows: `folder` is one
    of `results_folders`, lies in one under a name the readers read (a report there would be listed as a
    stray folder, and pandas.read_parquet of the results folder fails on it), or holds row files itself."""
    where = folder.resolve()
    for results in results_folders:
        results = results.resolve()
        if where == results or (where.is_relative_to(results)
                                and not where.relative_to(results).parts[0].startswith(SKIPPED_PREFIXES)):
            inside = "is" if where == results else "lies in"
            raise ConfigError(key, f"'{folder}' {inside} the results folder '{results}', where the report's files "
                                   "would be read beside its rows; name a folder outside it, or one in it whose name "
                                   f"starts with '_' (the default: '{results / '_report'}')")
    if where.is_dir() and any(path.suffix == ".parquet" and not path.name.startswith(SKIPPED_PREFIXES)
                              for path in where.iterdir()):
        raise ConfigError(key, f"'{folder}' holds row files (*.parquet): a results folder, where the report's files "
                               "would be read beside its rows; name another folder")


class Outputs:
    """The report's files in one folder: the ones a previous report wrote there, the ones this one claims."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.previous = _named(folder)  # what earlier reports wrote and did not remove

    def finish(self, written: list[Path]) -> list[Path]:
        """Once this report's files are whole: remove the files earlier reports (or a killed run of this one)
        wrote here that this one did not, and their temporaries; the manifest then names this report's
        files alone. Returns the files removed."""
        keep = {path.name for path in written}
        removed = []
        for name in sorted((self.previous | _named(self.folder)) - keep):
            path = self.folder / name
            try:
                if path.is_file() or path.is_symlink():
                    path.unlink()
                    removed.append(path)
            except OSError:  # a name no file can have (too long): nothing to remove
                continue
        for name in keep | self.previous:  # temporaries of a report killed while it wrote one of its files
            for temporary in self.folder.glob(f".{glob.escape(name)}.tmp-*"):
                if not _running(temporary.name.rpartition("-")[2]):
                    temporary.unlink(missing_ok=True)
        write_whole(self.folder / MANIFEST, "".join(f"{name}\n" for name in sorted(keep)))
        return removed


def claim(path: Path) -> None:
    """Append `path`'s name to the manifest of its folder (harness.report.figures.save claims each plot)."""
    with open(path.parent / MANIFEST, "a") as manifest:  # one short append: whole even beside another writer's
        manifest.write(f"{path.name}\n")


def _named(folder: Path) -> set[str]:
    """The file names the folder's manifest holds: plain names only (a line naming another folder's file,
    or a hidden one, is not the report's)."""
    try:
        lines = (folder / MANIFEST).read_text(errors="replace").splitlines()
    except OSError:  # none yet: a folder no report has written to
        return set()
    return {line for line in lines if line and line == Path(line).name and not line.startswith(".")}


def _running(pid: str) -> bool:
    """Whether the process that owns a temporary (by the pid in its name) still runs."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
