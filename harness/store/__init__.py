"""Stage 4 of the pipeline: what lands on disk. The row schema (the one source of every column), row
files written whole or not at all, and calibration records."""
