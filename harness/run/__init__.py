"""Stage 7 of the pipeline, the top: `python -m harness.run`, the Hydra app that turns a command line
into rows. It expands and checks the whole sweep first (plan), resolves each point once (resolve),
groups the points timed together (grouping), runs each group as one Hydra job (launch) that measures
it in a process of its own (execute, isolation, with the device's roofs from calibrate), assembles
each row (row) and hands it to harness.store; the groups are then judged against each other (windows).

How one key travels, e.g. `batch=4`, from the command line to its column:
1. `harness.config.schema.RunConfig`: the field `batch`, its type and its default; Hydra composes the
   override into the config and refuses a wrong type.
2. `harness.run.plan.plan`: every point of the sweep composed (`sweep_points`, `_plan_point`) before anything runs;
   `harness.config.validate.validate_sizes` refuses a value that is not a positive int64.
3. `harness.run.resolve.point_from_config`: copied into the frozen `harness.config.point.Point`, whose
   `key` hashes it (`harness.config.keys.keyed_fields`) and whose `group_key` groups it.
4. `harness.run.grouping.form_groups`: the points that share it (and everything but the strategy) are one group.
5. `harness.run.launch.run_jobs` -> one job per group (the Sweeper plugin, hydra_plugins/harness_sweeper/) ->
   `harness.run.execute.measure_planned_group` -> `harness.run.isolation.run_isolated` ->
   `harness.measure.group.measure_group`:
   in the group's own process, `harness.measure.member.Member.set_up` builds each member's session for
   `point.batch` sequences (`strategies.base.Strategy.new_session`), and the rounds time its steps.
6. `harness.run.row.build_row`: `flatten(point)` makes it the `batch` column, typed by
   `harness.store.columns.SCHEMA`; `harness.store.files.write_row` writes the row whole or not at all.
"""
