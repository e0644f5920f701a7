"""The harness's Sweeper plugin for Hydra (`hydra/sweeper=harness`, chosen by conf/config.yaml): a
multirun of `python -m harness.run` launches one job per group of points timed together, then one per
slow window measured again (group_sweeper.GroupSweeper).

`hydra_plugins` is Hydra's namespace for plugins (it has no `__init__.py`): Hydra imports every module
under it when it first looks for plugins, in any Hydra app of the environment, so nothing here imports
the harness at import time.
"""
