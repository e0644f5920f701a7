"""Stage 5 of the pipeline: what the rows mean. The analytic model (pure functions, no torch), device
roofs from datasheets and calibrations, reading a results folder with every row's prediction joined,
and the analytic CLI (`python -m harness.analysis`)."""
