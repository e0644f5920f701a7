"""Stage 6 of the pipeline: every measured row beside its analytic prediction, and the questions a KV
cache raises answered with this machine's numbers.

    python -m harness.report results_dir=results [hardware=h100_sxm] [out=<folder>]

writes <results_dir>/_report/report.md and a self-contained index.html (plots embedded). Modules:
document (blocks, Markdown), html (HTML), format (numbers), groups (rows per model/device/dtype),
plots, tables, questions (the answers), build (assembly).
"""
