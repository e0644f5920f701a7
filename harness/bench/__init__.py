"""The performance gate: ratios of the benchmark suite (tests/benchmarks) to a control measured in the
same run, judged against a committed baseline (`python -m harness.bench run.json`)."""
