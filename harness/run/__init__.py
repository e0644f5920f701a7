"""Stage 7 of the pipeline, the top: `python -m harness.run`, the Hydra app that turns a command line
into rows. It expands and checks the whole sweep first (plan), resolves each point once (resolve),
measures each in a process of its own (isolation, with the device's roofs from calibration), assembles
its row (row) and hands it to harness.store.

How one key travels, e.g. `batch=4`, from the command line to its column (five files):
1. harness/config/schema.py: `RunConfig.batch`, its type and its default; Hydra composes the override
   into the config and refuses a wrong type.
2. harness/config/validate.py: `validate_workload` refuses a value that is not a positive int64.
3. harness/run/resolve.py: `point_from_config` copies it into the frozen `Point` (harness/config/point.py),
   whose key hashes it.
4. harness/measure/decoding.py: `measure_point` builds the session for `point.batch` sequences and times
   its steps.
5. harness/run/row.py: `flatten(point)` makes it the `batch` column, typed by harness/store/columns.py.
"""
